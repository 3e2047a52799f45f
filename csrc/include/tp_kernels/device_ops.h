// Device-side building blocks of the peer-memory (`fused`) path, usable with ranks that are
// separate processes (pointers mapped from CUDA IPC handles) or virtual ranks in one process.
//
// * Flags: a rank publishes "chunk ready" by writing an epoch counter with a stream memory
//   operation (cuStreamWriteValue32, reached through cudaGetDriverEntryPointByVersion: the module
//   never links libcuda). Epochs only grow, so a later call or CUDA-graph replay never mistakes a
//   stale flag for a fresh one: waiters compare with >= (wrap-around safe, as CUDA's GEQ).
// * Bounded waits: a one-thread kernel polls a flag against the GPU's global timer; past its
//   timeout it records an error code in a host-visible error word and returns, so no stream hangs
//   forever. The host reads the word (see check_error_word) to raise a clear error.
// * Deterministic reduction: the sum of p partial buffers in fixed rank order 0..p-1 with fp32
//   accumulation, so the result does not depend on chunking, timing or the run.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tp_kernels/gemm.h"

namespace tp_kernels {

constexpr int kMaxRanks = 8;

// Writes `value` to the 32-bit word at device address `flag` on `stream` (after all prior work of
// the stream, with a memory fence so that the data written before it is visible first).
void write_flag(uint32_t* flag, uint32_t value, cudaStream_t stream);

// Makes `stream` wait until *flag >= value (as a signed 32-bit difference), by the driver's stream
// memory operation: unbounded, for flags whose writer is already enqueued in this process.
void wait_flag_unbounded(const uint32_t* flag, uint32_t value, cudaStream_t stream);

// Makes `stream` wait until *flag >= value or `timeout_ns` pass; on timeout writes `error_code`
// to *error_word (if it is still 0) and lets the stream go on. error_word must be readable by the
// host (mapped pinned memory).
void wait_flag_bounded(const uint32_t* flag, uint32_t value, uint64_t timeout_ns, uint32_t* error_word,
                       uint32_t error_code, cudaStream_t stream);

// out[i] = sum over q = 0..p-1 of in[q][i], accumulated in fp32 in that order, for `count`
// elements of `dtype`. Any of in[q] may be a peer's pointer; out may alias one of them.
void reduce_partials(const void* const* in, int p, void* out, int64_t count, DType dtype, cudaStream_t stream);

// True when the driver provides the stream memory operations (CUDA 12+ drivers do).
bool stream_memory_ops_available();

}  // namespace tp_kernels
