"""The public ops and the communicating primitive behind each, defined once.

Three primitives communicate (docs/architecture.md); a fourth public op,
``linear_with_grad_all_reduce`` (column-parallel without sequence parallelism), is a local GEMM
whose *backward* all-reduces. The native module names the same three primitives
(``_C.OPS``; a test holds the two lists equal).
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

__all__ = ["ALL_GATHER_MATMUL", "MATMUL_ALL_REDUCE", "MATMUL_REDUCE_SCATTER", "OPS", "PRIMITIVES", "OpSpec",
           "communicated_problem"]

PRIMITIVES = ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE = (
    "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    #: the primitive it communicates with (for linear_with_grad_all_reduce: in its backward)
    primitive: str
    #: the fewest dims its input ``x`` may have
    min_dim: int


OPS = {spec.name: spec for spec in (
    OpSpec(ALL_GATHER_MATMUL, ALL_GATHER_MATMUL, 2),
    OpSpec(MATMUL_REDUCE_SCATTER, MATMUL_REDUCE_SCATTER, 2),
    OpSpec(MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE, 1),
    OpSpec("linear_with_grad_all_reduce", MATMUL_ALL_REDUCE, 1),
)}


def communicated_problem(op: str, m: int, weight_shape) -> Tuple[int, int, int]:
    """``(m, n, k)`` of the GEMM ``[m, k] x [k, n]`` whose result ``op``'s primitive communicates,
    for a call with ``m`` rows of ``x`` and ``weight`` ``[out, in]``: the op's own GEMM, or for
    ``linear_with_grad_all_reduce`` its backward's ``dy [m, out] x W [out, in]``."""
    out_features, in_features = weight_shape
    if op == "linear_with_grad_all_reduce":
        return m, in_features, out_features
    return m, out_features, in_features
