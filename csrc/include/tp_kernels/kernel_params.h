// What the host passes to the device kernels (csrc/kernels/kernels.cu), by value: one definition
// for both sides. The kernels are compiled by NVRTC, which has no standard library, so only
// built-in types appear here.
#pragma once

namespace tp_kernels {

// The most ranks a peer-memory group has (every per-rank table is this long).
constexpr int kMaxRanks = 8;

// tpk_wait_flags: flag[i] is waited for (i < count); code[i] is its nonzero error code.
struct FlagList {
  unsigned int* flag[kMaxRanks];
  unsigned int code[kMaxRanks];
};

// tpk_reduce_partials_*: the p partial buffers, summed in this order.
struct PartialPtrs {
  const void* in[kMaxRanks];
};

}  // namespace tp_kernels
