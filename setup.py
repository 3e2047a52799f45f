"""Build script for tp_kernels: the Python package, plus the native extension ``tp_kernels._C``
built by CMake (Ninja) when a CUDA compiler is available.

Build switches (environment variables):

* ``TP_KERNELS_SKIP_CUDA_BUILD=1``: install the pure-Python package only.
* ``TP_KERNELS_CUDA_ARCHS``: CUDA architectures, ``;``-separated (default ``80;90a``).
* ``CUDA_HOME``: the CUDA toolkit (default: ``nvcc`` on ``PATH``, then ``/usr/local/cuda``).
* ``MAX_JOBS``: parallel compile jobs (default: the number of cores).
* ``TP_KERNELS_BUILD_TYPE``: CMake build type (default ``Release``).

Without nvcc the pure-Python package is installed, with a message saying so. NCCL and
cuBLASLt headers and libraries come from the ``nvidia-nccl-cu13`` and ``nvidia-cublas`` wheels,
build requirements that the in-tree backend (``_build/tp_kernels_build.py``) adds only when the
CUDA build will run; at run time the same wheels provide the libraries
(``pip install tp_kernels[cuda]``, or any CUDA 13 torch, which depends on them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "_build"))
from tp_kernels_build import find_nvcc, skip_requested  # noqa: E402  (one nvcc finder for both)


def _log(msg: str) -> None:
    print(f"tp_kernels setup: {msg}", file=sys.stderr, flush=True)


def _wheel_root(package: str, marker: str) -> Path:
    """The directory of an installed ``nvidia.*`` wheel that holds ``include/<marker>``."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    for root in roots:
        if (Path(root) / "include" / marker).is_file():
            return Path(root)
    raise RuntimeError(f"{package} (with include/{marker}) is not installed in the build environment")


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        nvcc, toolkit = find_nvcc()
        import cmake  # noqa: F401  (build requirements: cmake, ninja, pybind11, NVIDIA wheels)
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake_bin = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
        configure = [
            # --fresh: a cache from an earlier build points into its own (deleted) build environment
            cmake_bin, "--fresh", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TP_KERNELS_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DTP_KERNELS_NCCL_ROOT={_wheel_root('nvidia.nccl', 'nccl.h')}",
            f"-DTP_KERNELS_CUBLAS_ROOT={_wheel_root('nvidia.cu13', 'cublasLt.h')}",
        ]
        if toolkit is not None:
            configure.append(f"-DCUDAToolkit_ROOT={toolkit}")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        _log(f"building tp_kernels._C with {nvcc} (archs {os.environ.get('TP_KERNELS_CUDA_ARCHS', '80;90a')}, {jobs} jobs)")
        subprocess.run(configure, check=True)
        subprocess.run([cmake_bin, "--build", str(build_dir), "--parallel", jobs], check=True)


def _ext_modules():
    if skip_requested():
        _log("TP_KERNELS_SKIP_CUDA_BUILD is set: installing the pure-Python package only")
        return []
    if find_nvcc()[0] is None:
        _log("no nvcc found (set CUDA_HOME): installing the pure-Python package only; "
             "tp_kernels.extension_status() will say so")
        return []
    return [CMakeExtension("tp_kernels._C")]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": CMakeBuild})
