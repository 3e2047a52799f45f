"""The ``pipelined`` schedule in the native extension, for CUDA tensors.

The GEMMs run on cuBLASLt on the caller's stream and the collectives on NCCL on a communication
stream of the group's own communicator (``tp_kernels._C.Communicator``), chunk by chunk with
the boundaries of :func:`tp_kernels.schedule.chunk_bounds` (passed to the native code, so the
CPU-tested schedule is the one run). Nothing blocks the host: the ops can be captured in a CUDA
graph once the group's communicator exists.

:func:`tp_kernels.ops.select_backend` routes CUDA tensors here for ``backend="pipelined"``
after :func:`unsupported_reason` says the case is supported, and for ``"auto"`` when
:func:`auto_enabled` also allows it.

The communicator is made on a group's first native call: rank 0 makes an NCCL unique id and
sends it over the torch group (whatever its backend: with a gloo group the tensors still move
by NCCL), then every rank joins, bounded by :func:`tp_kernels.get_timeout`. A collective that
does not complete within that timeout is caught by the communicator's watchdog, which aborts
it; the next call on the group raises the error.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import _comm, _native
from .._comm import Pending
from ..schedule import chunk_bounds
from .reference import bias_epilogue

__all__ = [
    "AUTO_DISABLED_REASON",
    "all_gather_matmul",
    "auto_enabled",
    "destroy_communicators",
    "get_comm_stream_priority",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "set_comm_stream_priority",
    "unsupported_reason",
]

#: (id(group), group name, device index) -> (group, communicator). The group is kept so that its
#: id cannot be reused by another group while the entry lives.
_communicators: dict = {}

_HIGHEST_PRIORITY = -(2**31)  # clamped by the native side to the device's highest priority
_priority: Optional[int] = None


def set_comm_stream_priority(priority: int) -> None:
    """Priority of the communication stream of communicators created from now on.

    CUDA's convention: a lower number is a higher priority; values beyond the device's range are
    clamped to it. The default is the highest priority, so that NCCL kernels are scheduled
    promptly between GEMM blocks (``TP_KERNELS_COMM_STREAM_PRIORITY`` overrides it).
    """
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: expected an int, got {priority!r}")
    global _priority
    _priority = priority


def get_comm_stream_priority() -> int:
    """The priority new communication streams ask for (see :func:`set_comm_stream_priority`)."""
    if _priority is not None:
        return _priority
    env = os.environ.get("TP_KERNELS_COMM_STREAM_PRIORITY")
    if env:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"TP_KERNELS_COMM_STREAM_PRIORITY: expected an int, got {env!r}") from None
    return _HIGHEST_PRIORITY


#: Whether ``backend="auto"`` may pick this path without being asked. It stays off until the GPU
#: suite (``bench/gpu_suite.sh``) has passed with it and measured it against the reference:
#: ``"auto"`` must never be wrong or slower. ``TP_KERNELS_AUTO_NATIVE=1`` (or ``0``) overrides it.
AUTO_DEFAULT = False
AUTO_DISABLED_REASON = ("the native path is not yet chosen automatically (it has not passed the GPU suite); "
                        "use backend='pipelined', or set TP_KERNELS_AUTO_NATIVE=1")


def auto_enabled() -> bool:
    """Whether ``backend="auto"`` may run the native path (see ``AUTO_DEFAULT``)."""
    return _native.env_switch("TP_KERNELS_AUTO_NATIVE", AUTO_DEFAULT)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, group) -> Optional[str]:
    """Why the native path cannot run this call, or None when it can.

    Depends only on what every rank of the group shares (the extension, the device type, dtype
    and shapes, whether a capture is running), so all ranks decide alike.
    """
    reason = _native.unsupported_tensors_reason(x, weight)
    if reason is not None:
        return reason
    if (not torch.compiler.is_compiling() and _comm.group_size(group) > 1
            and _comm.group_key(group, x.device) not in _communicators and torch.cuda.is_current_stream_capturing()):
        return ("the group's NCCL communicator is made on its first call, which a CUDA graph capture "
                "cannot contain: run the op once before capturing")
    return None


def _communicator(group, device: torch.device):
    """The group's communicator on ``device``, made on first use (a collective call)."""
    key = _comm.group_key(group, device)
    entry = _communicators.get(key)
    if entry is None:
        p, r = _comm.group_size(group), _comm.group_rank(group)
        # Rank 0's id reaches the others through a bounded all-gather over the torch group.
        uid = _native._C.nccl_unique_id() if r == 0 else bytes(_native._C.NCCL_UNIQUE_ID_BYTES)
        uid = _comm.all_gather_bytes(uid, group, device)[0]
        comm = _native._C.Communicator(uid, r, p, device.index, get_comm_stream_priority(), _comm.get_timeout())
        entry = _communicators[key] = (group, comm)
    comm = entry[1]
    timeout = _comm.get_timeout()
    if comm.timeout_s != timeout:
        comm.timeout_s = timeout
    return comm


def destroy_communicators(group=None) -> None:
    """Close the communicators of ``group`` (of every group when None); errors are not raised."""
    for key in [k for k, (g, _) in _communicators.items() if group is None or g is group]:
        _, comm = _communicators.pop(key)
        try:
            comm.close()
        except RuntimeError:
            pass  # ended by an error: the communicator was already aborted


def _call(op, x, weight, bias, out, scratch, rows: int, group, num_chunks: int) -> None:
    with torch.cuda.device(x.device):
        comm = _communicator(group, x.device)
        bounds = [0] + [b for _, b in chunk_bounds(rows, num_chunks)]
        _native.call_primitive(op, comm, x, weight, bias, out, scratch, bounds, torch.cuda.current_stream(x.device))


def _check(x, weight, group) -> None:
    reason = unsupported_reason(x, weight, group)
    if reason is not None:
        raise ValueError(f"the native pipelined backend cannot run this call: {reason}")


def all_gather_matmul(x, weight, bias, group, num_chunks):
    _check(x, weight, group)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    p = _comm.group_size(group)
    if p == 1:
        return _native.linear(x, weight, bias), x
    mp, k = x.shape
    gathered = x.new_empty((p * mp, k))
    out = x.new_empty((p * mp, weight.shape[0]))
    _call(_native._C.all_gather_matmul, x, weight, bias, out, gathered, mp, group, num_chunks)
    return out, gathered


def _reduction(op: str, what: str, scatter: bool, x, weight, bias, group, num_chunks) -> Pending:
    """GEMM + reduce-scatter (``scatter``) or all-reduce; the bias is added after the reduction."""
    _check(x, weight, group)
    p = _comm.group_size(group)
    if p == 1:
        return Pending(_native.linear(x, weight, bias), what=what)
    x = x.contiguous()
    m, n = x.shape[0], weight.shape[0]
    rows = m // p if scatter else m  # the rows chunked, and the output's
    out = x.new_empty((rows, n))
    partial = x.new_empty((m, n)) if scatter else None  # destination-major chunks of x Wᵀ
    _call(getattr(_native._C, op), x, weight, None, out, partial, rows, group, num_chunks)
    return Pending(out, what=what, group=group, finish=bias_epilogue(bias))


def matmul_reduce_scatter(x, weight, bias, group, num_chunks) -> Pending:
    return _reduction("matmul_reduce_scatter", "matmul+reduce-scatter", True, x, weight, bias, group, num_chunks)


def matmul_all_reduce(x, weight, bias, group, num_chunks) -> Pending:
    return _reduction("matmul_all_reduce", "matmul+all-reduce", False, x, weight, bias, group, num_chunks)
