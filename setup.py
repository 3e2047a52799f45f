"""Build script for tp_kernels: the Python package, plus the native extension ``tp_kernels._C``
built by CMake (Ninja) for one CUDA major, like cupy-cuda12x / cupy-cuda13x.

Build switches (environment variables):

* ``TP_KERNELS_CUDA_MAJOR``: ``12`` or ``13``, the CUDA major to build for (default: the major of
  the machine's nvcc, ``CUDA_HOME``'s, on ``PATH`` or in ``/usr/local/cuda``; without one, the
  pure-Python package). No CUDA toolkit is needed: the host code is C++ against the CUDA runtime
  headers of the NVIDIA wheel, and NVRTC compiles the device code.
* ``TP_KERNELS_SKIP_CUDA_BUILD=1``: install the pure-Python package only.
* ``TP_KERNELS_CUDA_ARCHS``: the device code's architectures, ``;``-separated (default ``80;90``:
  A100, H100/H200; a PTX of the first is added, which the driver compiles for newer GPUs).
* ``MAX_JOBS``: parallel compile jobs (default: the number of cores).
* ``TP_KERNELS_BUILD_TYPE``: CMake build type (default ``Release``).

The headers and libraries come from the NVIDIA wheels of that CUDA major (CUDA 12:
``nvidia-cuda-runtime-cu12``, ``nvidia-cuda-nvrtc-cu12``, ``nvidia-nccl-cu12``,
``nvidia-cublas-cu12``; CUDA 13: ``nvidia-cuda-runtime``, ``nvidia-cuda-nvrtc``,
``nvidia-nccl-cu13``, ``nvidia-cublas``), build requirements that the in-tree backend
(``_build/tp_kernels_build.py``) adds only when the CUDA build will run. At run time the extension
uses the CUDA runtime, NCCL and cuBLASLt that the CUDA torch of the same major already depends on;
the package requires none of them. The version says the CUDA major (``0.1.0+cu13``), and
``tp_kernels/_C_build.json``, written next to the extension, what it was built with.
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
from tp_kernels_build import (  # noqa: E402  (one decision for both)
    CUDA_WHEELS, HEADER_WHEELS, MAJOR_VARIABLE, cuda_major, runtime_requirements, wheel_root)

VERSION = "0.1.0"
DEFAULT_ARCHS = "80;90"


def _log(msg: str) -> None:
    print(f"tp_kernels setup: {msg}", file=sys.stderr, flush=True)


def _wheel_version(requirement: str) -> str:
    """The installed version of the wheel ``requirement`` names (``"nvidia-nccl-cu13==2.28.9"``)."""
    from importlib.metadata import PackageNotFoundError, version

    name = requirement.split("==")[0]
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        major = cuda_major()
        wheels = CUDA_WHEELS[major]
        import cmake  # noqa: F401  (build requirements: cmake, ninja, pybind11, NVIDIA wheels)
        import pybind11

        roots = {key: wheel_root(major, key) for key in wheels}
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake_bin = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
        archs = os.environ.get("TP_KERNELS_CUDA_ARCHS", DEFAULT_ARCHS)
        runtime = runtime_requirements(major)
        configure = [
            # --fresh: a cache from an earlier build points into its own (deleted) build environment
            cmake_bin, "--fresh", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TP_KERNELS_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DTP_KERNELS_CUDA_MAJOR={major}",
            f"-DTP_KERNELS_CUDA_ARCHS={archs}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DTP_KERNELS_CUDART_ROOT={roots['cudart']}",
            f"-DTP_KERNELS_HEADER_ROOTS={';'.join(str(roots[key]) for key in HEADER_WHEELS)}",
            f"-DTP_KERNELS_NVRTC_ROOT={roots['nvrtc']}",
            f"-DTP_KERNELS_NCCL_ROOT={roots['nccl']}",
            f"-DTP_KERNELS_CUBLAS_ROOT={roots['cublas']}",
            f"-DTP_KERNELS_WHEELS={', '.join(n.split('==')[0] for n in runtime)}",
        ]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        _log(f"building tp_kernels._C for CUDA {major}, device code for archs {archs} by NVRTC "
             f"{_wheel_version(wheels['nvrtc'][0])}, against "
             + ", ".join(f"{n.split('==')[0]} {_wheel_version(n)}" for n in runtime) + f"; {jobs} jobs")
        subprocess.run(configure, check=True)
        subprocess.run([cmake_bin, "--build", str(build_dir), "--parallel", jobs], check=True)


    def copy_extensions_to_source(self) -> None:
        """An in-place (editable) install: the module's build record goes next to it too."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            record = os.path.join(os.path.dirname(regular_file), "_C_build.json")
            if os.path.exists(record):
                self.copy_file(record, os.path.join(os.path.dirname(inplace_file), "_C_build.json"), level=self.verbose)


def _build_plan():
    """(extension modules, version): the version names the CUDA major the extension is built for."""
    major = cuda_major()
    if major is None:
        if os.environ.get("TP_KERNELS_SKIP_CUDA_BUILD", "0") not in ("", "0"):
            _log("TP_KERNELS_SKIP_CUDA_BUILD is set: installing the pure-Python package only")
        else:
            _log(f"no CUDA major chosen ({MAJOR_VARIABLE}=12 or 13, or an nvcc on the machine): installing the "
                 "pure-Python package only; tp_kernels.extension_status() will say so")
        return [], VERSION
    return [CMakeExtension("tp_kernels._C")], f"{VERSION}+cu{major}"


_modules, _version = _build_plan()
setup(version=_version, ext_modules=_modules, cmdclass={"build_ext": CMakeBuild})
