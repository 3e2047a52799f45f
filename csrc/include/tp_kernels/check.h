// Error checks for every CUDA runtime, NCCL and cuBLASLt call.
//
// Each macro evaluates the call once and, on failure, throws tp_kernels::Error carrying the call's
// text, the numeric code and the library's description of it, e.g.
//   "ncclCommInitRank(&comm, p, id, r) failed: NCCL error 2 (unhandled system error) at comm.cpp:41"
// The Python bindings turn tp_kernels::Error into RuntimeError, and ArgumentError (a bad argument,
// found before any CUDA call: boundary.h) into ValueError.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace tp_kernels {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An argument the caller passed is wrong; the message starts with the argument's name.
class ArgumentError : public Error {
 public:
  using Error::Error;
};

// The index of `name` in `names` (an enum's name table), or an ArgumentError naming `arg` and
// listing the names.
template <size_t N>
int parse_name(const char* const (&names)[N], const std::string& name, const std::string& arg) {
  std::string known;
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<int>(i);
    known += std::string(i ? ", " : "") + names[i];
  }
  throw ArgumentError(arg + ": expected one of " + known + ", got '" + name + "'");
}

[[noreturn]] inline void fail(const char* call, const char* lib, long code, const char* meaning,
                              const char* file, int line) {
  throw Error(std::string(call) + " failed: " + lib + " error " + std::to_string(code) + " (" +
              meaning + ") at " + file + ":" + std::to_string(line));
}

inline const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUBLAS_STATUS_MAPPING_ERROR: return "mapping error";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "internal error";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "license error";
    default: return "unknown cuBLAS status";
  }
}

}  // namespace tp_kernels

#define TPK_CHECK_CUDA(call)                                                                      \
  do {                                                                                            \
    cudaError_t tpk_err_ = (call);                                                                \
    if (tpk_err_ != cudaSuccess)                                                                  \
      ::tp_kernels::fail(#call, "CUDA", static_cast<long>(tpk_err_), cudaGetErrorString(tpk_err_), \
                         __FILE__, __LINE__);                                                     \
  } while (0)

#define TPK_CHECK_NCCL(call)                                                                      \
  do {                                                                                            \
    ncclResult_t tpk_err_ = (call);                                                               \
    if (tpk_err_ != ncclSuccess)                                                                  \
      ::tp_kernels::fail(#call, "NCCL", static_cast<long>(tpk_err_), ncclGetErrorString(tpk_err_), \
                         __FILE__, __LINE__);                                                     \
  } while (0)

#define TPK_CHECK_CUBLAS(call)                                                                    \
  do {                                                                                            \
    cublasStatus_t tpk_err_ = (call);                                                             \
    if (tpk_err_ != CUBLAS_STATUS_SUCCESS)                                                        \
      ::tp_kernels::fail(#call, "cuBLAS", static_cast<long>(tpk_err_),                            \
                         ::tp_kernels::cublas_status_name(tpk_err_), __FILE__, __LINE__);         \
  } while (0)
