"""The ``fused`` backend: overlap over peer memory, for a group inside one node.

The native ops (``csrc/fused.cpp``) take a ``_C.PeerContext``, this rank's table of the group's
symmetric workspace (:mod:`tp_kernels.backends.peer_memory`), and move data between ranks by
copy engine while cuBLASLt multiplies on all SMs:

* ``all_gather_matmul``: each rank publishes its shard; the peers' shards are pulled chunk by
  chunk (``num_chunks`` pieces per shard) while the chunks already there multiply.
* ``matmul_reduce_scatter``: the partial for each destination multiplies while the previous one
  is pushed into its destination's inbox; then the p partials are summed in rank order in fp32
  (deterministic). It goes by destination, so ``num_chunks`` does not apply.
* ``matmul_all_reduce``: one of :func:`algorithms` (``_C.ALL_REDUCE_ALGORITHMS``), decided
  before the call (:func:`all_reduce_algorithm`) and carried in the implementation name
  (``"fused:two_shot"``): ``one_shot`` and ``two_shot`` kernels over peer memory for small
  messages, ``scatter_gather`` (the reduce-scatter above, then a copy-engine all-gather) for large
  ones. Deterministic too; ``num_chunks`` does not apply.
* ``all_reduce`` (the plain collective of :class:`tp_kernels.Communicator`): the same three
  algorithms on the caller's tensor in place of a product (``_C.fused_all_reduce``), chosen by
  :func:`collective_algorithm`; every algorithm gives the same bits (each element is summed in
  rank order in fp32), so switching between them never changes a result.

Readiness is signalled by flags in the workspace (see ``csrc/include/tp_kernels/peer.h``);
every device-side wait is bounded by :func:`tp_kernels.get_timeout`. A ready flag carries a hash
of the setter's call, which the waiter compares with its own. A wait that times out, or finds
another call's hash, records the op and the peer, and the group's next fused call raises that
error; ranks that grow the workspace for different calls all raise before anything runs
(:mod:`tp_kernels.backends.peer_memory`).

The ``rank_*`` functions prepare one rank's part of an op on a PeerContext (a :class:`RankCall`,
enqueued in phases); they serve process groups here and virtual ranks
(:class:`tp_kernels.testing.VirtualRanks`: p ranks driven by one process on one GPU, how the
fused path is tested and measured on a single GPU) alike.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .. import _collectives as coll
from .. import _extension, settings
from .._collectives import Pending
from ..schedule import boundaries
from . import peer_memory
from .reference import bias_epilogue

__all__ = [
    "MAX_BYTES",
    "RankCall",
    "algorithms",
    "all_gather_matmul",
    "all_reduce",
    "all_reduce_algorithm",
    "check_algorithm",
    "collective_algorithm",
    "kernel_algorithms",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "rank_all_gather_matmul",
    "rank_all_reduce",
    "rank_matmul_all_reduce",
    "rank_matmul_reduce_scatter",
    "unsupported_collective_reason",
    "unsupported_reason",
]

#: The size thresholds of :func:`all_reduce_algorithm`: the largest all-reduced ``[m, n]`` (in
#: bytes) each algorithm is chosen for, in order; above them all, ``scatter_gather``.
#: Provisional: they follow the usual shape of such curves (one-shot wins while latency
#: dominates, scatter-gather once bandwidth does) and are to be replaced by the crossovers that
#: ``python -m tp_kernels.bench.fused`` measures on the GPU (docs/benchmarks.md). A size class
#: that ``backend="auto"`` measured uses its winner instead.
MAX_BYTES = {"one_shot": 256 * 1024, "two_shot": 8 * 2**20}


def algorithms() -> Sequence[str]:
    """The all-reduce algorithms of fused ``matmul_all_reduce`` (the native module's list)."""
    return _extension.require().ALL_REDUCE_ALGORITHMS


def kernel_algorithms() -> Sequence[str]:
    """The all-reduce algorithms that run the all-reduce kernel (``tpk_all_reduce_*``; scatter-gather
    runs copy engines): those its profile runs (``bench/all_reduce_kernel.py``)."""
    return tuple(a for a in algorithms() if a != "scatter_gather")


def all_reduce_algorithm(m: int, n: int, p: int, dtype: torch.dtype, measured: Optional[str] = None) -> str:
    """The all-reduce of fused ``matmul_all_reduce`` for an ``[m, n]`` output on p ranks.

    In order: ``TP_KERNELS_FUSED_ALL_REDUCE`` forces one; else ``measured`` (what
    ``backend="auto"`` measured fastest for this size class); else the size thresholds.
    ``scatter_gather`` needs ``m >= p`` and falls back to ``two_shot`` below that.
    """
    algo = collective_algorithm(m * n, p, dtype, measured)
    return "two_shot" if algo == "scatter_gather" and m < p else algo


def collective_algorithm(numel: int, p: int, dtype: torch.dtype, measured: Optional[str] = None) -> str:
    """The algorithm of a fused all-reduce of ``numel`` elements on p ranks: forced by
    ``TP_KERNELS_FUSED_ALL_REDUCE``, else ``measured``, else by size (:data:`MAX_BYTES`). (The
    all-reduce alone runs any of them for any size.)"""
    algo = settings.forced_all_reduce_algorithm(algorithms()) or measured
    if algo is None:
        nbytes = numel * dtype.itemsize
        algo = next((a for a, most in MAX_BYTES.items() if nbytes <= most), "scatter_gather")
    return algo


def check_algorithm(algorithm: str, m: int, p: int) -> str:
    """``algorithm`` if it can all-reduce ``m`` rows on p ranks, else a ``ValueError``."""
    if algorithm not in algorithms():
        raise ValueError(f"algorithm: expected one of {tuple(algorithms())}, got {algorithm!r}")
    if algorithm == "scatter_gather" and m < p:
        raise ValueError(f"algorithm: scatter_gather needs at least p = {p} rows, got {m}")
    return algorithm


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, group) -> Optional[str]:
    """Why the fused path cannot run this call, or None when it can.

    The first call of a group with several ranks checks, collectively, that the group is on one
    node with peer access; everything else depends only on what all ranks share.
    """
    return _extension.unsupported_tensors_reason(x, weight) or _group_reason(group, x)


def unsupported_collective_reason(collective: str, x: torch.Tensor, group) -> Optional[str]:
    """Why the fused path cannot run this collective, or None when it can: it has the all-reduce
    only, in the dtypes of ``_C.DTYPES``; the group as for :func:`unsupported_reason`."""
    if collective != "all_reduce":
        return f"the fused path has no {collective} (only the all-reduce)"
    return _extension.unsupported_collective_reason(True, x) or _group_reason(group, x)


def _group_reason(group, x: torch.Tensor) -> Optional[str]:
    """Why the fused path cannot run on ``group`` with tensors on ``x``'s device, or None."""
    if group is None:
        return None
    p = coll.group_size(group)
    if p == 1:
        return None
    C = _extension.require()
    if p > C.MAX_RANKS:
        return f"{p} ranks: the fused path supports at most {C.MAX_RANKS}"
    if not C.stream_memory_ops_available():
        return "the CUDA driver does not provide stream memory operations (cuStreamWriteValue32)"
    return peer_memory.topology_reason(group, x.device)


# --- one rank's part, on a PeerContext: shared by process groups and virtual ranks -----------------


class RankCall(NamedTuple):
    """One rank's part of a fused op, its buffers made and nothing enqueued yet.

    ``enqueue(phase)`` enqueues phase ``phase`` (``0 .. phases - 1``) or, with None, every phase in
    order. A phase's waits need only what peers signal in earlier phases (or earlier ops), so a
    process driving several ranks enqueues phase k of every rank before phase k + 1 of any
    (:class:`tp_kernels.testing.VirtualRanks`); a rank that is a process of its own enqueues them
    all at once. The ``rank_*`` functions below make one on a stream they are given, or, for None,
    on the current stream of the context's device (what a rank that is a process of its own uses,
    without a stream switch). The native side makes that device current for the call.
    """

    result: object
    phases: int
    enqueue: Callable[[Optional[int]], None]


def _on(stream):
    """Where a rank's buffers are allocated: under ``stream`` (the caching allocator ties a block
    to the stream it is made on), or, for None (the current stream), without switching streams
    (a switch and back costs a few µs of host time)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _rank_call(result, fn, ctx, phases: int, stream, gemm: bool = True, **args) -> RankCall:
    stream = _extension.current_stream(ctx.device) if stream is None else _extension.stream_ref(stream)

    def enqueue(phase: Optional[int] = None) -> None:
        _extension.call(fn, ctx, phase=_extension.require().ALL_PHASES if phase is None else phase, stream=stream,
                        gemm=gemm, **args)

    return RankCall(result, phases, enqueue)


def rank_all_gather_matmul(ctx, x, weight, bias, num_chunks: int, stream) -> RankCall:
    """This rank's ``(AG(x) Wᵀ + b, AG(x))``: x ``[m/p, k]`` contiguous, on ``stream``."""
    C = _extension.require()
    mp, k = x.shape
    with _on(stream):
        gathered = x.new_empty((ctx.size * mp, k))
        out = x.new_empty((ctx.size * mp, weight.shape[0]))
    return _rank_call((out, gathered), C.fused_all_gather_matmul, ctx, C.fused_phases("all_gather_matmul"), stream,
                      x=x, weight=_extension.gemm_weight(weight), bias=bias, out=out, gathered=gathered,
                      bounds=boundaries(mp, num_chunks))


def rank_matmul_reduce_scatter(ctx, x, weight, stream) -> RankCall:
    """This rank's block of ``RS(x Wᵀ)``: x ``[m, k]`` contiguous, on ``stream``."""
    C = _extension.require()
    m = x.shape[0]
    with _on(stream):
        out = x.new_empty((m // ctx.size, weight.shape[0]))
        partial = x.new_empty((m, weight.shape[0]))
    return _rank_call(out, C.fused_matmul_reduce_scatter, ctx, C.fused_phases("matmul_reduce_scatter"), stream,
                      x=x, weight=_extension.gemm_weight(weight), out=out, partial=partial)


def rank_matmul_all_reduce(ctx, x, weight, algorithm: str, stream) -> RankCall:
    """This rank's ``AR(x Wᵀ)`` by ``algorithm``: x ``[m, k]`` contiguous, on ``stream``."""
    C = _extension.require()
    m = x.shape[0]
    scatter_gather = algorithm == "scatter_gather"
    with _on(stream):
        out = x.new_empty((m, weight.shape[0]))
        partial = x.new_empty((m, weight.shape[0])) if scatter_gather else None
    return _rank_call(out, C.fused_matmul_all_reduce, ctx, C.fused_phases("matmul_all_reduce", algorithm), stream,
                      x=x, weight=_extension.gemm_weight(weight), out=out, partial=partial,
                      bounds=boundaries(m, ctx.size if scatter_gather else 1), algorithm=algorithm)


def rank_all_reduce(ctx, x, out, algorithm: str, stream) -> RankCall:
    """This rank's part of ``out = Σ_ranks x`` by ``algorithm``: x contiguous, out of its shape
    (may be x), on ``stream``."""
    C = _extension.require()
    return _rank_call(out, C.fused_all_reduce, ctx, C.fused_phases("matmul_all_reduce", algorithm), stream,
                      gemm=False, x=x, out=out, algorithm=algorithm)


# --- the backend: process groups ---------------------------------------------------------------------


def _call(op: str, x, weight, how: Optional[str]) -> str:
    """A fused call as the ranks compare it when their workspaces grow."""
    tensors = f"x {list(x.shape)}" + ("" if weight is None else f", weight {list(weight.shape)}")
    return f"{op} of {tensors} {str(x.dtype).rpartition('.')[2]}" + (f", {how}" if how else "")


def all_gather_matmul(x, weight, bias, group, impl):
    p = coll.group_size(group)
    bias = None if bias is None else bias.contiguous()
    if p == 1:
        return _extension.linear(x, weight, bias), x
    x = x.contiguous()
    mp, k = x.shape
    need = peer_memory.region_needs("all_gather_matmul", p, p * mp, weight.shape[0], k, x.dtype)
    ctx = peer_memory.context(group, x.device, "all_gather_matmul", need,
                              lambda: _call("all_gather_matmul", x, weight, f"{impl.num_chunks} chunks"))
    call = rank_all_gather_matmul(ctx, x, weight, bias, impl.num_chunks, None)
    call.enqueue(None)
    return call.result


def _reduction(op: str, what: str, x, weight, bias, group, algorithm: Optional[str] = None) -> Pending:
    """GEMM + reduce-scatter, or all-reduce by ``algorithm``, over the group's workspace; the bias
    is added after the reduction."""
    p = coll.group_size(group)
    if p == 1:
        return Pending(_extension.linear(x, weight, bias), what=what)
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    need = peer_memory.region_needs(op, p, m, n, k, x.dtype, algorithm)
    ctx = peer_memory.context(group, x.device, op, need, lambda: _call(op, x, weight, algorithm))
    call = (rank_matmul_all_reduce(ctx, x, weight, algorithm, None) if algorithm is not None
            else rank_matmul_reduce_scatter(ctx, x, weight, None))
    call.enqueue(None)
    return Pending(call.result, what=what, group=group, finish=bias_epilogue(bias))


def matmul_reduce_scatter(x, weight, bias, group, impl) -> Pending:
    return _reduction("matmul_reduce_scatter", "fused matmul+reduce-scatter", x, weight, bias, group)


def matmul_all_reduce(x, weight, bias, group, impl) -> Pending:
    if impl.algorithm is None:
        raise ValueError(f"impl: the fused all-reduce runs an algorithm of {tuple(algorithms())}, named in the "
                         f"implementation (e.g. 'fused:two_shot'), got {impl.name!r}")
    return _reduction("matmul_all_reduce", "fused matmul+all-reduce", x, weight, bias, group, impl.algorithm)


def all_reduce(x, out, peer, group, impl):
    """The plain all-reduce (``backends.run_collective``): ``out = Σ_ranks x`` by the algorithm
    named in ``impl``, over the group's workspace."""
    p = coll.group_size(group)
    if p == 1:
        return out if out is x else out.copy_(x)
    need = peer_memory.all_reduce_needs(p, x.numel(), x.dtype, impl.algorithm)
    ctx = peer_memory.context(group, x.device, "all_reduce", need, lambda: _call("all_reduce", x, None, impl.algorithm))
    rank_all_reduce(ctx, x, out, impl.algorithm, None).enqueue(None)
    return out
