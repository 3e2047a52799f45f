"""The figures the GPU benchmarks are read against, defined once (docs/benchmarks.md lists them).

Each is a bound a measured ratio or time must meet on one H100/H200 (bf16, medians of CUDA-event
samples): ``>=`` for the ratios and the overlap efficiency, ``<=`` for the costs.
"""

from __future__ import annotations

__all__ = ["TARGETS", "meets"]

#: name -> (bound, ">=" or "<=", what it bounds)
TARGETS = {
    "native_gemm_vs_f_linear": (0.99, ">=", "native cuBLASLt GEMM throughput / F.linear's, 8192^3 and 70B TP8 shapes"),
    "host_overhead_us": (5.0, "<=", "host time a call adds over F.linear, m = 16, eager (us)"),
    "graph_overhead_us": (0.5, "<=", "GPU time a call adds over F.linear under CUDA-graph replay (us): none, "
                                     "within the timing's noise"),
    "chunk4_vs_unsplit": (0.97, ">=", "4-chunk GEMM throughput / the unsplit GEMM's, 70B TP8 shapes"),
    "gemm_slowdown": (0.03, "<=", "GEMM slowdown while the fused path's copies run beside it"),
    "overlap_efficiency": (0.95, ">=", "fused overlap efficiency E, all_gather_matmul and matmul_reduce_scatter, "
                                       "70B TP8, 8 virtual ranks"),
    "decode_all_reduce_us": (8.0, "<=", "decode all-reduce of matmul_all_reduce, <= 64 KiB, 8 virtual ranks, the "
                                        "best algorithm, alone and replayed from a CUDA graph (us)"),
    "model_error": (0.10, "<=", "|performance model prediction / measured - 1|"),
}


def meets(name: str, value) -> bool:
    """Whether ``value`` meets target ``name`` (False for a missing value)."""
    if value is None:
        return False
    bound, sense, _ = TARGETS[name]
    return value >= bound if sense == ">=" else value <= bound
