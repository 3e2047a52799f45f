"""The oracle: the collective, then the GEMM (or the reverse). Nothing is overlapped."""

from __future__ import annotations

import torch.nn.functional as F

from .. import _collectives as coll
from .._collectives import Pending


def bias_epilogue(bias):
    """The ``Pending.finish`` that adds ``bias`` once, after the reduction."""
    if bias is None:
        return None
    return lambda out: out.add_(bias)


def all_gather_matmul(x, weight, bias, group, impl):
    # (m/p, k) -(AG)-> (m, k) x (k, n/p) -> (m, n/p)
    gathered = coll.all_gather_dim0(x, group).wait()
    return F.linear(gathered, weight, bias), gathered


def matmul_reduce_scatter(x, weight, bias, group, impl) -> Pending:
    # (m, k/p) x (k/p, n) -> (m, n) partial -(RS)-> (m/p, n)
    rs = coll.reduce_scatter_dim0(F.linear(x, weight), group, scratch=True)
    return Pending(rs.tensor, deps=[rs], what=rs.what, group=group, finish=bias_epilogue(bias))


def matmul_all_reduce(x, weight, bias, group, impl) -> Pending:
    # (m, k/p) x (k/p, n) -> (m, n) partial -(AR)-> (m, n)
    ar = coll.all_reduce(F.linear(x, weight), group, inplace=True)
    return Pending(ar.tensor, deps=[ar], what=ar.what, group=group, finish=bias_epilogue(bias))
