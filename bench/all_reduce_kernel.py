"""The fused all-reduce on virtual ranks, alone: the program bench/gpu_profile.sh runs under
Nsight Compute.

    python bench/all_reduce_kernel.py --p 8 --bytes 16384 --algorithm one_shot [--calls 3]
    python bench/all_reduce_kernel.py ... --launches    # prints "SKIP COUNT" for ncu, runs nothing

Runs ``--calls`` all-reduces of ``--bytes`` bytes of bf16 a rank on p virtual ranks
(``VirtualRanks.all_reduce``: each rank's stages as phases, phase k of every rank before phase
k + 1 of any, so a profiler that runs one kernel at a time still finds every flag a kernel waits
for set) and checks the last one against the rank-order sum in fp32 (the kernel's own order: the
same bits). ``--launches`` prints how many launches of the all-reduce kernel the calls before the
last make (ncu's ``--launch-skip``) and how many the last makes (``--launch-count``).

Exit status: 0 when the result is right, 1 when it is wrong, 2 without a CUDA device or the
native extension, 3 when a device wait timed out.
"""

import argparse
import sys

import torch

from tp_kernels import _extension
from tp_kernels.backends import fused
from tp_kernels.testing import VirtualRanks, rank_order_sum


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/all_reduce_kernel.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=8, help="virtual ranks (default: %(default)s)")
    ap.add_argument("--bytes", type=int, default=16384, help="bytes a rank, bf16 (default: %(default)s)")
    ap.add_argument("--algorithm", default="one_shot", help="one_shot or two_shot (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=3, help="all-reduces, the last one profiled (default: %(default)s)")
    ap.add_argument("--launches", action="store_true", help="print the launches to skip and to profile, and exit")
    args = ap.parse_args(argv)
    if args.bytes <= 0 or args.bytes % 2 or args.calls < 1:
        ap.error("--bytes: a positive even number; --calls: at least 1")
    reason = _extension.unavailable()
    if reason is None and not args.launches and not torch.cuda.is_available():
        reason = "no CUDA device"
    if reason:
        print(f"needs a CUDA device and the native extension: {reason}", file=sys.stderr)
        return 2
    C = _extension.require()
    if args.algorithm not in fused.kernel_algorithms():
        ap.error(f"--algorithm: one of the all-reduce kernel's algorithms, not {args.algorithm!r}")
    per_call = args.p * C.fused_phases("matmul_all_reduce", args.algorithm)  # one launch a phase a rank
    if args.launches:
        print(per_call * (args.calls - 1), per_call)
        return 0
    g = torch.Generator().manual_seed(0)
    numel = args.bytes // 2
    xs = [torch.randn(numel, generator=g).to("cuda", torch.bfloat16) for _ in range(args.p)]
    want = rank_order_sum(xs, torch.bfloat16)
    try:
        with VirtualRanks(args.p, timeout_s=60.0) as vr:
            for _ in range(args.calls):
                outs = vr.all_reduce(xs, args.algorithm)
            torch.cuda.synchronize()
            vr.check()
    except RuntimeError as exc:
        print(f"a device wait failed: {exc}", file=sys.stderr)
        return 3
    wrong = [q for q, out in enumerate(outs) if not torch.equal(out, want)]
    print(f"{args.algorithm}, {args.bytes} bytes, {args.p} virtual ranks, {args.calls} calls "
          f"({per_call} launches a call): " + (f"WRONG on ranks {wrong}" if wrong else "right"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
