"""Which implementation runs a call: decided here, once, before it.

:func:`resolve` turns (op, tensors, group, requested backend, chunks) into an
implementation name (:mod:`tp_kernels.backends`: ``"reference"``, ``"pipelined:4"``,
``"native:4"``, ``"fused:1"``, ``"fused:two_shot"``) after every check: what each backend can run
here (their ``unsupported_reason``), what ``"auto"`` may choose (:func:`candidates`), its measured
choice (:func:`tp_kernels.autotune.choose`) and the fused all-reduce algorithm. The custom ops
carry that name down; the backward of a call runs on the implementation its forward chose (the
all-gather's and reduce-scatter's backward primitive in its own chunks:
:func:`tp_kernels.backends.backward_name`), and nothing below decides or checks again.
:func:`resolve`'s first step, :func:`check_runnable` (a named ``"fused"`` that cannot run the call
raises), is all that a call asks that runs the linear layer itself (one rank; a forward without
communication or backward).

:func:`resolve_collective` is the same decision for the plain collectives of
:class:`tp_kernels.Communicator` (``"reference"``, ``"native:1"``, ``"fused:one_shot"``), with
the candidates of ``"auto"`` found by the same rules (:func:`collective_candidates`).

The logger ``tp_kernels.dispatch`` says at debug level why a fast path was left out (not while
torch.compile traces: a logger call would break its graph).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Tuple

import torch

from . import _collectives as coll
from . import autotune, settings
from ._checks import check_choice
from ._op_table import OPS, communicated_problem
from .backends import fused, impl_name, parse, pipelined_native
from .schedule import DEFAULT_NUM_CHUNKS, resolve_num_chunks

__all__ = ["candidates", "capture_paths", "check_runnable", "collective_candidates", "collective_variants",
           "fused_all_reduce_algorithm", "resolve", "resolve_collective", "select_backend"]

logger = logging.getLogger(__name__)


def _debugging() -> bool:
    """Whether to say why at debug level: never while torch.compile traces (a logger call there
    would break the graph, and ``fullgraph=True`` fail)."""
    return not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG)


def candidates(x: torch.Tensor, weight: torch.Tensor, group, p: Optional[int] = None) -> Tuple[List[str], List[str]]:
    """The implementations (``"fused"``, ``"native"``, ``"pipelined"``, ``"reference"``) that
    ``"auto"`` may run this call on, in the order of :data:`tp_kernels.settings.AUTO_CHOICES`,
    and why the others were left out.

    ``"pipelined"`` is the native path where it is supported, else the portable schedule (the
    latter only when named: by default the portable schedule is no candidate, as it measured
    slower than the reference on the CPU, docs/benchmarks.md). Only what every rank shares
    goes into this, so all ranks get the same list. ``p`` defaults to the group's size.
    """
    why: List[str] = []
    p = coll.group_size(group) if p is None else p
    return _candidates(x, weight, group, p, why, settings.auto_state()), why


def _candidates(x: torch.Tensor, weight: torch.Tensor, group, p: int, why: Optional[List[str]],
                state: settings.AutoState) -> List[str]:
    """:func:`candidates` under the settings ``state``, the reasons appended to ``why`` (None: not
    asked for, not made)."""
    if p == 1:
        if why is not None:
            why.append("one rank, nothing to overlap")
        return ["reference"]
    return _allowed(pipelined_native.unsupported_reason, fused.unsupported_reason, (x, weight, group), True, why,
                    state)


def collective_candidates(collective: str, x: torch.Tensor, group) -> Tuple[List[str], List[str]]:
    """What ``"auto"`` may run collective ``collective`` (of ``_op_table.COLLECTIVES``) on, like
    :func:`candidates`: ``"fused"`` (the all-reduce only), ``"native"`` (NCCL), ``"reference"``
    (``torch.distributed``), and why the others were left out."""
    why: List[str] = []
    return _collective_candidates(collective, x, group, why, settings.auto_state()), why


def _collective_candidates(collective: str, x: torch.Tensor, group, why: Optional[List[str]],
                           state: settings.AutoState) -> List[str]:
    """:func:`collective_candidates` under the settings ``state``, the reasons appended to ``why``
    (None: not made)."""
    if coll.group_size(group) == 1:
        if why is not None:
            why.append("one rank, nothing to communicate")
        return ["reference"]
    return _allowed(pipelined_native.unsupported_collective_reason, fused.unsupported_collective_reason,
                    (collective, x, group), False, why, state)


def _allowed(native_reason: Callable[..., Optional[str]], fused_reason: Callable[..., Optional[str]], args: tuple,
             portable: bool, why: Optional[List[str]], state: settings.AutoState) -> List[str]:
    """The candidates of ``"auto"`` under the settings ``state`` given why the native and the
    fused paths cannot run a call (``native_reason(*args)``, ``fused_reason(*args)``: the fused
    one asked only when the fused path is allowed and the native one can run, as its first call
    of a group is collective), and whether a portable schedule stands in for the native one where
    that cannot run and ``"pipelined"`` is named; why the others were left out appended to
    ``why`` (None: the reasons are not made, as on a call's path unless it logs)."""
    named, allowed, fused_on, native_on = state.candidates, state.allowed, state.fused_on, state.native_on
    native = native_reason(*args)
    out: List[str] = []
    fused_out = pipelined_out = None  # why each was left out
    if "fused" in allowed:
        if not fused_on:  # the fused path needs what the native one needs: that reason first
            fused_out = native or settings.AUTO_FUSED_OFF
        elif native is not None:
            fused_out = native
        else:
            fused_out = fused_reason(*args)
            if fused_out is None:
                out.append("fused")
    if "pipelined" in allowed:
        if not native_on:
            pipelined_out = native or settings.AUTO_NATIVE_OFF
        elif native is None:
            out.append("native")
        elif named is not None and portable:
            out.append("pipelined")
            pipelined_out = "the portable schedule, not the native one: " + native
        else:
            pipelined_out = native
    if why is not None:
        why.extend(f"{name}: {reason}" for name, reason in (("fused", fused_out), ("pipelined", pipelined_out))
                   if reason is not None)
    if "reference" in allowed or not out:
        out.append("reference")
    return out


def fused_all_reduce_algorithm(op: str, x: torch.Tensor, weight: torch.Tensor, p: int,
                               measured: Optional[str] = None) -> str:
    """The fused all-reduce algorithm for this call of ``op`` (``matmul_all_reduce``, or the
    backward of ``linear_with_grad_all_reduce``): ``measured`` (``"auto"``'s choice for this
    call), else what ``"auto"`` measured for its size class, through
    :func:`tp_kernels.backends.fused.all_reduce_algorithm`."""
    m, n, _ = communicated_problem(op, x.shape[0], weight.shape)
    if measured is None:
        measured = autotune.measured_algorithm(m, n, p, x.dtype)
    return fused.all_reduce_algorithm(m, n, p, x.dtype, measured)


def _name(impl: str, op: str, x, weight, p: int, num_chunks: int, algorithm: Optional[str] = None) -> str:
    """The implementation name of ``impl`` for this call."""
    if impl == "reference":
        return impl
    if impl == "fused" and OPS[op].primitive == "matmul_all_reduce":
        return impl_name("fused", algorithm=fused_all_reduce_algorithm(op, x, weight, p, algorithm))
    return impl_name(impl, num_chunks)


#: The chunk counts ``"auto"`` measures of the native path of the ops whose GEMM it splits by rows
#: (the reduce-scatter's and the all-reduce's), where the call names none: the schedule's default
#: first (what runs unmeasured), then fewer. Each chunk is a GEMM of its own: on an H100 four
#: chunks of a Llama-3-70B TP8 GEMM ran up to 12 % slower than the whole one (docs/benchmarks.md),
#: as much as hiding the collective behind them wins, so the fastest count depends on the shape.
NATIVE_CHUNK_CHOICES = (4, 2, 1)


def _variants(impl: str, op: str, x, weight, p: int, num_chunks: int, chunks_named: bool = True) -> List[str]:
    """What ``"auto"`` measures of candidate ``impl``, the one it runs unmeasured first: for the
    fused all-reduce, each algorithm that can run the call (unless ``TP_KERNELS_FUSED_ALL_REDUCE``
    forces one), the one :func:`fused_all_reduce_algorithm` picks first; for the native path of an
    op split by rows, unless the call named its chunks, ``num_chunks`` and the other counts of
    :data:`NATIVE_CHUNK_CHOICES` that split its rows otherwise; else the one name."""
    first = _name(impl, op, x, weight, p, num_chunks)
    primitive = OPS[op].primitive
    if (impl == "fused" and primitive == "matmul_all_reduce"
            and settings.forced_all_reduce_algorithm(fused.algorithms()) is None):
        m = communicated_problem(op, x.shape[0], weight.shape)[0]
        others = [impl_name("fused", algorithm=a) for a in fused.algorithms() if a != "scatter_gather" or m >= p]
        return [first] + [v for v in others if v != first]
    if impl == "native" and not chunks_named and primitive != "all_gather_matmul":
        m = communicated_problem(op, x.shape[0], weight.shape)[0]
        rows = m // p if primitive == "matmul_reduce_scatter" else m  # (the rows each chunk splits)
        counts = {min(num_chunks, rows): num_chunks}
        for c in NATIVE_CHUNK_CHOICES:
            counts.setdefault(min(c, rows), c)  # (a count past the rows splits them as the rows' count does)
        return [first] + [impl_name("native", c) for c in counts.values() if c != num_chunks]
    return [first]


def select_backend(op: str, backend: str, x: torch.Tensor, p: int, group=None,
                   weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                   num_chunks: Optional[int] = None) -> str:
    """:func:`resolve`, its options checked first (``op``, ``backend``, ``num_chunks``)."""
    check_choice("op", op, tuple(OPS))
    check_choice("backend", backend, settings.BACKEND_NAMES)
    resolve_num_chunks(OPS[op].primitive, num_chunks)
    return resolve(op, backend, x, p, group, weight, bias, num_chunks)


def check_runnable(op: str, backend: str, x: torch.Tensor, p: int, group=None,
                   weight: Optional[torch.Tensor] = None) -> None:
    """The ``ValueError`` of a named backend that cannot run this call of ``op``: ``"fused"``,
    which has no portable form to fall back on, where :func:`fused.unsupported_reason` says why
    (a named ``"pipelined"`` falls back, the others run anywhere). Nothing else is decided: the
    first step of :func:`resolve`, and all that a call asks that runs the linear layer itself
    (with one rank, or a forward that communicates nothing and records no backward), where no
    path's name is needed. ``x`` of any dims."""
    if backend == "fused":
        # (one rank's group asks nothing of the fused path: None for it spares a call's host time its size)
        reason = fused.unsupported_reason(x, x if weight is None else weight, group if p > 1 else None)
        if reason is not None:
            raise ValueError(f"backend: 'fused' cannot run {op} (p={p}, x {tuple(x.shape)} {x.dtype} on "
                             f"{x.device}): {reason}. Use 'pipelined' or 'auto' there.")


def resolve(op: str, backend: str, x: torch.Tensor, p: int, group=None, weight: Optional[torch.Tensor] = None,
            bias: Optional[torch.Tensor] = None, num_chunks: Optional[int] = None) -> str:
    """The implementation name that runs ``op`` (a public op of :mod:`tp_kernels.ops`) for this
    call of ``p`` ranks, ``x`` 2-D: the one decision (see the module doc). The options were
    checked by the caller (:func:`select_backend`, the public ops, the layers).

    * ``"reference"`` runs the reference.
    * ``"pipelined"`` runs the native extension (``"native:<chunks>"``: cuBLASLt and NCCL, the
      same chunk schedule) for CUDA tensors it supports, else the portable schedule on
      ``torch.distributed`` (``"pipelined:<chunks>"``); the reason is logged at debug level.
    * ``"fused"`` runs over peer memory (:mod:`tp_kernels.backends.fused`) and raises a
      ``ValueError`` with the reason where it cannot (host tensors, a group across nodes or
      without peer access, no native extension): it has no portable form to fall back on.
    * ``"auto"`` chooses among the backends allowed for it that can run the call
      (:func:`candidates`; by default the reference, plus the fused and native paths where
      ``TP_KERNELS_AUTO_FUSED``/``TP_KERNELS_AUTO_NATIVE`` switch them on), measuring them on
      the first call of each shape class when there are several
      (:func:`tp_kernels.autotune.choose`). It says why at debug level. ``bias`` is the call's,
      for measuring.

    With one rank every backend runs the reference (``ops.run``: the linear layer itself; nothing
    to gather, scatter or overlap), once a named ``"fused"`` that cannot run the call has said so:
    nothing else of a path that does not run is asked for (its chunks, its all-reduce algorithm,
    whether the native module takes the tensors), which would only add host time to the call.

    ``num_chunks`` (None: the schedule's default for the op's primitive) goes into the name of
    the chunked implementations. Every input of the decision is the same on all ranks of the
    group, so they all decide alike (the first fused call of a group checks its peer access
    collectively; a measurement agrees the figures across the ranks).
    """
    if backend == "reference":
        return backend
    if backend == "fused":  # (the one backend check_runnable refuses: no call on auto's path)
        check_runnable(op, backend, x, p, group, weight)
    if p == 1 and (backend != "auto" or not _debugging()):  # (auto says why when asked: _candidates)
        return "reference"
    w = x if weight is None else weight
    chunks = DEFAULT_NUM_CHUNKS[OPS[op].primitive] if num_chunks is None else num_chunks
    if backend == "fused":
        return _name("fused", op, x, w, p, chunks)
    if backend == "pipelined":
        reason = pipelined_native.unsupported_reason(x, w, group)
        if reason is None:
            return _name("native", op, x, w, p, chunks)
        if x.is_cuda and _debugging():
            logger.debug("pipelined %s (p=%d, x %s %s): the portable schedule, not the native one: %s", op, p,
                         tuple(x.shape), x.dtype, reason)
        return _name("pipelined", op, x, w, p, chunks)
    debugging = _debugging()
    state = settings.auto_state()
    if not (state.fast_path_on or debugging):  # nothing but the reference to choose
        return "reference"
    key = None if debugging or _is_compiling() else (
        op, p, num_chunks, x.shape, x.dtype, x.device, w.shape, bias is not None, id(group), state)
    name = _recall(key)
    if name is not None:
        return name
    why: Optional[List[str]] = [] if debugging else None
    impls = _candidates(x, w, group, p, why, state)
    if why:
        logger.debug("auto backend for %s (p=%d, x %s %s on %s): candidates %s; left out: %s", op, p,
                     tuple(x.shape), x.dtype, x.device.type, impls, "; ".join(why))
    if len(impls) == 1:
        name = _name(impls[0], op, x, w, p, chunks)
    else:
        variants = [v for impl in impls for v in _variants(impl, op, x, w, p, chunks, num_chunks is not None)]
        choice = parse(autotune.choose(op, variants, x, w, bias, group))
        # the measured class's algorithm, valid for these rows
        name = choice.name if choice.algorithm is None else _name("fused", op, x, w, p, chunks, choice.algorithm)
    return _remember(key, group, x, name)


#: What ``"auto"`` resolved calls to, so that a call like an earlier one is not resolved again:
#: the call's key (what the decision depends on: the op or collective, the tensors' shapes, dtype
#: and device, the group, the settings of ``"auto"``) -> (the group, kept so that its id is not
#: reused meanwhile; the implementation name). Its entries hold while
#: :func:`tp_kernels.autotune.generation` is :data:`_resolved_generation` (a decision made or
#: dropped clears them); a choice made while nothing could be measured (torch.compile tracing, a
#: CUDA graph capture: the first candidate, unremembered) is not kept, nor any while the logger
#: says why (each call then says it). At most :data:`RESOLVED_MAX` entries: past that they are
#: dropped, to be resolved again.
_resolved: dict = {}
_resolved_generation = -1
RESOLVED_MAX = 4096
_is_compiling = torch.compiler.is_compiling


def _current_resolved() -> dict:
    """:data:`_resolved`, emptied if a decision was made or dropped since its entries were."""
    global _resolved_generation
    generation = autotune.generation()
    if generation != _resolved_generation:
        _resolved.clear()
        _resolved_generation = generation
    return _resolved


def _recall(key: Optional[tuple]) -> Optional[str]:
    """The name ``"auto"`` resolved the call of ``key`` to before, or None (also for no key)."""
    hit = None if key is None else _current_resolved().get(key)
    return None if hit is None else hit[1]


def _remember(key: Optional[tuple], group, x: torch.Tensor, name: str) -> str:
    """``name``, kept for the calls of ``key`` (None: not kept) where it holds for them."""
    if key is not None and autotune.unmeasurable_reason(x) is None:
        resolved = _current_resolved()
        if len(resolved) >= RESOLVED_MAX:
            resolved.clear()
        resolved[key] = (group, name)
    return name



def collective_variants(kind: str, collective: str, x: torch.Tensor, p: int) -> List[str]:
    """The implementation names of candidate ``kind`` for a collective, the one it runs unmeasured
    first: for the fused all-reduce each algorithm (one when ``TP_KERNELS_FUSED_ALL_REDUCE``
    forces it), :func:`fused.collective_algorithm`'s pick first."""
    if kind == "fused":
        first = fused.collective_algorithm(x.numel(), p, x.dtype, autotune.measured_algorithm(x.numel(), 0, p, x.dtype))
        forced = settings.forced_all_reduce_algorithm(fused.algorithms()) is not None
        rest = [] if forced else [a for a in fused.algorithms() if a != first]
        return [impl_name("fused", algorithm=a) for a in [first] + rest]
    return ["native:1" if kind == "native" else "reference"]


def resolve_collective(collective: str, backend: str, x: torch.Tensor, group, peer: int = -1) -> str:
    """The implementation name that runs ``collective`` (of ``_op_table.COLLECTIVES``) for this
    call on ``group``, ``x`` its input (for ``recv``, its output): the one decision for the plain
    collectives, as :func:`resolve` is for the ops. The options were checked by the caller.

    * With one rank, for an empty tensor, or for ``"reference"``: ``"reference"``
      (``torch.distributed``).
    * ``"pipelined"``: the group's NCCL communicator (``"native:1"``) where the native path can
      run the call, else the reference (there is no portable schedule of a lone collective).
    * ``"fused"``: the all-reduce over peer memory (``"fused:<algorithm>"``, the algorithm by
      :func:`fused.collective_algorithm`), the other collectives on the NCCL communicator; a
      ``ValueError`` with the reason where that cannot run.
    * ``"auto"``: among :func:`collective_candidates`, measured on the first call of each size
      class (:func:`tp_kernels.autotune.choose_collective`).
    """
    p = coll.group_size(group)
    if backend == "reference" or p == 1 or x.numel() == 0:
        return "reference"
    if backend == "pipelined":
        reason = pipelined_native.unsupported_collective_reason(collective, x, group)
        if reason is not None:
            if _debugging():
                logger.debug("pipelined %s (p=%d, x %s %s): torch.distributed: %s", collective, p, tuple(x.shape),
                             x.dtype, reason)
            return "reference"
        return "native:1"
    if backend == "fused":
        reason = pipelined_native.unsupported_collective_reason(collective, x, group)
        if reason is None and collective == "all_reduce":
            reason = fused.unsupported_collective_reason(collective, x, group)
        if reason is not None:
            raise ValueError(f"backend: 'fused' cannot run {collective} (p={p}, x {tuple(x.shape)} {x.dtype} on "
                             f"{x.device}): {reason}. Use 'pipelined' or 'auto' there.")
        return collective_variants("fused" if collective == "all_reduce" else "native", collective, x, p)[0]
    state, debugging = settings.auto_state(), _debugging()
    if not (state.fast_path_on or debugging):  # nothing but the reference to choose
        return "reference"
    key = None if debugging or _is_compiling() else (collective, x.numel(), x.dtype, x.device, peer, id(group), state)
    name = _recall(key)
    if name is not None:
        return name
    why: Optional[List[str]] = [] if debugging else None
    kinds = _collective_candidates(collective, x, group, why, state)
    if why:
        logger.debug("auto backend for %s (p=%d, x %s %s on %s): candidates %s; left out: %s", collective, p,
                      tuple(x.shape), x.dtype, x.device.type, kinds, "; ".join(why))
    if kinds == ["reference"]:  # nothing to choose among
        return _remember(key, group, x, "reference")
    variants = [v for kind in kinds for v in collective_variants(kind, collective, x, p)]
    return _remember(key, group, x, autotune.choose_collective(collective, variants, x, group, peer))


def capture_paths(backend: str, x: torch.Tensor, group) -> List[str]:
    """The paths among ``"native"`` and ``"fused"`` that :func:`resolve_collective` may run the
    plain collectives of ``backend`` on, for tensors like ``x``: what a CUDA graph capture needs
    made beforehand (:func:`tp_kernels.backends.prepare_capture`)."""
    if backend == "reference" or coll.group_size(group) == 1:
        return []
    if pipelined_native.unsupported_collective_reason("all_reduce", x, group) is not None:
        return []
    if backend == "auto":
        return [k for k in collective_candidates("all_reduce", x, group)[0] if k in ("fused", "native")]
    if backend == "fused":
        resolve_collective("all_reduce", backend, x, group)  # raises where the fused path cannot run
        return ["fused", "native"]
    return ["native"]
