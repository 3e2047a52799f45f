// The host side of the peer-memory path's device building blocks: flags, bounded waits and the
// deterministic reduction (device_ops.h), over the driver and the NVRTC-built kernels (driver.h).
#include "tp_kernels/device_ops.h"

#include <algorithm>
#include <string>

#include "tp_kernels/check.h"
#include "tp_kernels/driver.h"

namespace tp_kernels {

bool stream_memory_ops_available() { return driver_error().empty(); }

void write_flag(uint32_t* flag, uint32_t value, cudaStream_t stream) {
  if (!driver_error().empty()) throw Error("write_flag: " + driver_error());
  stream_write_value32(flag, value, stream);
}

namespace {

// The checks of a list of `count` flags that `fn` (write_flags, wait_flags) takes.
void check_flag_count(const char* fn, int count) {
  if (count < 0 || count > kMaxRanks)
    throw ArgumentError(std::string("flags: ") + fn + " takes 0 to " + std::to_string(kMaxRanks) + " flags, got " +
                        std::to_string(count));
}

// The kernel of a summing family (its float32 member, followed in Kernel by its float16 and
// bfloat16 ones) for `dtype`; `fn` names the caller in the error for another dtype.
Kernel summing_kernel(const char* fn, Kernel float32, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return float32;
    case DType::kFloat16: return static_cast<Kernel>(static_cast<int>(float32) + 1);
    case DType::kBFloat16: return static_cast<Kernel>(static_cast<int>(float32) + 2);
    default: throw Error(std::string(fn) + ": no reduction in " + dtype_name(dtype));
  }
}

uint32_t* checked_flag(const char* fn, uint32_t* const* flags, int i) {
  if (flags[i] == nullptr) throw ArgumentError(std::string("flags: ") + fn + " got a null flag " + std::to_string(i));
  return flags[i];
}

// Error code i of a flag wait of `fn`: nonzero, with kMismatchBit clear (the kernel sets it).
uint32_t checked_code(const char* fn, uint32_t code, int i) {
  if (code == 0 || (code & kMismatchBit) != 0)
    throw ArgumentError(std::string("codes: ") + fn + "' error code " + std::to_string(i) +
                        " must be nonzero, with MISMATCH_BIT (0x40000000) clear");
  return code;
}

}  // namespace

void write_flags(uint32_t* const* flags, const uint32_t* values, int count, cudaStream_t stream) {
  check_flag_count("write_flags", count);
  FlagWrites list{};
  for (int i = 0; i < count; ++i) {
    list.flag[i] = checked_flag("write_flags", flags, i);
    list.value[i] = values[i];
  }
  if (count == 0) return;
  void* args[] = {&list, &count};
  launch(Kernel::kSetFlags, 1, 32, args, stream);  // one thread per flag: kMaxRanks <= 32
}

void wait_flags(uint32_t* const* flags, const uint32_t* codes, const uint32_t* expect, int count, uint64_t timeout_ns,
                uint32_t* error_word, cudaStream_t stream) {
  check_flag_count("wait_flags", count);
  if (error_word == nullptr) throw ArgumentError("error_word: wait_flags got a null error word");
  FlagList list{};
  for (int i = 0; i < count; ++i) {
    list.flag[i] = checked_flag("wait_flags", flags, i);
    list.code[i] = checked_code("wait_flags", codes[i], i);
    list.expect[i] = expect == nullptr ? 0 : expect[i];
  }
  if (count == 0) return;
  unsigned long long timeout = timeout_ns;
  unsigned int* error = error_word;
  void* args[] = {&list, &count, &timeout, &error};
  launch(Kernel::kWaitFlags, 1, 32, args, stream);  // one thread per flag: kMaxRanks <= 32
}

void reduce_partials(const void* const* in, int p, void* out, int64_t count, DType dtype, cudaStream_t stream) {
  if (count == 0) return;
  const Kernel kernel = summing_kernel("reduce_partials", Kernel::kReduceFloat32, dtype);
  PartialPtrs ptrs{};
  for (int q = 0; q < p; ++q) ptrs.in[q] = in[q];
  const int threads = 256;
  int64_t blocks = (count + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(multiprocessor_count()) * 8;
  if (blocks > cap) blocks = cap;
  long long n = count;
  void* args[] = {&ptrs, &p, &out, &n};
  launch(kernel, static_cast<unsigned>(blocks), threads, args, stream);
}

void peer_all_reduce(const AllReduceParams& a, DType dtype, int sharing, cudaStream_t stream) {
  const char* fn = "peer_all_reduce";
  if (a.p < 1 || a.p > kMaxRanks || a.rank < 0 || a.rank >= a.p)
    throw ArgumentError(std::string(fn) + ": rank " + std::to_string(a.rank) + " of " + std::to_string(a.p) +
                        " ranks, expected 0 <= rank < p <= " + std::to_string(kMaxRanks));
  if (a.count < 0) throw ArgumentError(std::string(fn) + ": negative count");
  if (sharing < 1 || sharing > a.p)
    throw ArgumentError(std::string(fn) + ": " + std::to_string(sharing) + " ranks on this GPU, expected 1.." +
                        std::to_string(a.p));
  if (a.two_shot != 0 && a.two_shot != 1) throw ArgumentError(std::string(fn) + ": two_shot must be 0 or 1");
  const int all = kStagePublish | kStageReduce | (a.two_shot ? kStageGather : 0);
  if (a.stages <= 0 || (a.stages & ~all) != 0)
    throw ArgumentError(std::string(fn) + ": stages must be a nonempty set of kStagePublish, kStageReduce" +
                        (a.two_shot ? " and kStageGather" : " (kStageGather is two-shot's)"));
  if (a.two_shot && (a.slice < 0 || a.slice * a.p < a.count))
    throw ArgumentError(std::string(fn) + ": " + std::to_string(a.p) + " slices of " + std::to_string(a.slice) +
                        " elements do not cover " + std::to_string(a.count));
  if (a.error_word == nullptr || a.arrivals == nullptr || a.src == nullptr || a.out == nullptr)
    throw ArgumentError(std::string(fn) + ": null error word, counters, src or out");
  for (int q = 0; q < a.p; ++q)
    if (a.exports.in[q] == nullptr || (a.two_shot && a.exports2.in[q] == nullptr))
      throw ArgumentError(std::string(fn) + ": a null export region of rank " + std::to_string(q));
  auto check_flags = [&](const RegionFlags& f) {
    for (int i = 0; i < a.p - 1; ++i) {
      if (f.release.flag[i] == nullptr || f.ready.flag[i] == nullptr || f.signal_ready.flag[i] == nullptr ||
          f.signal_release.flag[i] == nullptr)
        throw ArgumentError(std::string(fn) + ": a null flag of peer " + std::to_string(i));
      checked_code(fn, f.release.code[i], i);
      checked_code(fn, f.ready.code[i], i);
    }
  };
  check_flags(a.export_flags);
  if (a.two_shot) check_flags(a.export2_flags);
  const Kernel kernel = summing_kernel(fn, Kernel::kAllReduceFloat32, dtype);
  const int threads = kAllReduceThreads;
  const int64_t per = static_cast<int64_t>(16 / dtype_size(dtype));  // elements a thread moves at once
  const int64_t items = (a.count + per - 1) / per;
  int64_t blocks = std::max<int64_t>(1, (items + threads - 1) / threads);
  blocks = std::min<int64_t>(blocks, std::max(1, std::min(32, multiprocessor_count() / sharing)));
  AllReduceParams copy = a;
  void* args[] = {&copy};
  launch(kernel, static_cast<unsigned>(blocks), threads, args, stream);
}

}  // namespace tp_kernels
