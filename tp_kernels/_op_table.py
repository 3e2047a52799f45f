"""The public ops and the communicating primitive behind each, and the plain collectives of
:class:`tp_kernels.Communicator`, defined once.

Three primitives communicate (docs/architecture.md); a fourth public op,
``linear_with_grad_all_reduce`` (column-parallel without sequence parallelism), is a local GEMM
whose *backward* all-reduces. The native module names the same three primitives (``_C.OPS``)
and the same collectives (``_C.COLLECTIVES``); a test holds the lists equal.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

__all__ = ["ALL_GATHER_MATMUL", "COLLECTIVES", "MATMUL_ALL_REDUCE", "MATMUL_REDUCE_SCATTER", "OPS", "POINT_TO_POINT",
           "PRIMITIVES", "REDUCTIONS", "OpSpec", "collective_output_shape", "communicated_problem"]

PRIMITIVES = ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE = (
    "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    #: the primitive it communicates with (for linear_with_grad_all_reduce: in its backward)
    primitive: str
    #: the fewest dims its input ``x`` may have
    min_dim: int
    #: whether it gathers or scatters a dim of ``x`` (dim 0, or the one its call names): the ops of
    #: sequence parallelism
    splits_rows: bool
    #: whether its forward communicates (linear_with_grad_all_reduce's is the local GEMM alone)
    forward_communicates: bool = True


OPS = {spec.name: spec for spec in (
    OpSpec(ALL_GATHER_MATMUL, ALL_GATHER_MATMUL, 2, True),
    OpSpec(MATMUL_REDUCE_SCATTER, MATMUL_REDUCE_SCATTER, 2, True),
    OpSpec(MATMUL_ALL_REDUCE, MATMUL_ALL_REDUCE, 1, False),
    OpSpec("linear_with_grad_all_reduce", MATMUL_ALL_REDUCE, 1, False, forward_communicates=False),
)}


def communicated_problem(op: str, m: int, weight_shape) -> Tuple[int, int, int]:
    """``(m, n, k)`` of the GEMM ``[m, k] x [k, n]`` whose result ``op``'s primitive communicates,
    for a call with ``m`` rows of ``x`` and ``weight`` ``[out, in]``: the op's own GEMM, or for
    ``linear_with_grad_all_reduce`` its backward's ``dy [m, out] x W [out, in]``."""
    out_features, in_features = weight_shape
    if op == "linear_with_grad_all_reduce":
        return m, in_features, out_features
    return m, out_features, in_features


#: The collectives, each over dim 0 of contiguous tensors (the communicator moves other dims there):
#: ``all_reduce`` and ``broadcast`` keep the shape, ``all_gather`` and ``gather`` (on the root)
#: stack the ranks' blocks rank-major (``[d, ...] -> [p*d, ...]``), ``reduce_scatter`` keeps this
#: rank's block of the sum (``[p*d, ...] -> [d, ...]``); ``send`` / ``recv`` are point to point.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "gather", "send", "recv")
#: The collectives that sum (the others move bytes, of any dtype).
REDUCTIONS = ("all_reduce", "reduce_scatter")
#: The point-to-point ones (two ranks take part, not the group).
POINT_TO_POINT = ("send", "recv")


def collective_output_shape(collective: str, shape, p: int, receives: bool = True) -> Optional[Tuple[int, ...]]:
    """The output shape of ``collective`` on p ranks for an input of ``shape`` (dim 0 gathered or
    scattered), or None where this rank receives nothing (``send``; ``gather`` off the root:
    ``receives=False``). ``shape[0]`` is divisible by p for ``reduce_scatter`` (checked before)."""
    shape = tuple(shape)
    if collective == "send" or (collective == "gather" and not receives):
        return None
    if collective in ("all_gather", "gather"):
        return (shape[0] * p,) + shape[1:]
    if collective == "reduce_scatter":
        return (shape[0] // p,) + shape[1:]
    return shape
