// Deterministic sum of p partial buffers (fixed rank order, fp32 accumulation). See device_ops.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "tp_kernels/check.h"
#include "tp_kernels/device_ops.h"

namespace tp_kernels {
namespace {

template <typename T>
struct Ptrs {
  const T* in[kMaxRanks];
};

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
__global__ void reduce_partials_kernel(Ptrs<T> ptrs, int p, T* out, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = to_float(ptrs.in[0][i]);
    for (int q = 1; q < p; ++q) acc += to_float(ptrs.in[q][i]);
    out[i] = from_float<T>(acc);
  }
}

template <typename T>
void launch(const void* const* in, int p, void* out, int64_t count, cudaStream_t stream) {
  Ptrs<T> ptrs{};
  for (int q = 0; q < p; ++q) ptrs.in[q] = static_cast<const T*>(in[q]);
  const int threads = 256;
  int device = 0, sms = 0;
  TPK_CHECK_CUDA(cudaGetDevice(&device));
  TPK_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int64_t blocks = (count + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  if (blocks > cap) blocks = cap;
  reduce_partials_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(ptrs, p, static_cast<T*>(out),
                                                                                   count);
  TPK_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void reduce_partials(const void* const* in, int p, void* out, int64_t count, DType dtype, cudaStream_t stream) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat32: return launch<float>(in, p, out, count, stream);
    case DType::kFloat16: return launch<__half>(in, p, out, count, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(in, p, out, count, stream);
    default: break;
  }
  throw Error(std::string("reduce_partials: no reduction in ") + dtype_name(dtype));
}

}  // namespace tp_kernels
