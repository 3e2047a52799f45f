// The plain collectives of a group, what tp_kernels.Communicator runs on CUDA tensors: NCCL on the
// group's communicator (comm.h), enqueued on the caller's stream, so that they can be captured in
// a CUDA graph; the fused all-reduce over peer memory is in peer.h.
//
// Shapes (elements; p ranks; the tensors contiguous; dim 0 gathered or scattered rank-major):
//   all_reduce      x [...]          out [...] (the same shape; may be x itself)   sum
//   all_gather      x [d, ...]       out [p*d, ...]
//   reduce_scatter  x [p*d, ...]     out [d, ...]                                  sum
//   broadcast       x [...]          out [...] (may be x itself); from rank `peer`
//   gather          x [d, ...]       out [p*d, ...] on rank `peer` only (none elsewhere)
//   send            x [...] to rank `peer`;   recv  out [...] from rank `peer`
// The reductions take the dtypes the module computes in (_C.DTYPES); the others move any dtype of
// the table (the Python side passes other dtypes as bytes). The arguments are trusted:
// boundary.h checks them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tp_kernels/comm.h"
#include "tp_kernels/tensor.h"

namespace tp_kernels {

// The collectives, in the order of _C.COLLECTIVES (their names, read by the Python side).
enum class Collective : int {
  kAllReduce = 0,
  kAllGather = 1,
  kReduceScatter = 2,
  kBroadcast = 3,
  kGather = 4,
  kSend = 5,
  kRecv = 6,
};
const char* collective_name(Collective c);
std::vector<std::string> collective_names();
// The collective called `name`; throws ArgumentError naming `arg` when there is none.
Collective parse_collective(const std::string& name, const std::string& arg);
// Whether `c` sums (and so takes the compute dtypes only).
bool reduces(Collective c);

struct CollectiveArgs {
  const void* x = nullptr;  // none for recv
  void* out = nullptr;      // none for send, and for gather on a rank other than the root
  // Elements each rank contributes or receives: x's for all_reduce, all_gather, broadcast,
  // gather and send; out's for reduce_scatter and recv.
  int64_t count = 0;
  DType dtype = DType::kFloat32;
  int peer = -1;  // broadcast, gather: the root; send: the destination; recv: the source
  cudaStream_t stream = nullptr;
};

// Collective `c` on the communicator's NCCL communicator, enqueued on args.stream (the host does
// not wait; the communicator's watchdog bounds the wait on the GPU). Nothing runs for count 0.
void nccl_collective(Communicator& comm, Collective c, const CollectiveArgs& args);

}  // namespace tp_kernels
