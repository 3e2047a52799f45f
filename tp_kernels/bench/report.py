"""From measurements to the report: metrics, the model check, table, JSON, CSV and plot.

Per case and backend (times are medians, seconds in, milliseconds out):

* ``tflops``: this rank's GEMM FLOPs / time; ``pct_peak``: against the run's peak, the fastest
  rate it saw: a large square GEMM's (:func:`tp_kernels.bench.measure.measure_peak`), any case's
  GEMMs alone, or any backend's (so never above 100 %);
* ``speedup``: the baseline backend's time / this backend's, measured in the same run;
* ``E = (t_gemm + t_comm - t) / t_comm``: overlap efficiency (1: communication fully hidden,
  0: none hidden; below 0: slower than running one after the other);
* ``gemm_slowdown``: the GEMMs' time while the case's collectives are in flight / alone;
* ``exposed_comm_ms = t - t_gemm``;
* ``model_ms``: what :mod:`tp_kernels.perf_model` predicts for this backend's schedule from
  this run's own GEMM times, one link fitted (least squares, per collective kind) to all of
  this run's collective times, and this case's measured slowdown; ``model_err = model /
  measured - 1``.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from .. import perf_model
from ..backends import parse
from .cases import TARGETS, Case

__all__ = ["CSV_FIELDS", "LEGEND", "compute_rows", "format_hold", "format_table", "model_error_summary", "plot",
           "schedule_of", "to_csv"]

#: The E axis's range: a point outside it is drawn at the nearer end as a labelled triangle.
_E_FLOOR, _E_CEILING = -2.0, 1.5

#: What the table's columns mean, printed under it.
LEGEND = """\
ms: median time per call, the slowest rank's; a layer's is forward+backward. TFLOP/s: this rank's GEMM
FLOPs / ms. %peak: of the fastest rate this run saw (a square GEMM, a case's GEMMs alone, or a backend).
speedup: the baseline backend's ms / this backend's, both measured in this run ({baseline} is the baseline).
E: overlap efficiency (t_gemm + t_comm - ms) / t_comm: 1 = the communication is fully hidden, 0 = nothing
hidden, below 0 = slower than the GEMMs then the collectives one after the other.
slow: the GEMMs' time while the collectives run beside them / alone. exposed: ms - t_gemm, the time the
communication adds. model ms: the performance model's prediction from this run's own GEMM and collective
times; err: model / measured - 1."""

CSV_FIELDS = [
    "target", "model", "m", "in", "out", "sequence_parallel", "p", "dtype", "backend", "resolved", "median_ms",
    "tflops", "pct_peak", "speedup", "baseline", "E", "gemm_ms", "comm_ms", "gemm_under_comm_ms", "gemm_slowdown",
    "exposed_comm_ms", "model_ms", "model_err",
]


def _model_inputs(result: dict, dtype: str):
    times, samples = {}, defaultdict(list)
    for c in result["cases"]:
        if c["dtype"] != dtype:
            continue
        for (m, n, k), t in c["gemm"]:
            times[(m, n, k, dtype)] = t
        for kind, nbytes, t in c["comm_samples"]:
            samples[kind].append((nbytes, t))
    gemm = perf_model.MeasuredGemm(times, source="GEMM times measured in this run")
    usable = {kind: pts for kind, pts in samples.items() if len({b for b, _ in pts}) >= 2}
    link = perf_model.Link.calibrated("this run's collectives", usable) if usable else None
    return gemm, link


#: the link of one rank: nothing to communicate (:meth:`tp_kernels.perf_model.Link.time` is 0 at p = 1)
_ONE_RANK = perf_model.Link("one rank: nothing to communicate", 1.0, 1.0, 0.0, 0.0)


def schedule_of(resolved: str) -> Tuple[Optional[str], Optional[int]]:
    """The schedule :mod:`tp_kernels.perf_model` predicts for what ran (``resolved``: an
    implementation name, or ``"auto"``'s ``"<name> (measured)"``) and its chunks: ``("naive",
    None)`` for the reference, ``("pipelined", chunks)`` for the pipelined and native paths, and
    ``(None, None)`` for what it does not model (the fused path, ``"auto"``'s several choices)."""
    try:
        impl = parse(resolved.split(" ")[0])
    except ValueError:
        return None, None
    if impl.backend == "reference":
        return "naive", None
    return ("pipelined", impl.num_chunks) if impl.backend in ("pipelined", "native") else (None, None)


def _predict(case: Case, p: int, dtype: str, schedule: str, gemm, link, slowdown: float,
             num_chunks: Optional[int]) -> Optional[float]:
    if p == 1:  # (the GEMMs alone, as the schedule splits them)
        link = _ONE_RANK
    elif link is None:
        return None
    try:
        tasks = case.tasks(p, dtype, gemm, link, schedule, num_chunks)
    except KeyError:  # a GEMM shape, or a kind of collective, this run did not measure (at two sizes)
        return None
    return perf_model.simulate(tasks, slowdown if schedule != "naive" else 1.0)


def compute_rows(result: dict, p: int, baseline: str) -> List[dict]:
    """One row per (case, dtype, backend) with every metric of the module docstring."""
    models = {d: _model_inputs(result, d) for d in {c["dtype"] for c in result["cases"]}}
    peaks = _peaks(result, p)
    rows = []
    for c in result["cases"]:
        case, dtype = Case(**c["case"]), c["dtype"]
        t_gemm, t_comm, t_guc = c["gemm_total"], c["comm_total"], c["gemm_under_comm"]
        slowdown = t_guc / t_gemm if t_gemm > 0 else float("nan")
        base = c["backend"][baseline]
        peak = peaks[dtype]
        gemm, link = models[dtype]
        for backend, t in c["backend"].items():
            resolved = c["resolved"][backend]
            tflops = case.gemm_flops(p) / t / 1e12
            schedule, chunks = schedule_of(resolved)
            model = (None if schedule is None else
                     _predict(case, p, dtype, schedule, gemm, link, slowdown, chunks))
            rows.append({
                **case.as_dict(), "p": p, "dtype": dtype, "backend": backend, "resolved": resolved,
                "median_ms": t * 1e3, "tflops": tflops, "pct_peak": 100.0 * tflops / peak,
                "speedup": base / t, "baseline": baseline,
                "E": (t_gemm + t_comm - t) / t_comm if t_comm > 0 else None,
                "gemm_ms": t_gemm * 1e3, "comm_ms": t_comm * 1e3, "gemm_under_comm_ms": t_guc * 1e3,
                "gemm_slowdown": slowdown, "exposed_comm_ms": (t - t_gemm) * 1e3,
                "model_ms": None if model is None else model * 1e3,
                "model_err": None if model is None else model / t - 1.0,
            })
    return rows


def _peaks(result: dict, p: int) -> Dict[str, float]:
    """Per dtype, the fastest TFLOP/s this run saw: the square GEMM's, any case's GEMMs alone, and
    any backend's whole case."""
    peaks = dict(result["peak_tflops"])
    for c in result["cases"]:
        case, dtype = Case(**c["case"]), c["dtype"]
        rates = [2.0 * m * n * k / t / 1e12 for (m, n, k), t in c["gemm"] if t > 0]
        rates += [case.gemm_flops(p) / t / 1e12 for t in c["backend"].values() if t > 0]
        peaks[dtype] = max([peaks.get(dtype, 0.0)] + rates)
    return peaks


def _fmt(v, spec: str, width: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-".rjust(width)
    return format(v, spec).rjust(width)


def format_hold(hold: dict) -> str:
    """The line that says how the GPU samples were taken (``hold``:
    :meth:`tp_kernels._timing.Hold.summary`)."""
    return (f"# GPU samples: the stream held until the host had enqueued each (the GPU's time, not the host's); "
            f"the host outlasted the hold in {hold['exposed']} of {hold['samples']}")


def format_table(rows: List[dict]) -> str:
    head = (f"{'target':<21} {'model':<15} {'m':>6} {'in':>6} {'out':>6} {'dtype':<8} {'backend':<9} {'ms':>9} "
            f"{'TFLOP/s':>8} {'%peak':>6} {'speedup':>7} {'E':>6} {'slow':>5} {'exposed':>8} {'model ms':>9} {'err':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['target']:<21} {r['model']:<15} {r['m']:>6} {r['in']:>6} {r['out']:>6} {r['dtype']:<8} "
            f"{r['backend']:<9} {r['median_ms']:>9.3f} {r['tflops']:>8.3f} {r['pct_peak']:>6.1f} "
            f"{r['speedup']:>6.2f}x {_fmt(r['E'], '.2f', 6)} {_fmt(r['gemm_slowdown'], '.2f', 5)} "
            f"{r['exposed_comm_ms']:>8.3f} {_fmt(r['model_ms'], '.3f', 9)} "
            f"{_fmt(None if r['model_err'] is None else 100 * r['model_err'], '+.0f', 5)}%"
        )
    return "\n".join(lines)


def model_error_summary(rows: List[dict]) -> Dict[str, dict]:
    """Median and worst |model_err| of the reference's rows and of the pipelined backend's, each
    where it ran its own schedule (:func:`schedule_of`: the pipelined backend on the native path too)."""
    out = {}
    for backend, schedule in (("reference", "naive"), ("pipelined", "pipelined")):
        errs = sorted(abs(r["model_err"]) for r in rows if r["model_err"] is not None and r["backend"] == backend
                      and schedule_of(r["resolved"])[0] == schedule)
        if errs:
            out[backend] = {"cases": len(errs), "median_abs_err": errs[len(errs) // 2], "max_abs_err": errs[-1]}
    return out


def to_csv(rows: List[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def plot(rows: List[dict], path: str, title: str) -> Optional[str]:
    """Write a PNG of speedup against the baseline (top row) and E (bottom row) against m, one
    column per target, one y scale per row, every measured m marked on a log-2 axis, and E below
    the axis's floor drawn at the floor as a labelled triangle; return its path, or None when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    present = set(r["target"] for r in rows)
    targets = [t for t in TARGETS if t in present]
    baseline = rows[0]["baseline"] if rows else "baseline"
    ms = sorted({r["m"] for r in rows})
    with plt.rc_context({"font.size": 10}):
        fig, axes = plt.subplots(2, len(targets), figsize=(2.8 * len(targets) + 0.8, 6.6), squeeze=False,
                                 sharex=True, sharey="row")
        colors = {}
        for col, target in enumerate(targets):
            series = defaultdict(list)
            for r in rows:
                if r["target"] == target and r["backend"] != r["baseline"]:
                    series[(r["model"], r["dtype"], r["backend"])].append(r)
            for key, rs in sorted(series.items()):
                rs.sort(key=lambda r: r["m"])
                label = f"{key[2]}, {key[0]} {key[1]}"
                color = colors.setdefault(label, f"C{len(colors)}")
                axes[0][col].plot([r["m"] for r in rs], [r["speedup"] for r in rs], marker="o", color=color,
                                  label=label)
                pts = [(r["m"], r["E"]) for r in rs if r["E"] is not None]
                if pts:
                    shown = [min(_E_CEILING, max(_E_FLOOR, e)) for _, e in pts]
                    axes[1][col].plot([m for m, _ in pts], shown, color=color, marker="o")
                    for (m, e), y in zip(pts, shown):
                        if y != e:  # outside the axis: at its end, marked, with its value
                            below = e < y
                            axes[1][col].plot([m], [y], marker="v" if below else "^", ms=9, color=color)
                            axes[1][col].annotate(f"{e:.1f}", (m, y), textcoords="offset points",
                                                  xytext=(0, 7 if below else -14), ha="center", fontsize=8,
                                                  color=color)
            axes[0][col].axhline(1.0, color="grey", lw=0.8, ls="--")
            axes[1][col].axhline(0.0, color="grey", lw=0.8, ls="--")
            axes[1][col].axhline(1.0, color="grey", lw=0.8, ls=":")
            axes[0][col].set_title(target)
            axes[1][col].set_xlabel("m (tokens)")
            for ax in (axes[0][col], axes[1][col]):
                ax.set_xscale("log", base=2)
                ax.set_xticks(ms, [str(m) for m in ms])
                ax.minorticks_off()
                ax.grid(True, alpha=0.3)
        axes[1][0].set_ylim(_E_FLOOR - 0.25, _E_CEILING + 0.25)
        axes[0][0].set_ylabel(f"speedup vs {baseline}")
        axes[1][0].set_ylabel(f"overlap efficiency E\n(▼ ▲: beyond {_E_FLOOR:g} / {_E_CEILING:g}, value beside)")
        if colors:
            handles = [plt.Line2D([], [], color=c, marker="o") for c in colors.values()]
            fig.legend(handles, list(colors), loc="lower center", ncol=min(4, len(colors)))
        fig.suptitle(title)
        fig.tight_layout(rect=(0, 0.07, 1, 0.96))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return path
