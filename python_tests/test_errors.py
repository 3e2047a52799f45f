"""Bad input raises ValueError naming the argument before any collective (but the fingerprint
exchange that tells every rank about it); nothing hangs."""

from __future__ import annotations

import contextlib
import re
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tp_kernels
from tp_kernels import _agreement, _collectives, ops, settings
from helpers import library_timeout, rank_world


@contextlib.contextmanager
def no_collectives():
    """Make any collective or point-to-point call fail loudly (not with ValueError), but the
    exchange of the call's fingerprint (tp_kernels._agreement), which every rank makes, with its
    error, before any payload moves: here every rank makes the same call, so it is simulated."""

    def boom(*args, **kwargs):
        raise AssertionError("a collective was started before the input was checked")

    def same_call_everywhere(mine, group, device):
        return None  # every rank's fingerprint alike

    names = ["all_reduce", "all_gather", "isend", "irecv", "broadcast"]
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(dist, name, boom))
        for name in ("_pg_all_reduce", "_pg_all_gather", "_pg_reduce_scatter"):
            stack.enter_context(mock.patch.object(_collectives, name, boom))
        stack.enter_context(mock.patch.object(_agreement, "_views_if_they_differ", same_call_everywhere))
        yield


def bad_calls(p):
    """(expected argument name in the message, zero-argument callable) pairs; sizes not
    divisible by p only when p > 1."""
    x, w, b = torch.randn(4, 6), torch.randn(5, 6), torch.randn(5)
    col = tp_kernels.ColumnParallelLinear(6, 4 * p)
    col_sp = tp_kernels.ColumnParallelLinear(6, 4 * p, sequence_parallel=True)
    row = tp_kernels.RowParallelLinear(6 * p, 5)
    row_full = tp_kernels.RowParallelLinear(6 * p, 5, input_is_parallel=False)

    def integer_x_under_autocast():  # (autocast casts floating-point inputs only, as F.linear's does)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ops.matmul_all_reduce(x.long(), w, b)
    emb = tp_kernels.VocabParallelEmbedding(3 * p, 4)
    # parameters with gradients: float32, float64, float32 on another device
    graded, graded64, graded_meta = (nn.Parameter(torch.zeros(3, dtype=dtype, device=device))
                                     for dtype, device in ((None, None), (torch.float64, None), (None, "meta")))
    for param in (graded, graded64, graded_meta):
        param.grad = torch.ones_like(param)
    divisibility = [
        # (a column's output and a vocabulary p does not divide are padded: test_embedding_ce)
        ("in_features", lambda: tp_kernels.RowParallelLinear(6 * p + 1, 5)),
        (f"plan['fc*']: 'fc1' (rowwise) has in_features={4 * p + 1}, which the tensor-parallel size {p} does not "
         "divide", lambda: tp_kernels.parallelize(_Odd(p), {"fc*": "rowwise"})),
        (f"output_sizes[0] ({4 * p - 3}) is not divisible", lambda: tp_kernels.ColumnParallelLinear(
            6, 4 * p, output_sizes=[4 * p - 3, 3])),
        ("plan['fc1']: 'fc1': output_sizes[0] (5) is not divisible",
         lambda: tp_kernels.parallelize(_Tiny(p), {"fc1": ("colwise", [5, 4 * p - 5])})),
        # three key/value heads: neither split over 2 or 4 ranks nor replicated on them
        (f"output_sizes[1]: its 3 heads can neither be split over the tensor-parallel size {p} nor replicated on it "
         f"({p} is not a multiple of 3)", lambda: tp_kernels.ColumnParallelLinear(
             6, 4 * p + 12, output_sizes=[4 * p, 6, 6], head_size=2)),
        ("plan['fc1']: 'fc1': output_sizes[1]: its 3 heads can neither",
         lambda: tp_kernels.parallelize(_Tiny(p, out=4 * p + 6), {"fc1": ("colwise", [4 * p, 3, 3], 1)})),
        ("pass input_is_parallel=False", lambda: row(torch.randn(3, 6 * p))),
        ("x.shape[0]", lambda: ops.matmul_reduce_scatter(torch.randn(2 * p + 1, 6), w, b)),
        ("input.shape[0]", lambda: tp_kernels.mappings.scatter_to_sequence_parallel_region(torch.randn(2 * p + 1, 3))),
        ("input.shape[-1]", lambda: tp_kernels.mappings.scatter_to_tensor_model_parallel_region(torch.randn(3, 2 * p + 1))),
    ]
    calls = [
        # wrong input width
        ("input:", lambda: col(torch.randn(3, 7))),
        ("input:", lambda: row(torch.randn(3, 7))),
        ("input:", lambda: row_full(torch.randn(3, 6 * p + 1))),
        ("x", lambda: ops.all_gather_matmul(torch.randn(4, 7), w, b)),
        ("x", lambda: ops.matmul_all_reduce(torch.randn(4, 7), w, b)),
        ("bias", lambda: ops.matmul_all_reduce(x, w, torch.randn(4))),
        ("weight", lambda: ops.matmul_all_reduce(x, torch.randn(5, 6, 1), b)),
        # not tensors, or tensors of the wrong number of dims: each named, whichever is wrong
        ("x: expected a torch.Tensor", lambda: ops.matmul_all_reduce(x.tolist(), w, b)),
        ("weight: expected a torch.Tensor", lambda: ops.matmul_all_reduce(x, "w", b)),
        ("bias: expected a torch.Tensor", lambda: ops.matmul_all_reduce(x, w, b.tolist())),
        ("bias: expected a 1-D tensor", lambda: ops.matmul_all_reduce(x, w, b[None])),
        ("x: expected at least 2 dims", lambda: ops.all_gather_matmul(x[0], w, b)),
        ("x: expected at least 2 dims", lambda: ops.matmul_reduce_scatter(x[0], w, b)),  # (a row to scatter)
        ("input: expected a torch.Tensor, got list",
         lambda: tp_kernels.mappings.copy_to_tensor_model_parallel_region(x.tolist())),
        ("input: expected at least 1 dims, got shape ()",
         lambda: tp_kernels.mappings.reduce_from_tensor_model_parallel_region(x[0, 0])),
        ("input: expected at least 1 dims, got shape ()",
         lambda: tp_kernels.mappings.gather_from_sequence_parallel_region(x[0, 0])),
        ("params[1]: expected a tensor, got str", lambda: tp_kernels.allreduce_sequence_parallel_grads([graded, "w"])),
        ("params: every gradient must share one dtype and device",
         lambda: tp_kernels.allreduce_sequence_parallel_grads([graded, graded64])),
        ("params: every gradient must share one dtype and device",
         lambda: tp_kernels.allreduce_sequence_parallel_grads([graded, graded_meta])),
        # dtype / device mismatch between input and weight
        ("input:", lambda: col(torch.randn(3, 6, dtype=torch.float64))),
        ("input:", lambda: row(torch.randn(3, 6, dtype=torch.bfloat16))),
        ("x", lambda: ops.all_gather_matmul(x.double(), w, b)),
        ("weight: expected a floating-point tensor, got torch.int64",
         lambda: ops.matmul_all_reduce(x.long(), w.long(), b.long())),
        ("x: dtype torch.int64 does not match weight's dtype torch.float32", integer_x_under_autocast),
        ("bias", lambda: ops.matmul_reduce_scatter(torch.randn(2 * p, 6), w, b.half())),
        ("bias: device meta does not match weight's device cpu",
         lambda: ops.matmul_all_reduce(x, w, torch.randn(5, device="meta"))),
        ("input:", lambda: col(torch.randn(3, 6, device="meta"))),
        ("input:", lambda: emb(torch.zeros(3, dtype=torch.long, device="meta"))),
        # sequence parallelism needs a dim 0 to split
        ("input:", lambda: col_sp(torch.randn(6))),
        # options
        ("sequence_parallel", lambda: tp_kernels.RowParallelLinear(6 * p, 5, input_is_parallel=False, sequence_parallel=True)),
        ("backend", lambda: ops.matmul_all_reduce(x, w, b, backend="fast")),
        ("backend", lambda: tp_kernels.ColumnParallelLinear(6, 4 * p, backend="nccl")),
        ("num_chunks", lambda: ops.matmul_all_reduce(x, w, b, num_chunks=0)),
        ("num_chunks", lambda: ops.all_gather_matmul(x, w, b, num_chunks=2.5)),
        ("num_chunks: expected an int >= 1, got 0", lambda: tp_kernels.RowParallelLinear(6 * p, 5, num_chunks=0)),
        ("linear: expected an nn.Linear, got Embedding",
         lambda: tp_kernels.ColumnParallelLinear.from_linear(torch.nn.Embedding(4, 6))),
        ("in_features", lambda: tp_kernels.ColumnParallelLinear(0, 4 * p)),
        (f"output_sizes: [{p}, {p}] sum to {2 * p}, not to out_features={4 * p}",
         lambda: tp_kernels.ColumnParallelLinear(6, 4 * p, output_sizes=[p, p])),
        ("output_sizes: expected a non-empty sequence",
         lambda: tp_kernels.ColumnParallelLinear(6, 4 * p, output_sizes=4 * p)),
        ("output_sizes[0]: expected an int >= 1",
         lambda: tp_kernels.ColumnParallelLinear(6, 4 * p, output_sizes=[0, 4 * p])),
        ("plan['fc1']: expected a style", lambda: tp_kernels.parallelize(_Tiny(p), {"fc1": ("rowwise", [4 * p])})),
        ("head_size: goes with output_sizes", lambda: tp_kernels.ColumnParallelLinear(6, 4 * p, head_size=2)),
        ("head_size: expected an int >= 1", lambda: tp_kernels.ColumnParallelLinear(
            6, 4 * p, output_sizes=[2 * p, 2 * p], head_size=0)),
        ("output_sizes[1] (3) is not a whole number of heads of head_size=2", lambda: tp_kernels.ColumnParallelLinear(
            6, 4 * p + 6, output_sizes=[4 * p, 3, 3], head_size=2)),
        ("plan['fc1']: 'fc1': head_size: expected an int >= 1",
         lambda: tp_kernels.parallelize(_Tiny(p), {"fc1": ("colwise", [2 * p, 2 * p], "2")})),
        ("plan: 'fc1' is matched as 'colwise', but the same module ('fc1') as ('colwise', [",
         lambda: tp_kernels.parallelize(_Tiny(p), {"fc1": ("colwise", [2 * p, 2 * p]), "fc*1": "colwise"})),
        ("linear", lambda: tp_kernels.ColumnParallelLinear.from_linear(nn.Conv1d(2, 2, 1))),
        # a subclass whose replacement would lose its own parameters or forward
        ("linear: _Adapted is an nn.Linear that also holds 'lora_a'",
         lambda: tp_kernels.ColumnParallelLinear.from_linear(_Adapted(6, 4 * p))),
        ("embedding: _Shifted is an nn.Embedding with a forward of its own, which is not the lookup times a constant",
         lambda: tp_kernels.VocabParallelEmbedding.from_embedding(_Shifted(3 * p, 2))),
        ("linear: _WithChild is an nn.Linear that also holds 'adapter'",
         lambda: tp_kernels.ColumnParallelLinear.from_linear(_WithChild(6, 4 * p))),
        ("linear: _WithScratch is an nn.Linear that also holds 'scratch'",
         lambda: tp_kernels.RowParallelLinear.from_linear(_WithScratch(6 * p, 4))),
        ("plan['fc1']: 'fc1': _Adapted is an nn.Linear that also holds 'lora_a'",
         lambda: tp_kernels.parallelize(_Tiny(p, _Adapted), {"fc1": "colwise"})),
        ("linear: this Linear has hooks registered on it (_forward_hooks)", lambda: tp_kernels.ColumnParallelLinear
         .from_linear(_hooked(nn.Linear(6, 4 * p)))),
        ("embedding: max_norm=1.0 is not supported",
         lambda: tp_kernels.VocabParallelEmbedding.from_embedding(nn.Embedding(3 * p, 2, max_norm=1.0))),
        ("embedding: sparse=True is not supported",
         lambda: tp_kernels.VocabParallelEmbedding.from_embedding(nn.Embedding(3 * p, 2, sparse=True))),
        ("embedding: scale_grad_by_freq=True is not supported",
         lambda: tp_kernels.VocabParallelEmbedding.from_embedding(nn.Embedding(3 * p, 2, scale_grad_by_freq=True))),
        ("output_scale: expected a number or None, got True",
         lambda: tp_kernels.VocabParallelEmbedding(3 * p, 2, output_scale=True)),
        ("output_scale: expected a number or None, got '2'",
         lambda: tp_kernels.VocabParallelEmbedding(3 * p, 2, output_scale="2")),
        (f"padding_idx: must be within num_embeddings ({3 * p}), got {-3 * p - 1}",
         lambda: tp_kernels.VocabParallelEmbedding(3 * p, 2, padding_idx=-3 * p - 1)),
        # parallelize plans
        ("plan", lambda: tp_kernels.parallelize(_Tiny(p), {"fc1": "diagonal"})),
        ("plan", lambda: tp_kernels.parallelize(_Tiny(p), {"fc9": "colwise"})),
        ("plan", lambda: tp_kernels.parallelize(_Tiny(p), {"emb": "colwise"})),
        ("plan", lambda: tp_kernels.parallelize(_Tiny(p), {"fc*": "colwise", "fc2": "rowwise"})),
        ("plan", lambda: tp_kernels.parallelize(_Tiny(p), {})),
        ("module", lambda: tp_kernels.parallelize("fc1", {"fc1": "colwise"})),
    ]
    return (divisibility if p > 1 else []) + calls


class _Odd(nn.Module):
    """Split sizes p does not divide."""

    def __init__(self, p):
        super().__init__()
        self.fc1 = nn.Linear(4 * p + 1, 6)


class _Tiny(nn.Module):
    def __init__(self, p, linear=nn.Linear, out=None):
        super().__init__()
        self.emb = nn.Embedding(3 * p, 6)
        self.fc1 = linear(6, out or 4 * p)
        self.fc2 = nn.Linear(4 * p, 6)


class _Adapted(nn.Linear):
    """A linear layer with an adapter of its own (as LoRA's)."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.lora_a = nn.Parameter(torch.zeros(2, in_features))


class _WithChild(nn.Linear):
    """A linear layer holding a module of its own (an adapter as a submodule)."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.adapter = nn.Linear(in_features, 2, bias=False)


class _WithScratch(nn.Linear):
    """A linear layer with nn.Linear's forward and a buffer kept out of its state dict."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def _hooked(module):
    module.register_forward_hook(lambda m, args, out: out * 2)
    return module


class _Renamed(nn.Linear):
    """A subclass that adds nothing (as torch's NonDynamicallyQuantizableLinear): replaceable."""


class _Shifted(nn.Embedding):
    def forward(self, ids):  # (not the lookup times a constant, which a parallel embedding computes)
        return super().forward(ids) + 2


def check_bad_input():
    r, p = rank_world()
    for i, (name, call) in enumerate(bad_calls(p)):
        with no_collectives():
            with pytest.raises(ValueError) as info:
                call()
                pytest.fail(f"case {i} ({name}) did not raise")
        assert name in str(info.value), f"expected {name!r} in the message, got: {info.value}"
    # parallelize checks the whole plan before replacing anything
    tiny = _Tiny(p)
    with pytest.raises(ValueError):
        tp_kernels.parallelize(tiny, {"fc1": "colwise", "fc9": "rowwise"})
    assert isinstance(tiny.fc1, nn.Linear)
    torch.manual_seed(0)  # (every rank the same dense model: parallelize checks)
    renamed = tp_kernels.parallelize(_Tiny(p, _Renamed), {"fc1": "colwise"})
    assert isinstance(renamed.fc1, tp_kernels.ColumnParallelLinear)


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_bad_input_raises_before_collectives(world):
    world.run(check_bad_input)


def check_not_a_member():
    r, p = rank_world()
    group = dist.new_group([0, 1])
    if r >= 2:
        with no_collectives(), pytest.raises(ValueError, match="group"):
            ops.matmul_all_reduce(torch.randn(3, 4), torch.randn(5, 4), group=group)
        with pytest.raises(ValueError, match="group"):
            tp_kernels.ColumnParallelLinear(4, 6, group=group)
    else:
        layer = tp_kernels.ColumnParallelLinear(4, 6, group=group)
        assert layer.tp_size == 2 and layer.tp_rank == r


def test_group_membership_checked(world4):
    world4.run(check_not_a_member)


def check_missing_peer_times_out(op, backend):
    """Rank 0 calls the op, rank 1 never does: rank 0 gets a clear error, not a hang."""
    r, p = rank_world()
    group = dist.new_group([0, 1])  # used once, then abandoned: its state is undefined after
    if r != 0:
        return None
    with library_timeout(2):
        x = torch.randn(4, 6)
        w = torch.randn(5, 6)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="did not complete") as info:
            getattr(ops, op)(x, w, group=group, backend=backend)
        elapsed = time.monotonic() - start
    assert elapsed < 15, f"the timeout of 2 s took {elapsed:.1f} s"
    assert "set_timeout" in str(info.value)
    # fingerprints off (the default): the error says how to have calls that differ named instead
    assert "set TP_KERNELS_FINGERPRINTS=1" in str(info.value) and not settings.fingerprints_enabled()
    return elapsed


@pytest.mark.parametrize("backend", ["reference", "pipelined"])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_missing_peer_times_out(world2, op, backend):
    world2.run(check_missing_peer_times_out, op, backend)


def test_a_timeout_says_how_to_find_calls_that_differ_only_where_fingerprints_are_off(monkeypatch):
    monkeypatch.setattr(_collectives.dist, "get_rank", lambda group=None: 3)
    for on in (False, True):
        with settings.overriding(fingerprints=on):
            message = str(_collectives._dead_peer_error("all-reduce of (4,)", None, 5.0, RuntimeError("timed out")))
        assert message.startswith("tp_kernels: all-reduce of (4,) did not complete on global rank 3 (group of 1 ranks")
        assert ("TP_KERNELS_FINGERPRINTS=1" in message) is not on, message


#: a Communicator call of rank 0 that rank 1 never makes
COLLECTIVE_CALLS = {
    "all_reduce": lambda c, x: c.all_reduce(x),
    "all_gather": lambda c, x: c.all_gather(x, dim=0),
    "reduce_scatter": lambda c, x: c.reduce_scatter(x, dim=0),
    "gather": lambda c, x: c.gather(x, dst=0, dim=0),
    "broadcast": lambda c, x: c.broadcast(x, src=0),
    "recv": lambda c, x: c.recv((4, 6), torch.float32, src=1),
}
#: what the error of each says did not complete
COLLECTIVE_WHAT = {
    "all_reduce": "all-reduce of (4, 6) torch.float32",
    "all_gather": "all-gather of (1, 4, 6) torch.float32",  # dim 0 of the Communicator: a leading block dim
    "reduce_scatter": "all-reduce of (4, 6) torch.float32",  # on the host, through an all-reduce
    "gather": "gather of (1, 4, 6) torch.float32 to rank 0",
    "broadcast": "broadcast of (4, 6) torch.float32 from rank 0",
    "recv": "recv of (4, 6) torch.float32 from rank 1",
}


def check_missing_peer_times_out_in_a_collective(name):
    """Every host collective of the Communicator is bounded by the timeout too."""
    r, p = rank_world()
    group = dist.new_group([0, 1])  # used once, then abandoned
    if r != 0:
        return None
    with library_timeout(2):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=re.escape(f"{COLLECTIVE_WHAT[name]} did not complete")):
            COLLECTIVE_CALLS[name](tp_kernels.Communicator(group), torch.randn(4, 6))
        elapsed = time.monotonic() - start
    assert elapsed < 15, f"the timeout of 2 s took {elapsed:.1f} s"
    return elapsed


@pytest.mark.parametrize("name", sorted(COLLECTIVE_CALLS))
def test_missing_peer_times_out_in_a_collective(world2, name):
    world2.run(check_missing_peer_times_out_in_a_collective, name)


def test_timeout_setting():
    old = tp_kernels.get_timeout()
    try:
        tp_kernels.set_timeout(12.5)
        assert tp_kernels.get_timeout() == 12.5
        with pytest.raises(ValueError, match="seconds"):
            tp_kernels.set_timeout(0)
    finally:
        tp_kernels.set_timeout(old)
