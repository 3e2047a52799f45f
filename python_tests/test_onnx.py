"""Tensor-parallel models out to ONNX (tp_kernels.onnx), proved on the CPU: every rank's model, from
the export route (tp_kernels layers traced by torch.onnx) and from the shard route (a dense ONNX
model split by a plan), runs in ONNX Runtime in its own gloo process, its collective nodes over
torch.distributed (tp_kernels.onnx.cpu_session's stand-ins), and matches the dense PyTorch model
against float64: an MLP, the transformer block of test_parallelize, and an embedding with an LM
head split over the vocabulary, p in {1, 2, 4}. Also: bad plans, and tp_kernels without onnx.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.nn as nn

import tp_kernels
from helpers import assert_close, block, held_rows, padded_block, rank_world
from test_parallelize import BATCH_FIRST_PLAN, _BatchFirstLM
from test_parallelize import PLAN as BLOCK_PLAN
from test_parallelize import Block

try:  # (each test skipped without the onnx extra, not the module: the GPU suite's `-m gpu` then selects none
    # of them and reports no skip)
    import onnx
    from onnx import helper, numpy_helper

    import tp_kernels.onnx
    from tp_kernels.onnx._collective_ops import GROUP_SIZE_KEY, RANK_KEY, made_for
    MISSING = None
except ImportError:
    MISSING = "the onnx extra is not installed (pip install tp_kernels[onnx])"

DEADLINE_S = 300


@pytest.fixture(scope="module", autouse=True)
def _onnx_extra():
    if MISSING is not None:
        pytest.skip(MISSING)


class LanguageModelEnds(nn.Module):
    """An embedding and an LM head: ids [b, s] -> logits [b, s, V]."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


class LanguageModelProbabilities(LanguageModelEnds):
    """:class:`LanguageModelEnds` with the softmax over the vocabulary, the axis its head splits."""

    def forward(self, ids):
        return super().forward(ids).softmax(-1)


LM_PLAN = {"embed": "vocab", "lm_head": "colwise"}
MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def _dense(case, p):
    """The dense model of ``case`` (seeded alike on every rank), its input and its plan."""
    torch.manual_seed(0)
    if case == "mlp":
        model, plan = nn.Sequential(nn.Linear(12, 8 * p), nn.GELU(), nn.Linear(8 * p, 12)), MLP_PLAN
        x = torch.randn(2 * p, 3, 12)
    elif case == "block":
        model, plan = Block(23, 3 * p, 17 * p), BLOCK_PLAN
        x = torch.randn(3 * p, 3, 23)
    else:
        model = (LanguageModelProbabilities if case == "lm_softmax" else LanguageModelEnds)(16 * p, 12)
        plan, x = LM_PLAN, torch.randint(0, 16 * p, (3, 5))
    return model.eval(), x, plan


def _collectives(model: onnx.ModelProto):
    return sorted(n.op_type for n in model.graph.node if n.domain == tp_kernels.onnx.DOMAIN)


def _run(model, x: torch.Tensor, group=None) -> torch.Tensor:
    session = tp_kernels.onnx.cpu_session(model, group=group)
    (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(y)


def check_export_padded_vocabulary():
    """A vocabulary p does not divide, exported: the embedding equals the dense one, the head's
    logits are the dense ones (gathered: the padding dropped) or this rank's block of them with
    -inf in the padding."""
    r, p = rank_world()
    vocab = 4 * p + 1
    torch.manual_seed(0)
    dense = LanguageModelEnds(vocab, 12).eval()
    ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(1))
    ref = dense.double()(ids).detach()
    for gather in (True, False):
        model = copy.deepcopy(dense).float()
        model.embed = tp_kernels.VocabParallelEmbedding.from_embedding(model.embed)
        model.lm_head = tp_kernels.ColumnParallelLinear.from_linear(model.lm_head, gather_output=gather)
        proto = tp_kernels.onnx.export(model, (ids,))
        onnx.checker.check_model(proto)
        y = _run(proto, ids)
        if gather:
            assert_close(f"padded lm exported, rank {r} of {p}", y, ref)
        else:
            held = held_rows(vocab, r, p)  # this rank's classes, the rest padding
            assert y.shape[-1] == -(-vocab // p) and torch.all(y[..., held:] == float("-inf"))
            assert_close(f"padded lm exported, rank {r} of {p}", y[..., :held],
                         padded_block(ref, -1, r, p)[..., :held])


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_exported_padded_vocabulary(world):
    world.run(check_export_padded_vocabulary, deadline_s=DEADLINE_S)


def check_export(case, sequence_parallel):
    """The export route: the tp_kernels model's per-rank ONNX model, with the collectives the
    layers make as nodes and this rank's shards as initializers, equals the dense model."""
    r, p = rank_world()
    dense, x, plan = _dense(case, p)
    ref = dense.double()(x if x.dtype == torch.int64 else x.double()).detach()
    model = copy.deepcopy(dense).float()
    if case == "lm":  # built from the layers directly, the logits gathered (parallelize keeps them split)
        model.embed = tp_kernels.VocabParallelEmbedding.from_embedding(model.embed)
        model.lm_head = tp_kernels.ColumnParallelLinear.from_linear(model.lm_head, gather_output=True)
    else:
        model = tp_kernels.parallelize(model, plan, sequence_parallel=sequence_parallel)
    sp = sequence_parallel and case != "lm"
    x_rank = block(x, 0, r, p) if sp else x
    proto = tp_kernels.onnx.export(model, (x_rank,))
    onnx.checker.check_model(proto)
    assert made_for(proto) == ((p, r) if p > 1 else None)  # the group the model was made for, in its metadata
    want = {"mlp": ["AllReduce"], "block": ["AllReduce", "AllReduce"], "lm": ["AllGather", "AllReduce"]}[case]
    if sp:
        # one all-gather per column-parallel input (q, k and v share theirs: the exporter merges the
        # three identical nodes), one reduce-scatter per row-parallel projection
        want = ["AllGather", "ReduceScatter"] * (1 if case == "mlp" else 2)
        want.sort()
    assert _collectives(proto) == (want if p > 1 else []), _collectives(proto)
    shapes = {tuple(i.dims) for i in proto.graph.initializer}
    local = {"mlp": (8, 12), "block": (17, 23), "lm": (16, 12)}[case]  # the first weight's shard [out/p, in]
    assert local in shapes or local[::-1] in shapes, shapes
    y = _run(proto, x_rank)
    assert_close(f"{case} exported, rank {r} of {p}", y, block(ref, 0, r, p) if sp else ref)
    return _collectives(proto)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("case", ["mlp", "block", "lm"])
def test_exported_per_rank_models_match_the_dense_model(world, case):
    world.run(check_export, case, False, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize("case", ["mlp", "block"])
def test_exported_sequence_parallel_models_match_the_dense_model(world, case):
    world.run(check_export, case, True, deadline_s=DEADLINE_S)


def check_export_batch_first_sequence_parallel():
    """A batch-first language model parallelized with sequence parallelism along dim 1, exported:
    the moves of the sequence to dim 0 and back are plain ONNX nodes around the collectives, and
    this rank's model's logits are the dense model's."""
    r, p = rank_world()
    torch.manual_seed(0)
    dense = _BatchFirstLM(4 * p + 3, 8, 2 * p, 3 * p).eval()
    par = tp_kernels.parallelize(copy.deepcopy(dense), BATCH_FIRST_PLAN, sequence_parallel=True, sequence_dim=1)
    ids = torch.randint(0, 4 * p + 3, (3, 2 * p), generator=torch.Generator().manual_seed(1))
    proto = tp_kernels.onnx.export(par, (ids,))
    onnx.checker.check_model(proto)
    # per block one all-gather for q, k, v and one for gate, up, a reduce-scatter for o and down; the
    # embedding's reduce-scatter; the head's two all-gathers (the sequence, then its columns)
    assert _collectives(proto) == sorted(["AllGather"] * 6 + ["ReduceScatter"] * 5), _collectives(proto)
    with torch.no_grad():
        want = dense.double()(ids)
    assert_close(f"batch-first sequence-parallel lm exported, rank {r} of {p}", _run(proto, ids), want)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_exported_batch_first_sequence_parallel_model(world):
    world.run(check_export_batch_first_sequence_parallel, deadline_s=DEADLINE_S)


def check_sessions_on_the_group_given(path):
    """A rank's model written by export (``f``) and read back by cpu_session from the file runs over
    the group given: the tensor-parallel group of 2 on 4 ranks gives the dense model's logits; the
    world's 4 ranks are refused by cpu_session, on every rank, naming the model's metadata (made
    for rank r % 2 of 2) and this rank, and without it the first collective node whose
    ``group_size`` differs and both sizes. A model whose layers run over both groups says no
    group in its metadata."""
    import torch.distributed as dist

    r, _ = rank_world()
    tp_kernels.initialize_model_parallel(2)
    try:
        dense, ids, _ = _dense("lm", 2)
        ref = dense.double()(ids).detach()
        model = copy.deepcopy(dense).float()
        model.embed = tp_kernels.VocabParallelEmbedding.from_embedding(model.embed)
        model.lm_head = tp_kernels.ColumnParallelLinear.from_linear(model.lm_head, gather_output=True)
        file = f"{path}-{r}.onnx"
        proto = tp_kernels.onnx.export(model, (ids,), file)
        assert onnx.load(file) == proto
        for group in (None, tp_kernels.get_tensor_model_parallel_group()):
            assert_close(f"lm exported and read back, rank {r}, group {group}", _run(file, ids, group), ref)
        with pytest.raises(ValueError, match=re.escape(
                f"model: it is rank {r % 2}'s model of a group of 2 (its metadata {RANK_KEY!r}, {GROUP_SIZE_KEY!r}), "
                f"and this process is rank {r} of the group of 4")):
            tp_kernels.onnx.cpu_session(proto, group=dist.group.WORLD)
        del proto.metadata_props[:]  # a model that does not say: its nodes do
        gather = next(n.name for n in proto.graph.node if n.op_type == "AllGather")
        for given in (proto, tp_kernels.onnx.standin_model(proto)):  # (its stand-ins checked alike)
            with pytest.raises(ValueError, match=re.escape(f"model: its AllGather node {gather!r} spans 2 ranks "
                                                           "(group_size), the group 4")):
                tp_kernels.onnx.cpu_session(given, group=dist.group.WORLD)
        # a model whose layers run over two groups (the tensor-parallel 2, the world's 4): no one group to
        # name, so its metadata says none (its nodes say their sizes)
        torch.manual_seed(0)
        two = nn.Sequential(tp_kernels.ColumnParallelLinear(6, 4, gather_output=True),
                            tp_kernels.ColumnParallelLinear(4, 8, gather_output=True, group=dist.group.WORLD))
        mixed = tp_kernels.onnx.export(two.eval(), (torch.randn(3, 6),))
        assert made_for(mixed) is None and _collectives(mixed) == ["AllGather", "AllGather"], _collectives(mixed)
    finally:
        tp_kernels.destroy_model_parallel()


def test_sessions_run_on_the_group_given(world4, tmp_path):
    world4.run(check_sessions_on_the_group_given, str(tmp_path / "lm"), deadline_s=DEADLINE_S)


def check_a_collective_past_the_timeout():
    """A collective node whose peer never runs its model fails once the timeout has passed: the
    session's run raises a RuntimeError naming the node and the collective that did not complete
    (the stand-in cannot raise: onnxruntime-extensions would end the process), bounded; the nodes
    after it (the head's all-gather) do not communicate; and the session runs again. Rank 1 runs
    nothing after making its session; rank 0 runs its language model twice, each run failing."""
    import time

    import torch.distributed as dist

    from tp_kernels import _collectives

    r, _ = rank_world()
    group = dist.new_group([0, 1])  # used by both ranks to make their models, then abandoned by rank 1
    dense, ids, _ = _dense("lm", 2)
    model = tp_kernels.parallelize(copy.deepcopy(dense), {"embed": "vocab", "lm_head": "colwise_gather_output"},
                                   group=group)
    proto = tp_kernels.onnx.export(model, (ids,))
    assert [n.op_type for n in proto.graph.node if n.domain == tp_kernels.onnx.DOMAIN] == ["AllReduce", "AllGather"]
    session = tp_kernels.onnx.cpu_session(proto, group=group)
    if r != 0:
        return None
    with tp_kernels.settings.overriding(timeout=2), \
            mock.patch.object(_collectives, "all_gather_dim0", side_effect=AssertionError("gathered")) as gather:
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"a collective AllReduce node of this rank's model failed, .* "
                                                   r"all-reduce of \(3, 5, 12\) torch.float32 did not complete"):
                session.run(None, {session.get_inputs()[0].name: ids.numpy()})
            assert time.monotonic() - start < 15
    assert not gather.called


def test_a_collective_past_the_timeout_is_an_error_of_the_run(world2):
    world2.run(check_a_collective_past_the_timeout, deadline_s=DEADLINE_S)


def check_sessions_of_models_the_ranks_disagree_on(path):
    """cpu_session refuses, on every rank, models the ranks cannot run together: rank 0's model
    loaded on both ranks (rank 1 names its model's metadata, rank 0 names rank 1 and its message),
    and models of two dense models, each made for its rank (both ranks list each rank's
    collectives); without the metadata, rank 0's model on both ranks is still refused on both (the
    ranks' graphs are compared), where each rank's own model, stripped too, runs and gives the
    dense logits."""
    import torch.distributed as dist

    r, _ = rank_world()
    models = {}
    for case, plan in (("lm", {"embed": "vocab", "lm_head": "colwise_gather_output"}), ("mlp", MLP_PLAN)):
        dense, x, _ = _dense(case, 2)
        models[case] = tp_kernels.onnx.export(tp_kernels.parallelize(copy.deepcopy(dense), plan), (x,),
                                              f"{path}-{case}-{r}.onnx")
    dense, ids, _ = _dense("lm", 2)
    dist.barrier()  # every rank's files written
    first = onnx.load(f"{path}-lm-0.onnx")
    if r == 1:
        with pytest.raises(ValueError, match=re.escape(f"model: it is rank 0's model of a group of 2 (its metadata "
                                                       f"{RANK_KEY!r}, {GROUP_SIZE_KEY!r}), and this process is "
                                                       "rank 1 of the group of 2")):
            tp_kernels.onnx.cpu_session(first)
    else:
        with pytest.raises(RuntimeError, match=r"tp_kernels.onnx.cpu_session: a rank of group .* rejected its "
                                               r"arguments, so no rank ran the call \(rank 1: model: it is rank 0's"):
            tp_kernels.onnx.cpu_session(first)
    with pytest.raises(RuntimeError, match=re.escape(
            "disagree on this call, so none of it ran (rank 0: tp_kernels.onnx.cpu_session: AllReduce(float32), "
            "AllGather(group_size=2, axis=0, float32); rank 1: tp_kernels.onnx.cpu_session: AllReduce(float32))")):
        tp_kernels.onnx.cpu_session(models["lm" if r == 0 else "mlp"])
    # the same collectives in another type on one rank: as many elements, another number of bytes
    mlp, x, plan = _dense("mlp", 2)
    wide = tp_kernels.onnx.export(tp_kernels.parallelize(copy.deepcopy(mlp).double(), plan), (x.double(),))
    with pytest.raises(RuntimeError, match=re.escape(
            "(rank 0: tp_kernels.onnx.cpu_session: AllReduce(float32); rank 1: tp_kernels.onnx.cpu_session: "
            "AllReduce(float64))")):
        tp_kernels.onnx.cpu_session(models["mlp"] if r == 0 else wide)
    del first.metadata_props[:]
    with pytest.raises(RuntimeError, match=r"tp_kernels.onnx.cpu_session: ranks \[0, 1\] of group '.+' hold the same "
                                           "model, and its metadata does not say which rank's it is " + re.escape(
                                               f"({RANK_KEY!r}, {GROUP_SIZE_KEY!r}): load each rank's own model")):
        _run(first, ids)  # without the check: rank 1 ran rank 0's shards, and the logits were wrong
    own = models["lm"]
    del own.metadata_props[:]
    assert_close(f"rank {r}'s lm without its metadata", _run(own, ids), dense.double()(ids).detach())


def test_sessions_of_models_the_ranks_disagree_on_are_refused(world2, tmp_path):
    world2.run(check_sessions_of_models_the_ranks_disagree_on, str(tmp_path / "m"), deadline_s=DEADLINE_S)


def check_sessions_of_models_that_say_what_they_are_not():
    """One rank: a model whose metadata names no rank of its group, or not as an int, or one key
    alone, is a ValueError naming the key; a model made for rank 1 of 2 is refused on a group of 1;
    a group without a host route is named."""
    rank_world()
    dense, x, plan = _dense("mlp", 1)
    proto = tp_kernels.onnx.export(tp_kernels.parallelize(copy.deepcopy(dense), plan), (x,))
    assert made_for(proto) is None  # (a model of one rank: no collectives, no shards)
    for props, message in (({GROUP_SIZE_KEY: "2", RANK_KEY: "2"}, "says rank 2 of a group of 2"),
                           ({GROUP_SIZE_KEY: "two", RANK_KEY: "0"},
                            f"metadata {GROUP_SIZE_KEY!r} is 'two', not an int"),
                           ({RANK_KEY: "0"}, f"metadata {GROUP_SIZE_KEY!r} is None, not an int"),
                           ({GROUP_SIZE_KEY: "2", RANK_KEY: "1"}, "it is rank 1's model of a group of 2")):
        bad = copy.deepcopy(proto)
        del bad.metadata_props[:]
        helper.set_model_props(bad, props)
        with pytest.raises(ValueError, match=re.escape(message)):
            tp_kernels.onnx.cpu_session(bad)
    with mock.patch.object(tp_kernels.parallel_state, "host_group", return_value=None), \
            pytest.raises(ValueError, match=r"group: .* carries no host tensors \(gloo\) and has no host twin"):
        tp_kernels.onnx.cpu_session(proto)
    assert_close("mlp exported, 1 rank", _run(proto, x), dense.double()(x.double()).detach())
    assert made_for(tp_kernels.onnx.export(dense, (x,))) is None  # no tp_kernels op: nothing to say


@pytest.mark.parametrize("world", [1], indirect=True)
def test_sessions_of_models_that_say_what_they_are_not(world):
    world.run(check_sessions_of_models_that_say_what_they_are_not, deadline_s=DEADLINE_S)


def _dense_onnx(model, x) -> onnx.ModelProto:
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        return torch.onnx.export(model, (x,), dynamo=True, opset_version=tp_kernels.onnx.OPSET).model_proto


def check_shard(case):
    """The shard route: the dense model's ONNX split by the plan equals the dense model, with the
    collectives tensor parallelism needs (one all-reduce per row-parallel projection; the split
    logits gathered for a softmax over the vocabulary)."""
    r, p = rank_world()
    dense, x, plan = _dense(case, p)
    ref = dense.double()(x if x.dtype == torch.int64 else x.double()).detach()
    full = _dense_onnx(dense.float(), x)
    mine = tp_kernels.onnx.shard(full, plan, p, r)
    assert made_for(mine) == ((p, r) if p > 1 else None) and made_for(full) is None
    collectives = _collectives(mine)
    if p > 1:
        reduces = collectives.count("AllReduce")
        assert reduces == {"mlp": 1, "block": 2, "lm": 1, "lm_softmax": 1}[case], collectives
        gathers = collectives.count("AllGather")
        # block: the keys, merged with the batch
        assert gathers <= {"mlp": 0, "block": 1, "lm": 1, "lm_softmax": 1}[case], collectives
    else:
        assert collectives == []
    sizes = sum(i.ByteSize() for i in mine.graph.initializer)
    assert p == 1 or sizes < 0.75 * sum(i.ByteSize() for i in full.graph.initializer)  # the weights are split
    assert_close(f"{case} sharded, rank {r} of {p}", _run(mine, x), ref)
    return collectives


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("case", ["mlp", "block", "lm", "lm_softmax"])
def test_sharded_per_rank_models_match_the_dense_model(world, case):
    per_rank = world.run(check_shard, case, deadline_s=DEADLINE_S)
    assert all(c == per_rank[0] for c in per_rank)  # every rank's graph makes the same collectives


def check_shard_in_other_types():
    """The shard route in float64 and float16: the stand-ins move float64 as it is and float16 as
    float32, between two ``Cast`` nodes. An MLP (an all-reduce) and an LM head with a softmax over
    the vocabulary (an all-gather) each equal the dense model in float64: to 1e-6 in float64, in
    float16 within twice the error of the dense float16 model run by ONNX Runtime, plus an ulp."""
    import onnxruntime

    r, p = rank_world()
    for case in ("mlp", "lm_softmax"):
        dense, x, plan = _dense(case, p)
        if case == "mlp":
            dense[1] = nn.ReLU()  # (ONNX Runtime's CPU build has no Erf in float64 nor float16)
        ref = dense.double()(x if x.dtype == torch.int64 else x.double()).detach()
        for dtype in (torch.float64, torch.float16):
            xt = x if x.dtype == torch.int64 else x.to(dtype)
            full = _dense_onnx(copy.deepcopy(dense).to(dtype), xt)
            mine = tp_kernels.onnx.shard(full, plan, p, r)
            standins = tp_kernels.onnx.standin_model(mine)
            casts = [n for n in standins.graph.node if n.op_type == "Cast" and n.output[0].endswith("float32_in")]
            assert len(casts) == (len(_collectives(mine)) if dtype == torch.float16 else 0), standins.graph.node
            plain = None
            if dtype == torch.float16:
                session = onnxruntime.InferenceSession(full.SerializeToString(), providers=["CPUExecutionProvider"])
                plain = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: xt.numpy()})[0])
            got = _run(mine, xt)
            assert got.dtype == dtype, got.dtype
            assert_close(f"{case} sharded in {dtype}, rank {r} of {p}", got, ref, plain)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_sharded_models_in_float64_and_float16(world):
    world.run(check_shard_in_other_types, deadline_s=DEADLINE_S)


def test_a_collective_of_another_type_is_refused():
    """A collective node moving a type the stand-ins do not move (here int64) is a ``ValueError``
    naming the node and the type, from ``standin_model`` (and so from ``cpu_session``, on its rank,
    before anything runs); one of bfloat16 moves as float32 between two ``Cast`` nodes; one of
    float64 is its own stand-in, which a second ``standin_model`` leaves as it is."""
    for elem_type, name in ((onnx.TensorProto.INT64, "int64"), (onnx.TensorProto.BFLOAT16, None),
                            (onnx.TensorProto.DOUBLE, None)):
        graph = helper.make_graph(
            [helper.make_node("Neg", ["x"], ["y"]),
             helper.make_node("AllGather", ["y"], ["z"], name="gather_y", domain=tp_kernels.onnx.DOMAIN, group_size=2,
                              axis=0)],
            "typed", [helper.make_tensor_value_info("x", elem_type, [3])],
            [helper.make_tensor_value_info("z", elem_type, [6])])
        model = _hand_built(graph)
        model.opset_import.append(helper.make_opsetid(tp_kernels.onnx.DOMAIN, 1))
        if name is not None:
            with pytest.raises(ValueError, match=rf"model: its AllGather node 'gather_y' moves {name}, a type the CPU "
                                                 r"stand-ins do not move: float32 and float64"):
                tp_kernels.onnx.standin_model(model)
            continue
        standins = tp_kernels.onnx.standin_model(model)
        assert tp_kernels.onnx.standin_model(standins) == standins  # (its stand-ins known as such)
        if elem_type == onnx.TensorProto.DOUBLE:
            assert [(n.op_type, n.domain) for n in standins.graph.node] == [
                ("Neg", ""), ("AllGatherFloat64", tp_kernels.onnx.STANDIN_DOMAIN)]
            continue
        assert [(n.op_type, n.domain) for n in standins.graph.node] == [
            ("Neg", ""), ("Cast", ""), ("AllGather", tp_kernels.onnx.STANDIN_DOMAIN), ("Cast", "")]
        assert standins.graph.node[-1].output[0] == "z"
        assert helper.get_attribute_value(standins.graph.node[-1].attribute[0]) == elem_type


def _hand_built(graph) -> onnx.ModelProto:
    """A model of the hand-built ``graph``, at the opset tp_kernels.onnx writes."""
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", tp_kernels.onnx.OPSET)])


def _gemm_mlp(p):
    """A dense ONNX MLP of two ``Gemm`` nodes whose ``alpha`` and ``beta`` are not 1 (as exporters
    other than torch's write them; ``fc2``'s weight ``[k, n]``, ``transB=0``), its input, and its
    output in float64."""
    g = torch.Generator().manual_seed(0)
    k, hidden, n = 6, 4 * p, 5
    weights = {"w1": torch.randn(hidden, k, generator=g), "b1": torch.randn(hidden, generator=g),
               "w2": torch.randn(hidden, n, generator=g), "b2": torch.randn(n, generator=g)}
    x = torch.randn(3, k, generator=g)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1, alpha=0.75, beta=0.5),
             helper.make_node("Relu", ["h"], ["a"], name="act"),
             helper.make_node("Gemm", ["a", "w2", "b2"], ["y"], name="fc2", alpha=1.25, beta=-2.0)]
    graph = helper.make_graph(nodes, "gemm_mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, n])],
                              [numpy_helper.from_array(w.numpy(), name) for name, w in weights.items()])
    model = _hand_built(graph)
    w = {name: t.double() for name, t in weights.items()}
    y = 1.25 * torch.relu(0.75 * x.double() @ w["w1"].t() + 0.5 * w["b1"]) @ w["w2"] - 2.0 * w["b2"]
    return model, x, y


def check_shard_gemm_scales():
    """A ``Gemm``'s ``alpha`` and ``beta`` survive the split: the column-parallel one scales its
    block of the product and of the bias, the row-parallel one each rank's partial product, and
    its bias, times ``beta``, is added once after the sum."""
    r, p = rank_world()
    dense, x, want = _gemm_mlp(p)
    mine = tp_kernels.onnx.shard(dense, {"fc1": "colwise", "fc2": "rowwise"}, p, r)
    assert _collectives(mine) == (["AllReduce"] if p > 1 else [])
    assert_close(f"Gemm MLP sharded, rank {r} of {p}", _run(mine, x), want)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_sharded_gemm_keeps_its_alpha_and_beta(world):
    world.run(check_shard_gemm_scales, deadline_s=DEADLINE_S)


def _propagation_model(p, elem_type):
    """A dense ONNX graph whose column-parallel ``Gemm`` (``fc1``, output ``h`` ``[3, 4p]``, split
    along its last axis) feeds every node type the split follows through: along other axes
    (reductions, ``Softmax``, ``Concat``, ``Slice``, ``Split``, ``Gather``, ``Transpose``,
    ``Unsqueeze``/``Squeeze``, ``Reshape``, a broadcast ``Add`` of a replicated constant) into a
    row-parallel ``Gemm`` (``fc2``), and along the split axis itself (each an output of its own,
    and a ``LayerNormalization`` before ``fc2``), with the ``Shape`` of ``h``. In ``elem_type``;
    returns the model and its input."""
    import numpy as np

    w = 4 * p
    g = torch.Generator().manual_seed(0)
    np_type = helper.tensor_dtype_to_np_dtype(elem_type)
    consts = {"w1": torch.randn(w, 6, generator=g), "b1": torch.randn(w, generator=g),
              "w2": torch.randn(w, 5, generator=g), "cvec": torch.randn(w, generator=g),
              "ln_scale": torch.rand(w, generator=g) + 0.5, "ln_bias": torch.randn(w, generator=g)}
    initializers = [numpy_helper.from_array(t.numpy().astype(np_type), name) for name, t in consts.items()]
    ints = {"ax0": [0], "ax1": [1], "ax2": [2], "starts": [1], "ends": [5], "starts1": [1], "ends1": [3],
            "split13": [1, 3], "split_1": [1, w - 1], "rows": [2, 0], "cols": [0, w - 1], "shape3": [4, 2 * p, 2]}
    initializers += [numpy_helper.from_array(np.array(v, dtype=np.int64), name) for name, v in ints.items()]
    n = helper.make_node
    nodes = [
        n("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        # along other axes than the split one: the split follows
        n("ReduceSum", ["h", "ax0"], ["a"], keepdims=1), n("Sub", ["h", "a"], ["b"]),
        n("Softmax", ["b"], ["c"], axis=0), n("Concat", ["c", "b"], ["d"], axis=0),
        n("Slice", ["d", "starts", "ends", "ax0"], ["e"]), n("Transpose", ["e"], ["f"], perm=[1, 0]),
        n("Unsqueeze", ["f", "ax0"], ["unsqueezed"]), n("Squeeze", ["unsqueezed", "ax0"], ["f2"]),
        n("Transpose", ["f2"], ["e2"]), n("Add", ["e2", "cvec"], ["j"]),
        n("Reshape", ["j", "shape3"], ["k"]), n("ReduceMax", ["k", "ax2"], ["k2"], keepdims=0),
        n("Split", ["j", "split13"], ["j1", "j3"], axis=0), n("Gather", ["j3", "rows"], ["g0"], axis=0),
        # along the split axis: on the whole of it
        n("LayerNormalization", ["g0", "ln_scale", "ln_bias"], ["ln"], axis=-1),
        n("Gemm", ["ln", "w2"], ["y"], name="fc2"),
        n("ReduceSum", ["h", "ax1"], ["o_sum"], keepdims=0), n("Relu", ["h"], ["relu"]),
        n("Concat", ["h", "relu"], ["o_cat"], axis=1), n("Slice", ["h", "starts1", "ends1", "ax1"], ["o_slice"]),
        n("Split", ["h", "split_1"], ["o_first", "o_rest"], axis=1), n("Gather", ["h", "cols"], ["o_cols"], axis=1),
        n("Softmax", ["h"], ["o_softmax"], axis=1), n("Shape", ["h"], ["o_shape"]),
    ]
    outputs = {"y": [2, 5], "k2": [4, 2 * p], "unsqueezed": [1, w, 4], "o_sum": [3], "o_cat": [3, 2 * w],
               "o_slice": [3, 2], "o_first": [3, 1], "o_rest": [3, w - 1], "o_cols": [3, 2], "o_softmax": [3, w]}
    graph = helper.make_graph(
        nodes, "propagation", [helper.make_tensor_value_info("x", elem_type, [3, 6])],
        [helper.make_tensor_value_info(name, elem_type, shape) for name, shape in outputs.items()]
        + [helper.make_tensor_value_info("o_shape", onnx.TensorProto.INT64, [2])], initializers)
    x = torch.randn(3, 6, generator=g).numpy().astype(np_type)
    return _hand_built(graph), x


def check_shard_propagation():
    """The split of a column-parallel output followed through each node type (:func:`_propagation_model`):
    every output of the rank's model, float32, is the dense graph's in float64 (run by ONNX Runtime)."""
    import onnxruntime

    r, p = rank_world()
    dense, x = _propagation_model(p, onnx.TensorProto.FLOAT)
    dense64, x64 = _propagation_model(p, onnx.TensorProto.DOUBLE)
    reference = onnxruntime.InferenceSession(dense64.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in reference.get_outputs()]
    want = dict(zip(names, reference.run(None, {"x": x64})))
    mine = tp_kernels.onnx.shard(dense, {"fc1": "colwise", "fc2": "rowwise"}, p, r)
    session = tp_kernels.onnx.cpu_session(mine)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    assert sorted(got) == sorted(want)
    for name in names:
        if name == "o_shape":
            assert got[name].tolist() == want[name].tolist() == [3, 4 * p], (got[name], want[name])
        else:
            assert_close(f"{name}, rank {r} of {p}", torch.from_numpy(got[name]), torch.from_numpy(want[name]))
    return _collectives(mine)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_sharded_split_follows_every_node_type(world):
    per_rank = world.run(check_shard_propagation, deadline_s=DEADLINE_S)
    assert all(c == per_rank[0] for c in per_rank)


def test_split_outputs_are_gathered_in_the_graphs_order():
    """``shard`` gathers the graph outputs a rank holds a block of in the graph's order of them, so
    that every rank's model, each made in a process of its own (whose hash seed differs), makes its
    collectives in one order: here eight, an order a set's would match once in 40320."""
    names = [f"out{i}" for i in range(8)]
    weight = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "w")
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1)]
    nodes += [helper.make_node("Mul", ["h", "h"] if i % 2 else ["h", "x2"], [name]) for i, name in enumerate(names)]
    scale = numpy_helper.from_array(torch.full((8,), 2.0).numpy(), "x2")
    graph = helper.make_graph(nodes, "outputs", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 6])],
                              [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3, 8]) for n in names],
                              [weight, scale])
    dense = _hand_built(graph)
    mine = tp_kernels.onnx.shard(dense, {"fc": "colwise"}, 2, 0)
    gathered = [n.output[0] for n in mine.graph.node if n.op_type == "AllGather" and n.output[0] in names]
    assert gathered == names


# --- bad plans and arguments ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_block():
    dense, x, _ = _dense("block", 2)
    return _dense_onnx(dense, x)


@pytest.mark.parametrize("plan,world_size,message", [
    ({"attn.nope": "colwise"}, 2, r"plan: pattern 'attn.nope' matches no node, initializer or module path"),
    ({"norm1": "colwise"}, 2, r"plan\['norm1'\]: style 'colwise' applies to MatMul or Gemm nodes, but .* is a "
                               r"LayerNormalization"),
    ({"mlp.0": "vocab"}, 2, r"plan\['mlp.0'\]: style 'vocab' applies to Gather nodes"),
    ({"mlp.0": "diagonal"}, 2, r"plan\['mlp.0'\]: unknown style 'diagonal'; expected one of 'colwise', 'rowwise'"),
    ({"mlp.0": ("colwise", [4, 4])}, 2, r"plan\['mlp.0'\]: unknown style \('colwise', \[4, 4\]\); .* by "
                                         r"tp_kernels.parallelize only"),
    ({"attn.q_proj": "colwise"}, 4, r"plan\['attn.q_proj'\]: .* \(colwise\) has out_features=30, which the world "
                                    r"size 4 does not divide"),
    ({"mlp.2": "rowwise"}, 3, r"plan\['mlp.2'\]: .* \(rowwise\) has in_features=34, which the world size 3"),
    ({"mlp.2": "rowwise", "mlp.*": "colwise"}, 2, r"plan: .* is matched as 'colwise' by 'mlp.\*' and as 'rowwise' "
                                                  r"by 'mlp.2'"),
    ({}, 2, r"plan: expected a non-empty mapping"),
])
def test_bad_plans_name_the_pattern(dense_block, plan, world_size, message):
    with pytest.raises(ValueError, match=message):
        tp_kernels.onnx.shard(dense_block, plan, world_size, 0)


def test_nodes_a_style_cannot_split_name_the_pattern():
    """A ``Gemm`` that transposes its input (``transA=1``: the rows a column split keeps would be
    its columns) and a ``Gather`` along another axis than the table's rows are refused, naming the
    pattern and the node, where splitting them as their style says would compute another model."""
    weight = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "w")
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [6, 3])
    gemm = _hand_built(helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], name="fc", transA=1, transB=1)], "gemm", [x],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 8])], [weight]))
    with pytest.raises(ValueError, match=r"plan\['fc'\]: 'fc' is a Gemm with transA=1, which is not supported"):
        tp_kernels.onnx.shard(gemm, {"fc": "colwise"}, 2, 0)
    ids = helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [4])
    gather = _hand_built(helper.make_graph(
        [helper.make_node("Gather", ["w", "ids"], ["rows"], name="lookup", axis=1)], "gather", [ids],
        [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, [8, 4])], [weight]))
    with pytest.raises(ValueError, match=r"plan\['lookup'\]: 'lookup' gathers along axis 1, not the table's rows"):
        tp_kernels.onnx.shard(gather, {"lookup": "vocab"}, 2, 0)


def test_a_weight_another_node_uses_too_is_kept_whole_for_it():
    """A weight the planned node shares with another node (here an ``Identity`` handing it on as an
    output) is cut into a new initializer for the planned node; the other node keeps the whole one,
    under its own name (cut in place, it would read this rank's block)."""
    weight = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "w")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], name="fc", transB=1),
         helper.make_node("Identity", ["w"], ["w_out"])],
        "shared", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 8]),
         helper.make_tensor_value_info("w_out", onnx.TensorProto.FLOAT, [8, 6])], [weight])
    mine = tp_kernels.onnx.shard(_hand_built(graph), {"fc": "colwise"}, 2, 1)
    inits = {i.name: numpy_helper.to_array(i) for i in mine.graph.initializer}
    fc = next(n for n in mine.graph.node if n.op_type == "Gemm")
    identity = next(n for n in mine.graph.node if n.op_type == "Identity")
    assert identity.input[0] == "w" and inits["w"].shape == (8, 6)
    assert fc.input[1] != "w" and (inits[fc.input[1]] == inits["w"][4:]).all()


def test_int32_ids_keep_their_type():
    """An embedding looked up by int32 ids (as some exporters write them) is split with its bounds
    and masks in int32: the sharded model type-checks (ONNX's strict inference), where bounds in
    int64 beside int32 ids would be a type error that ONNX Runtime refuses."""
    table = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup")], "lookup",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT32, [4])],
        [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, [4, 6])], [table])
    mine = tp_kernels.onnx.shard(_hand_built(graph), {"lookup": "vocab"}, 2, 1)
    onnx.shape_inference.infer_shapes(mine, check_type=True, strict_mode=True)
    bounds = [i for i in mine.graph.initializer if i.name.startswith(("table_start", "table_end"))]
    assert len(bounds) == 2 and all(i.data_type == onnx.TensorProto.INT32 for i in bounds), bounds


def test_a_gather_of_a_block_moves_its_split_past_the_indices_dims():
    """A ``Gather`` along axis 0 of a value held as blocks of its last axis, by indices of two dims,
    holds its output as blocks of its last axis too (axis 2 of ``[2, 2, 8]``): the graph output is
    gathered along it."""
    weight = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "w")
    picks = numpy_helper.from_array(torch.tensor([[0, 2], [1, 1]]).numpy(), "picks")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1),
         helper.make_node("Gather", ["h", "picks"], ["rows"], axis=0)],
        "picked", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, [2, 2, 8])], [weight, picks])
    mine = tp_kernels.onnx.shard(_hand_built(graph), {"fc": "colwise"}, 2, 0)
    (gather,) = [n for n in mine.graph.node if n.op_type == "AllGather"]
    assert list(gather.output) == ["rows"] and helper.get_attribute_value(gather.attribute[
        [a.name for a in gather.attribute].index("axis")]) == 2, gather


def test_a_matmul_over_blocks_of_its_contracted_axis_sums_them():
    """A ``MatMul`` of two values held as blocks of the axis it contracts (``h [3, 8/p]`` by its
    transpose ``[8/p, 3]``) multiplies the blocks and all-reduces the partial products: one
    ``AllReduce``, nothing gathered."""
    weight = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "w")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1),
         helper.make_node("Transpose", ["h"], ["ht"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "ht"], ["gram"])],
        "gram", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("gram", onnx.TensorProto.FLOAT, [3, 3])], [weight])
    mine = tp_kernels.onnx.shard(_hand_built(graph), {"fc": "colwise"}, 2, 0)
    assert [n.op_type for n in mine.graph.node if n.domain == tp_kernels.onnx.DOMAIN] == ["AllReduce"]


def test_a_reshape_keeps_a_split_only_where_p_divides_the_dim_it_lands_in():
    """A ``Reshape`` of ``h [3, 8]``, held as blocks of its last axis, to ``[3, 2, 4]`` keeps the
    split in axis 1 where p divides its 2 (p = 2: the output is gathered along axis 1); where p does
    not (p = 4: each rank's block of 2 columns is half a row of the 4 the reshape makes), ``h`` is
    gathered whole before the reshape and its output is whole."""
    weight = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "w")
    shape = numpy_helper.from_array(torch.tensor([3, 2, 4]).numpy(), "shape")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1),
         helper.make_node("Reshape", ["h", "shape"], ["k"])],
        "reshaped", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("k", onnx.TensorProto.FLOAT, [3, 2, 4])], [weight, shape])

    def gathers(p):
        mine = tp_kernels.onnx.shard(_hand_built(graph), {"fc": "colwise"}, p, 0)
        return [(n.input[0], n.output[0], helper.get_attribute_value(next(a for a in n.attribute if a.name == "axis")))
                for n in mine.graph.node if n.op_type == "AllGather"]

    (kept,) = gathers(2)
    assert kept[1:] == ("k", 1), kept
    (whole,) = gathers(4)
    assert whole[0] == "h" and whole[2] == 1, whole


def test_a_subgraph_reading_a_block_is_refused():
    """A node whose subgraph (an ``If``'s branches) reads a value this rank holds only a block of is
    refused, naming it, where its branches would compute on the block as if it were whole."""
    weight = numpy_helper.from_array(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).numpy(), "w")
    branch = [helper.make_graph([helper.make_node("Identity", ["h"], [f"{side}_out"])], side, [],
                                [helper.make_tensor_value_info(f"{side}_out", onnx.TensorProto.FLOAT, [3, 8])])
              for side in ("then", "else")]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1),
         helper.make_node("If", ["cond"], ["y"], name="choose", then_branch=branch[0], else_branch=branch[1])],
        "branching", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 6]),
                      helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 8])], [weight])
    with pytest.raises(ValueError, match=r"shard: 'choose' \(If\) has a subgraph that uses a value this rank holds "
                                         r"only a block of"):
        tp_kernels.onnx.shard(_hand_built(graph), {"fc": "colwise"}, 2, 0)


def test_bad_shard_and_export_arguments(dense_block):
    for world_size, rank, message in ((2, 2, r"rank 2 of 2"), (0, 0, r"rank 0 of 0"), (2, True, r"rank: expected an int")):
        with pytest.raises(ValueError, match=message):
            tp_kernels.onnx.shard(dense_block, BLOCK_PLAN, world_size, rank)
    with pytest.raises(ValueError, match=r"model: expected an onnx.ModelProto, got str"):
        tp_kernels.onnx.shard("model.onnx", BLOCK_PLAN, 2, 0)
    with pytest.raises(ValueError, match=r"opset_version: expected an int >= 18, got 16"):
        tp_kernels.onnx.export(nn.Linear(2, 2), (torch.ones(1, 2),), opset_version=16)
    assert onnx.checker.check_model(dense_block) is None  # shard left the model it was given unchanged
    assert not any(n.domain == tp_kernels.onnx.DOMAIN for n in dense_block.graph.node)


def test_tp_kernels_imports_without_the_onnx_extra():
    code = ("import sys\n"
            "for m in ('onnx', 'onnxruntime', 'onnxscript', 'onnxruntime_extensions'): sys.modules[m] = None\n"
            "import tp_kernels\n"
            "try:\n"
            "    import tp_kernels.onnx\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tp_kernels.onnx needs the onnx extra (pip install 'tp_kernels[onnx]')" in out.stdout
