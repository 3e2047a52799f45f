// Device-side building blocks of the peer-memory (`fused`) path, usable with ranks that are
// separate processes (pointers mapped from CUDA IPC handles) or virtual ranks in one process.
//
// * Flags: 32-bit words, 0 (clear) or set (nonzero: 1, or the word naming the call that set it,
//   which the waiter may require: peer.h). A rank sets a flag in a peer's memory with a
//   stream memory operation (cuStreamWriteValue32, through driver.h: the module never links
//   libcuda), fenced so that the data
//   written before it is visible first. The waiter consumes it: waits until it is set, then clears
//   it. Each flag has one writer and one waiter, and a protocol (peer.h) in which a flag is set
//   again only after its waiter has consumed it. Consecutive calls and CUDA-graph replays thus
//   start from the same flag state: no value baked into a captured graph can go stale, which an
//   epoch number given by the host would.
// * Bounded waits: a kernel polls the flags against the GPU's global timer; past its timeout it
//   records an error code in a host-visible error word and returns, so no stream hangs forever.
//   Once the error word is set, every later wait returns within microseconds (a wait reads the
//   word, which lies in host memory, every few microseconds of polling, not on every poll). The
//   host reads the word to raise a clear error.
// * Deterministic reduction: the sum of p partial buffers in fixed rank order 0..p-1 with fp32
//   accumulation, so the result does not depend on chunking, timing or the run.
// * The one-shot all-reduce of a rank in one kernel: the flag polls, the copy into its export
//   region, the flag writes and the reduction that would otherwise be six stream operations.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tp_kernels/gemm.h"
#include "tp_kernels/kernel_params.h"  // kMaxRanks

namespace tp_kernels {

// Writes `value` to the 32-bit word at device address `flag` (local or a peer's) on `stream`,
// after all prior work of the stream, with a memory fence so that what was written before it is
// visible first.
void write_flag(uint32_t* flag, uint32_t value, cudaStream_t stream);

// Writes values[i] to each of flags[0..count) (count <= kMaxRanks; local or a peer's words) on
// `stream` in one kernel launch, after all prior work of the stream, with a system-wide fence
// first: what write_flag does for one flag, for the p - 1 flags a rank sets at once.
void write_flags(uint32_t* const* flags, const uint32_t* values, int count, cudaStream_t stream);

// Makes `stream` wait until each of flags[0..count) (count <= kMaxRanks) is nonzero, and clears
// each one it saw set. A flag still clear after `timeout_ns`, or the error word already set, ends
// the wait: codes[i] of the first flag that timed out goes to *error_word (if it is still 0) and
// the stream goes on. A flag set to another value than expect[i] (expect null or expect[i] 0: any
// value) puts codes[i] | kMismatchBit there the same way. error_word must be device-accessible
// and host-readable (mapped pinned memory); the codes must be nonzero, with kMismatchBit clear.
void wait_flags(uint32_t* const* flags, const uint32_t* codes, const uint32_t* expect, int count, uint64_t timeout_ns,
                uint32_t* error_word, cudaStream_t stream);

// out[i] = sum over q = 0..p-1 of in[q][i], accumulated in fp32 in that order, for `count`
// elements of `dtype` (1 <= p <= kMaxRanks; the arguments are trusted: boundary.h checks them).
// Any of in[q] may be a peer's pointer; out may alias one of them.
void reduce_partials(const void* const* in, int p, void* out, int64_t count, DType dtype, cudaStream_t stream);

// A rank's one-shot or two-shot all-reduce in one launch (kernels.cu's tpk_all_reduce_*), by the
// stages of params.stages, on the flags of the export region and, two-shot, the export2 region
// (peer.h):
// * kStagePublish: every block polls this rank's release(export) flags (set, not cleared: the
//   peers have read its last partial), copies its share of src into this rank's export region; the
//   last block to finish clears those flags and sets the peers' ready(export) flags.
// * kStageReduce: every block polls this rank's ready(export) flags (each must carry its expect
//   value) and sums its share of the p partials (this rank's from src) in rank order in fp32: one-
//   shot every element, into out; two-shot the elements of this rank's slice, into out and this
//   rank's export2 region, after polling its release(export2) flags (the peers have read its last
//   slice). The last block clears the flags it polled and sets the peers' release(export) flags
//   (and, two-shot, their ready(export2) flags).
// * kStageGather (two-shot): every block polls this rank's ready(export2) flags and copies its
//   share of the peers' slices from their export2 regions into out; the last block clears them and
//   sets the peers' release(export2) flags.
// No block waits for another, so no launch needs all its blocks resident; each poll is bounded
// like wait_flags, into the same error word. The grid is at most max(1, min(32, SMs / sharing))
// blocks, `sharing` the ranks whose launches run on this GPU (1..p; p for virtual ranks), so that
// they fit on it side by side (kAllReduceBlocksPerSM blocks a multiprocessor at the least; a thread
// keeps p 16-byte loads in flight in a sum, 4 in a copy). The sums are reduce_partials' bits.
// The flags order the data by acquire loads, release stores and an acq_rel arrival count, with no
// full system fence (kernels.cu).
void peer_all_reduce(const AllReduceParams& params, DType dtype, int sharing, cudaStream_t stream);

// True when the driver provides what these need: stream memory operations, module loading and
// kernel launch (driver.h; CUDA 12+ drivers do).
bool stream_memory_ops_available();

}  // namespace tp_kernels
