"""The fused (peer-memory) path on one GPU with virtual ranks: overlap, latency, crossovers.

``python -m tp_kernels.bench.fused [--p 8] [--out-dir DIR] [--tag TAG]`` measures, and writes
as ``fused-<device>[-<tag>].json`` (device, commit, date, figures, the targets they are read
against):

1. **Overlap** of ``all_gather_matmul`` and ``matmul_reduce_scatter`` at the Llama-3-70B TP8
   shapes (m = 8192; column: k = 8192, n = 28672/8; row: k = 28672/8, n = 8192), every rank's
   work on its own streams:

   * ``t_gemm``: every rank's GEMMs as the op splits them, with no data movement;
   * ``t_comm``: every rank's data movement alone (the same copies between ranks' buffers; for
     the reduce-scatter also the reduction of the p partials);
   * ``t_overlap``: the fused op;
   * ``E = (t_gemm + t_comm - t_overlap) / t_comm`` (target >= 0.95), and the GEMM slowdown: the
     GEMMs' time while the copies run beside them over ``t_gemm`` (target <= 3 %;
     :data:`tp_kernels.bench.targets.TARGETS`);
   * ``model_ms``: the performance model's time for the fused op from ``t_gemm``, ``t_comm`` and
     the slowdown, its schedule on the one GPU as the ranks issue it
     (:func:`tp_kernels.perf_model.virtual_overlap_tasks`), and ``model_err``: it over
     ``t_overlap``, minus 1 (target within ±10 %).

2. **Small all-reduce latency** (decode: m in 1, 4, 16, 64, 256; k = 28672/8, n = 8192):
   ``matmul_all_reduce`` with each algorithm at p = 2 and --p, against the GEMMs alone, the
   NCCL all-reduce of the same bytes on a one-rank group and the reference path (GEMM, then that
   all-reduce); and the all-reduce alone (``VirtualRanks.all_reduce`` of ``[m, n]`` partials)
   by each algorithm, replayed from a CUDA graph of :data:`GRAPH_CALLS` calls, so that the
   host's launches (p ranks' kernels from one thread) stay out of its figure (``"all_reduce_graph_us"``:
   microseconds a call, or the error that stopped its capture). Each of those calls forks the
   ranks' streams and joins them again, so the next call starts only when every rank has
   finished: ``"harness_graph_us"`` is that fork and join alone (two one-element kernels a rank,
   as many launches as a one-shot call's), ``"all_reduce_chained_us"`` the all-reduce with each
   rank's :data:`GRAPH_CALLS` calls back to back on its own stream (forked and joined once; each
   call's phases in rounds over the ranks), and ``"all_reduce_one_launch_us"`` the same with each
   rank's call one launch of all its phases, as a rank that is a process of its own runs it (for
   one-shot and two-shot one kernel a call, the ranks' kernels side by side on the GPU): the
   figure read against the decode target. (Records before the kernel's flags became acquire loads
   and release stores also hold ``"all_reduce_one_launch_release_acquire_us"``: that form beside
   the volatile accesses and full fences they ran by default.)

3. **Crossovers**: each all-reduce algorithm over output sizes 16 KiB .. 64 MiB at p = 2 and
   --p, and the thresholds they imply (the fastest algorithm per size): of ``matmul_all_reduce``,
   eager, and of the all-reduce alone replayed from a CUDA graph (``"all_reduce_graph_us"``,
   ``"graph_thresholds"``), whose figures carry no host launches.

Virtual ranks share one GPU: their GEMMs share its SMs and the copies between their buffers go
through its own memory rather than over NVLink, so these figures measure the schedule and the
kernels, not an 8-GPU node (``tp_kernels.perf_model`` projects that). GPU times come from CUDA
events, the median of ``--iters`` samples after warm-up; the four figures of an overlap (the
GEMMs, the copies, the fused op, the GEMMs beside the copies) sampled in turns
(:func:`tp_kernels.bench.extension.in_turns`). Needs a CUDA device and the built extension;
exits with status 2 and says why otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import _extension, perf_model
from .._timing import HOLD, gpu_events, synchronize
from ..backends import fused
from ..testing import VirtualRanks, forked, phase_order
from .extension import LLAMA70B_TP8 as GEMM_SHAPES
from .extension import event_sampler, gpu_time_ms, graph_time_us, in_turns
from .records import default_out_dir, gpu_record, save_record
from .targets import TARGETS

#: The fused ops' shapes (m, k, n): the all-gather's the column layer's GEMM, the reduce-scatter's the row layer's
LLAMA70B_TP8 = {"all_gather_matmul": GEMM_SHAPES["column"], "matmul_reduce_scatter": GEMM_SHAPES["row"]}
ALL_REDUCE_M = (1, 4, 16, 64, 256)  # the decode rows: 16 KiB to 4 MiB at n = 8192 bf16 (m <= 4: <= 64 KiB)
SWEEP_BYTES = tuple(2**e for e in range(14, 27, 2))  # 16 KiB .. 64 MiB
GRAPH_CALLS = 20  # all-reduces a graph replays, for the all-reduce alone's latency
#: the device waits' bound of the virtual ranks whose calls are chained (seconds): a chain that
#: cannot make progress on one GPU costs this, once, instead of tp_kernels' default timeout
CHAINED_TIMEOUT_S = 5.0


def overlap_efficiency(t_gemm: float, t_comm: float, t_overlap: float) -> float:
    """E = (t_gemm + t_comm - t_overlap) / t_comm: the share of the communication hidden."""
    return (t_gemm + t_comm - t_overlap) / t_comm


def overlap_model(op: str, record: Dict) -> Dict[str, float]:
    """What :func:`tp_kernels.perf_model.predict_virtual_overlap` predicts for the fused ``op`` of
    its :func:`overlap` record from the GEMMs alone, the copies alone and the GEMM slowdown
    (``"model_ms"``), and ``"model_err"``: that over the op's measured time, minus 1."""
    model = perf_model.predict_virtual_overlap(op, record["p"], record["t_gemm_ms"], record["t_comm_ms"],
                                               record["gemm_slowdown"])
    return {"model_ms": model, "model_err": model / record["t_overlap_ms"] - 1.0}


def thresholds(sweep: Dict[str, Dict[int, float]]) -> Dict:
    """From {algorithm: {bytes: ms}}: the fastest algorithm per size, and for each algorithm of
    the size thresholds (``fused.MAX_BYTES``) the largest size at which it is still the fastest
    (``"<algorithm>_max_bytes"``; None when it never is)."""
    sizes = sorted(next(iter(sweep.values())))
    best = {b: min(sweep, key=lambda a: sweep[a][b]) for b in sizes}
    last = {f"{a}_max_bytes": max((b for b in sizes if best[b] == a), default=None) for a in fused.MAX_BYTES}
    return {"fastest": {str(b): best[b] for b in sizes}, **last}


def _fork_join(streams: Sequence[torch.cuda.Stream], work: Callable[[int, torch.cuda.Stream], None]) -> None:
    with forked(streams):
        for q, s in enumerate(streams):
            with torch.cuda.stream(s):
                work(q, s)


class FusedCase(NamedTuple):
    """A fused op's call on p virtual ranks, and its GEMMs and its data movement each alone."""

    xs: List[torch.Tensor]  # each rank's input (its block of the rows, for the gather)
    ws: List[torch.Tensor]  # each rank's weight [n, k]
    rows: List[torch.Tensor]  # each rank's GEMM input [m, k] (the gathered rows, or its input)
    outs: List[torch.Tensor]  # each rank's GEMM output [m, n] (its partial sums, for the reduce-scatter)
    moved: List[torch.Tensor]  # what each rank's data movement makes: its gathered rows, or its reduced block
    gemms: Callable[[int, torch.cuda.Stream], None]  # rank q's GEMMs as the op splits them, no data moved
    comms: Callable[[int, torch.cuda.Stream], None]  # rank q's copies between the ranks' buffers (and reduction)
    fused_op: Callable[[], object]  # the fused call of every rank


def fused_case(vr: VirtualRanks, op: str, shape: Optional[Tuple[int, int, int]] = None) -> FusedCase:
    """``op``'s (``all_gather_matmul`` or ``matmul_reduce_scatter``) inputs at its
    :data:`LLAMA70B_TP8` shape (or ``shape``, ``(m, k, n)``) in bf16 on ``vr``'s ranks, on its
    device: what the overlap benchmark times and the timeline traces. ``comms`` moves what the
    fused call moves: for the gather, the other ranks' blocks into a rank's rows; for the
    reduce-scatter, each rank's partial sums of the others' blocks into their inboxes, and the p
    partials of its own block summed (its own and its inbox's; the ranks' ``comms`` unordered
    with each other, as the benchmark runs them side by side: they time the movement, the fused
    call computes the result)."""
    m, k, n = shape or LLAMA70B_TP8[op]
    p, dtype, device = vr.p, torch.bfloat16, vr.device
    mp = m // p
    gathering = op == "all_gather_matmul"
    xs = [torch.randn(mp if gathering else m, k, device=device, dtype=dtype) for _ in range(p)]
    ws = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(p)]
    rows = [torch.cat(xs) for _ in range(p)] if gathering else xs
    outs = [torch.empty(m, n, device=device, dtype=dtype) for _ in range(p)]

    def gemms(q, s):
        for d in range(p):
            _extension.linear(rows[q][d * mp:(d + 1) * mp], ws[q], out=outs[q][d * mp:(d + 1) * mp])

    if gathering:
        moved = rows

        def comms(q, s):
            for d in range(p):
                if d != q:
                    rows[q][d * mp:(d + 1) * mp].copy_(xs[d], non_blocking=True)

        def fused_op():
            return vr.all_gather_matmul(xs, ws)
    else:
        inbox = [torch.empty(p, mp, n, device=device, dtype=dtype) for _ in range(p)]
        moved = [torch.empty(mp, n, device=device, dtype=dtype) for _ in range(p)]

        def comms(q, s):
            for d in range(p):
                if d != q:
                    inbox[d][q].copy_(outs[q][d * mp:(d + 1) * mp], non_blocking=True)
            _extension.reduce_partials([outs[q][q * mp:(q + 1) * mp] if r == q else inbox[q][r] for r in range(p)],
                                       moved[q])

        def fused_op():
            return vr.matmul_reduce_scatter(xs, ws)

    return FusedCase(xs, ws, rows, outs, moved, gemms, comms, fused_op)


def overlap(op: str, p: int, iters: int) -> Dict:
    m, k, n = LLAMA70B_TP8[op]
    gemm_streams = [torch.cuda.Stream() for _ in range(p)]
    copy_streams = [torch.cuda.Stream() for _ in range(p)]
    with VirtualRanks(p) as vr:
        case = fused_case(vr, op)
        gemms, comms, fused_op = case.gemms, case.comms, case.fused_op

        # the GEMMs' own time while the copies run beside them: events on the GEMM streams only (the
        # stream held until all is enqueued, as gpu_time_ms holds it)
        def gemm_under_copies(timed: bool) -> float:
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(p)]

            def region():
                with forked(gemm_streams + copy_streams):
                    for q in range(p):
                        with torch.cuda.stream(copy_streams[q]):
                            comms(q, copy_streams[q])
                        with torch.cuda.stream(gemm_streams[q]):
                            gemms(q, gemm_streams[q])
                            ends[q].record()

            start, _, _ = gpu_events(region, HOLD, timed)
            synchronize("overlap: a sample of the GEMMs under the copies")
            return max(start.elapsed_time(e) for e in ends)

        # the four in turns: E and the slowdown compare them, so the card's drift over the run
        # falls on each alike
        times = in_turns({"gemm": event_sampler(lambda: _fork_join(gemm_streams, gemms), "overlap: the GEMMs"),
                          "comm": event_sampler(lambda: _fork_join(copy_streams, comms), "overlap: the copies"),
                          "overlap": event_sampler(fused_op, "overlap: the fused op"),
                          "gemm_loaded": gemm_under_copies}, iters)
        t_gemm, t_comm, t_overlap, t_gemm_loaded = (times[k] for k in ("gemm", "comm", "overlap", "gemm_loaded"))
    record = {"shape": {"m": m, "k": k, "n": n}, "p": p, "dtype": "bfloat16", "t_gemm_ms": t_gemm,
              "t_comm_ms": t_comm, "t_overlap_ms": t_overlap,
              "overlap_efficiency": overlap_efficiency(t_gemm, t_comm, t_overlap),
              "gemm_slowdown": t_gemm_loaded / t_gemm - 1.0,
              "targets": {name: TARGETS[name][0] for name in ("overlap_efficiency", "gemm_slowdown", "model_error")}}
    return {**record, **overlap_model(op, record)}


def _nccl_one_rank():
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    return dist


def _replayed_us(fn: Callable[[], object], iters: int, calls: int = GRAPH_CALLS):
    """Microseconds a call of ``fn`` replayed from a CUDA graph of ``calls`` calls, or the error
    that stopped it (in the record, so that a figure missing says why)."""
    try:
        return graph_time_us(fn, calls, iters)
    except RuntimeError as exc:
        synchronize("a CUDA graph's capture or replay that failed")
        return f"error: {exc}"


def _chained(vr: VirtualRanks, xs, outs, algorithm: str, calls: int, one_launch: bool = False) -> None:
    """``calls`` all-reduces of ``xs`` into ``outs`` by ``algorithm``, each rank's back to back on
    its own stream, the streams forked from the current one and joined to it once: between two
    calls of a rank nothing waits for the other ranks but its flags. Each call's phases go in
    rounds over the ranks, or, ``one_launch``, each rank's call as one launch of all its phases, as
    a rank that is a process of its own enqueues it (the ranks' kernels then run side by side on
    the GPU, which their grids are sized for: ``device_ops.h``)."""
    with forked(vr.streams):
        for _ in range(calls):
            ranks = [fused.rank_all_reduce(vr.contexts[q], xs[q], outs[q], algorithm, s)
                     for q, s in enumerate(vr.streams)]
            order = [(q, None) for q in range(vr.p)] if one_launch else phase_order([c.phases for c in ranks])
            for q, phase in order:
                ranks[q].enqueue(phase)


def _chained_us(vr: VirtualRanks, xs, algorithm: str, iters: int, one_launch: bool = False):
    """Microseconds a call of :func:`_chained`'s, replayed from a CUDA graph of :data:`GRAPH_CALLS`
    calls a rank (or the error that stopped it)."""
    try:
        vr.all_reduce(xs, algorithm)  # the workspace for these calls, made before the capture
    except RuntimeError as exc:  # (these ranks failed in an earlier figure)
        return f"error: {exc}"
    outs = [torch.empty_like(x) for x in xs]
    us = _replayed_us(lambda: _chained(vr, xs, outs, algorithm, GRAPH_CALLS, one_launch), iters, calls=1)
    return us / GRAPH_CALLS if isinstance(us, float) else us


def _harness_us(p: int, iters: int):
    """Microseconds a call of the fork and join :meth:`VirtualRanks.all_reduce` wraps each call in,
    with two one-element kernels a rank in place of the all-reduce's, replayed as its figure is (or
    the error that stopped it)."""
    streams = [torch.cuda.Stream() for _ in range(p)]
    marks = [torch.zeros(1, device="cuda") for _ in range(p)]
    return _replayed_us(lambda: _fork_join(streams, lambda q, s: (marks[q].zero_(), marks[q].zero_())), iters)


def all_reduce_latency(ps: Sequence[int], iters: int, verbose: bool = True) -> List[Dict]:
    dist = _nccl_one_rank()
    k, n, dtype = 28672 // 8, 8192, torch.bfloat16
    rows = []
    for p in ps:
        harness = _harness_us(p, iters)
        # the chained calls on ranks of their own, and those in one launch a rank on ranks of their
        # own for each algorithm (the copy engine's scatter-gather may not make progress that way
        # on one GPU): a failure there (a timed-out wait fails its ranks for good) leaves the other
        # figures standing
        with VirtualRanks(p) as vr, VirtualRanks(p, timeout_s=CHAINED_TIMEOUT_S) as chained, \
                contextlib.ExitStack() as stack:
            one_launch = {algo: stack.enter_context(VirtualRanks(p, timeout_s=CHAINED_TIMEOUT_S))
                          for algo in fused.algorithms()}
            streams = [torch.cuda.Stream() for _ in range(p)]
            for m in ALL_REDUCE_M:
                xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(p)]
                ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(p)]
                y = torch.randn(m, n, device="cuda", dtype=dtype)
                row = {"p": p, "m": m, "k": k, "n": n, "bytes": m * n * 2,
                       "gemms_ms": gpu_time_ms(lambda: _fork_join(streams, lambda q, s: _extension.linear(xs[q], ws[q])),
                                               iters),
                       "nccl_one_rank_all_reduce_ms": gpu_time_ms(lambda: dist.all_reduce(y), iters),
                       "reference_one_rank_ms": gpu_time_ms(
                           lambda: dist.all_reduce(torch.nn.functional.linear(xs[0], ws[0])), iters)}
                row["algorithms_ms"] = {algo: gpu_time_ms(lambda: vr.matmul_all_reduce(xs, ws, algorithm=algo), iters)
                                        for algo in fused.algorithms() if algo != "scatter_gather" or m >= p}
                partials = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(p)]
                row["all_reduce_graph_us"] = {algo: _replayed_us(lambda: vr.all_reduce(partials, algo), iters)
                                              for algo in fused.algorithms()}
                row["harness_graph_us"] = harness
                row["all_reduce_chained_us"] = {algo: _chained_us(chained, partials, algo, iters)
                                                for algo in fused.algorithms()}
                row["all_reduce_one_launch_us"] = {algo: _chained_us(one_launch[algo], partials, algo, iters, True)
                                                   for algo in fused.algorithms()}
                rows.append(row)
                if verbose:
                    print(f"all-reduce latency: {json.dumps(row)}", flush=True)
    return rows


def crossovers(ps: Sequence[int], iters: int) -> Dict:
    out = {}
    n, k, dtype = 4096, 256, torch.bfloat16  # a small k: the all-reduce dominates
    for p in ps:
        sweep: Dict[str, Dict[int, float]] = {a: {} for a in fused.algorithms()}
        replayed: Dict[str, Dict[int, object]] = {a: {} for a in fused.algorithms()}
        with VirtualRanks(p) as vr:
            for nbytes in SWEEP_BYTES:
                m = max(p, nbytes // (n * 2))
                xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(p)]
                ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(p)]
                partials = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(p)]
                for algo in fused.algorithms():
                    sweep[algo][m * n * 2] = gpu_time_ms(lambda: vr.matmul_all_reduce(xs, ws, algorithm=algo), iters)
                    replayed[algo][m * n * 2] = _replayed_us(lambda: vr.all_reduce(partials, algo), iters)
        measured = all(isinstance(t, float) for s in replayed.values() for t in s.values())
        out[str(p)] = {"n": n, "k": k, "ms": {a: {str(b): t for b, t in s.items()} for a, s in sweep.items()},
                       **thresholds(sweep),
                       "all_reduce_graph_us": {a: {str(b): t for b, t in s.items()} for a, s in replayed.items()},
                       "graph_thresholds": thresholds(replayed) if measured else None}
        print(f"crossovers p={p}: {json.dumps(out[str(p)])}", flush=True)
    return out


def virtual_ranks_args(prog: str, doc: str, argv, p_help: str, iters: bool) -> argparse.Namespace:
    """The arguments of a benchmark on virtual ranks: ``--p`` (2..8), ``--iters`` (with
    ``iters``), ``--out-dir`` and ``--tag``."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=8, help=p_help)
    if iters:
        ap.add_argument("--iters", type=int, default=10, help="timed samples per figure")
    ap.add_argument("--out-dir", default=default_out_dir(), help="default: %(default)s")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if not 2 <= args.p <= 8:
        ap.error(f"--p: expected 2..8, got {args.p}")
    return args


def main(argv=None) -> int:
    args = virtual_ranks_args("python -m tp_kernels.bench.fused", __doc__, argv,
                              "virtual ranks for the overlap figures (2..8)", iters=True)
    record = gpu_record("tp_kernels.bench.fused")
    if record is None:
        return 2
    record["virtual_ranks"] = True
    ps = sorted({2, args.p})
    record["overlap"] = {}
    for op in LLAMA70B_TP8:
        record["overlap"][op] = overlap(op, args.p, args.iters)
        print(f"overlap {op}: {json.dumps(record['overlap'][op])}", flush=True)
    record["all_reduce_latency"] = all_reduce_latency(ps, args.iters)
    record["crossovers"] = crossovers(ps, args.iters)
    record["hold"] = HOLD.summary()  # (how many samples' host outlasted the stream's hold)
    save_record(record, args.out_dir, "fused", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
