// Flags for the fused path: stream memory operations through the driver entry points, and the
// bounded wait kernel. See device_ops.h.
#include <cuda.h>  // types only: entry points are looked up at run time, libcuda is not linked

#include <mutex>
#include <string>

#include "tp_kernels/check.h"
#include "tp_kernels/device_ops.h"

namespace tp_kernels {
namespace {

using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct DriverOps {
  WriteValue32 write = nullptr;
  std::string error;
};

const DriverOps& driver_ops() {
  static DriverOps ops;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult status{};
    void* fn = nullptr;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &status);
    if (err == cudaSuccess && status == cudaDriverEntryPointSuccess) ops.write = reinterpret_cast<WriteValue32>(fn);
    if (ops.write == nullptr) {
      ops.error = std::string("the driver does not provide cuStreamWriteValue32 (") + cudaGetErrorString(err) + ")";
      cudaGetLastError();
    }
  });
  return ops;
}

void check_driver(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS)
    throw Error(std::string(call) + " failed: CUDA driver error " + std::to_string(static_cast<int>(r)));
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct FlagList {
  uint32_t* flag[kMaxRanks];
  uint32_t code[kMaxRanks];
};

// Thread i waits for flag i and clears it.
__global__ void wait_flags_kernel(FlagList list, int count, uint64_t timeout_ns, uint32_t* error_word) {
  const int i = threadIdx.x;
  if (i >= count) return;
  volatile uint32_t* flag = list.flag[i];
  volatile uint32_t* error = error_word;
  const uint64_t start = global_timer_ns();
  while (*flag == 0) {
    if (*error != 0) return;  // an earlier wait failed: drain the stream
    if (global_timer_ns() - start > timeout_ns) {
      atomicCAS(error_word, 0u, list.code[i]);
      __threadfence_system();
      return;
    }
    __nanosleep(256);
  }
  *flag = 0;
  __threadfence_system();  // the clear is visible before anything this stream does next
}

}  // namespace

bool stream_memory_ops_available() { return driver_ops().error.empty(); }

void write_flag(uint32_t* flag, uint32_t value, cudaStream_t stream) {
  const DriverOps& ops = driver_ops();
  if (!ops.error.empty()) throw Error("write_flag: " + ops.error);
  check_driver(ops.write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(flag), value,
                         CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue32");
}

void wait_flags(uint32_t* const* flags, const uint32_t* codes, int count, uint64_t timeout_ns, uint32_t* error_word,
                cudaStream_t stream) {
  if (count < 0 || count > kMaxRanks)
    throw ArgumentError("flags: wait_flags takes 0 to " + std::to_string(kMaxRanks) + " flags, got " +
                        std::to_string(count));
  if (error_word == nullptr) throw ArgumentError("error_word: wait_flags got a null error word");
  FlagList list{};
  for (int i = 0; i < count; ++i) {
    if (flags[i] == nullptr) throw ArgumentError("flags: wait_flags got a null flag " + std::to_string(i));
    if (codes[i] == 0) throw ArgumentError("codes: wait_flags' error code " + std::to_string(i) + " must be nonzero");
    list.flag[i] = flags[i];
    list.code[i] = codes[i];
  }
  if (count == 0) return;
  wait_flags_kernel<<<1, 32, 0, stream>>>(list, count, timeout_ns, error_word);
  TPK_CHECK_CUDA(cudaGetLastError());
}

}  // namespace tp_kernels
