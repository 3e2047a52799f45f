"""The raw collectives (``tp_kernels._collectives``) on their own: what the ops, layers and
checkpoints build on without checking it again. A pending result completes once however often it
is waited for; the layout helpers undo each other; the reductions other than a sum are that
reduction, before and after a sum; the byte exchanges keep rank order; the guards of the helpers
that callers reach directly raise before anything is sent."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from tp_kernels import _collectives as coll

from helpers import rank_world


class _Work:
    """A collective's work as the backends give it: ``wait(timeout)``, counted."""

    def __init__(self):
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1


def test_a_pending_result_completes_once():
    """``Pending.wait`` waits for its dependencies, then its works, then runs its epilogues in the
    order ``then`` added them, once: waiting again returns the same tensor and repeats nothing (a
    bias added after a reduction is added once)."""
    log = []
    dep_work, work = _Work(), _Work()
    dep = coll.Pending(torch.zeros(1), (dep_work,), "a chunk", finish=lambda t: log.append("chunk"))
    out = torch.zeros(2)
    pending = coll.Pending(out, (work,), "the call", deps=(dep,),
                           finish=lambda t: log.append(("first", dep_work.waits)))
    assert pending.then(lambda t: t.add_(1)).then(None).then(lambda t: log.append("second")) is pending
    for _ in range(3):
        assert pending.wait() is out
    assert log == ["chunk", ("first", 1), "second"]
    assert (dep_work.waits, work.waits) == (1, 1)
    assert torch.equal(out, torch.ones(2))


@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=4), pick=st.integers(0, 3), p=st.integers(1, 4))
def test_blocks_cut_and_joined(shape, pick, p):
    """The layouts of every gather and scatter along a dim other than 0: ``join_stacked`` joins the
    blocks of a ``[p, *shape]`` tensor along ``dim`` as ``torch.cat`` does, and ``join_blocks``
    (``dim`` counted from either end) those of ``[p*b, ...]``, each contiguous, and a new tensor
    (not a view) unless the dims before ``dim`` are all 1 (then a view that autograd does not
    track as one), ``dim`` is 0 or there is one block; ``blocks_first`` cuts them apart again,
    contiguous (block r of the result is block r of ``dim``). Blocks one wide included: a reshape
    alone gives a view that is not contiguous there."""
    dim = pick % len(shape)
    stacked = torch.arange(p * math.prod(shape)).reshape(p, *shape)
    want = torch.cat(list(stacked), dim)
    joined = [coll.join_blocks(stacked.flatten(0, 1), d, p) for d in (dim, dim - len(shape))]
    if dim:
        joined.append(coll.join_stacked(stacked, dim))
    for got in joined:
        assert torch.equal(got, want) and got.is_contiguous(), (shape, dim, p)
        assert got._base is None or math.prod(shape[:dim]) == 1 or p == 1, "a view of the gathered blocks"
    cut = coll.blocks_first(want, dim, p)
    assert cut.is_contiguous() and torch.equal(cut, stacked.flatten(0, 1)), (shape, dim, p)


def check_helpers(flag: str):
    r, p = rank_world()
    group = coll.resolve_group(None)
    assert coll.group_from_name(coll.group_name(group)) is group
    assert coll.group_name(None) == "" and coll.group_from_name("") is None

    # Reductions other than a sum, between sums: each is its own reduction.
    want = {dist.ReduceOp.SUM: p * (p + 1) / 2, dist.ReduceOp.MAX: p, dist.ReduceOp.MIN: 1,
            dist.ReduceOp.PRODUCT: math.factorial(p)}
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, dist.ReduceOp.SUM,
               dist.ReduceOp.MAX):
        x = torch.tensor([r + 1.0], dtype=torch.float64)
        assert coll.all_reduce(x, group, op=op).wait().item() == want[op], op
        assert x.item() == r + 1.0  # (not in place: a copy)

    # A reduce-scatter of host tensors leaves its input as it was, unless it is scratch.
    x = torch.arange(2.0 * p * 3).reshape(2 * p, 3) * (r + 1)
    before = x.clone()
    got = coll.reduce_scatter_dim0(x, group).wait()
    assert torch.equal(got, (torch.arange(2.0 * p * 3).reshape(2 * p, 3) * p * (p + 1) / 2)[2 * r:2 * r + 2])
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match=rf"reduce-scatter: dim 0 \({p + 1}\) is not divisible by the group size {p}"):
        coll.reduce_scatter_dim0(torch.zeros(p + 1, 2), group)

    # Bytes: every rank's in rank order; a pair's swapped.
    mine = bytes([r, 7, 255 - r])
    assert coll.all_gather_bytes(mine, group, torch.device("cpu")) == [bytes([q, 7, 255 - q]) for q in range(p)]
    with pytest.raises(ValueError, match="payload: expected at least one byte"):
        coll.all_gather_bytes(b"", group, torch.device("cpu"))
    assert coll.swap_bytes(mine, r ^ 1, group, torch.device("cpu")) == bytes([r ^ 1, 7, 255 - (r ^ 1)])

    # A gather of complex numbers, to the last rank: the root's result is the buffer it gave.
    dst = p - 1
    x = torch.tensor([complex(r, -r), complex(2 * r, 1)], dtype=torch.complex64)
    out = torch.empty(2 * p, dtype=torch.complex64) if r == dst else None
    got = coll.gather(x, out, dst, group).wait()
    if r == dst:
        assert got is out
        assert torch.equal(out, torch.tensor([v for q in range(p) for v in (complex(q, -q), complex(2 * q, 1))],
                                             dtype=torch.complex64))
    else:
        assert got is x

    # A barrier returns on each rank once every rank has called it: rank 0 finds the flag the last
    # rank writes just before its own call, late.
    if r == p - 1:
        time.sleep(0.5)
        open(flag, "w").close()
    coll.barrier(group, torch.device("cpu"))
    assert os.path.exists(flag)
    coll.barrier(group, torch.device("cpu"))  # (no rank removes it before rank 0 looked)
    if r == p - 1:
        os.remove(flag)


def test_a_collective_that_fails_to_start_raises_as_a_dead_peer_does(monkeypatch):
    """A backend error starting a collective (a peer's connection gone) is raised as a failed wait
    is: what the collective was, on which rank, and what to do, the backend's message kept."""
    monkeypatch.setattr(coll.dist, "get_rank", lambda *args: 3)

    def start():
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(RuntimeError, match=r"^tp_kernels: all-reduce did not complete on global rank 3 \(group of 1 "
                                           r"ranks, timeout .* s\): Connection reset by peer\. A peer rank may have "
                                           r"died") as caught:
        coll._issue("all-reduce", None, torch.zeros(2), start)
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_ring_exchange_hands_back_the_send_apart_and_the_receive_as_the_pending_result(monkeypatch):
    """ring_exchange issues its send to the next rank and its receive from the previous as one
    batch, and returns the send's work apart and the receive's in the pending result, so that
    waiting for that result waits for the data received (not for the send); where the backend
    coalesces the batch into one work, that work is the pending result's."""
    issued = []

    class Group:
        def rank(self):
            return 1

        def size(self):
            return 3

    def batch(ops):
        issued.extend(ops)
        return [f"work {op[0]} {op[2]}" for op in ops]

    monkeypatch.setattr(coll.dist, "get_global_rank", lambda group, q: 10 + q)
    monkeypatch.setattr(coll.dist, "P2POp", lambda fn, t, peer, group, tag: (fn.__name__, t, peer, tag))
    monkeypatch.setattr(coll.dist, "batch_isend_irecv", batch)
    send, recv = torch.zeros(2), torch.empty(2)
    sent, pending = coll.ring_exchange(send, recv, Group(), 7, "ring step")
    assert [(name, t is send, t is recv, peer, tag) for name, t, peer, tag in issued] == [
        ("isend", True, False, 12, 7), ("irecv", False, True, 10, 7)]
    assert sent == "work isend 12" and pending.works == ("work irecv 10",) and pending.tensor is recv
    monkeypatch.setattr(coll.dist, "batch_isend_irecv", lambda ops: ["coalesced"])
    assert coll.ring_exchange(send, recv, Group(), 7, "ring step")[0] is None


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_the_helpers_on_several_ranks(world, tmp_path):
    world.run(check_helpers, str(tmp_path / "last_rank_arrived"))


def check_the_group_a_call_runs_on():
    from torch.distributed.device_mesh import DeviceMesh

    from tp_kernels import ops, parallel_state

    r, p = rank_world()
    world = dist.group.WORLD
    assert coll.resolve_group(None) is (parallel_state.tensor_model_parallel_group_or_none() or world)
    assert coll.resolve_group(world) is world
    assert coll.resolve_group(DeviceMesh.from_group(world, "cpu")) is world  # a one-dim mesh: its group
    with pytest.raises(ValueError, match=r"group: a DeviceMesh of 2 dims .* pass its tensor-parallel dim"):
        coll.resolve_group(DeviceMesh("cpu", torch.arange(p).reshape(1, p)))
    x, w = torch.randn(4, 8), torch.randn(6, 8)  # (a call on the mesh runs on its group)
    torch.testing.assert_close(ops.matmul_all_reduce(x, w, group=DeviceMesh.from_group(world, "cpu")),
                               ops.matmul_all_reduce(x, w, group=world))


def test_the_group_a_call_runs_on(world2):
    """``resolve_group``: None is the tensor-parallel group, else the default one; a process group
    is itself; a one-dim DeviceMesh is its group (a call on it runs on that group), one of more dims
    an error saying what to pass. (A group this process is no member of: test_errors.)"""
    world2.run(check_the_group_a_call_runs_on)
