"""The benchmarks' timer on the CPU: the GPU's hold (tp_kernels._timing.Hold) with stand-ins for
the CUDA events and the spinning kernel, so that the order of what is enqueued, the hold's size
and its count of exposed samples are checked without a GPU (test_gpu.py times the real ones); and
the host's bounded waits for an event and for a whole device, with stand-ins for the event and for
``torch.cuda.synchronize``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tp_kernels import _timing, settings
from tp_kernels.bench import extension, report


class _Events:
    """Stand-ins for ``torch.cuda.Event``: each logs what is done with it to ``log``; ``done``
    says whether a start event (even index) has completed when asked (``query``), ``ended``
    whether an end event (odd index) has; elapsed times are ``ms``."""

    def __init__(self, log, done=False, ms=(1.0,)):
        self.log, self.done, self.ended, self.ms, self.made = log, done, True, list(ms), 0

    def __call__(self, enable_timing=False):
        assert enable_timing
        outer = self
        index = self.made
        self.made += 1

        class Event:
            def record(self):
                outer.log.append(("record", index))

            def query(self):
                outer.log.append(("query", index))
                return outer.ended if index % 2 else outer.done

            def elapsed_time(self, end):
                return outer.ms[(index // 2) % len(outer.ms)]

        return Event()


@pytest.fixture
def fake_gpu(monkeypatch):
    """The hold's kernel and the CUDA events replaced; returns (log, events)."""
    log = []
    events = _Events(log)
    monkeypatch.setattr(_timing, "_sleep", lambda seconds: log.append(("hold", seconds)))
    monkeypatch.setattr(torch.cuda, "Event", events)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return log, events


def test_the_stream_is_held_before_pre_and_the_start_event(fake_gpu):
    log, _ = fake_gpu
    hold = _timing.Hold()
    start, end, state = _timing.gpu_events(lambda: log.append("body"), hold,
                                           pre=lambda: log.append("pre") or "started")
    assert state == "started"
    assert log == [("hold", _timing.HOLD_MIN_S), "pre", ("record", 0), "body", ("record", 1), ("query", 0)]
    assert hold.summary() == {"samples": 1, "exposed": 0}


def test_without_a_hold_nothing_spins_and_nothing_is_asked(fake_gpu):
    log, _ = fake_gpu
    _timing.gpu_events(lambda: log.append("body"))
    assert log == [("record", 0), "body", ("record", 1)]


def test_the_hold_follows_the_hosts_last_enqueue_within_its_bounds(fake_gpu, monkeypatch):
    """The next hold is HOLD_FACTOR times the host's time to enqueue the last sample (on a made-up
    clock: each body takes the host what it says), within [HOLD_MIN_S, HOLD_MAX_S]."""
    log, _ = fake_gpu
    clock = [0.0]
    monkeypatch.setattr(_timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))  # (the hold's clock only)

    def enqueue(seconds):
        return lambda: clock.__setitem__(0, clock[0] + seconds)

    hold = _timing.Hold()
    _timing.gpu_events(enqueue(0.004), hold)  # 4 ms to enqueue: the next hold 8 ms
    assert hold.seconds == pytest.approx(_timing.HOLD_FACTOR * 0.004) and 0.008 <= _timing.HOLD_MAX_S
    _timing.gpu_events(enqueue(0.001), hold)
    held = [entry[1] for entry in log if entry[0] == "hold"]
    assert held == [_timing.HOLD_MIN_S, pytest.approx(0.008)]
    assert hold.seconds == pytest.approx(0.002)  # a quicker enqueue shrinks it again
    _timing.gpu_events(enqueue(1e-6), hold)
    assert hold.seconds == _timing.HOLD_MIN_S  # not below the floor
    hold.before()  # nothing enqueued: the floor
    hold.after(_Event(), timed=False)
    assert hold.seconds == _timing.HOLD_MIN_S
    _timing.gpu_events(enqueue(0.03), hold)  # past the ceiling
    assert hold.seconds == _timing.HOLD_MAX_S
    log.clear()
    _timing.gpu_events(lambda: None, _timing.Hold(0.05))  # a first hold of its own (a trace's)
    assert log[0] == ("hold", 0.05)


def test_a_sample_whose_start_had_passed_is_counted_exposed_and_warm_ups_not_at_all(fake_gpu):
    _, events = fake_gpu
    hold = _timing.Hold()
    events.done = True
    _timing.gpu_events(lambda: None, hold, timed=False)
    assert hold.summary() == {"samples": 0, "exposed": 0}
    _timing.gpu_events(lambda: None, hold)
    events.done = False
    _timing.gpu_events(lambda: None, hold)
    assert hold.summary() == {"samples": 2, "exposed": 1}


def test_the_timer_holds_each_sample_and_counts_the_timed_ones(fake_gpu):
    log, events = fake_gpu
    events.ms = [5.0, 1.0, 2.0, 3.0]  # per sample (two events each): warm-up 5, then 1, 2, 3
    hold = _timing.Hold()
    calls = []
    timer = _timing.Timer(3, 1, True, None, hold=hold)
    t = timer(lambda i: calls.append(i), pre=lambda i: log.append(f"pre {i}"))
    assert t == pytest.approx(2.0e-3)  # the median of the timed samples, in seconds
    assert calls == [0, 1, 2, 3]
    assert hold.summary() == {"samples": 3, "exposed": 0}
    holds = [i for i, entry in enumerate(log) if isinstance(entry, tuple) and entry[0] == "hold"]
    pres = [i for i, entry in enumerate(log) if isinstance(entry, str)]
    assert len(holds) == 4 and all(h + 1 == p for h, p in zip(holds, pres))  # each hold, then its pre


def test_a_timer_without_a_hold_and_the_host_timer_spin_nothing(fake_gpu):
    log, _ = fake_gpu
    assert _timing.Timer(2, 1, True, None)(lambda i: None) == pytest.approx(1.0e-3)
    assert not [entry for entry in log if entry[0] == "hold"]
    log.clear()
    cpu = _timing.Timer(2, 1, False, None, hold=_timing.Hold())
    assert cpu.hold is None
    assert cpu(lambda i: None) >= 0.0 and log == []


def test_the_host_timer_times_the_body_alone_each_sample_after_a_barrier(monkeypatch):
    """On the host, each timed sample follows a barrier of the group (the warm-up none); ``pre`` and
    ``post`` run around the body, untimed, ``post`` given what ``pre`` returned."""
    log = []
    monkeypatch.setattr(_timing.coll, "barrier", lambda group, device: log.append("barrier"))

    def pre(i):
        time.sleep(0.05)
        log.append(f"pre {i}")
        return i

    def post(state):
        time.sleep(0.05)
        log.append(f"post {state}")

    t = _timing.Timer(2, 1, False, None)(lambda i: log.append(f"body {i}"), pre=pre, post=post)
    assert log == ["pre 0", "body 0", "post 0", "barrier", "pre 1", "body 1", "post 1",
                   "barrier", "pre 2", "body 2", "post 2"]
    assert t < 0.05


def test_the_timer_takes_several_bodies_samples_in_turns(monkeypatch):
    """Timer.in_turns: each body's warm-up runs, then its timed samples, one of each a round after
    a barrier, the order rotated each round (turns); each body's own median, in their order."""
    log = []
    monkeypatch.setattr(_timing.coll, "barrier", lambda group, device: log.append("barrier"))
    assert _timing.turns(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0)]

    def body(name, seconds):
        def run(i):
            log.append(f"{name} {i}")
            time.sleep(seconds)
        return run

    fast, slow = _timing.Timer(3, 1, False, None).in_turns([body("a", 0.0), body("b", 0.03)])
    assert log == ["a 0", "b 0", "barrier", "a 1", "barrier", "b 1", "barrier", "b 2", "barrier", "a 2",
                   "barrier", "a 3", "barrier", "b 3"]
    assert fast < 0.02 < 0.03 <= slow


def test_the_extension_benchmarks_time_with_the_shared_hold(fake_gpu, monkeypatch):
    log, events = fake_gpu
    events.ms = [9.0, 9.0, 1.0, 3.0, 2.0]
    hold = _timing.Hold()
    monkeypatch.setattr(extension, "HOLD", hold)
    assert extension.gpu_time_ms(lambda: log.append("call"), 3, warmup=2) == pytest.approx(2.0)
    assert log.count("call") == 5 and len([e for e in log if e[0] == "hold"]) == 5
    assert hold.summary() == {"samples": 3, "exposed": 0}


class _Event:
    """An event that completes at its ``after``-th query (never: None)."""

    def __init__(self, after=None):
        self.after, self.queries = after, 0

    def query(self):
        self.queries += 1
        return self.after is not None and self.queries >= self.after


def test_a_wait_for_an_event_returns_once_it_has_completed():
    done = _Event(after=1)
    _timing.wait_event(done, "x")
    assert done.queries == 1  # complete already: asked once
    later = _Event(after=4)
    _timing.wait_event(later, "x")
    assert later.queries == 4


def test_a_wait_for_an_event_that_does_not_complete_raises_within_the_timeout():
    event = _Event()
    started = time.monotonic()
    with settings.overriding(timeout=0.2), pytest.raises(
            RuntimeError, match=r"tp_kernels: the third sample: the GPU work it timed, and the work queued on the "
                                r"stream before it, did not complete within 0.2 s; it stays queued. The limit is "
                                r"tp_kernels.set_timeout\(\)"):
        _timing.wait_event(event, "the third sample")
    assert 0.2 <= time.monotonic() - started < 5.0
    assert event.queries > 2  # polled, not waited for once


class _Synchronize:
    """A stand-in for ``torch.cuda.synchronize``: it logs the device it is given and the thread it
    runs on, then returns once ``release`` is set (at once when made set), or raises ``error``."""

    def __init__(self, released=True, error=None):
        self.release, self.error, self.calls = threading.Event(), error, []
        if released:
            self.release.set()

    def __call__(self, device=None):
        self.calls.append((device, threading.current_thread()))
        self.release.wait(30.0)
        if self.error is not None:
            raise self.error


def test_a_device_wide_wait_returns_once_the_device_has_finished(monkeypatch):
    sync = _Synchronize()
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    _timing.synchronize("x")
    _timing.synchronize("x", torch.device("cuda", 1))
    # the current device's index is taken on the caller's thread: the helper's own would be 0
    assert [device for device, _ in sync.calls] == [torch.device("cuda", 3), torch.device("cuda", 1)]
    assert all(thread is not threading.current_thread() for _, thread in sync.calls)


def test_a_device_wide_wait_that_does_not_finish_raises_within_the_timeout(monkeypatch):
    sync = _Synchronize(released=False)
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    started = time.monotonic()
    try:
        with settings.overriding(timeout=0.2), pytest.raises(
                RuntimeError, match=r"tp_kernels: peer workspace release: the work queued on cuda:2, on every "
                                    r"stream, did not complete within 0.2 s; it stays queued. The limit is "
                                    r"tp_kernels.set_timeout\(\) or TP_KERNELS_TIMEOUT_S"):
            _timing.synchronize("peer workspace release", torch.device("cuda", 2))
        assert 0.2 <= time.monotonic() - started < 5.0
        (_, helper), = sync.calls
        assert helper.is_alive() and helper.daemon  # still waiting, and holding no exit
    finally:
        sync.release.set()
    helper.join(5.0)
    assert not helper.is_alive()


def test_a_device_wide_wait_raises_the_error_the_synchronization_raised(monkeypatch):
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "synchronize", _Synchronize(error=error))
    with pytest.raises(RuntimeError) as raised:
        _timing.synchronize("x", torch.device("cuda", 0))
    assert raised.value is error


def test_a_device_wide_wait_that_cannot_start_its_helper_waits_for_nothing_and_says_so(monkeypatch):
    """Python 3.12.1, in an atexit handler: "can't create new thread at interpreter shutdown". The
    wait is not made without its limit: it raises, naming the step."""
    sync = _Synchronize()
    monkeypatch.setattr(torch.cuda, "synchronize", sync)

    class Refused(threading.Thread):
        def start(self):
            raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(_timing, "threading", SimpleNamespace(Thread=Refused))
    with pytest.raises(RuntimeError, match=r"tp_kernels: VirtualRanks.close: the wait for the work queued on cuda:1 is "
                                           r"bounded on a helper thread, which could not start \(can't create new "
                                           r"thread at interpreter shutdown\); nothing was waited for") as raised:
        _timing.synchronize("VirtualRanks.close", torch.device("cuda", 1))
    assert sync.calls == [] and isinstance(raised.value.__cause__, RuntimeError)


def test_the_timer_waits_for_a_gpu_sample_within_the_timeout_and_names_what_it_timed(fake_gpu):
    _, events = fake_gpu
    events.ended = False  # the GPU never reaches a sample's end
    timer = _timing.Timer(2, 0, True, None, what="auto's measurement of matmul_all_reduce m=16")
    with settings.overriding(timeout=0.1), pytest.raises(
            RuntimeError, match=r"auto's measurement of matmul_all_reduce m=16: the GPU work it timed"):
        timer(lambda i: None)


def test_the_main_jobs_line_on_the_hold():
    line = report.format_hold({"samples": 40, "exposed": 3})
    assert line.startswith("# ") and "3 of 40" in line and "held" in line
