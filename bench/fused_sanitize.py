"""Every fused op once on two virtual ranks (the all-reduce kernel in both forms of its flags),
checked: the program compute-sanitizer runs.

    compute-sanitizer --tool memcheck --error-exitcode 9 python bench/fused_sanitize.py

Exit status: 0 when every result is right, 1 when one is wrong, 3 when a device wait timed out
(the tool may serialise kernels so that a waiting rank holds back the one it waits for).
"""

import sys

import torch

from tp_kernels.backends import fused
from tp_kernels.testing import VirtualRanks


def main() -> int:
    torch.manual_seed(0)
    p, dtype = 2, torch.float32
    xs_ag = [torch.randn(5, 24, device="cuda", dtype=dtype) for _ in range(p)]
    xs = [torch.randn(10, 24, device="cuda", dtype=dtype) for _ in range(p)]
    ws = [torch.randn(12, 24, device="cuda", dtype=dtype) for _ in range(p)]
    full = sum(x.double() @ w.double().t() for x, w in zip(xs, ws))
    bad = []
    try:
        with VirtualRanks(p, timeout_s=60.0) as vr:
            for q, (out, gathered) in enumerate(vr.all_gather_matmul(xs_ag, ws, num_chunks=2)):
                ref = torch.cat(xs_ag).double() @ ws[q].double().t()
                if not torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4):
                    bad.append(f"all_gather_matmul rank {q}")
            for q, out in enumerate(vr.matmul_reduce_scatter(xs, ws)):
                if not torch.allclose(out.double(), full[q * 5:(q + 1) * 5], rtol=1e-4, atol=1e-4):
                    bad.append(f"matmul_reduce_scatter rank {q}")
            for algo in fused.algorithms():
                for q, out in enumerate(vr.matmul_all_reduce(xs, ws, algorithm=algo)):
                    if not torch.allclose(out.double(), full, rtol=1e-4, atol=1e-4):
                        bad.append(f"matmul_all_reduce {algo} rank {q}")
            torch.cuda.synchronize()
            vr.check()
    except RuntimeError as exc:
        if "waited more than" in str(exc):
            print(f"timeout: {exc}", file=sys.stderr)
            return 3
        raise
    print("wrong:", bad if bad else "none")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
