// Helpers shared by the pipelined (overlap.cpp) and fused (fused.cpp) primitives; internal.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "tp_kernels/check.h"
#include "tp_kernels/device_guard.h"
#include "tp_kernels/gemm.h"
#include "tp_kernels/overlap.h"

namespace tp_kernels {
namespace detail {

// Element `row * width` of a row-major buffer of `dtype`.
template <typename T>
T* row_ptr(T* base, int64_t row, int64_t width, DType dtype) {
  using Byte = typename std::conditional<std::is_const<T>::value, const char, char>::type;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + row * width * static_cast<int64_t>(dtype_size(dtype)));
}

// Where a GEMM runs: a stream, and the cuBLASLt workspace that only GEMMs on that stream use.
struct Lane {
  cudaStream_t stream;
  void* workspace;
  size_t workspace_bytes;
};

inline Lane main_lane(const OverlapArgs& a) { return {a.stream, a.workspace, a.workspace_bytes}; }

// `rows` rows of x (ldx = k) times W^T into y (ldy = n) on `lane`, as a batch when batch > 1.
inline void gemm(const OverlapArgs& a, const Lane& lane, const void* x, void* y, int64_t rows, const void* bias,
                 int64_t batch = 1, int64_t stride_x = 0, int64_t stride_y = 0) {
  LinearArgs g;
  g.x = x;
  g.w = a.w;
  g.bias = bias;
  g.y = y;
  g.m = rows, g.n = a.n, g.k = a.k;
  g.ldx = a.k, g.ldw = a.ldw, g.ldy = a.n;
  g.w_col_major = a.w_col_major;
  g.batch = batch, g.stride_x = stride_x, g.stride_y = stride_y;
  g.dtype = a.dtype;
  g.workspace = lane.workspace;
  g.workspace_bytes = lane.workspace_bytes;
  g.stream = lane.stream;
  linear(g);
}

// The same on args.stream with its workspace.
inline void gemm(const OverlapArgs& a, const void* x, void* y, int64_t rows, const void* bias, int64_t batch = 1,
                 int64_t stride_x = 0, int64_t stride_y = 0) {
  gemm(a, main_lane(a), x, y, rows, bias, batch, stride_x, stride_y);
}

// Work enqueued on `to` from now on runs after the work enqueued on `from` so far (event `e`).
inline void order(cudaStream_t from, cudaStream_t to, cudaEvent_t e) {
  TPK_CHECK_CUDA(cudaEventRecord(e, from));
  TPK_CHECK_CUDA(cudaStreamWaitEvent(to, e, 0));
}

// NCCL's name of `t` (every dtype of the table has one).
inline ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kUInt8: return ncclUint8;
  }
  throw Error(std::string("no NCCL type for ") + dtype_name(t));
}

inline std::string shape(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

}  // namespace detail
}  // namespace tp_kernels
