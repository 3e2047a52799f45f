"""What the main job reports on one GPU, where a single rank has nothing to communicate.

With one rank every backend runs its GEMM alone, so the case table says little. On one GPU the
main job therefore adds three sections, each labelled with what it is:

1. **Per-rank costs, measured on this GPU (p = 1)**: the native GEMM's throughput against
   ``F.linear`` (8192³ and the Llama-3-70B TP8 shapes), the host time a call adds over
   ``F.linear`` at m = 16 eagerly and under CUDA-graph replay (``pipelined``, ``fused``,
   ``auto``), the 4-chunk GEMM against the unsplit one, and, for every op case of the run, each
   backend's time against its GEMMs alone (:func:`per_rank_costs`).
2. **The fused path on virtual ranks, measured on this GPU**: overlap efficiency E and GEMM
   slowdown of the fused ``all_gather_matmul`` and ``matmul_reduce_scatter`` at the 70B TP8
   shapes, the performance model's error on them (:func:`tp_kernels.bench.fused.overlap_model`),
   and the decode all-reduce latency of each algorithm, with 8 virtual ranks on the one GPU (their
   copies go through its memory, not NVLink: the schedule and the kernels, not a node).
3. **Projection for 8 GPUs**: :func:`tp_kernels.perf_model.project_transformer_layer` for one
   Llama-3-70B layer at TP 8 over NVLink 4, with the GEMM times of its every shape measured on this
   GPU in place of the roofline guess (:func:`project`). A model's output, labelled so.

Each figure is read against :data:`tp_kernels.bench.targets.TARGETS`. :func:`measure` runs on the
GPU (in the main job's one rank); :func:`report` and :func:`format_report` only compute and
format, so they are tested on the CPU with made-up measurements.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .. import perf_model
from . import fused
from .host import profile_text
from .targets import TARGETS, meets

__all__ = ["PROJECTED", "applies", "format_report", "measure", "per_rank_costs", "project", "projection_shapes",
           "report"]

#: What section 3 projects: one layer forward+backward with sequence parallelism.
PROJECTED = {"model": "llama3-70b", "tp": 8, "tokens": 8192, "gpu": "h100", "link": "nvlink4",
             "dtype": "bfloat16"}
#: Virtual ranks of section 2.
VIRTUAL_RANKS = 8

GemmKey = Tuple[int, int, int, str]


def applies(where: str, p: int) -> bool:
    """Whether the main job adds these sections: one rank on a GPU."""
    return where == "cuda" and p == 1


def projection_shapes() -> List[GemmKey]:
    """Every GEMM ``(m, n, k, dtype)`` the projection of section 3 asks for (its task graphs' GEMMs,
    each rank's share), so that exactly those are measured."""
    recorder = _ShapeRecorder()
    _projection(recorder)
    return sorted(set(recorder.asked))


class _ShapeRecorder:
    """A GEMM timer for the performance model that only notes the shapes it is asked for."""

    def __init__(self):
        self.asked: List[GemmKey] = []

    def __call__(self, m: int, n: int, k: int, dtype: str) -> float:
        self.asked.append((m, n, k, dtype))
        return 1e-3

    def describe(self) -> str:
        return "shapes only"


def _projection(gemm) -> dict:
    gpu = perf_model.GPUS[PROJECTED["gpu"]]
    return perf_model.project_transformer_layer(
        perf_model.MODELS[PROJECTED["model"]], PROJECTED["tp"], PROJECTED["tokens"], PROJECTED["tokens"], gpu,
        perf_model.LINKS[PROJECTED["link"]], PROJECTED["dtype"], gemm)


def project(gemm_times: Dict[GemmKey, float], device: str) -> dict:
    """Section 3: the projection with the GEMM times measured on ``device`` (seconds by shape), the
    roofline of the projected GPU for any shape not measured."""
    gpu = perf_model.GPUS[PROJECTED["gpu"]]
    gemm = perf_model.MeasuredGemm(gemm_times, fallback=perf_model.RooflineGemm(gpu),
                                   source=f"measured on {device}")
    proj = _projection(gemm)
    proj["label"] = (f"PROJECTION for {PROJECTED['tp']} GPUs (model output, not a measurement): GEMM times "
                     f"measured on {device}, collectives from the {PROJECTED['link']} link model")
    return proj


def per_rank_costs(rows: List[dict]) -> List[dict]:
    """Section 1's per-case part: for each op case of the run (layers left out), each backend's
    median against the case's GEMMs alone: ``added_us`` per call and ``vs_gemm`` (GEMM time /
    the backend's)."""
    out = []
    for r in rows:
        if r["target"] not in perf_model.OP_COLLECTIVE or r["p"] != 1:
            continue
        out.append({"target": r["target"], "m": r["m"], "in": r["in"], "out": r["out"], "dtype": r["dtype"],
                    "backend": r["backend"], "resolved": r["resolved"], "gemm_us": r["gemm_ms"] * 1e3,
                    "median_us": r["median_ms"] * 1e3, "added_us": (r["median_ms"] - r["gemm_ms"]) * 1e3,
                    "vs_gemm": r["gemm_ms"] / r["median_ms"] if r["median_ms"] else None})
    return out


def measure(iters: int) -> dict:
    """Sections 1 and 2's figures and section 3's GEMM times, on this GPU (one rank; the main job
    runs it). The fused path's figures need the native extension; without it they say why."""
    import torch
    import torch.nn.functional as F

    from .. import _extension
    from . import extension
    from .extension import gpu_time_ms

    out: Dict[str, object] = {}
    times = []
    for m, n, k, dtype in projection_shapes():
        x = torch.randn(m, k, device="cuda", dtype=getattr(torch, dtype))
        w = torch.randn(n, k, device="cuda", dtype=getattr(torch, dtype))
        times.append([m, n, k, dtype, gpu_time_ms(lambda: F.linear(x, w), iters) * 1e-3])
    out["projection_gemm_s"] = times
    reason = _extension.unavailable()
    if reason is not None:
        out["extension"] = out["fused"] = {"skipped": reason}
        return out
    out["extension"] = {"gemm_throughput": extension.gemm_throughput(iters),
                        "host_overhead": extension.host_overhead(iters), "chunking": extension.chunking(iters),
                        "decode_gemms": extension.decode_gemms(iters)}
    out["fused"] = {"overlap": {op: fused.overlap(op, VIRTUAL_RANKS, iters) for op in fused.LLAMA70B_TP8},
                    "all_reduce_latency": fused.all_reduce_latency([VIRTUAL_RANKS], iters, verbose=False)}
    return out


#: the figures of a decode row that measure the all-reduce alone, the first a row has read first
#: (tp_kernels.bench.fused: each rank's calls chained on its stream and each call one launch a
#: rank, else chained by phases, else each call forked and joined), graph-replayed
DECODE_FIGURES = (("all_reduce_one_launch_us", "alone, chained, one launch a rank, graph-replayed"),
                  ("all_reduce_chained_us", "alone, chained, graph-replayed"),
                  ("all_reduce_graph_us", "alone, graph-replayed"))


def _times_us(times: dict) -> str:
    """{algorithm: us, or the error that stopped its figure} as a report shows it."""
    return ", ".join(f"{a} {us:.1f}" if isinstance(us, (int, float)) else f"{a} ({us})" for a, us in times.items())


def _decode_all_reduce_us(latency: List[dict]) -> Optional[dict]:
    """The decode all-reduce's latency over the rows of at most 64 KiB, its best algorithm's: the
    first of :data:`DECODE_FIGURES` the row has, else its part of ``matmul_all_reduce`` (that op's
    time minus the GEMMs alone, eager: the host's launches in it); ``{"us", "algorithm", "m",
    "bytes", "how"}`` of the worst such row."""
    worst = None
    for row in latency:
        if row["bytes"] > 64 * 1024:
            continue
        how = "op minus GEMMs, eager"
        for key, label in DECODE_FIGURES:
            times = {a: us for a, us in row.get(key, {}).items() if isinstance(us, (int, float))}
            if times:
                how = label
                break
        else:
            times = {a: (ms - row["gemms_ms"]) * 1e3 for a, ms in row["algorithms_ms"].items()}
        if not times:
            continue
        best = min(times, key=times.get)
        if worst is None or times[best] > worst["us"]:
            worst = {"us": times[best], "algorithm": best, "m": row["m"], "bytes": row["bytes"], "how": how}
    return worst


def _cublaslt(entry: dict, split: str = "4_row_chunks") -> str:
    """What a chunking figure's record says of cuBLASLt (not in older records), as its report line
    ends with it ("" where it says nothing): the waves count of each plan of ``split``'s GEMMs and
    of the unsplit one (``"plans"``: the fraction past a whole number, the last wave's fill), and how
    much faster the fastest of the heuristic's proposals ran a chunk and the unsplit GEMM than its
    first, the one the native GEMM runs (``"candidates"``)."""
    notes = []
    plans = entry.get("plans") or {}
    if plans.get(split) and plans.get("unsplit"):
        chunk, whole = ("/".join(f"{q['waves']:.2f}" for q in plans[key]) for key in (split, "unsplit"))
        notes.append(f"cuBLASLt's waves: {chunk} a chunk, {whole} unsplit")
    ratios = [(entry.get("candidates") or {}).get(key, {}).get("first_over_fastest") for key in (split, "unsplit")]
    if all(r is not None for r in ratios):
        notes.append(f"its fastest proposal {ratios[0]:.2f}x its first a chunk, {ratios[1]:.2f}x unsplit")
    return f" ({'; '.join(notes)})" if notes else ""


def report(measured: dict, rows: List[dict], device: str) -> dict:
    """The three sections from :func:`measure`'s figures and the run's case rows: figures, each
    with its target and whether it meets it, and the projection."""
    checks = []

    def check(name: str, what: str, value):
        checks.append({"target": name, "what": what, "value": value, "bound": TARGETS[name][0],
                       "sense": TARGETS[name][1], "meets": meets(name, value)})

    ext = measured.get("extension", {})
    if "skipped" not in ext and ext:
        faster = (ext["gemm_throughput"].get("native_candidates") or {}).get("first_over_fastest")
        check("native_gemm_vs_f_linear", "native GEMM / F.linear, 8192^3"
              + (f" (cuBLASLt's fastest proposal {faster:.2f}x its first)" if faster is not None else ""),
              ext["gemm_throughput"]["ratio"])
        for name, entry in ext["chunking"].items():
            if isinstance(entry, dict):
                check("native_gemm_vs_f_linear", f"native GEMM / F.linear, 70B TP8 {name}",
                      entry.get("native_vs_f_linear"))
                check("chunk4_vs_unsplit", f"4 row chunks / unsplit, 70B TP8 {name}" + _cublaslt(entry),
                      entry["4_row_chunks"]["vs_unsplit"])
                for label, what in (("4_row_chunks_two_streams", "4 row chunks on two streams"),
                                    ("native_matmul_all_reduce_4_chunks_two_streams",
                                     "native matmul_all_reduce, 1 rank, 4 chunks on two streams")):
                    if label in entry:  # (not in older records)
                        check("chunk4_vs_unsplit", f"{what} / unsplit, 70B TP8 {name}", entry[label]["vs_unsplit"])
                tuned = entry.get("tuned")  # (not in older records)
                if tuned:
                    primitive = "native matmul_all_reduce, 1 rank, 4 chunks"
                    for label, what in (("4_row_chunks", "4 row chunks"),
                                        ("native_matmul_all_reduce_4_chunks", primitive)):
                        check("chunk4_vs_unsplit", f"{what} / unsplit, both tuned (the fastest of cuBLASLt's "
                              f"{tuned['candidates']} proposals each), 70B TP8 {name}", tuned[label]["vs_unsplit"])
        for name, entry in ext.get("decode_gemms", {}).items():  # (not in older records)
            if isinstance(entry, dict):
                for label in ("forward", "dgrad"):
                    check("native_gemm_vs_f_linear", f"native GEMM / F.linear, m = {entry['m']}, 70B TP8 {name} "
                          f"{label}", entry[label]["ratio"])
        for call, us in ext["host_overhead"]["added_eager_us"].items():
            if call.startswith("matmul_all_reduce_"):
                check("host_overhead_us", f"{call.rpartition('_')[2]}: host time added per call, m = 16", us)
        for call, us in ext["host_overhead"]["added_graph_us"].items():
            if call.startswith("matmul_all_reduce_"):
                check("graph_overhead_us", f"{call.rpartition('_')[2]}: GPU time added per replayed call", us)
    fused_fig = measured.get("fused", {})
    if "skipped" not in fused_fig and fused_fig:
        for op, o in fused_fig["overlap"].items():
            check("overlap_efficiency", f"fused {op}, {o['p']} virtual ranks", o["overlap_efficiency"])
            check("gemm_slowdown", f"fused {op}, GEMMs beside the copies", o["gemm_slowdown"])
            check("model_error", f"|performance model / measured - 1|, fused {op}, {o['p']} virtual ranks",
                  abs(fused.overlap_model(op, o)["model_err"]))
        decode = _decode_all_reduce_us(fused_fig["all_reduce_latency"])
        check("decode_all_reduce_us", "decode all-reduce part, <= 64 KiB, best algorithm"
              + (f" ({decode['algorithm']}, m = {decode['m']}, {decode['how']})" if decode else ""),
              decode and decode["us"])
    gemm_times = {(m, n, k, d): t for m, n, k, d, t in measured.get("projection_gemm_s", [])}
    return {"device": device, "checks": checks, "per_rank_costs": per_rank_costs(rows),
            "skipped": {k: v["skipped"] for k, v in measured.items() if isinstance(v, dict) and "skipped" in v},
            "virtual_ranks": VIRTUAL_RANKS, "fused": fused_fig if "skipped" not in fused_fig else None,
            "host_profile": ext.get("host_overhead", {}).get("profile", {}) if "skipped" not in ext else {},
            "projection": project(gemm_times, device) if gemm_times else None}


def _value(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def format_report(rep: dict) -> str:
    """The three sections as text (module doc), every figure with its target."""
    lines = [f"# 1. Per-rank costs, MEASURED on {rep['device']}, p = 1 (nothing to communicate: each backend "
             "runs its GEMM alone)"]
    section1 = [c for c in rep["checks"] if c["target"] in ("native_gemm_vs_f_linear", "host_overhead_us",
                                                               "graph_overhead_us", "chunk4_vs_unsplit")]
    section2 = [c for c in rep["checks"] if c not in section1]
    for c in section1:
        lines.append(_check_line(c))
    for call, rows in rep["host_profile"].items():
        lines.append(f"  {call}, {profile_text(rows)}")
    if "extension" in rep["skipped"]:
        lines.append(f"  (the native extension's figures: not measured, {rep['skipped']['extension']})")
    if rep["per_rank_costs"]:
        lines.append(f"  {'op':<22} {'m':>6} {'backend':<10} {'GEMMs us':>10} {'call us':>10} {'added us':>9} "
                     f"{'GEMM/call':>9}")
        for r in rep["per_rank_costs"]:
            lines.append(f"  {r['target']:<22} {r['m']:>6} {r['backend']:<10} {r['gemm_us']:>10.1f} "
                         f"{r['median_us']:>10.1f} {r['added_us']:>9.1f} {_value(r['vs_gemm']):>9}")
    lines.append(f"# 2. The fused path on {rep['virtual_ranks']} virtual ranks, MEASURED on {rep['device']} (one "
                 "GPU: the copies go through its memory, not NVLink)")
    for c in section2:
        lines.append(_check_line(c))
    if "fused" in rep["skipped"]:
        lines.append(f"  (not measured: {rep['skipped']['fused']})")
    elif rep["fused"]:
        for row in rep["fused"]["all_reduce_latency"]:
            algos = ", ".join(f"{a} {ms * 1e3:.1f}" for a, ms in row["algorithms_ms"].items())
            alone = "".join(f"; the all-reduce {how}: {_times_us(row[key])} us"
                            for key, how in DECODE_FIGURES if row.get(key))
            harness = (f" (the fork and join alone: {row['harness_graph_us']:.1f} us)"
                       if isinstance(row.get("harness_graph_us"), (int, float)) else "")
            lines.append(f"  decode m = {row['m']:>4} ({row['bytes'] // 1024} KiB): GEMMs {row['gemms_ms'] * 1e3:.1f} "
                         f"us; with the all-reduce: {algos} us{alone}{harness}")
    proj = rep["projection"]
    lines.append("# 3. " + (proj["label"] if proj else "PROJECTION: not computed (no GEMM time was measured)"))
    if proj:
        lines.append(f"  one {PROJECTED['model']} layer, forward+backward, sequence parallel, m = "
                     f"{PROJECTED['tokens']}: naive {proj['naive_ms']:.2f} ms, overlapped {proj['overlapped_ms']:.2f}"
                     f" ms, speedup {proj['speedup']:.2f}x (projected)")
        for r in proj["linears"]:
            lines.append(f"  {r['linear']:<6} {r['kind']:<6} GEMM {r['gemm_ms']:.3f} ms, comm {r['comm_ms']:.3f} ms: "
                         f"naive {r['naive_ms']:.3f}, overlapped {r['overlapped_ms']:.3f} ms")
    return "\n".join(lines)


def _check_line(c: dict) -> str:
    verdict = "meets" if c["meets"] else ("NOT MEASURED" if c["value"] is None else "MISSES")
    return (f"  {c['what']}: {_value(c['value'])} (target {c['sense']} {c['bound']:g}) "
            f"{verdict}")
