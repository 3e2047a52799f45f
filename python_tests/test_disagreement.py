"""Ranks that disagree (tp_kernels._agreement): inputs that differ between ranks, or an argument
wrong on one rank only, give every rank a clear error within the timeout, never an abort, a hang or
a wrong result, and the group works afterwards, with fingerprints on (TP_KERNELS_FINGERPRINTS=1).
Group setup and destroyed groups need no switch. Same-input bad calls are test_errors.py's.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import tp_kernels
from helpers import fingerprints_set, library_timeout, rank_world
from tp_kernels import _collectives, ops, settings
from tp_kernels.testing import World, WorkerError

DEADLINE_S = 120  # each world.run: a hard limit on the whole case


def fingerprints(check):
    """Run the rank function ``check`` with fingerprints on."""

    @functools.wraps(check)
    def on(*args, **kwargs):
        with fingerprints_set(True):
            return check(*args, **kwargs)

    return on


def _raises(fn):
    """The exception ``fn()`` raises, as (type name, message); a wrong result is no exception."""
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError("no error: a call the ranks disagree on ran")


def _still_works():
    """A good call after the failed one: the group is usable, and right."""
    r, p = rank_world()
    x, w = torch.ones(4, 6), torch.ones(5, 6)
    y = ops.matmul_all_reduce(x, w, backend="reference")
    assert torch.equal(y, torch.full((4, 5), 6.0 * p))


#: op -> how rank ``r`` of ``p`` builds its call, differing on ``what`` on rank 1 only
def _op_call(op, what, backend):
    r, p = rank_world()
    odd = r == 1
    rows, k, n = (5 if odd and what == "batch" else 4) * p, (7 if odd and what == "width" else 6), 5
    dtype = torch.float64 if odd and what == "dtype" else torch.float32
    chunks = 3 if odd and what == "num_chunks" else 2
    chosen = ("reference" if backend == "pipelined" else "pipelined") if odd and what == "backend" else backend
    # "dim": the same [rows, 2p, k] on every rank, gathered or scattered along dim 1 on rank 1 only
    # (the same bytes: without fingerprints, a wrong result)
    x = torch.randn(rows // p if op == "all_gather_matmul" else rows, *([2 * p] if what == "dim" else []), k,
                    dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    dim = {f"{'gather' if op == 'all_gather_matmul' else 'scatter'}_dim": int(odd)} if what == "dim" else {}
    return lambda: getattr(ops, op)(x, w, backend=chosen, num_chunks=chunks, **dim)


@fingerprints
def check_inputs_that_differ(op, backend):
    r, p = rank_world()
    messages = {}
    for what in ("batch", "width", "dtype", "num_chunks", "backend") + (("dim",) if op != "matmul_all_reduce" else ()):
        start = time.monotonic()
        kind, message = _raises(_op_call(op, what, backend))
        assert kind == "RuntimeError" and "disagree on this call, so none of it ran" in message, (what, message)
        assert f"rank 0: {op}:" in message and f"rank 1: {op}:" in message, message  # every rank's view
        assert time.monotonic() - start < 30, what
        messages[what] = message
        _still_works()
    return messages


@pytest.mark.parametrize("backend", ["reference", "pipelined"])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_inputs_that_differ_between_ranks_are_an_error_on_every_rank(world2, op, backend):
    per_rank = world2.run(check_inputs_that_differ, op, backend, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]  # the same error, word for word, on every rank


def test_inputs_that_differ_on_4_ranks(world4):
    per_rank = world4.run(check_inputs_that_differ, "all_gather_matmul", "pipelined", deadline_s=DEADLINE_S)
    assert all(m == per_rank[0] for m in per_rank)


@fingerprints
def check_settings_that_differ(op):
    """The same call on every rank, but rank 1 set apart in what decides its path: "auto" with
    other candidates (it would measure, a collective of its own, while the others ran the
    reference: a timeout, then a dead peer blamed), "fused" with another forced all-reduce
    algorithm (another protocol over peer memory), and "auto" with the fused path a candidate on
    every rank and another forced algorithm on rank 1. Every rank raises at once, its message
    naming the setting, and the group goes on."""
    r, p = rank_world()
    x, w = torch.randn(4 * p if op != "all_gather_matmul" else 4, 6), torch.randn(5, 6)
    messages = []
    for backend, everyone, apart, forced, named in (
            ("auto", {}, {"auto_candidates": ("pipelined", "reference")}, None,
             "candidates=('pipelined', 'reference')"),
            ("fused", {}, {}, "two_shot", "TP_KERNELS_FUSED_ALL_REDUCE='two_shot'"),
            ("auto", {"auto_candidates": ("fused", "reference")}, {}, "two_shot", "fused_all_reduce='two_shot'")):
        old = os.environ.pop("TP_KERNELS_FUSED_ALL_REDUCE", None)
        if r == 1 and forced is not None:  # (rank 1's forced fused all-reduce algorithm)
            os.environ["TP_KERNELS_FUSED_ALL_REDUCE"] = forced
        start = time.monotonic()
        try:
            with settings.overriding(**everyone, **(apart if r == 1 else {})):
                kind, message = _raises(lambda: getattr(ops, op)(x, w, backend=backend))
        finally:
            os.environ.pop("TP_KERNELS_FUSED_ALL_REDUCE", None)
            if old is not None:
                os.environ["TP_KERNELS_FUSED_ALL_REDUCE"] = old
        assert kind == "RuntimeError" and "disagree on this call, so none of it ran" in message, message
        assert named in message.partition("rank 1:")[2] and named not in message.partition("rank 1:")[0], message
        assert time.monotonic() - start < 30, backend
        messages.append(message)
        _still_works()
    return messages


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_settings_that_decide_the_path_differing_between_ranks(world2, op):
    per_rank = world2.run(check_settings_that_differ, op, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


#: a layer rank 1 builds otherwise than the others, and the input each rank calls it on: without
#: the layer in its fingerprint, the first gathers its output on rank 1 alone (gloo then killed a
#: rank), the second joins its outputs otherwise (a different result, unsaid)
LAYERS_BUILT_APART = {
    "gather_output": lambda odd: (tp_kernels.ColumnParallelLinear(6, 4, gather_output=odd), torch.randn(3, 6)),
    "output_sizes": lambda odd: (tp_kernels.ColumnParallelLinear(6, 8, output_sizes=(4, 4) if odd else (2, 6),
                                                                 gather_output=True), torch.randn(3, 6)),
    "embedding scale": lambda odd: (tp_kernels.VocabParallelEmbedding(8, 4, output_scale=2.0 if odd else None),
                                    torch.arange(4)),
    # (the padding row's gradient, the dim reduce-scattered, the dtype summed: each else apart, unsaid)
    "embedding padding_idx": lambda odd: (tp_kernels.VocabParallelEmbedding(8, 4, padding_idx=1 if odd else None),
                                          torch.arange(4)),
    "embedding sequence_dim": lambda odd: (tp_kernels.VocabParallelEmbedding(8, 4, sequence_parallel=True,
                                                                             sequence_dim=int(odd)),
                                           torch.arange(16).view(4, 4) % 8),
    "embedding dtype": lambda odd: (tp_kernels.VocabParallelEmbedding(8, 4, dtype=torch.float64 if odd else None),
                                    torch.arange(4)),
}


@fingerprints
def check_layers_built_apart(what):
    r, p = rank_world()
    layer, x = LAYERS_BUILT_APART[what](r == 1)
    kind, message = _raises(lambda: layer(x))
    assert kind == "RuntimeError" and "disagree on this call, so none of it ran" in message, message
    mine, _, theirs = message.partition("; rank 1:")
    assert all(f"{type(layer).__name__}(in" in view or f"{type(layer).__name__}(8, 4" in view
               for view in (mine, theirs)), message  # each rank's layer, as built
    _still_works()
    return message


@pytest.mark.parametrize("what", sorted(LAYERS_BUILT_APART))
def test_layers_built_apart_on_one_rank(world2, what):
    per_rank = world2.run(check_layers_built_apart, what, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


@fingerprints
def check_long_views_that_differ_at_their_end():
    """Fingerprints longer than the bytes a view shows that differ only past them (a long call's
    settings come last): still an error on every rank, which says where they differ, and within
    what time of each other the ranks must make their calls (the timeout set); alike, none."""
    from tp_kernels import _agreement

    r, p = rank_world()
    long = "x" * _agreement.PAYLOAD_BYTES
    assert _agreement.agree("probe", dist.group.WORLD, lambda: 1, lambda _: long + "same") == 1
    with settings.overriding(timeout=37.5):
        kind, message = _raises(lambda: _agreement.agree("probe", dist.group.WORLD, lambda: 1,
                                                         lambda _: f"{long}{r}"))
    assert kind == "RuntimeError" and "disagree on this call" in message, message
    assert f"they differ past the first {_agreement.PAYLOAD_BYTES} bytes shown" in message, message
    assert message.endswith("within 37.5 s of each other"), message
    _still_works()
    return message


def test_long_fingerprints_that_differ_at_their_end(world2):
    per_rank = world2.run(check_long_views_that_differ_at_their_end, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


@fingerprints
def check_cross_entropy_over_blocks_of_different_widths():
    r, p = rank_world()
    logits = torch.randn(3, 4 if r == 0 else 5)
    target = torch.tensor([0, 1, 2])
    kind, message = _raises(lambda: tp_kernels.vocab_parallel_cross_entropy(logits, target))
    assert kind == "RuntimeError" and "disagree" in message and "logits [3, 4]" in message and "logits [3, 5]" in message
    _still_works()
    return message


def test_cross_entropy_over_blocks_of_different_widths_is_an_error_not_a_wrong_loss(world2):
    per_rank = world2.run(check_cross_entropy_over_blocks_of_different_widths, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


def _targets():
    return torch.zeros(3, dtype=torch.long)


#: case -> ``(call, mine)`` for rank ``r`` of ``p``, the call made otherwise on rank 1 (``odd``): the
#: reduction over this rank's block of the vocabulary's logits, and what the error names of this rank's
VOCABULARY_REDUCTIONS = {
    "topk k": lambda odd, r, p: (lambda: tp_kernels.vocab_parallel_topk(torch.randn(3, 5), 3 if odd else 2),
                                 f"k {3 if odd else 2}"),
    "argmax vocab_size": lambda odd, r, p: (lambda: tp_kernels.vocab_parallel_argmax(
        torch.randn(3, 5), vocab_size=5 * p - odd), f"vocabulary {5 * p - odd}"),
    "entropy width": lambda odd, r, p: (lambda: tp_kernels.vocab_parallel_entropy(torch.randn(3, 5 + odd)),
                                        f"logits [3, {5 + odd}]"),
    "cross-entropy reduction": lambda odd, r, p: (lambda: tp_kernels.vocab_parallel_cross_entropy(
        torch.randn(3, 5), _targets(), reduction="sum" if odd else "mean"), f"reduction {'sum' if odd else 'mean'}"),
    "cross-entropy label_smoothing": lambda odd, r, p: (lambda: tp_kernels.vocab_parallel_cross_entropy(
        torch.randn(3, 5), _targets(), 0.1 if odd else 0.0), f"label_smoothing {0.1 if odd else 0.0}"),
    "cross-entropy ignore_index": lambda odd, r, p: (lambda: tp_kernels.vocab_parallel_cross_entropy(
        torch.randn(3, 5), _targets(), ignore_index=0 if odd else -100), f"ignore_index {0 if odd else -100}"),
    "sample temperature": lambda odd, r, p: (lambda: tp_kernels.vocab_parallel_sample(
        torch.randn(3, 5), temperature=0.5 if odd else 1.0, generator=torch.Generator().manual_seed(r)),
        f"temperature {0.5 if odd else 1.0}"),
}


@fingerprints
def check_vocabulary_reductions_that_differ(case):
    """The reductions over vocabulary-parallel logits, called otherwise on rank 1: the same clear
    error on every rank, naming what differs, and the group works afterwards (without the check, a
    k or a vocab_size that differs would merge candidates of another shape, or name another class)."""
    r, p = rank_world()
    call, mine = VOCABULARY_REDUCTIONS[case](r == 1, r, p)
    kind, message = _raises(call)
    assert kind == "RuntimeError" and "disagree on this call" in message and mine in message, message
    _still_works()
    return message


@pytest.mark.parametrize("case", sorted(VOCABULARY_REDUCTIONS))
def test_vocabulary_reductions_that_differ_between_ranks(world2, case):
    per_rank = world2.run(check_vocabulary_reductions_that_differ, case, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


@fingerprints
def check_one_round_when_the_ranks_agree():
    """Ranks that agree exchange a digest only; the descriptions travel only when they differ."""
    from tp_kernels import _agreement

    r, p = rank_world()
    exchanged = []
    original = _agreement.exchange_views
    _agreement.exchange_views = lambda *args, **kwargs: exchanged.append(1) or original(*args, **kwargs)
    try:
        _still_works()
        agreed = len(exchanged)
        _raises(_op_call("matmul_all_reduce", "batch", "reference"))
        return agreed, len(exchanged)
    finally:
        _agreement.exchange_views = original


def test_ranks_that_agree_exchange_one_digest(world2):
    assert world2.run(check_one_round_when_the_ranks_agree, deadline_s=DEADLINE_S) == [(0, 1)] * 2


@fingerprints
def check_host_twins():
    """A world whose backend carries no host tensors (as NCCL's does not; faked here on gloo):
    with fingerprints on, initialize_model_parallel gives each tensor-parallel group a gloo twin of
    the same ranks (none with them off), the
    default group gets one on its first exchange, the fingerprints travel over the twin on the
    host, a disagreement is still an error on every rank, and destroy_model_parallel destroys the
    twins."""
    from tp_kernels import _agreement, parallel_state

    r, p = rank_world()
    assert parallel_state.host_group(dist.group.WORLD) is dist.group.WORLD  # gloo: no twin needed
    used = []
    gather = _collectives.all_gather_bytes
    carries = parallel_state.carries_host_tensors
    parallel_state.carries_host_tensors = lambda group=None: False
    _collectives.all_gather_bytes = lambda payload, group, device: used.append((group, device)) or gather(
        payload, group, device)
    try:
        settings.set_fingerprints(False)
        tp_kernels.initialize_model_parallel(2)  # fingerprints off: no twin is made
        assert parallel_state.host_group(parallel_state.get_tensor_model_parallel_group()) is None
        tp_kernels.destroy_model_parallel()
        settings.set_fingerprints(True)
        tp_kernels.initialize_model_parallel(2)
        tp = parallel_state.get_tensor_model_parallel_group()
        twin = parallel_state.host_group(tp)
        assert twin is not None and twin is not tp
        assert (twin.size(), twin.rank()) == (tp.size(), tp.rank())
        assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(tp)
        assert parallel_state.host_group(parallel_state.get_data_parallel_group()) is None  # no twin made
        x, w = torch.ones(4, 6), torch.ones(5, 6)
        assert torch.equal(ops.matmul_all_reduce(x, w, backend="reference"), torch.full((4, 5), 12.0))
        assert used == [(twin, torch.device("cpu"))]
        kind, message = _raises(lambda: ops.matmul_all_reduce(torch.ones(4 if tp.rank() == 0 else 3, 6), w))
        assert kind == "RuntimeError" and "disagree" in message, message
        world = parallel_state.host_group(dist.group.WORLD)
        assert world is not None and world is not dist.group.WORLD and world.size() == p
        assert parallel_state.host_group(dist.group.WORLD) is world  # made once
        _agreement.agree("probe", dist.group.WORLD, lambda: None, lambda _: "alike")
        assert used[-1] == (world, torch.device("cpu"))
        tp_kernels.destroy_model_parallel()
        assert id(tp) not in parallel_state._HOST_TWINS
    finally:
        parallel_state.carries_host_tensors = carries
        _collectives.all_gather_bytes = gather
        parallel_state._HOST_TWINS.pop(id(dist.group.WORLD), None)
        if parallel_state.model_parallel_is_initialized():
            tp_kernels.destroy_model_parallel()
    return True


def test_fingerprints_of_a_group_without_a_host_backend_travel_over_its_host_twin(world4):
    assert world4.run(check_host_twins, deadline_s=DEADLINE_S) == [True] * 4


def test_fingerprints_are_off_by_default(monkeypatch):
    monkeypatch.delenv("TP_KERNELS_FINGERPRINTS", raising=False)
    assert settings.fingerprints_enabled() is settings.FINGERPRINTS_DEFAULT is False
    monkeypatch.setenv("TP_KERNELS_FINGERPRINTS", "1")
    assert settings.fingerprints_enabled() is True
    monkeypatch.setenv("TP_KERNELS_FINGERPRINTS", "on")
    with pytest.raises(ValueError, match="TP_KERNELS_FINGERPRINTS: expected 0 or 1"):
        settings.fingerprints_enabled()
    with pytest.raises(ValueError, match="enabled: expected a bool or None"):
        settings.set_fingerprints("yes")


# --- an argument wrong on one rank only -------------------------------------------------------------


def _one_rank_wrong(case, r):
    """(the call, the argument its error names) where rank 1's argument is wrong."""
    odd = r == 1
    if case == "layer input width":
        layer = tp_kernels.ColumnParallelLinear(6, 8 * dist.get_world_size())
        x = torch.randn(3, 7 if odd else 6)
        return (lambda: layer(x)), "input"
    if case == "embedding id":
        emb = tp_kernels.VocabParallelEmbedding(4 * dist.get_world_size(), 3)
        ids = torch.tensor([1, 99 if odd else 2])
        return (lambda: emb(ids)), "input"
    if case == "target":
        logits = torch.randn(2, 4)
        target = torch.tensor([1, 10_000 if odd else 3])
        return (lambda: tp_kernels.vocab_parallel_cross_entropy(logits, target)), "target"
    if case == "grads on one rank only":
        w = torch.nn.Parameter(torch.randn(3))
        if not odd:
            w.grad = torch.ones(3)
        return (lambda: tp_kernels.allreduce_sequence_parallel_grads([w])), None
    if case == "mapping":
        x = torch.randn(2, 5 if odd else 4 * dist.get_world_size())
        return (lambda: tp_kernels.mappings.scatter_to_tensor_model_parallel_region(x)), "input.shape[-1]"
    raise AssertionError(case)


ONE_RANK_CASES = ["layer input width", "embedding id", "target", "grads on one rank only", "mapping"]


@fingerprints
def check_one_rank_wrong(case):
    r, p = rank_world()
    call, name = _one_rank_wrong(case, r)
    start = time.monotonic()
    kind, message = _raises(call)
    if case == "grads on one rank only":  # nothing is wrong on either rank alone: they disagree
        assert kind == "RuntimeError" and "disagree" in message and "3 elements" in message, message
    elif r == 1:  # the rank whose argument is wrong: its own error, naming the argument
        assert kind == "ValueError" and message.startswith(name), message
    else:  # its peers learn it, naming the rank and its message
        assert kind == "RuntimeError" and "rejected its arguments" in message and f"rank 1: {name}" in message, message
    assert time.monotonic() - start < 30
    _still_works()  # the peer that was waiting is not left in a half-finished collective
    return kind


@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_an_argument_wrong_on_one_rank_is_an_error_on_every_rank(world2, case):
    kinds = world2.run(check_one_rank_wrong, case, deadline_s=DEADLINE_S)
    assert len(kinds) == 2


@fingerprints
def check_a_mapping_whose_backward_differs():
    """The same forward on every rank, but rank 1's backward would split its gradient where rank
    0's reduce-scatters it (a collective on one rank alone): both raise at the forward, naming the
    flag."""
    r, _ = rank_world()
    x = torch.randn(2, 3, requires_grad=True)
    kind, message = _raises(lambda: tp_kernels.mappings.gather_from_sequence_parallel_region(x, r == 0))
    assert kind == "RuntimeError" and "disagree on this call, so none of it ran" in message, message
    assert "tensor_parallel_output_grad True" in message and "tensor_parallel_output_grad False" in message, message
    _still_works()
    return message


def test_a_mapping_whose_backward_differs_between_ranks_is_an_error_on_every_rank(world2):
    per_rank = world2.run(check_a_mapping_whose_backward_differs, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


@fingerprints
def check_a_gradient_wanted_on_one_rank():
    """An input that wants a gradient on rank 1 alone: its backward would run a collective (the
    gathered input's reduce-scatter) on that rank only, so both raise at the forward, naming it.
    Under ``torch.no_grad()`` no backward is recorded on either rank: the call runs, the same on
    both."""
    r, p = rank_world()
    x, w = torch.ones(4, 6, requires_grad=r == 1), torch.ones(5, 6)
    kind, message = _raises(lambda: ops.all_gather_matmul(x, w, backend="reference"))
    assert kind == "RuntimeError" and "disagree on this call, so none of it ran" in message, message
    rank0, _, rank1 = message.partition("rank 0: ")[2].partition("; rank 1: ")
    assert "x [4, 6] float32 cpu, weight" in rank0 and "x [4, 6] float32 cpu grad, weight" in rank1, message
    with torch.no_grad():
        y = ops.all_gather_matmul(x, w, backend="reference")
    assert torch.equal(y, torch.full((4 * p, 5), 6.0))
    _still_works()
    return message


def test_a_gradient_wanted_on_one_rank_is_an_error_on_every_rank(world2):
    per_rank = world2.run(check_a_gradient_wanted_on_one_rank, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


@fingerprints
def check_no_exchange_while_compiling():
    """With fingerprints on, a call compiled whole (``fullgraph=True``) neither exchanges while
    torch.compile traces it (a collective read back on the host cannot be traced) nor when the
    compiled graph runs, and computes what the eager call does; the eager call exchanges."""
    r, p = rank_world()
    exchanges = []
    gather = _collectives.all_gather_bytes
    _collectives.all_gather_bytes = lambda *args: exchanges.append(1) or gather(*args)
    try:
        x, w = torch.randn(4, 6, generator=torch.Generator().manual_seed(r)), torch.randn(5, 6)
        eager = ops.matmul_all_reduce(x, w, backend="reference")
        assert len(exchanges) == 1  # (one digest: the ranks agree)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w: ops.matmul_all_reduce(x, w, backend="reference"),
                                 backend="aot_eager", fullgraph=True)
        for _ in range(2):
            torch.testing.assert_close(compiled(x, w), eager)
        assert len(exchanges) == 1
    finally:
        _collectives.all_gather_bytes = gather
    return True


def test_fingerprints_are_not_exchanged_while_compiling(world2):
    assert world2.run(check_no_exchange_while_compiling, deadline_s=DEADLINE_S) == [True, True]


def test_a_view_travels_cut_and_padded_to_the_size_asked():
    """The bytes of a view: its UTF-8 cut to the size asked and padded with zeros to it (the
    autotune's header travels in fewer bytes than a fingerprint), and the view they carry back."""
    from tp_kernels import _agreement

    assert _agreement._payload("abc", 8) == b"abc\0\0\0\0\0"
    assert _agreement._payload("abcdefghij", 4) == b"abcd"
    assert len(_agreement._payload("abc")) == _agreement.PAYLOAD_BYTES
    assert _agreement._view(_agreement._payload("r\u00e9sum\u00e9", 16)) == "r\u00e9sum\u00e9"
    assert _agreement._view(_agreement._payload("\u00e9", 1)) == "\ufffd"  # (a character cut: replaced, no error)


def test_an_argument_wrong_on_one_rank_of_4(world4):
    kinds = world4.run(check_one_rank_wrong, "layer input width", deadline_s=DEADLINE_S)
    assert kinds == ["RuntimeError", "ValueError", "RuntimeError", "RuntimeError"]


@fingerprints
def check_arguments_wrong_on_two_ranks():
    """Ranks 1 and 3 of 4 pass an input of the wrong width: each raises its own error, and the
    others one error naming both ranks, each with its message."""
    r, p = rank_world()
    layer = tp_kernels.ColumnParallelLinear(6, 2 * p)
    x = torch.randn(3, 6 + r % 2)
    kind, message = _raises(lambda: layer(x))
    if r % 2:
        assert kind == "ValueError" and message.startswith("input"), message
    else:
        assert kind == "RuntimeError" and "ranks of group" in message and "rejected its arguments" in message, message
        assert "(rank 1: input" in message and "; rank 3: input" in message, message
    _still_works()
    return kind


def test_arguments_wrong_on_two_ranks_of_4(world4):
    kinds = world4.run(check_arguments_wrong_on_two_ranks, deadline_s=DEADLINE_S)
    assert kinds == ["RuntimeError", "ValueError", "RuntimeError", "ValueError"]


# --- setup: groups, and layers outliving them -------------------------------------------------------


def check_initialize_with_sizes_that_differ():
    r, p = rank_world()
    with library_timeout(5):
        start = time.monotonic()
        kind, message = _raises(lambda: tp_kernels.initialize_model_parallel(2 if r == 0 else 1))
        elapsed = time.monotonic() - start
    assert kind == "RuntimeError" and "initialize_model_parallel: the ranks disagree" in message, message
    assert "rank 0: tensor_model_parallel_size=2" in message and "rank 1: tensor_model_parallel_size=1" in message
    assert elapsed < 15 and not tp_kernels.model_parallel_is_initialized()
    # a size wrong on rank 1 alone: its own ValueError there, the others told it rejected its arguments
    kind, wrong = _raises(lambda: tp_kernels.initialize_model_parallel(3 if r == 1 else p))
    if r == 1:
        assert kind == "ValueError" and "(3) x pipeline_model_parallel_size (1) = 3 does not divide the world size" \
            in wrong, wrong
    else:
        assert kind == "RuntimeError" and "initialize_model_parallel: a rank rejected its arguments, so no group was " \
            "made (rank 1: tensor_model_parallel_size (3)" in wrong, wrong
    # wrong on every rank alike: each rank's own ValueError
    kind, wrong = _raises(lambda: tp_kernels.initialize_model_parallel(3))
    assert kind == "ValueError" and f"does not divide the world size {p}" in wrong, wrong
    assert not tp_kernels.model_parallel_is_initialized()
    tp_kernels.initialize_model_parallel(p)  # the same sizes everywhere: it works
    try:
        assert tp_kernels.get_tensor_model_parallel_world_size() == p
        _still_works()
    finally:
        tp_kernels.destroy_model_parallel()
    return message


def test_initialize_with_sizes_that_differ(world2):
    per_rank = world2.run(check_initialize_with_sizes_that_differ, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]


def check_initialize_without_one_rank():
    r, p = rank_world()
    if r == p - 1:
        return None  # never arrives
    with library_timeout(3):
        start = time.monotonic()
        kind, message = _raises(lambda: tp_kernels.initialize_model_parallel(1))
        elapsed = time.monotonic() - start
    assert kind == "RuntimeError" and f"rank {p - 1} did not arrive within 3 s" in message, message
    assert 3 <= elapsed < 15, elapsed
    return message


def test_initialize_without_one_rank_is_an_error_within_the_timeout():
    with World(3, backend="gloo", timeout_s=60.0) as world:  # its own world: the absent rank stays out of step
        per_rank = world.run(check_initialize_without_one_rank, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1] and per_rank[2] is None


def check_deferred_gather_read_on_one_rank():
    """A DeferredGather read on one rank only (its norm logged there): that rank's read waits
    for the other's gather, and at the timeout raises the error that says what read it and that
    every rank must; the rank that did not read it goes on."""
    r, p = rank_world()
    x = torch.randn(2, 3)
    deferred = tp_kernels.mappings.gather_for_column_layers(x, sequence_dim=0)
    assert type(deferred).__name__ == "DeferredGather"
    if r != 0:
        return None
    with library_timeout(3):
        start = time.monotonic()
        kind, message = _raises(lambda: deferred.norm().item())
        elapsed = time.monotonic() - start
    assert kind == "RuntimeError" and "gathering a DeferredGather" in message and "aten." in message and \
        "Every rank of the group must read it" in message, message
    assert 3 <= elapsed < 15, elapsed
    return message


def test_a_deferred_gather_read_on_one_rank_is_an_error_within_the_timeout():
    with World(2, backend="gloo", timeout_s=60.0) as world:  # its own world: the ranks leave it out of step
        per_rank = world.run(check_deferred_gather_read_on_one_rank, deadline_s=DEADLINE_S)
    assert per_rank[1] is None and "read here by aten." in per_rank[0], per_rank


def check_layer_after_destroy():
    r, p = rank_world()
    tp_kernels.initialize_model_parallel(p)
    layer = tp_kernels.RowParallelLinear(4 * p, 3)
    x = torch.randn(2, 4)
    layer(x)
    tp_kernels.destroy_model_parallel()
    kind, message = _raises(lambda: layer(x))
    assert kind == "RuntimeError" and message.startswith("group: the process group") and \
        "destroyed by tp_kernels.destroy_model_parallel()" in message, message
    return True


def test_a_layer_used_after_destroy_model_parallel_says_so(world2):
    assert world2.run(check_layer_after_destroy, deadline_s=DEADLINE_S) == [True, True]


# --- a peer that dies mid-call ---------------------------------------------------------------------


def check_peer_dies_in_the_ring(path):
    """Rank 1 agrees on the call, then exits inside the pipelined ring; rank 0's error is the
    explained one, not gloo's own."""
    r, p = rank_world()
    tp_kernels.set_timeout(10)
    if r == 1:
        _collectives.ring_exchange = lambda *args, **kwargs: os._exit(3)
    x, w = torch.randn(4, 6), torch.randn(5, 6)
    try:
        ops.all_gather_matmul(x, w, backend="pipelined")
    except RuntimeError as exc:
        with open(path, "w") as f:
            f.write(str(exc))
        raise


def test_a_peer_that_dies_in_the_ring_is_the_explained_error():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.txt")
        world = World(2, backend="gloo", timeout_s=60.0)
        with pytest.raises(WorkerError):
            world.run(check_peer_dies_in_the_ring, path, deadline_s=DEADLINE_S)
        world.close()
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        message = open(path).read()
    assert "all-gather+matmul ring" in message and "A peer rank may have died" in message, message


# --- local checks, clearer messages -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, float("inf"), float("nan"), 1e10, 0, -1, "5"])
def test_set_timeout_rejects_what_is_not_a_sensible_number_of_seconds(bad):
    with pytest.raises(ValueError, match="seconds: expected a positive number of seconds, at most 86400"):
        tp_kernels.set_timeout(bad)


def test_a_malformed_timeout_in_the_environment_is_named(monkeypatch):
    monkeypatch.setattr(settings, "_timeout_s", None)
    for value in ("inf", "nan", "1e10", "soon", "0"):
        monkeypatch.setenv("TP_KERNELS_TIMEOUT_S", value)
        with pytest.raises(ValueError, match="TP_KERNELS_TIMEOUT_S: expected a positive number of seconds"):
            tp_kernels.get_timeout()


def test_clear_messages_for_integer_dtypes_and_ids():
    with pytest.raises(ValueError, match="dtype: expected a floating-point torch.dtype"):
        tp_kernels.ColumnParallelLinear(4, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype: expected a floating-point torch.dtype"):
        tp_kernels.VocabParallelEmbedding(8, 4, dtype=torch.int32)
    emb = tp_kernels.VocabParallelEmbedding(8, 4)
    for dtype in (torch.int16, torch.uint8, torch.int8):
        with pytest.raises(ValueError, match=f"input: expected ids of dtype torch.int64 or torch.int32, got {dtype}"):
            emb(torch.tensor([1, 2], dtype=dtype))
    assert emb(torch.tensor([1, 2], dtype=torch.int32)).shape == (2, 4)


def check_huge_num_chunks():
    x, w = torch.randn(4, 6), torch.randn(5, 6)
    ref = ops.matmul_all_reduce(x, w, backend="reference")
    for op_chunks in (2**31, 2**63):
        y = ops.matmul_all_reduce(x, w, backend="pipelined", num_chunks=op_chunks)
        assert torch.allclose(y, ref, atol=1e-5)
    return True


def test_a_huge_num_chunks_is_as_many_chunks_as_rows(world2):
    assert world2.run(check_huge_num_chunks, deadline_s=DEADLINE_S) == [True, True]


def check_parallelize_that_differs(case):
    """``parallelize`` agrees with the group whatever the fingerprint setting (a setup call, as
    initialize_model_parallel): ranks that built their dense models from different random draws
    (no seed), ranks given different plans, and a plan that fails on one rank only each raise on
    every rank, naming the cause, with nothing replaced; then the group works."""
    import torch.nn as nn

    r, p = rank_world()
    torch.manual_seed(0 if case != "weights" else r)  # ("weights": each rank its own draw)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    plan = {"0": "colwise", "2": "rowwise"}
    if case == "plans" and r == 1:
        plan = {"0": "colwise_gather_output", "2": "rowwise_split_input"}
    if case == "one rank's plan" and r == 1:
        plan = {"0": "colwise", "3": "rowwise"}  # (matches nothing here)
    if case == "torch's styles":  # (the same on both ranks, but for one layout: no address in the digests)
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Shard(0) if r == 1 else Replicate())}
    kind, message = _raises(lambda: tp_kernels.parallelize(model, plan))
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear  # nothing replaced
    _still_works()
    return kind, message


@pytest.mark.parametrize("case", ["weights", "plans", "one rank's plan", "torch's styles"])
def test_parallelize_that_differs_between_ranks(world2, case):
    results = world2.run(check_parallelize_that_differs, case, deadline_s=DEADLINE_S)
    if case == "weights":
        for kind, message in results:
            assert kind == "RuntimeError" and "hold different dense models" in message, message
            assert "seed every rank alike" in message and "rank 0: " in message and "rank 1: " in message, message
    elif case in ("plans", "torch's styles"):
        for kind, message in results:
            assert kind == "RuntimeError" and "disagree" in message and "rank 0: parallelize: plan" in message, message
    else:
        assert results[1][0] == "ValueError" and "pattern '3' matches no submodule" in results[1][1], results
        assert results[0][0] == "RuntimeError" and "rank 1: plan: pattern '3'" in results[0][1], results
