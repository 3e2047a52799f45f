// What the host passes to the device kernels (csrc/kernels/kernels.cu), by value: one definition
// for both sides. The kernels are compiled by NVRTC, which has no standard library, so only
// built-in types appear here.
#pragma once

namespace tp_kernels {

// The most ranks a peer-memory group has (every per-rank table is this long).
constexpr int kMaxRanks = 8;

// tpk_wait_flags: flag[i] is waited for (i < count); code[i] is its nonzero error code (bit
// kMismatchBit clear); expect[i] the value the flag must be set to (0: any nonzero value).
struct FlagList {
  unsigned int* flag[kMaxRanks];
  unsigned int code[kMaxRanks];
  unsigned int expect[kMaxRanks];
};

// tpk_set_flags: value[i] is written to flag[i] (i < count), a local or a peer's word.
struct FlagWrites {
  unsigned int* flag[kMaxRanks];
  unsigned int value[kMaxRanks];
};

// Added to a flag's error code when the flag was set to another value than the one expected.
constexpr unsigned int kMismatchBit = 0x40000000u;

// tpk_reduce_partials_*: the p partial buffers, summed in this order.
struct PartialPtrs {
  const void* in[kMaxRanks];
};

// The stages of tpk_all_reduce_* (a launch runs one of them, or several in this order).
constexpr int kStagePublish = 1;  // this rank's partial into its export region, the peers told
constexpr int kStageReduce = 2;   // the p partials summed (one-shot: all of them, into out; two-shot:
                                  // this rank's slice, into out and its export2 region), the peers
                                  // told their partials are read (two-shot: and the slice is there)
constexpr int kStageGather = 4;   // two-shot: the peers' slices into out, the peers told they are read

// The threads of a tpk_all_reduce_* block (its launch bound), and the blocks a multiprocessor holds
// at once at least (its register budget: 64 a thread, p loads in flight and 4 in a copy fit): the
// kernels of ranks that share a GPU, and of other groups' calls beside them, must fit side by side.
constexpr int kAllReduceThreads = 512;
constexpr int kAllReduceBlocksPerSM = 2;

// A data region's flags as a rank's all-reduce kernel uses them (peer.h). Entry i of each list is
// peer i of the rank's other ranks (the same peer in all four).
struct RegionFlags {
  FlagList release;           // this rank's release(region, peer i): polled (set: the peer is done with
                              // this rank's data), cleared once the rank has written the region again
  FlagList ready;             // this rank's ready(region, peer i): polled (the call word), cleared once read
  FlagWrites signal_ready;    // peer i's ready(region, rank): the call word
  FlagWrites signal_release;  // peer i's release(region, rank): 1
};

// tpk_all_reduce_*: the one-shot or two-shot all-reduce of a rank (peer.h's protocol on the export
// and export2 regions).
struct AllReduceParams {
  RegionFlags export_flags;    // the export region's: the partials
  RegionFlags export2_flags;   // two-shot: the export2 region's, the slices of the sum
  PartialPtrs exports;         // every rank's export region, in rank order
  PartialPtrs exports2;        // two-shot: every rank's export2 region (its slice of the sum)
  const void* src;             // this rank's partial, `count` elements
  void* out;                   // the sum (may be src)
  long long count;
  long long slice;             // two-shot: the elements of a rank's slice (rank q sums elements
                               // [q slice, (q + 1) slice) of [0, count))
  int rank, p;
  int two_shot;                // 1: two-shot, 0: one-shot
  int stages;                  // kStagePublish | kStageReduce (| kStageGather: two-shot)
  unsigned long long timeout_ns;
  unsigned int* error_word;
  unsigned int* arrivals;      // three counters in this rank's control block (0 between launches)
};

}  // namespace tp_kernels
