// The peer-memory (`fused`) path: a rank's view of its group's symmetric workspace, and the three
// fused primitives on it.
//
// Every rank owns one workspace buffer of the same size, mapped into every other rank (CUDA IPC
// between processes; plain pointers for virtual ranks, several ranks driven by one process on one
// GPU, each with its own streams). A PeerContext holds the table of those buffers as this
// process sees them, so the same code runs in both settings. A buffer is laid out as
//
//   [control block: kControlBytes of 32-bit flags][export][inbox][export2]
//
// with the three data regions of the sizes given at construction (the same on every rank).
// * export, export2: data a rank publishes for its peers to read (its shard to gather, its
//   partial for a one-shot all-reduce, its reduced block).
// * inbox: slots the peers write into (slot q: from rank q), e.g. the partials to reduce.
// For each region c and peer q a rank's control block has two flags, both set by q and consumed
// by the rank (device_ops.h):
// * ready(c, q): q's data for this rank is in place (export: q's region is written; inbox: q has
//   written its slot here).
// * release(c, q): q is done with this rank's data (export: q has read this rank's region; inbox:
//   q has consumed this rank's slot there). Release flags start set: nobody holds anything.
// A rank writes its export region only after consuming release(export, q) of every peer, and
// writes into q's inbox only after consuming release(inbox, q). Then no data is overwritten
// while read, and each flag is set again only after it was consumed.
//
// A ready flag is set and consumed within one op, so it carries the setter's *call word*
// (call_word: a hash of the op, algorithm, dtype, shapes and chunking), and the waiter expects
// its own: ranks that make different calls, or are out of step, find out at their first ready
// flag, with no message beyond the flags the op writes anyway. Release flags are consumed by a
// later op and carry 1.
//
// The one-shot and two-shot all-reduces keep this protocol in one kernel a rank (peer_all_reduce,
// device_ops.h): its blocks poll the flags without clearing them and the last block to finish a
// stage clears them, counting the blocks in three words of the control block after the flags.
//
// Every wait is bounded by the context's timeout; a wait that times out, or finds a ready flag
// with another call word than its own, records which op, flag and peer (and which of the two) in
// the context's error word, every later wait of the context returns within microseconds, and
// check() (called at the start of every op) raises the error. A context with an error stays
// failed: the group's workspace must be made again.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "tp_kernels/collectives.h"
#include "tp_kernels/device_ops.h"
#include "tp_kernels/overlap.h"

namespace tp_kernels {

// The data regions of a workspace buffer, in layout order (their names: _C.REGIONS).
enum class Region : int { kExport = 0, kInbox = 1, kExport2 = 2 };
constexpr int kNumRegions = 3;
const char* region_name(Region c);
std::vector<std::string> region_names();
constexpr size_t kControlBytes = 4096;
constexpr size_t kRegionAlignment = 256;

// All-reduce algorithms of fused matmul_all_reduce (their names: _C.ALL_REDUCE_ALGORITHMS).
enum class AllReduceAlgo : int {
  kOneShot = 0,   // every rank reads every partial and sums them: the lowest latency, p x the reads
  kTwoShot = 1,   // each rank sums 1/p of the elements, then everyone gathers the sums
  kScatterGather = 2,  // partials pushed to their block's owner by copy engine while the next
                       // block multiplies, summed there, then gathered by copy engine
};
const char* algorithm_name(AllReduceAlgo algo);
std::vector<std::string> algorithm_names();
// The algorithm called `name`; throws ArgumentError naming `arg` when there is none.
AllReduceAlgo parse_algorithm(const std::string& name, const std::string& arg);

// Index of flag (region, release?, peer) in a control block.
constexpr int flag_index(Region c, bool release, int peer) {
  return (static_cast<int>(c) * 2 + (release ? 1 : 0)) * kMaxRanks + peer;
}

// Index of the first of the three block counters of peer_all_reduce (one a stage) in a control block.
constexpr int kArrivalIndex = flag_index(static_cast<Region>(kNumRegions - 1), true, kMaxRanks - 1) + 1;
static_assert((kArrivalIndex + 3) * 4 <= static_cast<int>(kControlBytes), "the control block holds the counters");

// The control block a new workspace starts with (kControlBytes / 4 words; release flags set).
std::vector<uint32_t> initial_control_block();

// Byte offset of a region in a workspace buffer with the given region sizes.
size_t region_offset(const std::vector<size_t>& region_bytes, Region c);

class PeerContext {
 public:
  // This rank's view: `bases[q]` is rank q's workspace buffer as mapped in this process (each
  // initialised with initial_control_block()), laid out with `region_bytes` (3 sizes, multiples
  // of kRegionAlignment). `sharing`: how many of the group's ranks run on this rank's GPU (this
  // one included; virtual ranks: all of them), whose kernels must fit on it side by side.
  // Creates a copy stream, an event pool and a host-mapped error word.
  PeerContext(int rank, int size, int device, const std::vector<uintptr_t>& bases,
              const std::vector<size_t>& region_bytes, double timeout_s, int sharing);
  ~PeerContext();
  PeerContext(const PeerContext&) = delete;
  PeerContext& operator=(const PeerContext&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  int sharing() const { return sharing_; }
  double timeout_s() const { return timeout_s_.load(); }
  void set_timeout_s(double timeout_s);
  size_t region_bytes(Region c) const { return region_bytes_[static_cast<int>(c)]; }
  // Rank q's region c as mapped here, plus `offset` bytes.
  void* region(int q, Region c, size_t offset = 0) const;
  cudaStream_t copy_stream() const { return copy_stream_; }
  cudaEvent_t event(size_t i);

  // The call word of the op being enqueued (call_word; set by each op under lock()): what its
  // ready flags carry and its waits for ready flags expect.
  void begin(uint32_t call_word) { call_word_ = call_word; }
  // Sets flag (c, release, rank()) in every other rank's control block, on `stream` after its prior
  // work, in one kernel launch (write_flags): a ready flag to the call word, a release flag to 1.
  void signal_all(Region c, bool release, cudaStream_t stream);
  // Makes `stream` consume this rank's flags (c, release, q) for each q in `peers` (bounded; a
  // ready flag must carry the call word).
  void wait(const std::vector<int>& peers, Region c, bool release, Primitive op, cudaStream_t stream);
  // The all-reduce of `count` elements of this rank's partial `src` into `out` (may be src), in one
  // launch on `stream` (peer_all_reduce): one-shot, or two-shot with slices of `slice` elements
  // (two_shot_slice; the export2 region holds one); its `stages` (of
  // kStagePublish, kStageReduce and, two-shot, kStageGather, in that order) over the export and
  // export2 regions and their flags, which waits of `op` name.
  void all_reduce(const void* src, void* out, int64_t count, bool two_shot, int64_t slice, DType dtype, int stages,
                  Primitive op, cudaStream_t stream);
  // The other ranks, in the order r + 1, r + 2, ... (mod p).
  std::vector<int> others() const;

  // The error word (0: none) and the error it stands for, raised.
  uint32_t error_code() const;
  void check() const;
  std::string describe(uint32_t code) const;

  // One op at a time per context.
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(op_mutex_); }

 private:
  uint32_t* flag(int q, int index) const;
  uint64_t timeout_ns() const;  // of every device wait
  // Flag (c, release, rank()) of each of `peers` with the value signal_all() writes, and this rank's
  // flags (c, release, q) for each q in `peers` with the codes and values wait() takes, in that order.
  FlagWrites signals(const std::vector<int>& peers, Region c, bool release) const;
  FlagList waits(const std::vector<int>& peers, Region c, bool release, Primitive op) const;

  int rank_, size_, device_;
  std::vector<char*> bases_;
  std::vector<size_t> region_bytes_;
  std::atomic<double> timeout_s_;
  int sharing_;
  cudaStream_t copy_stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
  uint32_t* error_word_ = nullptr;  // mapped pinned host memory
  uint32_t call_word_ = 1;
  std::mutex op_mutex_;
};

// The call word of a fused call: a hash of `op`, `algo` (-1: none), whether it multiplies
// (args.w), the dtype, n, k and the row bounds (which hold m and the chunking). Never 0 or 1,
// and the same on every rank that makes the same call.
uint32_t call_word(Primitive op, int algo, const OverlapArgs& args);

// Bytes each region (in Region order) needs on every rank for a fused call of `op` on p ranks,
// rounded up to kRegionAlignment. `m` is the gathered rows for all_gather_matmul (p shards of
// m/p) and the rows of x for the reductions; `algo` matters for matmul_all_reduce only.
std::vector<size_t> fused_region_needs(Primitive op, int p, int64_t m, int64_t n, int64_t k, DType dtype,
                                       AllReduceAlgo algo);

// The fused primitives. Their arguments are trusted (boundary.h checks them); what each checks
// itself is that the context's regions hold what the call needs.
//
// Each op is a sequence of phases: a phase's waits need only signals that peers send in earlier
// phases of the same op, or in earlier ops. A process that drives several ranks on one GPU
// (virtual ranks) enqueues phase k of every rank before phase k + 1 of any, so every signal a
// wait needs is enqueued before that wait, whatever hardware queue each stream lands in and
// whenever a kernel's module loads: the launch is safe by construction. `phase` runs one phase
// (0 .. fused_phases() - 1) or, with kAllPhases, all of them in order: what a rank that is a
// process of its own does.
constexpr int kAllPhases = -1;
int fused_phases(Primitive op, AllReduceAlgo algo);
//
// out [m, n] = AG(x) W^T (+ bias): each rank publishes its shard [m/p, k] in its export region;
// the copy stream pulls the peers' shards chunk by chunk (bounds over m/p) into gathered
// (scratch, [m, k]) while the caller's stream multiplies the chunks already there.
void fused_all_gather_matmul(PeerContext& ctx, const OverlapArgs& args, int phase = kAllPhases);

// out [m/p, n] = RS(x W^T): the partial for each destination (rows of its block) multiplies on
// the caller's stream into scratch ([m, n]) while the copy stream pushes the previous one into
// its destination's inbox; then the p partials in the inbox are summed in rank order in fp32.
// bounds = {0, m/p}. The result's bits depend neither on timing nor on chunking.
void fused_matmul_reduce_scatter(PeerContext& ctx, const OverlapArgs& args, int phase = kAllPhases);

// out [m, n] = AR(x W^T) by `algo`. bounds: {0, m} for one-/two-shot; the p + 1 block boundaries
// over m for scatter-gather (scratch [m, n]). Deterministic like the reduce-scatter. One-shot is
// the GEMM into out and one PeerContext::one_shot launch (phase 0: the GEMM and the publishing
// stage; phase 1: the summing stage).
void fused_matmul_all_reduce(PeerContext& ctx, const OverlapArgs& args, AllReduceAlgo algo,
                             int phase = kAllPhases);

// The all-reduce alone (tp_kernels.Communicator): out = the sum over ranks of x (args from
// collective_args(kAllReduce, ...); out may be x), by `algo`, in the phases of
// fused_phases(kMatmulAllReduce, algo). It is fused_matmul_all_reduce with each rank's x in place
// of its partial product: x is copied into the workspace (so a CUDA graph captures the copy, and
// x itself needs no registration), viewed as all_reduce_layout's rows. Every algorithm sums each
// element in rank order in fp32, so they all give the same bits, for any count.
void fused_all_reduce(PeerContext& ctx, const CollectiveArgs& args, AllReduceAlgo algo, int phase = kAllPhases);

// The [rows, cols] view fused_all_reduce takes of `count` elements: rows of 16 bytes where the
// count allows, else rows of one element (scatter_gather splits rows among the ranks).
struct AllReduceLayout {
  int64_t rows, cols;
};
AllReduceLayout all_reduce_layout(int64_t count, DType dtype);

// Bytes each region needs on every rank for fused_all_reduce of `count` elements on p ranks.
std::vector<size_t> fused_all_reduce_needs(int p, int64_t count, DType dtype, AllReduceAlgo algo);

// Elements of each rank's slice in the two-shot all-reduce of `count` elements (16-byte aligned
// slices; the last ones may be short or empty).
int64_t two_shot_slice(int64_t count, int p, DType dtype);

// Device memory for a workspace buffer (cudaMalloc: one allocation, so one IPC handle).
uintptr_t workspace_alloc(size_t bytes, int device);
void workspace_free(uintptr_t ptr, int device);
// Writes initial_control_block() to the start of a workspace buffer (synchronously).
void workspace_init(uintptr_t ptr, int device);
// The CUDA IPC handle of a workspace buffer (bytes), and its mapping in another process.
std::string ipc_handle(uintptr_t ptr, int device);
uintptr_t ipc_open(const std::string& handle, int device);
void ipc_close(uintptr_t ptr, int device);

}  // namespace tp_kernels
