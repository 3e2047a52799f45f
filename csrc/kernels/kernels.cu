// The device code of tp_kernels._C: the bounded flag wait, the flag writes, the deterministic
// reduction and the one-shot and two-shot all-reduces of the peer-memory path (device_ops.h says what each
// does). Compiled at build time by NVRTC (_build/compile_kernels.py) into a cubin per
// architecture and a PTX, which driver.cpp loads and launches by the extern "C" names below
// (driver.h's kernel list).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tp_kernels/kernel_params.h"

namespace {

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// The sum of 16 bytes of T at item i (16-byte items) of each of the p partials, accumulated in fp32
// in rank order and rounded to T (sum_element's bits for each element). Every partial's load is
// issued before the first is used (p 16-byte loads in flight a thread): one load at a time, each
// waited for before the next, left the sum bound by the memory's latency. Peers' data is loaded
// past L1 (ld.global.cg).
template <typename T>
__device__ __forceinline__ uint4 sum_vector(const void* const* parts, int p, long long i) {
  constexpr int kPer = 16 / sizeof(T);
  uint4 raw[tp_kernels::kMaxRanks];
#pragma unroll
  for (int q = 0; q < tp_kernels::kMaxRanks; ++q)  // unrolled: parts and raw stay in registers
    if (q < p) raw[q] = __ldcg(static_cast<const uint4*>(parts[q]) + i);
  float acc[kPer];
  for (int e = 0; e < kPer; ++e) acc[e] = to_float(reinterpret_cast<const T*>(&raw[0])[e]);
#pragma unroll
  for (int q = 1; q < tp_kernels::kMaxRanks; ++q)
    if (q < p)
      for (int e = 0; e < kPer; ++e) acc[e] += to_float(reinterpret_cast<const T*>(&raw[q])[e]);
  uint4 v;
  for (int e = 0; e < kPer; ++e) reinterpret_cast<T*>(&v)[e] = from_float<T>(acc[e]);
  return v;
}

template <typename T>
__device__ __forceinline__ T sum_element(const void* const* parts, int p, long long i) {
  float acc = to_float(__ldcg(static_cast<const T*>(parts[0]) + i));
#pragma unroll
  for (int q = 1; q < tp_kernels::kMaxRanks; ++q) {
    if (q >= p) break;
    acc += to_float(__ldcg(static_cast<const T*>(parts[q]) + i));
  }
  return from_float<T>(acc);
}

// Each element is summed by one thread, q = 0..p-1 in order: the result is the same bits for
// every launch configuration and chunking.
template <typename T>
__device__ __forceinline__ void reduce_partials(const tp_kernels::PartialPtrs& ptrs, int p, void* out, long long count) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    static_cast<T*>(out)[i] = sum_element<T>(ptrs.in, p, i);
}

// The all-reduce's flag accesses (PTX's memory consistency model): a poll is an acquire load at
// system scope, so what the peer wrote before its flag is read after it; a signal a release store
// at system scope, so what this rank wrote and read before it (its blocks' too, through the arrival
// count) is done first; the arrival count an acq_rel atomic at GPU scope (only this rank's blocks
// share it). No full fence (fence.sc.sys, __threadfence_system): volatile accesses each beside one
// took 3.3-3.7 us more a one-shot call of <= 64 KiB on 8 virtual ranks of an H200
// (docs/benchmarks.md, the seventh run).
__device__ __forceinline__ unsigned int load_acquire_sys(const volatile unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(unsigned int* p, unsigned int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void store_relaxed_sys(unsigned int* p, unsigned int v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int add_acq_rel_gpu(unsigned int* p, unsigned int v) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0; }

// How often a wait reads the error word: it lies in mapped host memory, so each read crosses
// PCIe (about a microsecond), where the flags are the GPU's own memory. A wait reads it every
// kErrorPollNs of polling (none in a wait that ends sooner), not on every poll.
constexpr unsigned long long kErrorPollNs = 8192;

// Waits until flag i of `list` is set (polling every sleep_ns) and returns the value seen, or 0
// when it gives up: the error word found set (an earlier wait failed: drain the stream; read every
// kErrorPollNs), or timeout_ns passed (code i recorded in the error word, if it is still 0). A
// value other than expect[i] (when that is not 0) records code i | kMismatchBit. The flag is left
// as it is. `acquire`: each poll an acquire load (the all-reduce's), else a volatile one (tpk_wait_flags').
__device__ unsigned int await_flag(const tp_kernels::FlagList& list, int i, unsigned long long timeout_ns,
                                   unsigned int* error_word, unsigned int sleep_ns, bool acquire = false) {
  volatile unsigned int* flag = list.flag[i];
  volatile unsigned int* error = error_word;
  const unsigned long long start = global_timer_ns();
  unsigned long long read_error = start + kErrorPollNs;  // when the error word is read next
  unsigned int seen;
  while ((seen = acquire ? load_acquire_sys(flag) : *flag) == 0) {
    const unsigned long long now = global_timer_ns();
    if (now >= read_error) {
      if (*error != 0) return 0;
      read_error = now + kErrorPollNs;
    }
    if (now - start > timeout_ns) {
      atomicCAS(error_word, 0u, list.code[i]);
      __threadfence_system();
      return 0;
    }
    __nanosleep(sleep_ns);
  }
  if (list.expect[i] != 0 && seen != list.expect[i])
    atomicCAS(error_word, 0u, list.code[i] | tp_kernels::kMismatchBit);
  return seen;
}

// Thread i (< count) polls flag i of `list` until it is set, without clearing it (await_flag,
// polling every 32 ns, each poll an acquire load). Every thread of the block returns after it.
__device__ void poll_flags(const tp_kernels::FlagList& list, int count, unsigned long long timeout_ns,
                           unsigned int* error_word) {
  const int i = threadIdx.x;
  if (i < count) await_flag(list, i, timeout_ns, error_word, 32, true);
  __syncthreads();
}

// Each block of the grid calls this once, after its share of a stage: true in the last block to
// arrive, when what every block wrote and read before is complete and visible. The counter is
// zero again when it returns, for the next launch. The count's acq_rel atomic orders the blocks'
// work; the last block's release stores of its signals then carry it to the peers.
__device__ bool last_to_arrive(unsigned int* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    last = add_acq_rel_gpu(counter, 1u) == gridDim.x - 1;
    if (last) *counter = 0u;  // (every block has counted: the next launch, stream-ordered, reads 0)
  }
  __syncthreads();
  return last;
}

// Thread i (< count) clears this rank's flag i of `clear`, then writes peer i's flag of `writes`:
// the peer sets that flag of this rank again only after it has seen the write. The signal is a
// release store, which orders the clear and all before it.
__device__ void clear_then_signal(const tp_kernels::FlagList& clear, const tp_kernels::FlagWrites& writes, int count) {
  const int i = threadIdx.x;
  if (i >= count) return;
  store_relaxed_sys(clear.flag[i], 0u);
  store_release_sys(writes.flag[i], writes.value[i]);
}

// A thread's loads in flight in the all-reduce's copies and sums: a copy that stores each 16-byte
// item before it loads the next keeps one load outstanding a thread and is bound by the memory's
// latency, not its bandwidth (the stores may alias the loads, so the compiler cannot reorder them).
constexpr int kUnroll = 4;

// `items` items of V from src to dst, this thread's share of them (from `first`, every `stride`),
// kUnroll loads before their stores. Loaded past L1 (a peer's data, written by another GPU).
template <typename V>
__device__ __forceinline__ void copy_share(const V* src, V* dst, long long items, long long first, long long stride) {
  long long i = first;
  for (; i + (kUnroll - 1) * stride < items; i += kUnroll * stride) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < items; i += stride) dst[i] = __ldcg(src + i);
}

// copy_share of 16-byte items when `vec`, else of single T.
template <typename T>
__device__ __forceinline__ void copy_items(const void* src, void* dst, long long items, bool vec, long long first,
                                           long long stride) {
  if (vec)
    copy_share(static_cast<const uint4*>(src), static_cast<uint4*>(dst), items, first, stride);
  else
    copy_share(static_cast<const T*>(src), static_cast<T*>(dst), items, first, stride);
}

// The start of rank q's slice of the two-shot all-reduce (every rank's slice but the last ones
// whole), and its length: [q slice, (q + 1) slice) within [0, count).
__device__ __forceinline__ long long slice_start(const tp_kernels::AllReduceParams& a, int q) {
  const long long lo = q * a.slice;
  return lo < a.count ? lo : a.count;
}

__device__ __forceinline__ long long slice_length(const tp_kernels::AllReduceParams& a, int q) {
  const long long hi = (q + 1) * a.slice;
  return (hi < a.count ? hi : a.count) - slice_start(a, q);
}

template <typename T>
__device__ __forceinline__ const void* offset(const void* base, long long elements) {
  return static_cast<const char*>(base) + elements * static_cast<long long>(sizeof(T));
}

// The one-shot or two-shot all-reduce of rank a.rank (AllReduceParams, device_ops.h). A block does
// its share of the elements (grid-stride) and polls the peers' flags itself; no block waits for
// another: the last to arrive after a stage clears the flags the stage consumed and writes the ones
// it gives. One-shot sums every element into out; two-shot sums this rank's slice into out and its
// export2 region, then copies the peers' slices from theirs.
template <typename T>
__device__ void all_reduce(const tp_kernels::AllReduceParams& a) {
  using tp_kernels::kStageGather;
  using tp_kernels::kStagePublish;
  using tp_kernels::kStageReduce;
  constexpr int kPer = 16 / sizeof(T);
  const int peers = a.p - 1;
  const long long lo = a.two_shot ? slice_start(a, a.rank) : 0;  // the elements this rank sums
  const long long len = a.two_shot ? slice_length(a, a.rank) : a.count;
  const void* parts[tp_kernels::kMaxRanks];  // the partials from lo: this rank's own from src
  bool vec = a.count % kPer == 0 && (!a.two_shot || a.slice % kPer == 0) && aligned16(a.src) && aligned16(a.out);
#pragma unroll
  for (int q = 0; q < tp_kernels::kMaxRanks; ++q) {
    parts[q] = offset<T>(q == a.rank ? a.src : a.exports.in[q], lo);
    if (q < a.p) vec = vec && aligned16(a.exports.in[q]) && (!a.two_shot || aligned16(a.exports2.in[q]));
  }
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  if (a.stages & kStagePublish) {
    poll_flags(a.export_flags.release, peers, a.timeout_ns, a.error_word);  // the peers have read the last one
    copy_items<T>(a.src, const_cast<void*>(a.exports.in[a.rank]), vec ? a.count / kPer : a.count, vec, first, stride);
    if (last_to_arrive(&a.arrivals[0]))
      clear_then_signal(a.export_flags.release, a.export_flags.signal_ready, peers);
  }
  if (a.stages & kStageReduce) {
    poll_flags(a.export_flags.ready, peers, a.timeout_ns, a.error_word);  // every peer's partial is in place
    void* slice = nullptr;  // two-shot: this rank's export2 region, its slice of the sum for the peers
    if (a.two_shot) {
      poll_flags(a.export2_flags.release, peers, a.timeout_ns, a.error_word);  // the peers have read its last slice
      slice = const_cast<void*>(a.exports2.in[a.rank]);
    }
    void* out = const_cast<void*>(offset<T>(a.out, lo));
    const long long items = vec ? len / kPer : len;
    for (long long i = first; i < items; i += stride) {
      if (vec) {
        const uint4 v = sum_vector<T>(parts, a.p, i);
        static_cast<uint4*>(out)[i] = v;
        if (slice != nullptr) static_cast<uint4*>(slice)[i] = v;
      } else {
        const T v = sum_element<T>(parts, a.p, i);
        static_cast<T*>(out)[i] = v;
        if (slice != nullptr) static_cast<T*>(slice)[i] = v;
      }
    }
    if (last_to_arrive(&a.arrivals[1])) {
      clear_then_signal(a.export_flags.ready, a.export_flags.signal_release, peers);  // the peers' partials are read
      if (a.two_shot)  // this rank's slice is there
        clear_then_signal(a.export2_flags.release, a.export2_flags.signal_ready, peers);
    }
  }
  if (a.two_shot && (a.stages & kStageGather)) {
    poll_flags(a.export2_flags.ready, peers, a.timeout_ns, a.error_word);  // every peer's slice is in place
    for (int s = 1; s < a.p; ++s) {
      const int q = (a.rank + s) % a.p;
      const long long n = slice_length(a, q);
      copy_items<T>(a.exports2.in[q], const_cast<void*>(offset<T>(a.out, slice_start(a, q))), vec ? n / kPer : n, vec,
                    first, stride);
    }
    if (last_to_arrive(&a.arrivals[2]))
      clear_then_signal(a.export2_flags.ready, a.export2_flags.signal_release, peers);
  }
}

}  // namespace

// Thread i waits for flag i and clears it; past timeout_ns it records code i in *error_word (if
// still 0) and returns; a flag set to another value than expect[i] (when that is not 0) records
// code i | kMismatchBit. Once the error word is set, every wait returns within kErrorPollNs.
extern "C" __global__ void tpk_wait_flags(tp_kernels::FlagList list, int count, unsigned long long timeout_ns,
                                          unsigned int* error_word) {
  const int i = threadIdx.x;
  if (i >= count || await_flag(list, i, timeout_ns, error_word, 256) == 0) return;
  *static_cast<volatile unsigned int*>(list.flag[i]) = 0u;
  __threadfence_system();  // the clear (and an error) is visible before anything this stream does next
}

// Thread i writes value[i] to flag[i] (a peer's word, or this rank's), after a system-wide fence:
// one launch for the p - 1 flags a rank sets, where one stream write each would be p - 1
// operations. What the stream did before this kernel is complete (stream order), so a peer that
// sees the flag sees it too.
extern "C" __global__ void tpk_set_flags(tp_kernels::FlagWrites list, int count) {
  const int i = threadIdx.x;
  if (i >= count) return;
  __threadfence_system();
  *static_cast<volatile unsigned int*>(list.flag[i]) = list.value[i];
  __threadfence_system();
}

extern "C" __global__ void tpk_reduce_partials_float32(tp_kernels::PartialPtrs ptrs, int p, void* out, long long count) {
  reduce_partials<float>(ptrs, p, out, count);
}

extern "C" __global__ void tpk_reduce_partials_float16(tp_kernels::PartialPtrs ptrs, int p, void* out, long long count) {
  reduce_partials<__half>(ptrs, p, out, count);
}

extern "C" __global__ void tpk_reduce_partials_bfloat16(tp_kernels::PartialPtrs ptrs, int p, void* out,
                                                        long long count) {
  reduce_partials<__nv_bfloat16>(ptrs, p, out, count);
}

extern "C" __global__ void __launch_bounds__(tp_kernels::kAllReduceThreads, tp_kernels::kAllReduceBlocksPerSM)
    tpk_all_reduce_float32(tp_kernels::AllReduceParams a) {
  all_reduce<float>(a);
}

extern "C" __global__ void __launch_bounds__(tp_kernels::kAllReduceThreads, tp_kernels::kAllReduceBlocksPerSM)
    tpk_all_reduce_float16(tp_kernels::AllReduceParams a) {
  all_reduce<__half>(a);
}

extern "C" __global__ void __launch_bounds__(tp_kernels::kAllReduceThreads, tp_kernels::kAllReduceBlocksPerSM)
    tpk_all_reduce_bfloat16(tp_kernels::AllReduceParams a) {
  all_reduce<__nv_bfloat16>(a);
}
