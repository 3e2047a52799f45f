// The one check of what the Python side passes to the native module, and its translation into the
// core's argument structs (gemm.h, overlap.h, peer.h, device_ops.h).
//
// Each function takes TensorRefs (tensor.h) and throws ArgumentError naming the argument
// ("weight: expected [24, 40] to match x [6, 40], got [24, 39] bfloat16 on cuda:0") before any
// CUDA call, so every check here runs on machines without a GPU too. The core trusts what comes
// out of these functions and checks nothing again.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "tp_kernels/collectives.h"
#include "tp_kernels/device_ops.h"
#include "tp_kernels/gemm.h"
#include "tp_kernels/overlap.h"
#include "tp_kernels/peer.h"
#include "tp_kernels/tensor.h"

namespace tp_kernels {

// Y = X W^T (+ b) on one device:
//   x [m, k], or [batch, m, k] for `batch` products with one W (no bias then);
//   weight [n, k], row-major or column-major (a transposed view), leading dim >= its rows' length;
//   bias [n] contiguous, or none; out [m, n] (or [batch, m, n]);
//   x's and out's rows may be strided, their last dim is contiguous;
//   workspace: uint8 bytes for cuBLASLt (0 allowed).
// Empty tensors may have a null data pointer.
LinearArgs linear_args(const TensorRef& x, const TensorRef& weight, const TensorRef* bias, const TensorRef& out,
                       const TensorRef& workspace, cudaStream_t stream);

// The arguments of primitive `op` for a rank of a group of `p` ranks on `device` (overlap.h and
// peer.h give the shapes; everything contiguous but weight, which is as in linear_args):
//   all_gather_matmul      x [mp, k], scratch = gathered [p*mp, k], out [p*mp, n], bias [n] or none;
//                          bounds over mp
//   matmul_reduce_scatter  x [p*mp, k], scratch = partial [p*mp, n], out [mp, n]; bounds over mp
//   matmul_all_reduce      x [m, k], out [m, n], scratch = partial [m, n] or none; bounds over m
// `bounds`: 0 = b0 < b1 < ... < bc = the rows chunked (empty: one chunk). No dimension is empty
// (the callers run the plain GEMM then). The reductions take no bias (the caller adds it once,
// after the reduction).
OverlapArgs primitive_args(Primitive op, int p, int device, const TensorRef& x, const TensorRef& weight,
                           const TensorRef* bias, const TensorRef& out, const TensorRef* scratch,
                           std::vector<int64_t> bounds, const TensorRef& workspace, cudaStream_t stream);

// The arguments of collective `c` (collectives.h gives the shapes) for rank `rank` of a group of
// `p` on `device`: `x` (none for recv) and `out` (none for send, and for gather off the root)
// contiguous, of one dtype (a compute dtype for the reductions); `peer` the root (broadcast,
// gather), the destination (send) or the source (recv), another rank for send and recv.
CollectiveArgs collective_args(Collective c, int rank, int p, int device, const TensorRef* x, const TensorRef* out,
                               int peer, cudaStream_t stream);

// The fused all-reduce by `algo` (peer.h): one chunk for one_shot and two_shot; for scatter_gather
// the p blocks' boundaries (p + 1 of them, so m >= p) and a partial buffer.
void check_all_reduce_algorithm(const OverlapArgs& args, AllReduceAlgo algo, int p, bool has_partial);

// `phase` of a fused op of `phases` (peer.h): kAllPhases, or one of 0 .. phases - 1.
void check_phase(int phase, int phases);

// The pipelined all-gather's ring for rank `rank` of `p`: `ring` holds every rank once, this rank
// first; `next` and `prev` are other ranks (or this one, when p = 1).
void set_ring(OverlapArgs& args, int rank, int p, std::vector<int> ring, int next, int prev);

// The pipelined primitives' second stream for GEMMs (overlap.h): `side` (null: none), another
// stream than the call's, with a cuBLASLt workspace of its own, `workspace` (uint8 bytes on
// `device`, none of them the call's workspace's); no side stream takes no workspace.
void set_side_stream(OverlapArgs& args, int device, cudaStream_t side, const TensorRef* workspace);

// reduce_partials: p = inputs.size() in [1, kMaxRanks] contiguous tensors of one shape and compute
// dtype on one device, summed into out (same shape). Fills `ptrs` (kMaxRanks entries).
int64_t reduce_partials_args(const std::vector<TensorRef>& inputs, const TensorRef& out, const void** ptrs);

}  // namespace tp_kernels
