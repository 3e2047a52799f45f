// What the native module was built against and what it finds at run time.
#pragma once

#include <string>

namespace tp_kernels {

struct RuntimeInfo {
  int cuda_runtime_version = 0;   // cudaRuntimeGetVersion: the (static) runtime linked in
  int cuda_driver_version = 0;    // cudaDriverGetVersion: 0 when no driver is installed
  int nccl_version = 0;           // ncclGetVersion of the libnccl.so.2 loaded
  long cublaslt_version = 0;      // cublasLtGetVersion of the libcublasLt.so.13 loaded
  int device_count = 0;           // CUDA devices usable by this process
  std::string device_error;       // why device_count is 0, empty otherwise
};

// Never throws for "no driver" or "no device": those are reported in device_error.
RuntimeInfo query_runtime_info();

}  // namespace tp_kernels
