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

// The stages of tpk_one_shot_* (a launch runs one of them, or both in order).
constexpr int kStagePublish = 1;  // this rank's partial into its export region, the peers told
constexpr int kStageReduce = 2;   // the p partials summed into out, the peers told they are read

// The threads of a tpk_one_shot_* block (its launch bound).
constexpr int kOneShotThreads = 512;

// tpk_one_shot_*: the one-shot all-reduce of a rank (peer.h's protocol on the export region).
// Entry i of each flag list is peer i of the rank's other ranks (the same peer in all four).
struct OneShotParams {
  FlagList release;           // this rank's release(export, peer i): polled, cleared once published
  FlagList ready;             // this rank's ready(export, peer i): polled (the call word), cleared once read
  FlagWrites signal_ready;    // peer i's ready(export, rank): the call word
  FlagWrites signal_release;  // peer i's release(export, rank): 1
  PartialPtrs exports;        // every rank's export region, in rank order
  const void* src;            // this rank's partial, `count` elements
  void* out;                  // the sum (may be src)
  long long count;
  int rank, p;
  int stages;                 // kStagePublish | kStageReduce
  unsigned long long timeout_ns;
  unsigned int* error_word;
  unsigned int* arrivals;     // two counters in this rank's control block (0 between launches)
};

}  // namespace tp_kernels
