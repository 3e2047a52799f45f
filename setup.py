"""Build script for tp_kernels: the Python package, plus the native extension ``tp_kernels._C``
built by CMake (Ninja) when a CUDA compiler is available.

Build switches (environment variables):

* ``TP_KERNELS_SKIP_CUDA_BUILD=1``: install the pure-Python package only.
* ``TP_KERNELS_CUDA_ARCHS``: CUDA architectures, ``;``-separated (default ``80;90a``: A100, H100/H200).
* ``CUDA_HOME``: the CUDA toolkit (default: ``nvcc`` on ``PATH``, then ``/usr/local/cuda``). Its
  major (12 or 13) decides the build: one per CUDA major, like cupy-cuda12x / cupy-cuda13x.
* ``MAX_JOBS``: parallel compile jobs (default: the number of cores).
* ``TP_KERNELS_BUILD_TYPE``: CMake build type (default ``Release``).

Without nvcc the pure-Python package is installed, with a message saying so. NCCL and cuBLASLt
headers and libraries come from the NVIDIA wheels of that CUDA major (``nvidia-nccl-cu12`` and
``nvidia-cublas-cu12``; ``nvidia-nccl-cu13`` and ``nvidia-cublas``), build requirements that the
in-tree backend (``_build/tp_kernels_build.py``) adds only when the CUDA build will run. At run
time the extension uses the ones the CUDA torch of the same major already depends on; the
package requires none of them. The version says the CUDA major (``0.1.0+cu13``), and
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
from tp_kernels_build import CUDA_WHEELS, cuda_major, find_nvcc, nvcc_version  # noqa: E402  (one finder for both)

VERSION = "0.1.0"
DEFAULT_ARCHS = "80;90a"


def _log(msg: str) -> None:
    print(f"tp_kernels setup: {msg}", file=sys.stderr, flush=True)


def _wheel_root(package: str, marker: str) -> Path:
    """The directory of an installed ``nvidia.*`` wheel that holds ``marker``."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    for root in roots:
        if (Path(root) / marker).is_file():
            return Path(root)
    raise RuntimeError(f"{package} (with {marker}) is not installed in the build environment")


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
        nvcc, toolkit = find_nvcc()
        major, full = nvcc_version(nvcc)
        wheels = CUDA_WHEELS[major]
        import cmake  # noqa: F401  (build requirements: cmake, ninja, pybind11, NVIDIA wheels)
        import pybind11

        nccl_root = _wheel_root(wheels["nccl"][1], "include/nccl.h")
        cublas_root = _wheel_root(wheels["cublas"][1], f"lib/{wheels['cublaslt']}")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake_bin = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
        archs = os.environ.get("TP_KERNELS_CUDA_ARCHS", DEFAULT_ARCHS)
        configure = [
            # --fresh: a cache from an earlier build points into its own (deleted) build environment
            cmake_bin, "--fresh", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TP_KERNELS_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DTP_KERNELS_NCCL_ROOT={nccl_root}",
            f"-DTP_KERNELS_CUBLAS_ROOT={cublas_root}",
            f"-DTP_KERNELS_WHEELS={wheels['nccl'][0].split('==')[0]} and {wheels['cublas'][0].split('==')[0]}",
        ]
        if toolkit is not None:
            configure.append(f"-DCUDAToolkit_ROOT={toolkit}")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        _log(f"building tp_kernels._C for CUDA {major} with {nvcc} ({full}), archs {archs}, against NCCL "
             f"{_wheel_version(wheels['nccl'][0])} ({wheels['nccl'][0].split('==')[0]}) and cuBLAS "
             f"{_wheel_version(wheels['cublas'][0])} ({wheels['cublas'][0].split('==')[0]}); {jobs} jobs")
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
            _log("no nvcc found (set CUDA_HOME): installing the pure-Python package only; "
                 "tp_kernels.extension_status() will say so")
        return [], VERSION
    return [CMakeExtension("tp_kernels._C")], f"{VERSION}+cu{major}"


_modules, _version = _build_plan()
setup(version=_version, ext_modules=_modules, cmdclass={"build_ext": CMakeBuild})
