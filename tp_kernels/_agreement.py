"""Ranks that disagree: a call agrees across its group on what it does, or fails on every rank.

Every public call that communicates (the ops and layers, the embedding, the cross-entropy, the
mappings) first checks its own arguments, then exchanges a *fingerprint* with its group: a
fixed-size description of what it is about to do (the call, the shapes and dtypes of its
tensors, the backend and the settings that decide its path, the chunking, whether gradients will
flow, a layer's configuration), or the error this rank's check raised. Only when every rank
describes the same call does any payload move. Otherwise every
rank raises, before any other collective: the rank whose arguments were wrong its own
``ValueError``, the others a ``RuntimeError`` naming that rank and its message; or, when the
ranks disagree, every rank the same ``RuntimeError`` listing each rank's view. So a mismatch is
never an abort, a hang or a silently wrong result, and a rank that moves on to its next call
never meets a half-finished one. A point-to-point call (``Communicator.send``/``recv``) agrees
with its peer alone (:func:`agree_pair`).

The exchange is one all-gather of a :data:`DIGEST_BYTES` digest of the fingerprint per rank;
only when the digests differ, a second one of the fingerprints themselves (:data:`PAYLOAD_BYTES`,
to say what differs). Both are bounded like every collective (:func:`tp_kernels.get_timeout`),
and run on the host: over the group, or for an NCCL group over its gloo twin
(:func:`tp_kernels.parallel_state.host_group`: the tensor-parallel groups of
``initialize_model_parallel``, when fingerprints are on by then, and the default group have one),
so they never wait for the GPU.
Another NCCL group exchanges on the GPU, and reading the result back waits for its stream.
That is one more round trip per call, whose cost
``python -m tp_kernels.bench.fingerprints`` measures. It is off by default
(``TP_KERNELS_FINGERPRINTS=1`` or :func:`tp_kernels.settings.set_fingerprints` turn it on), and
skipped while torch.compile traces a call or a CUDA graph captures it. What runs whatever the
setting: a destroyed group is named, and ``initialize_model_parallel`` agrees
on the layout, bounded (:mod:`tp_kernels.parallel_state`).
"""

from __future__ import annotations

import hashlib
from typing import Callable, List, Optional, TypeVar

import torch

from . import _collectives as coll
from . import settings

__all__ = ["DIGEST_BYTES", "PAYLOAD_BYTES", "agree", "agree_pair", "describe", "exchange_views"]

#: Bytes of one rank's fingerprint: a description, or an error message, cut to fit.
PAYLOAD_BYTES = 1024
#: Bytes of the digest exchanged first.
DIGEST_BYTES = 16

T = TypeVar("T")

_OK, _ERROR = "ok", "error"


def describe(t) -> str:
    """A tensor argument as a fingerprint sees it: shape, dtype, device type and whether it wants
    a gradient (not its data, nor its device index: those may differ between ranks)."""
    if t is None:
        return "None"
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    grad = " grad" if t.requires_grad and torch.is_grad_enabled() else ""
    return f"{list(t.shape)} {str(t.dtype).rpartition('.')[2]} {t.device.type}{grad}"


def _payload(view: str, size: int = PAYLOAD_BYTES) -> bytes:
    """``view`` as the bytes that travel: UTF-8, cut to ``size`` bytes, padded with zeros to it."""
    return view.encode()[:size].ljust(size, b"\0")


def _view(payload: bytes) -> str:
    """The view a :func:`_payload` carries."""
    return payload.rstrip(b"\0").decode(errors="replace")


def exchange_views(view: str, group, device: torch.device, size: int = PAYLOAD_BYTES) -> List[str]:
    """Every rank's ``view`` (UTF-8, cut to ``size`` bytes), in group rank order: one bounded
    all-gather."""
    return [_view(v) for v in coll.all_gather_bytes(_payload(view, size), group, device)]


def _views_if_they_differ(mine: str, group, device: torch.device) -> Optional[List[str]]:
    """None when every rank's ``mine`` is the same (one all-gather of digests of the whole of
    each), else every rank's (each cut to :data:`PAYLOAD_BYTES`: they may then read alike)."""
    digest = hashlib.blake2b(mine.encode(), digest_size=DIGEST_BYTES).digest()
    if len(set(coll.all_gather_bytes(digest, group, device))) == 1:
        return None
    return exchange_views(mine, group, device)


def _recording() -> bool:
    """Whether the call is being recorded rather than run: torch.compile tracing it or a CUDA
    graph capturing it. The exchange (a collective read back on the host) cannot be recorded;
    the recorded call replays what ran eagerly before."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def agree(call: str, group, check: Callable[[], T], fingerprint: Callable[[T], str], hint=None, *,
          always: bool = False) -> T:
    """``check()`` (this rank's argument checks, raising ``ValueError``), agreed with the group.

    When fingerprints are on (or ``always``: a setup call whose disagreement nothing later would
    catch) and the group has several ranks, every rank exchanges
    ``call + fingerprint(check())``, or its error, and all raise together unless they are all the
    same (see the module doc). Returns ``check()``'s result. ``hint``: a tensor of the call, to
    find this rank's device on an NCCL group.
    """
    coll.check_alive(group)
    p = coll.group_size(group)
    # A malformed TP_KERNELS_TIMEOUT_S fails here, before any collective (one rank has none).
    timeout = settings.get_timeout() if p > 1 else None
    error: Optional[ValueError] = None
    try:
        result = check()
    except ValueError as exc:
        error = exc
    if p > 1 and (always or settings.fingerprints_enabled()) and not _recording():
        mine = f"{_ERROR}|{error}" if error is not None else f"{_OK}|{call}: {fingerprint(result)}"
        views = _views_if_they_differ(mine, *coll.host_route(group, hint))
        differ, views = views is not None, views or [mine]  # [mine]: all alike
        failed = [(q, v.partition("|")[2]) for q, v in enumerate(views) if v.partition("|")[0] != _OK]
        if error is None and failed:
            listing = "; ".join(f"rank {q}: {message}" for q, message in failed)
            raise RuntimeError(f"tp_kernels: {call}: {'a rank' if len(failed) == 1 else 'ranks'} of group "
                               f"{group.group_name!r} rejected its arguments, so no rank ran the call ({listing})")
        if error is None and differ:
            listing = "; ".join(f"rank {q}: {v.partition('|')[2]}" for q, v in enumerate(views))
            past = "" if len(set(views)) > 1 else f"; they differ past the first {PAYLOAD_BYTES} bytes shown"
            raise RuntimeError(
                f"tp_kernels: the ranks of group {group.group_name!r} disagree on this call, so none of it ran "
                f"({listing}{past}). Every rank of a group must make the same calls, with tensors of the same "
                f"shapes and dtypes (only their data may differ), within {timeout:g} s of each other")
    if error is not None:
        raise error
    return result


def agree_pair(call: str, group, peer: int, role: str, check: Callable[[], T], message: Callable[[T], str],
               hint=None) -> T:
    """``check()`` agreed with group rank ``peer``, the other end of a point-to-point call.

    ``role`` is ``"send"`` or ``"recv"``, ``message(check())`` the message as this end sees it
    (shape and dtype, and the path it takes). When fingerprints are on, the two ends swap their
    views (one bounded exchange, :func:`tp_kernels._collectives.swap_bytes`) and both raise, before
    the payload moves, unless one sends and the other receives the same message: a receiver
    expecting fewer bytes than were sent would be killed by gloo, one expecting more would read
    memory never written, one expecting another dtype would reinterpret the bytes. An end whose
    check failed raises its own ``ValueError``, and the other a ``RuntimeError`` carrying it.
    ``peer`` was checked by the caller; ``hint`` as for :func:`agree`."""
    coll.check_alive(group)
    error: Optional[ValueError] = None
    try:
        result = check()
    except ValueError as exc:
        error = exc
    if settings.fingerprints_enabled() and not _recording():
        me = coll.group_rank(group)
        mine = f"{_ERROR}|{error}" if error is not None else f"{_OK}|{role} {message(result)}"
        host, device = coll.host_route(group, hint)
        theirs = _view(coll.swap_bytes(_payload(mine), peer, host, device))
        status, _, view = theirs.partition("|")
        if error is None and status != _OK:
            raise RuntimeError(f"tp_kernels: {call}: rank {peer}, its peer, rejected its arguments, so nothing "
                               f"moved ({view})")
        if error is None and (view.partition(" ")[0] == role or view.partition(" ")[2] != message(result)):
            ends = sorted([(me, f"{role} {message(result)}"), (peer, view)])
            raise RuntimeError(
                f"tp_kernels: ranks {ends[0][0]} and {ends[1][0]} of group {group.group_name!r} disagree on a "
                f"message, so nothing moved (rank {ends[0][0]}: {ends[0][1]}; rank {ends[1][0]}: {ends[1][1]}). "
                "A send and the recv that takes it must agree on its shape and dtype, and on the backend that moves it")
    if error is not None:
        raise error
    return result
