"""The measured choice behind ``backend="auto"``.

``"auto"`` chooses among its *candidates*: the implementations allowed to run a call and able
to (:func:`tp_kernels.dispatch.candidates`). By default they are the reference and the fast
paths that are switched on for ``"auto"`` (``TP_KERNELS_AUTO_FUSED``, ``TP_KERNELS_AUTO_NATIVE``);
:func:`set_auto_candidates` (or ``TP_KERNELS_AUTO_CANDIDATES=reference,pipelined,fused``) names
them instead. A named one that cannot run the call (host tensors for ``fused``, ...) is left out,
and the reference runs when none is left. With one rank there is nothing to overlap: the
reference runs.

With one candidate there is nothing to choose. With several, the first call of each *shape
class* measures them all (:func:`choose`) and the fastest runs this call and every later one of
the class:

* the class is (op, group, device, dtype, m rounded up to a power of two, the primitive's n and
  k, bias or not, the candidates);
* each candidate runs the op's primitive on the call's own tensors (for
  ``linear_with_grad_all_reduce``, the all-reduce of its backward on tensors of that shape),
  without autograd: :data:`WARMUP` untimed runs (which also make communicators and workspaces),
  then :data:`REPEATS` timed ones, each after a barrier, timed by CUDA events on the current
  stream (host clock for host tensors, whose calls complete before they return), the slowest
  rank's time per sample, the median over samples, the candidates' runs taken in turns, the order
  rotated each round (:meth:`tp_kernels._timing.Timer.in_turns`: a GPU's clock rising from idle
  under the first candidate does not decide against it);
* the fused ``matmul_all_reduce`` is measured once per all-reduce algorithm (each its own
  implementation name, ``"fused:two_shot"``), and the fastest one is remembered for its size
  class (:func:`measured_algorithm`, which ``backend="fused"`` then runs too) unless
  ``TP_KERNELS_FUSED_ALL_REDUCE`` forces one.

Every rank gets the same figures, so all ranks choose alike. Before measuring, the ranks
exchange what they are about to measure (the call and the candidates); ranks that disagree get
a ``RuntimeError`` naming every rank's view instead of mismatched collectives.

The plain collectives of :class:`tp_kernels.Communicator` are measured the same way
(:func:`choose_collective`): per size class (collective, group, dtype, the element count rounded
up to a power of two, the root), each variant run on the call's input into a scratch output.

The forward decides: the backward of a call runs on the implementation its forward chose (the
all-gather's and reduce-scatter's backward primitive in its own chunks: ``backends.backward_name``).
Nothing is measured while ``torch.compile`` traces, a CUDA graph is captured or a ``torch.func``
transform runs: the class's decision is used if there is one, else the first candidate in the
order fused, pipelined, reference, and nothing is remembered. ``TP_KERNELS_AUTOTUNE=0``
(:func:`set_autotune`) always takes that first candidate. :func:`decisions` lists what was
measured and chosen; :func:`forget` drops it (``destroy_model_parallel`` does so for its groups).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _collectives as coll
from . import backends, parallel_state
from ._agreement import exchange_views
from ._checks import functorch_transforms
from ._op_table import OPS, POINT_TO_POINT, collective_output_shape, communicated_problem
from ._timing import Timer
from .settings import AUTO_CHOICES as CHOICES
from .settings import autotune_enabled, get_auto_candidates, set_auto_candidates, set_autotune

__all__ = [
    "CHOICES",
    "REPEATS",
    "WARMUP",
    "Decision",
    "autotune_enabled",
    "choose",
    "choose_collective",
    "decisions",
    "forget",
    "generation",
    "get_auto_candidates",
    "measured_algorithm",
    "set_auto_candidates",
    "set_autotune",
    "size_class",
    "unmeasurable_reason",
]

logger = logging.getLogger(__name__)

WARMUP = 2
REPEATS = 5
_HEADER_BYTES = 1024


def size_class(m: int) -> int:
    """The power of two at or above ``m``: calls whose row counts share it share measurements."""
    return 1 << max(m - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Decision:
    """One shape class's measurement: ``times_s[i]`` is the median seconds of ``variants[i]``
    (implementation names), the slowest rank's; ``choice`` (one of them) runs."""

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

    @property
    def algorithm(self) -> Optional[str]:
        """The fused all-reduce algorithm chosen, if the choice is one."""
        return backends.parse(self.choice).algorithm


#: class key -> (group, Decision); the group is kept so that its id is not reused meanwhile.
_decisions: Dict[tuple, Tuple[object, Decision]] = {}
#: (size class of m, n, p, dtype) -> the fused all-reduce algorithm measured fastest there
_algorithms: Dict[tuple, str] = {}
#: bumped whenever a decision is made or dropped (:func:`generation`)
_generation = 0


def generation() -> int:
    """A number that changes whenever a decision is made or dropped: what a choice made from
    these decisions (:func:`choose`, :func:`measured_algorithm`) stays true for."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


def decisions() -> List[Decision]:
    """Every decision measured so far in this process, oldest first."""
    return [d for _, d in _decisions.values()]


def _algorithm_key(m: int, n: int, p: int, dtype: torch.dtype) -> tuple:
    return size_class(m), n, p, dtype


def measured_algorithm(m: int, n: int, p: int, dtype: torch.dtype) -> Optional[str]:
    """The fused all-reduce algorithm measured fastest for an ``[m, n]`` all-reduce on p ranks
    (any ``m`` of the size class), or None when none was."""
    return _algorithms.get(_algorithm_key(m, n, p, dtype))


@parallel_state.on_group_destroyed
def forget(group=None) -> None:
    """Drop the decisions (and the fused all-reduce algorithms they chose) of ``group``, or all
    of them when ``group`` is None."""
    for key, (g, d) in list(_decisions.items()):
        if group is None or g is group:
            del _decisions[key]
            if d.algorithm is not None:
                _algorithms.pop(_algorithm_key(d.m_class, d.n, d.p, d.dtype), None)
    if group is None:
        _algorithms.clear()
    _changed()


def _operands(op: str, x: torch.Tensor, weight: torch.Tensor, bias):
    """The communicating primitive behind ``op``, the bias to measure it with, and a function that
    makes its input and weight to measure it on (called only to measure: the backward's input is
    a new tensor)."""
    if op == "linear_with_grad_all_reduce":  # its backward: dx = AR(dy W), dy (m, n/p), W as (k, n/p)
        return OPS[op].primitive, None, lambda: (x.new_ones((x.shape[0], weight.shape[0])), weight.t())
    return op, bias, lambda: (x, weight)


def _run_variant(primitive: str, name: str, x, weight, bias, group):
    out = backends.run(primitive, name, x, weight, bias, group)
    return out[0] if primitive == "all_gather_matmul" else out.wait()


def _agree(view: str, group, device: torch.device) -> None:
    """Raise on every rank unless all ranks of ``group`` are about to measure the same thing."""
    views = exchange_views(view, group, device, _HEADER_BYTES)
    if len(set(views)) > 1:
        listing = "; ".join(f"rank {q}: {v}" for q, v in enumerate(views))
        raise RuntimeError(f"backend='auto': the ranks of group {group.group_name!r} disagree on the call to "
                           f"measure, so they could not choose alike ({listing}). Every rank of a group must "
                           f"make the same calls, with the same candidates (TP_KERNELS_AUTO_CANDIDATES)")


def unmeasurable_reason(x: torch.Tensor) -> Optional[str]:
    """Why nothing can be measured for a call of input ``x`` now (then :func:`choose` takes a
    class's decision if there is one, else the first variant, and remembers nothing), or None."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    if functorch_transforms():  # (x a transform's wrapper, of no storage the native paths could read)
        return "a torch.func transform is active"
    return None


def _variant_set(variants: Sequence[str]) -> Tuple[str, ...]:
    """The variants as a class's key holds them: sorted, as their order is only which runs
    unmeasured, and it changes once the class is measured (the fused all-reduce's first variant
    is the algorithm measured fastest for the size class)."""
    return tuple(sorted(variants))


def choose(op: str, variants: Sequence[str], x: torch.Tensor, weight: torch.Tensor, bias, group) -> str:
    """The implementation among ``variants`` (implementation names, in the order of preference)
    that runs this call of ``op``: measured on the first call of its shape class (see the module
    doc), else the first."""
    if len(variants) == 1 or not autotune_enabled():
        return variants[0]
    primitive, b, make = _operands(op, x, weight, bias)
    m, n, k = communicated_problem(op, x.shape[0], weight.shape)
    key = (op, coll.group_key(group, x.device), x.dtype, size_class(m), n, k, b is not None, _variant_set(variants))
    operands: list = []

    def run(variant: str):
        if not operands:  # made on the first run, when measuring
            operands.extend(make())
        return _run_variant(primitive, variant, *operands, b, group)

    return _measured(key, op, variants, x, group, m, n, k, b is not None, run)


def choose_collective(collective: str, variants: Sequence[str], x: torch.Tensor, group, peer: int = -1) -> str:
    """:func:`choose` for a plain collective of :class:`tp_kernels.Communicator`: measured on the
    first call of its size class (its element count rounded up to a power of two: the decision's
    ``m_class``; ``n`` and ``k`` are 0), on scratch copies of the call's tensors. Point-to-point
    ``send`` and ``recv`` are not measured (one side alone cannot time them): they run the first."""
    if len(variants) == 1 or not autotune_enabled() or collective in POINT_TO_POINT:
        return variants[0]
    numel, p = x.numel(), coll.group_size(group)
    key = (collective, coll.group_key(group, x.device), x.dtype, size_class(numel), peer, _variant_set(variants))
    scratch: dict = {}

    def run(variant: str):
        if not scratch:  # made when measuring, once: x is only read (broadcast writes out)
            receives = collective != "gather" or coll.group_rank(group) == peer
            shape = collective_output_shape(collective, x.shape, p, receives)
            scratch["out"] = None if shape is None else x.new_empty(shape)
        return backends.run_collective(collective, variant, x, scratch["out"], peer, group)

    return _measured(key, collective, variants, x, group, numel, 0, 0, False, run,
                     also=f" peer={peer}" if peer >= 0 else "")


def _measured(key: tuple, op: str, variants: Sequence[str], x: torch.Tensor, group, m: int, n: int, k: int,
              bias: bool, run, also: str = "") -> str:
    """The decision of class ``key``: known, or measured now by timing ``run(variant)`` for each
    variant (see the module doc); the first variant where nothing can be measured. ``also``: more
    of the call, for the ranks to agree on."""
    hit = _decisions.get(key)
    if hit is not None:
        return hit[1].choice
    why_not = unmeasurable_reason(x)
    if why_not is not None:
        if not torch.compiler.is_compiling():  # a logger call would break torch.compile's graph
            logger.debug("auto backend for %s: %s and the shape class was never measured: %s", op, why_not,
                         variants[0])
        return variants[0]
    p = coll.group_size(group)
    _agree(f"{op} m={m} n={n} k={k} {x.dtype} bias={bias} p={p}{also} candidates={','.join(variants)}",
           group, x.device)
    with torch.no_grad(), (torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()):
        timer = Timer(REPEATS, WARMUP, x.is_cuda, group, what=f"auto's measurement of {op} m={m} n={n} k={k}")
        times = tuple(timer.in_turns([lambda i, v=v: run(v) for v in variants]))
    best = min(range(len(variants)), key=times.__getitem__)
    decision = Decision(op, group.group_name, str(x.device), x.dtype, p, size_class(m), n, k, bias,
                        tuple(variants), times, variants[best])
    if decision.algorithm is not None:
        _algorithms[_algorithm_key(m, n, p, x.dtype)] = decision.algorithm
    _decisions[key] = (group, decision)
    _changed()
    logger.debug("auto backend for %s (m class %d, n %d, k %d, %s, p=%d): measured %s; chose %s", op,
                 decision.m_class, n, k, x.dtype, p,
                 ", ".join(f"{v} {t * 1e3:.3f} ms" for v, t in zip(variants, times)), decision.choice)
    return decision.choice
