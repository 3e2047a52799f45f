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

}  // namespace tp_kernels
