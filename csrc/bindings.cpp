// Python bindings of tp_kernels._C: glue only. The C++ core is framework-free (csrc/include);
// every tensor argument arrives as a torch.Tensor (or a TensorRef), is read into a TensorRef here
// (arg) and is checked once, by boundary.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tp_kernels/boundary.h"
#include "tp_kernels/check.h"
#include "tp_kernels/collectives.h"
#include "tp_kernels/comm.h"
#include "tp_kernels/device_ops.h"
#include "tp_kernels/driver.h"
#include "tp_kernels/gemm.h"
#include "tp_kernels/overlap.h"
#include "tp_kernels/peer.h"
#include "tp_kernels/runtime_info.h"
#include "tp_kernels/tensor.h"

namespace py = pybind11;

namespace {

using tp_kernels::AllReduceAlgo;
using tp_kernels::CollectiveArgs;
using tp_kernels::Communicator;
using tp_kernels::OverlapArgs;
using tp_kernels::PeerContext;
using tp_kernels::Primitive;
using tp_kernels::TensorRef;
using OptionalRef = std::optional<TensorRef>;

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t stream_ptr(uintptr_t stream) { return ptr<CUstream_st>(stream); }

const TensorRef* opt(const OptionalRef& t) { return t ? &*t : nullptr; }

// --- tensor arguments: a torch.Tensor (or a TensorRef made by hand) read once, into a TensorRef --------

py::object steal_or_throw(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

std::vector<int64_t> int_tuple(const py::object& t) {  // torch.Size and stride() are tuples
  if (!PyTuple_Check(t.ptr())) return t.cast<std::vector<int64_t>>();
  const Py_ssize_t n = PyTuple_GET_SIZE(t.ptr());
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(t.ptr(), i));
    if (v[static_cast<size_t>(i)] == -1 && PyErr_Occurred()) throw py::error_already_set();
  }
  return v;
}

// The tensor argument `name`: a TensorRef as it is (tests make them by hand, with any address),
// else a torch.Tensor's data_ptr(), shape, stride(), dtype and get_device() (-1: host memory),
// read here through the C API. That spares making a TensorRef object in Python per tensor
// (about 1 µs of host time each, four to six a call). The objects kept for it (torch.Tensor,
// interned names, the dtype names) live as long as the process: never freed, so nothing is
// released after the interpreter is gone.
TensorRef arg(py::handle t, const char* name) {
  if (py::isinstance<TensorRef>(t)) return t.cast<TensorRef>();
  static PyObject* tensor_type = py::object(py::module_::import("torch").attr("Tensor")).release().ptr();
  static PyObject* s_data_ptr = PyUnicode_InternFromString("data_ptr");
  static PyObject* s_shape = PyUnicode_InternFromString("shape");
  static PyObject* s_stride = PyUnicode_InternFromString("stride");
  static PyObject* s_dtype = PyUnicode_InternFromString("dtype");
  static PyObject* s_get_device = PyUnicode_InternFromString("get_device");
  static PyObject* dtype_names = PyDict_New();  // torch.dtype -> its name without "torch."
  const int is_tensor = PyObject_IsInstance(t.ptr(), tensor_type);
  if (is_tensor < 0) throw py::error_already_set();
  if (is_tensor == 0)
    throw tp_kernels::ArgumentError(std::string(name) + ": expected a torch.Tensor, got " + Py_TYPE(t.ptr())->tp_name);
  const py::object data = steal_or_throw(PyObject_CallMethodNoArgs(t.ptr(), s_data_ptr));
  const auto address = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(data.ptr()));
  if (PyErr_Occurred()) throw py::error_already_set();
  std::vector<int64_t> shape = int_tuple(steal_or_throw(PyObject_GetAttr(t.ptr(), s_shape)));
  std::vector<int64_t> strides = int_tuple(steal_or_throw(PyObject_CallMethodNoArgs(t.ptr(), s_stride)));
  const py::object dtype = steal_or_throw(PyObject_GetAttr(t.ptr(), s_dtype));
  py::object dtype_name = py::reinterpret_borrow<py::object>(PyDict_GetItemWithError(dtype_names, dtype.ptr()));
  if (!dtype_name) {
    if (PyErr_Occurred()) throw py::error_already_set();
    const std::string full = py::str(dtype).cast<std::string>();  // "torch.bfloat16"
    dtype_name = py::str(full.substr(full.rfind('.') + 1));
    if (PyDict_SetItem(dtype_names, dtype.ptr(), dtype_name.ptr()) != 0) throw py::error_already_set();
  }
  const py::object device = steal_or_throw(PyObject_CallMethodNoArgs(t.ptr(), s_get_device));
  return tp_kernels::make_tensor_ref(name, address, std::move(shape), std::move(strides),
                                     dtype_name.cast<std::string>(), device.cast<int>());
}

OptionalRef optional_arg(py::handle t, const char* name) {
  if (t.is_none()) return std::nullopt;
  return arg(t, name);
}

// A list of tensor arguments, named `name[0]`, `name[1]`, ...
std::vector<TensorRef> arg_list(py::handle seq, const char* name) {
  if (!PyList_Check(seq.ptr()) && !PyTuple_Check(seq.ptr()))
    throw tp_kernels::ArgumentError(std::string(name) + ": expected a list of torch.Tensor, got " +
                                    Py_TYPE(seq.ptr())->tp_name);
  std::vector<TensorRef> refs;
  size_t i = 0;
  for (py::handle t : py::reinterpret_borrow<py::sequence>(seq)) {
    refs.push_back(arg(t, (std::string(name) + "[" + std::to_string(i++) + "]").c_str()));
  }
  return refs;
}

py::tuple names(const std::vector<std::string>& v) { return py::cast(v); }

// The arguments of `linear` (and `linear_problem`), read and checked.
tp_kernels::LinearArgs linear_call(py::handle x, py::handle weight, py::handle bias, py::handle out,
                                   py::handle workspace, uintptr_t stream) {
  const TensorRef x_ref = arg(x, "x"), w_ref = arg(weight, "weight");  // read in order: the first bad one is named
  const OptionalRef b_ref = optional_arg(bias, "bias");
  const TensorRef out_ref = arg(out, "out"), ws_ref = arg(workspace, "workspace");
  return tp_kernels::linear_args(x_ref, w_ref, opt(b_ref), out_ref, ws_ref, stream_ptr(stream));
}

// The arguments of primitive `op` (native or fused), read in order and checked by primitive_args:
// `bias` and `scratch` may be None; `scratch` is named `scratch_name` ("gathered", "partial").
OverlapArgs primitive_call(Primitive op, int size, int device, py::handle x, py::handle weight, py::handle bias,
                           py::handle out, py::handle scratch, const char* scratch_name, std::vector<int64_t> bounds,
                           py::handle workspace, cudaStream_t stream) {
  const TensorRef x_ref = arg(x, "x"), w_ref = arg(weight, "weight");
  const OptionalRef b_ref = optional_arg(bias, "bias");
  const TensorRef out_ref = arg(out, "out");
  const OptionalRef s_ref = optional_arg(scratch, scratch_name);
  const TensorRef ws_ref = arg(workspace, "workspace");
  return tp_kernels::primitive_args(op, size, device, x_ref, w_ref, opt(b_ref), out_ref, opt(s_ref), std::move(bounds),
                                    ws_ref, stream);
}

// The pipelined primitives' second stream for GEMMs and its workspace (boundary.h; 0 and None: none).
void set_side(OverlapArgs& a, int device, uintptr_t side_stream, py::handle side_workspace) {
  const OptionalRef ws = optional_arg(side_workspace, "side_workspace");
  tp_kernels::set_side_stream(a, device, stream_ptr(side_stream), opt(ws));
}

// An algorithm of cuBLASLt's (gemm.h's GemmAlgoInfo) into `d`, by the names of its fields.
void add_algo(py::dict& d, const tp_kernels::GemmAlgoInfo& a) {
  d["algo_id"] = a.algo_id;
  d["tile_id"] = a.tile_id;
  d["stages_id"] = a.stages_id;
  d["splitk"] = a.splitk;
  d["reduction_scheme"] = a.reduction_scheme;
  d["swizzle"] = a.swizzle;
  d["custom_option"] = a.custom_option;
  d["inner_shape_id"] = a.inner_shape_id;
  d["cluster_shape_id"] = a.cluster_shape_id;
  d["waves"] = a.waves;
  d["workspace_needed"] = a.workspace_needed;
}

// What the core receives for a call (boundary.h), for tests and diagnostics: no CUDA call.
py::dict describe(const tp_kernels::LinearArgs& a) {
  py::dict d;
  d["m"] = a.m, d["n"] = a.n, d["k"] = a.k, d["ldx"] = a.ldx, d["ldw"] = a.ldw, d["ldy"] = a.ldy;
  d["w_col_major"] = a.w_col_major, d["batch"] = a.batch, d["stride_x"] = a.stride_x, d["stride_y"] = a.stride_y;
  d["dtype"] = tp_kernels::dtype_name(a.dtype), d["has_bias"] = a.bias != nullptr;
  d["workspace_bytes"] = a.workspace_bytes, d["device"] = a.device;
  return d;
}

py::dict describe(const OverlapArgs& a) {
  py::dict d;
  d["n"] = a.n, d["k"] = a.k, d["ldw"] = a.ldw, d["w_col_major"] = a.w_col_major, d["bounds"] = a.bounds;
  d["dtype"] = tp_kernels::dtype_name(a.dtype), d["has_bias"] = a.bias != nullptr, d["has_scratch"] = a.scratch != nullptr;
  d["ring"] = a.ring, d["ring_next"] = a.ring_next, d["ring_prev"] = a.ring_prev;
  d["side_stream"] = a.side_stream != nullptr, d["side_workspace_bytes"] = a.side_workspace_bytes;
  return d;
}

py::dict describe(const CollectiveArgs& a) {
  py::dict d;
  d["count"] = a.count, d["dtype"] = tp_kernels::dtype_name(a.dtype), d["peer"] = a.peer;
  d["has_x"] = a.x != nullptr, d["has_out"] = a.out != nullptr;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tp_kernels native extension (CUDA runtime, NCCL, cuBLASLt; no libtorch)";
  // Registered in this order so that ArgumentError (a kind of Error) becomes ValueError.
  py::register_exception<tp_kernels::Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<tp_kernels::ArgumentError>(m, "ArgumentError", PyExc_ValueError);

  // The lists and limits both sides use, defined here and read by the Python side.
  m.attr("DTYPES") = names(tp_kernels::compute_dtype_names());
  m.attr("OPS") = names(tp_kernels::primitive_names());
  m.attr("COLLECTIVES") = names(tp_kernels::collective_names());
  m.attr("ALL_REDUCE_ALGORITHMS") = names(tp_kernels::algorithm_names());
  m.attr("REGIONS") = names(tp_kernels::region_names());
  m.attr("MAX_RANKS") = tp_kernels::kMaxRanks;
  m.attr("CONTROL_BYTES") = tp_kernels::kControlBytes;
  m.attr("MISMATCH_BIT") = tp_kernels::kMismatchBit;
  m.attr("REGION_ALIGNMENT") = tp_kernels::kRegionAlignment;
  m.attr("NCCL_UNIQUE_ID_BYTES") = static_cast<int>(NCCL_UNIQUE_ID_BYTES);

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

  py::class_<TensorRef>(m, "TensorRef",
                        "A tensor argument: its name (for messages), data pointer, shape and strides in "
                        "elements, dtype name and CUDA device (-1: host memory). Owns nothing.")
      .def(py::init(&tp_kernels::make_tensor_ref), py::arg("name"), py::arg("data"), py::arg("shape"),
           py::arg("strides"), py::arg("dtype"), py::arg("device"))
      .def_readonly("name", &TensorRef::name)
      .def_readonly("data", &TensorRef::data)
      .def_readonly("shape", &TensorRef::shape)
      .def_readonly("strides", &TensorRef::strides)
      .def_readonly("device", &TensorRef::device)
      .def_property_readonly("dtype", [](const TensorRef& t) { return tp_kernels::dtype_name(t.dtype); })
      .def("__repr__", [](const TensorRef& t) { return "TensorRef(" + t.name + ": " + t.describe() + ")"; });
  m.def(
      "tensor_ref", [](const std::string& name, py::handle tensor) { return arg(tensor, name.c_str()); },
      py::arg("name"), py::arg("tensor"),
      "The TensorRef every native function reads from `tensor` for its argument `name` (a TensorRef is taken as "
      "it is); ValueError naming `name` for anything else.");

  m.def(
      "linear",
      [](py::handle x, py::handle weight, py::handle bias, py::handle out, py::handle workspace, uintptr_t stream) {
        tp_kernels::LinearArgs a = linear_call(x, weight, bias, out, workspace, stream);
        py::gil_scoped_release release;
        tp_kernels::linear(a);
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("workspace"), py::arg("stream"),
      "out = x weight^T (+ bias) on cuBLASLt, enqueued on `stream` (boundary.h: x [m, k] or [batch, m, k] "
      "with one weight; weight row- or column-major; rows of x and out may be strided). k = 0 writes "
      "nothing: the caller fills out with the bias.");

  m.def(
      "linear_problem",
      [](py::handle x, py::handle weight, py::handle bias, py::handle out, py::handle workspace, uintptr_t stream) {
        return describe(linear_call(x, weight, bias, out, workspace, stream));
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("workspace"), py::arg("stream") = 0,
      "The GEMM `linear` would run for these arguments (checked as it checks them), as a dict; runs nothing.");
  m.def(
      "gemm_plans",
      []() {
        py::list out;
        for (const tp_kernels::GemmPlanInfo& p : tp_kernels::gemm_plans()) {
          py::dict d;
          d["device"] = p.device;
          d["m"] = p.m;
          d["n"] = p.n;
          d["k"] = p.k;
          d["batch"] = p.batch;
          d["ldx"] = p.ldx;
          d["ldw"] = p.ldw;
          d["ldy"] = p.ldy;
          d["dtype"] = tp_kernels::dtype_name(p.dtype);
          d["bias"] = p.bias;
          d["w_col_major"] = p.w_col_major;
          d["workspace_bytes"] = p.workspace_bytes;
          add_algo(d, p.algo);
          d["tuning_timed"] = p.tuning.timed;
          d["tuning_first_ms"] = p.tuning.first_ms;
          d["tuning_chosen_ms"] = p.tuning.chosen_ms;
          d["tuning_note"] = p.tuning.note;
          out.append(d);
        }
        return out;
      },
      "What cuBLASLt's heuristic chose for each GEMM problem `linear` has planned in this process, a dict "
      "each (gemm.h's GemmPlanInfo): the problem (device, m, n, k, batch, leading dims, dtype, bias, "
      "w_col_major, workspace_bytes), the algorithm's configuration as cublasLt.h numbers it (algo_id, "
      "tile_id, stages_id, splitk, reduction_scheme, swizzle, custom_option, inner_shape_id, "
      "cluster_shape_id; -1: not reported) and the heuristic's waves (its wavesCount: 1.0 fills every "
      "multiprocessor once) and workspace_needed; what its making timed where tuning was on (set_gemm_tuning): "
      "tuning_timed (the proposals timed; 0: none), tuning_first_ms and tuning_chosen_ms (the mean run of the "
      "heuristic's first and of the algorithm kept; -1: not timed) and tuning_note (why it did not time, or "
      "stopped; '' where it timed). Calls no CUDA function: [] before any GEMM.");
  m.def("forget_gemm_plans", &tp_kernels::forget_gemm_plans,
        "Drops every GEMM plan: the next GEMM of each problem makes its plan again, under the tuning set then "
        "(for the benchmarks, which compare a problem's plans with tuning off and on). Calls no CUDA function.");
  m.def("set_gemm_tuning", &tp_kernels::set_gemm_tuning, py::arg("candidates"), py::arg("iters"),
        py::arg("timeout_s"),
        "Tuning of the GEMM plans made from now on: `candidates` 0 (off: cuBLASLt's heuristic's first "
        "algorithm) or 2..32: a plan's making times that many of the heuristic's proposals for its problem, "
        "each run once then `iters` times (1..1000), on a stream, output and workspace of its own, without "
        "waiting for the caller's stream (each proposal's runs waited for within `timeout_s` seconds), and "
        "keeps the fastest where it beats the first by more than 2 %. Calls no CUDA function; raises "
        "ValueError naming the argument out of range.");
  m.def(
      "gemm_candidates",
      [](py::handle x, py::handle weight, py::handle bias, py::handle out, py::handle workspace, uintptr_t stream,
         int count, int iters, double timeout_s) {
        tp_kernels::LinearArgs a = linear_call(x, weight, bias, out, workspace, stream);
        std::vector<tp_kernels::GemmCandidate> found;
        {
          py::gil_scoped_release release;
          found = tp_kernels::gemm_candidates(a, count, iters, timeout_s);
        }
        py::list candidates;
        for (const tp_kernels::GemmCandidate& c : found) {
          py::dict d;
          add_algo(d, c.algo);
          d["ms"] = c.ms;
          candidates.append(d);
        }
        return candidates;
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("workspace"), py::arg("stream"),
      py::arg("count"), py::arg("iters"), py::arg("timeout_s"),
      "The algorithm `linear` runs for its problem of these arguments, then the others of the first `count` "
      "(1..32) cuBLASLt's heuristic proposes for it, in its order (`count` in all at most), each timed: a dict "
      "each, the algorithm as gemm_plans describes it and `ms`, the mean of `iters` runs on `stream` after one "
      "(-1: cuBLASLt would not run it). Waits for the stream, at most `timeout_s` seconds an algorithm (then "
      "raises, the GEMMs still queued); overwrites `out`; refuses a stream being captured. For the benchmarks.");

  m.def(
      "primitive_problem",
      [](const std::string& op, int rank, int size, int device, py::handle x, py::handle weight, py::handle bias,
         py::handle out, py::handle scratch, std::vector<int64_t> bounds, std::optional<std::vector<int>> ring,
         int ring_next, int ring_prev, py::handle workspace, uintptr_t stream, uintptr_t side_stream,
         py::handle side_workspace) {
        OverlapArgs a = primitive_call(tp_kernels::parse_primitive(op, "op"), size, device, x, weight, bias, out, scratch,
                                       "scratch", std::move(bounds), workspace, stream_ptr(stream));
        if (ring) tp_kernels::set_ring(a, rank, size, std::move(*ring), ring_next, ring_prev);
        set_side(a, device, side_stream, side_workspace);
        return describe(a);
      },
      py::arg("op"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("x"), py::arg("weight"),
      py::arg("bias"), py::arg("out"), py::arg("scratch"), py::arg("bounds"), py::arg("ring") = py::none(),
      py::arg("ring_next") = -1, py::arg("ring_prev") = -1, py::arg("workspace"), py::arg("stream") = 0,
      py::arg("side_stream") = 0, py::arg("side_workspace") = py::none(),
      "The arguments primitive `op` (one of OPS) of rank `rank` of a group of `size` on `device` would get "
      "(checked as the primitives check them), as a dict; runs nothing.");

  m.def(
      "collective_problem",
      [](const std::string& collective, int rank, int size, int device, py::handle x_, py::handle out_,
         int peer) {
        const OptionalRef x = optional_arg(x_, "x");
        const OptionalRef out = optional_arg(out_, "out");
        return describe(tp_kernels::collective_args(tp_kernels::parse_collective(collective, "collective"), rank, size,
                                                    device, opt(x), opt(out), peer, nullptr));
      },
      py::arg("collective"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("x"), py::arg("out"),
      py::arg("peer") = -1,
      "The arguments collective `collective` (one of COLLECTIVES) of rank `rank` of a group of `size` on `device` "
      "would get (checked as nccl_collective and fused_all_reduce check them), as a dict; runs nothing.");

  m.def(
      "nccl_unique_id", []() { return py::bytes(tp_kernels::nccl_unique_id()); },
      "A new NCCL unique id (bytes), made by one rank of a group and sent to the others.");
  m.def("nccl_can_revoke", &tp_kernels::nccl_can_revoke,
        "Whether the NCCL loaded has ncclCommRevoke (2.28.9 and later), which a Communicator in blocking mode needs.");

  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "A group's NCCL communicator (joined in nonblocking mode: every wait is bounded by the timeout), its "
      "communication stream and a watchdog that aborts it when enqueued work does not complete. `blocking`: the "
      "ops run on a split of it in NCCL's blocking mode, an enqueue blocked past the timeout revoked by the "
      "watchdog (comm.h).")
      .def(py::init([](py::bytes unique_id, int rank, int size, int device, int stream_priority, double timeout_s,
                       bool blocking) {
             std::string id = unique_id;
             py::gil_scoped_release release;  // joining waits for the other ranks
             return std::make_shared<Communicator>(id, rank, size, device, stream_priority, timeout_s, blocking);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("stream_priority"),
           py::arg("timeout_s"), py::arg("blocking") = false)
      .def_property_readonly("blocking", &Communicator::blocking)
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("device", &Communicator::device)
      .def_property_readonly("stream_priority", &Communicator::stream_priority)
      .def_property_readonly("stream", [](const Communicator& c) { return reinterpret_cast<uintptr_t>(c.stream()); })
      .def_property_readonly("gemm_stream",
                             [](const Communicator& c) { return reinterpret_cast<uintptr_t>(c.gemm_stream()); })
      .def_property("timeout_s", &Communicator::timeout_s, &Communicator::set_timeout_s)
      .def("check", &Communicator::check, "Raise the error that ended this communicator, if any.")
      .def(
          "progress",
          [](const Communicator& c) {
            const Communicator::Progress s = c.progress();
            py::dict d;
            d["calls"] = s.calls;
            d["in_progress"] = s.in_progress;
            d["polls"] = s.polls;
            d["polling_us"] = static_cast<double>(s.polling_ns) / 1e3;
            return d;
          },
          "Since the communicator was made: the NCCL calls completed, how many returned ncclInProgress (none "
          "in blocking mode), the polls of those and the host time spent polling them (us), as a dict.")
      .def("close", &Communicator::close, py::call_guard<py::gil_scoped_release>(),
           "Flush outstanding work and destroy the NCCL communicator.");

  m.def(
      "all_gather_matmul",
      [](Communicator& comm, py::handle x, py::handle weight, py::handle bias, py::handle out, py::handle gathered,
         std::vector<int64_t> bounds, std::vector<int> ring, int ring_next, int ring_prev, py::handle workspace,
         uintptr_t stream, uintptr_t side_stream, py::handle side_workspace) {
        OverlapArgs a = primitive_call(Primitive::kAllGatherMatmul, comm.size(), comm.device(), x, weight, bias, out,
                                       gathered, "gathered", std::move(bounds), workspace, stream_ptr(stream));
        tp_kernels::set_ring(a, comm.rank(), comm.size(), std::move(ring), ring_next, ring_prev);
        set_side(a, comm.device(), side_stream, side_workspace);
        py::gil_scoped_release release;
        tp_kernels::all_gather_matmul(comm, a);
      },
      py::arg("comm"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("gathered"),
      py::arg("bounds"), py::arg("ring"), py::arg("ring_next"), py::arg("ring_prev"), py::arg("workspace"),
      py::arg("stream"), py::arg("side_stream") = 0, py::arg("side_workspace") = py::none(),
      "out [m, n] = AG(x)[m, k] weight^T (+ bias): ring all-gather into `gathered` by NCCL send/recv, "
      "in the order `ring`, overlapped with the GEMM of the shards already there.");
  m.def(
      "matmul_reduce_scatter",
      [](Communicator& comm, py::handle x, py::handle weight, py::handle out, py::handle partial,
         std::vector<int64_t> bounds, py::handle workspace, uintptr_t stream, uintptr_t side_stream,
         py::handle side_workspace) {
        OverlapArgs a = primitive_call(Primitive::kMatmulReduceScatter, comm.size(), comm.device(), x, weight,
                                       py::none(), out, partial, "partial", std::move(bounds), workspace,
                                       stream_ptr(stream));
        set_side(a, comm.device(), side_stream, side_workspace);
        py::gil_scoped_release release;
        tp_kernels::matmul_reduce_scatter(comm, a);
      },
      py::arg("comm"), py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("partial"), py::arg("bounds"),
      py::arg("workspace"), py::arg("stream"), py::arg("side_stream") = 0, py::arg("side_workspace") = py::none(),
      "out [m/p, n] = RS(x[m, k] weight^T), chunk by chunk through `partial` [m, n].");
  m.def(
      "matmul_all_reduce",
      [](Communicator& comm, py::handle x, py::handle weight, py::handle out, std::vector<int64_t> bounds,
         py::handle workspace, uintptr_t stream, uintptr_t side_stream, py::handle side_workspace) {
        OverlapArgs a = primitive_call(Primitive::kMatmulAllReduce, comm.size(), comm.device(), x, weight, py::none(),
                                       out, py::none(), "partial", std::move(bounds), workspace, stream_ptr(stream));
        set_side(a, comm.device(), side_stream, side_workspace);
        py::gil_scoped_release release;
        tp_kernels::matmul_all_reduce(comm, a);
      },
      py::arg("comm"), py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("bounds"), py::arg("workspace"),
      py::arg("stream"), py::arg("side_stream") = 0, py::arg("side_workspace") = py::none(),
      "out [m, n] = AR(x[m, k] weight^T), chunk by chunk, in place in out.");

  m.def(
      "nccl_collective",
      [](Communicator& comm, const std::string& collective, py::handle x_, py::handle out_, int peer,
         uintptr_t stream) {
        const OptionalRef x = optional_arg(x_, "x");
        const OptionalRef out = optional_arg(out_, "out");
        const tp_kernels::Collective c = tp_kernels::parse_collective(collective, "collective");
        CollectiveArgs a = tp_kernels::collective_args(c, comm.rank(), comm.size(), comm.device(), opt(x), opt(out),
                                                       peer, stream_ptr(stream));
        py::gil_scoped_release release;
        tp_kernels::nccl_collective(comm, c, a);
      },
      py::arg("comm"), py::arg("collective"), py::arg("x"), py::arg("out"), py::arg("peer"), py::arg("stream"),
      "Collective `collective` (one of COLLECTIVES: all_reduce, all_gather and reduce_scatter over dim 0, "
      "broadcast and gather from/to rank `peer`, send to and recv from rank `peer`) on the communicator's NCCL "
      "communicator, enqueued on `stream` (capturable in a CUDA graph).");

  // Device building blocks of the peer-memory path (device_ops.h); flags are device addresses,
  // possibly a peer's.
  m.def("stream_memory_ops_available", &tp_kernels::stream_memory_ops_available,
        "Whether the driver provides what the fused path's flags and kernels need (cuStreamWriteValue32, "
        "cuModuleLoadData, cuLaunchKernel, ...).");
  m.def(
      "write_flag",
      [](uintptr_t flag, uint32_t value, uintptr_t stream) {
        tp_kernels::write_flag(ptr<uint32_t>(flag), value, stream_ptr(stream));
      },
      py::arg("flag"), py::arg("value"), py::arg("stream"),
      "Write `value` to the 32-bit flag on `stream` (stream memory operation, fenced).");
  m.def(
      "write_flags",
      [](std::vector<uintptr_t> flags, std::vector<uint32_t> values, uintptr_t stream) {
        if (flags.size() != values.size()) throw tp_kernels::ArgumentError("values: one value per flag");
        std::vector<uint32_t*> ptrs;
        for (uintptr_t f : flags) ptrs.push_back(ptr<uint32_t>(f));
        tp_kernels::write_flags(ptrs.data(), values.data(), static_cast<int>(ptrs.size()), stream_ptr(stream));
      },
      py::arg("flags"), py::arg("values"), py::arg("stream"),
      "Write values[i] to each 32-bit flag on `stream`, in one kernel launch (fenced system-wide first).");
  m.def(
      "wait_flags",
      [](std::vector<uintptr_t> flags, std::vector<uint32_t> codes, uint64_t timeout_ns, uintptr_t error_word,
         uintptr_t stream, std::vector<uint32_t> expect) {
        if (flags.size() != codes.size()) throw tp_kernels::ArgumentError("codes: one error code per flag");
        if (!expect.empty() && expect.size() != flags.size())
          throw tp_kernels::ArgumentError("expect: one expected value per flag, or none");
        std::vector<uint32_t*> f;
        for (uintptr_t a : flags) f.push_back(ptr<uint32_t>(a));
        tp_kernels::wait_flags(f.data(), codes.data(), expect.empty() ? nullptr : expect.data(),
                               static_cast<int>(f.size()), timeout_ns, ptr<uint32_t>(error_word), stream_ptr(stream));
      },
      py::arg("flags"), py::arg("codes"), py::arg("timeout_ns"), py::arg("error_word"), py::arg("stream"),
      py::arg("expect") = std::vector<uint32_t>{},
      "Make `stream` wait until every flag is nonzero, clearing each (consuming it); a flag still "
      "clear after timeout_ns puts its code in *error_word (host-readable memory) if that is 0, "
      "and the stream goes on; a flag set to another value than its `expect` entry (if given and "
      "not 0) puts its code | MISMATCH_BIT there. Waits return at once while *error_word is set.");
  m.def(
      "reduce_partials",
      [](py::handle inputs_, py::handle out_, uintptr_t stream) {
        const std::vector<TensorRef> inputs = arg_list(inputs_, "inputs");
        const TensorRef out = arg(out_, "out");
        const void* in[tp_kernels::kMaxRanks] = {};
        const int64_t count = tp_kernels::reduce_partials_args(inputs, out, in);
        tp_kernels::reduce_partials(in, static_cast<int>(inputs.size()), out.ptr(), count, out.dtype,
                                    stream_ptr(stream));
      },
      py::arg("inputs"), py::arg("out"), py::arg("stream"),
      "out = inputs[0] + ... + inputs[p-1] elementwise, in that order with fp32 accumulation "
      "(deterministic); p <= MAX_RANKS; out may be one of the inputs.");

  // The device code's images (driver.h), built by NVRTC: which one a device would load.
  {
    std::vector<std::string> kernels(std::begin(tp_kernels::kKernelNames), std::end(tp_kernels::kKernelNames));
    m.attr("KERNELS") = names(kernels);
  }
  m.attr("KERNEL_COMPILER") = tp_kernels::kKernelCompiler;
  m.def(
      "kernel_images",
      [] {
        py::list images;
        for (int i = 0; i < tp_kernels::kKernelImageCount; ++i) {
          const tp_kernels::KernelImage& im = tp_kernels::kKernelImages[i];
          py::dict d;
          d["target"] = im.target, d["arch"] = im.arch, d["ptx"] = im.ptx, d["arch_specific"] = im.arch_specific;
          d["data"] = py::bytes(reinterpret_cast<const char*>(im.data), im.size);
          images.append(d);
        }
        return images;
      },
      "The compiled images of the device code: dicts of target ('sm_90', 'compute_80'), arch, ptx, "
      "arch_specific and data (the cubin or PTX).");
  m.def(
      "kernel_image_for",
      [](int major, int minor) -> std::optional<std::string> {
        const tp_kernels::KernelImage* im = tp_kernels::kernel_image_for(major, minor);
        if (im == nullptr) return std::nullopt;
        return std::string(im->target);
      },
      py::arg("major"), py::arg("minor"),
      "The target of the image a device of compute capability major.minor loads, or None when none fits.");

  // The peer-memory (fused) path: workspace buffers, their IPC handles, contexts and ops (peer.h).
  m.def(
      "fused_region_needs",
      [](const std::string& op, int p, int64_t m_, int64_t n, int64_t k, const std::string& dtype,
         const std::optional<std::string>& algorithm) {
        return tp_kernels::fused_region_needs(
            tp_kernels::parse_primitive(op, "op"), p, m_, n, k, tp_kernels::parse_dtype(dtype, "dtype"),
            algorithm ? tp_kernels::parse_algorithm(*algorithm, "algorithm") : AllReduceAlgo::kOneShot);
      },
      py::arg("op"), py::arg("p"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("dtype"),
      py::arg("algorithm") = py::none(),
      "Bytes each region (in REGIONS order) needs on every rank for fused `op` (one of OPS) with p ranks, "
      "m rows (the gathered rows for all_gather_matmul), n, k, dtype and all-reduce algorithm, rounded "
      "up to REGION_ALIGNMENT.");
  m.def(
      "fused_call_word",
      [](const std::string& op, const std::optional<std::string>& algorithm, bool gemm, const std::string& dtype,
         int64_t n, int64_t k, std::vector<int64_t> bounds) {
        tp_kernels::OverlapArgs a;
        static const char kSomeWeight = 0;
        a.w = gemm ? &kSomeWeight : nullptr;  // only whether there is one enters the word
        a.dtype = tp_kernels::parse_dtype(dtype, "dtype");
        a.n = n, a.k = k, a.bounds = std::move(bounds);
        return tp_kernels::call_word(tp_kernels::parse_primitive(op, "op"),
                                     algorithm ? static_cast<int>(tp_kernels::parse_algorithm(*algorithm, "algorithm"))
                                               : -1,
                                     a);
      },
      py::arg("op"), py::arg("algorithm"), py::arg("gemm"), py::arg("dtype"), py::arg("n"), py::arg("k"),
      py::arg("bounds"),
      "The word a fused call's ready flags carry (peer.h): a hash of the op (one of OPS), the all-reduce "
      "algorithm (None: none), whether it multiplies, dtype, n, k and the row bounds; never 0 or 1.");
  m.def(
      "fused_all_reduce_needs",
      [](int p, int64_t count, const std::string& dtype, const std::string& algorithm) {
        return tp_kernels::fused_all_reduce_needs(p, count, tp_kernels::parse_dtype(dtype, "dtype"),
                                                  tp_kernels::parse_algorithm(algorithm, "algorithm"));
      },
      py::arg("p"), py::arg("count"), py::arg("dtype"), py::arg("algorithm"),
      "Bytes each region (in REGIONS order) needs on every rank for fused_all_reduce of `count` elements.");
  m.def(
      "all_reduce_layout",
      [](int64_t count, const std::string& dtype) {
        const tp_kernels::AllReduceLayout l = tp_kernels::all_reduce_layout(count, tp_kernels::parse_dtype(dtype, "dtype"));
        return py::make_tuple(l.rows, l.cols);
      },
      py::arg("count"), py::arg("dtype"), "The (rows, cols) view fused_all_reduce takes of `count` elements.");
  m.def(
      "two_shot_slice",
      [](int64_t count, int p, const std::string& dtype) {
        return tp_kernels::two_shot_slice(count, p, tp_kernels::parse_dtype(dtype, "dtype"));
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
                       double timeout_s, int sharing) {
             return std::make_shared<PeerContext>(rank, size, device, bases, region_bytes, timeout_s, sharing);
           }),
           py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("bases"), py::arg("region_bytes"),
           py::arg("timeout_s"), py::arg("sharing"))
      .def_property_readonly("rank", &PeerContext::rank)
      .def_property_readonly("size", &PeerContext::size)
      .def_property_readonly("device", &PeerContext::device)
      .def_property_readonly("sharing", &PeerContext::sharing)
      .def_property_readonly("region_bytes",
                             [](const PeerContext& c) {
                               std::vector<size_t> out;
                               for (int r = 0; r < tp_kernels::kNumRegions; ++r)
                                 out.push_back(c.region_bytes(static_cast<tp_kernels::Region>(r)));
                               return out;
                             })
      .def_property_readonly("copy_stream",
                             [](const PeerContext& c) { return reinterpret_cast<uintptr_t>(c.copy_stream()); })
      .def_property("timeout_s", &PeerContext::timeout_s, &PeerContext::set_timeout_s)
      .def_property_readonly("error_code", &PeerContext::error_code,
                             "The error word: 0, or the code of the first wait that timed out.")
      .def("describe", &PeerContext::describe, py::arg("code"), "The message for an error code.")
      .def("check", &PeerContext::check, "Raise the error a timed-out device wait recorded, if any.");

  m.attr("ALL_PHASES") = tp_kernels::kAllPhases;
  m.def(
      "fused_phases",
      [](const std::string& op, const std::optional<std::string>& algorithm) {
        return tp_kernels::fused_phases(
            tp_kernels::parse_primitive(op, "op"),
            algorithm ? tp_kernels::parse_algorithm(*algorithm, "algorithm") : AllReduceAlgo::kOneShot);
      },
      py::arg("op"), py::arg("algorithm") = py::none(),
      "The phases of fused `op` (peer.h): ranks driven by one process enqueue phase k of every rank before "
      "phase k + 1 of any.");
  m.def(
      "fused_all_gather_matmul",
      [](PeerContext& ctx, py::handle x, py::handle weight, py::handle bias, py::handle out, py::handle gathered,
         std::vector<int64_t> bounds, int phase, py::handle workspace, uintptr_t stream) {
        OverlapArgs a = primitive_call(Primitive::kAllGatherMatmul, ctx.size(), ctx.device(), x, weight, bias, out,
                                       gathered, "gathered", std::move(bounds), workspace, stream_ptr(stream));
        tp_kernels::check_phase(phase, tp_kernels::fused_phases(Primitive::kAllGatherMatmul, AllReduceAlgo::kOneShot));
        py::gil_scoped_release release;
        tp_kernels::fused_all_gather_matmul(ctx, a, phase);
      },
      py::arg("ctx"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("gathered"),
      py::arg("bounds"), py::arg("phase"), py::arg("workspace"), py::arg("stream"),
      "out [m, n] = AG(x)[m, k] weight^T (+ bias): shards published in the export regions and pulled by "
      "copy engine chunk by chunk (bounds over m/p) into `gathered` while the GEMM runs; `phase`: one "
      "phase, or ALL_PHASES.");
  m.def(
      "fused_matmul_reduce_scatter",
      [](PeerContext& ctx, py::handle x, py::handle weight, py::handle out, py::handle partial, int phase,
         py::handle workspace, uintptr_t stream) {
        OverlapArgs a = primitive_call(Primitive::kMatmulReduceScatter, ctx.size(), ctx.device(), x, weight, py::none(),
                                       out, partial, "partial", {}, workspace, stream_ptr(stream));
        tp_kernels::check_phase(phase,
                                tp_kernels::fused_phases(Primitive::kMatmulReduceScatter, AllReduceAlgo::kOneShot));
        py::gil_scoped_release release;
        tp_kernels::fused_matmul_reduce_scatter(ctx, a, phase);
      },
      py::arg("ctx"), py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("partial"), py::arg("phase"),
      py::arg("workspace"), py::arg("stream"),
      "out [m/p, n] = RS(x[m, k] weight^T): partials pushed by copy engine into their destination's inbox "
      "(through `partial` [m, n]), summed in rank order; `phase`: one phase, or ALL_PHASES.");
  m.def(
      "fused_matmul_all_reduce",
      [](PeerContext& ctx, py::handle x, py::handle weight, py::handle out, py::handle partial,
         std::vector<int64_t> bounds, const std::string& algorithm, int phase, py::handle workspace,
         uintptr_t stream) {
        const AllReduceAlgo algo = tp_kernels::parse_algorithm(algorithm, "algorithm");
        OverlapArgs a = primitive_call(Primitive::kMatmulAllReduce, ctx.size(), ctx.device(), x, weight, py::none(),
                                       out, partial, "partial", std::move(bounds), workspace, stream_ptr(stream));
        tp_kernels::check_all_reduce_algorithm(a, algo, ctx.size(), !partial.is_none());
        tp_kernels::check_phase(phase, tp_kernels::fused_phases(Primitive::kMatmulAllReduce, algo));
        py::gil_scoped_release release;
        tp_kernels::fused_matmul_all_reduce(ctx, a, algo, phase);
      },
      py::arg("ctx"), py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("partial"), py::arg("bounds"),
      py::arg("algorithm"), py::arg("phase"), py::arg("workspace"), py::arg("stream"),
      "out [m, n] = AR(x[m, k] weight^T) by `algorithm` (one of ALL_REDUCE_ALGORITHMS): bounds [0, m] for "
      "one_shot and two_shot; the p + 1 block boundaries and `partial` [m, n] for scatter_gather; `phase`: "
      "one phase, or ALL_PHASES.");
  m.def(
      "fused_all_reduce",
      [](PeerContext& ctx, py::handle x_, py::handle out_, const std::string& algorithm, int phase,
         uintptr_t stream) {
        const TensorRef x = arg(x_, "x");
        const TensorRef out = arg(out_, "out");
        const AllReduceAlgo algo = tp_kernels::parse_algorithm(algorithm, "algorithm");
        CollectiveArgs a = tp_kernels::collective_args(tp_kernels::Collective::kAllReduce, ctx.rank(), ctx.size(),
                                                       ctx.device(), &x, &out, -1, stream_ptr(stream));
        tp_kernels::check_phase(phase, tp_kernels::fused_phases(Primitive::kMatmulAllReduce, algo));
        py::gil_scoped_release release;
        tp_kernels::fused_all_reduce(ctx, a, algo, phase);
      },
      py::arg("ctx"), py::arg("x"), py::arg("out"), py::arg("algorithm"), py::arg("phase"), py::arg("stream"),
      "out = the sum over ranks of x (any shape, contiguous; out may be x) by `algorithm` (one of "
      "ALL_REDUCE_ALGORITHMS), over the workspace: the same bits for every algorithm; `phase`: one phase "
      "(fused_phases('matmul_all_reduce', algorithm)), or ALL_PHASES.");
}
