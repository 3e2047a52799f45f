#include "tp_kernels/runtime_info.h"

#include "tp_kernels/check.h"

namespace tp_kernels {

RuntimeInfo query_runtime_info() {
  RuntimeInfo info;
  TPK_CHECK_CUDA(cudaRuntimeGetVersion(&info.cuda_runtime_version));
  TPK_CHECK_CUDA(cudaDriverGetVersion(&info.cuda_driver_version));  // 0 without a driver
  TPK_CHECK_NCCL(ncclGetVersion(&info.nccl_version));
  info.cublaslt_version = static_cast<long>(cublasLtGetVersion());
  cudaError_t err = cudaGetDeviceCount(&info.device_count);
  if (err != cudaSuccess) {
    info.device_count = 0;
    info.device_error = std::string(info.cuda_driver_version == 0 ? "no CUDA driver is installed; " : "") +
                        cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // reset the runtime's last-error state so later calls start clean
  } else if (info.device_count == 0) {
    info.device_error = "no CUDA device is visible";
  }
  return info;
}

}  // namespace tp_kernels
