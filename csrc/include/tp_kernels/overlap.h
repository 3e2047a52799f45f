// The three tensor-parallel primitives, and their `pipelined` form: cuBLASLt GEMMs on the
// caller's stream overlapped with NCCL on the communicator's stream, chunk by chunk.
//
// Shapes (row-major, elements; p = comm.size(), r = comm.rank()):
//   all_gather_matmul      x [m/p, k] -(AG)-> gathered [m, k];  out [m, n] = gathered W^T (+ bias)
//   matmul_reduce_scatter  x [m, k];  partial [m, n] scratch;   out [m/p, n] = RS(x W^T)
//   matmul_all_reduce      x [m, k];                            out [m, n] = AR(x W^T)
// W is [n, k] as described in gemm.h (row- or column-major). x, gathered, partial and out are
// contiguous. `bounds` are the chunk boundaries 0 = b0 < b1 < ... < bc of the rows chunked
// (m/p for the first two ops, m for all-reduce), computed by tp_kernels.schedule.chunk_bounds,
// so the CPU-tested schedule is the one run here; the all-gather's ring order comes from
// tp_kernels.schedule.ring likewise.
//
// Stream contract: the work is enqueued on `stream` and on the communicator's stream, which
// first waits for `stream` and which `stream` waits for before the call returns. With a
// `side_stream` (and its own cuBLASLt workspace), the GEMMs of a call that has several alternate
// between `stream` and it (the first on `stream`), so that one GEMM's last, partly filled wave of
// tiles may run beside the next one's first; it too first waits for `stream`, which waits for it
// before the call returns. The host never waits for the GPU, so the calls can be captured in a
// CUDA graph. Hold no other reference to the buffers' memory on other streams.
//
// The arguments are trusted: boundary.h checks them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tp_kernels/comm.h"
#include "tp_kernels/gemm.h"

namespace tp_kernels {

// The primitives, in the order of _C.OPS (their names, read by the Python side).
enum class Primitive : int { kAllGatherMatmul = 0, kMatmulReduceScatter = 1, kMatmulAllReduce = 2 };
const char* primitive_name(Primitive op);
std::vector<std::string> primitive_names();
// The primitive called `name`; throws ArgumentError naming `arg` when there is none.
Primitive parse_primitive(const std::string& name, const std::string& arg);

struct OverlapArgs {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;  // all_gather_matmul only; the reductions add theirs afterwards
  void* out = nullptr;
  void* scratch = nullptr;  // all_gather_matmul: gathered [m, k]; reductions: partial [m, n]
  int64_t n = 0, k = 0;
  int64_t ldw = 0;
  bool w_col_major = false;
  DType dtype = DType::kBFloat16;
  std::vector<int64_t> bounds;
  // all_gather_matmul (pipelined): ring[s] is the rank whose shard this rank multiplies at step s
  // (ring[0] is this rank); each shard is forwarded to ring_next and received from ring_prev.
  std::vector<int> ring;
  int ring_next = -1, ring_prev = -1;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  // The pipelined primitives' second stream for GEMMs and its workspace (above); none: every GEMM
  // on `stream`. The fused primitives take none.
  cudaStream_t side_stream = nullptr;
  void* side_workspace = nullptr;
  size_t side_workspace_bytes = 0;
};

// Ring all-gather (at step s multiply the shard of rank ring[s] while the next one, ring[s + 1],
// arrives from ring_prev by NCCL send/recv), each shard sent as the chunks of `bounds` (over m/p).
void all_gather_matmul(Communicator& comm, const OverlapArgs& args);

// Chunk j = rows bounds[j]..bounds[j+1] of every destination's block, multiplied in one batched
// GEMM; its reduce-scatter runs while chunk j + 1 multiplies.
void matmul_reduce_scatter(Communicator& comm, const OverlapArgs& args);

// Chunk j = rows bounds[j]..bounds[j+1] of m; its all-reduce runs (in place, in `out`) while
// chunk j + 1 multiplies.
void matmul_all_reduce(Communicator& comm, const OverlapArgs& args);

}  // namespace tp_kernels
