// The dtype table and TensorRef (tensor.h).
#include "tp_kernels/tensor.h"

#include <sstream>

#include "tp_kernels/check.h"

namespace tp_kernels {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
  bool compute;  // the GEMMs and reductions take it
};

// The one list of element types (Python reads the compute ones' names from _C.DTYPES).
constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, "float32", 4, true},
    {DType::kFloat16, "float16", 2, true},
    {DType::kBFloat16, "bfloat16", 2, true},
    {DType::kUInt8, "uint8", 1, false},
};

const DTypeInfo& info(DType t) {
  for (const DTypeInfo& i : kDTypes)
    if (i.dtype == t) return i;
  throw Error("unknown dtype code " + std::to_string(static_cast<int>(t)));
}

}  // namespace

size_t dtype_size(DType t) { return info(t).size; }

const char* dtype_name(DType t) { return info(t).name; }

std::vector<std::string> compute_dtype_names() {
  std::vector<std::string> out;
  for (const DTypeInfo& i : kDTypes)
    if (i.compute) out.emplace_back(i.name);
  return out;
}

DType parse_dtype(const std::string& name, const std::string& arg) {
  for (const DTypeInfo& i : kDTypes)
    if (name == i.name) return i.dtype;
  std::string known;
  for (const DTypeInfo& i : kDTypes) known += std::string(known.empty() ? "" : ", ") + i.name;
  throw ArgumentError(arg + ": unknown dtype '" + name + "' (known: " + known + ")");
}

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string TensorRef::describe() const {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "] " << dtype_name(dtype);
  if (device >= 0)
    out << " on cuda:" << device;
  else
    out << " on the host";
  return out.str();
}

TensorRef make_tensor_ref(std::string name, uintptr_t data, std::vector<int64_t> shape, std::vector<int64_t> strides,
                          const std::string& dtype, int device) {
  if (shape.size() != strides.size())
    throw ArgumentError(name + ": " + std::to_string(shape.size()) + " sizes but " + std::to_string(strides.size()) +
                        " strides");
  for (int64_t s : shape)
    if (s < 0) throw ArgumentError(name + ": negative size");
  if (device < -1) throw ArgumentError(name + ": device must be a CUDA ordinal or -1 (host), got " + std::to_string(device));
  TensorRef t;
  t.dtype = parse_dtype(dtype, name);
  t.name = std::move(name);
  t.data = data;
  t.shape = std::move(shape);
  t.strides = std::move(strides);
  t.device = device;
  return t;
}

}  // namespace tp_kernels
