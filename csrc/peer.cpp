// A rank's view of its group's symmetric workspace: peer tables, flags, bounded waits and the
// error word; and the allocation / IPC helpers that build the workspace. See peer.h.
#include "tp_kernels/peer.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <sstream>

#include "tp_kernels/check.h"
#include "tp_kernels/detail.h"
#include "tp_kernels/driver.h"

namespace tp_kernels {
namespace {


constexpr uint32_t kCodeTag = 0x80000000u;

// The one list of each region's and algorithm's name, in enum order.
const char* const kRegionNames[kNumRegions] = {"export", "inbox", "export2"};
const char* const kAlgorithmNames[] = {"one_shot", "two_shot", "scatter_gather"};

// Error code of a wait: the op and the flag index (whose region, kind and peer it names).
uint32_t wait_code(Primitive op, int index) {
  return kCodeTag | (static_cast<uint32_t>(op) << 16) | static_cast<uint32_t>(index);
}

const char* op_name(uint32_t op) {
  return op <= static_cast<uint32_t>(Primitive::kMatmulAllReduce) ? primitive_name(static_cast<Primitive>(op))
                                                                   : "unknown op";
}

// What a rank waits for on flag (region, release) of a peer: region-specific words, one per region.
const char* flag_meaning(int region, bool release) {
  static const char* ready[] = {"its exported data to be ready", "its partial to arrive in this rank's inbox",
                                "its second exported buffer to be ready"};
  static const char* released[] = {"it to finish reading this rank's exported data",
                                   "it to consume what this rank delivered to its inbox",
                                   "it to finish reading this rank's second exported buffer"};
  return release ? released[region] : ready[region];
}

}  // namespace

const char* region_name(Region c) { return kRegionNames[static_cast<int>(c)]; }

std::vector<std::string> region_names() { return {std::begin(kRegionNames), std::end(kRegionNames)}; }

const char* algorithm_name(AllReduceAlgo algo) { return kAlgorithmNames[static_cast<int>(algo)]; }

std::vector<std::string> algorithm_names() { return {std::begin(kAlgorithmNames), std::end(kAlgorithmNames)}; }

AllReduceAlgo parse_algorithm(const std::string& name, const std::string& arg) {
  return static_cast<AllReduceAlgo>(parse_name(kAlgorithmNames, name, arg));
}

std::vector<uint32_t> initial_control_block() {
  std::vector<uint32_t> words(kControlBytes / sizeof(uint32_t), 0);
  for (int c = 0; c < kNumRegions; ++c)
    for (int q = 0; q < kMaxRanks; ++q) words[flag_index(static_cast<Region>(c), true, q)] = 1;
  return words;
}

size_t region_offset(const std::vector<size_t>& region_bytes, Region c) {
  size_t offset = kControlBytes;
  for (int i = 0; i < static_cast<int>(c); ++i) offset += region_bytes[i];
  return offset;
}

PeerContext::PeerContext(int rank, int size, int device, const std::vector<uintptr_t>& bases,
                         const std::vector<size_t>& region_bytes, double timeout_s, int sharing)
    : rank_(rank), size_(size), device_(device), timeout_s_(timeout_s), sharing_(sharing) {
  if (size < 1 || size > kMaxRanks)
    throw Error("PeerContext: size must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(size));
  if (rank < 0 || rank >= size)
    throw Error("PeerContext: rank " + std::to_string(rank) + " is not in [0, " + std::to_string(size) + ")");
  if (static_cast<int>(bases.size()) != size)
    throw Error("PeerContext: expected " + std::to_string(size) + " workspace buffers, got " +
                std::to_string(bases.size()));
  for (int q = 0; q < size; ++q)
    if (bases[q] == 0) throw Error("PeerContext: null workspace buffer of rank " + std::to_string(q));
  if (region_bytes.size() != kNumRegions)
    throw Error("PeerContext: expected " + std::to_string(kNumRegions) + " region sizes, got " +
                std::to_string(region_bytes.size()));
  for (size_t b : region_bytes)
    if (b % kRegionAlignment != 0)
      throw Error("PeerContext: region sizes must be multiples of " + std::to_string(kRegionAlignment) + " bytes");
  if (!(timeout_s > 0)) throw Error("PeerContext: timeout_s must be positive");
  if (sharing < 1 || sharing > size)
    throw Error("PeerContext: sharing (the ranks on this GPU) must be in [1, " + std::to_string(size) + "], got " +
                std::to_string(sharing));
  for (uintptr_t b : bases) bases_.push_back(reinterpret_cast<char*>(b));
  region_bytes_ = region_bytes;
  DeviceGuard guard(device);
  int least = 0, greatest = 0;
  TPK_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  TPK_CHECK_CUDA(cudaStreamCreateWithPriority(&copy_stream_, cudaStreamNonBlocking, greatest));
  void* host = nullptr;
  cudaError_t err = cudaHostAlloc(&host, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaStreamDestroy(copy_stream_);
    TPK_CHECK_CUDA(err);
  }
  error_word_ = static_cast<uint32_t*>(host);
  *reinterpret_cast<volatile uint32_t*>(error_word_) = 0;
  load_kernels();  // here, not at a first launch that a CUDA-graph capture may hold
}

PeerContext::~PeerContext() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  cudaStreamSynchronize(copy_stream_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  cudaStreamDestroy(copy_stream_);
  cudaFreeHost(error_word_);
  cudaSetDevice(previous);
}

void PeerContext::set_timeout_s(double timeout_s) {
  if (!(timeout_s > 0)) throw Error("PeerContext: timeout_s must be positive");
  timeout_s_.store(timeout_s);
}

void* PeerContext::region(int q, Region c, size_t offset) const {
  return bases_[q] + region_offset(region_bytes_, c) + offset;
}

cudaEvent_t PeerContext::event(size_t i) {
  while (events_.size() <= i) {
    cudaEvent_t e = nullptr;
    TPK_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events_.push_back(e);
  }
  return events_[i];
}

uint64_t PeerContext::timeout_ns() const {
  const double ns = timeout_s_.load() * 1e9;
  return ns > 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(ns);
}

uint32_t* PeerContext::flag(int q, int index) const {
  return reinterpret_cast<uint32_t*>(bases_[q]) + index;
}

FlagWrites PeerContext::signals(const std::vector<int>& peers, Region c, bool release) const {
  FlagWrites list{};
  for (size_t i = 0; i < peers.size(); ++i) {
    list.flag[i] = flag(peers[i], flag_index(c, release, rank_));
    list.value[i] = release ? 1u : call_word_;
  }
  return list;
}

FlagList PeerContext::waits(const std::vector<int>& peers, Region c, bool release, Primitive op) const {
  FlagList list{};
  for (size_t i = 0; i < peers.size(); ++i) {
    const int index = flag_index(c, release, peers[i]);
    list.flag[i] = flag(rank_, index);
    list.code[i] = wait_code(op, index);
    list.expect[i] = release ? 0u : call_word_;
  }
  return list;
}

void PeerContext::signal_all(Region c, bool release, cudaStream_t stream) {
  const std::vector<int> peers = others();  // one launch for them all (a stream write each would be p - 1 operations)
  const FlagWrites list = signals(peers, c, release);
  write_flags(list.flag, list.value, static_cast<int>(peers.size()), stream);
}

void PeerContext::wait(const std::vector<int>& peers, Region c, bool release, Primitive op, cudaStream_t stream) {
  const FlagList list = waits(peers, c, release, op);
  wait_flags(list.flag, list.code, list.expect, static_cast<int>(peers.size()), timeout_ns(), error_word_, stream);
}

void PeerContext::all_reduce(const void* src, void* out, int64_t count, bool two_shot, int64_t slice, DType dtype,
                             int stages, Primitive op, cudaStream_t stream) {
  const std::vector<int> peers = others();  // entry i of every list: the same peer
  auto flags = [&](Region c) {
    return RegionFlags{waits(peers, c, true, op), waits(peers, c, false, op), signals(peers, c, false),
                       signals(peers, c, true)};
  };
  AllReduceParams a{};
  a.export_flags = flags(Region::kExport);
  if (two_shot) a.export2_flags = flags(Region::kExport2);
  for (int q = 0; q < size_; ++q) {
    a.exports.in[q] = region(q, Region::kExport);
    if (two_shot) a.exports2.in[q] = region(q, Region::kExport2);
  }
  a.src = src;
  a.out = out;
  a.count = count;
  a.slice = two_shot ? slice : 0;
  a.rank = rank_;
  a.p = size_;
  a.two_shot = two_shot ? 1 : 0;
  a.stages = stages;
  a.timeout_ns = timeout_ns();
  a.error_word = error_word_;
  a.arrivals = flag(rank_, kArrivalIndex);
  peer_all_reduce(a, dtype, sharing_, stream);
}

std::vector<int> PeerContext::others() const {
  std::vector<int> out;
  for (int s = 1; s < size_; ++s) out.push_back((rank_ + s) % size_);
  return out;
}

uint32_t PeerContext::error_code() const { return *reinterpret_cast<volatile uint32_t*>(error_word_); }

std::string PeerContext::describe(uint32_t code) const {
  if ((code & kCodeTag) == 0) return "";
  const uint32_t op = (code >> 16) & 0x3fffu;
  const int index = static_cast<int>(code & 0xffffu);
  const int peer = index % kMaxRanks, kind = index / kMaxRanks;
  std::ostringstream msg;
  msg << "fused " << op_name(op) << ": ";
  if (code & kMismatchBit) {
    msg << "rank " << rank_ << " waited for rank " << peer << " (for " << flag_meaning(kind / 2, kind % 2 == 1)
        << ") and got the signal of another call (another op, algorithm, dtype, shape or chunking): the ranks "
           "disagree on their arguments, or are out of step in their sequences of fused ops. The result of that call "
           "and of every fused call on this group after it is not valid. TP_KERNELS_FINGERPRINTS=1 "
           "(tp_kernels.settings.set_fingerprints) compares every call's arguments across the group before any data "
           "moves, and says what differs.";
  } else {
    msg << "rank " << rank_ << " waited more than " << timeout_s_.load() << " s for rank " << peer << " (for "
        << flag_meaning(kind / 2, kind % 2 == 1)
        << "): the peer is missing, dead or out of step with this rank's sequence of fused ops.";
  }
  msg << " This group's fused workspace cannot be used again: destroy and re-create the group "
         "(tp_kernels.destroy_model_parallel).";
  return msg.str();
}

void PeerContext::check() const {
  const uint32_t code = error_code();
  if (code != 0) throw Error(describe(code));
}

uint32_t call_word(Primitive op, int algo, const OverlapArgs& args) {
  uint32_t h = 2166136261u;  // FNV-1a over the 64-bit values, byte by byte
  auto mix = [&h](int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint32_t>((static_cast<uint64_t>(v) >> (8 * b)) & 0xffu);
      h *= 16777619u;
    }
  };
  mix(static_cast<int64_t>(op));
  mix(algo);
  mix(args.w != nullptr);
  mix(static_cast<int64_t>(args.dtype));
  mix(args.n);
  mix(args.k);
  mix(static_cast<int64_t>(args.bounds.size()));
  for (int64_t b : args.bounds) mix(b);
  return h > 1u ? h : h + 2u;  // 0 is a clear flag, 1 a release
}

std::vector<size_t> fused_region_needs(Primitive op, int p, int64_t m, int64_t n, int64_t k, DType dtype,
                                       AllReduceAlgo algo) {
  if (p < 1 || p > kMaxRanks)
    throw ArgumentError("p: must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(p));
  if (m < 0 || n < 0 || k < 0) throw ArgumentError("m, n, k: negative dimension");
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  const int64_t block = (m + p - 1) / p;
  int64_t bytes[kNumRegions] = {0, 0, 0};  // export, inbox, export2
  switch (op) {
    case Primitive::kAllGatherMatmul:
      bytes[static_cast<int>(Region::kExport)] = (m / p) * k * es;
      break;
    case Primitive::kMatmulReduceScatter:
      bytes[static_cast<int>(Region::kInbox)] = m * n * es;
      break;
    case Primitive::kMatmulAllReduce:
      switch (algo) {
        case AllReduceAlgo::kOneShot:
          bytes[static_cast<int>(Region::kExport)] = m * n * es;
          break;
        case AllReduceAlgo::kTwoShot:
          bytes[static_cast<int>(Region::kExport)] = m * n * es;
          bytes[static_cast<int>(Region::kExport2)] = two_shot_slice(m * n, p, dtype) * es;
          break;
        case AllReduceAlgo::kScatterGather:
          bytes[static_cast<int>(Region::kInbox)] = p * block * n * es;
          bytes[static_cast<int>(Region::kExport)] = block * n * es;
          break;
      }
      break;
  }
  std::vector<size_t> out;
  for (int64_t b : bytes)
    out.push_back(static_cast<size_t>((b + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment));
  return out;
}

AllReduceLayout all_reduce_layout(int64_t count, DType dtype) {
  const int64_t per_row = 16 / static_cast<int64_t>(dtype_size(dtype));
  const int64_t cols = count % per_row == 0 ? per_row : 1;
  return {count / cols, cols};
}

std::vector<size_t> fused_all_reduce_needs(int p, int64_t count, DType dtype, AllReduceAlgo algo) {
  if (count < 0) throw ArgumentError("count: negative");
  const AllReduceLayout l = all_reduce_layout(count, dtype);
  return fused_region_needs(Primitive::kMatmulAllReduce, p, l.rows, l.cols, l.cols, dtype, algo);
}

int64_t two_shot_slice(int64_t count, int p, DType dtype) {
  const int64_t align = 16 / static_cast<int64_t>(dtype_size(dtype));  // 16-byte aligned slices
  const int64_t per = (count + p - 1) / p;
  return (per + align - 1) / align * align;
}

uintptr_t workspace_alloc(size_t bytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  TPK_CHECK_CUDA(cudaMalloc(&p, bytes));
  return reinterpret_cast<uintptr_t>(p);
}

void workspace_free(uintptr_t ptr, int device) {
  DeviceGuard guard(device);
  TPK_CHECK_CUDA(cudaFree(reinterpret_cast<void*>(ptr)));
}

void workspace_init(uintptr_t ptr, int device) {
  DeviceGuard guard(device);
  const std::vector<uint32_t> words = initial_control_block();
  TPK_CHECK_CUDA(cudaMemcpy(reinterpret_cast<void*>(ptr), words.data(), kControlBytes, cudaMemcpyHostToDevice));
}

std::string ipc_handle(uintptr_t ptr, int device) {
  DeviceGuard guard(device);
  cudaIpcMemHandle_t handle;
  TPK_CHECK_CUDA(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)));
  return std::string(handle.reserved, sizeof(handle.reserved));
}

uintptr_t ipc_open(const std::string& bytes, int device) {
  cudaIpcMemHandle_t handle;
  if (bytes.size() != sizeof(handle.reserved))
    throw Error("ipc_open: a CUDA IPC handle is " + std::to_string(sizeof(handle.reserved)) + " bytes, got " +
                std::to_string(bytes.size()));
  std::memcpy(handle.reserved, bytes.data(), sizeof(handle.reserved));
  DeviceGuard guard(device);
  void* p = nullptr;
  TPK_CHECK_CUDA(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<uintptr_t>(p);
}

void ipc_close(uintptr_t ptr, int device) {
  DeviceGuard guard(device);
  TPK_CHECK_CUDA(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)));
}

}  // namespace tp_kernels
