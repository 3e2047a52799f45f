"""What the call fingerprints cost (:mod:`tp_kernels._agreement`): every op and layer of the main
job's quick cases, timed with fingerprints on and off in the same run, and against PyTorch's own
collective fingerprinting (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

    python -m tp_kernels.bench.fingerprints [--iters N] [--m M,M] [--out-dir DIR] [--tag T]

Spawns 2 gloo ranks on the CPU (the main job's shapes divided by 64), or uses the ranks of
``torchrun`` (NCCL on GPUs, full shapes; no DETAIL world then). Each case and backend is timed
four times, off, on, off, on (median of ``--iters`` samples each, the slowest rank's), and each
setting keeps its faster time, so slow drift does not pass for a cost; then twice more, off, in a
second world of ranks started with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (another world: compare it
with care). Then the fixed costs, steadier than the cases' ratios: a fingerprint exchange alone,
and a one-element all-reduce with and without DETAIL. Writes
``fingerprints-<device>-<backend>-p<p>.json``: per case the times and the overheads
``on / off - 1`` and ``detail / off - 1``; their medians and worst, the first of which decides
whether fingerprints may be on by default (below 3 %: ``tp_kernels.settings.FINGERPRINTS_DEFAULT``);
and the fixed costs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from .. import settings
from .._agreement import agree
from .._timing import Timer
from ..testing import World, join_torchrun, launched_by_torchrun
from .cases import Case, TARGETS, model_cases
from .cli import QUICK_M
from .records import commit, default_out_dir, device_name, slug
from .measure import _time_backend, buffer_sets

#: the overhead below which fingerprints may be on by default
DEFAULT_LIMIT = 0.03


def run_rank(config: dict) -> List[Dict]:
    """Every case's best time with fingerprints in each of ``config["modes"]`` (all ranks call it
    together): rows with ``off_ms`` (and ``on_ms``); every rank gets the same figures."""
    group = dist.group.WORLD
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timer = Timer(config["iters"], config["warmup"], cuda, group)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for c in config["cases"]:
        case = Case(**c)
        (xm, xk), (wn, wk) = case.local(dist.get_world_size())
        nsets = buffer_sets((xm * xk + wn * wk) * dtype.itemsize, cuda)
        for backend in config["backends"]:
            best = {mode: float("inf") for mode in config["modes"]}
            for mode in config["modes"] * 2:
                settings.set_fingerprints(mode == "on")
                try:
                    t = _time_backend(case, backend, dtype, device, group, timer, None, nsets)
                finally:
                    settings.set_fingerprints(None)
                best[mode] = min(best[mode], t)
            rows.append({**case.as_dict(), "backend": backend, **{f"{m}_ms": t * 1e3 for m, t in best.items()}})
    return rows


def round_trips(config: dict) -> Dict[str, float]:
    """Fixed costs, median microseconds: a fingerprint exchange alone (``agree`` of a trivial call,
    ranks alike), and a one-element all-reduce (in a ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` world, that
    is a collective with PyTorch's fingerprint check)."""
    group = dist.group.WORLD
    timer = Timer(config["iters"] * 10, config["warmup"], False, group)
    one = torch.zeros(1)
    out = {"all_reduce_us": timer(lambda i: dist.all_reduce(one, group=group)) * 1e6}
    settings.set_fingerprints(True)
    try:
        out["fingerprint_us"] = timer(lambda i: agree("x", group, lambda: None, lambda _: "same on every rank")) * 1e6
    finally:
        settings.set_fingerprints(None)
    return out


def merge(rows: List[Dict], detail: List[Dict]) -> List[Dict]:
    """The rows with their overheads, and ``detail_ms`` (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, off)
    where the DETAIL world measured them."""
    out = []
    for i, r in enumerate(rows):
        r = dict(r, overhead=r["on_ms"] / r["off_ms"] - 1.0)
        if detail:
            r.update(detail_ms=detail[i]["off_ms"], detail_overhead=detail[i]["off_ms"] / r["off_ms"] - 1.0)
        out.append(r)
    return out


def summarize(rows: List[Dict]) -> Dict:
    overheads = [r["overhead"] for r in rows]
    median = statistics.median(overheads)
    summary = {"median_overhead": median, "worst_overhead": max(overheads), "cases": len(rows),
               "limit": DEFAULT_LIMIT, "below_limit": median < DEFAULT_LIMIT}
    if rows and "detail_overhead" in rows[0]:
        detail = [r["detail_overhead"] for r in rows]
        summary.update(median_detail_overhead=statistics.median(detail), worst_detail_overhead=max(detail))
    return summary


def format_table(rows: List[Dict]) -> str:
    detail = bool(rows) and "detail_ms" in rows[0]
    lines = [f"{'target':<22}{'m':>6}{'in':>7}{'out':>7}  {'backend':<10}{'off ms':>9}{'on ms':>9}{'cost':>8}"
             + (f"{'DETAIL ms':>11}{'cost':>8}" if detail else "")]
    for r in rows:
        lines.append(f"{r['target']:<22}{r['m']:>6}{r['in']:>7}{r['out']:>7}  {r['backend']:<10}{r['off_ms']:>9.3f}"
                     f"{r['on_ms']:>9.3f}{100 * r['overhead']:>7.1f}%"
                     + (f"{r['detail_ms']:>11.3f}{100 * r['detail_overhead']:>7.1f}%" if detail else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp_kernels.bench.fingerprints", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="timed samples per measurement")
    ap.add_argument("--m", default=None, help="token counts (default: the main job's --quick ones)")
    ap.add_argument("--out-dir", default=default_out_dir(), help="default: %(default)s")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    torchrun = launched_by_torchrun()
    if torchrun:
        backend, p = join_torchrun()
    else:
        backend, p = "gloo", 2
    where = "cuda" if backend == "nccl" else "cpu"
    ms = [int(v) for v in args.m.split(",")] if args.m else list(QUICK_M[where])
    cases = model_cases(["llama3-70b"], ms, TARGETS, p, 1 if where == "cuda" else 64)
    config = {"cases": [c.__dict__ for c in cases], "backends": ["reference", "pipelined"], "iters": args.iters,
              "warmup": 2, "modes": ["off", "on"]}
    start = time.monotonic()
    detail: List[Dict] = []
    if torchrun:
        rows = run_rank(config)
        fixed = round_trips(config)
        rank0 = dist.get_rank() == 0
        dist.destroy_process_group()
        if not rank0:
            return 0
    else:
        with World(p, backend=backend, timeout_s=300.0) as world:
            rows = world.run(run_rank, config, deadline_s=3600.0)[0]
            fixed = world.run(round_trips, config)[0]
        with World(p, backend=backend, timeout_s=300.0, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) as world:
            detail = world.run(run_rank, {**config, "modes": ["off"]}, deadline_s=3600.0)[0]
            fixed["all_reduce_detail_us"] = world.run(round_trips, config)[0]["all_reduce_us"]
    rows = merge(rows, detail)
    device = device_name(backend)
    summary = {**summarize(rows), **fixed}
    print(f"# fingerprints on {device}, {backend}, p={p}: {time.monotonic() - start:.0f} s")
    print(format_table(rows))
    print(f"# median cost {100 * summary['median_overhead']:.1f}%, worst {100 * summary['worst_overhead']:.1f}% "
          f"over {summary['cases']} cases ({'below' if summary['below_limit'] else 'above'} the "
          f"{100 * DEFAULT_LIMIT:.0f}% limit)"
          + (f"; TORCH_DISTRIBUTED_DEBUG=DETAIL: median {100 * summary['median_detail_overhead']:.1f}%, worst "
             f"{100 * summary['worst_detail_overhead']:.1f}%" if detail else ""))
    print(f"# fixed costs: a fingerprint exchange {fixed['fingerprint_us']:.0f} us per call; a one-element all-reduce "
          f"{fixed['all_reduce_us']:.0f} us"
          + (f", {fixed['all_reduce_detail_us']:.0f} us with TORCH_DISTRIBUTED_DEBUG=DETAIL (every collective)"
             if "all_reduce_detail_us" in fixed else ""))
    record = {"device": device, "backend": backend, "p": p, "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "summary": summary, "results": rows}
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"fingerprints-{slug(device)}-{backend}-p{p}{'-' + args.tag if args.tag else ''}"
                                      ".json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
