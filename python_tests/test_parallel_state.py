"""Megatron rank layout: the pure function, and the real groups on 8 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

import tp_kernels
from tp_kernels import parallel_state
from tp_kernels.parallel_state import rank_layout
from helpers import rank_world


def test_layout_8_ranks_tp2_pp2():
    tp, pp, dp = rank_layout(8, 2, 2)
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dp == [[0, 2], [1, 3], [4, 6], [5, 7]]


@given(t=st.integers(1, 4), q=st.integers(1, 4), d=st.integers(1, 4))
def test_layout_partitions(t, q, d):
    w = t * q * d
    tp, pp, dp = rank_layout(w, t, q)
    for groups, size in ((tp, t), (pp, q), (dp, d)):
        assert sorted(r for g in groups for r in g) == list(range(w))  # a partition of the ranks
        assert all(len(g) == size for g in groups)
    # a rank is identified by its (TP group, PP group, DP group) coordinates
    coords = {}
    for kind, groups in (("tp", tp), ("pp", pp), ("dp", dp)):
        for i, g in enumerate(groups):
            for r in g:
                coords.setdefault(r, {})[kind] = i
    assert len({(c["tp"], c["pp"], c["dp"]) for c in coords.values()}) == w


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="does not divide"):
        rank_layout(8, 3, 1)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size \(2\) x pipeline_model_parallel_size \(3\) = 6 "
                                         r"does not divide the world size 8"):
        rank_layout(8, 2, 3)  # (each divides it, their product does not)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        rank_layout(8, 0, 1)
    for args, name in (((8, True, 1), "tensor_model_parallel_size"), ((8, 2, 2.0), "pipeline_model_parallel_size"),
                       ((True, 1, 1), "world_size")):
        with pytest.raises(ValueError, match=rf"{name}: expected a positive int, got"):
            rank_layout(*args)


def test_host_backend_reads_the_backend_of_host_tensors(monkeypatch):
    """A group's backend for host tensors is the ``cpu:`` entry of its backend config: gloo's, or
    the host side of ``cpu:gloo,cuda:nccl``; none for NCCL alone (then its fingerprints travel over
    a host twin)."""
    for config, backend in (("cpu:gloo,cuda:gloo", "gloo"), ("cuda:nccl", ""), ("cpu:gloo,cuda:nccl", "gloo"),
                            ("cuda:nccl,cpu:gloo", "gloo")):
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, config=config: config)
        assert parallel_state.host_backend() == backend, config
        assert parallel_state.carries_host_tensors() is (backend != ""), config


def _members(group):
    """The global ranks of ``group``, found by communicating over it."""
    size = dist.get_world_size(group)
    gathered = [torch.empty(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in gathered]


def _own_timeout(group) -> float:
    """The timeout ``group`` was made with (its gloo backend's options), in seconds."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def check_layout(t, q):
    rank, world = rank_world()
    with tp_kernels.settings.overriding(timeout=47.5):  # not the world's (World: 60 s), nor new_group's 30 min
        tp_kernels.initialize_model_parallel(t, q)
    try:
        for group in (tp_kernels.get_tensor_model_parallel_group(), tp_kernels.get_pipeline_model_parallel_group(),
                      tp_kernels.get_data_parallel_group()):
            assert _own_timeout(group) == 47.5
        with pytest.raises(RuntimeError, match="already initialized"):
            tp_kernels.initialize_model_parallel(t, q)
        tp, pp, dp = rank_layout(world, t, q)
        mine = lambda groups: next(g for g in groups if rank in g)
        assert _members(tp_kernels.get_tensor_model_parallel_group()) == mine(tp)
        assert _members(tp_kernels.get_pipeline_model_parallel_group()) == mine(pp)
        assert _members(tp_kernels.get_data_parallel_group()) == mine(dp)
        assert tp_kernels.get_tensor_model_parallel_world_size() == t
        assert tp_kernels.get_pipeline_model_parallel_world_size() == q
        assert tp_kernels.get_data_parallel_world_size() == world // (t * q)
        assert tp_kernels.get_tensor_model_parallel_rank() == mine(tp).index(rank)
        assert tp_kernels.get_pipeline_model_parallel_rank() == mine(pp).index(rank)
        assert tp_kernels.get_data_parallel_rank() == mine(dp).index(rank)
        # group=None now means the TP group: a layer sees p = t and sums over its TP group only
        layer = tp_kernels.RowParallelLinear(4 * t, 3, bias=False, init_method=torch.nn.init.ones_)
        assert layer.tp_size == t
        y = layer(torch.full((2, 4), float(rank)))  # [2, 4] x [4, 3] summed over the TP group
        assert torch.equal(y, torch.full((2, 3), 4.0 * sum(mine(tp))))
    finally:
        tp_kernels.destroy_model_parallel()
    assert not tp_kernels.model_parallel_is_initialized()
    assert tp_kernels.get_tensor_model_parallel_world_size() == world  # back to the default group
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        tp_kernels.get_pipeline_model_parallel_group()


def test_groups_on_8_ranks(world8):
    world8.run(check_layout, 2, 2)
    world8.run(check_layout, 4, 1)
    world8.run(check_layout, 1, 8)


def check_teardowns():
    """destroy_model_parallel calls each teardown registered with on_group_destroyed for each group
    this rank is in (tensor-, pipeline-, data-parallel), while the group still works, then
    destroys it; with no groups, it calls none."""
    seen = []

    def record(group):
        seen.append((group, _members(group)))  # (a collective over it: not yet destroyed)

    parallel_state.on_group_destroyed(record)
    try:
        tp_kernels.initialize_model_parallel(2, 2)
        groups = [tp_kernels.get_tensor_model_parallel_group(), tp_kernels.get_pipeline_model_parallel_group(),
                  tp_kernels.get_data_parallel_group()]
        members = [_members(g) for g in groups]
        tp_kernels.destroy_model_parallel()
        assert [g for g, _ in seen] == groups and [m for _, m in seen] == members, seen
        seen.clear()
        tp_kernels.destroy_model_parallel()
        assert not seen
    finally:
        parallel_state._TEARDOWNS.remove(record)
        tp_kernels.destroy_model_parallel()


def test_groups_on_4_ranks(world4):
    world4.run(check_layout, 2, 1)
    world4.run(check_teardowns)
