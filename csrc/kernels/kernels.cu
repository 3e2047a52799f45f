// The device code of tp_kernels._C: the bounded flag wait and the deterministic reduction of the
// peer-memory path (device_ops.h says what each does). Compiled at build time by NVRTC
// (_build/compile_kernels.py) into a cubin per architecture and a PTX, which driver.cpp loads and
// launches by the extern "C" names below (driver.h's kernel list).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tp_kernels/kernel_params.h"

namespace {

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Each element is summed by one thread, q = 0..p-1 in order: the result is the same bits for
// every launch configuration and chunking.
template <typename T>
__device__ __forceinline__ void reduce_partials(const tp_kernels::PartialPtrs& ptrs, int p, void* out_, long long count) {
  T* out = static_cast<T*>(out_);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = to_float(static_cast<const T*>(ptrs.in[0])[i]);
    for (int q = 1; q < p; ++q) acc += to_float(static_cast<const T*>(ptrs.in[q])[i]);
    out[i] = from_float<T>(acc);
  }
}

}  // namespace

// Thread i waits for flag i and clears it; past timeout_ns it records code i in *error_word (if
// still 0) and returns; a flag set to another value than expect[i] (when that is not 0) records
// code i | kMismatchBit. Once the error word is set, every wait returns at once.
extern "C" __global__ void tpk_wait_flags(tp_kernels::FlagList list, int count, unsigned long long timeout_ns,
                                          unsigned int* error_word) {
  const int i = threadIdx.x;
  if (i >= count) return;
  volatile unsigned int* flag = list.flag[i];
  volatile unsigned int* error = error_word;
  const unsigned long long start = global_timer_ns();
  unsigned int seen;
  while ((seen = *flag) == 0) {
    if (*error != 0) return;  // an earlier wait failed: drain the stream
    if (global_timer_ns() - start > timeout_ns) {
      atomicCAS(error_word, 0u, list.code[i]);
      __threadfence_system();
      return;
    }
    __nanosleep(256);
  }
  *flag = 0;
  if (list.expect[i] != 0 && seen != list.expect[i])
    atomicCAS(error_word, 0u, list.code[i] | tp_kernels::kMismatchBit);
  __threadfence_system();  // the clear (and an error) is visible before anything this stream does next
}

// Thread i writes value[i] to flag[i] (a peer's word, or this rank's), after a system-wide fence:
// one launch for the p - 1 flags a rank sets, where one stream write each would be p - 1
// operations. What the stream did before this kernel is complete (stream order), so a peer that
// sees the flag sees it too.
extern "C" __global__ void tpk_set_flags(tp_kernels::FlagWrites list, int count) {
  const int i = threadIdx.x;
  if (i >= count) return;
  __threadfence_system();
  *static_cast<volatile unsigned int*>(list.flag[i]) = list.value[i];
  __threadfence_system();
}

extern "C" __global__ void tpk_reduce_partials_float32(tp_kernels::PartialPtrs ptrs, int p, void* out, long long count) {
  reduce_partials<float>(ptrs, p, out, count);
}

extern "C" __global__ void tpk_reduce_partials_float16(tp_kernels::PartialPtrs ptrs, int p, void* out, long long count) {
  reduce_partials<__half>(ptrs, p, out, count);
}

extern "C" __global__ void tpk_reduce_partials_bfloat16(tp_kernels::PartialPtrs ptrs, int p, void* out,
                                                        long long count) {
  reduce_partials<__nv_bfloat16>(ptrs, p, out, count);
}
