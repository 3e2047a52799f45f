"""A fused call's GPU timeline on virtual ranks, from torch.profiler's trace: where the time went.

``python -m tp_kernels.bench.timeline [--p 8] [--out-dir DIR] [--tag TAG]`` runs one warmed-up
call of the fused ``all_gather_matmul`` and ``matmul_reduce_scatter`` at the Llama-3-70B TP8
shapes on p virtual ranks under ``torch.profiler`` (CUDA activities: kernels, copies, memsets,
each with its stream), and writes ``timeline-<device>[-<tag>].json``: per op, the time from the
first GPU activity to the last, the busy time (the union of the intervals) of the GEMMs, of the
copies, of the flag kernels (the waits, ``tpk_wait_flags``, and the writes, ``tpk_set_flags``) and
of the rest, and how much of the copies' busy time ran while a GEMM ran (:func:`summarize`). Where the overlap benchmark says how much of the
communication was hidden (``tp_kernels.bench.fused``), this says why: copies that ran beside the
GEMMs or after them, and the waits between. It also traces one decode all-reduce alone
(``"all_reduce"``: 16 KiB, one-shot, eager) and one of 1 MiB by two-shot
(``"all_reduce_two_shot"``): the all-reduce kernel's own durations (``top``; stage by stage in
``stages``), which the graph-replayed figures of ``tp_kernels.bench.fused`` hold together with the
launches' gaps. And it names the kernels that ``F.linear`` and the native GEMM run for the GEMMs the
main job's section 1 compares (``"gemm_kernels"``, :func:`gemm_kernels`): a cuBLAS kernel's name
spells its tile and cluster, so two timings of one problem that differ say whether they ran the
same kernel.

Each call is traced with its stream held until the host has enqueued all of it
(:func:`traced`; ``"held"``: whether the hold outlasted the enqueue), so that its spans are the
GPU's time, as the fused benchmark's figures are, not stretched by the host's launches between.
Needs a CUDA device and the built extension; exits with status 2 and says why otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import _extension
from .._timing import Hold, gpu_events, synchronize
from ..testing import VirtualRanks
from . import extension
from .fused import LLAMA70B_TP8, _fork_join, fused_case, virtual_ranks_args
from .records import gpu_record, save_record

#: substrings of the GEMM kernels' names (cuBLASLt's Hopper kernels and CUTLASS's), and of the
#: fused path's flag kernels (their waits and their writes: "waits"); every other kernel (the
#: reduction, torch's copies) is "other"
GEMM_KERNELS = ("gemm", "nvjet", "xmma", "cutlass")
WAIT_KERNELS = ("tpk_wait_flags", "tpk_set_flags")
KINDS = ("gemms", "copies", "waits", "other")
#: torch.cuda._sleep's kernel: the stream's hold before a traced call, none of the call's kinds
HOLD_KERNEL = "spin_kernel"
#: The hold before a traced call (seconds): long, as its launches are slower under the profiler,
#: and a trace is one sample.
TRACE_HOLD_S = 0.05


def kind_of(event: dict) -> Optional[str]:
    """The kind of a trace event (chrome-trace format, as ``torch.profiler`` exports it): a GPU
    activity's (``"gemms"``, ``"copies"``, ``"waits"``, ``"other"``), None for anything else (the
    host's events, the stream's hold)."""
    category, name = str(event.get("cat", "")).lower(), str(event.get("name", "")).lower()
    if category == "gpu_memcpy":
        return "copies"
    if category == "gpu_memset":
        return "other"
    if category != "kernel" or HOLD_KERNEL in name:
        return None
    if any(w in name for w in WAIT_KERNELS):
        return "waits"
    return "gemms" if any(g in name for g in GEMM_KERNELS) else "other"


def _merged(intervals: Iterable[Tuple[float, float]]) -> List[List[float]]:
    out: List[List[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _length(merged: Sequence[Sequence[float]]) -> float:
    return sum(end - start for start, end in merged)


def _common(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """The length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: Iterable[dict], top: int = 8) -> Dict:
    """Where a traced call's GPU time went: ``span_us`` (first GPU activity to last), per kind the
    busy time (``busy_us``: the union of its intervals over every stream), the summed durations
    (``kernel_us``) and counts, the copies' busy time that a GEMM ran beside
    (``copies_beside_gemms_us``, and its share of the copies' busy time), and the ``top`` kernels
    and copies by summed duration (name, count, microseconds)."""
    spans: Dict[str, List[Tuple[float, float]]] = {k: [] for k in KINDS}
    streams, by_name = set(), {}
    for event in events:
        kind = kind_of(event) if event.get("ph") == "X" else None
        if kind is None:
            continue
        start, length = float(event["ts"]), float(event.get("dur", 0.0))
        spans[kind].append((start, start + length))
        streams.add(event.get("tid"))
        count, total = by_name.get(event.get("name", ""), (0, 0.0))
        by_name[event.get("name", "")] = (count + 1, total + length)
    every = [interval for intervals in spans.values() for interval in intervals]
    if not every:
        return {"activities": 0}
    merged = {k: _merged(v) for k, v in spans.items()}
    copies = _length(merged["copies"])
    beside = _common(merged["copies"], merged["gemms"])
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"activities": len(every), "streams": len(streams),
            "span_us": max(end for _, end in every) - min(start for start, _ in every),
            "busy_us": {k: _length(v) for k, v in merged.items()},
            "kernel_us": {k: sum(end - start for start, end in v) for k, v in spans.items()},
            "count": {k: len(v) for k, v in spans.items()},
            "copies_beside_gemms_us": beside, "copies_beside_gemms": beside / copies if copies else None,
            "top": [[name[:100], count, total] for name, (count, total) in ranked]}


def launches_by_stage(events: Iterable[dict], prefix: str = "tpk_all_reduce") -> List[Dict]:
    """The durations of the kernels named ``prefix...`` by their place on their stream: entry k
    over the k-th such launch of every stream (a virtual rank's all-reduce launches its stages
    one after another: publishing, summing and, two-shot, gathering), as ``count``, ``min_us``,
    ``median_us``, ``max_us``."""
    per_stream: Dict[object, List[Tuple[float, float]]] = {}
    for event in events:
        if event.get("ph") == "X" and str(event.get("name", "")).startswith(prefix):
            per_stream.setdefault(event.get("tid"), []).append((float(event["ts"]), float(event.get("dur", 0.0))))
    stages: List[List[float]] = []
    for launches in per_stream.values():
        for k, (_, length) in enumerate(sorted(launches)):
            if k == len(stages):
                stages.append([])
            stages[k].append(length)
    return [{"count": len(d), "min_us": min(d), "median_us": sorted(d)[len(d) // 2], "max_us": max(d)}
            for d in stages]


def traced(fn: Callable[[], object]) -> Tuple[List[dict], Optional[bool]]:
    """The chrome-trace events of one call of ``fn`` under ``torch.profiler`` (CUDA activities),
    and on a GPU whether the stream was held until the host had enqueued the whole call
    (:class:`tp_kernels._timing.Hold`, :data:`TRACE_HOLD_S`: the call's GPU activities then run
    without waiting for its launches, so its spans are the GPU's; None on the CPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    hold = None
    if torch.cuda.is_available():
        synchronize("traced: the work before the trace")
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        hold = Hold(TRACE_HOLD_S)
    with torch.profiler.profile(activities=activities) as prof:
        if hold is None:
            fn()
        else:
            gpu_events(fn, hold)
            synchronize("traced: the traced call")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", []), None if hold is None else hold.exposed == 0


def timeline(op: str, p: int) -> Dict:
    """One fused call of ``op`` (``all_gather_matmul`` or ``matmul_reduce_scatter``) at its 70B
    TP8 shape on p virtual ranks, traced and summarized, beside the same GEMMs alone (every rank's
    on its own stream); ``gemm_kernel_inflation``: the GEMM kernels' summed time in the fused call
    over theirs alone, minus 1 (how much the copies beside them slowed them)."""
    m, k, n = LLAMA70B_TP8[op]
    streams = [torch.cuda.Stream() for _ in range(p)]
    with VirtualRanks(p) as vr:
        case = fused_case(vr, op)
        for _ in range(3):  # warm: the workspace, cuBLASLt's plans, the kernels' modules
            case.fused_op()
            _fork_join(streams, case.gemms)
        fused_events, fused_held = traced(case.fused_op)
        alone_events, alone_held = traced(lambda: _fork_join(streams, case.gemms))
        vr.check()
    fused_summary, alone = summarize(fused_events), summarize(alone_events)
    gemm_us = [s.get("kernel_us", {}).get("gemms") for s in (fused_summary, alone)]
    return {"shape": {"m": m, "k": k, "n": n}, "p": p, "dtype": "bfloat16", "fused": fused_summary,
            "gemms_alone": alone, "held": bool(fused_held and alone_held),
            "gemm_kernel_inflation": gemm_us[0] / gemm_us[1] - 1.0 if all(gemm_us) else None}


def all_reduce_timeline(p: int, numel: int = 8192, algorithm: str = "one_shot") -> Dict:
    """One fused all-reduce alone of ``numel`` bf16 elements (8192: a decode row of 16 KiB) by
    ``algorithm`` on p virtual ranks, warmed up, traced and summarized (its kernels' durations in
    ``top``: per rank, a launch of the all-reduce kernel a stage: publishing, summing and, two-shot,
    gathering; ``stages``: those launches' durations stage by stage, :func:`launches_by_stage`)."""
    with VirtualRanks(p) as vr:
        xs = [torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(p)]
        for _ in range(3):  # warm: the workspace, the kernels' module
            vr.all_reduce(xs, algorithm)
        events, held = traced(lambda: vr.all_reduce(xs, algorithm))
        vr.check()
    return {"numel": numel, "bytes": numel * 2, "p": p, "dtype": "bfloat16", "algorithm": algorithm,
            "held": bool(held), "fused": summarize(events), "stages": launches_by_stage(events)}


def kernels_of(events: Iterable[dict]) -> List[list]:
    """The kernels of a traced call, in the order they ran, as ``[name, µs]`` (the stream's hold
    left out, as the copies and memsets are: not kernels)."""
    ran = [e for e in events
           if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel" and kind_of(e) is not None]
    return [[str(e.get("name", ""))[:200], float(e.get("dur", 0.0))] for e in sorted(ran, key=lambda e: e["ts"])]


def gemm_kernels() -> Dict:
    """The kernels ``F.linear`` and the native GEMM (:func:`tp_kernels._extension.linear`) run, bf16,
    for the GEMMs that section 1 of the main job times against each other
    (:mod:`tp_kernels.bench.extension`): 8192³ and the Llama-3-70B TP8 column and row shapes,
    unsplit and as one of their 4 row chunks, each warmed up and traced once: ``{case: {"shape":
    [m, k, n], "f_linear": [[name, µs], ...], "native": [...]}}`` (:func:`kernels_of`)."""
    cases = {"8192^3": (8192, 8192, 8192)}
    for name, (m, k, n) in extension.LLAMA70B_TP8.items():
        cases[name] = (m, k, n)
        cases[f"{name}_chunk_of_4"] = (m // 4, k, n)
    out = {}
    for case, (m, k, n) in cases.items():
        x, w = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (n, k)))
        entry = {"shape": [m, k, n]}
        for label, fn in (("f_linear", lambda: F.linear(x, w)), ("native", lambda: _extension.linear(x, w))):
            fn()  # warm: cuBLAS's plan and kernel module, the native plan and workspace
            entry[label] = kernels_of(traced(fn)[0])
        out[case] = entry
    return out


def main(argv=None) -> int:
    args = virtual_ranks_args("python -m tp_kernels.bench.timeline", __doc__, argv, "virtual ranks (2..8)",
                              iters=False)
    record = gpu_record("tp_kernels.bench.timeline")
    if record is None:
        return 2
    record["virtual_ranks"] = args.p
    record["timelines"] = {}
    for op in LLAMA70B_TP8:
        record["timelines"][op] = timeline(op, args.p)
        print(f"timeline {op}: {json.dumps(record['timelines'][op])}", flush=True)
    record["all_reduce"] = all_reduce_timeline(args.p)
    print(f"timeline all_reduce: {json.dumps(record['all_reduce'])}", flush=True)
    # the two-shot kernel at a size the thresholds give it (1 MiB): its three launches a rank
    record["all_reduce_two_shot"] = all_reduce_timeline(args.p, 2**19, "two_shot")
    print(f"timeline all_reduce_two_shot: {json.dumps(record['all_reduce_two_shot'])}", flush=True)
    save_record(record, args.out_dir, "timeline", args.tag)  # (kept should the step's limit stop what follows)
    record["gemm_kernels"] = gemm_kernels()
    print(f"gemm_kernels: {json.dumps(record['gemm_kernels'])}", flush=True)
    save_record(record, args.out_dir, "timeline", args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
