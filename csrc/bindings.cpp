// Python bindings of tp_kernels._C: glue only. The C++ core is framework-free (csrc/include).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tp_kernels/check.h"
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
}
