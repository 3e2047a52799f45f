// A tensor as it crosses the Python/C++ boundary, and the element types the module knows.
//
// Python describes every tensor argument with one TensorRef (tp_kernels/_extension.py builds
// them, in one place): where its memory is, its shape and strides in elements, its dtype by name
// and its device. The module owns nothing a TensorRef points to. Every entry point checks its
// TensorRefs once (boundary.h) and raises ArgumentError naming the argument, before any CUDA call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tp_kernels {

// Element types. The table in tensor.cpp holds each one's name (torch's, without "torch.") and
// size, and whether the GEMMs take it; the Python side reads the names from _C.DTYPES.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kUInt8 = 3 };

// Bytes per element of `t`.
size_t dtype_size(DType t);
// "float32", "float16", "bfloat16", "uint8".
const char* dtype_name(DType t);
// The dtypes the GEMMs and reductions compute in, by name, in the table's order.
std::vector<std::string> compute_dtype_names();
// The dtype called `name`; throws ArgumentError naming `arg` when there is none.
DType parse_dtype(const std::string& name, const std::string& arg);

struct TensorRef {
  std::string name;              // the argument's name, for messages ("x", "weight", "inputs[2]")
  uintptr_t data = 0;            // address of element [0, ..., 0]; may be 0 when numel() == 0
  std::vector<int64_t> shape;    // elements
  std::vector<int64_t> strides;  // elements
  DType dtype = DType::kFloat32;
  int device = -1;               // CUDA device ordinal; -1: host memory

  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
  void* ptr() const { return reinterpret_cast<void*>(data); }
  // "[4, 8] bfloat16 on cuda:0" (or "on the host").
  std::string describe() const;
};

// A TensorRef from what Python passes; checks that shape and strides have one entry per
// dimension and that sizes are not negative (ArgumentError naming `name`).
TensorRef make_tensor_ref(std::string name, uintptr_t data, std::vector<int64_t> shape, std::vector<int64_t> strides,
                          const std::string& dtype, int device);

}  // namespace tp_kernels
