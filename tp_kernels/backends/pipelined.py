"""Chunked overlap of GEMM and collectives over async ``torch.distributed`` work handles.

Runs on any process group (gloo on the CPU, NCCL on GPUs). Chunk boundaries and order are
those of :mod:`tp_kernels.schedule`. The communication of one chunk is in flight (on the
backend's own threads or streams) while the next chunk multiplies. With one rank there is
nothing to overlap and the plain GEMM runs.
"""

from __future__ import annotations

import torch

from .. import _collectives as coll
from .._collectives import Pending
from ..schedule import chunk_bounds, ring
from . import reference


def _mm_into(out, x, weight_t, bias):
    if bias is None:
        torch.mm(x, weight_t, out=out)
    else:
        torch.addmm(bias, x, weight_t, out=out)


def all_gather_matmul(x, weight, bias, group, impl):
    p = coll.group_size(group)
    if p == 1:
        return reference.all_gather_matmul(x, weight, bias, group, impl)
    r = coll.group_rank(group)
    sources = ring(r, p).sources
    mp, k = x.shape
    n = weight.shape[0]
    weight_t = weight.t()
    gathered = x.new_empty((p * mp, k))  # (m, k): ring buffer, shard q at rows [q*mp, (q+1)*mp)
    out = x.new_empty((p * mp, n))
    gathered[r * mp : (r + 1) * mp].copy_(x)
    pieces = chunk_bounds(mp, impl.num_chunks)
    inflight = [None] * len(pieces)  # receive of piece j of the current step's shard
    sends = []
    for step in range(p):
        src = sources[step] * mp  # first row of the shard multiplied at this step
        nxt = sources[(step + 1) % p] * mp  # first row of the shard arriving meanwhile
        for j, (a, b) in enumerate(pieces):
            if inflight[j] is not None:
                inflight[j].wait()
            if step < p - 1:
                # forward piece j of this shard to rank r+1, receive piece j of the next from r-1
                send, inflight[j] = coll.ring_exchange(
                    gathered[src + a : src + b],
                    gathered[nxt + a : nxt + b],
                    group,
                    tag=step * len(pieces) + j,
                    what=f"all-gather+matmul ring step {step} piece {j}",
                )
                if send is not None:
                    sends.append(send)
            else:
                inflight[j] = None
            # (b-a, k) x (k, n/p) -> rows of (m, n/p)
            _mm_into(out[src + a : src + b], gathered[src + a : src + b], weight_t, bias)
    for work in sends:
        coll.wait(work, "all-gather+matmul ring send", group, cuda=x.is_cuda)
    return out, gathered


def matmul_reduce_scatter(x, weight, bias, group, impl) -> Pending:
    p = coll.group_size(group)
    if p == 1:
        return reference.matmul_reduce_scatter(x, weight, bias, group, impl)
    m, kp = x.shape
    n = weight.shape[0]
    mp = m // p
    weight_t = weight.t()
    out = x.new_empty((mp, n))
    blocks = x.reshape(p, mp, kp)  # destination-major
    chunks = []
    for a, b in chunk_bounds(mp, impl.num_chunks):
        # rows [a, b) of every destination's block: (p*(b-a), k/p) x (k/p, n) -(RS)-> (b-a, n)
        partial = torch.mm(blocks[:, a:b].reshape(p * (b - a), kp), weight_t)
        chunks.append(coll.reduce_scatter_dim0(partial, group, out=out[a:b], scratch=True))
    return Pending(out, deps=chunks, what="matmul+reduce-scatter", group=group, finish=reference.bias_epilogue(bias))


def matmul_all_reduce(x, weight, bias, group, impl) -> Pending:
    p = coll.group_size(group)
    if p == 1:
        return reference.matmul_all_reduce(x, weight, bias, group, impl)
    m = x.shape[0]
    weight_t = weight.t()
    out = x.new_empty((m, weight.shape[0]))
    chunks = []
    for a, b in chunk_bounds(m, impl.num_chunks):
        # (b-a, k/p) x (k/p, n) -(AR)-> rows [a, b) of (m, n)
        torch.mm(x[a:b], weight_t, out=out[a:b])
        chunks.append(coll.all_reduce(out[a:b], group, inplace=True))
    return Pending(out, deps=chunks, what="matmul+all-reduce", group=group, finish=reference.bias_epilogue(bias))
