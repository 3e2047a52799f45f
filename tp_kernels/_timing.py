"""Timing of GPU or host work across the ranks of a group, for the benchmarks and for
``backend="auto"``'s measured choice (:mod:`tp_kernels.autotune`).

CUDA events on the current stream around the timed region on the GPU, ``time.perf_counter``
around synchronous host work on the CPU; a barrier before each sample; a sample's time is the
slowest rank's, so every rank gets the same figures.

A GPU sample starts on an idle GPU (the barrier and the last sample's end are waited for), so
its start event completes at once and the GPU then waits for each launch the host makes: the
sample holds the host's time to enqueue the region as well as the GPU's time to run it. The
benchmarks time the GPU's work (:class:`Hold`: the stream held before the start event until the
region is enqueued), and the host's time apart (:mod:`tp_kernels.bench.host`); ``"auto"``'s
measurement holds nothing, as an eager call pays both.

The host's waits for the GPU are here too, each within :func:`tp_kernels.get_timeout`: for an
event (:func:`wait_event`) and for a whole device (:func:`synchronize`).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _collectives as coll
from .settings import get_timeout

__all__ = ["HOLD", "Hold", "Timer", "gpu_events", "synchronize", "turns", "wait_event"]

#: The shortest and the longest hold (seconds): the hold is :data:`HOLD_FACTOR` times the
#: host's time to enqueue the last sample, within these.
HOLD_MIN_S = 50e-6
HOLD_MAX_S = 10e-3
HOLD_FACTOR = 2.0


@functools.lru_cache(maxsize=None)
def _cycles_per_second(device: int) -> float:
    """The rate of the GPU's clock that ``torch.cuda._sleep`` counts, measured once a device
    (CUDA events around a wait of 2**22 cycles, about 2 ms)."""
    cycles = 1 << 22
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)  # (loaded and warm)
        start, end, _ = gpu_events(lambda: torch.cuda._sleep(cycles))
        wait_event(end, "the GPU clock's measurement")
        return cycles / (start.elapsed_time(end) * 1e-3)


def _sleep(seconds: float) -> None:
    """A kernel on the current stream that spins about ``seconds``."""
    torch.cuda._sleep(max(1, int(seconds * _cycles_per_second(torch.cuda.current_device()))))


class Hold:
    """The current stream held (a kernel that spins) before a GPU sample's start event, long
    enough for the host to enqueue the timed region meanwhile: the events then measure the GPU's
    time for the region, not the host's time to enqueue it as well (see the module doc; nvbench
    holds the stream the same way, with a kernel that waits for the host).

    The hold lasts :data:`HOLD_FACTOR` times the host's time to enqueue the last sample, within
    [:data:`HOLD_MIN_S`, :data:`HOLD_MAX_S`]. Where the host took longer than the hold (its start
    event had completed when the region's end was enqueued: a region that waits for the GPU, or a
    slow host), the sample still holds the host's time: :attr:`exposed` counts those samples of
    :attr:`samples`.
    """

    def __init__(self, seconds: float = HOLD_MIN_S):
        self.seconds = seconds  # (the first hold's)
        self.samples = 0
        self.exposed = 0
        self._enqueue_start = 0.0

    def before(self) -> None:
        """Enqueue the hold; the sample's start event, then its region, follow."""
        _sleep(self.seconds)
        self._enqueue_start = time.perf_counter()

    def after(self, start, timed: bool = True) -> None:
        """Once the region and its end event are enqueued: size the next hold, and count the
        sample if ``timed`` (not a warm-up; exposed if the GPU had passed ``start`` already)."""
        enqueued = time.perf_counter() - self._enqueue_start
        if timed:
            self.samples += 1
            self.exposed += bool(start.query())
        self.seconds = min(HOLD_MAX_S, max(HOLD_MIN_S, HOLD_FACTOR * enqueued))

    def summary(self) -> dict:
        """What a record keeps of the hold: ``{"samples", "exposed"}``."""
        return {"samples": self.samples, "exposed": self.exposed}


#: The benchmarks' hold, one a process: its counts are over every sample they took in it.
HOLD = Hold()


def gpu_events(body: Callable[[], object], hold: Optional[Hold] = None, timed: bool = True,
               pre: Optional[Callable[[], object]] = None):
    """``(start, end, pre())``: CUDA events on the current stream around ``body()``, after
    ``pre()`` (untimed), the stream held first by ``hold`` (None: not held) until both are
    enqueued; ``timed``: whether the hold counts the sample (not a warm-up)."""
    if hold is not None:  # (before pre: what pre starts waits for it too)
        hold.before()
    state = pre() if pre is not None else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    body()
    end.record()
    if hold is not None:
        hold.after(start, timed)
    return start, end, state


#: How long a host wait for an event (:func:`wait_event`) sleeps between its queries after the
#: second (the first two are a yield apart), in seconds.
POLL_S = 100e-6


def _not_complete(what: str, work: str, timeout: float) -> RuntimeError:
    """The error of a host wait, named ``what``, for GPU ``work`` (a phrase that a comma closes)
    that passed ``timeout`` seconds."""
    return RuntimeError(f"tp_kernels: {what}: {work}, did not complete within {timeout:g} s; it stays queued. "
                        "The limit is tp_kernels.set_timeout() or TP_KERNELS_TIMEOUT_S.")


def wait_event(event, what: str) -> None:
    """Wait on the host until ``event`` has completed, at most :func:`tp_kernels.get_timeout`
    seconds (polled: a query, then a yield, then a query every :data:`POLL_S`); past that, raise
    ``RuntimeError`` naming ``what``, the GPU work it waited for. The work stays queued."""
    if event.query():
        return
    timeout = get_timeout()
    deadline = time.monotonic() + timeout
    time.sleep(0)
    while not event.query():
        if time.monotonic() > deadline:
            raise _not_complete(what, "the GPU work it timed, and the work queued on the stream before it", timeout)
        time.sleep(POLL_S)


def synchronize(what: str, device: Optional[torch.device] = None) -> None:
    """Wait on the host until the work queued on ``device`` (None: the current device) has
    completed on every stream, at most :func:`tp_kernels.get_timeout` seconds; past that, raise
    ``RuntimeError`` naming ``what``, the step that waited. ``torch.cuda.synchronize`` has no limit
    of its own, so it runs on a helper thread (torch lets go of the GIL while it waits) and the
    limit is on joining that thread. An error of the device's (an illegal address, say) is raised
    here as the synchronization raised it. Past the limit the work stays queued and the helper
    stays blocked until it ends (a daemon thread: it does not hold the interpreter's exit). Where no
    thread can start (some Pythons refuse one while the interpreter shuts down, as in an ``atexit``
    handler), it raises ``RuntimeError`` naming ``what`` and waits for nothing: never without a limit."""
    if device is None:  # (the helper thread's own current device is device 0)
        device = torch.device("cuda", torch.cuda.current_device())
    errors = []

    def wait() -> None:
        try:
            torch.cuda.synchronize(device)
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    helper = threading.Thread(target=wait, name=f"tp_kernels synchronize: {what}", daemon=True)
    timeout = get_timeout()
    try:
        helper.start()
    except RuntimeError as exc:  # some Pythons start no thread while the interpreter shuts down (atexit)
        raise RuntimeError(f"tp_kernels: {what}: the wait for the work queued on {device} is bounded on a helper "
                           f"thread, which could not start ({exc}); nothing was waited for, and the work stays "
                           "queued") from exc
    helper.join(timeout)
    if helper.is_alive():
        raise _not_complete(what, f"the work queued on {device}, on every stream", timeout)
    if errors:
        raise errors[0]


def turns(count: int, rounds: int) -> List[Tuple[int, int]]:
    """The order in which ``count`` figures are sampled in turns over ``rounds`` rounds: ``(round,
    figure)`` pairs, each figure once a round, the order rotated each round, so that what drifts
    over a measurement (a GPU's clock rising from idle, its temperature, its power limit) falls on
    every figure alike. The same on every rank."""
    return [(i, (i + j) % count) for i in range(rounds) for j in range(count)]


class Timer:
    """Median seconds of ``body(i)`` over ``iters`` samples (slowest rank each), see the module doc.

    ``pre(i)`` and ``post(i)`` run around each sample, untimed (e.g. starting and finishing
    communication that the timed GEMM should overlap). ``hold`` (on a GPU): each sample's stream
    held until ``pre`` and ``body`` are enqueued (:class:`Hold`), so that a sample is the GPU's
    time alone. A GPU sample is waited for within :func:`tp_kernels.get_timeout` (:func:`wait_event`:
    the error names ``what``).
    """

    def __init__(self, iters: int, warmup: int, cuda: bool, group=None, hold: Optional[Hold] = None,
                 what: str = "a timed sample"):
        self.iters, self.warmup, self.cuda, self.group, self.what = iters, warmup, cuda, group, what
        self.p = coll.group_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.hold = hold if cuda else None

    def __call__(self, body: Callable[[int], object], pre: Optional[Callable[[int], object]] = None,
                 post: Optional[Callable[[int], object]] = None) -> float:
        return self.in_turns([body], pre, post)[0]

    def in_turns(self, bodies: Sequence[Callable[[int], object]], pre: Optional[Callable[[int], object]] = None,
                 post: Optional[Callable[[int], object]] = None) -> List[float]:
        """The median seconds of each of ``bodies``, as :meth:`__call__` times one, their samples
        taken in turns (:func:`turns`): the warm-up rounds, then ``iters`` rounds of one sample
        each, so that a drift over the measurement does not decide between them."""
        def once(body, i):
            if self.cuda:
                start, end, state = gpu_events(lambda: body(i), self.hold, i >= self.warmup,
                                               None if pre is None else lambda: pre(i))
            else:
                state = pre(i) if pre else None
                t0 = time.perf_counter()
                body(i)
                elapsed = time.perf_counter() - t0
            if post:
                post(state)
            if self.cuda:
                wait_event(end, self.what)
                elapsed = start.elapsed_time(end) / 1e3
            return elapsed

        for i, b in turns(len(bodies), self.warmup):
            once(bodies[b], i)
        samples: List[List[float]] = [[] for _ in bodies]
        for i, b in turns(len(bodies), self.iters):
            coll.barrier(self.group, self.device)
            samples[b].append(once(bodies[b], self.warmup + i))
        if self.p > 1:  # each sample the slowest rank's
            t = torch.tensor(samples, dtype=torch.float64, device=coll.exchange_device(self.group, self.device))
            samples = coll.all_reduce(t, self.group, op=dist.ReduceOp.MAX, inplace=True).wait().tolist()
        return [statistics.median(s) for s in samples]
