"""Vocabulary-parallel embedding and cross-entropy against nn.Embedding / F.cross_entropy."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tp_kernels
from tp_kernels import mappings
from helpers import (CopiedBytes, assert_close, assert_dense_grads, block, fingerprints_set, held_rows, padded_block,
                     rank_world, skip_unless_own_plan)


def check_embedding(padding_idx, device="cpu"):
    """VocabParallelEmbedding against nn.Embedding on ``device``: its default init (drawn on the
    CPU), the lookup (exact) and the weight's gradient, under no_grad and inference_mode too, the
    padding row's zero gradient; ids out of range or not integers are a ValueError naming the
    input on every rank."""
    r, p = rank_world()
    vocab, dim = 11 * p, 5
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    torch.manual_seed(0)
    built = tp_kernels.VocabParallelEmbedding(vocab, dim, padding_idx=padding_idx)
    # default init draws the same full table as nn.Embedding under the same seed (a negative
    # padding index counted from the end, as nn.Embedding counts it)
    assert torch.equal(built.weight, block(dense.weight, 0, r, p)) and built.padding_idx == dense.padding_idx
    dense = dense.to(device)
    par = tp_kernels.VocabParallelEmbedding.from_embedding(dense)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 7), generator=g)
    ids[0, :3] = torch.tensor([0, vocab - 1, 11 * (p - 1)])  # both ends and the last rank's first row
    dy = torch.randn(4, 7, dim, generator=g)
    ids, dy = ids.to(device), dy.to(device)
    y = par(ids)
    y.backward(dy)
    ref = dense(ids)
    ref.backward(dy)
    assert torch.equal(y, ref)  # one nonzero term per output: exact
    assert_close("embedding dW", par.weight.grad, block(dense.weight.grad, 0, r, p).double())
    for context in (torch.no_grad, torch.inference_mode):  # (the sum written into the rows looked up: the same)
        with context():
            assert torch.equal(par(ids), ref), context
    if padding_idx is not None:
        pad_owner, pad_local = divmod(dense.padding_idx, 11)
        if pad_owner == r:
            assert torch.all(par.weight.grad[pad_local] == 0)
    with pytest.raises(ValueError, match="input"):
        par(torch.tensor([0, vocab], device=device))
    with pytest.raises(ValueError, match="input"):
        par(torch.tensor([-1], device=device))
    with pytest.raises(ValueError, match="input"):
        par(torch.zeros(3, device=device))


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_embedding_matches_dense(world, padding_idx):
    world.run(check_embedding, padding_idx)


def check_sequence_parallel_embedding():
    """With sequence_parallel=True each rank returns its block of dim 0 of the dense embedding
    (reduce-scattered), and the gradient of its rows is the dense one; with ``sequence_dim=1``, its
    block of dim 1 of batch-first ids' lookup, copying no more floats than along dim 0 (the ids'
    blocks are stacked first); ids whose dim 0 p does not divide are refused on every rank before
    anything moves."""
    r, p = rank_world()
    vocab, dim, s = 5 * p, 4, 3 * p
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, dim, padding_idx=2).double()
    par = tp_kernels.VocabParallelEmbedding.from_embedding(dense, sequence_parallel=True)
    assert par.sequence_parallel and "sequence_parallel=True" in repr(par)
    g = torch.Generator().manual_seed(1)
    for shape in [(s,), (s, 2)]:
        ids = torch.randint(0, vocab, shape, generator=g)
        dy = torch.randn(*shape, dim, generator=g, dtype=torch.float64)
        dense.zero_grad()
        par.zero_grad()
        ref = dense(ids)
        ref.backward(dy)
        y = par(ids)
        assert y.shape == (s // p, *shape[1:], dim), y.shape
        assert torch.equal(y, block(ref, 0, r, p))  # one nonzero term per output: exact
        y.backward(block(dy, 0, r, p))
        assert_close("sequence-parallel embedding dW", par.weight.grad, block(dense.weight.grad, 0, r, p))
    batch_first = tp_kernels.VocabParallelEmbedding.from_embedding(dense, sequence_parallel=True, sequence_dim=1)
    ids = torch.randint(0, vocab, (2, s), generator=g)
    dy = torch.randn(2, s, dim, generator=g, dtype=torch.float64)
    dense.zero_grad()
    dense(ids).backward(dy)
    copied = []
    for layer, ids_, dy_ in ((batch_first, ids, block(dy, 1, r, p)), (par, ids.t(), block(dy, 1, r, p).transpose(0, 1))):
        layer.zero_grad()
        with CopiedBytes() as forward:
            y = layer(ids_)
        with CopiedBytes() as backward:
            y.backward(dy_)
        copied.append((forward.floating, backward.floating))
        if layer is batch_first:
            assert y.is_contiguous() and torch.equal(y, block(dense(ids), 1, r, p))
            assert_close("batch-first embedding dW", layer.weight.grad, block(dense.weight.grad, 0, r, p))
    assert copied[0] == copied[1], f"batch-first: copied {copied[0]} bytes of floats (forward, backward), dim 0 {copied[1]}"
    if p > 1:
        with pytest.raises(ValueError, match=r"input.shape\[0\] \(" + str(s + 1) + r"\) is not divisible"):
            par(torch.zeros(s + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="input: expected at least 1 dims"):
        par(torch.tensor(0))
    assert torch.equal(par(torch.zeros(p, dtype=torch.long)), block(dense(torch.zeros(p, dtype=torch.long)), 0, r, p))
    if p > 1:  # a rank whose embedding is built otherwise: an error on every rank, not a mismatched collective
        odd = tp_kernels.VocabParallelEmbedding.from_embedding(dense, sequence_parallel=r != 1)
        with fingerprints_set(True), pytest.raises(RuntimeError,
                                                   match="disagree on this call.*sequence_parallel=True"):
            odd(torch.zeros(s, dtype=torch.long))
        assert par(torch.zeros(s, dtype=torch.long)).shape == (s // p, dim)  # the group still works


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_sequence_parallel_embedding(world):
    world.run(check_sequence_parallel_embedding)


class ScaledEmbedding(nn.Embedding):
    """Gemma's scaled word embedding: the lookup times ``sqrt(embedding_dim)`` in the weight's dtype,
    the scale a buffer kept out of the state dict."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(self.embedding_dim ** 0.5), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class NormedEmbedding(nn.Embedding):
    def forward(self, ids):  # (not the lookup times a constant)
        return F.normalize(super().forward(ids), dim=-1)


class ShiftedEmbedding(nn.Embedding):
    def forward(self, ids):  # (an added term: summed p times over the ranks)
        return super().forward(ids) + 1


class WidenedEmbedding(nn.Embedding):
    def forward(self, ids):  # (the lookup times 2, in float64 whatever the weight's dtype)
        return super().forward(ids).double() * 2


class UnscaledEmbedding(nn.Embedding):
    def forward(self, ids):  # (the lookup times 1: nothing to scale)
        return super().forward(ids) * 1.0


def check_scaled_embedding(dtype_name, sequence_parallel):
    """An ``nn.Embedding`` subclass whose forward is the lookup times a constant (Gemma's: the
    scale ``sqrt(24)``, not exact in any float) becomes a VocabParallelEmbedding scaling its rows
    alike: its output is the subclass's bit for bit, and its weight's gradient the dense one's rows.
    A forward that is anything else, a subclass on the meta device, or one keeping a buffer in its
    state dict is a ValueError naming the reason."""
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    dense = ScaledEmbedding(5 * p, 24, padding_idx=1).to(dtype)
    par = tp_kernels.VocabParallelEmbedding.from_embedding(dense, sequence_parallel=sequence_parallel)
    assert par.output_scale == torch.tensor(24 ** 0.5).to(dtype).item() and "output_scale=" in repr(par)
    ids = torch.randint(0, 5 * p, (2 * p, 3), generator=torch.Generator().manual_seed(1))
    want = dense(ids)
    got = par(ids)
    assert torch.equal(got, block(want, 0, r, p) if sequence_parallel else want), (got - want).abs().max()
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    want.backward(dy)
    got.backward(block(dy, 0, r, p) if sequence_parallel else dy)
    torch.testing.assert_close(par.weight.grad, block(dense.weight.grad, 0, r, p), rtol=0, atol=0)
    # a scale given as a number not exact in the weight's dtype: the rows times it in that dtype, as
    # Gemma's own embedding multiplies (not times the number itself, which rounds once, later)
    direct = tp_kernels.VocabParallelEmbedding(5 * p, 24, padding_idx=1, output_scale=24 ** 0.5, dtype=dtype,
                                               sequence_parallel=sequence_parallel)
    direct.load_full_weight(dense.weight.detach())
    want = F.embedding(ids, dense.weight.detach(), 1) * torch.tensor(24 ** 0.5, dtype=dtype)
    got = direct(ids)
    assert torch.equal(got, block(want, 0, r, p) if sequence_parallel else want), (got - want).abs().max()
    for kind, match in ((NormedEmbedding, "not the lookup times a constant"),
                        (ShiftedEmbedding, "not the lookup times a constant"),
                        (WidenedEmbedding, "not the lookup times a constant")):
        with pytest.raises(ValueError, match=f"embedding: {kind.__name__} is an nn.Embedding with a forward of its "
                                             f"own, which is {match}"):
            tp_kernels.VocabParallelEmbedding.from_embedding(kind(4 * p, 3))
    with pytest.raises(ValueError, match="cannot be run on the meta device"):
        tp_kernels.VocabParallelEmbedding.from_embedding(ScaledEmbedding(4 * p, 3, device="meta"))
    unscaled = tp_kernels.VocabParallelEmbedding.from_embedding(UnscaledEmbedding(4 * p, 3))
    assert unscaled.output_scale is None and "output_scale" not in repr(unscaled)
    hooked, called = ScaledEmbedding(4 * p, 3), []
    hooked.register_forward_hook(lambda module, args, out: called.append(1) or out + 1)
    with pytest.raises(ValueError, match="has hooks registered on it"):  # (and its forward not run to find a scale)
        tp_kernels.VocabParallelEmbedding.from_embedding(hooked)
    assert called == []
    kept = ScaledEmbedding(4 * p, 3)
    kept.register_buffer("counts", torch.zeros(4 * p))  # (in its state dict)
    with pytest.raises(ValueError, match="also holds 'counts'"):
        tp_kernels.VocabParallelEmbedding.from_embedding(kept)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_scaled_embedding(world, dtype, sequence_parallel):
    world.run(check_scaled_embedding, dtype, sequence_parallel)


def check_embedding_dim_split(scaled):
    """``"embedding_colwise"`` (``shard_embedding_dim``): each rank keeps its columns of every row
    of the table, and the ranks' lookups are gathered along the last dim: the output is the dense
    embedding's bit for bit (a padding row and Gemma's scaled subclass too), the weight's gradient
    (joined) the dense one's, and so are the state dict and the norm; the rest of the model is
    untouched. With fingerprints on, ranks looking up different shapes raise together."""
    r, p = rank_world()
    torch.manual_seed(0)
    table = ScaledEmbedding(11, 8, padding_idx=3) if scaled else nn.Embedding(11, 8, padding_idx=3)
    dense = nn.Sequential(table.double(), nn.Linear(8, 5, dtype=torch.float64))
    par = tp_kernels.parallelize(copy.deepcopy(dense), {"0": "embedding_colwise"})
    assert type(par[0]) is type(dense[0]) and par[0].embedding_dim == 8, par[0]
    assert torch.equal(par[0].weight, block(dense[0].weight.detach(), 1, r, p))
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    ids[0, 0] = 3
    assert torch.equal(par[0](ids), dense[0](ids))
    want, got = dense(ids), par(ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    want.square().sum().backward()
    got.square().sum().backward()
    assert_dense_grads(par, dense, 1e-12)
    total = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in dense.parameters()]))
    torch.testing.assert_close(tp_kernels.clip_grad_norm_(par, 1e9), total, rtol=1e-12, atol=0)
    full = tp_kernels.full_state_dict(par)
    assert all(torch.equal(full[k], v) for k, v in dense.state_dict().items())
    fresh = tp_kernels.parallelize(copy.deepcopy(dense).apply(lambda m: [q.data.zero_() for q in m.parameters(False)]),
                                   {"0": "embedding_colwise"})
    tp_kernels.load_full_state_dict(fresh, dense.state_dict())
    assert torch.equal(fresh(ids), got.detach())
    if p > 1:
        with fingerprints_set(True), pytest.raises(RuntimeError, match=r"disagree.*rank 0: .*input \[4, 5\] int64.*"
                                                                        r"rank 1: .*input \[3, 5\] int64"):
            par(ids[: 4 - min(r, 1)])
        assert torch.equal(par(ids), got.detach())  # (the group works afterwards)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_embedding_dim_split(world, scaled):
    world.run(check_embedding_dim_split, scaled)


def check_hugging_face_split_embedding_dim():
    """transformers' Qwen4-Exp by its own plan, whose per-layer n-gram embedding (a table of tens of
    GB at full size) is ``"embedding_colwise"``: each rank holds its columns of it, and the logits
    and every gradient are the dense model's in float64."""
    import transformers

    _, p = rank_world()
    config = transformers.Qwen4ExpTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts_per_tok=2, num_experts=4,
        layer_types=["linear_attention", "full_attention"], hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4,
        ngram_vocab_size_base=100, heads_per_ngram=2, split_ngram_parts=2, make_ngram_vocab_size_divisible_by=8,
        max_position_embeddings=64, eos_token_id=2, pad_token_id=0, bos_token_id=1, attn_implementation="eager",
        experts_implementation="eager")
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(config).double()
    plan = dict(dense.tp_plan)
    table = "model.layers.*.ple.ple_embedding.ngram_embedding"
    assert plan[table] == "embedding_colwise", plan
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    ngram = par.get_submodule(table.replace("*", "0"))
    assert ngram.weight.shape[1] == dense.get_submodule(table.replace("*", "0")).embedding_dim // p
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    want, got = dense(ids, labels=ids), par(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    want.loss.backward()
    got.loss.backward()
    for model in (dense, par):  # (what this small model leaves unused: no gradient in either)
        for q in model.parameters():
            q.grad = torch.zeros_like(q) if q.grad is None else q.grad
    assert_dense_grads(par, dense, 1e-12)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_hugging_face_split_embedding_dim(world):
    skip_unless_own_plan("Qwen4ExpTextConfig", "layers.*.ple.ple_embedding.ngram_embedding", "embedding_colwise")
    world.run(check_hugging_face_split_embedding_dim)


def check_embedding_dim_split_errors():
    """What ``"embedding_colwise"`` cannot split is a ValueError naming the module, before anything
    changes."""
    from tp_kernels.embedding import shard_embedding_dim

    _, p = rank_world()
    cases = [(nn.Embedding(5, 4 * p, max_norm=1.0), {}, r"'0': max_norm=1.0 renormalizes each whole row"),
             (NormedEmbedding(5, 4 * p), {}, r"NormedEmbedding is an nn.Embedding with a forward of its own"),
             (nn.Embedding(5, 4 * p), {"sequence_parallel": True}, r"'embedding_colwise' \(an embedding whose "
                                                                    r"output is whole\) does not go with sequence")]
    if p > 1:
        cases.append((nn.Embedding(5, 4 * p + 1), {}, rf"embedding_dim={4 * p + 1}, which the tensor-parallel size "
                                                      rf"{p} does not divide"))
    for table, options, message in cases:
        model = nn.Sequential(table)
        weight = table.weight.detach().clone()
        with pytest.raises(ValueError, match=message):
            tp_kernels.parallelize(model, {"0": "embedding_colwise"}, **options)
        assert torch.equal(model[0].weight, weight) and "parameter_splits" not in table.__dict__
    split = shard_embedding_dim(nn.Embedding(5, 4 * p))
    with pytest.raises(ValueError, match="embedding: this Embedding is split already"):
        shard_embedding_dim(split)


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_embedding_dim_split_errors(world):
    world.run(check_embedding_dim_split_errors)


def check_cross_entropy(dtype_name, label_smoothing, scale, device="cpu"):
    """vocab_parallel_cross_entropy of vocabulary-parallel logits (an ignored token, the last
    class), each reduction, against F.cross_entropy of the whole logits in float64 on ``device``:
    the loss and the logits' gradient within twice plain PyTorch's error in the same precision."""
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    vocab = 13 * p
    g = torch.Generator().manual_seed(2)
    full = (torch.randn(3, 7, vocab, generator=g) * scale).to(device, dtype)  # [s, b, V]
    target = torch.randint(0, vocab, (3, 7), generator=g)
    target[0, 0], target[1, 1] = -100, vocab - 1  # an ignored token, the last class
    target = target.to(device)
    dloss = torch.rand(3, 7, generator=g).to(device)

    def dense(d):
        logits = full.to(d, copy=True).requires_grad_()
        loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing).reshape(3, 7)
        loss.backward(dloss.to(d))
        return loss.detach(), logits.grad

    ref_loss, ref_grad = dense(torch.float64)
    work = torch.promote_types(dtype, torch.float32)  # what it computes in: float32, or float64's own
    plain_loss, plain_grad = dense(work)
    slack = 8 * torch.finfo(work).eps  # relative, for sums taken in another order
    logits = block(full, -1, r, p).clone().requires_grad_()
    loss = tp_kernels.vocab_parallel_cross_entropy(logits, target, label_smoothing)
    assert loss.dtype == work and loss.shape == target.shape
    loss.backward(dloss)
    assert logits.grad.dtype == dtype
    assert loss[0, 0] == 0 and torch.all(logits.grad[0, 0] == 0)  # ignore_index
    # at most twice plain PyTorch's error in that precision (whatever the logits' dtype)
    err, plain_err = (loss.double() - ref_loss).abs().max(), (plain_loss.double() - ref_loss).abs().max()
    assert err <= 2 * plain_err + slack * ref_loss.abs().max(), f"loss error {err:.3e} vs plain {plain_err:.3e}"
    grad_ref = block(ref_grad, -1, r, p)
    if dtype == work:
        err, plain_err = (logits.grad.double() - grad_ref).abs().max(), (block(plain_grad, -1, r, p).double() - grad_ref).abs().max()
        assert err <= 2 * plain_err + slack * grad_ref.abs().max(), f"grad error {err:.3e} vs plain {plain_err:.3e}"
    else:
        # the gradient is rounded once to the logits' dtype
        assert_close("dlogits", logits.grad, grad_ref, block(plain_grad, -1, r, p).to(dtype))
    for reduction in ("sum", "mean"):  # as F.cross_entropy reduces (a mean over the tokens not ignored)
        full64 = full.to(torch.float64, copy=True).requires_grad_()
        want = F.cross_entropy(full64.reshape(-1, vocab), target.reshape(-1), label_smoothing=label_smoothing,
                               reduction=reduction)
        want.backward()
        logits = block(full, -1, r, p).clone().requires_grad_()
        got = tp_kernels.vocab_parallel_cross_entropy(logits, target, label_smoothing, reduction=reduction)
        assert got.shape == () and got.dtype == work
        torch.testing.assert_close(got.double(), want.detach(), rtol=64 * torch.finfo(work).eps, atol=0)
        got.backward()
        bound = 2 * torch.finfo(dtype).eps + 64 * torch.finfo(work).eps  # one rounding to the logits' dtype
        torch.testing.assert_close(logits.grad.double(), block(full64.grad, -1, r, p),
                                   rtol=0, atol=bound * full64.grad.abs().max().item())


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("scale", [1.0, 1000.0])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_cross_entropy_matches_dense(world, dtype, label_smoothing, scale):
    world.run(check_cross_entropy, dtype, label_smoothing, scale)


def check_entropy(dtype_name, vocab_of_p, device="cpu"):
    """vocab_parallel_entropy equals the dense softmax's entropy (float64 reference, at most twice
    plain PyTorch's error in the working precision), its gradient the dense one's block; a padded
    vocabulary (-inf in the padding, as a padded output layer gives) the same with vocab_size or
    without; logits masked to -inf inside the vocabulary count as torch's Categorical counts them."""
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    vocab = {"divisible": 13 * p, "padded": 4 * p + 1}[vocab_of_p]
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(3, 7, vocab, generator=g) * 4).to(dtype)  # [s, b, V]
    dent = torch.rand(3, 7, generator=g)

    def dense(d):
        logits = full.to(d, copy=True).requires_grad_()
        ent = torch.special.entr(logits.softmax(-1)).sum(-1)
        ent.backward(dent.to(d))
        return ent.detach(), logits.grad

    ref, ref_grad = dense(torch.float64)
    work = torch.promote_types(dtype, torch.float32)
    plain, plain_grad = dense(work)
    slack = 8 * torch.finfo(work).eps
    for vocab_size in ([vocab, None] if vocab_of_p == "padded" else [None]):
        logits = padded_block(full, -1, r, p, float("-inf")).to(device).requires_grad_()
        ent = tp_kernels.vocab_parallel_entropy(logits, vocab_size=vocab_size)
        assert ent.dtype == work and ent.shape == (3, 7)
        ent.backward(dent.to(device))
        ent = ent.detach().cpu()
        err, plain_err = (ent.double() - ref).abs().max(), (plain.double() - ref).abs().max()
        assert err <= 2 * plain_err + slack * ref.abs().max(), f"entropy error {err:.3e} vs plain {plain_err:.3e}"
        assert logits.grad.dtype == dtype
        held = held_rows(vocab, r, p)
        assert torch.all(logits.grad[..., held:] == 0)  # the padding: no gradient
        got, want = logits.grad[..., :held].cpu(), padded_block(ref_grad, -1, r, p)[..., :held]
        plain_block = padded_block(plain_grad, -1, r, p)[..., :held]
        if dtype == work:
            err, plain_err = (got.double() - want).abs().max(), (plain_block.double() - want).abs().max()
            assert err <= 2 * plain_err + slack * want.abs().max(), f"grad error {err:.3e} vs plain {plain_err:.3e}"
        else:  # the gradient is rounded once to the logits' dtype
            assert_close("dlogits", got, want, plain_block.to(dtype))
    masked = full.double().clone()
    masked[..., ::3] = float("-inf")  # a third of the vocabulary masked out
    want = torch.distributions.Categorical(logits=masked).entropy()
    got = tp_kernels.vocab_parallel_entropy(padded_block(masked, -1, r, p, float("-inf")).to(device))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("vocab_of_p", ["divisible", "padded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_entropy_matches_dense(world, dtype, vocab_of_p):
    world.run(check_entropy, dtype, vocab_of_p)


def check_argmax(dtype_name, vocab_of_p, device="cpu"):
    """vocab_parallel_argmax is torch.argmax over the full logits, on every rank: ties (small
    integer logits, equal maxima on several ranks) go to the first, a row with NaN to its first NaN,
    a row of -inf to 0; a padded vocabulary's -inf padding is never chosen, with vocab_size or
    without."""
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    vocab = {"divisible": 5 * p, "padded": 4 * p + 1}[vocab_of_p]
    g = torch.Generator().manual_seed(4)
    full = torch.randint(-3, 3, (6, 5, vocab), generator=g).to(dtype)  # many ties
    full[0, 0] = float("-inf")
    full[0, 1, vocab - 1] = float("nan")
    full[0, 2, [1, vocab - 1]] = float("nan")
    full[1] = torch.randn(5, vocab, generator=g).to(dtype)  # rows without ties
    want = torch.argmax(full, -1)
    for vocab_size in ([vocab, None] if vocab_of_p == "padded" else [None]):
        got = tp_kernels.vocab_parallel_argmax(padded_block(full, -1, r, p, float("-inf")).to(device),
                                               vocab_size=vocab_size).cpu()
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    if dtype_name == "float32":  # compiled whole, as a decoding step is
        torch._dynamo.reset()
        greedy = torch.compile(tp_kernels.vocab_parallel_argmax, backend="aot_eager", fullgraph=True)
        assert torch.equal(greedy(padded_block(full, -1, r, p, float("-inf")).to(device), vocab_size=vocab).cpu(),
                           want)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("vocab_of_p", ["divisible", "padded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_argmax_matches_dense(world, dtype, vocab_of_p):
    world.run(check_argmax, dtype, vocab_of_p)


def check_sample(dtype_name, vocab_of_p, device="cpu"):
    """vocab_parallel_sample is the Gumbel-max draw of the noise each rank drew (its model-parallel
    stream, or a generator of its own), the same token on every rank, never a masked (-inf) class
    or a padding column; drawn 4000 times from one row, each class comes as often as the softmax
    says (within 5 standard deviations); temperature 0 is the argmax; bad arguments are named."""
    from tp_kernels import rng

    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    wide = torch.promote_types(dtype, torch.float32)
    vocab = {"divisible": 5 * p, "padded": 4 * p + 1}[vocab_of_p]
    width = -(-vocab // p)
    g = torch.Generator().manual_seed(6)
    full = torch.randn(6, 2, vocab, generator=g).to(dtype)
    full[0, 0, 1] = float("-inf")  # a masked class
    mine = padded_block(full, -1, r, p, float("-inf")).to(device)

    def noise_of_every_rank(draw, held):  # each rank's noisy logits as it drew them, joined in vocabulary order
        noisy = mine.reshape(-1, width)[:, :held].to(wide) / 0.7 - draw(held).log()
        noisy = torch.cat([noisy, noisy.new_full((noisy.shape[0], width - held), float("-inf"))], -1)
        return torch.cat(gather_all(noisy), -1)[:, :vocab]

    def gather_all(t):
        parts = [torch.empty_like(t) for _ in range(p)]
        torch.distributed.all_gather(parts, t.contiguous())
        return parts

    for vocab_size in ([vocab, None] if vocab_of_p == "padded" else [None]):
        rng.model_parallel_manual_seed(1234)
        got = tp_kernels.vocab_parallel_sample(mine, temperature=0.7, vocab_size=vocab_size)
        rng.model_parallel_manual_seed(1234)
        held = held_rows(vocab, r, p) if vocab_size else width  # (without vocab_size, the padding is classes)
        with rng.get_rng_tracker().fork():
            want = noise_of_every_rank(lambda n: torch.empty(12, n, dtype=wide, device=device).exponential_(), held)
        assert got.shape == (6, 2) and got.dtype == torch.int64
        assert torch.equal(got.reshape(-1), want.argmax(-1)), (got, want.argmax(-1))
        assert all(torch.equal(view, got) for view in gather_all(got))  # the same token on every rank
        assert got[0, 0] != 1  # the masked class
    own = torch.Generator(device).manual_seed(100 + r)
    got = tp_kernels.vocab_parallel_sample(mine, temperature=0.7, generator=own, vocab_size=vocab)
    own = torch.Generator(device).manual_seed(100 + r)
    want = noise_of_every_rank(lambda n: torch.empty(12, n, dtype=wide, device=device).exponential_(generator=own),
                               held_rows(vocab, r, p))
    assert torch.equal(got.reshape(-1), want.argmax(-1))
    assert torch.equal(tp_kernels.vocab_parallel_sample(mine, temperature=0, vocab_size=vocab),
                       tp_kernels.vocab_parallel_argmax(mine, vocab_size=vocab))
    # a temperature per row (a serving batch's requests): each row sampled at its own, a row at 0 greedy
    per_row = torch.tensor([0.7, 0.0, 1.5, 0.7, 0.0, 0.3] * 2, dtype=torch.float32, device=device).view(6, 2)
    own = torch.Generator(device).manual_seed(200 + r)
    got = tp_kernels.vocab_parallel_sample(mine, temperature=per_row, generator=own, vocab_size=vocab)
    own = torch.Generator(device).manual_seed(200 + r)
    held = held_rows(vocab, r, p)
    z = mine.reshape(-1, width)[:, :held].to(wide)
    e = torch.empty(12, held, dtype=wide, device=device).exponential_(generator=own)
    t = per_row.reshape(-1, 1).to(wide)
    noisy = torch.where(t > 0, z / t.clamp_min(1e-30) - e.log(), z)
    noisy = torch.cat([noisy, noisy.new_full((12, width - held), float("-inf"))], -1)
    want = torch.cat(gather_all(noisy), -1)[:, :vocab].argmax(-1)
    assert torch.equal(got.reshape(-1), want), (got, want)
    greedy = tp_kernels.vocab_parallel_argmax(mine, vocab_size=vocab)
    assert torch.equal(got[per_row == 0], greedy[per_row == 0])
    # as often as the softmax says
    row = full[1, 0]
    draws = tp_kernels.vocab_parallel_sample(padded_block(row.expand(4000, vocab), -1, r, p, float("-inf")).to(device),
                                             temperature=1.3, vocab_size=vocab).cpu()
    probs = torch.softmax(row.double() / 1.3, -1)
    freq = torch.bincount(draws, minlength=vocab).double() / 4000
    assert torch.all((freq - probs).abs() <= 5 * (probs * (1 - probs) / 4000).sqrt() + 1e-3), (freq, probs)
    for bad, match in [(dict(temperature=-1.0), "temperature: expected a finite number >= 0"),
                       (dict(temperature=float("inf")), "temperature"), (dict(temperature=True), "temperature"),
                       (dict(generator=3), "generator: expected a torch.Generator"),
                       (dict(temperature=torch.ones(6)), r"temperature: expected a floating tensor of the rows' shape"),
                       (dict(temperature=torch.full((6, 2), -1.0, device=device)), "expected finite numbers >= 0"),
                       (dict(temperature=torch.full((6, 2), float("nan"), device=device)), "expected finite numbers"),
                       (dict(temperature=torch.full((6, 2), float("inf"), device=device)), "expected finite numbers")]:
        with pytest.raises(ValueError, match=match):
            tp_kernels.vocab_parallel_sample(mine, vocab_size=vocab, **bad)
    elsewhere = mine.to("meta") if device == "cpu" else mine  # (logits off the CPU, where the generator is)
    with pytest.raises(ValueError, match=f"generator: on cpu, not on the logits' device {elsewhere.device.type}"):
        tp_kernels.vocab_parallel_sample(elsewhere, generator=torch.Generator(), vocab_size=vocab)
    rng.get_rng_tracker().reset()
    with pytest.raises(ValueError, match="call tp_kernels.model_parallel_manual_seed"):
        tp_kernels.vocab_parallel_sample(mine, vocab_size=vocab)
    # temperature 0 draws no noise: no stream needed
    assert torch.equal(tp_kernels.vocab_parallel_sample(mine, temperature=0, vocab_size=vocab), greedy)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("vocab_of_p", ["divisible", "padded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sample(world, dtype, vocab_of_p):
    world.run(check_sample, dtype, vocab_of_p)


def check_topk(dtype_name, vocab_of_p, device="cpu"):
    """vocab_parallel_topk is torch.topk over the full logits, on every rank: values and indices
    where the values differ (k within a block, across blocks, the whole vocabulary); with ties, the
    same values, and the indices a stable descending sort puts first (equal values by ascending
    index, the first of them taken); a row of -inf or with NaN as
    torch takes it; never a padding column, with vocab_size or without."""
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    vocab = {"divisible": 5 * p, "padded": 4 * p + 1}[vocab_of_p]
    g = torch.Generator().manual_seed(5)
    distinct = torch.stack([torch.randperm(vocab, generator=g) for _ in range(12)]).reshape(4, 3, vocab).to(dtype)
    ties = torch.randint(-2, 2, (4, 3, vocab), generator=g).to(dtype)
    ties[0, 0] = float("-inf")
    ties[0, 1, vocab // 2] = float("nan")
    for vocab_size in ([vocab, None] if vocab_of_p == "padded" else [None]):
        for k in sorted({1, min(3, vocab), min(-(-vocab // p) + 2, vocab), vocab}):
            mine = padded_block(distinct, -1, r, p, float("-inf")).to(device)
            values, indices = tp_kernels.vocab_parallel_topk(mine, k, vocab_size=vocab_size)
            want = torch.topk(distinct, k)
            assert values.dtype == dtype and indices.dtype == torch.int64 and values.shape == (4, 3, k)
            assert torch.equal(values.cpu(), want.values) and torch.equal(indices.cpu(), want.indices), k
            values, indices = tp_kernels.vocab_parallel_topk(padded_block(ties, -1, r, p, float("-inf")).to(device),
                                                             k, vocab_size=vocab_size)
            values, indices = values.cpu(), indices.cpu()
            assert torch.equal(values.nan_to_num(7.0), torch.topk(ties, k).values.nan_to_num(7.0)), k  # (NaN == NaN)
            assert bool((indices < vocab).all()) and all(len(set(row)) == k for row in indices.reshape(-1, k).tolist())
            assert torch.equal(ties.gather(-1, indices).nan_to_num(7.0), values.nan_to_num(7.0))
            same = values[..., 1:] == values[..., :-1]  # equal values come by ascending index
            assert torch.all(indices[..., 1:][same] > indices[..., :-1][same])
            # and the first of them by index are taken: a stable descending sort's first k, exactly
            assert torch.equal(indices, torch.sort(ties, dim=-1, descending=True, stable=True).indices[..., :k]), k
    if dtype_name == "float32":  # compiled whole, as a sampling step is
        torch._dynamo.reset()
        topk = torch.compile(tp_kernels.vocab_parallel_topk, backend="aot_eager", fullgraph=True)
        got = topk(padded_block(distinct, -1, r, p, float("-inf")).to(device), 2, vocab_size=vocab)
        assert torch.equal(got[1].cpu(), torch.topk(distinct, 2).indices)
    for bad, match in [(0, "k: expected an int >= 1"), (vocab + 1, f"k: expected at most the vocabulary's {vocab}"),
                       (True, "k: expected an int >= 1")]:
        with pytest.raises(ValueError, match=match):
            tp_kernels.vocab_parallel_topk(padded_block(distinct, -1, r, p).to(device), bad, vocab_size=vocab)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("vocab_of_p", ["divisible", "padded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_topk_matches_dense(world, dtype, vocab_of_p):
    world.run(check_topk, dtype, vocab_of_p)


def check_cross_entropy_errors():
    r, p = rank_world()
    logits = torch.randn(4, 5)
    with pytest.raises(ValueError, match="target"):
        tp_kernels.vocab_parallel_cross_entropy(logits, torch.zeros(4, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="target"):
        tp_kernels.vocab_parallel_cross_entropy(logits, torch.zeros(4))
    with pytest.raises(ValueError, match="target"):
        tp_kernels.vocab_parallel_cross_entropy(logits, torch.full((4,), 5 * p, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        tp_kernels.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long), 1.5)
    with pytest.raises(ValueError, match="logits"):
        tp_kernels.vocab_parallel_cross_entropy(logits.long(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction: expected one of 'none', 'sum', 'mean', got 'avg'"):
        tp_kernels.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="target: device meta does not match logits' device cpu"):
        tp_kernels.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long, device="meta"))
    for bad in (True, 1.0, None):
        with pytest.raises(ValueError, match=f"ignore_index: expected an int, got {bad!r}"):
            tp_kernels.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long), ignore_index=bad)
    # label_smoothing at its bound, 1: the mean over the vocabulary alone, as F.cross_entropy's
    full = torch.randn(4, 5 * p, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    target = torch.tensor([0, 5 * p - 1, -100, 3])
    torch.testing.assert_close(tp_kernels.vocab_parallel_cross_entropy(block(full, -1, r, p), target, 1.0),
                               F.cross_entropy(full, target, reduction="none", label_smoothing=1.0),
                               rtol=1e-12, atol=1e-12)
    ignored = tp_kernels.vocab_parallel_cross_entropy(logits, torch.full((4,), -100), reduction="mean")
    assert ignored.isnan() and tp_kernels.vocab_parallel_cross_entropy(  # F.cross_entropy's: NaN, and a sum of 0
        logits, torch.full((4,), -100), reduction="sum") == 0
    with pytest.raises(ValueError, match="logits: expected a floating-point tensor"):
        tp_kernels.vocab_parallel_entropy(logits.long())
    with pytest.raises(ValueError, match="logits: expected at least 1 dims"):
        tp_kernels.vocab_parallel_entropy(torch.tensor(1.0))
    with pytest.raises(ValueError, match=f"vocab_size: {5 * p + p} classes make blocks 6 wide"):
        tp_kernels.vocab_parallel_entropy(logits, vocab_size=5 * p + p)
    with pytest.raises(ValueError, match="logits: expected a floating-point tensor"):
        tp_kernels.vocab_parallel_argmax(logits.long())
    with pytest.raises(ValueError, match=f"vocab_size: {5 * p + p} classes make blocks 6 wide"):
        tp_kernels.vocab_parallel_argmax(logits, vocab_size=5 * p + p)


def test_cross_entropy_errors(world2):
    world2.run(check_cross_entropy_errors)


def check_unchecked_ids_fail(emb, emb_sp, head, ids, target, vocab):
    """Where no host check looks at the ids (``TP_KERNELS_CHECK_IDS=0``; compiling, here with
    ``aot_eager``), an id or target out of ``[0, V)`` (in the last rank's padding, past every
    rank's block, negative) fails the lookup on every rank, as ``nn.Embedding``'s and
    ``F.cross_entropy``'s do, before any collective: not zeros, not a wrong loss."""
    compiled = torch.compile(emb, backend="aot_eager", fullgraph=True)
    for bad in (vocab, vocab + 1000, -1):
        wrong = ids.clone()
        wrong[-1, -1] = bad
        for call in (emb, emb_sp, compiled):
            with pytest.raises(IndexError, match="index out of range"):
                call(wrong)
        wrong_target = target.clone()
        wrong_target[-1, -1] = bad
        with pytest.raises(RuntimeError, match="out of bounds"):
            tp_kernels.vocab_parallel_cross_entropy(head(emb(ids)), wrong_target, vocab_size=vocab)


def test_check_index_range_says_whether_it_looked():
    """True where it looked (the ids in range, or none), False where it was switched off (the
    lookup must then fail on its own); the mask it raises from leaves ``allowed`` out."""
    from tp_kernels.embedding import check_index_range, out_of_range

    ids = torch.tensor([0, 3, -100])
    assert check_index_range("ids", ids[:2], 4) is True and check_index_range("ids", ids[:0], 4) is True
    assert check_index_range("ids", ids, 4, allowed=-100) is True
    with tp_kernels.settings.overriding(ids_checked=False):
        assert check_index_range("ids", ids, 4) is False
    assert out_of_range(ids, 4).tolist() == [False, False, True]
    assert out_of_range(torch.tensor([4, -100, -1]), 4, allowed=-100).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="ids: index -100 is out of range for a vocabulary of 4"):
        check_index_range("ids", ids, 4)


def check_unchecked_id_fails_on_the_gpu():
    """With ``TP_KERNELS_CHECK_IDS=0`` on CUDA, an id past the vocabulary (in the last rank's
    padding) fails this rank's lookup, a device-side assert as ``nn.Embedding``'s: what the next
    synchronisation (or the all-reduce after the lookup) raised, or that nothing did."""
    _, p = rank_world()
    vocab = 4 * p + 1
    emb = tp_kernels.VocabParallelEmbedding(vocab, 6, device="cuda")
    # the group's NCCL communicator made first (torch makes it on the first collective), so that
    # what fails after the assert is a CUDA call, not the communicator's making
    dist.all_reduce(torch.zeros(1, device="cuda"))
    torch.cuda.synchronize()
    os.environ["TP_KERNELS_CHECK_IDS"] = "0"
    try:
        out = emb(torch.tensor([[0, vocab]], device="cuda"))
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return str(exc)
    return f"no error: embedded to {out.tolist()}"


#: vocabularies p does not divide (beyond p = 1): some ranks hold padding; with p + 1 at p = 4,
#: blocks of 2, 2, 1 and 0 classes (the last rank holds only padding)
PADDED_VOCABULARIES = {"one_over": lambda p: p + 1, "odd": lambda p: 4 * p + 1}


def check_padded_vocabulary(vocab_of_p, device="cpu"):
    """A vocabulary p does not divide is padded to ceil(V/p) rows per rank, and nothing a user sees
    changes: the embedding (with a padding index, and sequence-parallel) equals nn.Embedding; an
    output layer's logits are the dense ones with -inf in the padding, its gathered output is the
    dense output; the cross-entropy over them (with vocab_size=V, with or without smoothing, or
    without vocab_size and without smoothing) is F.cross_entropy's, gradients included; the padding
    rows hold zeros and get no gradient; a target in the padding is refused."""
    r, p = rank_world()
    vocab, dim, s = PADDED_VOCABULARIES[vocab_of_p](p), 6, 2 * p
    rows = -(-vocab // p)
    held = held_rows(vocab, r, p)  # this rank's classes
    torch.manual_seed(0)
    dense_emb = nn.Embedding(vocab, dim, padding_idx=vocab - 1).double().to(device)
    dense_head = nn.Linear(dim, vocab).double().to(device)
    emb = tp_kernels.VocabParallelEmbedding.from_embedding(dense_emb)
    emb_sp = tp_kernels.VocabParallelEmbedding.from_embedding(dense_emb, sequence_parallel=True)
    head = tp_kernels.ColumnParallelLinear.from_linear(dense_head)
    gathered = tp_kernels.ColumnParallelLinear.from_linear(dense_head, gather_output=True)
    head_sp = tp_kernels.ColumnParallelLinear.from_linear(dense_head, sequence_parallel=True, skip_bias_add=True)
    assert emb.weight.shape == (rows, dim) and head.weight.shape == (rows, dim) and head.bias.shape == (rows,)
    assert emb.pad_rows == head.pad_rows == rows - held
    assert (emb.vocab_start_index, emb.vocab_end_index) == (r * rows, r * rows + held)  # (its ids, no padding)
    for got, full in [(emb.weight, dense_emb.weight), (head.weight, dense_head.weight), (head.bias, dense_head.bias)]:
        assert torch.equal(got, padded_block(full, 0, r, p))  # the padding: zero rows
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (s, 3), generator=g)
    ids[0, :2] = torch.tensor([0, vocab - 1])
    target = torch.randint(0, vocab, (s, 3), generator=g)
    target[0, 0], target[0, 1] = -100, vocab - 1
    dloss = torch.rand(s, 3, generator=g, dtype=torch.float64)
    ids, target, dloss = ids.to(device), target.to(device), dloss.to(device)
    for label_smoothing, vocab_size in [(0.0, vocab), (0.1, vocab), (0.0, None)]:
        for m in (dense_emb, dense_head, emb, head):
            m.zero_grad()
        hidden = dense_emb(ids)
        logits = dense_head(hidden)
        loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing).reshape(s, 3)
        loss.backward(dloss)
        got_hidden = emb(ids)
        assert torch.equal(got_hidden, hidden)
        assert torch.equal(emb_sp(ids), block(hidden, 0, r, p))
        got_logits = head(got_hidden)
        torch.testing.assert_close(got_logits, padded_block(logits, -1, r, p, float("-inf")), rtol=1e-12, atol=1e-12)
        full = gathered(got_hidden)
        assert full.is_contiguous()  # (as nn.Linear's: .view() works)
        torch.testing.assert_close(full, logits, rtol=1e-12, atol=1e-12)
        unbiased, bias = head_sp(emb_sp(ids))  # the padding -inf without the bias too
        torch.testing.assert_close(unbiased + bias, got_logits, rtol=1e-12, atol=1e-12)
        got = tp_kernels.vocab_parallel_cross_entropy(got_logits, target, label_smoothing, vocab_size=vocab_size)
        torch.testing.assert_close(got, loss, rtol=1e-12, atol=1e-12)
        got.backward(dloss)
        for name, q, full in [("embedding", emb.weight, dense_emb.weight), ("head", head.weight, dense_head.weight),
                              ("head bias", head.bias, dense_head.bias)]:
            torch.testing.assert_close(q.grad, padded_block(full.grad, 0, r, p), rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name} gradient, smoothing {label_smoothing}: {m}")
    # the reductions over the vocabulary, their logits far below 0 (a block of padding alone adds
    # no maximum of its own, which would underflow every exponential: with p + 1 at p = 4)
    logits, got_logits = logits.detach() - 1000, head(got_hidden).detach() - 1000
    for vocab_size in (vocab, None):
        torch.testing.assert_close(tp_kernels.vocab_parallel_cross_entropy(got_logits, target, vocab_size=vocab_size),
                                   F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1),
                                                   reduction="none").reshape(s, 3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tp_kernels.vocab_parallel_entropy(got_logits, vocab_size=vocab),
                               torch.special.entr(logits.softmax(-1)).sum(-1), rtol=1e-12, atol=1e-12)
    greedy = tp_kernels.vocab_parallel_argmax(got_logits, vocab_size=vocab)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(tp_kernels.vocab_parallel_sample(got_logits, temperature=0, vocab_size=vocab), greedy)
    for k in sorted({1, rows + 1, vocab}):
        values, indices = tp_kernels.vocab_parallel_topk(got_logits, min(k, vocab), vocab_size=vocab)
        want = torch.sort(logits, dim=-1, descending=True, stable=True)
        torch.testing.assert_close(values, want.values[..., :min(k, vocab)], rtol=1e-12, atol=1e-12)
        assert torch.equal(indices, want.indices[..., :min(k, vocab)]), k
    head.zero_grad()  # a gradient given to the padding goes nowhere: the padding rows get none
    head(emb(ids)).backward(torch.ones(s, 3, rows, dtype=torch.float64, device=device))
    assert torch.all(head.weight.grad[held:] == 0) and torch.all(head.bias.grad[held:] == 0)
    assert torch.all(head.bias.grad[:held] == s * 3)
    with pytest.raises(ValueError, match=f"target: index {vocab} is out of range for a vocabulary of {vocab}"):
        tp_kernels.vocab_parallel_cross_entropy(head(emb(ids)), torch.full((s, 3), vocab, device=device),
                                                vocab_size=vocab)
    with pytest.raises(ValueError, match=f"input: index {vocab} is out of range"):
        emb(torch.tensor([vocab], device=device))
    with pytest.raises(ValueError, match="input: index -1 is out of range"):  # (the first out of range named)
        emb(torch.tensor([[0, -1], [vocab, 1]], device=device))
    os.environ["TP_KERNELS_CHECK_IDS"] = "0"  # (no host sync: an id out of range fails the lookup, on every rank)
    try:
        assert torch.equal(emb(ids), hidden) and torch.equal(emb_sp(ids), block(hidden, 0, r, p))
        got = tp_kernels.vocab_parallel_cross_entropy(head(emb(ids)), target, vocab_size=vocab)  # (-100 ignored)
        torch.testing.assert_close(got, F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1),
                                                        reduction="none").reshape(s, 3), rtol=1e-12, atol=1e-12)
        if device == "cpu":  # (on CUDA the failed lookup is a device-side assert, which ends the process)
            check_unchecked_ids_fail(emb, emb_sp, head, ids, target, vocab)
        os.environ["TP_KERNELS_CHECK_IDS"] = "2"
        with pytest.raises(ValueError, match="TP_KERNELS_CHECK_IDS: expected 0 or 1, got '2'"):
            emb(ids)
    finally:
        del os.environ["TP_KERNELS_CHECK_IDS"]
    if device == "cpu":  # (the setter, as the variable)
        with tp_kernels.settings.overriding(ids_checked=False), pytest.raises(IndexError, match="index out of range"):
            emb(torch.tensor([[0, vocab]], device=device))
    if p > 1:
        with pytest.raises(ValueError, match=re.escape(f"vocab_size: {rows * p + 1} classes make blocks {rows + 1} "
                                                       f"wide on {p} ranks (ceil(V/p)), but logits' blocks are {rows} "
                                                       "wide")):
            tp_kernels.vocab_parallel_cross_entropy(head(emb(ids)), target, vocab_size=rows * p + 1)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("vocab_of_p", sorted(PADDED_VOCABULARIES))
def test_padded_vocabulary(world, vocab_of_p):
    world.run(check_padded_vocabulary, vocab_of_p)


def check_compiled_language_model_loss(sequence_parallel, vocab):
    """Embedding, a column -> row pair (with mappings between), a vocabulary-parallel head and the
    cross-entropy (with smoothing and an ignored token) less an entropy bonus, compiled whole
    (``fullgraph=True``): the same loss and gradients as eager. With sequence parallelism, the
    embedding's reduce-scatter and the layers' sequence-parallel collectives too; with a
    vocabulary p does not divide, its padding."""
    r, p = rank_world()
    torch.manual_seed(0)
    sp = dict(sequence_parallel=sequence_parallel)
    vocab = 8 * p + (vocab == "padded")
    emb = tp_kernels.VocabParallelEmbedding(vocab, 6, **sp)
    fc1, fc2 = tp_kernels.ColumnParallelLinear(6, 4 * p, **sp), tp_kernels.RowParallelLinear(4 * p, 6, **sp)
    head = tp_kernels.ColumnParallelLinear(6, vocab, bias=False, **sp)
    model = nn.ModuleList([emb, fc1, fc2, head])
    g = torch.Generator().manual_seed(1)
    ids, target = (torch.randint(0, vocab, (3 * p, 5), generator=g) for _ in range(2))
    target[0, 0] = -100

    def loss_fn(ids, target):
        # (with sequence parallelism fc1's backward reduce-scatters d(input) itself)
        embedded = emb(ids) if sequence_parallel else mappings.copy_to_tensor_model_parallel_region(emb(ids))
        hidden = fc1(embedded).relu()
        # gathered and split again by the mappings: the same block, through two more collectives
        hidden = mappings.scatter_to_tensor_model_parallel_region(mappings.gather_from_tensor_model_parallel_region(hidden))
        logits = head(fc2(hidden))
        loss = tp_kernels.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1, vocab_size=vocab)
        return loss.mean() - 0.01 * tp_kernels.vocab_parallel_entropy(logits, vocab_size=vocab).mean()

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, target)
        loss.backward()
        return [loss.detach()] + [q.grad.clone() for q in model.parameters()]

    eager = run(loss_fn)
    torch._dynamo.reset()
    compiled = run(torch.compile(loss_fn, backend="aot_eager", fullgraph=True))
    for i, (got, want) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(got, want, msg=lambda m: f"output {i}: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("vocab", ["divisible", "padded"])
def test_compiled_language_model_loss(world2, sequence_parallel, vocab):
    world2.run(check_compiled_language_model_loss, sequence_parallel, vocab, deadline_s=600)
