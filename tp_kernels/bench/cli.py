"""The main job: ``python -m tp_kernels.bench``.

    python -m tp_kernels.bench --quick       # one model, two m, every op and layer, the communicator (< 1 min on 2 CPU cores)
    python -m tp_kernels.bench               # Llama-3 8B/70B and GPT-3 175B shapes, decode and training m
    torchrun --nproc-per-node 8 -m tp_kernels.bench   # real multi-GPU nodes (NCCL)

Without torchrun it spawns its own ranks: gloo processes on the CPU (default p = 2), one rank
per GPU otherwise. For every case (an op, or a layer forward+backward, at a model's shape) it
measures the GEMMs alone, the collectives alone, the GEMMs under the collectives, and every
backend; then prints and saves (``--out-dir``, default :func:`default_out_dir`) a JSON and a CSV
with device, commit and date, and a PNG plot of speedup and overlap efficiency against m.
The metrics are defined in :mod:`tp_kernels.bench.report`. On one GPU (one rank, nothing to
communicate) it adds per-rank costs, the fused path on virtual ranks and a calibrated projection
for 8 GPUs (:mod:`tp_kernels.bench.one_gpu`; in the JSON under ``"one_gpu"``). The ``communicator`` target times
the communicator's all-reduce on every path against message size, with the crossovers its
``"auto"`` chooses (:mod:`tp_kernels.bench.communicator`; in the JSON under ``"communicator"``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import List

import torch
import torch.distributed as dist

from ..perf_model import MODELS
from ..settings import BACKEND_NAMES
from ..testing import World, default_backend, join_torchrun, launched_by_torchrun
from . import communicator, one_gpu, report
from .cases import DECODE_M, OPS, SWEEPS, TARGETS, TRAIN_M, custom_cases, model_cases
from .records import commit, default_out_dir, device_name, slug

QUICK_M = {"cuda": (16, 8192), "cpu": (16, 1024)}


def _csv(value: str, allowed=None, what: str = "", conv=str) -> List:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)} (choose from {', '.join(allowed)})")
    try:
        return [conv(v) for v in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {value!r}") from None


def _parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tp_kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one model, two m, fewer samples")
    ap.add_argument("-p", "--world-size", type=int, default=None,
                    help="ranks to spawn when not under torchrun (default: 2 on the CPU, else the number of GPUs)")
    ap.add_argument("--backends", default="reference,pipelined",
                    type=lambda v: _csv(v, BACKEND_NAMES, "backend"),
                    help="comma-separated; the first is the baseline of 'speedup' (default: reference,pipelined)")
    ap.add_argument("--targets", default=",".join(TARGETS + SWEEPS), type=lambda v: _csv(v, TARGETS + SWEEPS, "target"),
                    help="ops, layers and sweeps to run (default: all): " + ", ".join(TARGETS + SWEEPS))
    ap.add_argument("--dtypes", default=None, type=lambda v: _csv(v, ["float32", "bfloat16", "float16"], "dtype"),
                    help="default: bfloat16 on GPUs, float32 on the CPU")
    ap.add_argument("--models", default=None, type=lambda v: _csv(v, sorted(MODELS), "model"),
                    help="model shapes (default: all; --quick: llama3-70b)")
    ap.add_argument("--m", default=None, type=lambda v: _csv(v, None, "ints", int),
                    help="token counts m (default: 1,16,64,256 and training sizes)")
    ap.add_argument("--scale", type=int, default=None,
                    help="divide the models' feature sizes by this (default: 1 on GPUs, 64 on the CPU)")
    ap.add_argument("--shape", action="append", default=None, metavar="M,IN,OUT",
                    help="a custom shape instead of the models' (repeatable)")
    ap.add_argument("--iters", type=int, default=None, help="timed samples per measurement (default 20, quick 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed samples per measurement")
    ap.add_argument("--num-chunks", type=int, default=None, help="pipelined chunks (default: the schedule's)")
    ap.add_argument("--out-dir", default=default_out_dir(),
                    help="where the JSON, CSV and PNG go (default: %(default)s)")
    ap.add_argument("--tag", default="", help="appended to the output files' names")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if args.shape:
        try:
            args.shape = [tuple(int(v) for v in s.split(",")) for s in args.shape]
            assert all(len(s) == 3 and min(s) > 0 for s in args.shape)
        except (ValueError, AssertionError):
            ap.error("--shape: expected three positive ints M,IN,OUT")
    if args.m is not None and (not args.m or min(args.m) < 1):
        ap.error("--m: expected positive ints")
    for name in ("world_size", "scale", "iters", "num_chunks"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive int, got {v}")
    args.iters = args.iters or (5 if args.quick else 20)
    return args, ap


def _cases(args, ap: argparse.ArgumentParser, p: int, where: str, scale: int) -> List:
    """The cases of ``args`` on ``p`` ranks (``where``: "cuda" or "cpu"): its shapes, else its
    models' (default: every model; --quick, Llama-3 70B) at its m (default: the decode m and
    ``where``'s training m; --quick, two), feature sizes divided by ``scale``."""
    case_targets = [t for t in args.targets if t in TARGETS]
    if args.shape:
        return custom_cases(args.shape, case_targets, p)
    models = args.models or (["llama3-70b"] if args.quick else sorted(MODELS))
    ms = args.m or (QUICK_M[where] if args.quick else DECODE_M + TRAIN_M[where])
    try:
        return model_cases(models, ms, case_targets, p, scale)
    except KeyError as exc:
        ap.error(f"--models: {exc}")


def main(argv=None) -> int:
    args, ap = _parse(argv)
    torchrun = launched_by_torchrun()
    if torchrun:
        backend, p = join_torchrun()
    else:
        p = args.world_size or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        backend = default_backend(p)
    where = "cuda" if backend == "nccl" else "cpu"
    scale = args.scale or (1 if where == "cuda" else 64)
    sweep = "communicator" in args.targets
    cases = _cases(args, ap, p, where, scale)
    if not cases and not sweep:
        ap.error(f"no case runs on p={p} (m and the split feature sizes must be divisible by p)")
    dtypes = args.dtypes or (["bfloat16"] if where == "cuda" else ["float32"])
    config = {"cases": [c.__dict__ for c in cases], "backends": args.backends, "dtypes": dtypes,
              "iters": args.iters, "warmup": args.warmup, "num_chunks": args.num_chunks,
              "communicator": sweep, "quick": args.quick, "one_gpu": one_gpu.applies(where, p)}
    from .measure import run_rank

    start = time.monotonic()
    if torchrun:
        result = run_rank(config)
        rank0 = dist.get_rank() == 0
        dist.destroy_process_group()
        if not rank0:
            return 0
    else:
        print(f"tp_kernels.bench: {len(cases)} cases x {len(dtypes)} dtypes" + (" and the communicator sweep" if sweep
              else "") + f" on {p} ranks ({backend})",
              file=sys.stderr, flush=True)
        with World(p, backend=backend, timeout_s=300.0) as world:
            result = world.run(run_rank, config, deadline_s=6 * 3600.0)[0]
    rows = report.compute_rows(result, p, args.backends[0])
    device = device_name(backend)
    elapsed = time.monotonic() - start
    peaks = ", ".join(f"{d} {v:.2f}" for d, v in result["peak_tflops"].items())
    header = (f"# {device}, {backend}, p={p}, {args.iters} samples per measurement (median, slowest rank)"
              + (f", measured GEMM peak TFLOP/s: {peaks}" if peaks else "") + f"; {elapsed:.0f} s")
    print(header)
    if result.get("hold"):
        print(report.format_hold(result["hold"]))
    if rows:
        print(report.format_table(rows))
        print(report.LEGEND.format(baseline=args.backends[0]))
    errors = report.model_error_summary(rows)
    for schedule, e in errors.items():
        print(f"# perf model vs measured, {schedule}: median |error| {100 * e['median_abs_err']:.0f}%, "
              f"worst {100 * e['max_abs_err']:.0f}% over {e['cases']} cases")
    single = one_gpu.report(result["one_gpu"], rows, device) if result.get("one_gpu") else None
    if single:
        print(one_gpu.format_report(single))
    if result.get("communicator"):
        print(communicator.format_table(result["communicator"]))
    if args.no_save:
        return 0
    stem = os.path.join(args.out_dir, f"{slug(device)}-{backend}-p{p}" + ("-quick" if args.quick else "")
                        + (f"-{args.tag}" if args.tag else ""))
    record = {
        "device": device, "backend": backend, "p": p, "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "elapsed_s": round(elapsed, 1),
        "config": {k: v for k, v in config.items() if k != "cases"} | {"scale": scale, "quick": args.quick,
                                                                       "ops": [t for t in args.targets if t in OPS]},
        "peak_tflops": result["peak_tflops"], "model_error": errors, "results": rows,
        "communicator": result.get("communicator"),  # the all-reduce latency sweep, when run
        "one_gpu": single,  # on one GPU: per-rank costs, the fused path on virtual ranks, the projection
        "hold": result.pop("hold", None),  # on a GPU: the samples, and those whose host outlasted the hold
        "measurements": result,  # the raw per-case timings (seconds) the rows were computed from
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    if not rows:
        print(f"# wrote {stem}.json")
        return 0
    with open(stem + ".csv", "w") as f:
        f.write(report.to_csv(rows))
    png = report.plot(rows, stem + ".png", f"{device}, {backend}, p={p}, commit {record['commit']}")
    print(f"# wrote {stem}.json, {stem}.csv" + (f", {png}" if png else " (no plot: matplotlib is not installed)"))
    return 0
