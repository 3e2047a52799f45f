// Y = X W^T (+ b) on cuBLASLt: the GEMM of every tensor-parallel linear layer.
//
// X and Y are row-major with a leading dimension (elements between consecutive rows):
//   X [m, k] (ldx >= k), Y [m, n] (ldy >= n), bias [n] or null.
// W [n, k] is row-major (ldw >= k), or, with w_col_major, column-major (ldw >= n: W is the
// transposed view of a row-major [k, n], as in a backward pass's W^T).
// batch > 1 runs `batch` such products with one W: X_i = X + i * stride_x, Y_i = Y + i * stride_y
// (elements); a bias is not supported then.
// fp16 and bf16 accumulate in fp32; fp32 computes in full fp32 (no TF32), as torch does by
// default. The bias is added by the GEMM's epilogue. Work is enqueued on `stream`; nothing
// blocks the host, so the call can be captured in a CUDA graph. The workspace (any size,
// 0 allowed) is owned by the caller and must not be used concurrently by another stream.
// m = 0 or n = 0 is no work; k = 0 (an empty sum) writes nothing: the caller fills Y with the bias.
//
// The arguments are trusted: they come checked from the boundary (boundary.h) or from the
// primitives built on this GEMM.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tp_kernels/tensor.h"

namespace tp_kernels {

struct LinearArgs {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;  // may be null
  void* y = nullptr;
  int64_t m = 0, n = 0, k = 0;
  int64_t ldx = 0, ldw = 0, ldy = 0;
  bool w_col_major = false;
  int64_t batch = 1, stride_x = 0, stride_y = 0;
  DType dtype = DType::kBFloat16;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  int device = -1;  // made current for the call (the inputs' device); -1: the current one
};

// Throws tp_kernels::Error when a CUDA or cuBLASLt call fails.
void linear(const LinearArgs& args);

// An algorithm of cuBLASLt's as cublasLt.h numbers its configuration (the CUBLASLT_ALGO_CONFIG_*
// attributes: cublasLtMatmulTile_t, cublasLtMatmulStages_t, cublasLtClusterShape_t, ...; -1 where
// this cuBLASLt does not report one), and its heuristic's figures for a problem: `waves` (its
// wavesCount: 1.0 fills every multiprocessor once, so a fraction past a whole number is a last
// wave partly filled) and the workspace the algorithm needs.
struct GemmAlgoInfo {
  int algo_id = -1, tile_id = -1, stages_id = -1, splitk = -1, reduction_scheme = -1, swizzle = -1,
      custom_option = -1, inner_shape_id = -1, cluster_shape_id = -1;
  float waves = 0.0f;
  size_t workspace_needed = 0;
};

// What a plan's making timed where tuning was on (set_gemm_tuning): how many of the heuristic's
// proposals ran (0: none, the heuristic's first kept unmeasured), the mean time of a run of its
// first and of the algorithm kept, and why tuning did not run or stopped ("" where it ran).
struct GemmTuningInfo {
  int timed = 0;
  float first_ms = -1.0f, chosen_ms = -1.0f;
  std::string note;
};

// What cuBLASLt's heuristic chose for one problem `linear` (or gemm_candidates) has planned in this
// process (its cached plan): the problem and the algorithm. For the benchmarks: why a GEMM runs at the rate it
// does.
struct GemmPlanInfo {
  int device = 0;
  int64_t m = 0, n = 0, k = 0, batch = 1;
  int64_t ldx = 0, ldw = 0, ldy = 0;
  DType dtype = DType::kBFloat16;
  bool bias = false, w_col_major = false;
  size_t workspace_bytes = 0;  // the workspace the plan was made for
  GemmAlgoInfo algo;
  GemmTuningInfo tuning;
};

// Every plan made so far, in the order of their problems (device, m, n, k, ...). Reads only what
// the plans hold: no CUDA call.
std::vector<GemmPlanInfo> gemm_plans();

// Drops every plan (their descriptors freed): the next GEMM of each problem makes its plan again,
// under the tuning set then. For the benchmarks, which compare a problem's plans with tuning off
// and on in one process. No CUDA call.
void forget_gemm_plans();

// Tuning of the plans made from now on: `candidates` 0 (off: each plan runs cuBLASLt's heuristic's
// first algorithm, the default) or 2..32: a plan's making times the heuristic's first `candidates`
// proposals for its problem and keeps the fastest where it is more than 2 % faster than the first.
// Each proposal runs once, then `iters` times between two CUDA events, on a stream of the plan's
// own, into an output and a workspace of its own (allocated stream-ordered, freed after): the
// caller's X and W are read without waiting for the work queued before the call (a GEMM's time
// does not depend on its values), so the wait, within `timeout_s` seconds in all, is for these
// GEMMs alone, never behind a collective the peers have yet to join. A plan made while its stream
// is captured, or whose timing fails (no memory for the output, say), keeps the heuristic's first
// and says why (gemm_plans). Which algorithm wins can differ between runs and ranks, and with it
// the rounding of a product. Throws ArgumentError for an argument out of range; no CUDA call.
void set_gemm_tuning(int candidates, int iters, double timeout_s);

// One of the algorithms cuBLASLt's heuristic proposes for a problem, timed (gemm_candidates).
struct GemmCandidate {
  GemmAlgoInfo algo;
  float ms = -1.0f;  // the mean time of a run; -1 where cuBLASLt would not run it
};

// The algorithm `linear` runs for the problem of `args` (its plan, made here if it is not yet),
// then the others of the first `count` (1..32) cuBLASLt's heuristic proposes for it (within its
// workspace), `count` in all at most, in the heuristic's order, each run once and then `iters`
// times between two CUDA events on args.stream, which this waits for (each algorithm's runs, and
// the stream's work queued before the first, within `timeout_s` seconds, else it throws); `args`'
// output is overwritten. For the benchmarks (whether another algorithm than the heuristic's first
// runs a problem faster), at sizes whose GEMM outlasts its launch; never on a stream being
// captured. Throws ArgumentError for count, iters or timeout_s out of range, before any CUDA call.
std::vector<GemmCandidate> gemm_candidates(const LinearArgs& args, int count, int iters, double timeout_s);

}  // namespace tp_kernels
