"""p ranks of the fused path driven by one process on one GPU: how its kernels, flags and peer
copies are tested and measured on a single GPU."""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch

from .. import _extension, settings
from .._timing import synchronize
from ..backends import fused, peer_memory

__all__ = ["VirtualRanks", "forked", "phase_order", "rank_order_sum"]


@contextlib.contextmanager
def forked(streams: Sequence[torch.cuda.Stream], device=None):
    """``streams`` ordered after the work of the current stream (of ``device``; None: the current
    device) on entry, and that stream after theirs on exit: work enqueued on them inside runs
    between what the current stream did before and what it does after."""
    current = torch.cuda.current_stream(device)
    for s in streams:
        s.wait_stream(current)
    yield
    for s in streams:
        current.wait_stream(s)


def rank_order_sum(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """What the fused all-reduce gives for ``parts`` (one per rank): their sum in rank order in
    float32, then rounded to ``dtype`` (the same bits)."""
    acc = parts[0].float()
    for t in parts[1:]:
        acc = acc + t.float()
    return acc.to(dtype)


def phase_order(phases: Sequence[int]) -> List[tuple]:
    """``(rank, phase)`` in the order virtual ranks enqueue them, for ranks with ``phases[q]``
    phases each: in rounds, phase k of every rank before phase k + 1 of any."""
    return [(q, k) for k in range(max(phases, default=0)) for q, n in enumerate(phases) if k < n]


class VirtualRanks:
    """p ranks driven by this process on one GPU, for tests and benchmarks of the fused path.

    Each rank has its own workspace buffer, PeerContext, stream and copy stream; the ops take one
    input per rank, enqueue every rank's work on its stream (the host never waits inside an op,
    so rank 0 can wait on the GPU for rank 1's data) and order the current stream after all of
    them. The kernels, flags and copies are those of a real group (``fused.rank_*``); only the
    buffers are in one process (and on one GPU, so the copies share its memory bandwidth instead
    of NVLink).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, p: int, device=None, timeout_s: Optional[float] = None):
        C = _extension.require()
        if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= C.MAX_RANKS:
            raise ValueError(f"p: expected an int in [1, {C.MAX_RANKS}], got {p!r}")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index)
        self.p = p
        self.timeout_s = timeout_s
        self.streams = [torch.cuda.Stream(self.device) for _ in range(p)]
        self.regions: Optional[List[int]] = None  # None: no workspace yet
        self.bases: List[int] = []
        self.contexts: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Free every rank's buffer (after the device has finished with them).

        A device that does not finish within the timeout keeps the buffers and the ranks' contexts
        (in ``peer_memory._unreleased``: not freed under work that may still use them, as
        :func:`~tp_kernels.backends.peer_memory.destroy_workspaces` keeps a group's), and the error
        is raised; this object starts afresh at its next call."""
        if self.bases:
            try:
                synchronize("VirtualRanks.close: the ranks' work on their buffers", self.device)
            except BaseException:
                peer_memory._unreleased.append((self.contexts, self.bases))
                self.contexts, self.bases, self.regions = [], [], None
                raise
            self.contexts = []
            for b in self.bases:
                _extension.require().workspace_free(b, self.device.index)
            self.bases, self.regions = [], None

    def check(self) -> None:
        """Raise the error a timed-out device wait of any rank recorded."""
        for ctx in self.contexts:
            ctx.check()

    def _ensure(self, op: str, need: Sequence[int]) -> None:
        grown = peer_memory.grown(self.regions, need)
        if grown is not None:
            if peer_memory.capturing():
                raise peer_memory.capture_growth_error(op, grown)
            self.check()
            self.close()
            C, dev = _extension.require(), self.device.index
            for _ in range(self.p):
                self.bases.append(C.workspace_alloc(C.CONTROL_BYTES + sum(grown), dev))
                C.workspace_init(self.bases[-1], dev)
            self.regions = grown
            # (sharing: every rank's kernels run on this one GPU)
            self.contexts = [peer_memory.new_context(q, self.p, dev, self.bases, grown, self._timeout(), self.p)
                             for q in range(self.p)]
        for ctx in self.contexts:
            ctx.timeout_s = self._timeout()

    def _timeout(self) -> float:
        return self.timeout_s if self.timeout_s is not None else settings.get_timeout()

    def _check_inputs(self, xs, weights, op: str):
        if len(xs) != self.p or len(weights) != self.p:
            raise ValueError(f"{op}: expected one x and one weight per rank ({self.p}), got {len(xs)} and {len(weights)}")
        for q, (x, w) in enumerate(zip(xs, weights)):
            if x.device != self.device or w.device != self.device:
                raise ValueError(f"xs[{q}]/weights[{q}]: expected tensors on {self.device}")
            if x.dim() != 2 or w.dim() != 2 or x.shape != xs[0].shape or w.shape != weights[0].shape:
                raise ValueError(f"xs[{q}]/weights[{q}]: expected 2-D tensors shaped like rank 0's "
                                 f"{tuple(xs[0].shape)}/{tuple(weights[0].shape)}")
            if x.dtype not in _extension.NATIVE_DTYPES or x.dtype != w.dtype:
                raise ValueError(f"xs[{q}]: dtype {x.dtype} (weight {w.dtype}): expected one of "
                                 f"{', '.join(_extension.require().DTYPES)} for both")
            if x.shape[1] != w.shape[1]:
                raise ValueError(f"xs[{q}]: {x.shape[1]} columns do not match weights[{q}] {tuple(w.shape)}")

    def _launch(self, prepare, inputs) -> list:
        """Every rank's part of an op (``prepare(q, stream)``: a :class:`fused.RankCall`) on its
        stream, ordered after the current stream's work and before what the current stream does
        next; returns the ranks' results.

        The phases go in rounds (:func:`phase_order`): phase k of every rank is enqueued before
        phase k + 1 of any. A phase's waits need only signals of earlier phases, so each is
        enqueued after everything it waits for, whichever hardware queue a stream lands in and
        whenever a kernel's module loads: no rank's spinning wait can sit in front of the work it
        waits for.
        """
        current = torch.cuda.current_stream(self.device)
        with forked(self.streams, self.device):
            calls = []
            for q, s in enumerate(self.streams):
                for t in inputs[q]:
                    if t is not None:
                        t.record_stream(s)
                calls.append(prepare(q, s))
            for q, phase in phase_order([c.phases for c in calls]):
                calls[q].enqueue(phase)
        for c in calls:
            for t in (c.result if isinstance(c.result, tuple) else (c.result,)):
                t.record_stream(current)
        return [c.result for c in calls]

    def all_gather_matmul(self, xs, weights, biases=None, num_chunks: int = 1):
        """Per rank q: ``(AG(xs) weights[q]ᵀ + biases[q], AG(xs))``."""
        self._check_inputs(xs, weights, "all_gather_matmul")
        biases = [None] * self.p if biases is None else [None if b is None else b.contiguous() for b in biases]
        xs = [x.contiguous() for x in xs]
        mp, k = xs[0].shape
        self._ensure("all_gather_matmul",
                     peer_memory.region_needs("all_gather_matmul", self.p, self.p * mp, weights[0].shape[0], k,
                                              xs[0].dtype))
        return self._launch(
            lambda q, s: fused.rank_all_gather_matmul(self.contexts[q], xs[q], weights[q], biases[q], num_chunks, s),
            [(xs[q], weights[q], biases[q]) for q in range(self.p)])

    def matmul_reduce_scatter(self, xs, weights):
        """Per rank q: block q of ``Σ_r xs[r] weights[r]ᵀ`` (rows split in p)."""
        self._check_inputs(xs, weights, "matmul_reduce_scatter")
        xs = [x.contiguous() for x in xs]
        m, k = xs[0].shape
        if m % self.p:
            raise ValueError(f"xs[0].shape[0]: {m} is not divisible by p = {self.p}")
        self._ensure("matmul_reduce_scatter",
                     peer_memory.region_needs("matmul_reduce_scatter", self.p, m, weights[0].shape[0], k, xs[0].dtype))
        return self._launch(lambda q, s: fused.rank_matmul_reduce_scatter(self.contexts[q], xs[q], weights[q], s),
                            [(xs[q], weights[q]) for q in range(self.p)])

    def matmul_all_reduce(self, xs, weights, algorithm: Optional[str] = None):
        """Per rank q: ``Σ_r xs[r] weights[r]ᵀ`` by ``algorithm`` (default:
        :func:`tp_kernels.backends.fused.all_reduce_algorithm`)."""
        self._check_inputs(xs, weights, "matmul_all_reduce")
        xs = [x.contiguous() for x in xs]
        m, k = xs[0].shape
        n = weights[0].shape[0]
        algorithm = (fused.all_reduce_algorithm(m, n, self.p, xs[0].dtype) if algorithm is None
                     else fused.check_algorithm(algorithm, m, self.p))
        self._ensure("matmul_all_reduce",
                     peer_memory.region_needs("matmul_all_reduce", self.p, m, n, k, xs[0].dtype, algorithm))
        return self._launch(
            lambda q, s: fused.rank_matmul_all_reduce(self.contexts[q], xs[q], weights[q], algorithm, s),
            [(xs[q], weights[q]) for q in range(self.p)])

    def all_reduce(self, xs, algorithm: Optional[str] = None):
        """Per rank q: ``Σ_r xs[r]`` (the plain all-reduce of :class:`tp_kernels.Communicator`, any
        shape) by ``algorithm`` (default: :func:`tp_kernels.backends.fused.collective_algorithm`)."""
        if len(xs) != self.p:
            raise ValueError(f"all_reduce: expected one x per rank ({self.p}), got {len(xs)}")
        for q, x in enumerate(xs):
            if x.device != self.device or x.shape != xs[0].shape or x.dtype != xs[0].dtype:
                raise ValueError(f"xs[{q}]: expected a tensor shaped like rank 0's {tuple(xs[0].shape)} "
                                 f"{xs[0].dtype} on {self.device}")
        xs = [x.contiguous() for x in xs]
        numel, dtype = xs[0].numel(), xs[0].dtype
        if algorithm is None:
            algorithm = fused.collective_algorithm(numel, self.p, dtype)
        elif algorithm not in fused.algorithms():
            raise ValueError(f"algorithm: expected one of {tuple(fused.algorithms())}, got {algorithm!r}")
        self._ensure("all_reduce", peer_memory.all_reduce_needs(self.p, numel, dtype, algorithm))

        def prepare(q, s):
            with torch.cuda.stream(s):
                out = torch.empty_like(xs[q])
            return fused.rank_all_reduce(self.contexts[q], xs[q], out, algorithm, s)

        return self._launch(prepare, [(xs[q],) for q in range(self.p)])
