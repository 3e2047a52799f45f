// Python bindings of tp_kernels._C: glue only. The C++ core is framework-free (csrc/include).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "tp_kernels/check.h"
#include "tp_kernels/gemm.h"
#include "tp_kernels/runtime_info.h"

namespace py = pybind11;

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
         int64_t ldw, int64_t ldy, int dtype, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
        tp_kernels::LinearArgs a;
        a.x = reinterpret_cast<const void*>(x);
        a.w = reinterpret_cast<const void*>(w);
        a.bias = reinterpret_cast<const void*>(bias);
        a.y = reinterpret_cast<void*>(y);
        a.m = m_, a.n = n, a.k = k, a.ldx = ldx, a.ldw = ldw, a.ldy = ldy;
        a.dtype = static_cast<tp_kernels::DType>(dtype);
        a.workspace = reinterpret_cast<void*>(workspace);
        a.workspace_bytes = workspace_bytes;
        a.stream = reinterpret_cast<cudaStream_t>(stream);
        py::gil_scoped_release release;
        tp_kernels::linear(a);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("ldx"), py::arg("ldw"), py::arg("ldy"), py::arg("dtype"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"),
      "Y[m, n] = X[m, k] W[n, k]^T (+ bias[n]) on cuBLASLt, row-major, enqueued on `stream` "
      "(dtype: 0 float32, 1 float16, 2 bfloat16; bias 0 for none).");
}
