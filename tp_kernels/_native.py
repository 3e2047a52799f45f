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
    sees a CUDA device), ``cuda_reason`` (str or None), ``backends`` (names usable now: ``"fused"`` needs the native
    module and a CUDA device).
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
        "backends": [b for b in BACKEND_NAMES if b != "fused" or (_C is not None and cuda)],
    }


DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: cuBLASLt workspace per (device, stream); cuBLAS recommends 32 MiB on Hopper.
WORKSPACE_BYTES = 32 * 2**20
_workspaces: dict = {}


def _workspace(stream: "torch.cuda.Stream") -> torch.Tensor:
    key = (stream.device_index, stream.cuda_stream)
    ws = _workspaces.get(key)
    if ws is None:
        with torch.cuda.stream(stream):  # owned by this stream, as the caching allocator needs
            ws = _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=stream.device)
    return ws


def call_primitive(op, context, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   out: torch.Tensor, scratch: Optional[torch.Tensor], bounds, stream: "torch.cuda.Stream",
                   *extra) -> None:
    """Enqueue the native primitive ``op`` (``_C.all_gather_matmul``, ``_C.fused_matmul_all_reduce``,
    ...: they all take the same arguments, some then more: ``extra``) of the group ``context``
    (a ``Communicator`` or a ``PeerContext``) on ``stream``, with its cuBLASLt workspace.
    ``x`` is contiguous ``[rows, k]``; ``weight`` ``[n, k]`` in any layout (see :func:`weight_layout`)."""
    weight, ldw, col_major = weight_layout(weight)
    ws = _workspace(stream)
    op(context, x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
       0 if scratch is None else scratch.data_ptr(), weight.shape[0], x.shape[1], ldw, col_major, DTYPE_CODES[x.dtype],
       bounds, ws.data_ptr(), ws.numel(), stream.cuda_stream, *extra)


def weight_layout(weight: torch.Tensor):
    """``(weight, ldw, col_major)`` as the native GEMM takes ``W [n, k]``: row-major (``ldw >= k``),
    or column-major (``ldw >= n``: the transposed view of a row-major ``[k, n]``, as backward
    passes use); any other layout is copied to row-major."""
    n, k = weight.shape
    if weight.stride(1) == 1 and weight.stride(0) >= max(1, k):
        return weight, weight.stride(0), False
    if weight.stride(0) == 1 and weight.stride(1) >= max(1, n):
        return weight, weight.stride(1), True
    weight = weight.contiguous()
    return weight, max(1, k), False


def unavailable() -> Optional[str]:
    """Why the native module cannot be used here, or None when it can."""
    return None if _C is not None else f"the native extension is unavailable: {_reason}"


def env_switch(name: str, default: bool) -> bool:
    """The 0/1 environment variable ``name``, or ``default`` when it is unset or empty."""
    env = os.environ.get(name)
    if env in (None, ""):
        return default
    if env not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {env!r}")
    return env == "1"


def unsupported_tensors_reason(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why the native module cannot take these tensors here, or None (what every native path
    needs: the module, a CUDA device, a supported dtype, no empty dimension)."""
    reason = unavailable()
    if reason is not None:
        return reason
    if not x.is_cuda:
        return f"x is on {x.device.type}, not on a CUDA device"
    if x.dtype not in DTYPE_CODES:
        return f"dtype {x.dtype} is not supported natively (float32, float16, bfloat16)"
    if x.numel() == 0 or weight.numel() == 0:
        return f"an empty dimension (x {tuple(x.shape)}, weight {tuple(weight.shape)})"
    return None


def require() -> None:
    """Raise when the native module cannot be used here, with the reason."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Y = X Wᵀ + b`` through the native cuBLASLt GEMM, on the current stream (no autograd).

    Args:
        x: ``[m, k]`` CUDA tensor, float32/float16/bfloat16 (rows need not be adjacent, but the
            last dim must be contiguous; otherwise a contiguous copy is made).
        weight: ``[n, k]``, same dtype and device, row- or column-major (a transposed view is
            used as it is); bias: ``[n]`` or None.
        out: ``[m, n]``, same dtype and device, last dim contiguous (e.g. rows of a larger
            buffer), written in place; None for a new tensor.
    Returns:
        ``[m, n]`` (``out`` when given), accumulated in float32.
    """
    require()
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor")
    if not x.is_cuda:
        raise ValueError(f"x: expected a CUDA tensor, got device {x.device}")
    if x.dtype not in DTYPE_CODES:
        raise ValueError(f"x: dtype {x.dtype} is not supported (float32, float16, bfloat16)")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x: expected {weight.shape[1]} columns to match weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name}: dtype/device {t.dtype}/{t.device} do not match x's {x.dtype}/{x.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    x = x if x.stride(1) == 1 and x.stride(0) >= max(1, x.shape[1]) else x.contiguous()
    weight, ldw, col_major = weight_layout(weight)
    bias = None if bias is None else bias.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        y = x.new_empty((m, n))
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != x.dtype
          or out.device != x.device or out.stride(1) != 1 or out.stride(0) < max(1, n)):
        raise ValueError(f"out: expected a [{m}, {n}] {x.dtype} tensor on {x.device} with contiguous rows, got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    else:
        y = out
    if k == 0:  # an empty sum: the bias alone
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    with torch.cuda.device(x.device):  # the native side works on the current device
        stream = torch.cuda.current_stream(x.device)
        ws = _workspace(stream)
        _C.linear(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                  m, n, k, x.stride(0), ldw, y.stride(0), DTYPE_CODES[x.dtype], ws.data_ptr(), ws.numel(),
                  stream.cuda_stream, col_major)
    return y
