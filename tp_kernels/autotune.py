"""The measured choice behind ``backend="auto"``.

``"auto"`` chooses among its *candidates*: the implementations allowed to run a call and able
to. By default they are the reference and the fast paths that are switched on for ``"auto"``
(``TP_KERNELS_AUTO_FUSED``, ``TP_KERNELS_AUTO_NATIVE``); :func:`set_auto_candidates` (or
``TP_KERNELS_AUTO_CANDIDATES=reference,pipelined,fused``) names them instead. A named one that
cannot run the call (host tensors for ``fused``, ...) is left out, and the reference runs when
none is left. With one rank there is nothing to overlap: the reference runs.

With one candidate there is nothing to choose. With several, the first call of each *shape
class* measures them all and the fastest runs this call and every later one of the class:

* the class is (op, group, device, dtype, m rounded up to a power of two, the primitive's n and
  k, bias or not, the candidates);
* each candidate runs the op's primitive on the call's own tensors (for
  ``linear_with_grad_all_reduce``, the all-reduce of its backward on tensors of that shape),
  without autograd: :data:`WARMUP` untimed runs (which also make communicators and workspaces),
  then :data:`REPEATS` timed ones, each after a barrier, timed by CUDA events on the current
  stream (host clock for host tensors, whose calls complete before they return), the slowest
  rank's time per sample, the median over samples (:class:`tp_kernels._timing.Timer`);
* the fused ``matmul_all_reduce`` is measured once per all-reduce algorithm, and the fastest
  one is remembered for its size class (:func:`tp_kernels.backends.fused.all_reduce_algorithm`)
  unless ``TP_KERNELS_FUSED_ALL_REDUCE`` forces one.

Every rank gets the same figures, so all ranks choose alike. Before measuring, the ranks
exchange what they are about to measure (the call and the candidates); ranks that disagree get
a ``RuntimeError`` naming every rank's view instead of mismatched collectives.

The forward decides: the backward of a call runs on the backend its forward chose. Nothing is
measured while ``torch.compile`` traces or a CUDA graph is captured: the class's decision is
used if there is one, else the first candidate in the order fused, pipelined, reference, and
nothing is remembered. ``TP_KERNELS_AUTOTUNE=0`` (:func:`set_autotune`) always takes that
first candidate. :func:`decisions` lists what was measured and chosen; :func:`forget` drops it
(``destroy_model_parallel`` does so for its groups).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _comm, _native
from ._timing import Timer
from .backends import IMPLEMENTATIONS, fused, native

__all__ = [
    "CHOICES",
    "REPEATS",
    "WARMUP",
    "Decision",
    "autotune_enabled",
    "candidates",
    "choose",
    "decisions",
    "forget",
    "get_auto_candidates",
    "set_auto_candidates",
    "set_autotune",
]

logger = logging.getLogger(__name__)

#: The backends ``"auto"`` may be allowed to choose, in the order of its choice without measuring.
CHOICES = ("fused", "pipelined", "reference")
WARMUP = 2
REPEATS = 5
_HEADER_BYTES = 1024

_candidates_setting: Optional[Tuple[str, ...]] = None
_autotune_setting: Optional[bool] = None


def _parse_candidates(names, what: str) -> Tuple[str, ...]:
    names = tuple(names)
    bad = [n for n in names if n not in CHOICES]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"{what}: expected distinct names among {CHOICES}, got {names!r}")
    return names


def set_auto_candidates(names: Optional[Sequence[str]]) -> None:
    """The backends ``"auto"`` chooses among (any of :data:`CHOICES`), measured when several
    can run a call; None returns to ``TP_KERNELS_AUTO_CANDIDATES`` or the default (see the
    module doc). Decisions already made are kept: :func:`forget` drops them."""
    global _candidates_setting
    _candidates_setting = None if names is None else _parse_candidates(names, "names")


def get_auto_candidates() -> Optional[Tuple[str, ...]]:
    """The backends named for ``"auto"``, or None for the default."""
    if _candidates_setting is not None:
        return _candidates_setting
    env = os.environ.get("TP_KERNELS_AUTO_CANDIDATES")
    if not env:
        return None
    return _parse_candidates((n.strip() for n in env.split(",")), "TP_KERNELS_AUTO_CANDIDATES")


def set_autotune(enabled: Optional[bool]) -> None:
    """Whether ``"auto"`` measures its candidates (default: ``TP_KERNELS_AUTOTUNE``, else yes);
    without measuring it takes the first of them in the order of :data:`CHOICES`."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool or None, got {enabled!r}")
    global _autotune_setting
    _autotune_setting = enabled


def autotune_enabled() -> bool:
    if _autotune_setting is not None:
        return _autotune_setting
    return _native.env_switch("TP_KERNELS_AUTOTUNE", True)


def candidates(x: torch.Tensor, weight: torch.Tensor, group, p: Optional[int] = None) -> Tuple[List[str], List[str]]:
    """The implementations (keys of ``backends.IMPLEMENTATIONS``) ``"auto"`` may run this call
    on, in the order of :data:`CHOICES`, and why the others were left out.

    ``"pipelined"`` is the native path where it is supported, else the portable schedule (the
    latter only when named: by default the portable schedule is no candidate, as it measured
    slower than the reference on the CPU, docs/benchmarks.md). Only what every rank shares
    goes into this, so all ranks get the same list. ``p`` defaults to the group's size.
    """
    if (_comm.group_size(group) if p is None else p) == 1:
        return ["reference"], ["one rank, nothing to overlap"]
    named = get_auto_candidates()
    allowed = named if named is not None else CHOICES
    out: List[str] = []
    why: List[str] = []
    native_reason = native.unsupported_reason(x, weight, group)
    if "fused" in allowed:
        if native_reason is not None:  # the fused path needs what the native one needs
            why.append(f"fused: {native_reason}")
        elif named is None and not fused.auto_enabled():
            why.append("fused: not switched on for 'auto' (TP_KERNELS_AUTO_FUSED=1 or set_auto_candidates)")
        else:
            reason = fused.unsupported_reason(x, weight, group)
            if reason is None:
                out.append("fused")
            else:
                why.append(f"fused: {reason}")
    if "pipelined" in allowed:
        if native_reason is None and (named is not None or native.auto_enabled()):
            out.append("native")
        elif named is not None:
            out.append("pipelined")
            why.append(f"pipelined: the portable schedule, not the native one: {native_reason}")
        else:
            why.append(f"pipelined: {native_reason or native.AUTO_DISABLED_REASON}")
    if "reference" in allowed or not out:
        out.append("reference")
    return out, why


@dataclasses.dataclass(frozen=True)
class Decision:
    """One shape class's measurement: ``times_s[i]`` is the median seconds of ``variants[i]``
    (an implementation, or ``"fused:<algorithm>"``), the slowest rank's; ``choice`` runs."""

    op: str
    group_name: str
    device: str
    dtype: torch.dtype
    p: int
    m_class: int
    n: int
    k: int
    bias: bool
    variants: Tuple[str, ...]
    times_s: Tuple[float, ...]
    choice: str
    algorithm: Optional[str]


#: class key -> (group, Decision); the group is kept so that its id is not reused meanwhile.
_decisions: Dict[tuple, Tuple[object, Decision]] = {}


def decisions() -> List[Decision]:
    """Every decision measured so far in this process, oldest first."""
    return [d for _, d in _decisions.values()]


def forget(group=None) -> None:
    """Drop the decisions (and the fused all-reduce algorithms they chose) of ``group``, or all
    of them when ``group`` is None."""
    for key, (g, d) in list(_decisions.items()):
        if group is None or g is group:
            del _decisions[key]
            if d.algorithm is not None:
                fused.measured_algorithms.pop(fused.measured_key(d.m_class, d.n, d.p, d.dtype), None)
    if group is None:
        fused.measured_algorithms.clear()


def _primitive(op: str, x: torch.Tensor, weight: torch.Tensor, bias):
    """The communicating primitive behind ``op`` and the operands to measure it on."""
    if op == "linear_with_grad_all_reduce":  # its backward: dx = AR(dy W), dy (m, n/p), W as (k, n/p)
        return "matmul_all_reduce", x.new_ones((x.shape[0], weight.shape[0])), weight.t(), None
    return op, x, weight, bias


def _variants(primitive: str, impls: Sequence[str], m: int, p: int) -> List[str]:
    out = []
    for impl in impls:
        if impl == "fused" and primitive == "matmul_all_reduce" and fused.forced_all_reduce_algorithm() is None:
            out += [f"fused:{a}" for a in fused.ALL_REDUCE_ALGORITHMS if a != "scatter_gather" or m >= p]
        else:
            out.append(impl)
    return out


def _run_variant(primitive: str, variant: str, x, weight, bias, group, num_chunks: int):
    impl, _, algorithm = variant.partition(":")
    if algorithm:
        return fused.matmul_all_reduce(x, weight, bias, group, num_chunks, algorithm=algorithm).wait()
    out = getattr(IMPLEMENTATIONS[impl], primitive)(x, weight, bias, group, num_chunks)
    return out[0] if primitive == "all_gather_matmul" else out.wait()


def _agree(view: str, group, device: torch.device) -> None:
    """Raise on every rank unless all ranks of ``group`` are about to measure the same thing."""
    payload = view.encode()[:_HEADER_BYTES].ljust(_HEADER_BYTES, b"\0")
    views = [v.rstrip(b"\0").decode(errors="replace") for v in _comm.all_gather_bytes(payload, group, device)]
    if len(set(views)) > 1:
        listing = "; ".join(f"rank {q}: {v}" for q, v in enumerate(views))
        raise RuntimeError(f"backend='auto': the ranks of group {group.group_name!r} disagree on the call to "
                           f"measure, so they could not choose alike ({listing}). Every rank of a group must "
                           f"make the same calls, with the same candidates (TP_KERNELS_AUTO_CANDIDATES)")


def _not_measurable(x: torch.Tensor) -> Optional[str]:
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    return None


def choose(op: str, impls: Sequence[str], x: torch.Tensor, weight: torch.Tensor, bias, group,
           num_chunks: int) -> str:
    """The implementation among ``impls`` (from :func:`candidates`) that runs this call of
    ``op``: measured on the first call of its shape class (see the module doc)."""
    if len(impls) == 1 or not autotune_enabled():
        return impls[0]
    primitive, a, w, b = _primitive(op, x, weight, bias)
    m, k, n = a.shape[0], a.shape[1], w.shape[0]
    m_class = fused.size_class(m)
    key = (op, _comm.group_key(group, x.device), x.dtype, m_class, n, k, b is not None, tuple(impls))
    hit = _decisions.get(key)
    if hit is not None:
        return hit[1].choice
    why_not = _not_measurable(x)
    if why_not is not None:
        logger.debug("auto backend for %s: %s and the shape class was never measured: %s", op, why_not, impls[0])
        return impls[0]
    p = _comm.group_size(group)
    variants = _variants(primitive, impls, m, p)
    _agree(f"{op} m={m} n={n} k={k} {x.dtype} bias={b is not None} p={p} candidates={','.join(variants)}",
           group, x.device)
    with torch.no_grad(), (torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()):
        timer = Timer(REPEATS, WARMUP, x.is_cuda, group)
        times = tuple(timer(lambda i, v=v: _run_variant(primitive, v, a, w, b, group, num_chunks))
                      for v in variants)
    best = min(range(len(variants)), key=times.__getitem__)
    choice, _, algorithm = variants[best].partition(":")
    if algorithm:
        fused.measured_algorithms[fused.measured_key(m, n, p, x.dtype)] = algorithm
    decision = Decision(op, group.group_name, str(x.device), x.dtype, p, m_class, n, k, b is not None,
                        tuple(variants), times, choice, algorithm or None)
    _decisions[key] = (group, decision)
    logger.debug("auto backend for %s (m class %d, n %d, k %d, %s, p=%d): measured %s; chose %s", op,
                 decision.m_class, n, k, x.dtype, p,
                 ", ".join(f"{v} {t * 1e3:.3f} ms" for v, t in zip(variants, times)), variants[best])
    return choice
