// The checks of what crosses the Python/C++ boundary (boundary.h). No CUDA call in this file.
#include "tp_kernels/boundary.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "tp_kernels/check.h"

namespace tp_kernels {
namespace {

std::string dims(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

[[noreturn]] void fail(const TensorRef& t, const std::string& expected) {
  throw ArgumentError(t.name + ": expected " + expected + ", got " + t.describe());
}

void require_dim(const TensorRef& t, int64_t d) {
  if (t.dim() != d) fail(t, "a " + std::to_string(d) + "-D tensor");
}

void require_shape(const TensorRef& t, const std::vector<int64_t>& shape, const std::string& why = "") {
  if (t.shape != shape) fail(t, dims(shape) + why);
}

// On a CUDA device: `device`, or any when device < 0.
void require_cuda(const TensorRef& t, int device) {
  if (t.device < 0) fail(t, "a CUDA tensor");
  if (device >= 0 && t.device != device) fail(t, "a tensor on cuda:" + std::to_string(device));
}

void require_compute_dtype(const TensorRef& t) {
  std::vector<std::string> names = compute_dtype_names();
  if (std::find(names.begin(), names.end(), dtype_name(t.dtype)) == names.end()) {
    std::string known;
    for (const std::string& n : names) known += (known.empty() ? "" : ", ") + n;
    fail(t, "dtype " + known);
  }
}

// The dtype and device of `like` (the argument everything is compared with).
void require_like(const TensorRef& t, const TensorRef& like) {
  if (t.dtype != like.dtype || t.device != like.device)
    fail(t, std::string(dtype_name(like.dtype)) + " on the device of " + like.name + " (" + like.describe() + ")");
}

void require_data(const TensorRef& t) {
  if (t.data == 0 && t.numel() > 0) fail(t, "a non-null data pointer");
}

// Row-major; an empty tensor's strides are any (nothing is stored: torch calls it contiguous).
void require_contiguous(const TensorRef& t) {
  if (t.numel() > 0) {
    int64_t expected = 1;
    for (int64_t i = t.dim() - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != expected)
        fail(t, "a contiguous tensor (strides " + dims(t.strides) + ")");
      expected *= t.shape[i];
    }
  }
  require_data(t);
}

// The leading dimension of the 2-D matrix made of dims (d, d + 1) of `t`, whose last dim must be
// contiguous: the row stride, or the row length when there is at most one row or `t` is empty
// (its strides are any).
int64_t row_stride(const TensorRef& t, int64_t d) {
  const int64_t rows = t.shape[d], cols = t.shape[d + 1];
  if (t.numel() == 0) return std::max<int64_t>(1, cols);
  if (cols > 1 && t.strides[d + 1] != 1) fail(t, "a contiguous last dim (strides " + dims(t.strides) + ")");
  if (rows <= 1) return std::max<int64_t>(1, cols);
  if (t.strides[d] < std::max<int64_t>(1, cols)) fail(t, "rows that do not overlap (strides " + dims(t.strides) + ")");
  return t.strides[d];
}

// (leading dimension, column-major?) of weight [n, k] as the GEMM takes it (gemm.h): row-major
// (last dim contiguous, rows at least k apart) first, else column-major; an empty one row-major,
// whatever its strides.
std::pair<int64_t, bool> weight_layout(const TensorRef& w) {
  const int64_t n = w.shape[0], k = w.shape[1];
  if (w.numel() == 0) return {std::max<int64_t>(1, k), false};
  if ((k <= 1 || w.strides[1] == 1) && (n <= 1 || w.strides[0] >= std::max<int64_t>(1, k)))
    return {n <= 1 ? std::max<int64_t>(1, k) : w.strides[0], false};
  if ((n <= 1 || w.strides[0] == 1) && (k <= 1 || w.strides[1] >= std::max<int64_t>(1, n)))
    return {k <= 1 ? std::max<int64_t>(1, n) : w.strides[1], true};
  fail(w, "a row-major or column-major weight (strides " + dims(w.strides) + ")");
}

void require_weight(const TensorRef& w, const TensorRef& x, int64_t k) {
  require_dim(w, 2);
  require_like(w, x);
  if (w.shape[1] != k) fail(w, "[n, " + std::to_string(k) + "] to match " + x.name + " " + dims(x.shape));
  require_data(w);
}

void require_bias(const TensorRef& b, const TensorRef& x, int64_t n) {
  require_like(b, x);
  require_shape(b, {n});
  require_contiguous(b);
}

// A cuBLASLt workspace: uint8 bytes on `device` (called `device_name` in the error).
void require_workspace(const TensorRef& ws, int device, const std::string& device_name) {
  require_dim(ws, 1);
  if (ws.dtype != DType::kUInt8 || ws.device != device) fail(ws, "uint8 bytes on " + device_name);
  require_contiguous(ws);
}

void require_workspace(const TensorRef& ws, const TensorRef& x) {
  require_workspace(ws, x.device, "the device of " + x.name);
}

std::vector<int64_t> checked_bounds(std::vector<int64_t> bounds, int64_t rows, const std::string& what) {
  if (bounds.empty()) return {0, rows};
  std::string got = "bounds: got " + dims(bounds);
  if (bounds.size() < 2 || bounds.front() != 0 || bounds.back() != rows)
    throw ArgumentError(got + ", expected boundaries 0 < ... < " + std::to_string(rows) + " (" + what + ")");
  for (size_t j = 1; j < bounds.size(); ++j)
    if (bounds[j] <= bounds[j - 1]) throw ArgumentError(got + ", expected them strictly increasing");
  return bounds;
}

}  // namespace

LinearArgs linear_args(const TensorRef& x, const TensorRef& weight, const TensorRef* bias, const TensorRef& out,
                       const TensorRef& workspace, cudaStream_t stream) {
  if (x.dim() != 2 && x.dim() != 3) fail(x, "a 2-D tensor [m, k], or a 3-D [batch, m, k]");
  require_cuda(x, -1);
  require_compute_dtype(x);
  require_data(x);
  const int64_t d = x.dim() - 2;  // the matrix dims are (d, d + 1)
  const int64_t batch = d ? x.shape[0] : 1, m = x.shape[d], k = x.shape[d + 1];
  require_weight(weight, x, k);
  const int64_t n = weight.shape[0];
  if (bias != nullptr) {
    if (batch > 1 || d) throw ArgumentError(bias->name + ": a bias is not supported with a batch of products");
    require_bias(*bias, x, n);
  }
  require_like(out, x);
  std::vector<int64_t> expected = d ? std::vector<int64_t>{batch, m, n} : std::vector<int64_t>{m, n};
  require_shape(out, expected, " (x " + dims(x.shape) + " times weight " + dims(weight.shape) + " transposed)");
  require_data(out);
  require_workspace(workspace, x);

  LinearArgs a;
  a.x = x.ptr(), a.w = weight.ptr(), a.y = out.ptr();
  a.bias = bias ? bias->ptr() : nullptr;
  a.m = m, a.n = n, a.k = k;
  a.ldx = row_stride(x, d);
  a.ldy = row_stride(out, d);
  std::tie(a.ldw, a.w_col_major) = weight_layout(weight);
  a.batch = batch;
  if (batch > 1) {  // an empty x or out: the strides of a row-major one (nothing is stored)
    a.stride_x = x.numel() ? x.strides[0] : m * a.ldx, a.stride_y = out.numel() ? out.strides[0] : m * a.ldy;
    if (a.stride_x < m * a.ldx) fail(x, "matrices of the batch that do not overlap (strides " + dims(x.strides) + ")");
    if (a.stride_y < m * a.ldy)
      fail(out, "matrices of the batch that do not overlap (strides " + dims(out.strides) + ")");
  }
  a.dtype = x.dtype;
  a.workspace = workspace.ptr();
  a.workspace_bytes = static_cast<size_t>(workspace.numel());
  a.stream = stream;
  a.device = x.device;
  return a;
}

OverlapArgs primitive_args(Primitive op, int p, int device, const TensorRef& x, const TensorRef& weight,
                           const TensorRef* bias, const TensorRef& out, const TensorRef* scratch,
                           std::vector<int64_t> bounds, const TensorRef& workspace, cudaStream_t stream) {
  require_dim(x, 2);
  require_cuda(x, device);
  require_compute_dtype(x);
  require_contiguous(x);
  const int64_t rows = x.shape[0], k = x.shape[1];
  require_weight(weight, x, k);
  const int64_t n = weight.shape[0];
  const std::string name = primitive_name(op);
  if (rows == 0 || k == 0 || n == 0)
    throw ArgumentError("x, weight: " + name + " takes no empty dimension (the plain GEMM does), got x " +
                        dims(x.shape) + " and weight " + dims(weight.shape));
  if (bias != nullptr) {
    if (op != Primitive::kAllGatherMatmul)
      throw ArgumentError(bias->name + ": " + name + " adds no bias (the caller adds it once, after the reduction)");
    require_bias(*bias, x, n);
  }
  // (out rows, scratch shape, rows chunked by bounds)
  int64_t out_rows = rows, chunked = rows;
  std::vector<int64_t> scratch_shape;
  switch (op) {
    case Primitive::kAllGatherMatmul:
      out_rows = p * rows;
      scratch_shape = {p * rows, k};  // gathered
      break;
    case Primitive::kMatmulReduceScatter:
      if (rows % p) fail(x, "rows divisible by the group's " + std::to_string(p) + " ranks");
      out_rows = chunked = rows / p;
      scratch_shape = {rows, n};  // partial
      break;
    case Primitive::kMatmulAllReduce:
      scratch_shape = {rows, n};  // partial, when the algorithm uses one
      break;
  }
  require_like(out, x);
  require_shape(out, {out_rows, n}, " (the output of " + name + " on " + std::to_string(p) + " ranks)");
  require_contiguous(out);
  if (scratch != nullptr) {
    require_like(*scratch, x);
    require_shape(*scratch, scratch_shape);
    require_contiguous(*scratch);
  } else if (op != Primitive::kMatmulAllReduce) {
    throw ArgumentError(std::string(op == Primitive::kAllGatherMatmul ? "gathered" : "partial") + ": " + name +
                        " needs its buffer " + dims(scratch_shape));
  }
  require_workspace(workspace, x);

  OverlapArgs a;
  a.x = x.ptr(), a.w = weight.ptr(), a.out = out.ptr();
  a.bias = bias ? bias->ptr() : nullptr;
  a.scratch = scratch ? scratch->ptr() : nullptr;
  a.n = n, a.k = k;
  std::tie(a.ldw, a.w_col_major) = weight_layout(weight);
  a.dtype = x.dtype;
  a.bounds = checked_bounds(std::move(bounds), chunked, op == Primitive::kMatmulAllReduce ? "over m" : "over m/p");
  a.workspace = workspace.ptr();
  a.workspace_bytes = static_cast<size_t>(workspace.numel());
  a.stream = stream;
  return a;
}

CollectiveArgs collective_args(Collective c, int rank, int p, int device, const TensorRef* x, const TensorRef* out,
                               int peer, cudaStream_t stream) {
  const std::string name = collective_name(c);
  const bool root = (c == Collective::kBroadcast || c == Collective::kGather);
  const char* peer_name = c == Collective::kSend || c == Collective::kGather ? "dst" : "src";
  if (c == Collective::kAllReduce || c == Collective::kAllGather || c == Collective::kReduceScatter) {
    peer = -1;
  } else if (peer < 0 || peer >= p || (!root && peer == rank)) {
    throw ArgumentError(std::string(peer_name) + ": expected " + (root ? "a rank" : "another rank") + " of the group's " +
                        std::to_string(p) + " (this is rank " + std::to_string(rank) + "), got " + std::to_string(peer));
  }
  // Which tensors the call takes on this rank.
  const bool takes_x = c != Collective::kRecv;
  const bool takes_out = c != Collective::kSend && (c != Collective::kGather || rank == peer);
  auto presence = [&](const TensorRef* t, bool takes, const char* what) {
    if (takes && t == nullptr) throw ArgumentError(std::string(what) + ": " + name + " needs it on rank " + std::to_string(rank));
    if (!takes && t != nullptr)
      throw ArgumentError(std::string(what) + ": " + name + " takes none on rank " + std::to_string(rank) +
                          (c == Collective::kGather ? " (only the root, rank " + std::to_string(peer) + ", receives)" : ""));
  };
  presence(x, takes_x, "x");
  presence(out, takes_out, "out");
  const TensorRef& first = takes_x ? *x : *out;
  require_cuda(first, device);
  if (reduces(c)) require_compute_dtype(first);
  require_contiguous(first);
  if (takes_x && takes_out) {
    require_like(*out, *x);
    require_contiguous(*out);
    std::vector<int64_t> expected = x->shape;
    if (c == Collective::kAllGather || c == Collective::kGather || c == Collective::kReduceScatter) {
      if (x->dim() < 1) fail(*x, "at least one dimension (dim 0 is " + std::string(c == Collective::kReduceScatter ? "scattered" : "gathered") + ")");
      if (c == Collective::kReduceScatter) {
        if (x->shape[0] % p) fail(*x, "dim 0 divisible by the group's " + std::to_string(p) + " ranks");
        expected[0] /= p;
      } else {
        expected[0] *= p;
      }
    }
    require_shape(*out, expected, " (the output of " + name + " of " + x->name + " " + dims(x->shape) + " on " +
                                      std::to_string(p) + " ranks)");
  }

  CollectiveArgs a;
  a.x = takes_x ? x->ptr() : nullptr;
  a.out = takes_out ? out->ptr() : nullptr;
  a.count = c == Collective::kReduceScatter || c == Collective::kRecv ? out->numel() : x->numel();
  a.dtype = first.dtype;
  a.peer = peer;
  a.stream = stream;
  return a;
}

void check_all_reduce_algorithm(const OverlapArgs& a, AllReduceAlgo algo, int p, bool has_partial) {
  if (algo != AllReduceAlgo::kScatterGather) {
    if (a.bounds.size() != 2)
      throw ArgumentError(std::string("bounds: ") + algorithm_name(algo) + " takes one chunk [0, m], got " +
                          std::to_string(a.bounds.size() - 1));
    return;
  }
  if (static_cast<int>(a.bounds.size()) != p + 1)
    throw ArgumentError("bounds: scatter_gather takes the boundaries of the " + std::to_string(p) +
                        " ranks' blocks (m >= p rows), got " + std::to_string(a.bounds.size() - 1) + " chunks");
  if (!has_partial) throw ArgumentError("partial: scatter_gather needs its buffer [m, n]");
}

void check_phase(int phase, int phases) {
  if (phase != kAllPhases && (phase < 0 || phase >= phases))
    throw ArgumentError("phase: expected " + std::to_string(kAllPhases) + " (all) or 0 to " + std::to_string(phases - 1) +
                        ", got " + std::to_string(phase));
}

void set_ring(OverlapArgs& a, int rank, int p, std::vector<int> ring, int next, int prev) {
  std::vector<int> sorted = ring;
  std::sort(sorted.begin(), sorted.end());
  bool permutation = static_cast<int>(ring.size()) == p;
  for (int q = 0; permutation && q < p; ++q) permutation = sorted[q] == q;
  if (!permutation || ring[0] != rank)
    throw ArgumentError("ring: expected every rank of " + std::to_string(p) + " once, rank " + std::to_string(rank) +
                        " first");
  auto other = [&](int q) { return q >= 0 && q < p && (q != rank || p == 1); };
  if (!other(next) || !other(prev))
    throw ArgumentError("ring_next, ring_prev: expected other ranks of " + std::to_string(p) + ", got " +
                        std::to_string(next) + " and " + std::to_string(prev));
  a.ring = std::move(ring);
  a.ring_next = next, a.ring_prev = prev;
}

void set_side_stream(OverlapArgs& a, int device, cudaStream_t side, const TensorRef* workspace) {
  if (side == nullptr) {
    if (workspace != nullptr) throw ArgumentError(workspace->name + ": given without a side_stream");
    return;
  }
  if (side == a.stream) throw ArgumentError("side_stream: expected a stream other than `stream`, got the same one");
  if (workspace == nullptr)
    throw ArgumentError("side_workspace: a side_stream needs a cuBLASLt workspace of its own, got None");
  const TensorRef& ws = *workspace;
  require_workspace(ws, device, "cuda:" + std::to_string(device));
  const uintptr_t begin = ws.data, end = begin + static_cast<uintptr_t>(ws.numel());
  const uintptr_t main_begin = reinterpret_cast<uintptr_t>(a.workspace), main_end = main_begin + a.workspace_bytes;
  if (begin < main_end && main_begin < end) fail(ws, "bytes of its own (it shares some with workspace)");
  a.side_stream = side;
  a.side_workspace = ws.ptr();
  a.side_workspace_bytes = static_cast<size_t>(ws.numel());
}

int64_t reduce_partials_args(const std::vector<TensorRef>& inputs, const TensorRef& out, const void** ptrs) {
  const int p = static_cast<int>(inputs.size());
  if (p < 1 || p > kMaxRanks)
    throw ArgumentError("inputs: p must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(p));
  const TensorRef& first = inputs[0];
  require_cuda(first, -1);
  require_compute_dtype(first);
  for (int q = 0; q < p; ++q) {
    require_like(inputs[q], first);
    require_shape(inputs[q], first.shape, " (the shape of " + first.name + ")");
    require_contiguous(inputs[q]);
    ptrs[q] = inputs[q].ptr();
  }
  require_like(out, first);
  require_shape(out, first.shape, " (the shape of " + first.name + ")");
  require_contiguous(out);
  return first.numel();
}

}  // namespace tp_kernels
