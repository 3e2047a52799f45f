"""In-tree PEP 517 backend: setuptools, plus the CUDA build's requirements only when it will run.

The native extension needs pybind11, CMake, Ninja and the NCCL and cuBLAS wheels of the CUDA
major its nvcc compiles for (:data:`CUDA_WHEELS`) to build. Asking for them unconditionally would
download about 600 MB of NVIDIA wheels on machines that build the pure-Python package anyway (no
nvcc, or ``TP_KERNELS_SKIP_CUDA_BUILD=1``). They are *build* requirements only: at run time the
extension uses the NCCL and cuBLASLt that the user's CUDA torch already depends on, and the
package never installs or replaces them (the NCCL wheels of the two CUDA majors own the same
``nvidia/nccl/lib/libnccl.so.2``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Tuple

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook not overridden below)

#: The tools the CUDA build adds.
CUDA_BUILD_TOOLS = ["pybind11>=2.12", "cmake>=3.24", "ninja"]

#: Per CUDA major: (the NCCL wheel, its package holding include/ and lib/), (the cuBLAS wheel, its
#: package), and the cuBLASLt soname. Pinned to the oldest versions we support (those a torch of
#: that major brings: torch 2.4 for CUDA 12, 2.9 for CUDA 13), so the extension runs with those or
#: newer.
CUDA_WHEELS = {
    12: {"nccl": ("nvidia-nccl-cu12==2.20.5", "nvidia.nccl"),
         "cublas": ("nvidia-cublas-cu12==12.1.3.1", "nvidia.cublas"), "cublaslt": "libcublasLt.so.12"},
    13: {"nccl": ("nvidia-nccl-cu13==2.28.9", "nvidia.nccl"),
         "cublas": ("nvidia-cublas==13.1.0.3", "nvidia.cu13"), "cublaslt": "libcublasLt.so.13"},
}


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


def nvcc_version(nvcc: Path) -> Tuple[int, str]:
    """``(CUDA major, full version)`` of ``nvcc`` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"release (\d+)\.(\d+), V([\d.]+)", out)
    if not found:
        raise RuntimeError(f"{nvcc} --version said no release: {out!r}")
    return int(found.group(1)), found.group(3)


def cuda_major() -> Optional[int]:
    """The CUDA major the extension will be built for, or None when it will not be built."""
    if skip_requested():
        return None
    nvcc, _ = find_nvcc()
    if nvcc is None:
        return None
    major, full = nvcc_version(nvcc)
    if major not in CUDA_WHEELS:
        raise RuntimeError(f"tp_kernels builds for CUDA {sorted(CUDA_WHEELS)}; {nvcc} is CUDA {full}. Point CUDA_HOME "
                           "at a supported toolkit, or set TP_KERNELS_SKIP_CUDA_BUILD=1 for the pure-Python package")
    return major


def _extra():
    major = cuda_major()
    if major is None:
        return []
    wheels = CUDA_WHEELS[major]
    return CUDA_BUILD_TOOLS + [wheels["nccl"][0], wheels["cublas"][0]]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra()
