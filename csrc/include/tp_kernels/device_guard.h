// DeviceGuard: a device made current for a scope, the previous one restored after.
//
// The primitives, the collectives and the GEMM make the device of what they were given current
// themselves (the group's communicator or peer context, the GEMM's input), so a caller never has
// to, and a call never runs on whatever device happened to be current. When that device is
// already current, the usual case, the guard costs one cudaGetDevice. (The device building blocks
// of device_ops.h, which take bare addresses, run on the current device.)
#pragma once

#include <cuda_runtime_api.h>

#include "tp_kernels/check.h"

namespace tp_kernels {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    TPK_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) {
      TPK_CHECK_CUDA(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace tp_kernels
