"""Timing of GPU or host work across the ranks of a group, for the benchmarks and for
``backend="auto"``'s measured choice (:mod:`tp_kernels.autotune`).

CUDA events on the current stream around the timed region on the GPU, ``time.perf_counter``
around synchronous host work on the CPU; a barrier before each sample; a sample's time is the
slowest rank's, so every rank gets the same figures.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import _collectives as coll

__all__ = ["Timer"]


class Timer:
    """Median seconds of ``body(i)`` over ``iters`` samples (slowest rank each), see the module doc.

    ``pre(i)`` and ``post(i)`` run around each sample, untimed (e.g. starting and finishing
    communication that the timed GEMM should overlap).
    """

    def __init__(self, iters: int, warmup: int, cuda: bool, group=None):
        self.iters, self.warmup, self.cuda, self.group = iters, warmup, cuda, group
        self.p = coll.group_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def __call__(self, body: Callable[[int], object], pre: Optional[Callable[[int], object]] = None,
                 post: Optional[Callable[[int], object]] = None) -> float:
        def once(i):
            state = pre(i) if pre else None
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                body(i)
                end.record()
            else:
                t0 = time.perf_counter()
                body(i)
                elapsed = time.perf_counter() - t0
            if post:
                post(state)
            if self.cuda:
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            return elapsed

        for i in range(self.warmup):
            once(i)
        samples = []
        for i in range(self.iters):
            coll.barrier(self.group, self.device)
            samples.append(once(self.warmup + i))
        if self.p > 1:
            t = torch.tensor(samples, dtype=torch.float64, device=coll.exchange_device(self.group, self.device))
            samples = coll.all_reduce(t, self.group, op=dist.ReduceOp.MAX, inplace=True).wait().tolist()
        return statistics.median(samples)
