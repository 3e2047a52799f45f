// The pipelined primitives: GEMM chunks on the caller's stream, their communication on the
// communicator's stream, ordered by events (see overlap.h for the contract).
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
using detail::nccl_type;
using detail::order;
using detail::row_ptr;
using detail::shape;

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
  for (int step = 0; step < p; ++step) {
    const int src = a.ring[step];
    for (size_t j = 0; j < chunks; ++j) {
      const int64_t row = src * mp + a.bounds[j];
      if (step > 0) TPK_CHECK_CUDA(cudaStreamWaitEvent(a.stream, comm.event(1 + (step - 1) * chunks + j), 0));
      gemm(a, row_ptr(a.scratch, row, a.k, a.dtype), row_ptr(a.out, row, a.n, a.dtype), a.bounds[j + 1] - a.bounds[j],
           a.bias);
    }
  }
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
  for (size_t j = 0; j < chunks; ++j) {
    const int64_t a0 = a.bounds[j], rows = a.bounds[j + 1] - a0;
    // Rows [a0, a0 + rows) of each destination's block, as p products; partial chunk j is
    // destination-major: [p, rows, n] at row p * a0.
    void* partial = row_ptr(a.scratch, p * a0, a.n, a.dtype);
    gemm(a, row_ptr(a.x, a0, a.k, a.dtype), partial, rows, nullptr, p, mp * a.k, rows * a.n);
    order(a.stream, cs, comm.event(j));
    comm.finish(ncclReduceScatter(partial, row_ptr(a.out, a0, a.n, a.dtype), static_cast<size_t>(rows * a.n),
                                  nccl_type(a.dtype), ncclSum, comm.nccl(), cs),
                "ncclReduceScatter", what);
  }
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
  for (size_t j = 0; j < chunks; ++j) {
    const int64_t a0 = a.bounds[j], rows = a.bounds[j + 1] - a0;
    void* y = row_ptr(a.out, a0, a.n, a.dtype);
    gemm(a, row_ptr(a.x, a0, a.k, a.dtype), y, rows, nullptr);
    order(a.stream, cs, comm.event(j));
    comm.finish(ncclAllReduce(y, y, static_cast<size_t>(rows * a.n), nccl_type(a.dtype), ncclSum, comm.nccl(), cs),
                "ncclAllReduce", what);
  }
  order(cs, a.stream, comm.event(chunks));
  comm.watch(cs, what);
}

}  // namespace tp_kernels
