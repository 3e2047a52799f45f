"""In-tree PEP 517 backend: setuptools, plus the CUDA build's requirements only when it will run.

The native extension is built for one CUDA major (:func:`cuda_major`: ``TP_KERNELS_CUDA_MAJOR``,
else the major of an nvcc found on the machine). It needs pybind11, CMake, Ninja and the NVIDIA
wheels of that major (:data:`CUDA_WHEELS`): the CUDA runtime (headers, ``libcudart``), NVRTC (which
compiles the device code: no CUDA toolkit is needed), NCCL and cuBLAS. Asking for them
unconditionally would download about 600 MB of NVIDIA wheels on machines that build the
pure-Python package anyway (no major chosen, or ``TP_KERNELS_SKIP_CUDA_BUILD=1``). They are
*build* requirements only: at run time the extension uses the CUDA runtime, NCCL and cuBLASLt that
the user's CUDA torch already depends on, and the package never installs or replaces them (the
NCCL wheels of the two CUDA majors own the same ``nvidia/nccl/lib/libnccl.so.2``).
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

#: Per CUDA major, each wheel the build uses: (requirement, the package holding its include/ and
#: lib/, a file of it that the build needs). Pinned to old versions (those torch 2.4 brought for
#: CUDA 12, torch 2.9 for CUDA 13: none newer than a torch tp_kernels runs with brings), so the
#: extension runs with those or newer. Build only: the headers the runtime headers include
#: (``crt/``, in CUDA 12's nvcc wheel; ``nv/target``, in CCCL's, whose CUDA 12 wheels carry it
#: from 12.9) and NVRTC; the others are loaded at run time too.
CUDA_WHEELS = {
    12: {"cudart": ("nvidia-cuda-runtime-cu12==12.1.105", "nvidia.cuda_runtime", "include/cuda_runtime_api.h"),
         "crt": ("nvidia-cuda-nvcc-cu12==12.1.105", "nvidia.cuda_nvcc", "include/crt/host_defines.h"),
         "cccl": ("nvidia-cuda-cccl-cu12==12.9.27", "nvidia.cuda_cccl", "include/nv/target"),
         "nvrtc": ("nvidia-cuda-nvrtc-cu12==12.1.105", "nvidia.cuda_nvrtc", "lib/libnvrtc.so.12"),
         "nccl": ("nvidia-nccl-cu12==2.20.5", "nvidia.nccl", "include/nccl.h"),
         "cublas": ("nvidia-cublas-cu12==12.1.3.1", "nvidia.cublas", "lib/libcublasLt.so.12")},
    13: {"cudart": ("nvidia-cuda-runtime==13.0.96", "nvidia.cu13", "include/cuda_runtime_api.h"),
         "crt": ("nvidia-cuda-crt==13.0.88", "nvidia.cu13", "include/crt/host_defines.h"),
         "cccl": ("nvidia-cuda-cccl==13.0.85", "nvidia.cu13", "include/nv/target"),
         "nvrtc": ("nvidia-cuda-nvrtc==13.0.88", "nvidia.cu13", "lib/libnvrtc.so.13"),
         "nccl": ("nvidia-nccl-cu13==2.28.9", "nvidia.nccl", "include/nccl.h"),
         "cublas": ("nvidia-cublas==13.1.0.3", "nvidia.cu13", "lib/libcublasLt.so.13")},
}

#: The wheels of CUDA_WHEELS whose libraries the extension loads at run time.
RUNTIME_WHEELS = ("cudart", "nccl", "cublas")
#: Those that only add include directories (a CUDA toolkit of the same major has them too).
HEADER_WHEELS = ("crt", "cccl")

#: The environment variable that chooses the CUDA major to build for.
MAJOR_VARIABLE = "TP_KERNELS_CUDA_MAJOR"


def runtime_requirements(major: int) -> list:
    """The NVIDIA wheels whose libraries the CUDA ``major`` build loads (those a CUDA torch of that
    major brings), as pinned requirements: what a machine without such a torch installs to load it.

        python _build/tp_kernels_build.py runtime 12
    """
    return [CUDA_WHEELS[major][key][0] for key in RUNTIME_WHEELS]


def package_dirs(package: str) -> list:
    """The directories of an installed (namespace) package such as ``nvidia.cu13``; [] if none."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        return []
    return [Path(d) for d in spec.submodule_search_locations] if spec and spec.submodule_search_locations else []


def wheel_root(major: int, key: str) -> Path:
    """Where the build finds ``CUDA_WHEELS[major][key]``: the directory of the installed wheel that
    holds its file; for headers only (``HEADER_WHEELS``), else a CUDA toolkit of the same major
    (a torch environment, built in with ``--no-build-isolation``, has all the other wheels)."""
    requirement, package, marker = CUDA_WHEELS[major][key]
    for root in package_dirs(package):
        if (root / marker).is_file():
            return root
    nvcc = find_nvcc() if key in HEADER_WHEELS else None
    if nvcc is not None and nvcc_version(nvcc)[0] == major:
        toolkit = nvcc.resolve().parent.parent
        if (toolkit / marker).is_file():
            return toolkit
    name = requirement.split("==")[0]
    raise RuntimeError(f"the CUDA {major} build needs {name} (its {marker}), which is not installed: pip install "
                       f"'{name}>={requirement.split('==')[1]}', or build with isolation (no --no-build-isolation)"
                       + (f", or with a CUDA {major} toolkit's nvcc on PATH" if key in HEADER_WHEELS else ""))


def skip_requested() -> bool:
    return os.environ.get("TP_KERNELS_SKIP_CUDA_BUILD", "0") not in ("", "0")


def find_nvcc() -> Optional[Path]:
    """The machine's nvcc, or None: ``CUDA_HOME``'s, then one on PATH, then ``/usr/local/cuda``'s.
    (Only its version is read: it says which CUDA major a build defaults to.)"""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    on_path = shutil.which("nvcc")
    candidates = [Path(cuda_home) / "bin" / "nvcc"] if cuda_home else []
    candidates += [Path(on_path)] if on_path else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for nvcc in candidates:
        if nvcc.is_file() and os.access(nvcc, os.X_OK):
            return nvcc
    return None


def nvcc_version(nvcc: Path) -> Tuple[int, str]:
    """``(CUDA major, full version)`` of ``nvcc`` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"release (\d+)\.(\d+), V([\d.]+)", out)
    if not found:
        raise RuntimeError(f"{nvcc} --version said no release: {out!r}")
    return int(found.group(1)), found.group(3)


def cuda_major() -> Optional[int]:
    """The CUDA major the extension will be built for, or None when it will not be built:
    ``TP_KERNELS_CUDA_MAJOR`` (12 or 13), else the major of the nvcc found (:func:`find_nvcc`: a
    machine's toolkit says which CUDA it runs), else None."""
    if skip_requested():
        return None
    chosen = os.environ.get(MAJOR_VARIABLE, "").strip()
    if chosen:
        if not chosen.isdigit() or int(chosen) not in CUDA_WHEELS:
            raise RuntimeError(f"{MAJOR_VARIABLE} must be one of {', '.join(map(str, sorted(CUDA_WHEELS)))}, "
                               f"got '{chosen}'")
        return int(chosen)
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    major, full = nvcc_version(nvcc)
    if major not in CUDA_WHEELS:
        raise RuntimeError(f"tp_kernels builds for CUDA {sorted(CUDA_WHEELS)}; {nvcc} is CUDA {full}. Set "
                           f"{MAJOR_VARIABLE}=12 or 13 (no toolkit is needed), or TP_KERNELS_SKIP_CUDA_BUILD=1 for the "
                           "pure-Python package")
    return major


def _extra():
    major = cuda_major()
    if major is None:
        return []
    return CUDA_BUILD_TOOLS + [requirement for requirement, _, _ in CUDA_WHEELS[major].values()]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra()


def build_requirements(major: int) -> list:
    """Everything building the CUDA ``major`` extension needs: pyproject.toml's build system, the
    tools and every wheel of :data:`CUDA_WHEELS` (what ``--no-build-isolation`` expects to find)."""
    import tomllib  # Python 3.11+, as the scripts that ask for this list run

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        system = tomllib.load(f)["build-system"]["requires"]
    return system + CUDA_BUILD_TOOLS + [requirement for requirement, _, _ in CUDA_WHEELS[major].values()]


if __name__ == "__main__":  # the requirements of a major, for scripts (.ci/run)
    import sys

    lists = {"runtime": runtime_requirements, "build": build_requirements}
    if len(sys.argv) != 3 or sys.argv[1] not in lists or not sys.argv[2].isdigit() or int(sys.argv[2]) not in CUDA_WHEELS:
        sys.exit(f"usage: {sys.argv[0]} {{runtime|build}} {{{'|'.join(map(str, sorted(CUDA_WHEELS)))}}}")
    print(" ".join(lists[sys.argv[1]](int(sys.argv[2]))))
