// The fused primitives over the symmetric workspace (peer.h): copy engines move data between
// ranks' buffers while cuBLASLt multiplies on the caller's stream; readiness by flags.
#include <algorithm>
#include <string>

#include "tp_kernels/check.h"
#include "tp_kernels/detail.h"
#include "tp_kernels/peer.h"

namespace tp_kernels {
namespace {

using detail::gemm;
using detail::order;
using detail::row_ptr;
using detail::shape;

void copy(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes > 0) TPK_CHECK_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream));
}

// The workspace was sized for this call by the caller (fused_region_needs); a smaller one is a
// bug on the Python side, caught here before any peer's memory is touched.
void need_region(const PeerContext& ctx, Region c, int64_t bytes, const std::string& op) {
  if (bytes < 0 || static_cast<size_t>(bytes) > ctx.region_bytes(c)) {
    throw Error(op + ": the workspace's " + region_name(c) + " region holds " + std::to_string(ctx.region_bytes(c)) +
                " bytes, this call needs " + std::to_string(bytes));
  }
}

// Every phase of an op starts here, on the context's device and under its lock: an earlier
// error, and the call word its flags carry.
void start(PeerContext& ctx, uint32_t word) {
  ctx.check();
  ctx.begin(word);
}

// Phase k of an op runs when all of them run, or just that one (peer.h).
bool runs(int phase, int k) { return phase == kAllPhases || phase == k; }

// Phase k of a one-shot or two-shot all-reduce runs stage 1 << k of its kernel.
static_assert(kStagePublish == 1 << 0 && kStageReduce == 1 << 1 && kStageGather == 1 << 2, "phase k: stage 1 << k");

// Rows row..row+rows of this rank's partial into `dst` on the caller's stream: their GEMM, or,
// for the all-reduce alone (a.w == nullptr: x is the partial, [m, n]), a copy of x's rows.
void partial_rows(const OverlapArgs& a, int64_t row, int64_t rows, void* dst) {
  if (rows == 0) return;
  if (a.w != nullptr)
    gemm(a, row_ptr(a.x, row, a.k, a.dtype), dst, rows, nullptr);
  else
    copy(dst, row_ptr(a.x, row, a.n, a.dtype), rows * a.n * static_cast<int64_t>(dtype_size(a.dtype)), a.stream);
}

// The partial of destination blocks (rows bounds[d]..bounds[d+1]) in the order r + 1, ..., r:
// each remote block's GEMM goes to scratch and is pushed by the copy stream into its destination's
// inbox slot r while the next block multiplies (without a GEMM, x's rows are pushed as they are);
// the own block goes straight into the own inbox slot r. `slot_bytes` is the inbox slot stride.
// Its one wait needs every destination's release of earlier ops; its one signal, after the last
// push, tells every destination its partial has arrived (each waits for all of them anyway). A
// block may be empty (the all-reduce alone of fewer rows than ranks).
void scatter_partials(PeerContext& ctx, const OverlapArgs& a, const std::vector<int64_t>& blocks, int64_t slot_bytes,
                      Primitive op) {
  const int p = ctx.size(), r = ctx.rank();
  cudaStream_t cs = ctx.copy_stream();
  order(a.stream, cs, ctx.event(0));  // scratch and x come from the caller's stream
  ctx.wait(ctx.others(), Region::kInbox, true, op, cs);  // each has consumed what this rank put there last time
  for (int s = 1; s <= p; ++s) {
    const int d = (r + s) % p;
    const int64_t row = blocks[d], rows = blocks[d + 1] - blocks[d];
    const int64_t bytes = rows * a.n * static_cast<int64_t>(dtype_size(a.dtype));
    if (d == r) {
      partial_rows(a, row, rows, ctx.region(r, Region::kInbox, r * slot_bytes));
      continue;
    }
    const void* partial = row_ptr(a.x, row, a.n, a.dtype);  // the all-reduce alone: x is the partial
    if (a.w != nullptr) {
      void* product = row_ptr(a.scratch, row, a.n, a.dtype);
      partial_rows(a, row, rows, product);
      partial = product;
    }
    order(a.stream, cs, ctx.event(s));
    copy(ctx.region(d, Region::kInbox, r * slot_bytes), partial, bytes, cs);
  }
  ctx.signal_all(Region::kInbox, false, cs);
}

// The caller's stream consumes every peer's delivery (their scatter_partials).
void wait_inbox(PeerContext& ctx, const OverlapArgs& a, Primitive op) {
  ctx.wait(ctx.others(), Region::kInbox, false, op, a.stream);
}

// The p inbox slots summed in rank order into `out` (rows of this rank's block), then every
// source told its slot here is free again.
void reduce_inbox(PeerContext& ctx, const OverlapArgs& a, int64_t rows, int64_t slot_bytes, void* out) {
  const void* in[kMaxRanks];
  for (int q = 0; q < ctx.size(); ++q) in[q] = ctx.region(ctx.rank(), Region::kInbox, q * slot_bytes);
  reduce_partials(in, ctx.size(), out, rows * a.n, a.dtype, a.stream);
  ctx.signal_all(Region::kInbox, true, a.stream);
}

}  // namespace

int fused_phases(Primitive op, AllReduceAlgo algo) {
  if (op != Primitive::kMatmulAllReduce) return 2;
  return algo == AllReduceAlgo::kOneShot ? 2 : 3;
}

void fused_all_gather_matmul(PeerContext& ctx, const OverlapArgs& a, int phase) {
  const std::string op = "fused all_gather_matmul";
  const DeviceGuard device(ctx.device());
  auto guard = ctx.lock();
  start(ctx, call_word(Primitive::kAllGatherMatmul, -1, a));
  const int p = ctx.size(), r = ctx.rank();
  const int64_t mp = a.bounds.back(), es = static_cast<int64_t>(dtype_size(a.dtype));
  const size_t chunks = a.bounds.size() - 1;
  need_region(ctx, Region::kExport, mp * a.k * es, op + " (shard " + shape(mp, a.k) + ")");
  cudaStream_t cs = ctx.copy_stream();
  const std::vector<int> peers = ctx.others();
  if (runs(phase, 0)) {
    order(a.stream, cs, ctx.event(0));  // gathered comes from the caller's stream
    // Publish this rank's shard once every peer has finished reading the last one.
    ctx.wait(peers, Region::kExport, true, Primitive::kAllGatherMatmul, a.stream);
    copy(ctx.region(r, Region::kExport), a.x, mp * a.k * es, a.stream);
    ctx.signal_all(Region::kExport, false, a.stream);
    copy(row_ptr(a.scratch, r * mp, a.k, a.dtype), a.x, mp * a.k * es, a.stream);
  }
  if (!runs(phase, 1)) return;
  // Pull the peers' shards chunk by chunk, once every peer has published (one wait), and release
  // them all after the last (one signal); event 1 + (s - 1) * chunks + j marks chunk j of step s.
  ctx.wait(peers, Region::kExport, false, Primitive::kAllGatherMatmul, cs);
  for (int s = 1; s < p; ++s) {
    const int src = peers[s - 1];
    for (size_t j = 0; j < chunks; ++j) {
      const int64_t row = a.bounds[j], rows = a.bounds[j + 1] - row;
      copy(row_ptr(a.scratch, src * mp + row, a.k, a.dtype),
           static_cast<const char*>(ctx.region(src, Region::kExport)) + row * a.k * es, rows * a.k * es, cs);
      TPK_CHECK_CUDA(cudaEventRecord(ctx.event(1 + (s - 1) * chunks + j), cs));
    }
  }
  ctx.signal_all(Region::kExport, true, cs);
  // Multiply the own shard, then each chunk as it lands.
  for (int s = 0; s < p; ++s) {
    const int src = s == 0 ? r : peers[s - 1];
    for (size_t j = 0; j < chunks; ++j) {
      const int64_t row = src * mp + a.bounds[j];
      if (s > 0) TPK_CHECK_CUDA(cudaStreamWaitEvent(a.stream, ctx.event(1 + (s - 1) * chunks + j), 0));
      gemm(a, row_ptr(a.scratch, row, a.k, a.dtype), row_ptr(a.out, row, a.n, a.dtype), a.bounds[j + 1] - a.bounds[j],
           a.bias);
    }
  }
  order(cs, a.stream, ctx.event(1 + (p - 1) * chunks));
}

void fused_matmul_reduce_scatter(PeerContext& ctx, const OverlapArgs& a, int phase) {
  const std::string op = "fused matmul_reduce_scatter";
  const DeviceGuard device(ctx.device());
  auto guard = ctx.lock();
  start(ctx, call_word(Primitive::kMatmulReduceScatter, -1, a));
  const int p = ctx.size();
  const int64_t mp = a.bounds.back(), es = static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t slot = mp * a.n * es;
  need_region(ctx, Region::kInbox, p * slot, op + " (partials " + shape(p * mp, a.n) + ")");
  if (runs(phase, 0)) {
    std::vector<int64_t> blocks;
    for (int d = 0; d <= p; ++d) blocks.push_back(d * mp);
    scatter_partials(ctx, a, blocks, slot, Primitive::kMatmulReduceScatter);
  }
  if (!runs(phase, 1)) return;
  wait_inbox(ctx, a, Primitive::kMatmulReduceScatter);
  reduce_inbox(ctx, a, mp, slot, a.out);
  order(ctx.copy_stream(), a.stream, ctx.event(p + 1));
}

namespace {

// out = AR(partial) by `algo`, the partial being x W^T, or x itself when a.w == nullptr (the
// all-reduce alone). `op` names the call in messages.
void all_reduce(PeerContext& ctx, const OverlapArgs& a, AllReduceAlgo algo, int phase, const std::string& op) {
  const Primitive id = Primitive::kMatmulAllReduce;
  const DeviceGuard device(ctx.device());
  auto guard = ctx.lock();
  start(ctx, call_word(id, static_cast<int>(algo), a));
  const int p = ctx.size(), r = ctx.rank();
  const int64_t es = static_cast<int64_t>(dtype_size(a.dtype));
  const std::vector<int> peers = ctx.others();
  if (algo == AllReduceAlgo::kOneShot || algo == AllReduceAlgo::kTwoShot) {
    // The partial into out (its GEMM), then one kernel a phase (PeerContext::all_reduce): phase k
    // runs stage 1 << k (publish, reduce, two-shot's gather), every phase all of them.
    const bool two_shot = algo == AllReduceAlgo::kTwoShot;
    const int64_t m = a.bounds.back(), count = m * a.n;
    need_region(ctx, Region::kExport, count * es, op + " (partial " + shape(m, a.n) + ")");
    const int64_t slice = two_shot ? two_shot_slice(count, p, a.dtype) : 0;
    if (two_shot)
      need_region(ctx, Region::kExport2, slice * es, op + " (two-shot slice of " + std::to_string(slice) + ")");
    if (runs(phase, 0) && a.w != nullptr && m > 0) gemm(a, a.x, a.out, m, nullptr);
    const void* partial = a.w != nullptr ? a.out : a.x;  // the all-reduce alone: x is the partial
    const int stages = phase == kAllPhases ? kStagePublish | kStageReduce | (two_shot ? kStageGather : 0) : 1 << phase;
    ctx.all_reduce(partial, a.out, count, two_shot, slice, a.dtype, stages, id, a.stream);
    return;
  }
  int64_t block = 0;
  for (int d = 0; d < p; ++d) block = std::max(block, a.bounds[d + 1] - a.bounds[d]);
  const int64_t slot = block * a.n * es;
  need_region(ctx, Region::kInbox, p * slot, op + " (partial blocks of " + shape(block, a.n) + ")");
  need_region(ctx, Region::kExport, slot, op + " (reduced block " + shape(block, a.n) + ")");
  cudaStream_t cs = ctx.copy_stream();
  if (runs(phase, 0)) scatter_partials(ctx, a, a.bounds, slot, id);
  // This rank's block: summed into its export region, copied to out, and gathered by the peers.
  const int64_t rows = a.bounds[r + 1] - a.bounds[r];
  if (runs(phase, 1)) {
    wait_inbox(ctx, a, id);
    ctx.wait(peers, Region::kExport, true, id, a.stream);
    reduce_inbox(ctx, a, rows, slot, ctx.region(r, Region::kExport));
    ctx.signal_all(Region::kExport, false, a.stream);
    order(a.stream, cs, ctx.event(p + 1));
    copy(row_ptr(a.out, a.bounds[r], a.n, a.dtype), ctx.region(r, Region::kExport), rows * a.n * es, a.stream);
  }
  if (!runs(phase, 2)) return;
  ctx.wait(peers, Region::kExport, false, id, cs);  // every peer's block summed, then each copied
  for (int q : peers)
    copy(row_ptr(a.out, a.bounds[q], a.n, a.dtype), ctx.region(q, Region::kExport),
         (a.bounds[q + 1] - a.bounds[q]) * a.n * es, cs);
  ctx.signal_all(Region::kExport, true, cs);
  order(cs, a.stream, ctx.event(p + 2));
}

}  // namespace

void fused_matmul_all_reduce(PeerContext& ctx, const OverlapArgs& a, AllReduceAlgo algo, int phase) {
  all_reduce(ctx, a, algo, phase, "fused matmul_all_reduce");
}

void fused_all_reduce(PeerContext& ctx, const CollectiveArgs& c, AllReduceAlgo algo, int phase) {
  if (c.count == 0) return;
  const AllReduceLayout layout = all_reduce_layout(c.count, c.dtype);
  OverlapArgs a;
  a.x = c.x;
  a.out = c.out;
  a.n = a.k = layout.cols;
  a.dtype = c.dtype;
  a.stream = c.stream;
  if (algo == AllReduceAlgo::kScatterGather) {  // p blocks of at most ceil(rows / p) rows, as fused_region_needs sizes them
    const int p = ctx.size();
    const int64_t block = (layout.rows + p - 1) / p;
    for (int d = 0; d <= p; ++d) a.bounds.push_back(std::min<int64_t>(d * block, layout.rows));
  } else {
    a.bounds = {0, layout.rows};
  }
  all_reduce(ctx, a, algo, phase, "fused all_reduce");
}

}  // namespace tp_kernels
