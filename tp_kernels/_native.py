"""The one place that loads the native extension ``tp_kernels._C``.

Importing tp_kernels never fails for lack of it (or of a GPU): the reason it is unavailable is
kept and reported by :func:`extension_status`.

``_C`` needs ``libnccl.so.2`` and ``libcublasLt.so.13`` from the ``nvidia-nccl-cu13`` and
``nvidia-cublas`` wheels. Its RPATH finds them next to an installed package
(``$ORIGIN/../nvidia/...``); so that any layout works (an editable install in a source tree,
too), they are first loaded here by path from wherever those wheels are installed.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from typing import Optional

import torch

#: (package of the NVIDIA wheel, library _C links)
_NVIDIA_LIBRARIES = (("nvidia.nccl", "libnccl.so.2"), ("nvidia.cu13", "libcublasLt.so.13"))


def _preload_nvidia_libraries() -> None:
    for package, name in _NVIDIA_LIBRARIES:
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            path = os.path.join(root, "lib", name)
            if os.path.isfile(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break


_C = None
_reason: Optional[str] = None

if importlib.util.find_spec("tp_kernels._C") is None:
    _reason = "not built: this installation of tp_kernels has no native extension; the pure-PyTorch backends are used"
else:
    try:
        _preload_nvidia_libraries()
        _C = importlib.import_module("tp_kernels._C")
    except (ImportError, OSError) as exc:  # built, but cannot load here (e.g. a missing library)
        _reason = (
            f"tp_kernels._C failed to load: {exc}. Its libraries come from the nvidia-nccl-cu13 and "
            "nvidia-cublas wheels: pip install 'tp_kernels[cuda]'"
        )


def extension_status() -> dict:
    """Whether the native module is importable and a CUDA device usable, with reasons.

    Returns a dict: ``built`` (bool: the native module is importable), ``reason`` (str or None),
    ``native`` (the native module's view when built: CUDA runtime/driver, NCCL and cuBLASLt
    versions, ``device_count`` and ``device_error``; else None), ``cuda_available`` (torch
    sees a CUDA device), ``cuda_reason`` (str or None), ``backends`` (names usable now).
    """
    from .ops import BACKEND_NAMES

    cuda = torch.cuda.is_available()
    if cuda:
        cuda_reason = None
    elif torch.version.cuda is None:
        cuda_reason = "this torch build has no CUDA support"
    else:
        cuda_reason = "no CUDA device is visible"
    return {
        "built": _C is not None,
        "reason": _reason,
        "native": None if _C is None else _C.runtime_info(),
        "cuda_available": cuda,
        "cuda_reason": cuda_reason,
        "backends": list(BACKEND_NAMES),
    }
