"""Run functions on a world of local processes, spawned once and reused (tests, benchmarks).

:class:`World` starts ``world_size`` processes, each with ``torch.distributed`` initialized
(gloo on the CPU unless told otherwise) and a bounded collective timeout, then runs any number
of module-level functions on every rank::

    with World(4) as world:
        per_rank = world.run(check_something, 13, 17)   # check_something(13, 17) on each rank

A function that raises on any rank makes :meth:`World.run` raise :class:`WorkerError` with
every failing rank's traceback; a rank that does not answer within the deadline ends the world
with :class:`WorkerError` too, never a hang. After a failure the world is closed (its ranks
may disagree about which collective comes next) and must be recreated.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..settings import set_timeout

__all__ = ["ONE_GPU_RANKS_ENV", "World", "WorkerError", "default_backend", "join_torchrun", "launched_by_torchrun"]


_ERROR_GRACE_S = 3.0


#: The environment of several NCCL ranks on one GPU (``World(..., backend="nccl", env=ONE_GPU_RANKS_ENV,
#: cuda_device=0)``): NCCL refuses two ranks on one device of one host, so each rank claims its own
#: host (NCCL_HOSTID) and they talk over sockets on loopback.
ONE_GPU_RANKS_ENV = {
    "NCCL_HOSTID": "tp-kernels-rank-{rank}",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
}


class WorkerError(RuntimeError):
    """A function failed (or did not finish) on one or more ranks of a :class:`World`."""


def default_backend(world_size: int) -> str:
    """``nccl`` when every rank can have its own GPU, else ``gloo``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def join_torchrun() -> Tuple[str, int]:
    """Under torchrun: initialize the default process group, NCCL on this rank's GPU
    (``LOCAL_RANK``) where there is one, else gloo; returns ``(backend, world size)``."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return backend, dist.get_world_size()


def _worker(rank, world_size, store_path, backend, timeout_s, threads, env, cuda_device, tasks, results):
    try:
        os.environ.update({k: v.format(rank=rank) for k, v in env.items()})
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank if cuda_device is None else cuda_device)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        set_timeout(timeout_s)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """``world_size`` local processes with ``torch.distributed`` initialized, reused across calls.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or None for :func:`default_backend`.
        timeout_s: collective timeout inside the ranks (``init_process_group`` and
            :func:`tp_kernels.set_timeout`).
        threads: ``torch.set_num_threads`` in each rank (default: cores / ranks, at least 1).
        env: environment variables set in each rank before ``torch.distributed`` starts; values
            may use ``{rank}`` (e.g. ``{"NCCL_HOSTID": "host-{rank}"}``).
        cuda_device: put every rank on this CUDA device (default: rank r on device r).
    """

    def __init__(self, world_size: int, backend: Optional[str] = None, timeout_s: float = 60.0,
                 threads: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 cuda_device: Optional[int] = None):
        if world_size < 1:
            raise ValueError(f"world_size: expected a positive int, got {world_size}")
        self.world_size = world_size
        self.backend = backend or default_backend(world_size)
        self.timeout_s = timeout_s
        threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="tp_kernels_world_")
        store_path = os.path.join(self._dir.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store_path, self.backend, timeout_s, threads, dict(env or {}), cuda_device,
                      self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.alive = True
        self._collect(deadline_s=timeout_s + 120.0, what="start-up")

    def _collect(self, deadline_s: float, what: str) -> List[Any]:
        values: List[Any] = [None] * self.world_size
        errors, pending = {}, set(range(self.world_size))
        end = time.monotonic() + deadline_s
        while pending:
            if errors:
                # The other ranks are likely blocked in a collective the failed rank left: give
                # them a moment to report their own errors, then stop the world.
                end = min(end, time.monotonic() + _ERROR_GRACE_S)
            try:
                rank, ok, value = self._results.get(timeout=max(0.05, min(1.0, end - time.monotonic())))
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead or time.monotonic() > end:
                    self.close()
                    if errors:
                        break
                    why = f"ranks {sorted(dead)} exited" if dead else f"no answer within {deadline_s:g} s"
                    raise WorkerError(f"{what}: {why} (waiting for ranks {sorted(pending)})" + _format(errors))
                continue
            pending.discard(rank)
            if ok:
                values[rank] = value
            else:
                errors[rank] = value
        if errors:
            self.close()
            silent = f"; ranks {sorted(pending)} gave no answer" if pending else ""
            raise WorkerError(f"{what} failed on ranks {sorted(errors)}{silent}" + _format(errors))
        return values

    def run(self, fn: Callable, *args, deadline_s: Optional[float] = None, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        ``fn`` must be importable by the ranks (a module-level function). ``deadline_s``
        (default: twice the collective timeout plus 30 s) bounds the whole call.
        """
        if not self.alive:
            raise WorkerError("this World is closed")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(deadline_s or 2 * self.timeout_s + 30.0, f"{name} on {self.world_size} ranks")

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        if not getattr(self, "alive", False):
            return
        self.alive = False
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + 10.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self._dir.cleanup()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # A World collected alive (never closed): its ranks stopped by force. Not close(): its
        # queues start a feeder thread on a put, and a thread started from a finalizer, which runs
        # wherever the collector does (inside another thread's start, say), can deadlock.
        if getattr(self, "alive", False):
            self.alive = False
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()


def _format(errors) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
