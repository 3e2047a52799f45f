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
using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct DriverOps {
  WriteValue32 write = nullptr;
  WaitValue32 wait = nullptr;
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
    fn = nullptr;
    err = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &status);
    if (err == cudaSuccess && status == cudaDriverEntryPointSuccess) ops.wait = reinterpret_cast<WaitValue32>(fn);
    if (ops.write == nullptr || ops.wait == nullptr) {
      ops.error = std::string("the driver does not provide cuStreamWriteValue32/cuStreamWaitValue32 (") +
                  cudaGetErrorString(err) + ")";
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

__global__ void wait_flag_kernel(const volatile uint32_t* flag, uint32_t value, uint64_t timeout_ns,
                                 uint32_t* error_word, uint32_t error_code) {
  const uint64_t start = global_timer_ns();
  while (static_cast<int32_t>(*flag - value) < 0) {
    if (global_timer_ns() - start > timeout_ns) {
      atomicCAS(error_word, 0u, error_code);
      __threadfence_system();
      return;
    }
    __nanosleep(200);
  }
  __threadfence();  // what the writer published before the flag is visible after the wait
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

void wait_flag_unbounded(const uint32_t* flag, uint32_t value, cudaStream_t stream) {
  const DriverOps& ops = driver_ops();
  if (!ops.error.empty()) throw Error("wait_flag_unbounded: " + ops.error);
  check_driver(ops.wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(flag), value,
                        CU_STREAM_WAIT_VALUE_GEQ),
               "cuStreamWaitValue32");
}

void wait_flag_bounded(const uint32_t* flag, uint32_t value, uint64_t timeout_ns, uint32_t* error_word,
                       uint32_t error_code, cudaStream_t stream) {
  if (flag == nullptr || error_word == nullptr) throw Error("wait_flag_bounded: null flag or error word");
  if (error_code == 0) throw Error("wait_flag_bounded: error_code must be nonzero");
  wait_flag_kernel<<<1, 1, 0, stream>>>(flag, value, timeout_ns, error_word, error_code);
  TPK_CHECK_CUDA(cudaGetLastError());
}

}  // namespace tp_kernels
