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
    return coll.reduce_scatter_dim0(F.linear(x, weight), group, scratch=True).then(bias_epilogue(bias))


def matmul_all_reduce(x, weight, bias, group, impl) -> Pending:
    # (m, k/p) x (k/p, n) -> (m, n) partial -(AR)-> (m, n)
    return coll.all_reduce(F.linear(x, weight), group, inplace=True).then(bias_epilogue(bias))


# --- the plain collectives (tp_kernels.Communicator): torch.distributed, bounded -------------------
# Each takes (x, out, peer, group, impl) as backends.run_collective passes them: contiguous
# tensors, dim 0 gathered or scattered; returns the output.


def all_reduce(x, out, peer, group, impl):
    if out is not x:
        out.copy_(x)
    return coll.all_reduce(out, group, inplace=True).wait()


def all_gather(x, out, peer, group, impl):
    return coll.all_gather_dim0(x, group, out=out).wait()


def reduce_scatter(x, out, peer, group, impl):
    return coll.reduce_scatter_dim0(x, group, out=out).wait()


def broadcast(x, out, peer, group, impl):
    if out is not x:
        out.copy_(x)
    return coll.broadcast(out, peer, group).wait()


def gather(x, out, peer, group, impl):
    coll.gather(x, out, peer, group).wait()
    return out


def send(x, out, peer, group, impl):
    coll.send(x, peer, group).wait()


def recv(x, out, peer, group, impl):
    return coll.recv(out, peer, group).wait()
