"""The one place that loads the native extension ``tp_kernels._C``.

Importing tp_kernels never fails for lack of it (or of a GPU): the reason it is unavailable is
kept and reported by :func:`extension_status`.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

_C = None
_reason: Optional[str] = None

try:
    _C = importlib.import_module("tp_kernels._C")
except ModuleNotFoundError as exc:
    if exc.name == "tp_kernels._C":
        _reason = "not built: this installation of tp_kernels has no native extension; the pure-PyTorch backends are used"
    else:
        _reason = f"tp_kernels._C needs {exc.name!r}, which is not installed ({exc})"
except ImportError as exc:  # built, but it cannot load here (e.g. a missing shared library)
    _reason = f"tp_kernels._C failed to load: {exc}"


def extension_status() -> dict:
    """Whether the native module is importable and a CUDA device usable, with reasons.

    Returns a dict: ``built`` (bool), ``reason`` (str or None), ``cuda_available`` (bool),
    ``cuda_reason`` (str or None), ``backends`` (the backend names usable now).
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
        "cuda_available": cuda,
        "cuda_reason": cuda_reason,
        "backends": list(BACKEND_NAMES),
    }
