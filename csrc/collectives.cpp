// The plain collectives on a group's NCCL communicator (collectives.h).
#include "tp_kernels/collectives.h"

#include <iterator>
#include <string>

#include "tp_kernels/check.h"
#include "tp_kernels/detail.h"

namespace tp_kernels {
namespace {

// The one list of the collectives' names (Python reads it as _C.COLLECTIVES), in enum order.
const char* const kCollectiveNames[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                        "gather",     "send",       "recv"};

using detail::nccl_type;

}  // namespace

const char* collective_name(Collective c) { return kCollectiveNames[static_cast<int>(c)]; }

std::vector<std::string> collective_names() { return {std::begin(kCollectiveNames), std::end(kCollectiveNames)}; }

Collective parse_collective(const std::string& name, const std::string& arg) {
  return static_cast<Collective>(parse_name(kCollectiveNames, name, arg));
}

bool reduces(Collective c) { return c == Collective::kAllReduce || c == Collective::kReduceScatter; }

void nccl_collective(Communicator& comm, Collective c, const CollectiveArgs& a) {
  const std::string name = collective_name(c);
  const DeviceGuard device(comm.device());
  if (a.count == 0) return;
  const std::string what = name + " of " + std::to_string(a.count) + " " + dtype_name(a.dtype) + " elements";
  const ncclDataType_t type = nccl_type(a.dtype);
  const size_t count = static_cast<size_t>(a.count);
  auto guard = comm.lock(what);
  comm.check();
  ncclComm_t nccl = comm.nccl();
  switch (c) {
    case Collective::kAllReduce:
      comm.finish(ncclAllReduce(a.x, a.out, count, type, ncclSum, nccl, a.stream), "ncclAllReduce", what);
      break;
    case Collective::kAllGather:
      comm.finish(ncclAllGather(a.x, a.out, count, type, nccl, a.stream), "ncclAllGather", what);
      break;
    case Collective::kReduceScatter:
      comm.finish(ncclReduceScatter(a.x, a.out, count, type, ncclSum, nccl, a.stream), "ncclReduceScatter", what);
      break;
    case Collective::kBroadcast:
      comm.finish(ncclBroadcast(a.x, a.out, count, type, a.peer, nccl, a.stream), "ncclBroadcast", what);
      break;
    case Collective::kGather: {
      // NCCL has no gather: the root receives every other rank's block, which each sends it.
      const int p = comm.size(), r = comm.rank();
      const size_t bytes = count * dtype_size(a.dtype);
      if (r == a.peer)
        TPK_CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(a.out) + r * bytes, a.x, bytes, cudaMemcpyDeviceToDevice,
                                       a.stream));
      TPK_CHECK_NCCL(ncclGroupStart());
      if (r == a.peer) {
        for (int q = 0; q < p; ++q)
          if (q != r)
            comm.finish(ncclRecv(static_cast<char*>(a.out) + q * bytes, count, type, q, nccl, a.stream), "ncclRecv",
                        what);
      } else {
        comm.finish(ncclSend(a.x, count, type, a.peer, nccl, a.stream), "ncclSend", what);
      }
      comm.finish(ncclGroupEnd(), "ncclGroupEnd", what);
      break;
    }
    case Collective::kSend:
      comm.finish(ncclSend(a.x, count, type, a.peer, nccl, a.stream), "ncclSend", what);
      break;
    case Collective::kRecv:
      comm.finish(ncclRecv(a.out, count, type, a.peer, nccl, a.stream), "ncclRecv", what);
      break;
  }
  comm.watch(a.stream, what);
}

}  // namespace tp_kernels
