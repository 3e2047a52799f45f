"""The ``pipelined`` schedule in the native extension (implementation ``"native"``), for CUDA
tensors: what ``backend="pipelined"`` runs wherever :func:`unsupported_reason` allows it.

The GEMMs run on cuBLASLt on the caller's stream (or, with
:func:`tp_kernels.settings.set_gemm_streams` at 2, alternating with a second stream of the group's
communicator, ``gemm_stream``) and the collectives on NCCL on a communication stream of the
group's own communicator (``tp_kernels._C.Communicator``), chunk by chunk with
the boundaries of :func:`tp_kernels.schedule.chunk_bounds` and the ring of
:func:`tp_kernels.schedule.ring` (passed to the native code, so the CPU-tested schedule is the
one run). Nothing blocks the host: the ops can be captured in a CUDA graph once the group's
communicator exists.

The communicator is made on a group's first native call: rank 0 makes an NCCL unique id and
sends it over the torch group (whatever its backend: with a gloo group the tensors still move
by NCCL), then every rank joins, bounded by :func:`tp_kernels.get_timeout`. A collective that
does not complete within that timeout is caught by the communicator's watchdog, which aborts
it; the next call on the group raises the error. ``destroy_model_parallel`` closes a group's
communicators.

The plain collectives of :class:`tp_kernels.Communicator` (``all_reduce`` ... ``recv``) run on
the same communicator, enqueued on the caller's stream (``_C.nccl_collective``), so that a CUDA
graph captures them; the collectives that only move data take any dtype, as bytes.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _collectives as coll
from .. import _extension, parallel_state, settings
from .._collectives import Pending
from .._op_table import REDUCTIONS
from ..schedule import boundaries, ring
from .reference import bias_epilogue

__all__ = [
    "all_gather",
    "all_gather_matmul",
    "all_reduce",
    "broadcast",
    "communicator",
    "destroy_communicators",
    "gather",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "recv",
    "reduce_scatter",
    "send",
    "unsupported_collective_reason",
    "unsupported_reason",
]

#: (id(group), device index, NCCL blocking mode) -> (group, communicator). The group
#: is kept so that its id cannot be reused by another group while the entry lives.
_communicators: dict = {}


@functools.lru_cache(maxsize=1)
def _nccl_can_revoke() -> bool:
    """Whether the NCCL loaded has ``ncclCommRevoke`` (2.28.9 and later), which a communicator in
    NCCL's blocking mode needs (the watchdog revokes an enqueue blocked past the timeout): the
    extension's answer, the one the communicator's making checks too."""
    return _extension.require().nccl_can_revoke()


def blocking_mode() -> bool:
    """Whether a communicator made now is in NCCL's blocking mode: as
    :func:`tp_kernels.settings.nccl_blocking` is set, and by default (unset) where the NCCL loaded
    has ``ncclCommRevoke``, which bounds a blocked call (else nonblocking, each call polled
    against the timeout)."""
    chosen = settings.nccl_blocking()
    return _nccl_can_revoke() if chosen is None else chosen


def _key(group, device: torch.device) -> tuple:
    """The group's communicator's entry in :data:`_communicators` on ``device``, in the NCCL mode
    of a communicator made now (:func:`blocking_mode`: a communicator of each mode, where the mode
    was changed between calls, as the host benchmark changes it)."""
    return (*coll.group_key(group, device), blocking_mode())


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, group) -> Optional[str]:
    """Why the native path cannot run this call, or None when it can.

    Depends only on what every rank of the group shares (the extension, the device type, dtype
    and shapes, whether a capture is running), so all ranks decide alike.
    """
    return _extension.unsupported_tensors_reason(x, weight) or _capture_reason(x, group, gemms=True)


def unsupported_collective_reason(collective: str, x: torch.Tensor, group) -> Optional[str]:
    """Why the native path cannot run this collective, or None when it can (the reductions need a
    dtype of ``_C.DTYPES``; the others move any dtype). Depends only on what the ranks share."""
    return (_extension.unsupported_collective_reason(collective in REDUCTIONS, x)
            or _capture_reason(x, group, gemms=False))


def _capture_reason(x: torch.Tensor, group, gemms: bool) -> Optional[str]:
    """Why a call cannot be captured now: what its first call makes (the communicator; for an op
    that multiplies, ``gemms``, the second GEMM stream's workspace where two streams are asked for)
    is not made yet."""
    if (not torch.compiler.is_compiling() and coll.group_size(group) > 1
            and torch.cuda.is_current_stream_capturing()):
        entry = _communicators.get(_key(group, x.device))
        if entry is None:
            return ("the group's NCCL communicator is made on its first call, which a CUDA graph capture "
                    "cannot contain: run the op once before capturing")
        if gemms and settings.gemm_streams() == 2 and not _extension.has_workspace(_gemm_stream(entry[1])):
            return ("the cuBLASLt workspace of the communicator's second GEMM stream (gemm_streams 2) is made on "
                    "the first call that uses it, which a CUDA graph capture cannot contain: run the op once "
                    "before capturing")
    return None


def _gemm_stream(comm) -> _extension.StreamRef:
    return comm.device, comm.gemm_stream


def _side(comm) -> Optional[_extension.StreamRef]:
    """The second stream the call's GEMMs alternate with, where
    :func:`tp_kernels.settings.gemm_streams` asks for two; else None."""
    return _gemm_stream(comm) if settings.gemm_streams() == 2 else None


def communicator(group, device: torch.device):
    """The group's communicator on ``device``, made on first use (a collective call), in NCCL's
    blocking mode where :func:`blocking_mode` says so then."""
    key = _key(group, device)
    entry = _communicators.get(key)
    C = _extension.require()
    if entry is None:
        p, r = coll.group_size(group), coll.group_rank(group)
        with torch.cuda.device(device):
            # Rank 0's id reaches the others through a bounded all-gather over the group's host
            # route (its gloo twin where it has one: no wait for the GPU).
            uid = C.nccl_unique_id() if r == 0 else bytes(C.NCCL_UNIQUE_ID_BYTES)
            uid = coll.all_gather_bytes(uid, *coll.host_route(group, device))[0]
            comm = C.Communicator(uid, r, p, device.index, settings.get_comm_stream_priority(), settings.get_timeout(),
                                  key[-1])
        entry = _communicators[key] = (group, comm)
    comm = entry[1]
    timeout = settings.get_timeout()
    if comm.timeout_s != timeout:
        comm.timeout_s = timeout
    return comm


@parallel_state.on_group_destroyed
def destroy_communicators(group=None) -> None:
    """Close the communicators of ``group`` (of every group when None); errors are not raised."""
    for key in [k for k, (g, _) in _communicators.items() if group is None or g is group]:
        _, comm = _communicators.pop(key)
        try:
            comm.close()
        except RuntimeError:
            pass  # ended by an error: the communicator was already aborted


def all_gather_matmul(x, weight, bias, group, impl):
    C = _extension.require()
    p = coll.group_size(group)
    if p == 1:
        return _extension.linear(x, weight, bias), x
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    mp, k = x.shape
    gathered = x.new_empty((p * mp, k))
    out = x.new_empty((p * mp, weight.shape[0]))
    order = ring(coll.group_rank(group), p)
    comm = communicator(group, x.device)
    _extension.call(C.all_gather_matmul, comm, x=x, weight=_extension.gemm_weight(weight), bias=bias, out=out,
                    gathered=gathered, bounds=boundaries(mp, impl.num_chunks), ring=order.sources,
                    ring_next=order.next, ring_prev=order.prev, stream=_extension.current_stream(x.get_device()),
                    side=_side(comm))
    return out, gathered


def _reduction(op: str, what: str, scatter: bool, x, weight, bias, group, impl) -> Pending:
    """GEMM + reduce-scatter (``scatter``) or all-reduce; the bias is added after the reduction."""
    C = _extension.require()
    p = coll.group_size(group)
    if p == 1:
        return Pending(_extension.linear(x, weight, bias), what=what)
    x = x.contiguous()
    m, n = x.shape[0], weight.shape[0]
    rows = m // p if scatter else m  # the rows chunked, and the output's
    out = x.new_empty((rows, n))
    scratch = {"partial": x.new_empty((m, n))} if scatter else {}  # destination-major chunks of x Wᵀ
    comm = communicator(group, x.device)
    _extension.call(getattr(C, op), comm, x=x, weight=_extension.gemm_weight(weight), out=out,
                    bounds=boundaries(rows, impl.num_chunks), stream=_extension.current_stream(x.get_device()),
                    side=_side(comm), **scratch)
    return Pending(out, what=what, group=group, finish=bias_epilogue(bias))


def matmul_reduce_scatter(x, weight, bias, group, impl) -> Pending:
    return _reduction("matmul_reduce_scatter", "matmul+reduce-scatter", True, x, weight, bias, group, impl)


def matmul_all_reduce(x, weight, bias, group, impl) -> Pending:
    return _reduction("matmul_all_reduce", "matmul+all-reduce", False, x, weight, bias, group, impl)


# --- the plain collectives: (x, out, peer, group, impl), as backends.run_collective passes them ---


def _as_bytes(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A contiguous tensor's elements as a flat uint8 view (what the collectives that only move
    data send, whatever the dtype); None stays None."""
    return None if t is None else t.reshape(-1).view(torch.uint8)


def _nccl(collective: str):
    moves_bytes = collective not in REDUCTIONS

    def run(x, out, peer, group, impl):
        t = x if x is not None else out
        C = _extension.require()
        _extension.call(C.nccl_collective, communicator(group, t.device), collective,
                        x=_as_bytes(x) if moves_bytes else x, out=_as_bytes(out) if moves_bytes else out, peer=peer,
                        stream=_extension.current_stream(t.get_device()), gemm=False)
        return out

    run.__name__ = run.__qualname__ = collective
    run.__doc__ = f"``{collective}`` on the group's NCCL communicator (see _op_table.COLLECTIVES)."
    return run


all_reduce = _nccl("all_reduce")
all_gather = _nccl("all_gather")
reduce_scatter = _nccl("reduce_scatter")
broadcast = _nccl("broadcast")
gather = _nccl("gather")
send = _nccl("send")
recv = _nccl("recv")
