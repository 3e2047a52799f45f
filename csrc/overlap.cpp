// The pipelined primitives: GEMM chunks on the caller's stream (or alternating between it and a
// side stream), their communication on the communicator's stream, ordered by events (see
// overlap.h for the contract).
#include "tp_kernels/overlap.h"

#include <iterator>
#include <string>

#include "tp_kernels/check.h"
#include "tp_kernels/detail.h"

namespace tp_kernels {
namespace {

// The one list of the primitives' names (Python reads it as _C.OPS), in enum order.
const char* const kPrimitiveNames[] = {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"};

using detail::gemm;
using detail::Lane;
using detail::main_lane;
using detail::nccl_type;
using detail::order;
using detail::row_ptr;
using detail::shape;

// The lanes of a call's `count` GEMMs: `stream` alone, or, with a side stream and several GEMMs,
// GEMM g on `stream` when g is even and on the side stream when g is odd. The side stream first
// waits for `stream` (event `first_event`); join() makes `stream` wait for it (event
// first_event + 1), and so does the destructor where a call ends by an error before join(), so
// that a capture is not left with a stream it cannot join.
class GemmLanes {
 public:
  GemmLanes(Communicator& comm, const OverlapArgs& a, size_t count, size_t first_event)
      : lanes_{main_lane(a), Lane{a.side_stream, a.side_workspace, a.side_workspace_bytes}},
        two_(a.side_stream != nullptr && count > 1),
        join_(two_ ? comm.event(first_event + 1) : nullptr) {
    if (two_) order(a.stream, a.side_stream, comm.event(first_event));
  }
  ~GemmLanes() {  // an error path, best effort (a destructor does not throw)
    if (two_ && !joined_ && cudaEventRecord(join_, lanes_[1].stream) == cudaSuccess)
      cudaStreamWaitEvent(lanes_[0].stream, join_, 0);
  }
  GemmLanes(const GemmLanes&) = delete;
  GemmLanes& operator=(const GemmLanes&) = delete;

  const Lane& operator[](size_t g) const { return lanes_[two_ ? g % 2 : 0]; }

  void join() {
    if (!two_ || joined_) return;
    joined_ = true;
    order(lanes_[1].stream, lanes_[0].stream, join_);
  }

 private:
  const Lane lanes_[2];
  const bool two_;
  bool joined_ = false;
  cudaEvent_t join_;
};

}  // namespace

const char* primitive_name(Primitive op) { return kPrimitiveNames[static_cast<int>(op)]; }

std::vector<std::string> primitive_names() { return {std::begin(kPrimitiveNames), std::end(kPrimitiveNames)}; }

Primitive parse_primitive(const std::string& name, const std::string& arg) {
  return static_cast<Primitive>(parse_name(kPrimitiveNames, name, arg));
}

void all_gather_matmul(Communicator& comm, const OverlapArgs& a) {
  const DeviceGuard device(comm.device());
  const int p = comm.size(), r = comm.rank();
  const int64_t mp = a.bounds.back();
  const size_t chunks = a.bounds.size() - 1;
  const std::string what = "all_gather_matmul (ring all-gather of " + shape(mp, a.k) + " shards)";
  auto guard = comm.lock(what);
  comm.check();
  cudaStream_t cs = comm.stream();
  void* own = row_ptr(a.scratch, r * mp, a.k, a.dtype);
  if (own != a.x)
    TPK_CHECK_CUDA(cudaMemcpyAsync(own, a.x, mp * a.k * dtype_size(a.dtype), cudaMemcpyDeviceToDevice, a.stream));
  // Event 0 releases the communication stream; event 1 + s*chunks + j marks piece j of the
  // shard received at ring step s.
  if (p > 1) {
    order(a.stream, cs, comm.event(0));
    const int next = a.ring_next, prev = a.ring_prev;
    for (int step = 0; step + 1 < p; ++step) {
      const int src = a.ring[step];      // the shard forwarded at this step
      const int dst = a.ring[step + 1];  // the shard arriving meanwhile
      for (size_t j = 0; j < chunks; ++j) {
        const int64_t a0 = a.bounds[j], rows = a.bounds[j + 1] - a0;
        const size_t count = static_cast<size_t>(rows * a.k);
        TPK_CHECK_NCCL(ncclGroupStart());
        comm.finish(ncclSend(row_ptr(a.scratch, src * mp + a0, a.k, a.dtype), count, nccl_type(a.dtype), next,
                             comm.nccl(), cs),
                    "ncclSend", what);
        comm.finish(ncclRecv(row_ptr(a.scratch, dst * mp + a0, a.k, a.dtype), count, nccl_type(a.dtype), prev,
                             comm.nccl(), cs),
                    "ncclRecv", what);
        comm.finish(ncclGroupEnd(), "ncclGroupEnd", what);
        TPK_CHECK_CUDA(cudaEventRecord(comm.event(1 + step * chunks + j), cs));
      }
    }
  }
  // (events 2 + (p - 1) * chunks and the next; the side stream forked after the own shard's copy)
  GemmLanes lanes(comm, a, p * chunks, 2 + (p - 1) * chunks);
  for (int step = 0; step < p; ++step) {
    const int src = a.ring[step];
    for (size_t j = 0; j < chunks; ++j) {
      const int64_t row = src * mp + a.bounds[j];
      const Lane& lane = lanes[step * chunks + j];
      if (step > 0) TPK_CHECK_CUDA(cudaStreamWaitEvent(lane.stream, comm.event(1 + (step - 1) * chunks + j), 0));
      gemm(a, lane, row_ptr(a.scratch, row, a.k, a.dtype), row_ptr(a.out, row, a.n, a.dtype),
           a.bounds[j + 1] - a.bounds[j], a.bias);
    }
  }
  lanes.join();
  if (p > 1) {
    order(cs, a.stream, comm.event(1 + (p - 1) * chunks));
    comm.watch(cs, what);
  }
}

void matmul_reduce_scatter(Communicator& comm, const OverlapArgs& a) {
  const DeviceGuard device(comm.device());
  const int p = comm.size();
  const int64_t mp = a.bounds.back();
  const size_t chunks = a.bounds.size() - 1;
  const std::string what = "matmul_reduce_scatter (reduce-scatter of " + shape(p * mp, a.n) + ")";
  auto guard = comm.lock(what);
  comm.check();
  cudaStream_t cs = comm.stream();
  GemmLanes lanes(comm, a, chunks, chunks + 1);  // (events chunks + 1 and chunks + 2)
  for (size_t j = 0; j < chunks; ++j) {
    const int64_t a0 = a.bounds[j], rows = a.bounds[j + 1] - a0;
    // Rows [a0, a0 + rows) of each destination's block, as p products; partial chunk j is
    // destination-major: [p, rows, n] at row p * a0.
    void* partial = row_ptr(a.scratch, p * a0, a.n, a.dtype);
    gemm(a, lanes[j], row_ptr(a.x, a0, a.k, a.dtype), partial, rows, nullptr, p, mp * a.k, rows * a.n);
    order(lanes[j].stream, cs, comm.event(j));
    comm.finish(ncclReduceScatter(partial, row_ptr(a.out, a0, a.n, a.dtype), static_cast<size_t>(rows * a.n),
                                  nccl_type(a.dtype), ncclSum, comm.nccl(), cs),
                "ncclReduceScatter", what);
  }
  lanes.join();
  order(cs, a.stream, comm.event(chunks));
  comm.watch(cs, what);
}

void matmul_all_reduce(Communicator& comm, const OverlapArgs& a) {
  const DeviceGuard device(comm.device());
  const int64_t m = a.bounds.back();
  const size_t chunks = a.bounds.size() - 1;
  const std::string what = "matmul_all_reduce (all-reduce of " + shape(m, a.n) + ")";
  auto guard = comm.lock(what);
  comm.check();
  cudaStream_t cs = comm.stream();
  GemmLanes lanes(comm, a, chunks, chunks + 1);  // (events chunks + 1 and chunks + 2)
  for (size_t j = 0; j < chunks; ++j) {
    const int64_t a0 = a.bounds[j], rows = a.bounds[j + 1] - a0;
    void* y = row_ptr(a.out, a0, a.n, a.dtype);
    gemm(a, lanes[j], row_ptr(a.x, a0, a.k, a.dtype), y, rows, nullptr);
    order(lanes[j].stream, cs, comm.event(j));
    comm.finish(ncclAllReduce(y, y, static_cast<size_t>(rows * a.n), nccl_type(a.dtype), ncclSum, comm.nccl(), cs),
                "ncclAllReduce", what);
  }
  lanes.join();
  order(cs, a.stream, comm.event(chunks));
  comm.watch(cs, what);
}

}  // namespace tp_kernels
