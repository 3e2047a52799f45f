"""Benchmark: tensor-parallel layers forward+backward, each backend against the reference.

    python -m tp_kernels.bench              # spawns its own ranks (gloo on the CPU)
    python -m tp_kernels.bench --quick      # a smaller run (< 2 minutes on 2 cores)
    torchrun --nproc-per-node 8 -m tp_kernels.bench   # real multi-GPU nodes (NCCL)

For each shape and layer (column- and row-parallel, with and without sequence parallelism) it
times forward+backward of every backend and prints the median, and the speedup against the
``reference`` backend measured in the same run. A step's time is the slowest rank's. CUDA work
is timed with CUDA events; host work with ``time.perf_counter`` around a synchronous step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

#: (tokens m, in_features, out_features); m is the full sequence*batch (split by p under SP)
SHAPES = {
    "quick": [(512, 512, 1024), (2048, 256, 512)],
    "full": [(512, 512, 1024), (2048, 512, 1024), (2048, 256, 512), (4096, 128, 256), (1024, 1024, 2048)],
}
LAYERS = [("column", False), ("column", True), ("row", False), ("row", True)]


def _parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tp_kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and iterations (< 2 min on 2 CPU cores)")
    ap.add_argument("-p", "--world-size", type=int, default=None,
                    help="ranks to spawn when not under torchrun (default: 2, or the number of GPUs)")
    ap.add_argument("--backends", default="reference,pipelined", help="comma-separated (the first is the baseline)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on GPUs, float32 on the CPU")
    ap.add_argument("--shape", action="append", default=None, metavar="M,IN,OUT",
                    help="a shape to run (repeatable); default: the built-in list")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per case (default 20, quick 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    ap.add_argument("--num-chunks", type=int, default=None, help="pipelined chunks (default: the schedule's)")
    ap.add_argument("--out", default=None, help="also write the results as JSON to this path")
    args = ap.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    from .ops import BACKEND_NAMES

    for b in args.backends:
        if b not in BACKEND_NAMES:
            ap.error(f"--backends: unknown backend {b!r} (choose from {', '.join(BACKEND_NAMES)})")
    if args.shape:
        try:
            args.shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape]
            assert all(len(s) == 3 and min(s) > 0 for s in args.shapes)
        except (ValueError, AssertionError):
            ap.error("--shape: expected three positive ints M,IN,OUT")
    else:
        args.shapes = SHAPES["quick" if args.quick else "full"]
    args.iters = args.iters or (5 if args.quick else 20)
    return args


def _step_time(fn, cuda: bool) -> float:
    """Seconds of one synchronous step of ``fn`` on this rank."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_rank(config: dict) -> Optional[List[dict]]:
    """Time every case on this rank; rank 0 returns the rows (others return None)."""
    from . import ColumnParallelLinear, RowParallelLinear

    rank, p = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, config["dtype"])
    rows = []
    for m, k, n in config["shapes"]:
        for kind, sp in LAYERS:
            if m % p or (n if kind == "column" else k) % p:
                continue
            times: Dict[str, float] = {}
            for backend in config["backends"]:
                torch.manual_seed(0)
                if kind == "column":
                    layer = ColumnParallelLinear(k, n, sequence_parallel=sp, backend=backend, device=device,
                                                 dtype=dtype, num_chunks=config["num_chunks"])
                    x = torch.randn((m // p if sp else m), k, device=device, dtype=dtype)
                else:
                    layer = RowParallelLinear(k, n, sequence_parallel=sp, backend=backend, device=device,
                                              dtype=dtype, num_chunks=config["num_chunks"])
                    x = torch.randn(m, k // p, device=device, dtype=dtype)
                x.requires_grad_()
                dy = torch.randn_like(layer(x))

                def step():
                    layer.zero_grad(set_to_none=True)
                    x.grad = None
                    layer(x).backward(dy)

                for _ in range(config["warmup"]):
                    step()
                samples = []
                for _ in range(config["iters"]):
                    dist.barrier()
                    samples.append(_step_time(step, cuda))
                # a step lasts as long as its slowest rank
                t = torch.tensor(samples, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[backend] = statistics.median(t.tolist())
            base = times[config["backends"][0]]
            for backend, t in times.items():
                rows.append({
                    "layer": kind, "sequence_parallel": sp, "m": m, "in": k, "out": n, "p": p,
                    "dtype": config["dtype"], "backend": backend, "median_ms": t * 1e3,
                    "speedup": base / t, "baseline": config["backends"][0],
                })
    return rows if rank == 0 else None


def _device_name(backend: str) -> str:
    if backend == "nccl":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _commit() -> str:
    """``TP_KERNELS_COMMIT``, else the git commit of this source tree."""
    if os.environ.get("TP_KERNELS_COMMIT"):
        return os.environ["TP_KERNELS_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def format_table(rows: List[dict]) -> str:
    head = f"{'layer':<7} {'SP':<3} {'m':>6} {'in':>6} {'out':>6} {'p':>2} {'backend':<10} {'median ms':>10} {'vs ' + rows[0]['baseline'] if rows else '':>14}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['layer']:<7} {'yes' if r['sequence_parallel'] else 'no':<3} {r['m']:>6} {r['in']:>6} {r['out']:>6} "
            f"{r['p']:>2} {r['backend']:<10} {r['median_ms']:>10.3f} {r['speedup']:>13.2f}x"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    from .launch import World, default_backend, launched_by_torchrun

    torchrun = launched_by_torchrun()
    if torchrun:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        p = dist.get_world_size()
    else:
        p = args.world_size or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        backend = default_backend(p)
    dtype = args.dtype or ("bfloat16" if backend == "nccl" else "float32")
    config = {"shapes": args.shapes, "backends": args.backends, "dtype": dtype, "iters": args.iters,
              "warmup": args.warmup, "num_chunks": args.num_chunks}
    start = time.monotonic()
    if torchrun:
        rows = run_rank(config)
        rank0 = dist.get_rank() == 0
        dist.destroy_process_group()
        if not rank0:
            return 0
    else:
        print(f"tp_kernels.bench: spawning {p} ranks ({backend})...", file=sys.stderr, flush=True)
        with World(p, backend=backend, timeout_s=300.0) as world:
            rows = world.run(run_rank, config, deadline_s=3600.0)[0]
    device = _device_name(backend)
    print(f"# {device}, {backend}, p={p}, {dtype}, {args.iters} timed steps per case (median), "
          f"forward+backward, {time.monotonic() - start:.0f} s")
    print(format_table(rows))
    if args.out:
        record = {"device": device, "backend": backend, "commit": _commit(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "torch": torch.__version__, "config": {**config, "shapes": [list(s) for s in args.shapes]},
                  "results": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
