"""What the native extension costs on one GPU, against plain PyTorch.

``python -m tp_kernels.bench.extension [--out-dir DIR] [--tag TAG]`` measures, and writes as
``extension-<device>[-<tag>].json`` (device, commit, date, figures, the targets they are read
against):

1. **GEMM throughput**: the native cuBLASLt GEMM against ``torch.nn.functional.linear`` at
   M = N = K = 8192, bf16 (target: ≥ 0.99×), with what cuBLASLt's heuristic chose for it
   (``"native_plans"``: :func:`cublaslt_plans`, its tile and its waves count) and its other
   proposals timed (``"native_candidates"``: :func:`gemm_candidates`).
2. **Host overhead per call** at a decode size (m = 16, k = 3584, n = 8192: the Llama-3-70B TP8
   row-parallel GEMM): the host time to issue one call (the GPU is never waited for inside the
   timed loop) of ``F.linear``, the native GEMM and ``tp_kernels.matmul_all_reduce`` on the
   ``pipelined``, ``fused`` and ``auto`` backends (one rank: the whole Python path, custom op
   included, then the GEMM), with the functions each call's host time goes to (``"profile"``:
   :func:`tp_kernels.bench.host.profiled`); each figure the fastest of ``--iters`` samples of 200
   calls, the calls timed in turns (:func:`tp_kernels.bench.host.host_times_us`; the medians are
   in the record too); and the GPU time per call when the same calls are replayed from a CUDA
   graph (target: at most 5 µs added eagerly, nothing added under replay).
3. **Chunking cost** at the Llama-3-70B TP8 shapes (m = 8192; column: k = 8192, n = 28672/8;
   row: k = 28672/8, n = 8192): the GEMM split as the schedules split it (4 row chunks; the
   reduce-scatter's 4 batched chunks over 8 destination blocks; the all-gather ring's 8 shards)
   against the unsplit GEMM (target for 4 chunks: ≥ 0.97× its TFLOP/s), and the 4 row chunks and
   the 8 shards alternating between two streams (``..._two_streams``: whether one GEMM's last
   wave beside the next one's first wins back the split's cost); the native
   ``matmul_all_reduce`` primitive itself on a one-rank NCCL communicator, in 4 chunks, its
   GEMMs on one stream and on two (``native_matmul_all_reduce_4_chunks[_two_streams]``:
   :func:`tp_kernels.settings.set_gemm_streams`; the chunks' all-reduces there move nothing, so
   what it adds to the GEMMs is the schedule's events and NCCL's launches); and the unsplit
   native GEMM against ``F.linear`` at those shapes (target ≥ 0.99×). ``"plans"``: what cuBLASLt
   chose for the unsplit GEMM and for each split's (:func:`cublaslt_plans`): the waves count
   says how full a GEMM's last wave of tiles is, the account of what splitting costs;
   ``"candidates"``: the unsplit GEMM and a row chunk by the native GEMM's algorithm and by the
   heuristic's other proposals (:data:`CANDIDATES` in all, :func:`gemm_candidates`): whether
   another algorithm would win the split's cost back; ``"tuned"``: the unsplit GEMM, the 4 row
   chunks and the native primitive again with the native GEMM's plans tuned, each the fastest of
   those proposals (:func:`tuned_chunking`, :func:`tp_kernels.settings.set_gemm_tuning`).
4. **Decode GEMMs**: the native GEMM against ``F.linear`` at m = 16 of those shapes, forward and
   the backward's dgrad (the weight transposed), replayed from a CUDA graph: the GEMMs' own time,
   without the host's launch (target ≥ 0.99×), each with cuBLASLt's plan (its split-K among it).

The targets are :data:`tp_kernels.bench.targets.TARGETS`.

GPU times come from CUDA events, the median of ``--iters`` samples after warm-up, the samples of
the figures one ratio compares taken in turns (:func:`in_turns`), the stream held until each
sample is enqueued (:class:`tp_kernels._timing.Hold`: the GPU's time, not the host's;
``"hold"`` in the record counts the samples whose host outlasted it). Needs a CUDA device and the
built extension; exits with status 2 and says why otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from .. import _extension, ops, settings
from .._timing import HOLD, gpu_events, synchronize, turns, wait_event
from ..schedule import boundaries, chunk_bounds
from .host import host_times_us, profiled
from .records import default_out_dir, gpu_record, save_record
from .targets import TARGETS

LLAMA70B_TP8 = {"column": (8192, 8192, 28672 // 8), "row": (8192, 28672 // 8, 8192)}  # (m, k, n)


def in_turns(samplers: Dict[str, Callable[[bool], float]], iters: int, warmup: int = 3) -> Dict[str, float]:
    """The median of ``iters`` samples of each of ``samplers`` (``sample(timed) -> ms``; ``timed``
    False for the ``warmup`` rounds first), the samples taken in turns, one of each a round, the
    order rotated each round: what drifts over a run (the card's clock as it warms, its power
    limit) falls on every figure alike, so that their ratios are the calls', where figures taken
    one after the other differed by the moment (the same cuBLASLt kernel 1.42 ms in one run and
    1.57 in the next, beside an ``F.linear`` of 1.47 and 1.46 taken before it)."""
    names = list(samplers)
    samples = {name: [] for name in names}
    for i, j in turns(len(names), warmup + iters):
        ms = samplers[names[j]](i >= warmup)
        if i >= warmup:
            samples[names[j]].append(ms)
    return {name: statistics.median(s) for name, s in samples.items()}


def event_sampler(fn: Callable[[], object], what: str) -> Callable[[bool], float]:
    """A sampler of :func:`in_turns`: the GPU time of one call of ``fn``, CUDA events around it,
    the stream held until the call is enqueued (:data:`tp_kernels._timing.HOLD`), so that the
    host's time to make it is not in it; waited for within the timeout (the error names ``what``)."""
    def sample(timed: bool) -> float:
        start, end, _ = gpu_events(fn, HOLD, timed=timed)
        wait_event(end, what)
        return start.elapsed_time(end)

    return sample


def gpu_times_ms(fns: Dict[str, Callable[[], object]], iters: int, warmup: int = 3) -> Dict[str, float]:
    """Median GPU time of each of ``fns`` (:func:`event_sampler`), their samples in turns
    (:func:`in_turns`): the figures of one comparison."""
    return in_turns({name: event_sampler(fn, f"gpu_times_ms: a sample of {name}") for name, fn in fns.items()},
                    iters, warmup)


def gpu_time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median GPU time of ``fn`` alone (:func:`gpu_times_ms` of one)."""
    return gpu_times_ms({"the call": fn}, iters, warmup)["the call"]


def graph_times_us(fns: Dict[str, Callable[[], object]], calls: int, iters: int) -> Dict[str, float]:
    """GPU time per call of each of ``fns`` replayed from a CUDA graph of ``calls`` calls of it,
    the graphs' replays timed in turns (:func:`gpu_times_ms`)."""
    graphs = {}
    for name, fn in fns.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # plans, workspaces and communicators exist before the capture
        torch.cuda.current_stream().wait_stream(side)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for _ in range(calls):
                fn()
    times = gpu_times_ms({name: graph.replay for name, graph in graphs.items()}, iters)
    return {name: ms * 1e3 / calls for name, ms in times.items()}


def graph_time_us(fn: Callable[[], object], calls: int, iters: int) -> float:
    """GPU time per call of ``fn`` replayed from a CUDA graph of ``calls`` calls."""
    return graph_times_us({"the call": fn}, calls, iters)["the call"]


def tflops(m: int, k: int, n: int, ms: float) -> float:
    return 2.0 * m * k * n / (ms * 1e-3) / 1e12


#: The fields of a cuBLASLt algorithm's configuration (``_C.gemm_plans`` and ``_C.gemm_candidates``
#: report each, -1 where cuBLASLt reports none) that together name the algorithm.
ALGO_FIELDS = ("algo_id", "tile_id", "stages_id", "splitk", "reduction_scheme", "swizzle", "custom_option",
               "inner_shape_id", "cluster_shape_id")

#: What a record keeps of each of cuBLASLt's plans (``_C.gemm_plans``): the problem and what the
#: heuristic chose for it, its ``waves`` (1.0: every multiprocessor busy once; 1.7: a second wave
#: 70 % full) first; then what its making timed where tuning was on (:func:`tuned_chunking`).
PLAN_FIELDS = ("m", "n", "k", "batch", "waves") + ALGO_FIELDS + (
    "tuning_timed", "tuning_first_ms", "tuning_chosen_ms", "tuning_note")


def cublaslt_plans(m: int, n: int, k: int, batch: int = 1, w_col_major: bool = False, dtype: str = "bfloat16",
                   plans=None) -> List[dict]:
    """What cuBLASLt's heuristic chose for the native GEMMs ``[m, k] × [n, k]ᵀ`` (``batch`` of
    them; ``w_col_major``: the weight a transposed view, as a backward's dgrad passes it) that this
    process ran: :data:`PLAN_FIELDS` of each plan of that problem (``plans``: ``_C.gemm_plans()``'s
    list, read when None; several where the calls differed in leading dims, bias or alignment), so
    that a record says which tiles a GEMM ran and how full its last wave was."""
    plans = _extension.require().gemm_plans() if plans is None else plans
    problem = (m, n, k, batch, w_col_major, dtype)
    return [{f: q[f] for f in PLAN_FIELDS} for q in plans
            if (q["m"], q["n"], q["k"], q["batch"], q["w_col_major"], q["dtype"]) == problem]


#: How many of the algorithms cuBLASLt's heuristic proposes for a problem section 1 times, the
#: native GEMM's among them (:func:`gemm_candidates`).
CANDIDATES = 8


def gemm_candidates(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, iters: int,
                    count: int = CANDIDATES) -> Dict:
    """The algorithm the native GEMM runs for ``out = x wᵀ`` (its plan's, cuBLASLt's heuristic's
    first) and the heuristic's other proposals, ``count`` in all at most, each timed
    (``_C.gemm_candidates``: the mean of ``iters`` runs back to back after one, between two CUDA
    events, each algorithm's waited for within :func:`tp_kernels.settings.get_timeout`):
    ``{"candidates": [..., each with its "waves", :data:`ALGO_FIELDS` and "ms"],
    "first_over_fastest": the first's time over the fastest's}``: how much faster than the
    heuristic's choice another of its proposals runs this problem (1.0: none)."""
    C = _extension.require()
    found = _extension.call(C.gemm_candidates, x=x, weight=w, bias=None, out=out,
                            stream=_extension.current_stream(x.get_device()), count=count, iters=iters,
                            timeout_s=settings.get_timeout())
    keep = ("waves",) + ALGO_FIELDS + ("ms",)
    candidates = [{f: c[f] for f in keep} for c in found]
    ran = [c["ms"] for c in candidates if c["ms"] > 0]
    first = candidates[0]["ms"] if candidates else -1.0
    return {"candidates": candidates, "first_over_fastest": first / min(ran) if first > 0 and ran else None}


def gemm_throughput(iters: int) -> Dict:
    m = k = n = 8192
    x, w = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (n, k)))
    times = gpu_times_ms({"f_linear": lambda: F.linear(x, w), "native": lambda: _extension.linear(x, w)}, iters)
    t_torch, t_native = times["f_linear"], times["native"]
    return {"shape": [m, k, n], "dtype": "bfloat16", "f_linear_ms": t_torch, "native_ms": t_native,
            "f_linear_tflops": tflops(m, k, n, t_torch), "native_tflops": tflops(m, k, n, t_native),
            "ratio": t_torch / t_native, "native_plans": cublaslt_plans(m, n, k),
            "native_candidates": gemm_candidates(x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), iters),
            "target": TARGETS["native_gemm_vs_f_linear"][0]}


def decode_gemms(iters: int, m: int = 16) -> Dict:
    """The native GEMM against ``F.linear`` at a decode size (m rows) of the Llama-3-70B TP8
    shapes: the forward (``x [m, k]`` by the weight ``[n, k]`` as a layer holds it) and the
    backward's dgrad (``dy [m, n]`` by the same weight transposed, the view the backward passes):
    ``{shape: {"forward"|"dgrad": {"f_linear_ms", "native_ms", "ratio", "eager_..."}}}`` (ratio:
    F.linear's time over the native one's, target as :func:`gemm_throughput`'s). The GEMMs' own
    time, replayed from a CUDA graph of 20 calls; each call alone, eagerly, is in the record too
    (``"eager_f_linear_ms"``, ``"eager_native_ms"``, ``"eager_ratio"``: :func:`gpu_time_ms`, the
    stream held while the host launches it; records before that hold timed the host's launch as
    well, which :func:`host_overhead` measures apart, docs/benchmarks.md)."""
    out = {}
    for name, (_, k, n) in LLAMA70B_TP8.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        entry = {}
        for label, a, b in (("forward", x, w), ("dgrad", dy, w.t())):
            pair = {"f_linear": lambda: F.linear(a, b), "native": lambda: _extension.linear(a, b)}
            replayed, eager = graph_times_us(pair, 20, iters), gpu_times_ms(pair, iters)
            t_torch, t_native = replayed["f_linear"] / 1e3, replayed["native"] / 1e3
            eager_torch, eager_native = eager["f_linear"], eager["native"]
            entry[label] = {"f_linear_ms": t_torch, "native_ms": t_native, "ratio": t_torch / t_native,
                            "eager_f_linear_ms": eager_torch, "eager_native_ms": eager_native,
                            "eager_ratio": eager_torch / eager_native,
                            "native_plans": cublaslt_plans(m, b.shape[0], b.shape[1], w_col_major=label == "dgrad")}
        out[name] = {"m": m, "k": k, "n": n, "dtype": "bfloat16", **entry}
    out["target"] = TARGETS["native_gemm_vs_f_linear"][0]
    return out


def host_overhead(iters: int) -> Dict:
    m, k, n = 16, 28672 // 8, 8192
    x, w = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (n, k)))
    calls = {
        "f_linear": lambda: F.linear(x, w),
        "native_linear": lambda: _extension.linear(x, w),
        **{f"matmul_all_reduce_{b}": (lambda b=b: ops.matmul_all_reduce(x, w, backend=b))
           for b in ("pipelined", "fused", "auto")},
    }
    times = host_times_us(calls, iters, cuda=True)  # the fastest sample: what disturbs a host only adds
    host = {name: t["min_us"] for name, t in times.items()}
    graph = graph_times_us(calls, 20, iters)
    return {"shape": [m, k, n], "dtype": "bfloat16", "eager_host_us": host,
            "eager_host_median_us": {name: t["median_us"] for name, t in times.items()}, "graph_gpu_us": graph,
            # where each call's host time goes (tp_kernels.bench.host.profiled)
            "profile": {name: profiled(fn, 200, True) for name, fn in calls.items() if name != "f_linear"},
            "added_eager_us": {name: host[name] - host["f_linear"] for name in host},
            "added_graph_us": {name: graph[name] - graph["f_linear"] for name in graph},
            "target_us": TARGETS["host_overhead_us"][0]}


def tuned_chunking(m: int, n: int, k: int, fns: Dict[str, Callable[[], object]], plans: Callable[[], dict],
                   iters: int) -> Dict:
    """``fns`` (``"unsplit"`` and splits of one problem) again with the native GEMM's plans tuned
    (:func:`tp_kernels.settings.set_gemm_tuning`, :data:`CANDIDATES` proposals each): every plan
    dropped and made again under tuning by a first call of each, then their samples in turns;
    each split's ``"vs_unsplit"`` against the tuned unsplit GEMM; ``"plans"``: ``plans()`` then
    (each plan's tuning figures among its fields). The plans are dropped again after, so that what
    follows makes them untuned."""
    C = _extension.require()
    C.forget_gemm_plans()
    try:
        with settings.overriding(gemm_tuning=CANDIDATES):
            for fn in fns.values():
                fn()  # (each problem's plan made, its proposals timed)
            synchronize("chunking: the tuned plans' first calls")
            times = gpu_times_ms(fns, iters)
            made = plans()
    finally:
        C.forget_gemm_plans()
    t_full = times["unsplit"]
    return {"candidates": CANDIDATES, "unsplit_ms": t_full, "plans": made,
            **{label: {"ms": t, "tflops": tflops(m, k, n, t), "vs_unsplit": t_full / t}
               for label, t in times.items() if label != "unsplit"}}


def chunking(iters: int, p: int = 8, chunks: int = 4) -> Dict:
    """Section 3 of the module doc: each split's GEMMs one after the other on the current stream,
    as the schedules run them, and (``..._two_streams``) the row chunks and the ring's shards
    alternating between the current stream and a second one, so that a GEMM's last, partly filled
    wave of tiles may run beside the next GEMM's first (:func:`alternating`): whether that wins
    back what splitting costs."""
    out = {}
    side = torch.cuda.Stream()
    C = _extension.require()
    device = torch.cuda.current_device()
    # the native primitive's schedule at one rank (its communicator made and closed here)
    comm = C.Communicator(C.nccl_unique_id(), 0, 1, device, settings.get_comm_stream_priority(),
                          settings.get_timeout())

    def alternating(gemms) -> None:
        """Each of ``gemms`` (callables, each enqueuing one GEMM on the current stream) on the
        current stream and ``side`` in turn, ``side`` first waiting for the current stream and
        the current stream, last, for ``side``."""
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for j, gemm in enumerate(gemms):
            with torch.cuda.stream(side if j % 2 else main):
                gemm()
        main.wait_stream(side)

    for name, (m, k, n) in LLAMA70B_TP8.items():
        x, w = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (n, k)))
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        mp = m // p
        blocks = x.view(p, mp, k)

        def row_gemms():  # all-reduce's chunks, a GEMM each
            return (lambda a=a, b=b: _extension.linear(x[a:b], w, out=y[a:b]) for a, b in chunk_bounds(m, chunks))

        def ring_gemms():  # all-gather ring: a GEMM per shard
            return (lambda q=q: _extension.linear(x[q * mp:(q + 1) * mp], w, out=y[q * mp:(q + 1) * mp])
                    for q in range(p))

        def one_stream(gemms) -> None:
            for gemm in gemms:
                gemm()

        def rs_split():  # reduce-scatter's chunks: rows [a, b) of every destination block, batched
            for a, b in chunk_bounds(mp, chunks):
                _extension.linear(blocks[:, a:b], w, out=y[p * a:p * b].view(p, b - a, n))

        def native_op(side_stream):  # the primitive (pipelined_native's call) at one rank
            _extension.call(C.matmul_all_reduce, comm, x=x, weight=w, out=y, bounds=boundaries(m, chunks),
                            stream=_extension.current_stream(device), side=side_stream)

        splits = {f"{chunks}_row_chunks": lambda: one_stream(row_gemms()),
                  f"{chunks}_rs_chunks_x{p}": rs_split, f"ring_{p}_shards": lambda: one_stream(ring_gemms()),
                  f"{chunks}_row_chunks_two_streams": lambda: alternating(row_gemms()),
                  f"ring_{p}_shards_two_streams": lambda: alternating(ring_gemms()),
                  f"native_matmul_all_reduce_{chunks}_chunks": lambda: native_op(None),
                  f"native_matmul_all_reduce_{chunks}_chunks_two_streams":
                      lambda: native_op((device, comm.gemm_stream))}
        # every figure of the shape in turns: its ratios to the unsplit GEMM are the same moment's
        times = gpu_times_ms({"unsplit": lambda: _extension.linear(x, w, out=y), "f_linear": lambda: F.linear(x, w),
                              **splits}, iters)
        t_full, t_torch = times["unsplit"], times["f_linear"]
        entry = {"shape": [m, k, n], "dtype": "bfloat16", "unsplit_ms": t_full, "unsplit_tflops": tflops(m, k, n, t_full),
                 "f_linear_ms": t_torch, "native_vs_f_linear": t_torch / t_full}
        for label in splits:
            t = times[label]
            entry[label] = {"ms": t, "tflops": tflops(m, k, n, t), "vs_unsplit": t_full / t}
        # what cuBLASLt ran for each split's GEMMs (the two-stream forms and the primitive run the
        # row chunks' and the shards' problems): the tiles, and how full each GEMM's last wave was
        plans = C.gemm_plans()

        def split(rows: int, batch: int = 1, plans=plans) -> List[dict]:  # chunk_bounds(rows, chunks)'s plans
            sizes = sorted({b - a for a, b in chunk_bounds(rows, chunks)}, reverse=True)
            return [q for size in sizes for q in cublaslt_plans(size, n, k, batch, plans=plans)]

        entry["plans"] = {"unsplit": cublaslt_plans(m, n, k, plans=plans), f"{chunks}_row_chunks": split(m),
                          f"{chunks}_rs_chunks_x{p}": split(mp, p),
                          f"ring_{p}_shards": cublaslt_plans(mp, n, k, plans=plans)}
        # and whether another of the heuristic's proposals runs them faster: the unsplit GEMM and
        # the first row chunk
        rows = chunk_bounds(m, chunks)[0][1]
        entry["candidates"] = {"unsplit": gemm_candidates(x, w, y, iters),
                               f"{chunks}_row_chunks": gemm_candidates(x[:rows], w, y[:rows], iters)}
        entry["tuned"] = tuned_chunking(m, n, k, {"unsplit": lambda: _extension.linear(x, w, out=y),
                                                  f"{chunks}_row_chunks": splits[f"{chunks}_row_chunks"],
                                                  f"native_matmul_all_reduce_{chunks}_chunks":
                                                      splits[f"native_matmul_all_reduce_{chunks}_chunks"]},
                                        lambda: {"unsplit": cublaslt_plans(m, n, k),
                                                 f"{chunks}_row_chunks": split(m, plans=C.gemm_plans())},
                                        iters)
        out[name] = entry
    synchronize("chunking: the last figures")
    comm.close()
    out["target"] = TARGETS["chunk4_vs_unsplit"][0]
    return out


def main(argv=None) -> int:

    ap = argparse.ArgumentParser(prog="python -m tp_kernels.bench.extension", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20, help="timed samples per figure")
    ap.add_argument("--out-dir", default=default_out_dir(), help="default: %(default)s")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    record = gpu_record("tp_kernels.bench.extension")
    if record is None:
        return 2
    for key, fn in (("gemm_throughput", gemm_throughput), ("host_overhead", host_overhead),
                    ("chunking", chunking), ("decode_gemms", decode_gemms)):
        record[key] = fn(args.iters)
        print(f"{key}: {json.dumps(record[key])}", flush=True)
    record["hold"] = HOLD.summary()  # (how many samples' host outlasted the stream's hold)
    save_record(record, args.out_dir, "extension", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
