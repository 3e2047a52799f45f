"""The random streams of tp_kernels.rng: the default stream the same on every rank, the
model-parallel stream each rank's own, a tensor-parallel block with dropout against the dense
block with the same masks in float64, and activation checkpointing replaying the forward's
masks."""

from __future__ import annotations

import contextlib
import functools
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tp_kernels
from helpers import assert_close, block, rank_world
from tp_kernels import rng

SEED = 1234
DROP = 0.3


def draws(seed: int, sizes, device="cpu") -> torch.Tensor:
    """What a stream seeded ``seed`` gives to ``torch.rand(n)`` for each ``n`` of ``sizes`` in turn,
    joined (call by call: on CUDA, two calls do not draw what one call of both sizes draws)."""
    g = torch.Generator(device).manual_seed(seed)
    return torch.cat([torch.rand(n, generator=g, device=device) for n in sizes])


def gathered(t: torch.Tensor):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def check_streams(device="cpu"):
    """After model_parallel_manual_seed, the default stream is the seed's on every rank, and a
    fork draws the rank's own stream (seed + 2718 + rank), going on across forks, without moving
    the default stream; get_states/set_states go back to a state."""
    r, p = rank_world()
    rng.model_parallel_manual_seed(SEED)
    tracker = rng.get_rng_tracker()
    assert tracker.seeds() == {rng.MODEL_PARALLEL_RNG: SEED + 2718 + r}
    before = torch.rand(3, device=device)
    with tracker.fork():
        forked = torch.rand(4, device=device)
    between = torch.rand(2, device=device)
    with tracker.fork():
        forked = torch.cat([forked, torch.rand(4, device=device)])
    after = torch.rand(3, device=device)
    assert torch.equal(torch.cat([before, between, after]), draws(SEED, [3, 2, 3], device))
    assert torch.equal(forked, draws(SEED + 2718 + r, [4, 4], device))
    views = gathered(forked)
    assert all(not torch.equal(views[q], views[r]) for q in range(p) if q != r)

    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(5, device=device)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(5, device=device), first)

    tracker.add("other", 99)
    with tracker.fork(), tracker.fork("other"):  # streams nest; the inner one draws
        assert torch.equal(torch.rand(3, device=device), draws(99, [3], device))
    with pytest.raises(RuntimeError, match="already forked"):
        with tracker.fork(), tracker.fork():
            pass
    with tracker.fork():  # the failed nesting left the stream usable, and where it was
        assert torch.equal(torch.rand(5, device=device), draws(SEED + 2718 + r, [4, 4, 5, 5], device)[13:])


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_the_default_stream_is_shared_and_the_forked_one_is_each_ranks(world):
    world.run(check_streams)


class Block(nn.Module):
    """A transformer MLP with dropout: on the hidden units (each rank's own under tensor
    parallelism) and on the output (replicated, or under sequence parallelism each rank's block
    of the sequence)."""

    def __init__(self, dim=6, hidden=8):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x, masks):
        return self.down(self.up(x).relu() * masks[0]) * masks[1]


class ParallelBlock(nn.Module):
    def __init__(self, dense: Block, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.up = tp_kernels.ColumnParallelLinear.from_linear(dense.up, sequence_parallel=sequence_parallel)
        self.down = tp_kernels.RowParallelLinear.from_linear(dense.down, input_is_parallel=True,
                                                             sequence_parallel=sequence_parallel)

    def forward(self, x):
        tracker = rng.get_rng_tracker()
        with tracker.fork():
            h = F.dropout(self.up(x).relu(), DROP)
        y = self.down(h)
        with tracker.fork() if self.sequence_parallel else contextlib.nullcontext():
            return F.dropout(y, DROP)


def masks_drawn(rows, hidden, dim, sequence_parallel, device):
    """The dense block's two masks, made of what each rank draws: the hidden mask from the
    rank's stream, joined over the ranks; the output mask from the default stream (replicated), or
    under sequence parallelism from each rank's stream after its hidden mask, joined over the
    sequence."""
    r, p = rank_world()
    ones = functools.partial(torch.ones, dtype=torch.float64, device=device)  # contiguous, as the activations
    devices = [torch.cuda.current_device()] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED + 2718 + r)
        hidden_mask = F.dropout(ones(rows, hidden // p), DROP)
        own_out = F.dropout(ones(rows // p, dim), DROP) if sequence_parallel else None
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED)
        out_mask = F.dropout(ones(rows, dim), DROP)
    if sequence_parallel:
        out_mask = torch.cat(gathered(own_out), 0)
    return torch.cat(gathered(hidden_mask), 1), out_mask


def run_block(par, x, dy, wrap):
    par.zero_grad()
    x = x.detach().requires_grad_()
    rng.model_parallel_manual_seed(SEED)
    y = wrap(par, x)
    y.backward(dy)
    return y.detach(), x.grad, [param.grad.clone() for param in par.parameters()]


def check_parallel_dropout(sequence_parallel, device="cpu"):
    """The parallel block, its dropout drawn from the streams, equals the dense block with the
    masks those streams draw (float64); its replicated output is the same on every rank; and
    checkpointing it with tp_kernels.rng.checkpoint (or with a selective policy) gives bitwise
    the gradients of running it plainly."""
    r, p = rank_world()
    rows, dim, hidden = 4 * p, 6, 4 * p
    torch.manual_seed(0)
    dense = Block(dim, hidden).double().to(device)
    par = ParallelBlock(dense, sequence_parallel)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64).to(device).requires_grad_()
    dy = torch.randn(rows, dim, generator=g, dtype=torch.float64).to(device)
    mine = (lambda t: block(t, 0, r, p)) if sequence_parallel else (lambda t: t)

    y, dx, grads = run_block(par, mine(x), mine(dy), lambda m, x: m(x))
    ref = dense(x, masks_drawn(rows, hidden, dim, sequence_parallel, device))
    ref.backward(dy)
    assert_close("output", y, mine(ref))
    assert_close("input gradient", dx, mine(x.grad))
    assert_close("up.weight gradient", grads[0], block(dense.up.weight.grad, 0, r, p))
    assert_close("down.weight gradient", grads[2], block(dense.down.weight.grad, 1, r, p))
    if not sequence_parallel:
        assert all(torch.equal(view, y) for view in gathered(y)), "the replicated output differs between ranks"

    policy = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
                               [torch.ops.aten.mm.default])
    for wrap in (lambda m, x: rng.checkpoint(m, x),
                 lambda m, x: rng.checkpoint(m, x, context_fn=policy),
                 lambda m, x: rng.checkpoint(m, x, preserve_rng_state=True, determinism_check="default")):
        y2, dx2, grads2 = run_block(par, mine(x), mine(dy), wrap)
        assert torch.equal(y2, y)
        assert torch.equal(dx2, dx)
        assert all(torch.equal(a, b) for a, b in zip(grads2, grads))


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_in_a_parallel_block_matches_the_dense_block_and_checkpoints_exactly(world, sequence_parallel):
    world.run(check_parallel_dropout, sequence_parallel)


def _dropout_case(fork=lambda: rng.get_rng_tracker().fork()):
    """``(f, x)``: ``f`` a float64 linear layer (seeded 0) whose output is dropped at 0.5 inside
    ``fork()`` (the tracker's model-parallel stream by default), ``x`` its input, needing its grad."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 5).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def f(x):
        with fork():
            return F.dropout(lin(x), 0.5)
    return f, x


def test_checkpoint_recomputes_the_forwards_masks_after_the_stream_moved_on():
    """Backward twice through a retained graph recomputes twice; the stream drawn meanwhile does
    not change what the recomputation draws, and it is where it was afterwards. torch's own
    checkpoint, which does not know the tracker, recomputes with other masks."""
    f, x = _dropout_case()
    tracker = rng.get_rng_tracker()

    rng.model_parallel_manual_seed(SEED)
    plain = f(x)
    (dx_plain,) = torch.autograd.grad(plain.sum(), x)
    with tracker.fork():
        expected = torch.rand(7), torch.rand(4)
    rng.model_parallel_manual_seed(SEED)
    y = rng.checkpoint(f, x)
    with tracker.fork():
        assert torch.equal(torch.rand(7), expected[0])
    state = tracker.get_states()
    for _ in range(2):
        (dx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        assert torch.equal(dx, dx_plain)
    assert torch.equal(y, plain)
    assert all(torch.equal(state[n][d], tracker.get_states()[n][d]) for n in state for d in state[n])
    with tracker.fork():
        assert torch.equal(torch.rand(4), expected[1])
    rng.model_parallel_manual_seed(SEED)
    y = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)  # torch's replays the default stream only
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, plain) and not torch.equal(dx, dx_plain)


def test_checkpoint_runs_the_context_fns_contexts():
    """A ``context_fn``'s two contexts (a selective-checkpointing policy's) are kept: the first
    around the forward, the second around the recompute, whose masks drawn in a fork are still the
    forward's (the gradient the plain run's, bit for bit)."""
    events = []

    @contextlib.contextmanager
    def context(name):
        events.append(f"enter {name}")
        try:
            yield
        finally:  # (torch stops a recompute early by raising through it once it has what it needs)
            events.append(f"exit {name}")

    dropped, x = _dropout_case()

    def f(x):
        events.append("run")
        return dropped(x)

    rng.model_parallel_manual_seed(SEED)
    plain = f(x)
    (dx_plain,) = torch.autograd.grad(plain.sum(), x)
    events.clear()
    rng.model_parallel_manual_seed(SEED)
    y = rng.checkpoint(f, x, context_fn=lambda: (context("forward"), context("recompute")))
    assert events == ["enter forward", "run", "exit forward"]
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert events[3:] == ["enter recompute", "run", "exit recompute"]
    assert torch.equal(y, plain) and torch.equal(dx, dx_plain)


def check_rank_fork():
    """``rank_fork`` draws a stream of each rank's own (another at each fork), the default stream
    afterwards where one draw of it leaves it (alike on every rank), and torch's own checkpoint,
    reentrant or not, draws the forward's masks again: its gradients bit for bit the plain run's,
    no seed of the tracker's needed. Forks nest (the inner one's seed drawn from the outer one's stream)."""
    r, p = rank_world()
    torch.manual_seed(SEED)
    with rng.rank_fork():
        first = torch.rand(6)
    with rng.rank_fork():
        second = torch.rand(6)
        with rng.rank_fork():
            inner = torch.rand(6)
        assert not torch.equal(torch.rand(6), inner)
    after = torch.rand(4)
    assert not torch.equal(first, second) and not torch.equal(second, inner)
    views = gathered(first)
    assert all(not torch.equal(views[q], views[r]) for q in range(p) if q != r)
    torch.manual_seed(SEED)
    for _ in range(2):  # (what the two outer forks drew of the default stream, one number each; the inner one drew
        # its seed from the fork around it)
        torch.randint(2**63 - 1, ())
    assert torch.equal(torch.rand(4), after)
    assert all(torch.equal(v, after) for v in gathered(after))

    f, x = _dropout_case(rng.rank_fork)

    torch.manual_seed(SEED)
    plain = f(x)
    (dx_plain,) = torch.autograd.grad(plain.sum(), x)
    for reentrant in (False, True):
        x.grad = None
        torch.manual_seed(SEED)
        y = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=reentrant)
        torch.rand(3)  # (the default stream moved on before the backward recomputes)
        y.sum().backward()
        assert torch.equal(y, plain) and torch.equal(x.grad, dx_plain), reentrant


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_rank_fork(world):
    world.run(check_rank_fork)


def check_seeds_that_differ():
    """Ranks given different seeds would drop their replicated activations differently: the
    same error on every rank, naming each rank's seed, and the group works afterwards. A seed
    whose last rank's stream would leave the seeds' range is refused on every rank."""
    r, p = rank_world()
    with pytest.raises(RuntimeError, match=re.escape("rank 0: model_parallel_manual_seed: seed 5; "
                                                     "rank 1: model_parallel_manual_seed: seed 6")):
        rng.model_parallel_manual_seed(5 + r)
    edge = rng.SEED_LIMIT - rng.SEED_OFFSET - 1  # rank 0's stream's seed would fit, rank 1's not: refused on both
    with pytest.raises(ValueError, match=re.escape(f"seed: {edge} + 2718 + the rank (up to 1) leaves [0, 2**63)")):
        rng.model_parallel_manual_seed(edge)
    own, theirs = (ValueError, "^seed: expected an int in"), (RuntimeError, "rejected its arguments.*rank 1: seed: ")
    kind, message = own if r == 1 else theirs
    with pytest.raises(kind, match=message):
        rng.model_parallel_manual_seed(5 if r != 1 else -1)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == p


def test_seeds_that_differ_between_ranks_are_an_error_on_every_rank(world2):
    world2.run(check_seeds_that_differ)


@pytest.mark.parametrize("seed, message", [
    (True, r"seed: expected an int, got bool True"), (1.5, r"seed: expected an int, got float 1.5"),
    ("1", r"seed: expected an int, got str '1'"), (-1, r"seed: expected an int in \[0, 2\*\*63\), got -1$"),
    (2**63, r"seed: expected an int in \[0, 2\*\*63\), got 9223372036854775808$"),
    (2**63 - 2718, r"seed: 9223372036854773090 \+ 2718 \+ the rank \(up to 0\) leaves \[0, 2\*\*63\)")])
def test_bad_seeds_are_named(seed, message):
    """A seed that is no int in [0, 2**63), or whose model-parallel stream's seed would leave that
    range, is refused by ``model_parallel_manual_seed`` and by a tracker's ``add``, saying why."""
    with pytest.raises(ValueError, match=message):
        rng.model_parallel_manual_seed(seed)
    if seed != 2**63 - 2718:  # (a stream's own seed may be that: it adds nothing)
        with pytest.raises(ValueError, match=message):
            rng.RNGStatesTracker().add("stream", seed)
    else:
        rng.RNGStatesTracker().add("stream", seed)


def test_states_are_copied_in_and_out():
    """What get_states returns and set_states takes stays as it was: a fork after set_states moves
    the tracker's stream, not the states put back, which put back again draw the same numbers."""
    tracker = rng.RNGStatesTracker()
    tracker.add("a", 1)
    with tracker.fork("a"):
        torch.rand(3)
    saved = tracker.get_states()
    tracker.set_states(saved)
    with tracker.fork("a"):
        after = torch.rand(3)
    with tracker.fork("a"):
        assert not torch.equal(torch.rand(3), after)
    for _ in range(2):
        tracker.set_states(saved)
        with tracker.fork("a"):
            assert torch.equal(torch.rand(3), after)
    tracker.set_states(saved)
    for per_device in (saved, tracker.get_states()):  # (the caller's tensors changed in place: not the tracker's)
        per_device["a"]["cpu"].zero_()
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), after)


def test_reset_inside_a_fork_forgets_the_forked_stream():
    """``reset()`` inside a fork forgets the stream being forked: one added again under its name
    forks inside that block, from its own seed, and the block's end leaves it where it went on to."""
    tracker = rng.RNGStatesTracker()
    tracker.add("a", 1)
    with tracker.fork("a"):
        tracker.reset()
        tracker.add("a", 2)
        with tracker.fork("a"):
            first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(torch.cat([first, second]), draws(2, [3, 3]))


def test_forks_are_refused_inside_a_cuda_graph_capture():
    """A fork, of a tracker's stream or of the rank's own, inside a CUDA graph capture (as torch
    reports it, patched here) is a ``RuntimeError`` saying why, before anything is drawn: the
    default stream where it was."""
    tracker = rng.RNGStatesTracker()
    tracker.add("a", 1)
    torch.manual_seed(SEED)
    with mock.patch.object(torch.cuda, "is_initialized", return_value=True), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=True):
        for fork, name in ((lambda: tracker.fork("a"), "fork"), (rng.rank_fork, "rank_fork")):
            with pytest.raises(RuntimeError, match=rf"^{name}: a CUDA graph is being captured"):
                with fork():
                    pass
    assert torch.equal(torch.rand(3), draws(SEED, [3]))
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), draws(1, [3]))


def test_a_recompute_context_that_fails_leaves_the_streams_as_they_were():
    """A ``context_fn`` whose recompute context fails to enter fails the backward, and leaves the
    tracker's streams as they were before it, not as the forward began."""
    f, x = _dropout_case()
    tracker = rng.get_rng_tracker()

    class Refused:
        def __enter__(self):
            raise RuntimeError("recompute refused")

        def __exit__(self, *exc):
            return False

    rng.model_parallel_manual_seed(SEED)
    y = rng.checkpoint(f, x, context_fn=lambda: (contextlib.nullcontext(), Refused()))
    with tracker.fork():  # (the stream moved on after the forward)
        torch.rand(4)
    before = tracker.get_states()
    with pytest.raises(RuntimeError, match="recompute refused"):
        y.sum().backward()
    after = tracker.get_states()
    assert all(torch.equal(before[n][d], after[n][d]) for n in before for d in before[n])


def test_tracker_errors_name_what_is_wrong():
    tracker = rng.RNGStatesTracker()
    with pytest.raises(ValueError, match="model_parallel_manual_seed adds it"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match=r"name: .*'b'.*streams: 'a'"):
        with tracker.fork("b"):
            pass
    with pytest.raises(ValueError, match="name: the stream 'a' exists already"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed: 1 already seeds the stream 'a'"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="name: expected a non-empty str"):
        tracker.add("", 3)
    with pytest.raises(ValueError, match="states: no stream named 'z'"):
        tracker.set_states({"z": {}})
    with pytest.raises(ValueError, match="use_reentrant"):
        rng.checkpoint(lambda x: x, torch.ones(1, requires_grad=True), use_reentrant=True)
    with pytest.raises(ValueError, match="context_fn"):
        rng.checkpoint(lambda x: x, torch.ones(1, requires_grad=True), context_fn=3)
    tracker.reset()
    assert tracker.seeds() == {}
