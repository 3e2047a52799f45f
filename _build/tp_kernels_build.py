"""In-tree PEP 517 backend: setuptools, plus the CUDA build's requirements only when it will run.

The native extension needs pybind11, CMake, Ninja and the NCCL and cuBLAS wheels to build.
Asking for them unconditionally would download about 600 MB of NVIDIA wheels on machines that
build the pure-Python package anyway (no nvcc, or ``TP_KERNELS_SKIP_CUDA_BUILD=1``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook not overridden below)

#: What the CUDA build adds. The NVIDIA wheels are pinned to the oldest versions we support, so
#: that the extension runs with those or newer.
CUDA_BUILD_REQUIRES = [
    "pybind11>=2.12",
    "cmake>=3.24",
    "ninja",
    "nvidia-nccl-cu13==2.28.9",
    "nvidia-cublas==13.1.0.3",
]


def skip_requested() -> bool:
    return os.environ.get("TP_KERNELS_SKIP_CUDA_BUILD", "0") not in ("", "0")


def toolkit_root(nvcc: Path):
    """The CUDA toolkit holding ``nvcc``, or None (e.g. a wrapper script elsewhere on PATH)."""
    root = nvcc.resolve().parent.parent
    return root if (root / "include" / "cuda_runtime.h").is_file() else None


def find_nvcc():
    """``(nvcc, toolkit root or None)``: ``CUDA_HOME``, then an nvcc on PATH that sits in a
    toolkit, then ``/usr/local/cuda``, then any nvcc on PATH; ``(None, None)`` if none."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    on_path = shutil.which("nvcc")
    candidates = [Path(cuda_home) / "bin" / "nvcc"] if cuda_home else []
    if on_path and toolkit_root(Path(on_path)):
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    if on_path:
        candidates.append(Path(on_path))
    for nvcc in candidates:
        if nvcc.is_file() and os.access(nvcc, os.X_OK):
            return nvcc, toolkit_root(nvcc)
    return None, None


def will_build_cuda() -> bool:
    return not skip_requested() and find_nvcc()[0] is not None


def _extra():
    return list(CUDA_BUILD_REQUIRES) if will_build_cuda() else []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra()
