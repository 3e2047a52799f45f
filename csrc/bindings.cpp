// Python bindings of tp_kernels._C: glue only. The C++ core is framework-free (csrc/include).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tp_kernels/check.h"
#include "tp_kernels/comm.h"
#include "tp_kernels/device_ops.h"
#include "tp_kernels/gemm.h"
#include "tp_kernels/overlap.h"
#include "tp_kernels/peer.h"
#include "tp_kernels/runtime_info.h"

namespace py = pybind11;

namespace {

using tp_kernels::Communicator;
using tp_kernels::OverlapArgs;
using tp_kernels::PeerContext;

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// The arguments shared by the three pipelined ops (see overlap.h), from Python integers.
OverlapArgs overlap_args(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t out, uintptr_t scratch, int64_t n,
                         int64_t k, int64_t ldw, bool w_col_major, int dtype, std::vector<int64_t> bounds,
                         uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
  OverlapArgs a;
  a.x = ptr<const void>(x);
  a.w = ptr<const void>(w);
  a.bias = ptr<const void>(bias);
  a.out = ptr<void>(out);
  a.scratch = ptr<void>(scratch);
  a.n = n, a.k = k, a.ldw = ldw;
  a.w_col_major = w_col_major;
  a.dtype = static_cast<tp_kernels::DType>(dtype);
  a.bounds = std::move(bounds);
  a.workspace = ptr<void>(workspace);
  a.workspace_bytes = workspace_bytes;
  a.stream = ptr<CUstream_st>(stream);
  return a;
}

template <typename Context, void (*Op)(Context&, const OverlapArgs&)>
void bind_overlap(py::module_& m, const char* name, const char* doc) {
  m.def(
      name,
      [](Context& comm, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t out, uintptr_t scratch, int64_t n,
         int64_t k, int64_t ldw, bool w_col_major, int dtype, std::vector<int64_t> bounds, uintptr_t workspace,
         size_t workspace_bytes, uintptr_t stream) {
        OverlapArgs a = overlap_args(x, w, bias, out, scratch, n, k, ldw, w_col_major, dtype, std::move(bounds),
                                     workspace, workspace_bytes, stream);
        py::gil_scoped_release release;
        Op(comm, a);
      },
      py::arg("comm"), py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out"), py::arg("scratch"), py::arg("n"),
      py::arg("k"), py::arg("ldw"), py::arg("w_col_major"), py::arg("dtype"), py::arg("bounds"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"), doc);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tp_kernels native extension (CUDA runtime, NCCL, cuBLASLt; no libtorch)";
  py::register_exception<tp_kernels::Error>(m, "Error", PyExc_RuntimeError);

  m.def(
      "runtime_info",
      []() {
        tp_kernels::RuntimeInfo info = tp_kernels::query_runtime_info();
        py::dict d;
        d["cuda_runtime_version"] = info.cuda_runtime_version;
        d["cuda_driver_version"] = info.cuda_driver_version;
        d["nccl_version"] = info.nccl_version;
        d["cublaslt_version"] = info.cublaslt_version;
        d["device_count"] = info.device_count;
        d["device_error"] = info.device_error;
        return d;
      },
      "Versions of the CUDA runtime (static), driver, NCCL and cuBLASLt in use, and the usable "
      "device count with the reason when it is 0.");

  // Pointers and the stream cross as integers (torch's data_ptr() and cuda_stream).
  m.def(
      "linear",
      [](uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m_, int64_t n, int64_t k, int64_t ldx,
         int64_t ldw, int64_t ldy, int dtype, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
         bool w_col_major, int64_t batch, int64_t stride_x, int64_t stride_y) {
        tp_kernels::LinearArgs a;
        a.x = ptr<const void>(x);
        a.w = ptr<const void>(w);
        a.bias = ptr<const void>(bias);
        a.y = ptr<void>(y);
        a.m = m_, a.n = n, a.k = k, a.ldx = ldx, a.ldw = ldw, a.ldy = ldy;
        a.w_col_major = w_col_major;
        a.batch = batch, a.stride_x = stride_x, a.stride_y = stride_y;
        a.dtype = static_cast<tp_kernels::DType>(dtype);
        a.workspace = ptr<void>(workspace);
        a.workspace_bytes = workspace_bytes;
        a.stream = ptr<CUstream_st>(stream);
        py::gil_scoped_release release;
        tp_kernels::linear(a);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("ldx"), py::arg("ldw"), py::arg("ldy"), py::arg("dtype"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"), py::arg("w_col_major") = false,
      py::arg("batch") = 1, py::arg("stride_x") = 0, py::arg("stride_y") = 0,
      "Y[m, n] = X[m, k] W[n, k]^T (+ bias[n]) on cuBLASLt, row-major X and Y, W row-major (ldw >= k) "
      "or column-major (w_col_major, ldw >= n), enqueued on `stream` (dtype: 0 float32, 1 float16, "
      "2 bfloat16; bias 0 for none). batch > 1: that many products with one W, X and Y advanced by "
      "stride_x and stride_y elements (no bias).");

  m.attr("NCCL_UNIQUE_ID_BYTES") = static_cast<int>(NCCL_UNIQUE_ID_BYTES);
  m.def(
      "nccl_unique_id", []() { return py::bytes(tp_kernels::nccl_unique_id()); },
      "A new NCCL unique id (bytes), made by one rank of a group and sent to the others.");

  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "A group's NCCL communicator (nonblocking: every wait is bounded by the timeout), its "
      "communication stream and a watchdog that aborts it when enqueued work does not complete.")
      .def(py::init([](py::bytes unique_id, int rank, int size, int device, int stream_priority, double timeout_s) {
             std::string id = unique_id;
             py::gil_scoped_release release;  // joining waits for the other ranks
             return std::make_shared<Communicator>(id, rank, size, device, stream_priority, timeout_s);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("stream_priority"),
           py::arg("timeout_s"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("device", &Communicator::device)
      .def_property_readonly("stream_priority", &Communicator::stream_priority)
      .def_property_readonly("stream", [](const Communicator& c) { return reinterpret_cast<uintptr_t>(c.stream()); })
      .def_property("timeout_s", &Communicator::timeout_s, &Communicator::set_timeout_s)
      .def("check", &Communicator::check, "Raise the error that ended this communicator, if any.")
      .def("close", &Communicator::close, py::call_guard<py::gil_scoped_release>(),
           "Flush outstanding work and destroy the NCCL communicator.");

  bind_overlap<Communicator, tp_kernels::all_gather_matmul>(
      m, "all_gather_matmul",
      "out[m, n] = AG(x)[m, k] W^T (+ bias): ring all-gather into scratch (gathered [m, k]) by NCCL "
      "send/recv, overlapped with the GEMM of the shards already there.");
  bind_overlap<Communicator, tp_kernels::matmul_reduce_scatter>(
      m, "matmul_reduce_scatter",
      "out[m/p, n] = RS(x[m, k] W^T), chunk by chunk through scratch (partial [m, n]); bias must be 0.");
  bind_overlap<Communicator, tp_kernels::matmul_all_reduce>(
      m, "matmul_all_reduce", "out[m, n] = AR(x[m, k] W^T), chunk by chunk, in place in out; bias must be 0.");

  // Device building blocks of the peer-memory path (device_ops.h); pointers may be peers'.
  m.attr("MAX_RANKS") = tp_kernels::kMaxRanks;
  m.def("stream_memory_ops_available", &tp_kernels::stream_memory_ops_available,
        "Whether the driver provides cuStreamWriteValue32 (the flags of the fused path).");
  m.def(
      "write_flag",
      [](uintptr_t flag, uint32_t value, uintptr_t stream) {
        tp_kernels::write_flag(ptr<uint32_t>(flag), value, ptr<CUstream_st>(stream));
      },
      py::arg("flag"), py::arg("value"), py::arg("stream"),
      "Write `value` to the 32-bit flag on `stream` (stream memory operation, fenced).");
  m.def(
      "wait_flags",
      [](std::vector<uintptr_t> flags, std::vector<uint32_t> codes, uint64_t timeout_ns, uintptr_t error_word,
         uintptr_t stream) {
        if (flags.size() != codes.size()) throw tp_kernels::Error("wait_flags: one error code per flag");
        if (flags.size() > static_cast<size_t>(tp_kernels::kMaxRanks))
          throw tp_kernels::Error("wait_flags: at most " + std::to_string(tp_kernels::kMaxRanks) + " flags");
        std::vector<uint32_t*> f;
        for (uintptr_t a : flags) f.push_back(ptr<uint32_t>(a));
        tp_kernels::wait_flags(f.data(), codes.data(), static_cast<int>(f.size()), timeout_ns, ptr<uint32_t>(error_word),
                               ptr<CUstream_st>(stream));
      },
      py::arg("flags"), py::arg("codes"), py::arg("timeout_ns"), py::arg("error_word"), py::arg("stream"),
      "Make `stream` wait until every flag is nonzero, clearing each (consuming it); a flag still "
      "clear after timeout_ns puts its code in *error_word (host-readable memory) if that is 0, "
      "and the stream goes on. Waits return at once while *error_word is set.");
  m.def(
      "reduce_partials",
      [](std::vector<uintptr_t> inputs, uintptr_t out, int64_t count, int dtype, uintptr_t stream) {
        std::vector<const void*> in;
        for (uintptr_t a : inputs) in.push_back(ptr<const void>(a));
        tp_kernels::reduce_partials(in.data(), static_cast<int>(in.size()), ptr<void>(out), count,
                                    static_cast<tp_kernels::DType>(dtype), ptr<CUstream_st>(stream));
      },
      py::arg("inputs"), py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("stream"),
      "out = inputs[0] + ... + inputs[p-1] elementwise, in that order with fp32 accumulation "
      "(deterministic); p <= MAX_RANKS.");

  // The peer-memory (fused) path: workspace buffers, their IPC handles, contexts and ops (peer.h).
  m.attr("CONTROL_BYTES") = tp_kernels::kControlBytes;
  m.attr("REGION_ALIGNMENT") = tp_kernels::kRegionAlignment;
  m.attr("IPC_HANDLE_BYTES") = static_cast<int>(sizeof(cudaIpcMemHandle_t));
  m.attr("REGIONS") = py::make_tuple("export", "inbox", "export2");
  m.attr("ALL_REDUCE_ALGORITHMS") = py::make_tuple("one_shot", "two_shot", "scatter_gather");
  m.attr("FUSED_OPS") = py::make_tuple("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce");
  m.def(
      "fused_region_need",
      [](int op, int region, int p, int64_t m_, int64_t n, int64_t k, int dtype, int algo) {
        if (op < 0 || op > 2) throw tp_kernels::Error("fused_region_need: op must be 0, 1 or 2");
        if (region < 0 || region >= tp_kernels::kNumRegions) throw tp_kernels::Error("fused_region_need: bad region");
        if (algo < 0 || algo > 2) throw tp_kernels::Error("fused_region_need: algo must be 0, 1 or 2");
        return tp_kernels::fused_region_need(static_cast<tp_kernels::FusedOp>(op), static_cast<tp_kernels::Region>(region),
                                             p, m_, n, k, static_cast<tp_kernels::DType>(dtype),
                                             static_cast<tp_kernels::AllReduceAlgo>(algo));
      },
      py::arg("op"), py::arg("region"), py::arg("p"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("dtype"),
      py::arg("algo") = 0,
      "Bytes region `region` (index in REGIONS) needs for fused op `op` (index in FUSED_OPS) with p "
      "ranks, m rows (the gathered / full rows), n, k, dtype code and all-reduce algorithm index.");
  m.def(
      "two_shot_slice",
      [](int64_t count, int p, int dtype) {
        return tp_kernels::two_shot_slice(count, p, static_cast<tp_kernels::DType>(dtype));
      },
      py::arg("count"), py::arg("p"), py::arg("dtype"), "Elements per rank's slice of a two-shot all-reduce.");
  m.def("initial_control_block", &tp_kernels::initial_control_block,
        "The 32-bit words a workspace's control block starts with (release flags set).");
  m.def("workspace_alloc", &tp_kernels::workspace_alloc, py::arg("bytes"), py::arg("device"),
        "cudaMalloc `bytes` on `device` (one allocation: one IPC handle); returns the address.");
  m.def("workspace_free", &tp_kernels::workspace_free, py::arg("ptr"), py::arg("device"), "cudaFree.");
  m.def("workspace_init", &tp_kernels::workspace_init, py::arg("ptr"), py::arg("device"),
        "Write the initial control block to a workspace buffer (synchronously).");
  m.def(
      "ipc_handle", [](uintptr_t p, int device) { return py::bytes(tp_kernels::ipc_handle(p, device)); },
      py::arg("ptr"), py::arg("device"), "The CUDA IPC handle (bytes) of a workspace buffer.");
  m.def(
      "ipc_open", [](py::bytes handle, int device) { return tp_kernels::ipc_open(std::string(handle), device); },
      py::arg("handle"), py::arg("device"), "Map another process's workspace buffer here; returns its address.");
  m.def("ipc_close", &tp_kernels::ipc_close, py::arg("ptr"), py::arg("device"), "Unmap a buffer from ipc_open.");

  py::class_<PeerContext, std::shared_ptr<PeerContext>>(
      m, "PeerContext",
      "One rank's view of its group's symmetric workspace: the table of every rank's buffer as "
      "mapped in this process, a copy stream, an event pool and a host-readable error word that "
      "bounded device waits set on timeout.")
      .def(py::init([](int rank, int size, int device, std::vector<uintptr_t> bases, std::vector<size_t> region_bytes,
                       double timeout_s) {
             return std::make_shared<PeerContext>(rank, size, device, bases, region_bytes, timeout_s);
           }),
           py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("bases"), py::arg("region_bytes"),
           py::arg("timeout_s"))
      .def_property_readonly("rank", &PeerContext::rank)
      .def_property_readonly("size", &PeerContext::size)
      .def_property_readonly("device", &PeerContext::device)
      .def_property_readonly("region_bytes",
                             [](const PeerContext& c) {
                               return py::make_tuple(c.region_bytes(tp_kernels::Region::kExport),
                                                     c.region_bytes(tp_kernels::Region::kInbox),
                                                     c.region_bytes(tp_kernels::Region::kExport2));
                             })
      .def_property_readonly("copy_stream",
                             [](const PeerContext& c) { return reinterpret_cast<uintptr_t>(c.copy_stream()); })
      .def_property("timeout_s", &PeerContext::timeout_s, &PeerContext::set_timeout_s)
      .def_property_readonly("error_code", &PeerContext::error_code,
                             "The error word: 0, or the code of the first wait that timed out.")
      .def("describe", &PeerContext::describe, py::arg("code"), "The message for an error code.")
      .def("check", &PeerContext::check, "Raise the error a timed-out device wait recorded, if any.");

  bind_overlap<PeerContext, tp_kernels::fused_all_gather_matmul>(
      m, "fused_all_gather_matmul",
      "out[m, n] = AG(x)[m, k] W^T (+ bias): shards published in the export regions and pulled by "
      "copy engine chunk by chunk into scratch (gathered [m, k]) while the GEMM runs.");
  bind_overlap<PeerContext, tp_kernels::fused_matmul_reduce_scatter>(
      m, "fused_matmul_reduce_scatter",
      "out[m/p, n] = RS(x[m, k] W^T): partials pushed by copy engine into their destination's inbox "
      "(scratch: partial [m, n]), summed in rank order; bounds {0, m/p}; bias must be 0.");
  m.def(
      "fused_matmul_all_reduce",
      [](PeerContext& ctx, uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t out, uintptr_t scratch, int64_t n,
         int64_t k, int64_t ldw, bool w_col_major, int dtype, std::vector<int64_t> bounds, uintptr_t workspace,
         size_t workspace_bytes, uintptr_t stream, int algo) {
        if (algo < 0 || algo > 2) throw tp_kernels::Error("fused_matmul_all_reduce: algo must be 0, 1 or 2");
        OverlapArgs a = overlap_args(x, w, bias, out, scratch, n, k, ldw, w_col_major, dtype, std::move(bounds),
                                     workspace, workspace_bytes, stream);
        py::gil_scoped_release release;
        tp_kernels::fused_matmul_all_reduce(ctx, a, static_cast<tp_kernels::AllReduceAlgo>(algo));
      },
      py::arg("ctx"), py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out"), py::arg("scratch"), py::arg("n"),
      py::arg("k"), py::arg("ldw"), py::arg("w_col_major"), py::arg("dtype"), py::arg("bounds"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"), py::arg("algo"),
      "out[m, n] = AR(x[m, k] W^T) by algorithm `algo` (index in ALL_REDUCE_ALGORITHMS): bounds "
      "{0, m} for one-/two-shot, the p + 1 block boundaries for scatter_gather (scratch [m, n]); "
      "bias must be 0 (the arguments are those of the other primitives, then algo).");
}
