"""Per-rank measurements: each case's GEMMs alone, its collectives alone, the GEMMs while the
collectives are in flight, and every backend's op (or layer forward+backward).

Timing: CUDA events around the timed region on the GPU, the stream held before it until the host
has enqueued the region (:class:`tp_kernels._timing.Hold`: the GPU's time, not the host's;
:mod:`tp_kernels.bench.host` times that), ``time.perf_counter`` around synchronous host work on
the CPU; a barrier before each sample; a sample's time is the slowest rank's; the median over
``iters`` samples after ``warmup`` untimed ones. Inputs rotate through enough buffer sets to
exceed twice the last-level cache (L2 on the GPU; at most 16 sets and 4 GiB), and are random
normal, never zeros.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _collectives as coll
from .. import autotune, dispatch, ops, perf_model
from .._timing import HOLD, Timer
from ..layers import ColumnParallelLinear, RowParallelLinear
from . import communicator, one_gpu
from .cases import Case

__all__ = ["Timer", "buffer_sets", "measure_case", "measure_peak", "model_gemms", "run_rank"]

_CPU_CACHE_BYTES = 32 << 20
_GPU_CACHE_BYTES = 64 << 20  # when torch does not report the L2 size
_MAX_SETS = 16
_MAX_SET_BYTES = 4 << 30


def buffer_sets(bytes_per_set: int, cuda: bool) -> int:
    """Buffer sets to rotate through so that the working set exceeds twice the cache."""
    cache = _CPU_CACHE_BYTES
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        cache = getattr(props, "L2_cache_size", 0) or _GPU_CACHE_BYTES
    n = math.ceil(2 * cache / max(1, bytes_per_set)) + 1
    return max(2, min(_MAX_SETS, n, max(1, _MAX_SET_BYTES // max(1, bytes_per_set))))


def measure_peak(dtype: torch.dtype, device: torch.device, timer: Timer) -> float:
    """TFLOP/s of a large square GEMM (8192 on the GPU, 1024 on the CPU): the run's GEMM peak."""
    size = 8192 if device.type == "cuda" else 1024
    a = [torch.randn(size, size, device=device, dtype=dtype) for _ in range(2)]
    b = torch.randn(size, size, device=device, dtype=dtype)
    t = timer(lambda i: torch.mm(a[i % 2], b))
    return 2.0 * size ** 3 / t / 1e12


def _rand(shape, n, device, dtype):
    return [torch.randn(shape, device=device, dtype=dtype) for _ in range(n)]


def _collectives(case: Case, p: int) -> List[Tuple[str, Tuple[int, int], str]]:
    """``(kind, shape, what)`` of the collectives one call (op, or layer fwd+bwd) communicates."""
    m, k, n = case.m, case.k, case.n
    if not case.is_layer:
        kind = perf_model.OP_COLLECTIVE[case.target]
        return [(kind, (m // p, k), "x")] if kind == "all_gather" else [(kind, (m, n), "x W^T")]
    if case.kind == "column":
        if case.sequence_parallel:
            return [("all_gather", (m // p, k), "x"), ("all_gather", (m // p, k), "x (backward)"),
                    ("reduce_scatter", (m, k), "dx")]
        return [("all_reduce", (m, k), "dx")]
    if case.sequence_parallel:
        return [("reduce_scatter", (m, n), "y"), ("all_gather", (m // p, n), "dy")]
    return [("all_reduce", (m, n), "y")]


def _start(kind: str, buf: torch.Tensor, group) -> coll.Pending:
    if kind == "all_gather":
        return coll.all_gather_dim0(buf, group)
    if kind == "reduce_scatter":
        return coll.reduce_scatter_dim0(buf, group, scratch=True)
    return coll.all_reduce(buf, group, inplace=True)


def _ring(send: torch.Tensor, recv: torch.Tensor, group) -> None:
    work, pending = coll.ring_exchange(send, recv, group, tag=0, what="ring step")
    pending.wait()
    if work is not None:
        coll.wait(work, "ring step send", group, cuda=send.is_cuda)


def _gemms(case: Case, p: int) -> List[Tuple[Tuple[int, int, int], str]]:
    """``((m, n, k), layout)`` of this rank's GEMMs: the op's one, or a layer's fwd, dgrad and
    wgrad, each in the layout its call runs it (:func:`_gemm_call`)."""
    m = case.m
    if case.kind == "column":
        fwd = (m, case.n // p, case.k)
    else:
        fwd = (m, case.n, case.k // p)
    if not case.is_layer:
        return [(fwd, "linear")]
    mm, nn, kk = fwd
    return [(fwd, "linear"), ((mm, kk, nn), "dgrad"), ((nn, kk, mm), "wgrad")]  # dgrad (m, k, n), wgrad (n, k, m)


def model_gemms(case: Case, p: int, num_chunks: Optional[int]) -> Set[Tuple[int, int, int]]:
    """The ``(m, n, k)`` of every GEMM :mod:`tp_kernels.perf_model` reads to predict ``case`` on
    ``p`` ranks, in the reference's schedule and in the pipelined one of ``num_chunks`` (None: the
    defaults) as the report asks it (:mod:`tp_kernels.bench.report`)."""
    asked: Set[Tuple[int, int, int]] = set()

    def gemm(m, n, k, dtype):
        asked.add((m, n, k))
        return 0.0

    for schedule in ("naive", "pipelined"):
        case.tasks(p, "float32", gemm, perf_model.LINKS["nvlink4"], schedule, num_chunks)  # (the link's times unread)
    return asked


def _gemm_call(shape: Tuple[int, int, int], layout: str, nsets: int, device, dtype):
    """The operands (``nsets`` of each) and the call of a GEMM of ``[m, n]`` over ``k`` as the ops
    and their backwards run it: ``"linear"``, ``F.linear(x [m, k], W [n, k])``; ``"dgrad"``, the
    input's gradient ``dy [m, k] @ W [k, n]`` (the weight not transposed); ``"wgrad"``, the weight's
    ``dy [k, m]ᵀ @ x [k, n]``. (Each layout is its own cuBLAS kernel: timing the backward's GEMMs as
    ``F.linear`` measured another one.)"""
    m, n, k = shape
    if layout == "linear":
        return _rand((m, k), nsets, device, dtype), _rand((n, k), nsets, device, dtype), F.linear
    if layout == "dgrad":
        return _rand((m, k), nsets, device, dtype), _rand((k, n), nsets, device, dtype), torch.mm
    return _rand((k, m), nsets, device, dtype), _rand((k, n), nsets, device, dtype), lambda a, b: torch.mm(a.t(), b)


def measure_case(case: Case, backends: List[str], dtype: torch.dtype, device: torch.device, group,
                 timer: Timer, num_chunks: Optional[int]) -> dict:
    """Every timing of one case on this rank (all ranks call it together); seconds."""
    p = coll.group_size(group)
    esize = dtype.itemsize
    gemms = _gemms(case, p)
    colls = _collectives(case, p)
    per_set = esize * sum(a * c + b * c + a * b for (a, b, c), _ in gemms)
    nsets = buffer_sets(per_set, device.type == "cuda")
    calls = [_gemm_call(shape, layout, nsets, device, dtype) for shape, layout in gemms]

    def run_gemms(i):
        for a, b, call in calls:
            call(a[i % nsets], b[i % nsets])

    out = {"gemm": {}, "comm": {}, "backend": {}}
    whole = {}
    for (shape, _), (av, bv, call) in zip(gemms, calls):
        whole.setdefault(shape, []).append(timer(lambda i: call(av[i % nsets], bv[i % nsets])))
    out["gemm_total"] = sum(sum(ts) for ts in whole.values())
    # by shape, as the model reads them: a shape two GEMMs share (the input and weight gradients of a
    # row layer at m = n, of a column layer at m = n/p), the mean of their times, so that the model's
    # two reads add up to theirs
    out["gemm"] = {shape: sum(ts) / len(ts) for shape, ts in whole.items()}
    # the chunk GEMMs of the schedules the model predicts, each on rows of the whole GEMM's operands,
    # in its layout (the model then reads each one rather than scaling another). A schedule splits
    # the forward's GEMM or the input gradient's, never the weight gradient's: where the latter's
    # (n, k) is one of theirs too (as above), theirs is the layout
    split = {}
    for j, ((_, n, k), layout) in enumerate(gemms):
        if layout != "wgrad":
            split.setdefault((n, k), j)
    for shape in sorted(model_gemms(case, p, num_chunks) - set(out["gemm"])):
        rows, n, k = shape
        j = split.get((n, k))
        if j is None or rows > gemms[j][0][0]:
            raise RuntimeError(f"{case.label()}: the model reads a GEMM {shape} that is no rows of the case's "
                               f"GEMMs {gemms}")
        av, bv, call = calls[j]
        av = [t[:rows] for t in av]
        out["gemm"][shape] = timer(lambda i: call(av[i % nsets], bv[i % nsets]))

    comm_bufs = [(kind, _rand(shape, 2, device, dtype)) for kind, shape, _ in colls]
    samples: List[Tuple[str, int, float]] = []
    out["comm_total"] = 0.0
    if p > 1:
        for kind, bufs in comm_bufs:
            t = timer(lambda i: _start(kind, bufs[i % 2], group).wait())
            nbytes = bufs[0].numel() * esize * (p if kind == "all_gather" else 1)
            samples.append((kind, nbytes, t))
            out["comm_total"] += t
        # a second size per kind, to fit the model's link; and the ring's own send/recv step
        for kind, bufs in {kind: bufs for kind, bufs in comm_bufs}.items():
            rows = bufs[0].shape[0] // 4
            if kind == "reduce_scatter":  # keep dim 0 divisible by p
                rows = rows // p * p
            if rows < 1:
                continue
            quarter = [b[:rows] for b in bufs]
            t = timer(lambda i: _start(kind, quarter[i % 2], group).wait())
            samples.append((kind, quarter[0].numel() * esize * (p if kind == "all_gather" else 1), t))
            if kind == "all_gather":
                # the pipelined ring moves shards by send/recv, not by the all-gather collective
                for bufs_ in (bufs, quarter):
                    recv = [torch.empty_like(b) for b in bufs_]
                    t = timer(lambda i: _ring(bufs_[i % 2], recv[i % 2], group))
                    samples.append(("ring_step", bufs_[0].numel() * esize, t))

        def start_all(i):
            return [_start(kind, bufs[i % 2], group) for kind, bufs in comm_bufs]

        def finish_all(pending):
            for work in pending:
                work.wait()

        out["gemm_under_comm"] = timer(run_gemms, pre=start_all, post=finish_all)
    else:
        out["gemm_under_comm"] = out["gemm_total"]
    out["comm_samples"] = samples

    out["resolved"] = {}
    probe = torch.empty(case.local(p)[0], device=device, dtype=dtype)
    op = case.target if not case.is_layer else (
        "all_gather_matmul" if case.kind == "column" and case.sequence_parallel else
        "matmul_reduce_scatter" if case.sequence_parallel else "matmul_all_reduce")
    for backend in backends:
        before = len(autotune.decisions())
        out["backend"][backend] = _time_backend(case, backend, dtype, device, group, timer, num_chunks, nsets)
        out["resolved"][backend] = _resolved(op, backend, probe, p, group, num_chunks, autotune.decisions()[before:])
    return out


def _resolved(op: str, backend: str, probe: torch.Tensor, p: int, group, num_chunks: Optional[int], made) -> str:
    """What ran for ``backend`` (asked for ``num_chunks``): for a measured ``"auto"``, the
    implementations it chose during the timing (``"<choice> (measured)"``), else the decision's
    answer."""
    if backend == "auto" and len(dispatch.candidates(probe, probe, group, p)[0]) > 1:
        chosen = sorted({d.choice for d in made})
        return f"{'+'.join(chosen)} (measured)" if chosen else "measured before"
    return dispatch.select_backend(op, backend, probe, p, group, num_chunks=num_chunks)


def _time_backend(case, backend, dtype, device, group, timer, num_chunks, nsets) -> float:
    p = coll.group_size(group)
    (xm, xk), _ = case.local(p)
    if not case.is_layer:
        _, wshape = case.local(p)
        xs = _rand((xm, xk), nsets, device, dtype)
        ws = _rand(wshape, nsets, device, dtype)
        fn = getattr(ops, case.target)
        return timer(lambda i: fn(xs[i % nsets], ws[i % nsets], group=group, backend=backend, num_chunks=num_chunks))
    cls = ColumnParallelLinear if case.kind == "column" else RowParallelLinear
    torch.manual_seed(0)
    layer = cls(case.k, case.n, sequence_parallel=case.sequence_parallel, backend=backend, device=device,
                dtype=dtype, num_chunks=num_chunks, group=group)
    xs = [x.requires_grad_() for x in _rand((xm, xk), nsets, device, dtype)]
    dy = torch.randn_like(layer(xs[0]))

    def step(i):
        x = xs[i % nsets]
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(dy)

    return timer(step)


def run_rank(config: dict) -> Optional[dict]:
    """Measure every case of ``config`` on this rank; rank 0 returns the measurements."""
    group = dist.group.WORLD if dist.is_initialized() else None
    rank = coll.group_rank(group)
    cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timer = Timer(config["iters"], config["warmup"], cuda, group, hold=HOLD)  # GPU time: the host's apart
    cases = [Case(**c) for c in config["cases"]]
    total = len(cases) * len(config["dtypes"])
    start = time.monotonic()
    result = {"peak_tflops": {}, "cases": []}
    done = 0
    for dtype_name in config["dtypes"]:
        dtype = getattr(torch, dtype_name)
        if cases:
            result["peak_tflops"][dtype_name] = measure_peak(dtype, device, timer)
        for case in cases:
            if rank == 0 and config.get("progress", True):
                _progress(done, total, start, f"{case.label()} {dtype_name}")
            torch.manual_seed(1234 + done)
            m = measure_case(case, config["backends"], dtype, device, group, timer, config["num_chunks"])
            m["gemm"] = [[list(k), v] for k, v in m["gemm"].items()]
            result["cases"].append({"case": dataclasses.asdict(case), "dtype": dtype_name, **m})
            done += 1
    if config.get("one_gpu"):
        if rank == 0 and config.get("progress", True):
            _progress(done, total, start, "one-GPU figures: per-rank costs, the fused path on virtual ranks, "
                                          "the projection's GEMMs")
        result["one_gpu"] = one_gpu.measure(config["iters"])
    if config.get("communicator"):
        if rank == 0 and config.get("progress", True):
            _progress(done, total, start, "communicator sweep")
        result["communicator"] = communicator.sweep(getattr(torch, config["dtypes"][0]), device, group, timer,
                                                    quick=config.get("quick", False))
    if cuda:
        result["hold"] = HOLD.summary()  # (this rank's)
    if rank == 0 and config.get("progress", True):
        _progress(done, total, start, "done", end=True)
    return result if rank == 0 else None


def _progress(done: int, total: int, start: float, what: str, end: bool = False) -> None:
    elapsed = time.monotonic() - start
    eta = f", ~{elapsed / done * (total - done):.0f} s left" if done else ""
    line = f"[{done}/{total}] {elapsed:.0f} s{eta}: {what}"
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + line + ("\n" if end else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()
