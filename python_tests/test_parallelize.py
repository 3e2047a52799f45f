"""A dense transformer block parallelized with `parallelize` matches the dense block over
forward, backward and two SGD steps."""

from __future__ import annotations

import collections
import contextlib
import copy
import fnmatch
import itertools
import math
import warnings
import weakref
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tp_kernels
from tp_kernels.parallelize import _ELEMENTWISE
from helpers import (adam_atol, adam_drift, assert_close, assert_dense_grads, assert_same_loss_and_backward, block,
                     fingerprints_set, padded_block, rank_world, skip_unless_own_plan, torch_before)

HEAD_DIM = 5


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * HEAD_DIM)
        self.k_proj = nn.Linear(hidden, heads * HEAD_DIM)
        self.v_proj = nn.Linear(hidden, heads * HEAD_DIM)
        self.o_proj = nn.Linear(heads * HEAD_DIM, hidden)

    def forward(self, x):  # [s, b, h]
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))  # [s, b, heads_local*d]
        s, b = q.shape[:2]
        # the number of heads comes from the layer's output width: the local heads once sharded
        q, k, v = (t.reshape(s, b, -1, HEAD_DIM).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))


class Block(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


PLAN = {"attn.[qkv]_proj": "colwise", "attn.o_proj": "rowwise", "mlp.0": "colwise", "mlp.2": "rowwise"}


def check_block(sequence_parallel):
    r, p = rank_world()
    hidden, heads, ffn, s, b = 23, 3 * p, 17 * p, 3 * p, 3
    torch.manual_seed(0)
    dense = Block(hidden, heads, ffn)
    ref = copy.deepcopy(dense).double()
    par = tp_kernels.parallelize(copy.deepcopy(dense), PLAN, sequence_parallel=sequence_parallel)
    # with sequence parallelism the activations between the parallel layers are [s/p, b, h]
    seq = (lambda t: block(t, 0, r, p)) if sequence_parallel else (lambda t: t)
    assert isinstance(par.attn.q_proj, tp_kernels.ColumnParallelLinear)
    assert isinstance(par.mlp[2], tp_kernels.RowParallelLinear)
    assert par.attn.q_proj.weight.shape == (3 * HEAD_DIM, hidden)

    def sharded(name, full):
        """What this rank's parameter holds of the dense parameter ``full``."""
        if name.startswith(("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.0")):
            return block(full, 0, r, p)
        if name in ("attn.o_proj.weight", "mlp.2.weight"):
            return block(full, 1, r, p)
        return full

    models = {"ref": ref, "plain": dense, "par": par}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(s, b, hidden, generator=g)
        w_loss = torch.randn(s, b, hidden, generator=g)
        outs = {}
        for k, m in models.items():
            d = torch.float64 if k == "ref" else torch.float32
            is_par = k == "par"
            xx = (seq(x) if is_par else x).to(d, copy=True).requires_grad_()
            y = m(xx)
            (y * (seq(w_loss) if is_par else w_loss).to(d)).sum().backward()
            # compare what this rank holds: its sequence block of the dense results under SP
            outs[k] = (y.detach(), xx.grad) if is_par else (seq(y.detach()), seq(xx.grad))
        if sequence_parallel:
            norms = [q for name, q in par.named_parameters() if name.startswith("norm")]
            tp_kernels.allreduce_sequence_parallel_grads(norms)
        # float32 against float64: at most twice the dense float32 model's own error
        for what, i in (("y", 0), ("dx", 1)):
            err = (outs["par"][i].double() - outs["ref"][i]).abs().max()
            plain_err = (outs["plain"][i].double() - outs["ref"][i]).abs().max()
            assert err <= 2 * plain_err + 1e-6 * outs["ref"][i].abs().max(), f"step {step} {what}: {err} vs {plain_err}"
        ref_params = dict(ref.named_parameters())
        plain_params = dict(dense.named_parameters())
        # Some gradients are mathematically zero (a key bias: softmax ignores shifts), so the
        # floor scales with the largest gradient in the model, not with each value.
        floor = 1e-6 * max(q.grad.abs().max() for q in ref.parameters())
        for name, param in par.named_parameters():
            want, plain = sharded(name, ref_params[name].grad), sharded(name, plain_params[name].grad)
            err = (param.grad.double() - want).abs().max()
            plain_err = (plain.double() - want).abs().max()
            assert err <= 2 * plain_err + floor, f"step {step} grad {name}: {err} vs plain {plain_err}"
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    for name, param in par.named_parameters():
        want = sharded(name, dict(ref.named_parameters())[name].detach())
        assert_close(f"{name} after two steps", param.detach(), want)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallelized_block_matches_dense(world, sequence_parallel):
    world.run(check_block, sequence_parallel)


class _BatchFirstBlock(nn.Module):
    """A pre-norm block of causal attention and a gated MLP on batch-first ``[b, s, h]``, which
    takes the sequence length and its heads from the column layers' outputs (TorchTitan's do)."""

    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        # (no key bias: its gradient is zero but for rounding, softmax ignoring a shift)
        self.q, self.v = nn.Linear(hidden, heads * HEAD_DIM), nn.Linear(hidden, heads * HEAD_DIM)
        self.k = nn.Linear(hidden, heads * HEAD_DIM, bias=False)
        self.o = nn.Linear(heads * HEAD_DIM, hidden)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        h = self.norm1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _BatchFirstLM(nn.Module):
    """A small batch-first language model of our own (ids ``[b, s]``)."""

    def __init__(self, vocab, hidden, heads, ffn):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_BatchFirstBlock(hidden, heads, ffn) for _ in range(2))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            x = layer(x)
        return self.head(self.norm(x))


BATCH_FIRST_PLAN = {"embed": "vocab", "blocks.*.[qkv]": "colwise", "blocks.*.o": "rowwise",
                    "blocks.*.gate": "colwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
                    "blocks.*.norm[12]": "replicated_with_grad_allreduce", "norm": "replicated_with_grad_allreduce",
                    "head": "colwise_gather_output"}


def check_batch_first_sequence_parallel(backend, device="cpu"):
    """``parallelize(..., sequence_parallel=True, sequence_dim=1)`` of a batch-first language
    model: the embedding returns each rank's block of dim 1 of the dense embedding, the column
    layers gather it and the row layers reduce-scatter it back, so the logits are the dense
    model's, and so is every gradient (the norms', on the sequence blocks, summed over the group)
    and the loss after an SGD step; a vocabulary p does not divide is padded. A sequence p does not
    divide, and ``sequence_dim`` without sequence parallelism, are ``ValueError``s naming them."""
    r, p = rank_world()
    vocab, hidden, heads, ffn, b, s = 4 * p + 3, 8, 2 * p, 3 * p, 3, 2 * p
    torch.manual_seed(0)
    dense = _BatchFirstLM(vocab, hidden, heads, ffn).double().to(device)
    par = tp_kernels.parallelize(copy.deepcopy(dense), BATCH_FIRST_PLAN, sequence_parallel=True, sequence_dim=1)
    for layer in (par.embed, par.blocks[0].q, par.blocks[0].o):
        assert layer.sequence_dim == 1 and "sequence_dim=1" in repr(layer)
    for m in par.modules():
        if isinstance(m, (tp_kernels.ColumnParallelLinear, tp_kernels.RowParallelLinear)):
            m.backend = backend
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1)).to(device)
    torch.testing.assert_close(par.embed(ids), block(dense.embed(ids), 1, r, p), rtol=0, atol=0)
    models = (dense, par)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    for step in range(2):
        want, got = dense(ids), par(ids)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"step {step} logits: {m}")
        for m, logits in zip(models, (want, got)):
            F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        assert_dense_grads(par, dense, 1e-12)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if p > 1:
        with pytest.raises(ValueError, match=rf"input.shape\[1\] \({2 * p + 1}\) is not divisible"):
            par(torch.zeros(b, 2 * p + 1, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match=r"input: expected at least 2 dims, got shape \(6,\)"):
        par.embed(torch.zeros(6, dtype=torch.long, device=device))  # (ids without their batch dim)
    with pytest.raises(ValueError, match=r"sequence_dim: expected a dim of input other than its last, in \[-2, 0\] "
                                         r"for input of shape \(6, 8\), got 1"):
        par.blocks[0].q(torch.zeros(6, 8, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match=r"sequence_dim: 1 splits the sequence, which only sequence_parallel=True"):
        tp_kernels.parallelize(copy.deepcopy(dense), BATCH_FIRST_PLAN, sequence_dim=1)
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError, match=r"sequence_dim: expected an int >= 0"):
            tp_kernels.ColumnParallelLinear(4, 2 * p, sequence_parallel=True, sequence_dim=bad)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("backend", ["reference", "pipelined"])
def test_batch_first_sequence_parallel(world, backend):
    world.run(check_batch_first_sequence_parallel, backend)


class _TitanAttention(nn.Module):
    """Attention as TorchTitan's Llama writes it: the sequence length taken from its input, which
    its plan gathers whole (``PrepareModuleInput``); a second argument left as it is."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(hidden, heads * HEAD_DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(heads * HEAD_DIM, hidden, bias=False)

    def forward(self, x, scale):
        bs, seqlen, _ = x.shape
        q, k, v = (proj(x).view(bs, seqlen, -1, HEAD_DIM).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class _TitanFeedForward(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _TitanBlock(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attention, self.feed_forward = _TitanAttention(hidden, heads), _TitanFeedForward(hidden, ffn)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x), HEAD_DIM ** -0.5)
        return x + self.feed_forward(self.ffn_norm(x))


class _TitanLM(nn.Module):
    """A small language model in TorchTitan's Llama's shape and names (batch-first)."""

    def __init__(self, vocab, hidden, heads, ffn):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(hidden, heads, ffn) for i in range(2)})
        self.norm = nn.RMSNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def _titan_plan(sequence_parallel: bool, loss_parallel: bool = False) -> dict:
    """TorchTitan's tensor-parallel plan of its Llama (torch's style objects), with or without
    sequence parallelism (its ``Shard(1)``), its logits gathered or, with ``loss_parallel``, handed
    on split as a DTensor (for torch's ``loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    logits = {"output_layouts": Shard(-1), "use_local_output": False} if loss_parallel else \
        {"output_layouts": Replicate()}
    if not sequence_parallel:
        return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(**logits),
                **{f"layers.*.{name}": ColwiseParallel() for name in ("attention.w[qkv]", "feed_forward.w[13]")},
                **{f"layers.*.{name}": RowwiseParallel() for name in ("attention.wo", "feed_forward.w2")}}
    gather = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), **logits),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.attention": gather,
            "layers.*.attention.w[qkv]": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "layers.*.feed_forward.w[13]": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


@contextlib.contextmanager
def _counting_collectives():
    """Count the all-reduces, reduce-scatters and all-gathers issued inside, by (kind, elements)."""
    from tp_kernels import _collectives as coll

    counted = collections.Counter()
    originals = {"all_reduce": coll.all_reduce, "reduce_scatter": coll.reduce_scatter_dim0,
                 "all_gather": coll.all_gather_dim0}
    inside = []  # (gloo's reduce-scatter is an all-reduce inside: counted as the reduce-scatter alone)

    def counting(kind):
        def call(x, *args, **kwargs):
            if not inside:
                counted[(kind, x.numel())] += 1
            inside.append(kind)
            try:
                return originals[kind](x, *args, **kwargs)
            finally:
                inside.pop()
        return call

    coll.all_reduce, coll.reduce_scatter_dim0 = counting("all_reduce"), counting("reduce_scatter")
    coll.all_gather_dim0 = counting("all_gather")
    try:
        yield counted
    finally:
        coll.all_reduce, coll.reduce_scatter_dim0 = originals["all_reduce"], originals["reduce_scatter"]
        coll.all_gather_dim0 = originals["all_gather"]


def check_torch_parallel_styles(sequence_parallel, device="cpu", loss_parallel=False):
    """A plan of torch's styles (TorchTitan's for its Llama, with and without sequence
    parallelism; its logits gathered, or with ``loss_parallel`` a DTensor that torch's
    ``loss_parallel`` takes the loss of), given with a one-dim DeviceMesh, parallelizes a model of
    TorchTitan's shape with tp_kernels' layers: its logits, every gradient and two SGD steps are the
    dense model's in float64, and so are those of torch's own ``parallelize_module`` with the same
    plan (DTensors)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss
    from torch.distributed.tensor.parallel import parallelize_module

    r, p = rank_world()
    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, device)  # (sets no device, as init_device_mesh can)
    # (with loss parallelism a vocabulary p does not divide: the logits a DTensor split unevenly, the padding left out)
    vocab, hidden, heads, ffn, b, s = 4 * p + int(loss_parallel), 8, 2 * p, 3 * p, 3, 2 * p
    torch.manual_seed(0)
    dense = _TitanLM(vocab, hidden, heads, ffn).double().to(device)
    ours = tp_kernels.parallelize(copy.deepcopy(dense), _titan_plan(sequence_parallel, loss_parallel), group=mesh)
    theirs = parallelize_module(copy.deepcopy(dense), mesh, _titan_plan(sequence_parallel, loss_parallel))
    assert isinstance(ours.layers["0"].attention.wq, tp_kernels.ColumnParallelLinear)
    assert ours.layers["0"].attention.wo.sequence_parallel == sequence_parallel
    assert ours.output.sequence_parallel == sequence_parallel and ours.output.gather_output != loss_parallel
    # (the attention's projections share the gather its PrepareModuleInput leaves them; without sequence
    # parallelism nothing gathers their input, and nothing watches their calls)
    shared = ours.layers["0"].attention.wq.shared_gather
    assert (shared is not None) == (sequence_parallel and p > 1), shared
    assert shared is None or shared.layers == tuple(getattr(ours.layers["0"].attention, n) for n in ("wq", "wk", "wv"))

    def backward(logits):  # (under loss_parallel, backward too; the dense logits a plain tensor, which it refuses)
        with parallel_loss() if hasattr(logits, "full_tensor") else contextlib.nullcontext():
            F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    def whole(logits):
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits

    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1)).to(device)
    if sequence_parallel:
        torch.testing.assert_close(ours.tok_embeddings(ids), block(dense.tok_embeddings(ids), 1, r, p), rtol=0, atol=0)
    models = (dense, ours, theirs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    for step in range(2):
        logits = [m(ids) for m in models]
        assert type(logits[1]).__name__ == ("DTensor" if loss_parallel else "Tensor")
        for name, got in zip(("tp_kernels", "torch"), logits[1:]):
            torch.testing.assert_close(whole(got), logits[0], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"step {step}: {name}'s logits: {m}")
        with _counting_collectives() as counted:
            backward(logits[1])
        for out in (logits[0], logits[2]):
            backward(out)
        if sequence_parallel and p > 1:
            # the input gradients of the column layers a PrepareModuleInput's gather fed (q, k, v; w1,
            # w3), each rank's partial one, reduce-scattered once per gather, as torch does (and by
            # the head, which gathers its own): no all-reduce of activations
            activations = b * s * hidden
            assert counted.get(("all_reduce", activations), 0) == 0, counted
            assert counted[("reduce_scatter", activations)] == 2 * len(ours.layers) + 1, counted
        assert_dense_grads(ours, dense, 1e-12)
        for name, q in theirs.named_parameters():
            grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            torch.testing.assert_close(grad, dense.get_parameter(name).grad, rtol=0,
                                       atol=1e-12 * grad.abs().max().item(), msg=lambda m: f"torch's {name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("sequence_parallel, loss_parallel", [(False, False), (True, False), (True, True)])
def test_torch_parallel_styles(world, sequence_parallel, loss_parallel):
    world.run(check_torch_parallel_styles, sequence_parallel, loss_parallel=loss_parallel)


def check_torch_parallel_styles_compiled():
    """TorchTitan's plan with sequence parallelism, the model compiled whole (``fullgraph=True``:
    the hooks of its ``PrepareModuleInput`` gathers traced, each a plain gather there): the logits
    and every gradient are the dense model's in float64."""
    _, p = rank_world()
    torch.manual_seed(0)
    dense = _TitanLM(4 * p, 8, 2 * p, 3 * p).double()
    ours = tp_kernels.parallelize(copy.deepcopy(dense), _titan_plan(True))
    ids = torch.randint(0, 4 * p, (3, 2 * p), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    got, want = torch.compile(ours, backend="aot_eager", fullgraph=True)(ids), dense(ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for logits in (got, want):
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    assert_dense_grads(ours, dense, 1e-12)
    torch._dynamo.reset()


def test_torch_parallel_styles_compiled(world2):
    world2.run(check_torch_parallel_styles_compiled)


def check_torch_checkpoints_interoperate(path):
    """A ``dcp`` checkpoint of torch's own tensor-parallel model (``parallelize_module`` by
    TorchTitan's plan: DTensor parameters) loads, through ``sharded_state_dict``, into the model
    tp_kernels makes by the same plan, which then holds the dense weights; and a checkpoint of that
    one loads into torch's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    _, p = rank_world()
    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")

    def model(seed):
        torch.manual_seed(seed)
        return _TitanLM(4 * p, 8, 2 * p, 3 * p).double()

    dense = model(0)
    dcp.save(parallelize_module(copy.deepcopy(dense), mesh, _titan_plan(True)).state_dict(),
             checkpoint_id=f"{path}/torch")
    ours = tp_kernels.parallelize(model(1), _titan_plan(True), group=mesh)
    dcp.load(tp_kernels.sharded_state_dict(ours), checkpoint_id=f"{path}/torch")
    full = tp_kernels.full_state_dict(ours)
    for key, value in dense.state_dict().items():
        assert torch.equal(full[key], value), key
    dcp.save(tp_kernels.sharded_state_dict(ours), checkpoint_id=f"{path}/ours")
    theirs = parallelize_module(model(2), mesh, _titan_plan(True))
    state = theirs.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/ours")
    for key, value in dense.state_dict().items():
        got = state[key].full_tensor() if hasattr(state[key], "full_tensor") else state[key]
        assert torch.equal(got, value), key


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_torch_checkpoints_interoperate(world, tmp_path):
    world.run(check_torch_checkpoints_interoperate, str(tmp_path))


def check_torchtitan_composition(device="cpu"):
    """TorchTitan's composition on 4 ranks: a (dp 2, tp 2) DeviceMesh, tensor parallelism by its
    plan over ``mesh["tp"]`` (sequence parallelism included), then FSDP2's ``fully_shard`` of each
    block and of the model over ``mesh["dp"]``, each data-parallel rank taking half the batch: two
    SGD steps with momentum, clipped by the whole model's norm, give the dense model's weights on
    the whole batch in float64, on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r, p = rank_world()
    mesh = init_device_mesh(torch.device(device).type, (2, 2), mesh_dim_names=("titan_dp", "titan_tp"))
    dp, tp = mesh["titan_dp"], mesh["titan_tp"]
    vocab, hidden, heads, ffn = 8, 8, 4, 6
    torch.manual_seed(0)
    dense = _TitanLM(vocab, hidden, heads, ffn).double().to(device)
    model = tp_kernels.parallelize(copy.deepcopy(dense), _titan_plan(True), group=tp)
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    wq = model.layers["0"].attention.wq.weight  # [heads * HEAD_DIM / tp, hidden], its rows over dp
    assert type(wq).__name__ == "DTensor" and wq.to_local().shape == (heads * HEAD_DIM // 4, hidden), wq.shape
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (dense, model)]
    g = torch.Generator().manual_seed(1)
    mine = slice(2 * dp.get_local_rank(), 2 * dp.get_local_rank() + 2)  # this data-parallel rank's half
    for _ in range(2):
        ids = torch.randint(0, vocab, (4, 4), generator=g).to(device)
        F.cross_entropy(dense(ids).flatten(0, 1), ids.flatten()).backward()
        F.cross_entropy(model(ids[mine]).flatten(0, 1), ids[mine].flatten()).backward()  # (FSDP2 averages)
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
        tp_kernels.clip_grad_norm_(model, 0.5)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = tp_kernels.full_state_dict(model)
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{key}: {m}")


def test_torchtitan_composition(world4):
    world4.run(check_torchtitan_composition)


class _Middle(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x)


def check_torch_prepare_module_input_output():
    """torch's ``PrepareModuleInputOutput`` (a module run on each rank's block of the sequence:
    its input split, its output gathered) and ``ColwiseParallel(output_layouts=Replicate())`` on
    an embedding (its table split along the embedding dim): the model's logits and gradients are
    the dense model's; so they are with the input's layout given by its name in the module's
    forward (``input_kwarg_layouts``), which the model passes by position."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, SequenceParallel

    r, p = rank_world()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Embedding(11, 4 * p), _Middle(4 * p), nn.Linear(4 * p, 5)).double()
    outputs = {"output_layouts": Shard(1), "desired_output_layouts": Replicate()}
    for middle in (PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1), **outputs),
                   PrepareModuleInputOutput(input_kwarg_layouts={"x": Replicate()},
                                            desired_input_kwarg_layouts={"x": Shard(1)}, **outputs)):
        plan = {"0": ColwiseParallel(output_layouts=Replicate()), "1": middle, "1.norm": SequenceParallel()}
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        assert par[0].weight.shape == (11, 4) and type(par[1]) is _Middle
        seen = []
        par[1].norm.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
        ids = torch.randint(0, 11, (3, 2 * p), generator=torch.Generator().manual_seed(1))
        dense.zero_grad()
        want, got = dense(ids), par(ids)
        assert seen == [(3, 2, 4 * p)], seen  # (each rank's block of the sequence)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        want.square().sum().backward()
        got.square().sum().backward()
        assert_dense_grads(par, dense, 1e-12)
    # the layout given by position, the input passed by its name: moved all the same
    middle = PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1), **outputs)
    par = tp_kernels.parallelize(copy.deepcopy(dense), {"1": middle, "1.norm": SequenceParallel()})
    seen = []
    par[1].norm.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    hidden = dense[0](ids).detach()
    torch.testing.assert_close(par[1](x=hidden), dense[1](hidden), rtol=1e-12, atol=1e-12)
    assert seen == [(3, 2, 4 * p)], seen


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_torch_prepare_module_input_output(world):
    world.run(check_torch_prepare_module_input_output)


class _TwoProjections(nn.Module):
    """Two projections of one input, which the module reads too (``read``: ``"first"``, before
    the projections, or ``"after"`` the first; ``None``: not): its largest magnitude, detached,
    scales the first projection's output, and its mean over the hidden units, a second output, is
    the same on every rank, and so is its gradient. The inputs it is handed are noted in ``seen``."""

    def __init__(self, hidden, out, read):
        super().__init__()
        self.a, self.b = nn.Linear(hidden, out), nn.Linear(hidden, out)
        self.read, self.seen = read, []

    def forward(self, x):
        self.seen.append(x)
        if self.read is None:
            return self.a(x) + self.b(x), None
        if self.read == "first":
            scale = x.detach().abs().amax()
            return self.a(x) * scale + self.b(x), x.mean(-1)
        a = self.a(x)
        return a * x.detach().abs().amax() + self.b(x), x.mean(-1)


def check_deferred_gather(read, device="cpu", dtype=torch.float64, backend="auto"):
    """A ``PrepareModuleInput`` gathering the sequence (``Shard(1)`` to ``Replicate()``) hands the
    module a :class:`tp_kernels.mappings.DeferredGather`: of the gathered shape, this rank's block
    inside, gathered by nothing until read. Its column layers, sharing it, take the block (one
    ``all_gather_matmul`` of their weights: one gather, the input left ungathered; in backward
    one reduce-scatter and the input gathered again); a module that reads it first
    (``read="first"``) gathers it once, and the layers take the gathered tensor (backward: one
    reduce-scatter of their partial input gradients, with the gradient of what it computed from
    it, no gather); read after the layers took it (``"after"``), it is gathered a second time (the
    layers' backward as without the read). Either way
    the outputs, the input's gradient and every parameter's are the dense module's in float64,
    plain and under torch's checkpoint, reentrant or not; and a DeferredGather printed is not
    gathered, read is gathered once, written in place is written in what it gathered. (On a GPU:
    ``dtype`` float32 and ``backend`` the layers', the native paths; the collectives, which the
    counts here do not see, not counted.)"""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput
    from torch.utils.checkpoint import checkpoint

    from tp_kernels.mappings import DeferredGather

    r, p = rank_world()
    b, s, hidden, out = 2, 3 * p, 4, 2 * p
    torch.manual_seed(0)
    dense = nn.Sequential(_TwoProjections(hidden, out, read)).double().to(device)
    plan = {"0": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "0.a": ColwiseParallel(), "0.b": ColwiseParallel()}
    par = tp_kernels.parallelize(copy.deepcopy(dense).to(dtype), plan)
    for layer in (par[0].a, par[0].b):
        layer.backend = backend
    x = torch.randn(b, s, hidden, dtype=torch.float64).to(device).requires_grad_()  # (a leaf on any device)

    def close(name, got, want):
        if dtype == torch.float64:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
        else:
            assert_close(name, got, want)

    def loss(outputs):
        return outputs[0].square().sum() + (0 if outputs[1] is None else outputs[1].sum())

    want, want_mean = dense(x)
    loss((want, want_mean)).backward()
    for wrap in (None, None, lambda f, t: checkpoint(f, t, use_reentrant=False),
                 lambda f, t: checkpoint(f, t, use_reentrant=True)):
        par.zero_grad()
        par[0].seen.clear()
        xs = block(x.detach(), 1, r, p).to(dtype).requires_grad_()
        with _counting_collectives() as counted:
            got, mean = par(xs) if wrap is None else wrap(par, xs)
            forward = dict(counted)
            counted.clear()
            loss((got, mean)).backward()
        close("output", got, block(want, 2, r, p))
        assert (mean is None) == (want_mean is None)
        if read:
            close("mean", mean, want_mean)
        close("input gradient", xs.grad, block(x.grad, 1, r, p))
        for name, q in par.named_parameters():
            close(name, q.grad, block(dense.get_parameter(name).grad, 0, r, p))
        if p == 1 or wrap is not None:
            continue
        given = par[0].seen[-1]
        assert type(given) is DeferredGather and given.shape == (b, s, hidden) and given.block.shape == xs.shape
        assert (given.whole is not None) == (read is not None), given
        if device != "cpu":
            continue
        rows = b * s * hidden // p
        # (the layers' shared gather, or the read's; both)
        assert forward == {("all_gather", rows): 2 if read == "after" else 1}, forward
        assert dict(counted) == ({("reduce_scatter", rows * p): 1} if read == "first" else
                                 {("reduce_scatter", rows * p): 1, ("all_gather", rows): 1}), counted
    if p > 1:  # a DeferredGather read: gathered once, in place ops on it written to what it gathered
        deferred = tp_kernels.mappings.gather_for_column_layers(xs.detach(), sequence_dim=1)
        assert "gathered=False" in repr(deferred)  # (printed without gathering: no collective one rank waits on)
        # what code reading the input's shape asks (dim() was shadowed by the gathered dim's attribute)
        assert (deferred.dim(), deferred.ndim, deferred.size(1), deferred.whole) == (3, 3, s, None)
        with _counting_collectives() as counted:
            doubled = deferred * 2
            assert deferred.mul_(3) is deferred and deferred.whole is not None
            torch.testing.assert_close(deferred.view(-1), 1.5 * doubled.view(-1), rtol=0, atol=0)
        assert device != "cpu" or dict(counted) == {("all_gather", xs.numel()): 1}, counted
        torch.testing.assert_close(doubled, (2 * x.detach()).to(dtype), rtol=0, atol=0)
        # its data pointer is the gathered tensor's (gathered for it), two of them two pointers
        first, second = (tp_kernels.mappings.gather_for_column_layers(xs.detach(), sequence_dim=1) for _ in range(2))
        ptr = first.data_ptr()
        assert first.whole is not None and ptr == first.whole.data_ptr() != 0 and second.whole is None
        assert second.data_ptr() not in (0, ptr)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("read", [None, "first", "after"])
def test_deferred_gather(world, read):
    world.run(check_deferred_gather, read)


class _Scaled(nn.Module):
    """``x`` times a factor: each rank's partial sum of ``x`` times the factors' sum."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def check_torch_partial_outputs():
    """A module whose output is each rank's partial sum, ``PrepareModuleOutput(output_layouts=
    Partial())``: summed whole (``desired_output_layouts=Replicate()``) or reduce-scattered along
    the sequence (``Shard(1)``), the gradient of the input its factor times the output's gradient,
    whole (gathered back from the blocks); a Partial() moved elsewhere is a ValueError."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    r, p = rank_world()
    total = p * (p + 1) // 2  # (the factors r + 1 summed)
    x = torch.randn(3, 2 * p, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(3, 2 * p, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for wanted, keep in ((Replicate(), lambda t: t), (Shard(1), lambda t: block(t, 1, r, p))):
        model = tp_kernels.parallelize(nn.Sequential(_Scaled(r + 1)), {
            "0": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=wanted)})
        given = x.clone().requires_grad_()
        out = model(given)
        torch.testing.assert_close(out, keep(x * total), rtol=1e-15, atol=0)
        out.backward(keep(grad))
        torch.testing.assert_close(given.grad, grad * (r + 1), rtol=1e-15, atol=0)
    for wanted, shown in ((Shard(-1), r"Shard\(-1\)"), (Shard(1), None)):
        given = Partial("max") if shown is None else Partial()
        with pytest.raises(ValueError, match=r"plan\['0'\]: PrepareModuleOutput: output 0: from "
                                             + (r"Partial\(\) to " + shown if shown else r"Partial\(.*max") +
                                             r".*, which tp_kernels does not move .* sums a Partial\(\) to "
                                             r"Replicate\(\) or, reduce-scattered, to Shard\(d\) with d >= 0"):
            tp_kernels.parallelize(nn.Sequential(_Scaled(1)), {
                "0": PrepareModuleOutput(output_layouts=given, desired_output_layouts=wanted)})


class _MLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def check_row_layers_with_partial_outputs():
    """A row layer whose output is left each rank's partial sum (torch's
    ``RowwiseParallel(output_layouts=Partial())``, or ``("rowwise", "partial")``), reduced by the
    module around it (``PrepareModuleOutput(output_layouts=Partial())``), reduce-scattered along the
    sequence or summed whole: the output (its bias once) and every gradient are the dense MLP's;
    with sequence parallelism, or a whole input, it is a ValueError."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

    r, p = rank_world()
    torch.manual_seed(0)
    dense = nn.Sequential(_MLP(4, 3 * p)).double()
    x = torch.randn(2, 2 * p, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for row, wanted, keep in ((RowwiseParallel(output_layouts=Partial()), Shard(1), lambda t: block(t, 1, r, p)),
                              (("rowwise", "partial"), Replicate(), lambda t: t)):
        par = tp_kernels.parallelize(copy.deepcopy(dense), {
            "0.fc1": ColwiseParallel(), "0.fc2": row,
            "0": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=wanted)})
        assert not par[0].fc2.reduce_results
        dense.zero_grad()
        want, got = dense(x), par(x)
        torch.testing.assert_close(got, keep(want), rtol=1e-12, atol=1e-12)
        grad = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        want.backward(grad)
        got.backward(keep(grad))
        assert_dense_grads(par, dense, 1e-12)
    with pytest.raises(ValueError, match=r"plan\['0.fc2'\]: RowwiseParallel: output_layouts=Partial\(\) takes the "
                                         r"input split along the last dim, input_layouts=Shard\(-1\), not Replicate"):
        tp_kernels.parallelize(copy.deepcopy(dense), {
            "0.fc2": RowwiseParallel(input_layouts=Replicate(), output_layouts=Partial())})
    with pytest.raises(ValueError, match=r"plan\['0.fc2'\]: '0.fc2': a row layer whose output is left partial, "
                                         r"\('rowwise', 'partial'\), do not go with sequence parallelism"):
        tp_kernels.parallelize(copy.deepcopy(dense), {"0.fc1": "colwise", "0.fc2": ("rowwise", "partial")},
                               sequence_parallel=True)
    with pytest.raises(ValueError, match=r"plan\['0.fc2'\]: 'rowwise' takes \('rowwise', 'partial'\)"):
        tp_kernels.parallelize(copy.deepcopy(dense), {"0.fc2": ("rowwise", "sum")})


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_row_layers_with_partial_outputs(world):
    world.run(check_row_layers_with_partial_outputs)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_torch_partial_outputs(world):
    world.run(check_torch_partial_outputs)


class _Tokens(nn.Module):
    """Its input, ``[b, s, h]``, times a factor, handed back flat, ``[b*s, h]`` (as Llama 4's mixture
    of experts hands back its tokens), or, ``pooled``, summed over the batch, ``[s, h]``."""

    def __init__(self, factor, pooled=False):
        super().__init__()
        self.factor, self.pooled = factor, pooled

    def forward(self, x):
        y = x * self.factor
        return y.sum(0) if self.pooled else y.flatten(0, 1)


def check_torch_outputs_of_two_dims():
    """A module whose input a ``PrepareModuleInputOutput`` gathers along the sequence, ``[b, s/p, h]``
    to ``[b, s, h]``, and whose output, each rank's partial sum, it reduce-scatters along the
    sequence: an output that is the tokens flat, ``[b*s, h]``, is reduce-scattered as ``[b, s, h]``
    and handed on flat, ``[b*s/p, h]``; one of two dims that is not (summed over the batch,
    ``[s, h]``) is reduce-scattered along its own dim 0; a move along a dim the output does not have
    besides its last (``Shard(2)``) is a ValueError naming the output and its shape as the module
    gave it."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    r, p = rank_world()
    b, s, h = 2, 2 * p, 4
    total = p * (p + 1) // 2  # (the factors r + 1 summed)
    x = torch.randn(b, s, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def model(pooled, dim):
        return tp_kernels.parallelize(nn.Sequential(_Tokens(r + 1, pooled)), {"0": PrepareModuleInputOutput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), output_layouts=Partial(),
            desired_output_layouts=Shard(dim))})

    for pooled, dim, want in ((False, 1, block(x * total, 1, r, p).flatten(0, 1)),
                              (True, 0, block(x.sum(0) * total, 0, r, p))):
        given = block(x, 1, r, p).clone().requires_grad_()
        out = model(pooled, dim)(given)
        torch.testing.assert_close(out, want, rtol=1e-15, atol=0)
        out.sum().backward()
        assert given.grad.shape == given.shape, pooled
    with pytest.raises(ValueError, match=rf"_Tokens output 0: sequence_dim: .* of shape \({b * s}, {h}\), got 2"):
        model(False, 2)(block(x, 1, r, p))


def test_torch_outputs_of_two_dims(world2):
    world2.run(check_torch_outputs_of_two_dims)


class _Keyed(nn.Module):
    """``x`` plus ``memory``, an input a call passes by its name alone."""

    def forward(self, x, *, memory):
        return x + memory


def check_torch_keyword_inputs():
    """A ``PrepareModuleInput``'s layouts of inputs by their names, several of them: each moves its
    own input (one alike moves nothing), a keyword-only one too; a layout given by position past
    the inputs a call may pass by position (``memory``, keyword-only) is a ValueError at the call,
    naming it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    r, p = rank_world()
    g = torch.Generator().manual_seed(0)
    x, memory = (torch.randn(2, 2 * p, 3, dtype=torch.float64, generator=g) for _ in range(2))
    by_name = tp_kernels.parallelize(nn.Sequential(_Keyed()), {"0": PrepareModuleInput(
        input_kwarg_layouts={"x": Replicate(), "memory": Shard(1)},
        desired_input_kwarg_layouts={"x": Replicate(), "memory": Replicate()})})
    torch.testing.assert_close(by_name[0](x, memory=block(memory, 1, r, p)), x + memory, rtol=0, atol=0)
    by_position = tp_kernels.parallelize(nn.Sequential(_Keyed()), {"0": PrepareModuleInput(
        input_layouts=(Replicate(), Shard(1)), desired_input_layouts=(Replicate(), Replicate()))})
    with pytest.raises(ValueError, match=r"_Keyed: its PrepareModule style moves input 1, which this call does not "
                                         r"have \(1 positional, keywords \['memory'\]\)"):
        by_position[0](x, memory=block(memory, 1, r, p))


def test_torch_keyword_inputs(world2):
    world2.run(check_torch_keyword_inputs)


def check_torch_parallel_style_errors():
    """What tp_kernels cannot take of torch's styles is a ValueError naming the pattern, before
    anything is replaced: DTensor outputs, an embedding's columns left split, a row layer's whole
    input with a sequence-split output, a move between two shardings, a style on a parameter, a
    move of a layer the plan replaces or two moves of one module, one module matched with two sequence
    dims, and a DeviceMesh of two dims."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel)

    _, p = rank_world()
    torch.manual_seed(0)
    model = _TitanLM(4 * p, 8, 2 * p, 3 * p)
    dense = copy.deepcopy(model)
    cases = [
        ({"output": ColwiseParallel(output_layouts=Replicate(), use_local_output=False)},
         r"plan\['output'\]: ColwiseParallel: use_local_output=False: tp_kernels hands on a DTensor only as a "
         r"column layer's output split along its last dim \(torch's loss_parallel"),
        ({"tok_embeddings": ColwiseParallel()}, r"ColwiseParallel: on an nn.Embedding leaves each rank its columns"),
        ({"tok_embeddings": RowwiseParallel(input_layouts=Shard(0))},
         r"RowwiseParallel: on an nn.Embedding takes the ids whole, input_layouts=Replicate\(\), not Shard\(0\)"),
        ({"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Partial())},
         r"RowwiseParallel: output_layouts=Partial\(\): expected Replicate\(\) or the sequence"),
        ({"layers.*.attention.wo": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))},
         r"RowwiseParallel: input_layouts=Replicate\(\) with a sequence-sharded output"),
        ({"layers.*.attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(2))},
         r"PrepareModuleInput: input 0: from Shard\(1\) to Shard\(2\), which tp_kernels does not move"),
        ({"output.weight": ColwiseParallel()}, r"ColwiseParallel applies to a module, but 'output.weight' is a parameter"),
        ({"layers.*.attention": ColwiseParallel()}, r"applies to nn.Linear or nn.Embedding, but the module is a "
                                                    r"_TitanAttention"),
        ({"output": ColwiseParallel(input_layouts=Shard(-1))}, r"input_layouts=Shard\(-1\): expected Replicate\(\) "
                                                                r"or the sequence"),
        ({"layers.*.attention": "redistribute"}, r"'redistribute' moves a module's inputs or outputs between layouts"),
        ({"output": "colwise", "outpu[t]": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())},
         r"plan: 'output' is matched as \('redistribute', Moves.*but the same module \('output'\) as 'colwise', which "
         r"replaces it"),
        ({"layers.*.attention.wq": ColwiseParallel(), "layers.0.attention.wq": ColwiseParallel(input_layouts=Shard(1))},
         r"plan: 'layers.0.attention.wq' is matched with the sequence split along dim 1, but the same module "
         r"\('layers.0.attention.wq'\) along no dim"),
        ({"layers.*.attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
          "layers.0.attention": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1))},
         r"plan: 'layers.0.attention' is matched as \('redistribute', Moves\(inputs=\(\(0, \('scatter', 1\)\),\).*"
         r"but the same module \('layers.0.attention'\) as \('redistribute', Moves\(inputs=\(\(0, \('gather', 1\)"),
    ]
    for plan, match in cases:
        with pytest.raises(ValueError, match=match):
            tp_kernels.parallelize(model, plan)
    mesh = init_device_mesh("cpu", (1, p), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"group: a DeviceMesh of 2 dims \(\('dp', 'tp'\)\); pass its tensor-parallel "
                                         r"dim, mesh\['tp'\]"):
        tp_kernels.parallelize(model, {"output": ColwiseParallel()}, group=mesh)
    for (name, q), (_, want) in zip(model.named_parameters(), dense.named_parameters()):
        assert type(q) is nn.Parameter and torch.equal(q, want), name  # nothing replaced
    tp_kernels.parallelize(model, {"output": ColwiseParallel()}, group=mesh["tp"])
    assert isinstance(model.output, tp_kernels.ColumnParallelLinear)
    # a layout given by a name the forward's signature does not have: an error at the call, on every rank
    misnamed = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()})
    fresh = tp_kernels.parallelize(copy.deepcopy(dense), {"layers.*.attention": misnamed})
    with pytest.raises(ValueError, match=r"_TitanAttention: its PrepareModule style moves input 'hidden_states', "
                                         r"which this call does not have \(2 positional, keywords \[\]\): its "
                                         r"forward's signature has no such input"):
        fresh(torch.zeros(2, 2 * p, dtype=torch.long))
    # an output moved that the module does not hand back: an error at the call, on every rank
    extra = tp_kernels.parallelize(copy.deepcopy(dense), {"layers.*.attention": PrepareModuleOutput(
        output_layouts=(Replicate(), Partial()), desired_output_layouts=(Replicate(), Replicate()))})
    with pytest.raises(ValueError, match=r"_TitanAttention: its PrepareModule style moves output 1, which this call "
                                         r"does not have \(1 outputs\): output_layouts counts the module's outputs"):
        extra(torch.zeros(2, 2 * p, dtype=torch.long))
    # a layout given to an input that is no tensor (the attention's scale): an error at the call
    scaled = tp_kernels.parallelize(copy.deepcopy(dense), {"layers.*.attention": PrepareModuleInput(
        input_layouts=(None, Shard(1)), desired_input_layouts=(None, Replicate()))})
    with pytest.raises(ValueError, match=r"_TitanAttention input 1: expected a tensor to move \(gather along dim "
                                         r"1\), got float"):
        scaled(torch.zeros(2, 2 * p, dtype=torch.long))
    # two layouts of one input (by position, and by its name in the forward's signature) that differ
    twice = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                               input_kwarg_layouts={"x": Replicate()}, desired_input_kwarg_layouts={"x": Shard(1)})
    with pytest.raises(ValueError, match=r"_TitanAttention: its PrepareModule style gives input 0 \('x' in its "
                                         r"forward\) two layouts"):
        tp_kernels.parallelize(copy.deepcopy(dense), {"layers.*.attention": twice})
    # a style whose layouts are alike moves nothing: taken, no hook registered
    alike = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1))
    still = tp_kernels.parallelize(copy.deepcopy(dense), {"layers.*.attention": alike})
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in still.modules())


def test_torch_parallel_style_errors(world2):
    world2.run(check_torch_parallel_style_errors)


def test_only_an_input_gathered_along_the_sequence_is_gathered_for_the_column_layers():
    """What a PrepareModule style gathers for the module's column layers (deferred, one
    reduce-scatter of their input gradients): an input gathered along a sequence dim, by position
    or by name; not one gathered along the hidden units (-1), nor an output."""
    from tp_kernels._torch_styles import Moves

    assert Moves(inputs=((0, ("gather", 1)),)).gathers_sequence
    assert Moves(kwargs=(("hidden_states", ("gather", 0)),)).gathers_sequence
    assert not Moves(inputs=((0, ("gather", -1)),)).gathers_sequence
    assert not Moves(inputs=((0, ("scatter", 1)),), outputs=((0, ("gather", 1)),)).gathers_sequence


def check_vocab_plan_and_shared_modules():
    r, p = rank_world()
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(7 * p, 6), "head": nn.Linear(6, 7 * p, bias=False)})
    model["tied"] = model["head"]  # one module under two names is sharded once
    dense = copy.deepcopy(model)
    tp_kernels.parallelize(model, {"emb": "vocab", "head": "colwise"})
    assert isinstance(model["emb"], tp_kernels.VocabParallelEmbedding)
    assert model["tied"] is model["head"]
    ids = torch.tensor([[0, 7 * p - 1, 3]])
    assert torch.equal(model["emb"](ids), dense["emb"](ids))
    assert torch.equal(model["head"].weight, block(dense["head"].weight, 0, r, p))
    shared = nn.ModuleDict({"a": nn.Linear(4, 2 * p)})
    shared["b"] = shared["a"]
    with pytest.raises(ValueError, match="same module"):
        tp_kernels.parallelize(shared, {"a": "colwise", "b": "rowwise"})


def test_vocab_plan_and_shared_modules(world2):
    world2.run(check_vocab_plan_and_shared_modules)


class LanguageModel(nn.Module):
    def __init__(self, vocab, hidden, heads, ffn):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.block = Block(hidden, heads, ffn)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):  # [s, b] -> [s, b, vocab]
        return self.head(self.block(self.emb(ids)))


LM_PLAN = {"emb": "vocab", "head": "colwise", **{f"block.{k}": v for k, v in PLAN.items()}}


def check_clip_grad_norm(sequence_parallel, device="cpu"):
    """tp_kernels.clip_grad_norm_ on a parallelized language model (vocabulary-parallel embedding,
    column and row layers, layer norms and row biases whole on every rank) gives the dense model's
    total norm, the same on every rank, and the dense model's clipped gradients, for norms of order
    1, 2, 3 and inf, in float64."""
    r, p = rank_world()
    vocab, hidden, heads, ffn, s, b = 7 * p, 10, 2 * p, 6 * p, 2 * p, 3
    torch.manual_seed(0)
    dense = LanguageModel(vocab, hidden, heads, ffn).double().to(device)
    par = tp_kernels.parallelize(copy.deepcopy(dense), LM_PLAN, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, vocab, (s, b), generator=torch.Generator().manual_seed(1)).to(device)
    tokens = torch.randint(0, vocab, (s, b), generator=torch.Generator().manual_seed(2)).to(device)

    def grads():
        for model in (dense, par):
            model.zero_grad()
        F.cross_entropy(dense(ids).reshape(-1, vocab), tokens.reshape(-1), reduction="sum").backward()
        # the dense model's own forward; under sequence parallelism the embedding returns [s/p, b, h]
        # and the head gathers it: [s, b, vocab/p] either way
        logits = par(ids)
        tp_kernels.vocab_parallel_cross_entropy(logits, tokens).sum().backward()
        if sequence_parallel:
            tp_kernels.allreduce_sequence_parallel_grads([q for n, q in par.named_parameters() if "norm" in n])

    def shard(name, full):  # what this rank holds of a dense gradient
        module = par.get_submodule(name.rpartition(".")[0])
        names = getattr(type(module), "sharded_parameters", ())
        if name.rpartition(".")[2] not in names or p == 1:
            return full
        return block(full, 1 if isinstance(module, tp_kernels.RowParallelLinear) else 0, r, p)

    totals = []
    for norm_type in (2.0, 1, 3.0, math.inf):
        grads()
        want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1e-3, norm_type)
        got = tp_kernels.clip_grad_norm_(par, 1e-3, norm_type)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=f"total norm of order {norm_type}")
        dense_grads = dict((n, q.grad) for n, q in dense.named_parameters())
        for name, q in par.named_parameters():
            torch.testing.assert_close(q.grad, shard(name, dense_grads[name]), rtol=1e-10, atol=1e-14,
                                       msg=lambda m: f"order {norm_type}, {name}: {m}")
        totals.append(got.item())
    # a rank without gradients still takes part, and scales nothing
    grads()
    if r == p - 1:
        par.zero_grad()
    mine = tp_kernels.clip_grad_norm_(par, 1e9)
    assert torch.isfinite(mine)
    # non-finite: every rank raises when asked to
    grads()
    if r == 0:
        par.head.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="total norm of order 2.0 of the gradients is nan"):
        tp_kernels.clip_grad_norm_(par, 1.0, error_if_nonfinite=True)
    for bad, match in [(dict(max_norm=-1.0), "max_norm"), (dict(max_norm=1.0, norm_type=0), "norm_type"),
                       (dict(max_norm=True), "max_norm")]:
        with pytest.raises(ValueError, match=match):
            tp_kernels.clip_grad_norm_(par, **bad)
    with pytest.raises(ValueError, match="module"):
        tp_kernels.clip_grad_norm_(list(par.parameters()), 1.0)
    two = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    for q in two.parameters():
        q.grad = torch.ones_like(q)
    with pytest.raises(ValueError, match=r"module: its gradients are on several devices \(cpu, meta\)"):
        tp_kernels.clip_grad_norm_(two, 1.0)
    # bfloat16 gradients: each one's norm taken in float32, the float64 norm of their values to float32's rounding
    low = nn.Linear(64, 64, dtype=torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(3)  # (alike on every rank: a parameter every rank holds whole counts once)
    for q in low.parameters():
        q.grad = torch.randn(q.shape, generator=g).to(device, torch.bfloat16)
    exact = torch.linalg.vector_norm(torch.cat([q.grad.double().flatten() for q in low.parameters()]))
    torch.testing.assert_close(tp_kernels.clip_grad_norm_(low, 1e9), exact, rtol=1e-6, atol=0)
    return totals + [mine.item()]


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_clip_grad_norm_is_the_dense_models(world, sequence_parallel):
    per_rank = world.run(check_clip_grad_norm, sequence_parallel)
    assert all(t == per_rank[0] for t in per_rank), per_rank  # bit for bit the same total on every rank


def check_full_state_dict_across_sizes(device="cpu"):
    """The full state dict of a model parallelized over all the ranks is the dense model's, bit for
    bit, on every rank; the dense model loads it, and so does the same model parallelized over half
    the ranks (load_full_state_dict), which then computes what the dense model computes."""
    r, p = rank_world()
    vocab, hidden, heads, ffn = 4 * p, 10, 2 * p, 4 * p
    torch.manual_seed(0)
    dense = LanguageModel(vocab, hidden, heads, ffn).double().to(device)
    wide = tp_kernels.parallelize(copy.deepcopy(dense), LM_PLAN)
    full = tp_kernels.full_state_dict(wide)
    want = dense.state_dict()
    assert list(full) == list(want)
    for key, value in want.items():
        assert torch.equal(full[key], value), key
    torch.manual_seed(1)  # other weights, replaced by the loads
    other = LanguageModel(vocab, hidden, heads, ffn).double().to(device)
    other.load_state_dict(full)
    ids = torch.randint(0, vocab, (4, 3), generator=torch.Generator().manual_seed(2)).to(device)
    assert torch.equal(other(ids), dense(ids))
    tp_kernels.initialize_model_parallel(max(p // 2, 1))
    try:
        torch.manual_seed(1)
        narrow = tp_kernels.parallelize(LanguageModel(vocab, hidden, heads, ffn).double().to(device), LM_PLAN)
        result = tp_kernels.load_full_state_dict(narrow, full)
        assert not result.missing_keys and not result.unexpected_keys
        q, n = tp_kernels.get_tensor_model_parallel_rank(), tp_kernels.get_tensor_model_parallel_world_size()
        assert torch.equal(narrow.block.mlp[2].weight, block(dense.block.mlp[2].weight, 1, q, n))
        logits = tp_kernels.mappings.gather_from_tensor_model_parallel_region(narrow(ids))
        torch.testing.assert_close(logits, dense(ids), rtol=1e-12, atol=1e-12)
        bad = dict(full, **{"head.weight": full["head.weight"][:-1]})
        with pytest.raises(ValueError, match=r"state_dict\['head.weight'\]: expected the full shape"):
            tp_kernels.load_full_state_dict(narrow, bad)
        with pytest.raises(RuntimeError, match="Missing key"):
            tp_kernels.load_full_state_dict(narrow, {k: v for k, v in full.items() if k != "emb.weight"})
        with pytest.raises(ValueError, match="state_dict"):
            tp_kernels.load_full_state_dict(narrow, list(full.values()))
    finally:
        tp_kernels.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_full_state_dict_across_sizes(world):
    world.run(check_full_state_dict_across_sizes)


def check_full_state_dict_options(device="cpu"):
    """cpu_offload gives the dense state dict on the CPU, each tensor contiguous; rank0_only gives it
    on the group's rank 0 and {} on the others; both are checked on every rank, and agreed: a rank
    that asks for another option than its peers gets the same error as they do, and the group works
    afterwards. load_full_state_dict passes ``strict`` to load_state_dict and returns its result."""
    r, p = rank_world()
    torch.manual_seed(0)
    dense = LanguageModel(4 * p, 10, 2 * p, 4 * p).double().to(device)
    wide = tp_kernels.parallelize(copy.deepcopy(dense), LM_PLAN)
    want = dense.state_dict()
    for cpu_offload in (False, True):
        for rank0_only in (False, True):
            full = tp_kernels.full_state_dict(wide, cpu_offload=cpu_offload, rank0_only=rank0_only)
            if rank0_only and r != 0:
                assert full == {}, (cpu_offload, list(full))
                continue
            assert list(full) == list(want)
            for key, value in want.items():
                assert full[key].device.type == ("cpu" if cpu_offload else value.device.type), key
                assert full[key].is_contiguous(), key  # (a row layer's weight too, joined along dim 1)
                assert torch.equal(full[key].to(value.device), value), (key, cpu_offload, rank0_only)
    for bad in ("cpu_offload", "rank0_only"):
        with pytest.raises(ValueError, match=f"{bad}: expected a bool, got 1"):
            tp_kernels.full_state_dict(wide, **{bad: 1})
    if p > 1:
        odd_one = "disagree on this call.*rank 1: full_state_dict: .* rank0_only True"
        with fingerprints_set(True), pytest.raises(RuntimeError, match=odd_one):
            tp_kernels.full_state_dict(wide, rank0_only=r == 1)
    full = tp_kernels.full_state_dict(wide)  # the group still works
    assert torch.equal(full["head.weight"], want["head.weight"])
    extra = {**want, "extra": torch.zeros(1)}  # (strict as load_state_dict takes it, and its result)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        tp_kernels.load_full_state_dict(wide, extra)
    loaded = tp_kernels.load_full_state_dict(wide, extra, strict=False)
    assert loaded.unexpected_keys == ["extra"] and loaded.missing_keys == [], loaded


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_full_state_dict_options(world):
    world.run(check_full_state_dict_options)


class _MemoryAttention(Attention):
    """:class:`Attention` whose keys and values come from ``memory`` where it is given (cross-attention),
    and which leaves its value projection uncalled where ``keys_as_values`` (the keys attended twice)."""

    def forward(self, x, memory=None, keys_as_values=False):  # [s, b, h]
        memory = x if memory is None else memory
        q, k = self.q_proj(x), self.k_proj(memory)
        v = k if keys_as_values else self.v_proj(memory)
        s, b = q.shape[:2]
        q, k, v = (t.reshape(t.shape[0], b, -1, HEAD_DIM).permute(1, 2, 0, 3) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))


def check_shared_input_gather():
    """Under parallelize's sequence parallelism, the column layers a module calls on one input (an
    attention's query, key and value projections) gather it once (learned in the module's first
    forward outside saved-tensor hooks, which shares too): the attention and the MLP (one column
    layer) each all-gather their input once in forward, and in backward reduce-scatter its gradient
    once and gather it once more for the weights' gradients (where each layer gathered its own: 10
    gathers and 6 reduce-scatters of the activations' blocks, here 6 and 4), giving the dense
    block's output, input gradient and every weight gradient in float64, plain and under torch's
    checkpoint (reentrant or not; a first forward under the non-reentrant one, whose saved-tensor
    hooks are on, learns nothing; under it, nothing of the call kept). The weights joined for the shared GEMM are not kept for the backward
    (freed once the forward returns); each layer's output is a contiguous tensor of its own. A layer
    called outside the module, or the layers once their backends differ, gather alone, the groups
    kept. An attention whose keys and values come from another input shares their gather (the
    query's alone); one that leaves its value projection uncalled shares the query's and the key's;
    a call off the groups runs alone, under the non-reentrant checkpoint too (its recomputation the
    same); a first forward that raises learns nothing;
    a block holding its attention's and its MLP's projections side by side (some with a bias, some
    without) shares each input's: the dense results every time."""
    from torch.utils.checkpoint import checkpoint

    r, p = rank_world()
    hidden, heads, ffn, s, b = 9, 2 * p, 3 * p, 3 * p, 2
    torch.manual_seed(0)
    dense = Block(hidden, heads, ffn).double()
    par = tp_kernels.parallelize(copy.deepcopy(dense), PLAN, sequence_parallel=True)
    shared = par.attn.q_proj.shared_gather
    if p == 1:  # (nothing gathered: nothing shared)
        assert shared is None
        return
    qkv = (par.attn.q_proj, par.attn.k_proj, par.attn.v_proj)
    assert all(m.shared_gather is shared for m in qkv) and par.mlp[0].shared_gather is None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, b, hidden, dtype=torch.float64, generator=g)

    def run(model, x, wrap=None):
        x = x.clone().requires_grad_()
        y = (wrap or (lambda f, t: f(t)))(model, x)
        y.square().sum().backward()
        if model is par:  # (the norms' gradients, each rank's block's share, summed)
            tp_kernels.allreduce_sequence_parallel_grads([q for name, q in model.named_parameters() if "norm" in name])
        grads = {name: q.grad for name, q in model.named_parameters()}
        model.zero_grad()
        return y.detach(), x.grad, grads

    def kinds(counted):  # (by kind alone: the collectives of the activations' blocks and of the whole ones)
        return {kind: sum(n for (k, _), n in counted.items() if k == kind) for kind, _ in counted}

    want_y, want_dx, want_grads = run(dense, x)
    non_reentrant = lambda f, t: checkpoint(f, t, use_reentrant=False)  # noqa: E731
    for wrap in (non_reentrant, None, non_reentrant, lambda f, t: checkpoint(f, t, use_reentrant=True)):
        learning = shared.groups is None and wrap is None
        with _counting_collectives() as counted:
            got_y, got_dx, got_grads = run(par, block(x, 0, r, p), wrap)
        if wrap is None:  # (the learning forward shares too; the norms' gradients summed: an all-reduce)
            assert kinds(counted) == {"all_gather": 6, "reduce_scatter": 4, "all_reduce": 1} and learning, counted
        torch.testing.assert_close(got_y, block(want_y, 0, r, p), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_dx, block(want_dx, 0, r, p), rtol=1e-12, atol=1e-12)
        for name, grad in got_grads.items():
            want = want_grads[name]
            if name.startswith(("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.0")):
                want = block(want, 0, r, p)
            elif name in ("attn.o_proj.weight", "mlp.2.weight"):
                want = block(want, 1, r, p)
            torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
        if shared.groups is None:  # (the first forward, under the checkpoint's hooks: nothing learned)
            assert wrap is non_reentrant
    assert {id(m) for m in shared.groups[id(qkv[0])]} == {id(m) for m in qkv} == set(shared.groups)
    # under torch's non-reentrant checkpoint its saved-tensor hooks decide: nothing of the call kept
    inputs = []
    hook = par.attn.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    y = checkpoint(par, block(x, 0, r, p).clone().requires_grad_(), use_reentrant=False)
    hook.remove()
    assert inputs[0]() is None, "the attention's input kept"  # (recomputed in backward)
    y.square().sum().backward()
    par.zero_grad()

    joined = []  # the weights joined for the shared GEMM, as weak references
    original_cat = torch.cat

    def cat(tensors, *args, **kwargs):
        out = original_cat(tensors, *args, **kwargs)
        if out.shape == (3 * heads // p * HEAD_DIM, hidden):
            joined.append(weakref.ref(out))
        return out

    xs = block(x, 0, r, p).clone().requires_grad_()
    with _counting_collectives() as counted:
        outputs = []
        hooks = [m.register_forward_hook(lambda m, args, out: outputs.append(out)) for m in (qkv[0], qkv[2])]
        with mock.patch.object(torch, "cat", cat):
            y = par(xs)
        for hook in hooks:
            hook.remove()
        assert kinds(counted) == {"all_gather": 2, "reduce_scatter": 2}, counted  # (the attention's and the
        # MLP's gathers; the row layers' reduce-scatters)
        assert len(joined) == 1 and joined[0]() is None, joined  # (the attention's, not kept by the backward)
        assert all(out.is_contiguous() and out.shape == (s, b, heads // p * HEAD_DIM) for out in outputs)
        counted.clear()
        y.square().sum().backward()
        assert kinds(counted) == {"all_gather": 4, "reduce_scatter": 2}, counted  # (the row layers' gradients
        # gathered; the shared input's gradient reduce-scattered and the input gathered again, once for the
        # attention and once for the MLP)
        counted.clear()
        with torch.no_grad():  # (a layer called outside its module's forward: alone, the groups kept)
            torch.testing.assert_close(par.attn.v_proj(xs), block(dense.attn.v_proj(x), 2, r, p), rtol=1e-12,
                                       atol=1e-12)
        assert kinds(counted) == {"all_gather": 1} and not shared.held and len(shared.groups) == 3, counted
        for backend, gathers in (("reference", 4), ("auto", 2)):  # (one layer's backend changed: each alone)
            counted.clear()
            qkv[1].backend = backend
            with torch.no_grad():
                torch.testing.assert_close(par(xs), block(want_y, 0, r, p), rtol=1e-12, atol=1e-12)
            assert kinds(counted) == {"all_gather": gathers, "reduce_scatter": 2}, (backend, counted)
    torch.testing.assert_close(xs.grad, block(want_dx, 0, r, p), rtol=1e-12, atol=1e-12)

    # keys and values of another input, then a value projection left uncalled: the dense results, the
    # layers called on one input sharing its gather
    torch.manual_seed(0)
    dense_attention = _MemoryAttention(hidden, heads).double()
    plan = {"[qkv]_proj": "colwise", "o_proj": "rowwise"}
    memory = torch.randn(2 * s, b, hidden, dtype=torch.float64, generator=g)
    for kwargs, together in (({"memory": memory}, ("k_proj", "v_proj")),
                             ({"keys_as_values": True}, ("q_proj", "k_proj"))):
        attention = tp_kernels.parallelize(copy.deepcopy(dense_attention), plan, sequence_parallel=True)
        shared = attention.q_proj.shared_gather
        for _ in range(3):
            got = attention(block(x, 0, r, p), **{k: block(v, 0, r, p) if k == "memory" else v
                                                  for k, v in kwargs.items()})
            torch.testing.assert_close(got, block(dense_attention(x, **kwargs), 0, r, p), rtol=1e-12, atol=1e-12)
            assert {id(attention.get_submodule(name)) for name in together} == set(shared.groups), kwargs
        # a call that does not follow the groups (the keys of another input), under the non-reentrant
        # checkpoint: alone, nothing changed, so its recomputation takes the same path
        for other in ({"memory": memory}, {"keys_as_values": True}):
            xs = block(x, 0, r, p).clone().requires_grad_()
            got = checkpoint(attention, xs, use_reentrant=False,
                             **{k: block(v, 0, r, p) if k == "memory" else v for k, v in other.items()})
            got.square().sum().backward()
            torch.testing.assert_close(got, block(dense_attention(x, **other), 0, r, p), rtol=1e-12, atol=1e-12)
            assert {id(attention.get_submodule(name)) for name in together} == set(shared.groups), other
    # a first forward that raises learns nothing: the next learns
    attention = tp_kernels.parallelize(copy.deepcopy(dense_attention), plan, sequence_parallel=True)
    with pytest.raises(ValueError, match="input"):
        attention(torch.randn(s // p, b, hidden + 1, dtype=torch.float64))
    assert attention.q_proj.shared_gather.groups is None
    torch.testing.assert_close(attention(block(x, 0, r, p)), block(dense_attention(x), 0, r, p), rtol=1e-12,
                               atol=1e-12)
    assert len(attention.q_proj.shared_gather.groups) == 3
    # a block holding its projections side by side: each input's layers share its gather
    vocab, dim = 4 * p + 3, 8
    torch.manual_seed(0)
    dense_lm = _BatchFirstLM(vocab, dim, 2 * p, 3 * p).double()
    lm = tp_kernels.parallelize(copy.deepcopy(dense_lm), BATCH_FIRST_PLAN, sequence_parallel=True, sequence_dim=1)
    ids = torch.randint(0, vocab, (3, 2 * p), generator=g)
    for _ in range(2):
        torch.testing.assert_close(lm(ids), dense_lm(ids), rtol=1e-12, atol=1e-12)
    layer = lm.blocks[0]
    assert {frozenset(map(id, group)) for group in layer.q.shared_gather.groups.values()} == \
        {frozenset(map(id, (layer.q, layer.k, layer.v))), frozenset(map(id, (layer.gate, layer.up)))}


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_shared_input_gather(world):
    world.run(check_shared_input_gather)


class FusedBlock(nn.Module):
    """Attention with one fused [q, k, v] projection (grouped-query: half as many k/v heads as
    q heads) and a gated MLP with one fused [gate, up] projection, as Hugging Face and vLLM models
    are written; the splits of the fused outputs follow the local widths."""

    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.sizes = [heads * HEAD_DIM, heads // 2 * HEAD_DIM, heads // 2 * HEAD_DIM]
        self.qkv = nn.Linear(hidden, sum(self.sizes))
        self.o_proj = nn.Linear(heads * HEAD_DIM, hidden)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):  # [s, b, h] ([s/p, b, h] under sequence parallelism)
        shrink = sum(self.sizes) // self.qkv.weight.shape[0]  # p once sharded, else 1
        qkv = self.qkv(x)
        s, b, _ = qkv.shape  # the whole sequence, gathered under sequence parallelism
        q, k, v = qkv.split([n // shrink for n in self.sizes], -1)
        q, k, v = (t.reshape(s, b, -1, HEAD_DIM).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))
        gate, up = self.gate_up(x).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def _blocks_of_outputs(full, sizes, dim, r, p, head_size=None):
    """Rank r's blocks of each of the outputs of ``sizes`` along ``dim`` of ``full``, side by side
    (of one output p does not divide, its block padded with zeros; of an output of fewer heads of
    ``head_size`` than ranks, the head rank r shares with its neighbours, r * heads // p)."""
    if len(sizes) == 1:
        return padded_block(full, dim, r, p)

    def rows(part):
        heads = part.shape[dim] // head_size if head_size else p
        if heads >= p:
            return block(part, dim, r, p)
        return part.narrow(dim, r * heads // p * head_size, head_size)

    return torch.cat([rows(part) for part in full.split(sizes, dim)], dim)


def _assert_same_backward(dense, par, x):
    """``par(x)`` is ``dense(x)``, and so is the input's gradient of the output's sum of squares
    (float64 closeness); both models' parameters get their gradients. Returns the dense output."""
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = dense(xd), par(xp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(xp.grad, xd.grad, rtol=1e-12, atol=1e-12)
    return want.detach()


def _save_with_dcp(model, opt, path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": tp_kernels.sharded_state_dict(model),
              "optim": tp_kernels.sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _assert_dense_checkpoint(path, dense, dense_opt, moments=("exp_avg", "exp_avg_sq"), atol=1e-8):
    """The dcp checkpoint at ``path`` (of :func:`_save_with_dcp`), converted offline to one file by
    torch and read with tp_kernels.dense_state_dict, is the dense model's state dict and its
    optimizer's ``moments`` (Adam's; SGD's ``"momentum_buffer"``) (float64 closeness: the parallel
    gradients round otherwise; ``atol`` the parameters': after SGD's steps 1e-8, after Adam's
    :func:`helpers.adam_atol`). On one rank, once every rank's ``dcp.save`` has returned."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, f"{path}.pt")
    state = tp_kernels.dense_state_dict(torch.load(f"{path}.pt"))
    assert sorted(state["model"]) == sorted(dense.state_dict())  # (in the order the ranks wrote them)
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(state["model"][key], value.cpu(), rtol=1e-10, atol=atol, msg=lambda m: f"{key}: {m}")
    for name, param in dense.named_parameters():
        for k in moments:
            torch.testing.assert_close(state["optim"]["state"][name][k], dense_opt.state[param][k].cpu(), rtol=1e-10,
                                       atol=1e-14, msg=lambda m: f"{name} {k}: {m}")


def _load_with_dcp(model, path):
    """A fresh Adam for ``model``, both loaded in place from the dcp checkpoint at ``path``."""
    import torch.distributed.checkpoint as dcp

    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": tp_kernels.sharded_state_dict(model),
             "optim": tp_kernels.sharded_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    tp_kernels.load_sharded_optimizer_state_dict(model, opt, state["optim"])
    return opt


def _assert_dense_moments(model, opt, dense, dense_opt, steps=1):
    """Every Adam moment of ``model`` is the dense optimizer's after ``steps`` steps, this rank's block of it
    as the parameter holds it (float64 closeness: the parallel gradients round otherwise)."""
    q, n = tp_kernels.get_tensor_model_parallel_rank(), tp_kernels.get_tensor_model_parallel_world_size()
    dense_params = dict(dense.named_parameters())
    blocks, _, _ = tp_kernels.layers.sharded_blocks(model)
    for name, param in model.named_parameters():
        want_state, got_state = dense_opt.state[dense_params[name]], opt.state[param]
        for k in ("exp_avg", "exp_avg_sq"):
            want = want_state[k]
            if name in blocks:
                _, dim, layer = blocks[name]
                want = _blocks_of_outputs(want, layer.split_parts, dim, q, n, getattr(layer, "head_size", None))
            # (atol: a gradient that is zero but for rounding, as a key bias's, rounds otherwise)
            torch.testing.assert_close(got_state[k], want, rtol=1e-10, atol=1e-14, msg=lambda m: f"{name} {k}: {m}")
        assert float(got_state["step"]) == float(want_state["step"]) == steps, name


def check_fused_projections(path, device="cpu"):
    """("colwise", output_sizes) shards fused projections so that the dense block's own code
    computes the dense result (a plain "colwise" does not), gradients included; full_state_dict
    gives the dense state dict back, which a model over half the ranks loads; and dcp, through
    the sharded state dicts (an entry per output), moves the model and its Adam state from all the
    ranks to half of them: the dense model's weights and moments."""
    r, p = rank_world()
    hidden, heads, ffn, s, b = 7, 2 * p, 3 * p, 4, 2
    torch.manual_seed(0)
    dense = FusedBlock(hidden, heads, ffn).double().to(device)
    plan = {"qkv": ("colwise", dense.sizes), "o_proj": "rowwise", "gate_up": ("colwise", [ffn, ffn]),
            "down": "rowwise"}
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    assert par.qkv.split_parts == tuple(dense.sizes)
    x = torch.randn(s, b, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    want = _assert_same_backward(dense, par, x)
    fused = {"qkv.weight": dense.sizes, "qkv.bias": dense.sizes, "gate_up.weight": [ffn, ffn]}
    for name, sizes in fused.items():
        torch.testing.assert_close(par.get_parameter(name).grad,
                                   _blocks_of_outputs(dense.get_parameter(name).grad, sizes, 0, r, p),
                                   rtol=1e-12, atol=1e-12)
    sp = tp_kernels.parallelize(copy.deepcopy(dense), plan, sequence_parallel=True)
    torch.testing.assert_close(sp(block(x, 0, r, p)), block(want, 0, r, p), rtol=1e-12, atol=1e-12)
    if p > 1:  # the hazard: a plain split of the fused rows gives some ranks whole outputs
        plain = tp_kernels.parallelize(copy.deepcopy(dense), dict(plan, qkv="colwise", gate_up="colwise"))
        assert not torch.allclose(plain(x), dense(x))
    full = {k: v.clone() for k, v in tp_kernels.full_state_dict(par).items()}  # (it shares memory, as state_dict())
    dense_before = copy.deepcopy(dense)
    assert list(full) == list(dense.state_dict())
    for key, value in dense.state_dict().items():
        assert torch.equal(full[key], value), key
    assert {"qkv.weight[0]", "qkv.weight[2]", "gate_up.weight[1]"} <= set(tp_kernels.sharded_state_dict(par))
    dense_opt, par_opt = torch.optim.Adam(dense.parameters(), lr=0.1), torch.optim.Adam(par.parameters(), lr=0.1)
    dense_opt.step(), par_opt.step()
    saved = {k: v.clone() for k, v in tp_kernels.full_state_dict(par).items()}  # what a load must give back
    _save_with_dcp(par, par_opt, path)
    tp_kernels.initialize_model_parallel(max(p // 2, 1))
    try:
        torch.manual_seed(1)
        narrow = tp_kernels.parallelize(FusedBlock(hidden, heads, ffn).double().to(device), plan)
        tp_kernels.load_full_state_dict(narrow, full)
        torch.testing.assert_close(narrow(x), dense_before(x), rtol=1e-12, atol=1e-12)
        narrow_opt = _load_with_dcp(narrow, path)  # the model in place
        after = tp_kernels.full_state_dict(narrow)
        for key, value in saved.items():
            assert torch.equal(after[key], value), key
        _assert_dense_moments(narrow, narrow_opt, dense, dense_opt)
    finally:
        tp_kernels.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_fused_projections(world, tmp_path):
    world.run(check_fused_projections, str(tmp_path))


class GroupedQueryBlock(nn.Module):
    """Attention of ``heads`` query heads over ``kv_heads`` key/value heads, through one fused
    [q, k, v] projection, and a gated MLP through one fused [gate, up], written as vLLM writes a
    model for ``tp`` ranks: the local numbers of heads from ``tp``, at least one key/value head
    (replicated where there are fewer of them than ranks)."""

    def __init__(self, hidden, heads, kv_heads, ffn, tp=1):
        super().__init__()
        self.heads, self.kv_heads, self.ffn, self.tp = heads, kv_heads, ffn, tp
        self.sizes = [heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM]
        self.qkv = nn.Linear(hidden, sum(self.sizes))
        self.o_proj = nn.Linear(heads * HEAD_DIM, hidden)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):  # [s, b, h] ([s/p, b, h] under sequence parallelism)
        q_local, kv_local = self.heads // self.tp, max(self.kv_heads // self.tp, 1)
        qkv = self.qkv(x)
        s, b, _ = qkv.shape
        q, k, v = qkv.split([q_local * HEAD_DIM, kv_local * HEAD_DIM, kv_local * HEAD_DIM], -1)
        q, k, v = (t.reshape(s, b, -1, HEAD_DIM).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        k, v = (t.repeat_interleave(q_local // kv_local, 1) for t in (k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))
        gate, up = self.gate_up(x).split(self.ffn // self.tp, -1)
        return x + self.down(F.silu(gate) * up)


def check_replicated_kv_heads(path, kv_heads, device="cpu"):
    """Grouped-query and multi-query attention with fewer key/value heads than ranks, parallelized
    with ("colwise", [q, k, v], head_size): each key/value head is replicated on the ranks whose
    query heads attend with it, and the block matches the dense one in float64: output, gradients
    (a replicated head's summed over its ranks), clip_grad_norm_'s total, two Adam steps (the
    replicas stay alike), sequence parallelism, full_state_dict; dcp moves the model and its Adam
    state to half the ranks (another replication, or none)."""
    r, p = rank_world()
    hidden, heads, ffn, s, b = 7, 2 * p, 3 * p, 4, 2

    def model(tp, device=device):
        torch.manual_seed(0)
        return GroupedQueryBlock(hidden, heads, kv_heads, ffn, tp).double().to(device)

    def plan(dense):
        return {"qkv": ("colwise", dense.sizes, HEAD_DIM), "o_proj": "rowwise", "gate_up": ("colwise", [ffn, ffn]),
                "down": "rowwise"}

    dense = model(1)
    if p == 4 and kv_heads == 1:  # (a transformers attention's num_key_value_groups: each rank's, or refused)
        for k_heads, v_heads, groups, message in [
                (2, 1, 4, r"'attn.v' splits its heads into 1 blocks and 'attn.k' into 2: 'attn''s "
                          r"num_key_value_groups"),
                (1, 1, 3, r"'attn.k''s heads in 1 blocks over 4 ranks leave 'attn' \(num_key_value_groups=3\) "
                          r"no whole"),
                (1, 1, 4, None)]:  # (4 query heads, one key/value head: one query head a rank)
            torch.manual_seed(0)
            attn = nn.Module()
            attn.k, attn.v = nn.Linear(hidden, k_heads * HEAD_DIM), nn.Linear(hidden, v_heads * HEAD_DIM)
            attn.num_key_value_groups = groups
            holder = nn.ModuleDict({"attn": attn})
            attn_plan = {"attn.k": ("colwise", [k_heads * HEAD_DIM], HEAD_DIM),
                         "attn.v": ("colwise", [v_heads * HEAD_DIM], HEAD_DIM)}
            if message is None:
                tp_kernels.parallelize(holder, attn_plan)
                assert attn.num_key_value_groups == 1 and attn.k.split_blocks == (1,)
                continue
            with pytest.raises(ValueError, match=message):
                tp_kernels.parallelize(holder, attn_plan)
            assert isinstance(attn.k, nn.Linear) and attn.num_key_value_groups == groups  # (nothing changed)
    par = tp_kernels.parallelize(model(p), plan(dense))
    replicas = p // kv_heads if kv_heads < p else 1
    assert par.qkv.split_blocks == (p, p // replicas, p // replicas)
    assert par.qkv.weight.shape[0] == (heads // p + 2 * max(kv_heads // p, 1)) * HEAD_DIM
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(s, b, hidden, dtype=torch.float64, generator=g).to(device) for _ in range(3)]
    lr, eps = 0.1, 1e-8
    opts = [torch.optim.Adam(m.parameters(), lr=lr, eps=eps) for m in (dense, par)]
    drift = 0.0  # what Adam makes of the two models' gradient rounding, the largest of each step's
    for step, x in enumerate(xs[:2]):
        _assert_same_backward(dense, par, x)
        for name, sizes, head_size in [("qkv.weight", dense.sizes, HEAD_DIM), ("qkv.bias", dense.sizes, HEAD_DIM),
                                       ("gate_up.weight", [ffn, ffn], None)]:
            got = par.get_parameter(name).grad
            want = _blocks_of_outputs(dense.get_parameter(name).grad, sizes, 0, r, p, head_size)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name} gradient: {m}")
        drift = max(drift, adam_drift(par, dense, eps))
        if step == 0:
            want_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
            torch.testing.assert_close(tp_kernels.clip_grad_norm_(par, 1.0), want_norm, rtol=1e-12, atol=0)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    atol = adam_atol(lr, drift, steps=2)  # (the key bias's gradient is rounding alone)
    full = tp_kernels.full_state_dict(par)
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-10, atol=atol, msg=lambda m: f"{key}: {m}")
    sp = tp_kernels.parallelize(model(p), plan(dense), sequence_parallel=True)
    tp_kernels.load_full_state_dict(sp, full)
    torch.testing.assert_close(sp(block(xs[2], 0, r, p)), block(dense(xs[2]), 0, r, p), rtol=1e-10, atol=1e-10)
    saved = {k: v.clone() for k, v in full.items()}
    _save_with_dcp(par, opts[1], path)
    if r == 0:  # (dcp.save has returned on rank 0, which writes the metadata last)
        _assert_dense_checkpoint(path, dense, opts[0], atol=atol)
    tp_kernels.initialize_model_parallel(max(p // 2, 1))
    try:
        half = max(p // 2, 1)
        narrow = tp_kernels.parallelize(model(half), plan(dense))
        narrow_opt = _load_with_dcp(narrow, path)
        after = tp_kernels.full_state_dict(narrow)
        for key, value in saved.items():
            assert torch.equal(after[key], value), key
        q = tp_kernels.get_tensor_model_parallel_rank()
        for name in ("qkv.weight", "qkv.bias"):  # every rank's copy of a replicated head (the full dict has one)
            assert torch.equal(narrow.get_parameter(name), _blocks_of_outputs(saved[name], dense.sizes, 0, q, half,
                                                                              HEAD_DIM)), name
        _assert_dense_moments(narrow, narrow_opt, dense, opts[0], steps=2)
    finally:
        tp_kernels.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_replicated_kv_heads(world, kv_heads, tmp_path):
    world.run(check_replicated_kv_heads, str(tmp_path), kv_heads)


def check_tied_embedding_stays_tied():
    """An embedding tied to the output layer (one parameter) stays one parameter when the plan
    splits both alike, and two SGD steps match the dense tied model in float64; a plan that would
    split the tie apart (one of them left dense, or split along another dim) is refused before
    anything is replaced. (The replacements held two copies before: after one step, silently two
    different tables.)"""
    r, p = rank_world()
    vocab, hidden, heads, ffn = 4 * p, 6 * p, 2 * p, 4 * p

    def tied_model():
        torch.manual_seed(0)
        model = LanguageModel(vocab, hidden, heads, ffn).double()
        model.head.weight = model.emb.weight
        return model

    dense, par = tied_model(), tp_kernels.parallelize(tied_model(), LM_PLAN)
    assert par.head.weight is par.emb.weight and len(list(par.parameters())) == len(list(dense.parameters()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (dense, par)]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids, tokens = torch.randint(0, vocab, (4, 3), generator=g), torch.randint(0, vocab, (4, 3), generator=g)
        F.cross_entropy(dense(ids).reshape(-1, vocab), tokens.reshape(-1), reduction="sum").backward()
        tp_kernels.vocab_parallel_cross_entropy(par(ids), tokens).sum().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(par.emb.weight, block(dense.emb.weight, 0, r, p), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(par.block.mlp[0].weight, block(dense.block.mlp[0].weight, 0, r, p), rtol=1e-12,
                               atol=1e-12)
    for plan, what in [({"emb": "vocab"}, "'head.weight' (left dense)"),
                       ({"emb": "vocab", "head": "rowwise"}, "'head.weight' (rowwise, split along dim 1)"),
                       ({"emb": "vocab", "head": ("colwise", [2 * p, 2 * p])},
                        f"'head.weight' (colwise of outputs [{2 * p}, {2 * p}], split along dim 0)")]:
        model = tied_model()
        with pytest.raises(ValueError, match="are one parameter \\(tied\\)") as info:
            tp_kernels.parallelize(model, plan)
        assert what in str(info.value), str(info.value)
        assert isinstance(model.emb, nn.Embedding) and model.head.weight is model.emb.weight  # untouched


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_tied_embedding_stays_tied(world):
    world.run(check_tied_embedding_stays_tied)


def check_padded_vocabulary_model(path, vocab_of_p, device="cpu"):
    """A language model whose vocabulary p does not divide, its embedding tied to its output
    layer, parallelized: two Adam steps on the vocabulary-parallel loss (with smoothing) match the
    dense model's, the padding rows staying zero; full_state_dict gives the dense state dict; and
    dcp moves the model and its Adam state to half the ranks (another padding), into a model made
    on the meta device whose memory held NaN, which then takes the dense model's next step."""
    r, p = rank_world()
    vocab, hidden, heads, ffn = {"one_over": p + 1, "odd": 4 * p + 1}[vocab_of_p], 6, 2 * p, 4 * p

    def tied_model(device):
        torch.manual_seed(0)
        model = LanguageModel(vocab, hidden, heads, ffn).double().to(device)
        model.head.weight = model.emb.weight
        return model

    dense = tied_model(device)
    par = tp_kernels.parallelize(tied_model(device), LM_PLAN)
    assert par.head.weight is par.emb.weight and par.emb.weight.shape == (-(-vocab // p), hidden)
    lr, eps = 0.1, 1e-8
    opts = [torch.optim.Adam(m.parameters(), lr=lr, eps=eps) for m in (dense, par)]
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, vocab, (4, 3), generator=g).to(device) for _ in range(2)] for _ in range(3)]

    def step(model, opt, ids, tokens):
        opt.zero_grad()
        if model is dense:
            loss = F.cross_entropy(model(ids).reshape(-1, vocab), tokens.reshape(-1), reduction="sum",
                                   label_smoothing=0.1)
        else:
            loss = tp_kernels.vocab_parallel_cross_entropy(model(ids), tokens, 0.1, vocab_size=vocab).sum()
        loss.backward()
        opt.step()
        return loss.detach()

    drift = 0.0  # what Adam makes of the two models' gradient rounding, the largest of each step's
    for ids, tokens in batches[:2]:
        torch.testing.assert_close(step(par, opts[1], ids, tokens), step(dense, opts[0], ids, tokens),
                                   rtol=1e-10, atol=1e-10)
        drift = max(drift, adam_drift(par, dense, eps))
    atol = adam_atol(lr, drift, steps=2)  # (the key bias's gradient is rounding alone)
    for name in ("emb.weight", "block.mlp.0.weight", "head.weight"):
        torch.testing.assert_close(par.get_parameter(name), padded_block(dense.get_parameter(name), 0, r, p),
                                   rtol=1e-10, atol=atol, msg=lambda m: f"{name}: {m}")
    pad = par.emb.pad_rows
    assert torch.all(par.emb.weight[par.emb.weight.shape[0] - pad:] == 0)  # exactly: never a gradient
    full = tp_kernels.full_state_dict(par)
    assert list(full) == list(dense.state_dict())
    for key, value in dense.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-10, atol=atol, msg=lambda m: f"{key}: {m}")
    saved = {k: v.clone() for k, v in full.items()}
    _save_with_dcp(par, opts[1], path)
    if r == 0:
        _assert_dense_checkpoint(path, dense, opts[0], atol=atol)
    tp_kernels.initialize_model_parallel(max(p // 2, 1))
    try:
        narrow = tp_kernels.parallelize(tied_model("meta"), LM_PLAN).to_empty(device=device)
        narrow.head.weight = narrow.emb.weight  # tied again: to_empty() unties
        with torch.no_grad():
            for q in narrow.parameters():
                q.fill_(float("nan"))
        narrow_opt = _load_with_dcp(narrow, path)
        after = tp_kernels.full_state_dict(narrow)
        for key, value in saved.items():
            assert torch.equal(after[key], value), key
        assert torch.all(narrow.emb.weight[narrow.emb.weight.shape[0] - narrow.emb.pad_rows:] == 0)
        _assert_dense_moments(narrow, narrow_opt, dense, opts[0], steps=2)
        torch.testing.assert_close(step(narrow, narrow_opt, *batches[2]), step(dense, opts[0], *batches[2]),
                                   rtol=1e-10, atol=1e-10)
        atol = adam_atol(lr, max(drift, adam_drift(narrow, dense, eps)), steps=3)
        after = tp_kernels.full_state_dict(narrow)  # the step's update too (a NaN gradient would show here)
        for key, value in dense.state_dict().items():
            torch.testing.assert_close(after[key], value, rtol=1e-10, atol=atol, msg=lambda m: f"{key}: {m}")
    finally:
        tp_kernels.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("vocab_of_p", ["one_over", "odd"])
def test_padded_vocabulary_model(world, vocab_of_p, tmp_path):
    world.run(check_padded_vocabulary_model, str(tmp_path), vocab_of_p)


def check_distributed_checkpoint_across_sizes(path, device="cpu"):
    """torch.distributed.checkpoint with sharded_state_dict (its blocks DTensors, with one rank
    plain tensors): a model parallelized over all the ranks saves, and the same model parallelized
    over half of them loads in place, holding the dense model's weights bit for bit. The plain
    state_dict names every rank's block as one tensor, which dcp saves from one rank only: loading
    it back gives the other ranks that rank's blocks."""
    import torch.distributed.checkpoint as dcp

    r, p = rank_world()
    vocab, hidden, heads, ffn = 4 * p, 6, 2 * p, 4 * p
    torch.manual_seed(0)
    dense = LanguageModel(vocab, hidden, heads, ffn).to(device)
    wide = tp_kernels.parallelize(copy.deepcopy(dense), LM_PLAN)
    state = tp_kernels.sharded_state_dict(wide)
    kinds = {type(v).__name__ for v in state.values()}
    assert kinds == ({"Tensor"} if p == 1 else {"Tensor", "DTensor"}), kinds  # (with one rank, plain tensors)
    dcp.save(state, checkpoint_id=f"{path}/sharded")
    tp_kernels.initialize_model_parallel(max(p // 2, 1))
    try:
        torch.manual_seed(1)  # other weights, replaced by the load
        narrow = tp_kernels.parallelize(LanguageModel(vocab, hidden, heads, ffn).to(device), LM_PLAN)
        dcp.load(tp_kernels.sharded_state_dict(narrow), checkpoint_id=f"{path}/sharded")  # in place
        full = tp_kernels.full_state_dict(narrow)
        for key, value in dense.state_dict().items():
            assert torch.equal(full[key], value), key
    finally:
        tp_kernels.destroy_model_parallel()
    if p > 1:  # why: the plain state dict loses every block but one rank's
        dcp.save(wide.state_dict(), checkpoint_id=f"{path}/plain")
        again = copy.deepcopy(wide)
        state = again.state_dict()
        dcp.load(state, checkpoint_id=f"{path}/plain")
        lost = not all(torch.equal(state[k], v) for k, v in wide.state_dict().items())
        return lost
    return None


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_distributed_checkpoint_across_sizes(world, tmp_path):
    lost = world.run(check_distributed_checkpoint_across_sizes, str(tmp_path))
    assert world.world_size == 1 or any(lost), lost


def _assert_same_sgd_step(dense, par):
    """An SGD step on the dense and the parallel model (their gradients made) leaves the parallel
    one holding the dense weights (float64 closeness)."""
    for model in (dense, par):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    for name, value in tp_kernels.full_state_dict(par).items():
        torch.testing.assert_close(value, dense.state_dict()[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")


def check_hugging_face_llama(device="cpu"):
    """A Hugging Face Llama (transformers' own code, a small config made here, embeddings tied to the
    head, 2 key/value heads) parallelized by its own ``tp_plan`` over 1, 2 and 4 ranks (its style
    names: the head ``"colwise_gather_output"``, so that transformers' loss and generation take
    whole logits, the embedding ``"embedding_rowwise"``); on 4 the key and value projections hold a
    head each, replicated on two ranks: by the plan as it is (its ``"colwise"`` read as whole heads)
    and by tp_kernels' own entry for them (``("colwise", [k], head_size)``). Its
    logits and loss are the dense model's in float64, an SGD step gives the dense weights, and
    greedy generation the dense model's tokens, by SDPA and by the eager attention, a row of the
    batch padded (on 4 ranks the attention's ``num_key_value_groups`` is then each rank's: one
    query head a key/value head). ``device``: where the models and the batch are."""
    for attention in ("sdpa", "eager"):
        _check_hugging_face_llama(attention, device)


def _check_hugging_face_llama(attention, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    r, p = rank_world()
    vocab, d = 30, 4
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation=attention, pad_token_id=0)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(config).double().to(device)
    plan = dict(dense.tp_plan)  # transformers' own, in its style names
    assert plan["model.embed_tokens"] == "embedding_rowwise" and plan["lm_head"] == "colwise_gather_output", plan
    if p > 2 and attention == "eager":  # 2 key/value heads: one each, replicated on two ranks (said so)
        for name in ("k_proj", "v_proj"):
            plan[f"model.layers.*.self_attn.{name}"] = ("colwise", [2 * d], d)
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    assert par.lm_head.weight is par.model.embed_tokens.weight  # still tied
    k_proj = par.model.layers[0].self_attn.k_proj
    assert (k_proj.split_blocks, k_proj.head_size) == (((2,), d) if p > 2 else ((p,), None))
    assert par.model.layers[0].self_attn.num_key_value_groups == (2 if p < 4 else 1)
    ids = torch.randint(1, vocab, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # (padding: SDPA then repeats the keys itself)
    assert_same_loss_and_backward(dense, par, ids, attention_mask=mask)
    _assert_same_sgd_step(dense, par)
    with torch.no_grad():
        tokens = [model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False) for model in (dense, par)]
    assert torch.equal(tokens[0], tokens[1]), tokens


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_hugging_face_llama(world):
    world.run(check_hugging_face_llama)


def check_hugging_face_heads_that_cannot_be_split_whole():
    """A transformers attention whose heads the ranks cannot each hold whole (6 query heads on 4
    ranks; 3 key/value heads of 6 query heads on 4 ranks): its plan's ``"colwise"`` is a
    ``ValueError`` naming the projection and the heads, before anything is replaced (not a shape
    error in its first forward); with 2 key/value heads of 6, those are replicated and the query
    heads' split is the error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for queries, kv, named in ((6, 6, "q_proj"), (12, 3, "k_proj")):
        config = LlamaConfig(vocab_size=32, hidden_size=4 * queries, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=queries, num_key_value_heads=kv, max_position_embeddings=16)
        dense = LlamaForCausalLM(config)
        kind = "query" if named == "q_proj" else "key/value"
        with pytest.raises(ValueError, match=rf"'model.layers.0.self_attn.{named}' \('colwise'\) holds "
                                             rf"{queries if named == 'q_proj' else kv} {kind} heads of head_dim 4"):
            tp_kernels.parallelize(dense, dense.tp_plan)
        assert type(dense.model.layers[0].self_attn.q_proj) is nn.Linear  # nothing replaced


def test_hugging_face_heads_that_cannot_be_split_whole(world4):
    pytest.importorskip("transformers")
    world4.run(check_hugging_face_heads_that_cannot_be_split_whole)


def check_hugging_face_llama_sequence_parallel():
    """A transformers Llama (its own code; embeddings tied to the head, an attention mask, 2
    key/value heads) under sequence parallelism, by :func:`tp_kernels.sequence_parallel_plan` of
    its own ``tp_plan``; on 4 ranks its key and value projections hold a head each, replicated on
    two ranks (its ``ColwiseParallel`` read as whole heads), inside the gathered attention. The decoder layers run on
    each rank's block of the sequence, and the logits, the loss, every gradient and an SGD step are
    the dense model's in float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    r, p = rank_world()
    config = LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(config).double()
    plan = tp_kernels.sequence_parallel_plan(dense)
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    assert par.model.layers[0].self_attn.v_proj.split_blocks == ((2,) if p > 2 else (p,))  # (2 key/value heads)
    assert par.lm_head.weight is par.model.embed_tokens.weight  # still tied
    seen = []
    par.model.layers[1].input_layernorm.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    ids = torch.randint(1, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_backward(dense, par, ids, attention_mask=torch.ones_like(ids))
    assert seen == [(2, 8 // p, 16)], seen  # each rank's block of the sequence
    assert_dense_grads(par, dense, 1e-12)
    _assert_same_sgd_step(dense, par)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_hugging_face_llama_sequence_parallel(world):
    pytest.importorskip("transformers")
    world.run(check_hugging_face_llama_sequence_parallel)


def check_hugging_face_qwen3_sequence_parallel():
    """Qwen 3 under sequence parallelism by :func:`tp_kernels.sequence_parallel_plan`, its per-head
    ``q_norm`` and ``k_norm`` (inside the gathered attention, on each rank's heads) by its
    ``tp_plan``'s own style for them, ``"replicated_with_grad_allreduce"``, kept beside torch's
    styles: the logits, the loss and every gradient are the dense model's in float64."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(config).double()
    plan = tp_kernels.sequence_parallel_plan(dense)
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce", plan
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_backward(dense, par, ids)
    assert_dense_grads(par, dense, 1e-12)


def test_hugging_face_qwen3_sequence_parallel(world2):
    pytest.importorskip("transformers")
    world2.run(check_hugging_face_qwen3_sequence_parallel)


class DroppingMLP(nn.Module):
    """A column layer, dropout on its hidden units, the row layer, dropout on its output (whole on
    every rank once the row layer sums it)."""

    def __init__(self, dim, hidden, drop):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.inner, self.outer = nn.Dropout(drop), nn.Dropout(drop)

    def forward(self, x):
        return self.outer(self.down(self.inner(self.up(x).exp())))  # (exp: no zero but the mask's)


class _NamedDropMLP(nn.Module):
    """:class:`DroppingMLP`'s dropout of the hidden units as a float attribute named for it
    (``attn_pdrop``, as GPT-BigCode's and DBRX's modules keep theirs) that its forward passes to
    ``F.dropout``, with no dropout module."""

    def __init__(self, dim, hidden, drop):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.attn_pdrop = drop

    def forward(self, x):
        return self.down(F.dropout(self.up(x).exp(), self.attn_pdrop, self.training))


def gathered(t: torch.Tensor) -> list:
    views = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(views, t.contiguous())
    return views


def _dropout_run(par, x, dy, call=None):
    """``call`` (``par`` itself by default) on a copy of ``x``, the default stream seeded alike,
    then its backward of ``dy``: the output, the input's gradient and every parameter's."""
    par.zero_grad()
    xr = x.clone().requires_grad_()
    torch.manual_seed(5)
    y = (call or par)(xr)
    y.backward(dy)
    return y.detach(), xr.grad, [q.grad.clone() for q in par.parameters() if q.grad is not None]


def _assert_checkpoints_replay(par, x, dy, plain) -> None:
    """torch's checkpoint of ``par`` (reentrant or not) gives bit for bit the ``plain`` run of
    :func:`_dropout_run`, and the default stream goes on alike on every rank afterwards."""
    for reentrant in (False, True):
        again = _dropout_run(par, x, dy, lambda t: torch.utils.checkpoint.checkpoint(par, t, use_reentrant=reentrant))
        assert all(torch.equal(a, b) for a, b in zip((again[0], again[1], *again[2]),
                                                     (plain[0], plain[1], *plain[2]))), reentrant
    after = torch.rand(8)
    assert all(torch.equal(v, after) for v in gathered(after)), "the default stream went on otherwise on some rank"


def _assert_dense_run(plain, ref, x64, dy, up, down) -> None:
    """The ``plain`` run of :func:`_dropout_run` is the dense ``ref`` (of ``x64``, with the masks the
    ranks drew; backward of ``dy``): its output, its input's gradient and the gradients of the
    column layer ``up`` and the row layer ``down``, this rank's blocks of the dense ones."""
    r, p = rank_world()
    ref.backward(dy)
    y, dx, grads = plain
    assert_close("output", y, ref)
    assert_close("input gradient", dx, x64.grad)
    assert_close("up.weight gradient", grads[0], block(up.weight.grad, 0, r, p))
    assert_close("down.weight gradient", grads[1], block(down.weight.grad, 1, r, p))


def check_dropout_per_rank():
    """In training mode a parallelized module draws the dropout between its column and its row
    layer from each rank's own stream (each rank's hidden units get their own mask, not another
    rank's), and the dropout of the row layer's output from the default stream, alike on every rank
    (the output the same everywhere); the model is the dense one with the masks so drawn (float64),
    torch's checkpoint (reentrant or not) recomputes those masks (its gradients bit for bit the plain
    run's), and the default stream goes on alike on every rank. In eval mode, or with every dropout
    0, nothing is drawn. A dropout kept as a float attribute named for it (``attn_pdrop``) is found
    too."""
    r, p = rank_world()
    rows, dim, hidden, drop = 16, 4, 8, 0.5
    torch.manual_seed(0)
    dense = DroppingMLP(dim, hidden, drop).double()
    par = tp_kernels.parallelize(copy.deepcopy(dense), {"up": "colwise", "down": "rowwise"}).train()
    masks = {}
    for name in ("inner", "outer"):
        getattr(par, name).register_forward_hook(lambda m, args, out, name=name: masks.__setitem__(name, out != 0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    dy = torch.randn(rows, dim, generator=g, dtype=torch.float64)

    y, dx, grads = _dropout_run(par, x, dy)
    inner = gathered(masks["inner"])
    assert all(not torch.equal(inner[q], inner[r]) for q in range(p) if q != r), "a rank's hidden units dropped alike"
    assert all(torch.equal(v, masks["outer"]) for v in gathered(masks["outer"]))
    assert all(torch.equal(v, y) for v in gathered(y)), "the row layer's output differs between ranks"
    x64 = x.clone().requires_grad_()
    ref = dense.down(dense.up(x64).exp() * torch.cat(inner, 1) / (1 - drop)) * masks["outer"] / (1 - drop)
    _assert_dense_run((y, dx, grads), ref, x64, dy, dense.up, dense.down)
    _assert_checkpoints_replay(par, x, dy, (y, dx, grads))
    state = torch.get_rng_state()
    with torch.no_grad():
        par.eval()(x)
        par.train()
        par.inner.p = par.outer.p = 0.0
        par(x)
    assert torch.equal(torch.get_rng_state(), state), "drew where nothing drops"
    torch.manual_seed(0)
    quiet = tp_kernels.parallelize(DroppingMLP(dim, hidden, 0.0).double(), {"up": "colwise", "down": "rowwise"})
    assert not quiet._forward_pre_hooks and not quiet._forward_hooks  # (no dropout above 0: nothing hooked)
    # a dropout probability kept as a float attribute named for it ("pdrop") draws each rank's own mask too
    torch.manual_seed(0)
    named = tp_kernels.parallelize(_NamedDropMLP(dim, hidden, drop).double(), {"up": "colwise", "down": "rowwise"})
    named.down.register_forward_pre_hook(lambda m, args: masks.__setitem__("named", args[0] != 0))
    torch.manual_seed(5)
    named.train()(x)
    views = gathered(masks["named"])
    assert all(not torch.equal(views[q], views[r]) for q in range(p) if q != r), "hidden units dropped alike (pdrop)"


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_dropout_per_rank(world):
    world.run(check_dropout_per_rank)


class _Mix(nn.Module):
    """A column layer, dropout on its hidden units, the row layer, dropout on its output (for the
    residual: Seed-OSS's attention and MLP)."""

    def __init__(self, dim, hidden, drop):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.inner, self.after = nn.Dropout(drop), nn.Dropout(drop)

    def forward(self, x):
        return self.after(self.down(self.inner(self.up(x).exp())))


class _Jitter(nn.Module):
    """Noise on every token alike, as a router's jitter (Mixtral's) scales the tokens it routes."""

    def forward(self, x):
        return x * (1 + 0.1 * torch.rand_like(x))


class _SequenceLayer(nn.Module):
    """A decoder layer's shape, batch-first: its mixing module (:class:`_Mix`) on the residual,
    then the jitter of the sum."""

    def __init__(self, dim, hidden, drop):
        super().__init__()
        self.mix, self.jitter = _Mix(dim, hidden, drop), _Jitter()

    def forward(self, x):
        return self.jitter(x + self.mix(x))


class _DropsItsBlock(nn.Module):
    """A decoder layer's shape as Phi-3's: its mixing module (:class:`_Mix`, without dropout) on
    the residual, its output dropped by the layer's own dropout module."""

    def __init__(self, dim, hidden, drop):
        super().__init__()
        self.mix, self.resid = _Mix(dim, hidden, 0.0), nn.Dropout(drop)

    def forward(self, x):
        return x + self.resid(self.mix(x))


class _Stack(nn.Module):
    """One layer (``layer_class(*args)``), for a plan to name; with ``head``, a linear layer of its
    own beside it (as a language model's head, a plan's column layer), which its forward leaves out."""

    def __init__(self, layer_class, *args, head=False):
        super().__init__()
        self.layer = layer_class(*args)
        if head:
            self.head = nn.Linear(args[0], args[0], bias=False)

    def forward(self, x):
        return self.layer(x)


def check_sequence_dropout_per_rank():
    """A layer under a torch style's sequence parallelism (the layer on each rank's block of the
    sequence, its mixing module and the jitter on the sequence gathered, the row layer
    reduce-scattering), in training mode: the dropout of the mixing module's output, on the block,
    draws each rank's own mask, as the hidden units' dropout does, while the jitter on the gathered
    tokens draws the same noise on every rank (the default stream); the layer is the dense one with
    the masks and the noise so drawn (float64), torch's checkpoint (reentrant or not) recomputes
    them, bit for bit, and the default stream goes on alike on every rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel)

    r, p = rank_world()
    b, s, dim, hidden, drop = 2, 4 * p, 4, 8, 0.5
    torch.manual_seed(0)
    dense = _Stack(_SequenceLayer, dim, hidden, drop).double()
    plan = {"layer": PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                              output_layouts=Shard(1), desired_output_layouts=Replicate()),
            "layer.mix": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "layer.mix.up": ColwiseParallel(), "layer.mix.down": RowwiseParallel(output_layouts=Shard(1)),
            "layer.jitter": PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                     output_layouts=Replicate(), desired_output_layouts=Shard(1))}
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan).train()
    drawn = {}
    layer = par.layer
    layer.mix.inner.register_forward_hook(lambda m, args, out: drawn.__setitem__("inner", out != 0))
    layer.mix.after.register_forward_hook(lambda m, args, out: drawn.__setitem__("residual", out != 0))
    layer.jitter.register_forward_hook(lambda m, args, out: drawn.__setitem__("jitter", (out / args[0]).detach()),
                                       prepend=True)  # (before its output is split again)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, dim, generator=g, dtype=torch.float64)
    dy = torch.randn(b, s, dim, generator=g, dtype=torch.float64)

    y, dx, grads = _dropout_run(par, x, dy)
    for name in ("inner", "residual"):  # (each rank's own: its hidden units, its block of the sequence)
        views = gathered(drawn[name])
        assert all(not torch.equal(views[q], views[r]) for q in range(p) if q != r), name
    assert all(torch.equal(v, drawn["jitter"]) for v in gathered(drawn["jitter"])), "the gathered tokens' noise"
    x64 = x.clone().requires_grad_()
    mix = dense.layer.mix
    mixed = mix.down(mix.up(x64).exp() * torch.cat(gathered(drawn["inner"]), -1) / (1 - drop))
    ref = (x64 + mixed * torch.cat(gathered(drawn["residual"]), 1) / (1 - drop)) * drawn["jitter"]  # (blocks joined)
    _assert_dense_run((y, dx, grads), ref, x64, dy, mix.up, mix.down)
    _assert_checkpoints_replay(par, x, dy, (y, dx, grads))


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_sequence_dropout_per_rank(world):
    world.run(check_sequence_dropout_per_rank)


def check_layer_dropout_on_its_block():
    """A layer under a torch style's sequence parallelism that drops, by a dropout module of its
    own, its mixing module's output, which the plan computes whole on every rank and splits along
    the sequence (Phi-3's residual dropout under its sequence-parallel plan), in training mode: each
    rank draws its block's mask from its own stream; the layer is the dense one with the masks so
    drawn (float64), torch's checkpoint (reentrant or not) recomputes them bit for bit, and the
    default stream goes on alike on every rank (the model holding a column layer of its own, a
    head). Without sequence parallelism the same dropout, on the whole output, draws alike on every
    rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

    r, p = rank_world()
    b, s, dim, hidden, drop = 2, 4 * p, 4, 8, 0.5
    torch.manual_seed(0)
    dense = _Stack(_DropsItsBlock, dim, hidden, drop, head=True).double()
    tensor_plan = {"layer.mix.up": ColwiseParallel(), "layer.mix.down": RowwiseParallel(), "head": ColwiseParallel()}
    plan = {"layer": PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                              output_layouts=Shard(1), desired_output_layouts=Replicate()),
            "layer.mix": PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                  output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            **tensor_plan}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, dim, generator=g, dtype=torch.float64)
    dy = torch.randn(b, s, dim, generator=g, dtype=torch.float64)
    drawn = {}
    for name, model_plan in (("block", plan), ("whole", tensor_plan)):
        par = tp_kernels.parallelize(copy.deepcopy(dense), model_plan).train()
        par.layer.resid.register_forward_hook(lambda m, args, out, name=name: drawn.__setitem__(name, out != 0))
        plain = _dropout_run(par, x, dy)
        if name == "whole":
            assert all(torch.equal(v, drawn[name]) for v in gathered(drawn[name])), "the whole output's mask"
            continue
        views = gathered(drawn[name])
        assert all(not torch.equal(views[q], views[r]) for q in range(p) if q != r), "the blocks' masks"
        x64 = x.clone().requires_grad_()
        mix = dense.layer.mix
        ref = x64 + mix(x64) * torch.cat(views, 1) / (1 - drop)  # (the blocks' masks joined)
        _assert_dense_run(plain, ref, x64, dy, mix.up, mix.down)
        _assert_checkpoints_replay(par, x, dy, plain)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_layer_dropout_on_its_block(world):
    world.run(check_layer_dropout_on_its_block)


def check_hugging_face_gradient_checkpointing(kind, sequence):
    """A transformers Llama (or Seed-OSS, whose attention and MLP drop their output on the residual
    after their row layer, or Phi-3, whose decoder layer drops it with its own dropout modules, and
    whose plan gathers its projections' outputs whole) parallelized by its own plan (or under
    sequence parallelism), in training mode, with its gradient checkpointing (torch's checkpoint,
    reentrant or not): without dropout its logits and every gradient are the dense model's
    (float64); with its dropout at 0.5 (eager attention) each rank drops its heads with its own
    masks, and the residual (Seed-OSS's, Phi-3's) alike on every rank where it is whole, each rank
    its own where it is the rank's block of the sequence, the logits are alike on every rank, and
    the checkpointed run's logits and gradients are bit for bit the plain run's."""
    import importlib

    import transformers

    r, p = rank_world()
    ids = torch.randint(1, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    for drop in (0.0, 0.5):
        sizes = dict(vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=64, attention_dropout=drop,
                     attn_implementation="eager")
        if kind == "llama":
            config, model_class = transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM
        elif kind == "seed_oss":
            config = transformers.SeedOssConfig(**sizes, head_dim=4, residual_dropout=drop)
            model_class = transformers.SeedOssForCausalLM
        else:
            config = transformers.Phi3Config(**sizes, resid_pdrop=drop, pad_token_id=0)
            model_class = transformers.Phi3ForCausalLM
        torch.manual_seed(0)
        dense = model_class(config).double().train()
        plan = tp_kernels.sequence_parallel_plan(dense) if sequence else dense.tp_plan
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan).train()
        runs = []
        for checkpointing in (None, False, True):
            if checkpointing is not None:
                for model in (dense, par):
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
            dense.zero_grad()
            par.zero_grad()
            drawn = []
            dropout = module.nn.functional.dropout

            def recording(t, *args, **kwargs):  # (the stream each draws from: the CPU generator's state, its shape)
                drawn.append((torch.get_rng_state(), t.dim()))
                return dropout(t, *args, **kwargs)

            torch.manual_seed(5)
            module.nn.functional.dropout = recording
            try:
                got = par(ids, use_cache=False).logits
            finally:
                module.nn.functional.dropout = dropout
            got.square().sum().backward()
            runs.append((got.detach(), [q.grad.clone() for q in par.parameters()]))
            if drop == 0.0:
                want = dense(ids, use_cache=False).logits
                want.square().sum().backward()
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
                assert_dense_grads(par, dense, 1e-12)
                continue
            assert all(torch.equal(v, got) for v in gathered(got)), "the logits differ between ranks"
            assert len(drawn) == 2 * (1 if kind == "llama" else 3)  # (each layer's attention weights; residuals)
            if checkpointing is None and p > 1:
                for state, dims in drawn:  # (the attention weights [b, heads / p, s, s]; a residual [b, s(/p), h])
                    views = gathered(state)
                    # (Phi-3's plan computes its attention whole on every rank; its decoder layer drops its
                    # attention's and MLP's outputs itself, under sequence parallelism each rank's block)
                    own = (dims == 4 and kind != "phi3") or (dims == 3 and sequence)
                    assert all(torch.equal(views[q], views[r]) != own for q in range(p) if q != r), dims
        if drop:
            plain = (runs[0][0], *runs[0][1])
            assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip((run[0], *run[1]), plain))


@pytest.mark.parametrize("kind", ["llama", "seed_oss", "phi3"])
@pytest.mark.parametrize("sequence", [False, True], ids=["tensor", "sequence"])
def test_hugging_face_gradient_checkpointing(world2, kind, sequence):
    transformers = pytest.importorskip("transformers")
    if kind == "seed_oss" and getattr(transformers, "SeedOssConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no SeedOssConfig")
    world2.run(check_hugging_face_gradient_checkpointing, kind, sequence)


def check_sequence_parallel_plans(kind):
    """transformers' Gemma 3 (four norms a layer, a scaled embedding, per-head norms, sliding
    windows), Gemma 4's dense model (its plan's entries for its mixtures' experts naming nothing:
    left out) and its mixture (an MLP and experts beside it in the decoder layer itself, its
    router run on each rank's block of the tokens, its gradients summed, the experts gathering
    the tokens, ``("moe_tp_experts", "sequence")``), Mistral, Qwen 2, Phi 3 and OLMo 2 (their projections' outputs gathered whole,
    ``"colwise_rep"`` and ``"rowwise_rep"``: their modules' outputs whole, then split) under sequence
    parallelism by :func:`tp_kernels.sequence_parallel_plan`
    of their own ``tp_plan``: the decoder layers see each rank's block of the sequence, and the
    logits, the loss and every gradient are the dense model's in float64 (Gemma 3's norms, computed
    in float32, to float32's precision of their size)."""
    import transformers

    _, p = rank_world()
    config, model_class = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "mistral": ("MistralConfig",
                           "MistralForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                           "phi3": ("Phi3Config", "Phi3ForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
                           "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
                           "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM")}[kind]
    # (Gemma 4's dense model: its plan's entries for the experts of its mixtures name nothing here, and are left out;
    # no per-layer embedding)
    gemma4 = {"sliding_window": 4, "hidden_size_per_layer_input": 0, "layer_types": ["sliding_attention", "full_attention"]}
    extra = {"gemma3": {"sliding_window": 4}, "gemma4": gemma4,
             "gemma4_moe": {**gemma4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                            "moe_intermediate_size": 8, "experts_implementation": "eager"}}
    config = getattr(transformers, config)(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, max_position_embeddings=64, attn_implementation="sdpa", pad_token_id=0,
        **extra.get(kind, {}))
    torch.manual_seed(0)
    dense = getattr(transformers, model_class)(config).double()
    par = tp_kernels.parallelize(copy.deepcopy(dense), tp_kernels.sequence_parallel_plan(dense))
    seen = []
    par.model.layers[1].register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_backward(dense, par, ids)
    assert seen == [(2, 8 // p, 16)], seen  # each rank's block of the sequence
    assert_dense_grads(par, dense, 8 * torch.finfo(torch.float32).eps if kind.startswith("gemma") else 1e-12)


@pytest.mark.parametrize("kind", ["gemma3", "gemma4", "gemma4_moe", "mistral", "qwen2", "phi3", "olmo2"])
def test_sequence_parallel_plans(world2, kind):
    transformers = pytest.importorskip("transformers")
    if kind.startswith("gemma4") and getattr(transformers, "Gemma4TextConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma4TextConfig")
    world2.run(check_sequence_parallel_plans, kind)


def check_moe_sequence_parallel_plan(kind, parallelism, device="cpu"):
    """transformers' mixtures of experts under sequence parallelism by
    :func:`tp_kernels.sequence_parallel_plan` of their own plans (``"ep"``: ``{**tp_plan,
    **ep_plan}``, whole experts a rank; ``"tp_shared"``: the tp_plan with Qwen 2 MoE's shared
    expert split as Qwen 3 Next's plan splits its), the experts' module gathered and its output,
    the experts' partial sums, reduce-scattered once (Qwen 2 MoE's, its shared expert whole on
    every rank, summed and split; split, its row layer's term of the sum left partial and its gate's
    output gradient summed, as Qwen 3 Next's); Qwen 3 and Qwen 2 MoE's first layer a dense MLP
    under the same name, its row layer reduce-scattering: the decoder layers see each rank's block
    of the sequence, the forward moves each layer's activations by one gather and one
    reduce-scatter a module (but Qwen 2 MoE's experts' sum), the backward by as many (the experts'
    input gradients left for the module's reduce-scatter) and a gather again where a module's column
    layers took its gather, and the logits, the loss and every
    gradient are the dense model's in float64 (the routers' softmax in float32: to float32's
    precision)."""

    from test_experts import _moe_model, _plan
    from tp_kernels import _collectives as coll

    _, p = rank_world()
    dense = _moe_model(kind).to(device)
    plan = _qwen2_moe_split_shared_expert_plan(dense) if parallelism == "tp_shared" else _plan(dense, parallelism)
    sequence_plan = tp_kernels.sequence_parallel_plan(dense, plan)
    gated = kind == "qwen3_next" or parallelism == "tp_shared"  # (the shared expert's gate, its output's gradient summed)
    assert sequence_plan.get("model.layers.*.mlp.shared_expert_gate") == \
        ("replicated_with_output_grad_allreduce" if gated else None), sequence_plan
    par = tp_kernels.parallelize(copy.deepcopy(dense), sequence_plan,
                                 # (its plan names both of DeepSeek-V2's query paths, and Qwen 3 Next's a dense MLP
                                 # beside the mixture, which none of these layers is)
                                 strict=kind not in ("deepseek_v2", "qwen3_next"))
    seen = []
    par.model.layers[1].register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    assert_same_loss_and_backward(dense, par, ids)
    assert seen == [(2, 8 // p, 16)], seen
    assert_dense_grads(par, dense, 1e-12 if kind == "qwen3_moe" else 4 * torch.finfo(torch.float32).eps)

    if device != "cpu":  # (on a GPU the native paths issue their own collectives, which these counts miss)
        return
    moved, inside = [], []  # the collectives of whole activations, [b, s, h] (on the CPU a reduce-scatter is an
    # all-reduce inside: the outer call counts), and of each rank's block of them

    def counted(name, collective):
        def call(x, *args, **kwargs):
            if x.numel() * (p if name == "AG" else 1) == ids.numel() * 16 and not inside:
                moved.append(name)
            inside.append(name)
            try:
                return collective(x, *args, **kwargs)
            finally:
                inside.pop()
        return call

    with mock.patch.object(coll, "all_reduce", counted("AR", coll.all_reduce)), \
            mock.patch.object(coll, "reduce_scatter_dim0", counted("RS", coll.reduce_scatter_dim0)), \
            mock.patch.object(coll, "all_gather_dim0", counted("AG", coll.all_gather_dim0)):
        loss = par(ids).logits.square().sum()
        # the embedding's sum (where the model's plan splits it: transformers 5.17's do not), each layer's
        # attention and MLP or mixture, the head's gather: a module moved
        # by a gather and a reduce-scatter (DeepSeek's mixtures too, their shared experts' row layer leaving
        # its term of the sum); Qwen 2 MoE's mixture (its shared expert whole) summed whole, and split;
        # DeepSeek-V3's attention (whole) gathered, split
        # Qwen 3 Next's first layer's linear attention (its projections' outputs gathered whole: the last, of the
        # hidden size, counted) gathered, split
        pair = ["AG", "RS"]
        attention = ["AG"] if kind == "deepseek_v3" else pair
        mixture = ["AG", "AR"] if kind == "qwen2_moe" and parallelism != "tp_shared" else pair
        first = ["AG", "AG"] if kind == "qwen3_next" else attention
        embedding = ["AR"] if "model.embed_tokens" in plan else []
        assert moved == [*embedding, *first, *pair, *attention, *mixture, "AG"], moved
        moved.clear()
        loss.backward()  # the gathers' gradients reduce-scattered (the experts' too), no sum of a whole one;
        # the input of a module whose column layers took its gather (one all_gather_matmul of their weights)
        # gathered again for their weights' gradients: Mixtral's attentions, Qwen's and their first layer's
        # MLP, DeepSeek's first layer's MLP (V2's attention one column layer, V3's whole), Qwen 3 Next's
        # attention (its linear attention's projections gather their outputs; a mixture's input is read whole
        # by its router first)
    again = {"mixtral": 2, "qwen3_next": 1, "deepseek_v2": 1, "deepseek_v3": 1}.get(kind, 3)
    assert "AR" not in moved and sorted(moved) == \
        ["AG"] * (6 + again) + ["RS"] * (3 if kind.startswith("deepseek") else 5), moved


@pytest.mark.parametrize("kind, parallelism", [("mixtral", "tp"), ("qwen3_moe", "tp"), ("qwen3_moe", "ep"),
                                               ("qwen2_moe", "tp"), ("qwen2_moe", "tp_shared"), ("qwen3_next", "tp"),
                                               ("deepseek_v2", "tp"), ("deepseek_v3", "tp"), ("deepseek_v3", "ep"),
                                               ("deepseek_v3", "ep_router")])
def test_moe_sequence_parallel_plan(world2, kind, parallelism):
    pytest.importorskip("transformers")
    if kind == "qwen2_moe":
        skip_unless_own_plan("Qwen2MoeConfig", "layers.*.mlp.experts", "moe_tp_experts")
    if kind == "qwen3_next":
        skip_unless_own_plan("Qwen3NextConfig", "layers.*.mlp.shared_expert.down_proj", "rowwise")
    world2.run(check_moe_sequence_parallel_plan, kind, parallelism)


def _qwen2_moe_split_shared_expert_plan(dense) -> dict:
    """Qwen 2 MoE's tp_plan with its shared expert split as Qwen 3 Next's plan splits its."""
    from test_experts import _plan

    plan = _plan(dense, "tp")
    plan.update({f"model.layers.*.mlp.shared_expert.{name}": style for name, style in
                 (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))})
    return plan


def _assert_moe_runs_as_dense(dense, plan) -> None:
    """A mixture of experts ``dense`` parallelized by ``plan``: on a batch, the logits, the loss and
    every gradient are the dense model's in float64 (its router's softmax in float32: to float32's
    precision)."""
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_backward(dense, par, ids)
    assert_dense_grads(par, dense, 4 * torch.finfo(torch.float32).eps)


def check_moe_row_layer_in_mixture_and_dense_layer():
    """Qwen 2 MoE whose plan names its dense first layer's row layer and its mixture's shared
    expert's by one entry (``mlp.*down_proj``): that row layer cannot leave its term of a partial
    sum in one layer and reduce-scatter in the other, so both modules sum their outputs whole (then
    split), and the logits, the loss and every gradient are the dense model's in float64."""
    from test_experts import _moe_model
    from torch.distributed.tensor import Replicate

    _, p = rank_world()
    dense = _moe_model("qwen2_moe")
    plan = _qwen2_moe_split_shared_expert_plan(dense)
    for relative in ("down_proj", "shared_expert.down_proj"):
        del plan[f"model.layers.*.mlp.{relative}"]
    plan["model.layers.*.mlp.*down_proj"] = "rowwise"
    sequence_plan = tp_kernels.sequence_parallel_plan(dense, plan)
    assert sequence_plan["model.layers.*.mlp"].prepare_module_output.output_layouts == (Replicate(),), sequence_plan
    assert sequence_plan["model.layers.*.mlp.experts"] == "moe_tp_experts", sequence_plan  # (not partial)
    _assert_moe_runs_as_dense(dense, sequence_plan)


def test_moe_row_layer_in_mixture_and_dense_layer(world2):
    skip_unless_own_plan("Qwen2MoeConfig", "layers.*.mlp.experts", "moe_tp_experts")
    world2.run(check_moe_row_layer_in_mixture_and_dense_layer)


#: what makes a mixture of experts one the sequence plan cannot tell from one that adds to its output what
#: every rank computes alike (then summed whole, then split, not reduce-scattered as partial sums), and the
#: model it is made in (Qwen 2 MoE's plan with its shared expert split: a gated term of the partial sum)
UNTOLD_MIXTURES = {
    "router_with_another_parameter": "qwen3_moe",  # (the router holds a [hidden] parameter beside its [E, hidden])
    "gate_of_two_outputs": "qwen2_moe",  # (the shared expert's gate of two outputs: no scale a token)
    "gate_beside_no_row_layer": "qwen2_moe",  # (a gate of one output beside a module holding no row layer)
    "router_inside_the_shared_expert": "qwen2_moe",  # (an [E, hidden] weight, not of a child of the mixture)
    "router_weight_beside_planned_layers": "qwen2_moe",  # (the shared expert's own [E, hidden] parameter)
    "expert_scales_alone": "qwen3_moe",  # (a child holding an [E] parameter, but no [E, hidden] weight)
    "shared_experts_outputs_whole": "deepseek_v3",  # (its shared experts' layers gather their outputs whole)
}


@pytest.mark.parametrize("layout", list(UNTOLD_MIXTURES))
def test_sequence_plan_sums_a_mixture_it_cannot_tell_apart(layout):
    """A mixture of experts holding a module the sequence plan cannot tell is a router (a child of
    the mixture holding an ``[E, hidden]`` weight and ``[E]`` parameters alone) or a shared expert's
    gate (an ``nn.Linear`` of one output beside a module holding a row layer of the plan), or whose
    plan leaves a layer's output whole: it might add to the mixture's output what every rank
    computes alike, which a reduce-scatter of partial sums would count p times, so the mixture's
    output is summed whole, then split, and the module gets no gate's entry. (The plan alone: such
    modules are no model's.)"""
    pytest.importorskip("transformers")
    from test_experts import _moe_model, _plan
    from torch.distributed.tensor import Replicate

    kind = UNTOLD_MIXTURES[layout]
    if kind == "qwen2_moe":
        skip_unless_own_plan("Qwen2MoeConfig", "layers.*.mlp.experts", "moe_tp_experts")
    dense = _moe_model(kind)
    plan = _qwen2_moe_split_shared_expert_plan(dense) if kind == "qwen2_moe" else _plan(dense, "tp")
    assert tp_kernels.sequence_parallel_plan(dense, plan)["model.layers.*.mlp.experts"] == \
        ("moe_tp_experts", "partial")  # (as it comes)
    mixture = dense.model.layers[1].mlp
    if layout == "router_with_another_parameter":
        mixture.gate.register_parameter("scale", nn.Parameter(torch.ones(16, dtype=torch.float64)))
    elif layout == "gate_of_two_outputs":
        mixture.shared_expert_gate = nn.Linear(16, 2, bias=False).double()
    elif layout == "gate_beside_no_row_layer":
        mixture.extra, mixture.extra_gate = nn.Identity(), nn.Linear(16, 1, bias=False).double()
    elif layout == "router_inside_the_shared_expert":
        mixture.shared_expert.router = nn.Linear(16, 4, bias=False).double()
    elif layout == "router_weight_beside_planned_layers":
        mixture.shared_expert.register_parameter("scores", nn.Parameter(torch.ones(4, 16, dtype=torch.float64)))
    elif layout == "expert_scales_alone":
        mixture.scales = nn.Module()
        mixture.scales.register_parameter("weight", nn.Parameter(torch.ones(4, dtype=torch.float64)))
    else:
        plan.update({f"model.layers.*.mlp.shared_experts.{name}": style for name, style in (
            ("gate_proj", "colwise_gather_output"), ("up_proj", "colwise_gather_output"),
            ("down_proj", "rowwise_split_input"))})
    sequence_plan = tp_kernels.sequence_parallel_plan(dense, plan)
    assert sequence_plan["model.layers.1.mlp"].prepare_module_output.output_layouts == (Replicate(),), sequence_plan
    assert sequence_plan["model.layers.*.mlp.experts"] == "moe_tp_experts", sequence_plan
    assert not any(name.endswith("_gate") for name in sequence_plan), sequence_plan


def check_moe_packed_shared_expert_sequence_plan():
    """Qwen 2 MoE whose shared expert keeps its gate's and its up projection's rows in one layer
    (Phi 3's MLP: ``gate_up_proj`` ``"packed_colwise"``, ``down_proj`` ``"rowwise"``) under
    :func:`tp_kernels.sequence_parallel_plan`: a term of the mixture's sum each rank computes its
    share of, as the split shared expert's, so the experts' and its outputs are left partial, the
    module's reduce-scattered once, and its gate's output gradient summed; the logits, the loss and
    every gradient are the dense model's in float64 (the router's softmax in float32)."""
    import transformers
    from test_experts import _moe_model
    from torch.distributed.tensor import Partial

    dense = _moe_model("qwen2_moe")
    torch.manual_seed(2)
    dense.model.layers[1].mlp.shared_expert = transformers.models.phi3.modeling_phi3.Phi3MLP(
        transformers.Phi3Config(hidden_size=16, intermediate_size=12)).double()
    plan = {k: v for k, v in _qwen2_moe_split_shared_expert_plan(dense).items()
            if not k.endswith(("shared_expert.gate_proj", "shared_expert.up_proj"))}
    plan["model.layers.*.mlp.shared_expert.gate_up_proj"] = "packed_colwise"
    sequence_plan = tp_kernels.sequence_parallel_plan(dense, plan)
    assert sequence_plan["model.layers.*.mlp.experts"] == ("moe_tp_experts", "partial"), sequence_plan
    assert sequence_plan["model.layers.1.mlp"].prepare_module_output.output_layouts == (Partial(),), sequence_plan
    assert sequence_plan["model.layers.*.mlp.shared_expert.down_proj"].output_layouts == (Partial(),), sequence_plan
    assert sequence_plan["model.layers.*.mlp.shared_expert_gate"] == "replicated_with_output_grad_allreduce"
    _assert_moe_runs_as_dense(dense, sequence_plan)


def test_moe_packed_shared_expert_sequence_plan(world2):
    skip_unless_own_plan("Qwen2MoeConfig", "layers.*.mlp.experts", "moe_tp_experts")
    world2.run(check_moe_packed_shared_expert_sequence_plan)


def check_hybrid_sequence_parallel_plan():
    """NemotronH, a hybrid whose decoder layers each hold one ``mixer`` of their own kind (a Mamba-2
    mixer, a mixture of experts, an attention, an MLP) and a ``norm``, its Mamba mixer a gated
    ``norm`` of its own: the plan names the layers' norms each by its own name (``layers.*.norm``
    would name the mixer's too, which runs whole on every rank: its gradient would be summed p
    times), the mixers run whole on the gathered sequence (its plan splits the experts alone), and
    the logits, the loss and every gradient are the dense model's in float64, to float32's
    precision of its size (its norms computed in float32)."""
    import transformers

    config = transformers.NemotronHConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=4, head_dim=4,
        max_position_embeddings=64, mamba_num_heads=4, mamba_head_dim=4, n_groups=2, ssm_state_size=4,
        moe_intermediate_size=8, moe_shared_expert_intermediate_size=12, n_routed_experts=4, num_experts_per_tok=2,
        hybrid_override_pattern="ME*-", pad_token_id=0, attn_implementation="sdpa", experts_implementation="eager")
    torch.manual_seed(0)
    dense = transformers.NemotronHForCausalLM(config).double()
    plan = tp_kernels.sequence_parallel_plan(dense)
    assert "model.layers.*.norm" not in plan and all(
        isinstance(plan[f"model.layers.{i}.norm"], torch.distributed.tensor.parallel.SequenceParallel)
        for i in range(4)), plan
    assert not any(name.startswith("model.layers.0.mixer.norm") for name in plan), plan
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    want, got = dense(ids, use_cache=False), par(ids, use_cache=False)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=64 * torch.finfo(torch.float32).eps)
    want.logits.square().sum().backward()
    got.logits.square().sum().backward()
    assert_dense_grads(par, dense, 16 * torch.finfo(torch.float32).eps)


def check_llama4_sequence_parallel_plan():
    """Llama 4 by its own plan (transformers names its layers in it both from the text model,
    ``layers.*``, and from the causal LM, ``model.layers.*``: the entries that name no module are
    left out), its mixture of experts (a router scaling the experts' input, a shared expert split,
    experts whose weights are transposed) returning its tokens flat, ``[b*s, h]``: the sequence
    plan reduce-scatters that output as ``[b, s, h]`` (the experts' and the shared expert's partial
    sums, one move) and hands it on flat, ``[b*s/p, h]``; the logits and every gradient are the
    dense model's in float64, as by its plan without sequence parallelism (to float32's precision:
    its router's sigmoid is taken in float32)."""
    import transformers

    _, p = rank_world()
    config = transformers.Llama4TextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, intermediate_size_mlp=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=4, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    dense = transformers.Llama4ForCausalLM(config).double()
    plan = tp_kernels.sequence_parallel_plan(dense)
    assert not any(k.startswith("layers.") for k in plan) and "model.layers.*.feed_forward" in plan, plan
    flat = []
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    eps = 4 * torch.finfo(torch.float32).eps  # (its router's sigmoid is taken in float32)
    for given in (dict(dense.tp_plan), plan):
        for q in dense.parameters():
            q.grad = None
        par = tp_kernels.parallelize(copy.deepcopy(dense), given, strict=False)  # (a dense MLP no layer holds)
        par.model.layers[0].feed_forward.register_forward_hook(lambda m, args, out: flat.append(tuple(out[0].shape)))
        want, got = dense(ids, use_cache=False), par(ids, use_cache=False)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=eps * want.logits.abs().max().item())
        want.logits.square().sum().backward()
        got.logits.square().sum().backward()
        assert_dense_grads(par, dense, eps)
    assert flat == [(16, 16), (16 // p, 16)], flat


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_llama4_sequence_parallel_plan(world):
    transformers = pytest.importorskip("transformers")
    if getattr(transformers, "Llama4TextConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Llama4TextConfig")
    world.run(check_llama4_sequence_parallel_plan)


def test_hybrid_sequence_parallel_plan(world2):
    transformers = pytest.importorskip("transformers")
    if getattr(transformers, "NemotronHConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no NemotronHConfig")
    world2.run(check_hybrid_sequence_parallel_plan)


def test_sequence_parallel_plan_of_every_transformers_model():
    """Every transformers causal language model whose config has a tensor-parallel plan, built from
    a small config (hidden size 16, two layers, four heads, four experts; those the small config
    cannot build passed over): :func:`tp_kernels.sequence_parallel_plan` writes its plan, every
    pattern of which names a module or a parameter of the model, or raises ``ValueError`` naming
    what it cannot write (a model beside whose layers sits a module it cannot split, hyper-
    connections), never another error (a hybrid's module some layers hold as None once raised
    ``AttributeError``). Most are written: 94 of 109 in transformers 5.24."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=4, max_position_embeddings=64, moe_intermediate_size=8, num_experts=4,
                 num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=12,
                 pad_token_id=0)
    written, refused = [], []
    for kind, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            config_class, model_class = CONFIG_MAPPING[kind], getattr(transformers, class_name)
        except Exception:  # (a model whose classes this install cannot load: not what this tests)
            continue
        if not getattr(config_class, "base_model_tp_plan", None):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                model = model_class(config_class(**small))
        except Exception:  # (a config the small sizes do not fit: not what this tests)
            continue
        try:
            plan = tp_kernels.sequence_parallel_plan(model)
        except ValueError:
            refused.append(kind)
            continue
        names = [name for name, _ in itertools.chain(model.named_modules(), model.named_parameters())]
        for pattern in plan:
            assert any(fnmatch.fnmatchcase(name, pattern) for name in names), (kind, pattern)
        written.append(kind)
    assert len(written) >= 2 * len(refused) and len(written) >= 10, (written, refused)


def test_sequence_parallel_plan_errors():
    """What :func:`tp_kernels.sequence_parallel_plan` cannot write is a ValueError naming it: a
    module whose entries hold no row layer and leave its output split along the hidden units, or
    sum a gradient over the group (a per-head norm's, DeepSeek's latent key/value projection's:
    every rank would compute it whole), a plan of torch's styles, entries outside the decoder layers, a model
    without a ``tp_plan``, a module beside the layers that is not a norm, a module of the layers
    that is a norm in some of them only, a row layer's entry that would reduce-scatter in one layer
    and sum its output whole in another."""
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor.parallel import ColwiseParallel

    common = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    plan = dict(llama.tp_plan)
    cases = [
        (llama, {"model.layers.*.self_attn.q_proj": "colwise"},
         r"plan: model.layers.0.self_attn holds 'self_attn.q_proj' \('colwise'\), whose output is split along the "
         r"hidden units, but no 'rowwise' layer"),
        (llama, {**plan, "lm_head": ColwiseParallel()}, r"plan\['lm_head'\]: a style of torch's"),
        (llama, {**plan, "model.norm": "replicated_with_grad_allreduce"}, r"plan\['model.norm'\]: outside the decoder"),
        (nn.Linear(2, 2), None, r"plan: Linear has no tp_plan"),
        (llama, {"lm_head": "colwise"}, r"plan: expected the entries of one list of decoder layers"),
        (llama, {**{k: v for k, v in plan.items() if ".mlp." not in k},
                 "model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
         r"plan: model.layers.0.mlp holds 'mlp.act_fn' \('replicated_with_grad_allreduce'\), whose gradient is summed "
         r"over the group \(each rank's share of it where the module's heads are split\), but no 'rowwise' layer"),
    ]
    for model, given, match in cases:
        with pytest.raises(ValueError, match=match):
            tp_kernels.sequence_parallel_plan(model, given)
    llama.model.extra = nn.Linear(16, 16)  # (beside the layers, holding parameters, not a norm)
    with pytest.raises(ValueError, match=r"model: model.extra \(Linear\) holds parameters the plan leaves whole"):
        tp_kernels.sequence_parallel_plan(llama)
    two = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**common, "num_hidden_layers": 2}))
    two.model.layers[1].input_layernorm = nn.Linear(16, 16)  # (a norm in one layer, not in the other)
    with pytest.raises(ValueError, match=r"model: model.layers.\*.input_layernorm is a norm in some layers and not"):
        tp_kernels.sequence_parallel_plan(two)
    from test_experts import _moe_model, _plan

    latent = _moe_model("deepseek_v2")  # (its latent key/value projection alone, its rotary key's gradient summed)
    with pytest.raises(ValueError, match=r"plan: model.layers.0.self_attn holds 'self_attn.kv_a_proj_with_mqa' "
                                         r"\('mla_kv_a_proj'\), whose gradient is summed over the group"):
        tp_kernels.sequence_parallel_plan(latent, {k: v for k, v in _plan(latent, "tp").items()
                                                   if ".self_attn." not in k or k.endswith("kv_a_proj_with_mqa")})
    deepseek = _moe_model("deepseek_v3")  # (a row entry of the dense MLP's and, inside the mixture, of its shared experts')
    with pytest.raises(ValueError, match=r"plan: model.layers.\*.mlp.down_proj is a row layer of a module of some "
                                         r"layers whose output must be whole"):
        tp_kernels.sequence_parallel_plan(deepseek, {**_plan(deepseek, "tp"), "model.layers.*.mlp.*down_proj": "rowwise"})


def check_hugging_face_plans(kind, device="cpu"):
    """transformers models parallelized by their own ``tp_plan``, its other styles: Qwen 3's per-head
    ``q_norm`` and ``k_norm`` (``"replicated_with_grad_allreduce"``: each rank's gradient of them is
    its heads' share, summed over the group in backward) and OLMo 2's whole-width ones (its
    projections ``"colwise_gather_output"`` and ``"rowwise_split_input"``). Two micro-batches
    accumulated, then an SGD step, give the dense model's weights in float64 (so the norms' gradient
    is summed once per backward, not again with what had accumulated); the logits are the dense
    model's. ``device``: where the models and the batches are."""
    import transformers

    r, p = rank_world()
    config = getattr(transformers, {"qwen3": "Qwen3Config", "olmo2": "Olmo2Config"}[kind])(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=4, max_position_embeddings=64, attn_implementation="sdpa")
    model_class = getattr(transformers, {"qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}[kind])
    torch.manual_seed(0)
    dense = model_class(config).double().to(device)
    plan = dict(dense.tp_plan)
    assert {"qwen3": "replicated_with_grad_allreduce", "olmo2": "rowwise_split_input"}[kind] in plan.values(), plan
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32, (2, 6), generator=g).to(device) for _ in range(2)]
    for ids in batches:  # accumulated
        want, got = dense(ids, labels=ids), par(ids, labels=ids)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
        want.loss.backward()
        got.loss.backward()
    _assert_same_sgd_step(dense, par)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_hugging_face_plans(world, kind):
    world.run(check_hugging_face_plans, kind)


def check_hugging_face_gemma(kind, device="cpu"):
    """Gemma 1, 2 and 3 by their own plans: their embedding, a subclass that scales the lookup by
    ``sqrt(hidden)`` and is tied to the head, becomes a VocabParallelEmbedding scaling its rows
    alike (``output_scale``). The logits and loss are the dense model's in float64 and so is every
    gradient (Gemma 3's per-head norms, computed in float32, to float32's precision of its size).
    ``device``: where the models and the batch are."""
    import transformers

    r, p = rank_world()
    config, model_class = {"gemma": ("GemmaConfig", "GemmaForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}[kind]
    torch.manual_seed(0)
    dense = getattr(transformers, model_class)(getattr(transformers, config)(
        vocab_size=32, hidden_size=24, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=4, max_position_embeddings=64, attn_implementation="eager")).double().to(device)
    assert type(dense.model.embed_tokens).forward is not nn.Embedding.forward  # (scaled)
    par = tp_kernels.parallelize(copy.deepcopy(dense), dict(dense.tp_plan))
    # (the model's own scale: sqrt(24) rounded to float32, then made float64 by .double())
    assert par.model.embed_tokens.output_scale == dense.model.embed_tokens.embed_scale.item() != 24 ** 0.5
    assert par.lm_head.weight is par.model.embed_tokens.weight
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    assert_same_loss_and_backward(dense, par, ids)
    assert_dense_grads(par, dense, 8 * torch.finfo(torch.float32).eps if kind == "gemma3" else 1e-12)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("kind", ["gemma", "gemma2", "gemma3"])
def test_hugging_face_gemma(world, kind):
    world.run(check_hugging_face_gemma, kind)


def check_hugging_face_plan_compiled():
    """Qwen 3 by its own plan, compiled with torch.compile (its per-head norms' gradients summed by
    hooks the compiled forward still installs and runs): twice forward and backward, the norms'
    gradients are the dense model's (to float32 rounding: the model's norms compute in float32)."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=4,
                                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    dense = transformers.Qwen3ForCausalLM(config).double()
    par = tp_kernels.parallelize(copy.deepcopy(dense), dict(dense.tp_plan))
    compiled = torch.compile(par)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for model in (dense, par):
            model.zero_grad()
        compiled(ids, labels=ids).loss.backward()
        dense(ids, labels=ids).loss.backward()
    for name in ("q_norm", "k_norm"):
        got = par.model.layers[0].self_attn.get_submodule(name).weight.grad
        want = dense.model.layers[0].self_attn.get_submodule(name).weight.grad
        # (Qwen 3's RMSNorm computes in float32, which the compiled kernels round otherwise)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@torch_before(2, 13, "inductor's CPU backward of a float64 scaled_dot_product_attention raises 'expected scalar type "
                     "Double but found Float'")
def test_hugging_face_plan_compiled(world2):
    world2.run(check_hugging_face_plan_compiled)


def check_data_parallel_over_tensor_parallel(device="cpu"):
    """Tensor parallelism 2 x data parallelism 2 on 4 ranks: DistributedDataParallel over the
    data-parallel group wraps the parallelized model, each data-parallel rank takes half the batch,
    and two SGD steps match the dense model's on the whole batch in float64, on ``device``."""
    r, p = rank_world()
    tp_kernels.initialize_model_parallel(2)
    try:
        q, dp = tp_kernels.get_tensor_model_parallel_rank(), tp_kernels.get_data_parallel_rank()
        vocab, hidden, heads, ffn = 8, 6, 2, 8
        torch.manual_seed(0)
        dense = LanguageModel(vocab, hidden, heads, ffn).double().to(device)
        par = tp_kernels.parallelize(copy.deepcopy(dense), LM_PLAN)
        ddp = nn.parallel.DistributedDataParallel(par, process_group=tp_kernels.get_data_parallel_group())
        opts = [torch.optim.SGD(dense.parameters(), lr=0.5), torch.optim.SGD(ddp.parameters(), lr=0.5)]
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            ids, tokens = (torch.randint(0, vocab, (4, 6), generator=g).to(device) for _ in range(2))
            F.cross_entropy(dense(ids).reshape(-1, vocab), tokens.reshape(-1)).backward()
            mine = slice(3 * dp, 3 * dp + 3)  # this data-parallel rank's half of the batch (dim 1)
            tp_kernels.vocab_parallel_cross_entropy(ddp(ids[:, mine]), tokens[:, mine]).mean().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for name, want in (("emb.weight", 0), ("block.mlp.2.weight", 1), ("head.weight", 0)):
            got = par.get_parameter(name)
            torch.testing.assert_close(got, block(dense.get_parameter(name), want, q, 2), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(par.block.norm1.weight, dense.block.norm1.weight, rtol=1e-12, atol=1e-12)
    finally:
        tp_kernels.destroy_model_parallel()


def test_data_parallel_over_tensor_parallel(world4):
    world4.run(check_data_parallel_over_tensor_parallel)


def _data_parallel_mesh(mesh_kind, device):
    """The mesh FSDP2 shards over with tensor parallelism 2 on 4 ranks (the Megatron layout's
    groups: TP [0, 1] [2, 3], DP [0, 2] [1, 3]): the data-parallel group's (``"fsdp"``), or
    ``"hsdp"``'s two dims, replicated over the data-parallel ranks and sharded over none. Named
    anew each time: torch caches meshes by value, and would hand back one of an earlier test's,
    whose groups destroy_model_parallel destroyed."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    kind = torch.device(device).type
    tag = tp_kernels.get_data_parallel_group().group_name
    if mesh_kind == "hsdp":
        names = (f"replicate{tag}", f"shard{tag}", f"tp{tag}")
        return init_device_mesh(kind, (2, 1, 2), mesh_dim_names=names)[names[:2]]
    return DeviceMesh.from_group(tp_kernels.get_data_parallel_group(), kind, mesh_dim_names=(f"dp{tag}",))


def check_fully_sharded_data_parallel_over_tensor_parallel(path, sequence_parallel, mesh_kind, device="cpu"):
    """Tensor parallelism 2 x FSDP2 over the 2 data-parallel ranks (``fully_shard``; or HSDP,
    replicated over them) on 4 ranks, with sequence parallelism or without (its norms' gradients
    summed after backward, or, "hooked", by the plan's "replicated_with_grad_allreduce" in
    backward): each data-parallel rank takes half the batch, and two SGD steps with momentum, each
    clipped by clip_grad_norm_ (the dense model's total norm), give the dense model's weights on the
    whole batch in float64; full_state_dict is the dense state dict,
    which a model sharded alike loads with load_full_state_dict. Saved with dcp (the sharded state
    dicts, the optimizer's too), the checkpoint is the dense model's and momenta offline; a model
    sharded alike resumes from it, its next step the original's; and the model parallelized over
    all 4 ranks without FSDP2 loads it. A model made on the meta device, sharded, then initialized
    in place holds what it holds without FSDP2. A padded layer's full state dict is the dense one;
    parallelizing a model already sharded is a clear error; FSDP2 finds no view returned by the model
    (its head is a column layer). On ``device``'s tensors (each model drawn on the CPU, then moved;
    the meta-device one initialized on ``device``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    r, _ = rank_world()
    vocab, hidden, heads, ffn = 8, 6, 4, 8
    tp_kernels.initialize_model_parallel(2)
    try:
        dp = tp_kernels.get_data_parallel_rank()
        mesh = _data_parallel_mesh(mesh_kind, device)

        # sequence parallelism's norms: their gradients summed after backward, or by the plan in backward
        plan = dict(LM_PLAN)
        if sequence_parallel == "hooked":
            plan["block.norm*"] = "replicated_with_grad_allreduce"

        def sharded(seed, vocab=vocab):
            torch.manual_seed(seed)
            model = tp_kernels.parallelize(LanguageModel(vocab, hidden, heads, ffn).double().to(device), plan,
                                           sequence_parallel=bool(sequence_parallel))
            fully_shard(model.block, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        def sgd(model):  # (not Adam: the key bias's gradient is zero, softmax ignoring it, and Adam
            return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # would scale its rounding noise)

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, vocab, (4, 6), generator=g).to(device),
                    torch.randint(0, vocab, (4, 6), generator=g).to(device)) for _ in range(3)]

        def step(model, opt, ids, tokens):
            mine = slice(3 * dp, 3 * dp + 3)  # this data-parallel rank's half of the batch (dim 1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits = model(ids[:, mine])
            assert not [w for w in caught if "view" in str(w.message)], [str(w.message) for w in caught]
            tp_kernels.vocab_parallel_cross_entropy(logits, tokens[:, mine]).mean().backward()  # FSDP2 averages
            if sequence_parallel is True:
                tp_kernels.allreduce_sequence_parallel_grads([q for n, q in model.named_parameters() if "norm" in n])
            total = tp_kernels.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
            return total

        torch.manual_seed(0)
        dense = LanguageModel(vocab, hidden, heads, ffn).double().to(device)
        dense_opt = sgd(dense)
        par = sharded(5)
        tp_kernels.load_full_state_dict(par, dense.state_dict())
        opt = sgd(par)
        for ids, tokens in batches[:2]:
            F.cross_entropy(dense(ids).reshape(-1, vocab), tokens.reshape(-1)).backward()
            want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
            dense_opt.step()
            dense_opt.zero_grad()
            torch.testing.assert_close(step(par, opt, ids, tokens), want, rtol=1e-12, atol=0)
        state, want = tp_kernels.full_state_dict(par), dense.state_dict()
        assert list(state) == list(want)
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
        again = sharded(7)
        tp_kernels.load_full_state_dict(again, state)
        assert all(torch.equal(a, b) for a, b in zip(tp_kernels.full_state_dict(again).values(), state.values()))
        # (a column layer's weight, one block a rank that FSDP2's rows cut alone: Shard(0) over the group, then
        # FSDP2's own placements, its rows as they are, not a chunk)
        column, param = tp_kernels.sharded_state_dict(par)["block.mlp.0.weight"], par.block.mlp[0].weight
        assert list(column.placements) == [Shard(0), *param.placements], column.placements
        assert type(column.to_local()) is torch.Tensor and column.shape == (ffn, hidden), column

        _save_with_dcp(par, opt, path)
        if r == 0:  # offline, whole: the dense model's weights and momenta
            _assert_dense_checkpoint(path, dense, dense_opt, moments=("momentum_buffer",))
        resumed, resumed_opt = sharded(9), None
        resumed_opt = sgd(resumed)
        loaded = {"model": tp_kernels.sharded_state_dict(resumed),
                  "optim": tp_kernels.sharded_optimizer_state_dict(resumed, resumed_opt)}
        dcp.load(loaded, checkpoint_id=path)
        tp_kernels.load_sharded_optimizer_state_dict(resumed, resumed_opt, loaded["optim"])
        for model, model_opt in ((par, opt), (resumed, resumed_opt)):
            step(model, model_opt, *batches[2])
        assert all(torch.equal(a, b) for a, b in zip(tp_kernels.full_state_dict(resumed).values(),
                                                     tp_kernels.full_state_dict(par).values()))

        # made on the meta device, parallelized, sharded, then initialized in place (TorchTitan's way):
        # the parameters of the same model initialized without FSDP2
        made = []
        for shard in (True, False):
            with torch.device("meta"):
                model = tp_kernels.parallelize(LanguageModel(vocab, hidden, heads, ffn).double(), LM_PLAN)
            if shard:
                fully_shard(model.block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            model.to_empty(device=device)
            torch.manual_seed(11)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            made.append(tp_kernels.full_state_dict(model))
        assert all(torch.equal(made[0][name], made[1][name]) for name in want)

        padded = sharded(3, vocab=7)  # 7 classes on 2 ranks: a padded embedding and head
        torch.manual_seed(3)
        joined = tp_kernels.full_state_dict(padded)  # without the padding: the dense model's
        for name, value in LanguageModel(7, hidden, heads, ffn).double().state_dict().items():
            assert torch.equal(joined[name].cpu(), value), name
        # sharded, then parallelized
        late = fully_shard(LanguageModel(vocab, hidden, heads, ffn).double().to(device), mesh=mesh)
        with pytest.raises(ValueError, match="are DTensors .* parallelize the dense model first"):
            tp_kernels.parallelize(late, LM_PLAN)
    finally:
        tp_kernels.destroy_model_parallel()
    tp_kernels.initialize_model_parallel(4)  # the checkpoint into tensor parallelism alone, over all 4 ranks
    try:
        wide = tp_kernels.parallelize(LanguageModel(vocab, hidden, heads, ffn).double().to(device), LM_PLAN)
        dcp.load({"model": tp_kernels.sharded_state_dict(wide)}, checkpoint_id=path)
        for name, value in tp_kernels.full_state_dict(wide).items():
            torch.testing.assert_close(value, want[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    finally:
        tp_kernels.destroy_model_parallel()


@pytest.mark.parametrize("sequence_parallel,mesh_kind", [(False, "fsdp"), (True, "fsdp"), ("hooked", "fsdp"),
                                                          (False, "hsdp")])
def test_fully_sharded_data_parallel_over_tensor_parallel(world4, tmp_path, sequence_parallel, mesh_kind):
    world4.run(check_fully_sharded_data_parallel_over_tensor_parallel, str(tmp_path / "checkpoint"),
               sequence_parallel, mesh_kind)


class _GroupedQueryLM(nn.Module):
    """An embedding, a :class:`GroupedQueryBlock` and a head: a language model every sharded layer
    of which is a fused one (the block's) or, for a vocabulary that p does not divide, a padded one."""

    def __init__(self, vocab, hidden, heads, kv_heads, ffn, tp=1):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.block = GroupedQueryBlock(hidden, heads, kv_heads, ffn, tp)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):  # [s, b] -> [s, b, vocab]
        return self.head(self.block(self.emb(ids)))

    def plan(self):
        return {"emb": "vocab", "head": "colwise", "block.qkv": ("colwise", self.block.sizes, HEAD_DIM),
                "block.o_proj": "rowwise", "block.gate_up": ("colwise", [self.block.ffn] * 2),
                "block.down": "rowwise"}


def check_fused_layers_under_fully_sharded_data_parallel(path, mesh_kind, device="cpu"):
    """Tensor parallelism 2 x FSDP2 (or HSDP, replicated over the data-parallel ranks) on 4 ranks
    over a model each sharded layer of which is made of pieces that FSDP2's rows cut across: a
    vocabulary of 7 on 2 ranks (the embedding and the head padded), a fused [q, k, v] of 8 query
    heads and one key/value head that both ranks hold (FSDP2's rows of a rank's 30 ending inside
    its fourth query head) and a fused [gate, up]. Two SGD steps with momentum, each data-parallel
    rank taking half the batch, give the dense model's weights; saved with dcp through the sharded
    state dicts (each entry's rows a chunk), the checkpoint read offline is the dense model's
    weights and momenta; a model sharded alike (made on the meta device) resumes from it (its
    weights, padding zero, momenta and next step the original's), and the model parallelized over
    all 4 ranks without FSDP2 (another padding, the key/value head on 4 ranks) loads the same
    weights and momenta. On ``device``'s tensors (each model drawn on the CPU, then moved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    r, _ = rank_world()
    sizes = dict(vocab=7, hidden=6, heads=8, kv_heads=1, ffn=12)

    def momenta(model, opt):
        params = dict(model.named_parameters())
        return {name: opt.state[param]["momentum_buffer"] for name, param in params.items()}

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    torch.manual_seed(0)
    dense = _GroupedQueryLM(**sizes).double().to(device)
    dense_opt = sgd(dense)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, 7, (4, 6), generator=g).to(device) for _ in range(2)) for _ in range(3)]
    for ids, tokens in batches[:2]:
        F.cross_entropy(dense(ids).reshape(-1, 7), tokens.reshape(-1)).backward()
        dense_opt.step()
        dense_opt.zero_grad()
    want, want_momenta = dense.state_dict(), momenta(dense, dense_opt)

    tp_kernels.initialize_model_parallel(2)
    try:
        dp = tp_kernels.get_data_parallel_rank()
        mesh = _data_parallel_mesh(mesh_kind, device)

        def sharded(seed, meta=False):
            torch.manual_seed(seed)
            with torch.device("meta") if meta else contextlib.nullcontext():
                model = _GroupedQueryLM(**sizes, tp=2).double()
                model = tp_kernels.parallelize(model if meta else model.to(device), model.plan())
            fully_shard(model.block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if meta:  # (made on the meta device: its memory, padding included, NaN until loaded)
                model.to_empty(device=device)
                with torch.no_grad():
                    for param in model.parameters():
                        param.to_local().fill_(float("nan"))
            return model

        def step(model, opt, ids, tokens):
            mine = slice(3 * dp, 3 * dp + 3)  # this data-parallel rank's half of the batch (dim 1)
            tp_kernels.vocab_parallel_cross_entropy(model(ids[:, mine]), tokens[:, mine]).mean().backward()
            opt.step()
            opt.zero_grad()

        par = sharded(0)  # (the dense model's weights)
        opt = sgd(par)
        for ids, tokens in batches[:2]:
            step(par, opt, ids, tokens)
        qkv = par.block.qkv.weight
        assert mesh_kind == "hsdp" or qkv.to_local().shape == (15, 6), qkv.to_local().shape  # (a half of 30 rows)
        state = tp_kernels.full_state_dict(par)
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
        entries = tp_kernels.sharded_state_dict(par)
        first = 4 * tp_kernels.get_tensor_model_parallel_rank()  # (the first of the rank's 4 query heads)
        assert {"emb.weight", "head.weight", f"block.qkv.weight[0][{first + 3}]", "block.qkv.weight[1][0]",
                "block.qkv.bias[2][0]", "block.gate_up.weight[1]"} <= set(entries), sorted(entries)
        _save_with_dcp(par, opt, path)
        if r == 0:  # offline, whole: the dense model's weights and momenta
            _assert_dense_checkpoint(path, dense, dense_opt, moments=("momentum_buffer",))

        resumed = sharded(9, meta=True)
        resumed_opt = sgd(resumed)
        loaded = {"model": tp_kernels.sharded_state_dict(resumed),
                  "optim": tp_kernels.sharded_optimizer_state_dict(resumed, resumed_opt)}
        dcp.load(loaded, checkpoint_id=path)
        tp_kernels.load_sharded_optimizer_state_dict(resumed, resumed_opt, loaded["optim"])
        assert all(torch.isfinite(param.to_local()).all() for param in resumed.parameters())  # (the padding: zero)
        for name, value in momenta(par, opt).items():
            got = momenta(resumed, resumed_opt)[name]
            assert type(got) is type(value) and torch.equal(got.to_local(), value.to_local()), name
        for stepped in (False, True):  # the weights loaded in place, then after the next step
            for model, model_opt in ((par, opt), (resumed, resumed_opt)) if stepped else ():
                step(model, model_opt, *batches[2])
            got, original = tp_kernels.full_state_dict(resumed), tp_kernels.full_state_dict(par)
            assert all(torch.equal(got[name], original[name]) for name in want), stepped
    finally:
        tp_kernels.destroy_model_parallel()
    tp_kernels.initialize_model_parallel(4)  # the checkpoint into tensor parallelism alone, over all 4 ranks
    try:
        torch.manual_seed(1)
        wide = _GroupedQueryLM(**sizes, tp=4).double().to(device)
        wide = tp_kernels.parallelize(wide, wide.plan())
        wide_opt = sgd(wide)
        loaded = {"model": tp_kernels.sharded_state_dict(wide),
                  "optim": tp_kernels.sharded_optimizer_state_dict(wide, wide_opt)}
        dcp.load(loaded, checkpoint_id=path)
        tp_kernels.load_sharded_optimizer_state_dict(wide, wide_opt, loaded["optim"])
        for name, value in tp_kernels.full_state_dict(wide).items():
            torch.testing.assert_close(value, want[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
        blocks, _, _ = tp_kernels.layers.sharded_blocks(wide)
        for name, got in momenta(wide, wide_opt).items():
            expected = want_momenta[name]
            if name in blocks:
                _, dim, layer = blocks[name]
                expected = _blocks_of_outputs(expected, layer.split_parts, dim, r, 4, getattr(layer, "head_size", None))
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} momentum: {m}")
    finally:
        tp_kernels.destroy_model_parallel()


@pytest.mark.parametrize("mesh_kind", ["fsdp", "hsdp"])
def test_fused_layers_under_fully_sharded_data_parallel(world4, tmp_path, mesh_kind):
    world4.run(check_fused_layers_under_fully_sharded_data_parallel, str(tmp_path / "checkpoint"), mesh_kind)


class _InputScale(nn.Module):
    """Its input times a parameter of its own, one factor per feature."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features, dtype=torch.float64))

    def forward(self, x):
        return x * self.weight


def check_replicated_heads_under_fully_sharded_data_parallel():
    """A fused query/key/value layer whose one key and one value head every rank of the
    tensor-parallel group holds whole (tensor parallelism 2), sharded by FSDP2 over the 2
    data-parallel ranks, its rows cut inside the replicated heads, after a parameter FSDP2 leaves
    whole (its module not sharded): clip_grad_norm_ counts each replicated row once and the whole
    parameter once, its total the dense model's norm in float64 (a total below max_norm: the
    gradients left as they are), and full_state_dict is the dense model's weights."""
    from torch.distributed.fsdp import fully_shard

    tp_kernels.initialize_model_parallel(2)
    try:
        mesh = _data_parallel_mesh("fsdp", "cpu")
        torch.manual_seed(0)
        # the query's 2 heads of 2, a key head, a value head
        dense = nn.Sequential(_InputScale(4), nn.Linear(4, 8, dtype=torch.float64))
        layer = tp_kernels.ColumnParallelLinear.from_linear(dense[1], output_sizes=[4, 2, 2], head_size=2)
        assert layer.weight.shape[0] == 6  # (its query head; the key and value heads whole)
        model = nn.Sequential(copy.deepcopy(dense[0]), fully_shard(layer, mesh=mesh))
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        # (each tensor-parallel rank its query head and half the key and value heads' term: the layer sums
        # their gradients over the two; every data-parallel rank the same batch: FSDP2's average is it)
        y = model(x).square()
        (y[:, :2].sum() + y[:, 2:].sum() / 2).backward()
        dense(x).square().sum().backward()
        want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1e9)
        local = [tp_kernels._data_parallel.local(q.grad) for q in model.parameters()]
        before = [g.clone() for g in local]
        torch.testing.assert_close(tp_kernels.clip_grad_norm_(model, 1e9), want, rtol=1e-12, atol=0)
        assert all(torch.equal(g, b) for g, b in zip(local, before))  # (not scaled up)
        state = tp_kernels.full_state_dict(model)
        for name, value in dense.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    finally:
        tp_kernels.destroy_model_parallel()


def test_replicated_heads_under_fully_sharded_data_parallel(world4):
    world4.run(check_replicated_heads_under_fully_sharded_data_parallel)


def check_data_parallel_layouts_not_taken():
    """What tp_kernels takes of a model whose parameters are DTensors is FSDP2's layout alone, over
    one mesh: a parameter sharded along another dim than 0, or parameters over two meshes, is a
    ValueError naming them from clip_grad_norm_ and full_state_dict, on every rank, before anything
    moves. Of a mesh that replicates (HSDP's dims), the first copy is the rank at coordinate 0 in
    every dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tp_kernels import _data_parallel

    r, _ = rank_world()
    tag = torch.distributed.group.WORLD.group_name
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(f"layouts{tag}",))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=(f"other{tag}",))
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    dense = [lin.weight.detach().clone() for lin in model]
    model[0].weight = nn.Parameter(distribute_tensor(dense[0], mesh, [Shard(1)]))
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    for call in (lambda: tp_kernels.clip_grad_norm_(model, 1.0), lambda: tp_kernels.full_state_dict(model)):
        with pytest.raises(ValueError, match=r"module: parameter '0.weight': a DTensor placed \(Shard\(dim=1\),\)"):
            call()
    model[0].weight = nn.Parameter(distribute_tensor(dense[0], mesh, [Shard(0)]))
    model[1].weight = nn.Parameter(distribute_tensor(dense[1], other, [Replicate()]))
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    for call in (lambda: tp_kernels.clip_grad_norm_(model, 1.0), lambda: tp_kernels.full_state_dict(model)):
        with pytest.raises(ValueError, match=r"module: its parameters are DTensors over 2 meshes \('0.weight', "
                                             r"'1.weight'\)"):
            call()
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=(f"replicate{tag}", f"shard{tag}"))
    assert _data_parallel.first_copy(hsdp) is (r == 0)
    assert _data_parallel.first_copy(init_device_mesh("cpu", (1, 2), mesh_dim_names=(f"one{tag}", f"two{tag}"))) \
        is (r == 0)


def test_data_parallel_layouts_not_taken(world2):
    world2.run(check_data_parallel_layouts_not_taken)


def check_layers_on_two_groups_refused():
    """A model whose parallel layers use two groups (one made of the same ranks as the world, but
    another group) is a ValueError saying so from every function that reads the whole model's
    shards: clip_grad_norm_, full_state_dict, sharded_state_dict, load_full_state_dict,
    sharded_optimizer_state_dict and load_sharded_optimizer_state_dict, on every rank, before
    anything moves (its gradients left as they were)."""
    pair = torch.distributed.new_group([0, 1])
    model = nn.Sequential(tp_kernels.ColumnParallelLinear(4, 6, group=pair), tp_kernels.RowParallelLinear(6, 4))
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {"clip_grad_norm_": lambda: tp_kernels.clip_grad_norm_(model, 1e-3),
             "full_state_dict": lambda: tp_kernels.full_state_dict(model),
             "sharded_state_dict": lambda: tp_kernels.sharded_state_dict(model),
             "load_full_state_dict": lambda: tp_kernels.load_full_state_dict(model, {}),
             "sharded_optimizer_state_dict": lambda: tp_kernels.sharded_optimizer_state_dict(model, optimizer),
             "load_sharded_optimizer_state_dict":
                 lambda: tp_kernels.load_sharded_optimizer_state_dict(model, optimizer, {"state": {},
                                                                                         "param_groups": []})}
    for name, call in calls.items():
        with _counting_collectives() as counted, \
                pytest.raises(ValueError, match=r"module: its parallel layers use 2 different groups; this takes one "
                                                r"tensor-parallel group"):
            call()
            pytest.fail(f"{name} did not raise")
        assert not counted, (name, counted)
    assert all(torch.equal(q.grad, torch.ones_like(q)) for q in model.parameters())


def test_layers_on_two_groups_refused(world2):
    world2.run(check_layers_on_two_groups_refused)


def check_distributed_checkpoint_with_optimizer(path, device="cpu"):
    """An Adam step, then the model and the optimizer saved with dcp from all the ranks
    (sharded_state_dict, sharded_optimizer_state_dict), and loaded into the model parallelized
    over half of them and a fresh Adam (load_sharded_optimizer_state_dict): every moment of every
    parameter is the dense optimizer's (to float64 rounding), split as the parameter is."""
    r, p = rank_world()
    vocab, hidden, heads, ffn = 4 * p, 6, 2 * p, 4 * p
    torch.manual_seed(0)
    dense = LanguageModel(vocab, hidden, heads, ffn).double().to(device)
    wide = tp_kernels.parallelize(copy.deepcopy(dense), LM_PLAN)
    dense_opt, wide_opt = torch.optim.Adam(dense.parameters(), lr=0.1), torch.optim.Adam(wide.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    ids, tokens = (torch.randint(0, vocab, (4, 3), generator=g).to(device) for _ in range(2))
    F.cross_entropy(dense(ids).reshape(-1, vocab), tokens.reshape(-1), reduction="sum").backward()
    tp_kernels.vocab_parallel_cross_entropy(wide(ids), tokens).sum().backward()
    dense_opt.step(), wide_opt.step()
    _save_with_dcp(wide, wide_opt, path)
    tp_kernels.initialize_model_parallel(max(p // 2, 1))
    try:
        torch.manual_seed(1)
        narrow = tp_kernels.parallelize(LanguageModel(vocab, hidden, heads, ffn).double().to(device), LM_PLAN)
        _assert_dense_moments(narrow, _load_with_dcp(narrow, path), dense, dense_opt)
    finally:
        tp_kernels.destroy_model_parallel()


def check_factored_optimizer_state_is_refused():
    """An optimizer whose state of a sharded parameter is not shaped as the parameter (Adafactor's
    row and column statistics) cannot be saved sharded: every rank raises, naming the parameter,
    where the state would have been saved as one tensor and loaded as rank 0's everywhere."""
    r, p = rank_world()
    torch.manual_seed(0)
    par = tp_kernels.parallelize(LanguageModel(4 * p, 6, 2 * p, 4 * p), LM_PLAN)
    opt = torch.optim.Adafactor(par.parameters())
    par(torch.randint(0, 4 * p, (4, 3))).square().sum().backward()
    opt.step()
    if p == 1:  # nothing sharded: the state is the dense optimizer's, saved as it is
        assert "emb.weight" in tp_kernels.sharded_optimizer_state_dict(par, opt)["state"]
        return
    with pytest.raises(ValueError, match=r"optimizer: a state tensor of 'emb.weight' has shape \[4, 1\], not its "
                                         r"block's \[4, 6\] \(a factored optimizer"):
        tp_kernels.sharded_optimizer_state_dict(par, opt)


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_factored_optimizer_state_is_refused(world):
    world.run(check_factored_optimizer_state_is_refused)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_distributed_checkpoint_with_optimizer(world, tmp_path):
    world.run(check_distributed_checkpoint_with_optimizer, str(tmp_path))


def test_dense_state_dict_joins_and_refuses_incomplete_entries():
    """dense_state_dict joins outputs and heads in order (whatever order the entries come in),
    packed expert weights' outputs along the dim they name, leaves other entries alone, and names
    an entry whose outputs or heads are not all there, whose outputs name different dims, or whose
    unsplit values differ."""
    t = [torch.full((1, 2), float(i)) for i in range(4)]
    got = tp_kernels.dense_state_dict({"a.w[1][1]": t[3], "b": t[0], "a.w[0]": t[0], "a.w[1][0]": t[2],
                                       "opt": {"state": {"a.w[1]": {"m": t[1], "step": 3}, "a.w[0]": {"m": t[0],
                                                                                                 "step": 3}}}})
    assert list(got) == ["a.w", "b", "opt"] and got["b"] is t[0]
    assert torch.equal(got["a.w"], torch.cat([t[0], t[2], t[3]]))
    assert torch.equal(got["opt"]["state"]["a.w"]["m"], torch.cat([t[0], t[1]])) and got["opt"]["state"]["a.w"]["step"] == 3
    packed = tp_kernels.dense_state_dict({"e.gate_up[dim1][1]": t[1], "e.gate_up[dim1][0]": t[0]})
    assert list(packed) == ["e.gate_up"] and torch.equal(packed["e.gate_up"], torch.cat([t[0], t[1]], 1))
    for bad, match in [({"a.w[1]": t[0]}, r"the entries of 'a.w' are not every output \(and head\) of it: \['a.w\[1\]'\]"),
                       ({"a.w[0][1]": t[0]}, "the entries of 'a.w' are not every output"),
                       ({"a.w[dim1][0]": t[0], "a.w[1]": t[1]},
                        r"the entries of 'a.w' are not every output \(and head\) of it: "
                        r"\['a.w\[dim1\]\[0\]', 'a.w\[1\]'\]"),
                       ({"a.w[0]": {"m": t[0], "step": 1}, "a.w[1]": {"m": t[1], "step": 2}},
                        r"the pieces of 'a.w.step' hold different values"),
                       ([t[0]], "state_dict: expected a mapping, got list")]:
        with pytest.raises(ValueError, match=match):
            tp_kernels.dense_state_dict(bad)


class _LearnedActivation(nn.Module):
    """An MLP whose activation holds a parameter (a PReLU's slope), applied to the first layer's
    output, or (``view``) to a view of it."""

    def __init__(self, view: bool = False):
        super().__init__()
        self.up, self.act, self.down, self.view = nn.Linear(4, 8), nn.PReLU(), nn.Linear(8, 4), view

    def forward(self, x):
        h = self.up(x)
        return self.down(self.act(h.view(*h.shape[:-1], 2, -1)).flatten(-2) if self.view else self.act(h))


def check_parameters_on_column_outputs():
    """A module the plan does not name that holds parameters and takes a column layer's output
    (or a view of it), each rank's block of its columns: ``parallelize`` watches each such module's
    first call, which raises ValueError naming it, the column layer and the plan entry that fixes it
    where gradients are taken; under no_grad the output is the dense one, and a gradient that
    reaches its parameters later raises the same. Named ``"replicated_with_grad_allreduce"``, every
    gradient is the dense model's; named ``"replicate"``, nothing is raised; frozen (no gradient to
    take), nothing is raised either. The hooks are gone after the first call. transformers' Apertus
    (its learnable xIELU activation) by its own plan raises so, and so under sequence parallelism
    (its MLP moved whole by sequence_parallel_plan); with the entry its gradients are the dense
    model's, both ways."""
    r, p = rank_world()
    plan = {"up": "colwise", "down": "rowwise"}
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # (alike on every rank)
    for view in (False, True):
        torch.manual_seed(0)
        dense = _LearnedActivation(view).double()
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        if p == 1:
            assert not par.act._forward_pre_hooks and not par.up._forward_hooks
            continue
        with pytest.raises(ValueError, match=r"'act' \(PReLU\) holds parameters \(weight\) that the plan keeps whole, "
                                             r"and takes the output of the column layer 'up'.*Name it in the plan: "
                                             r"'act': 'replicated_with_grad_allreduce'"):
            par(x)
        assert not par.act._forward_pre_hooks and not par.up._forward_hooks  # (checked once)
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        with torch.no_grad():
            torch.testing.assert_close(par(x), dense(x), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=r"'act' \(PReLU\) holds parameters"):
            par(x).sum().backward()
    for style in ("replicated_with_grad_allreduce", "replicate"):
        torch.manual_seed(0)
        dense = _LearnedActivation().double()
        par = tp_kernels.parallelize(copy.deepcopy(dense), {**plan, "act": style})
        dense(x).square().sum().backward()
        par(x).square().sum().backward()
        assert not par.up._forward_hooks
        if style == "replicated_with_grad_allreduce":
            assert_dense_grads(par, dense, 1e-12)
        elif p > 1:  # (told it applies its parameter elsewhere: taken at its word, each rank its share)
            assert not torch.allclose(par.act.weight.grad, dense.act.weight.grad)
    torch.manual_seed(0)  # a frozen parameter takes no gradient: nothing to raise
    dense = _LearnedActivation().double()
    dense.act.weight.requires_grad_(False)
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    y = par(x)
    y.square().sum().backward()
    dense(x).square().sum().backward()
    torch.testing.assert_close(y, dense(x), rtol=1e-12, atol=1e-12)
    for got, want in ((par.up.weight.grad, block(dense.up.weight.grad, 0, r, p)),
                      (par.up.bias.grad, block(dense.up.bias.grad, 0, r, p)),
                      (par.down.weight.grad, block(dense.down.weight.grad, 1, r, p)),
                      (par.down.bias.grad, dense.down.bias.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert par.act.weight.grad is None

    transformers = pytest.importorskip("transformers")
    if getattr(transformers, "ApertusConfig", None) is None:
        return
    config = transformers.ApertusConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, head_dim=4,
                                        max_position_embeddings=64, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    dense = transformers.ApertusForCausalLM(config).double()
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    if p > 1:
        for plan in (dict(dense.tp_plan), tp_kernels.sequence_parallel_plan(dense)):  # (moved whole: watched too)
            par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
            with pytest.raises(ValueError, match=r"'model.layers.0.mlp.act_fn' \(XIELUActivation\) holds parameters "
                                                 r"\(alpha_p, alpha_n\).*'model.layers.\*.mlp.act_fn': "
                                                 r"'replicated_with_grad_allreduce'"):
                par(ids)
    plan = {**dense.tp_plan, "model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}
    for plan in (plan, tp_kernels.sequence_parallel_plan(dense, plan)):
        for q in dense.parameters():
            q.grad = None
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        assert_same_loss_and_backward(dense, par, ids)
        assert_dense_grads(par, dense, 1e-12)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_parameters_on_column_outputs(world):
    world.run(check_parameters_on_column_outputs)


class _NormedMLP(nn.Module):
    """An embedding, a norm of its output (in a Sequential), an MLP and a norm of the MLP's output.
    ``kind``: ``"gathered"``, the output norm takes the up layer's output; ``"own_split"``, the
    output norm runs on this rank's block of the rows of the MLP's output, which the model's own
    code takes (``chunk``); ``"columns"`` and ``"sequence"``, a module of a parameter of its own
    (:class:`_WeightedSum`) takes the MLP's output beside the up layer's (each rank's block of its
    columns), or beside that output's block of rows (a sequence-parallel block); ``"residual"``,
    the output norm takes the embedding's output plus half the MLP's (a residual sum), and
    ``"own_split_residual"`` this rank's block of its rows; ``"scaled_columns"``, a module scaling
    by a parameter of its own (:class:`_Scale`) takes half the up layer's output. The blocks are
    taken where ``split``, as a parallelized model's; else the tensors whole."""

    def __init__(self, kind=None):
        super().__init__()
        self.embed, self.norm = nn.Embedding(8, 8), nn.Sequential(nn.LayerNorm(8))
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        mixed = kind in ("columns", "sequence")
        self.out_norm = _WeightedSum() if mixed else _Scale() if kind == "scaled_columns" else \
            nn.LayerNorm(16 if kind == "gathered" else 8)
        self.kind, self.split = kind, True

    def forward(self, ids):
        e = self.embed(ids)
        u = self.up(self.norm(e))
        if self.kind in ("gathered", "scaled_columns"):
            return self.out_norm(u if self.kind == "gathered" else 0.5 * u)
        h = self.down(F.gelu(u))
        if self.kind in ("residual", "own_split_residual"):
            h = e + 0.5 * h
        if self.kind == "columns":
            return self.out_norm(h, u)
        if self.kind == "sequence":
            return self.out_norm(h, tp_kernels.mappings.scatter_to_sequence_parallel_region(h) if self.split else h)
        if self.kind in ("own_split", "own_split_residual") and self.split:
            r, p = rank_world()
            return self.out_norm(h.chunk(p)[r])
        return self.out_norm(h)


class _Scale(nn.Module):
    """Its input times a parameter of its own (one number): given a rank's block of columns, its
    gradient on each rank is that block's share."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.weight * x


class _WeightedSum(nn.Module):
    """``u`` times the sum of ``h`` weighted by its own parameter: given the whole ``h`` and a rank's
    block of ``u``, its gradient on each rank is that block's share."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, h, u):
        return u * (h * self.weight).sum()


def check_summed_gradients_of_whole_inputs():
    """A module the plan names "replicated_with_grad_allreduce" whose input is whole and alike on
    every rank (an embedding's summed output, a row layer's, a column layer's gathered) would take its whole gradient on
    every rank, summed p times: its first call raises ValueError naming it, the layer whose output
    it took and the entry that fixes it, where gradients are taken; under no_grad the output is the
    dense one and a gradient that reaches its parameters later raises (the sum's own check, that the
    gradient is the same on every rank, before the plan's refusal). Named "replicate"
    instead, its gradients are the dense model's. Not raised where its input is a part of that output
    that the model's own code takes (its rows' blocks, each rank's: then the sum is the dense
    gradient), or where another of its inputs is a rank's block of a column layer's output. The
    same for an input computed from such an output by elementwise steps (a residual sum), where
    gradients are taken, but not for one computed so from a column layer's block (a scaling: the
    sum is the dense gradient). The hooks are gone after the first call."""
    r, p = rank_world()
    ids = torch.randint(0, 8, (4, 3), generator=torch.Generator().manual_seed(1))
    layers = {"embed": "vocab", "up": "colwise", "down": "rowwise"}
    for named, source, kind, kept in (("norm", "embed", "Sequential", None), ("out_norm", "down", "LayerNorm", None),
                                      ("out_norm", "up", "LayerNorm", "gathered")):
        torch.manual_seed(0)
        dense = _NormedMLP(kept).double()
        plan = {**layers, named: "replicated_with_grad_allreduce"}
        if kept == "gathered":
            plan = {"embed": "vocab", "up": "colwise_gather_output", named: "replicated_with_grad_allreduce"}
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        if p == 1:
            assert not par.down._forward_hooks
            continue
        with pytest.raises(ValueError, match=rf"'{named}' \({kind}\) is named 'replicated_with_grad_allreduce' "
                                             rf".*its input is the output of '{source}', whole and alike on every "
                                             rf"rank.*Name it in the plan: '{named}': 'replicate'"):
            par(ids)
        assert not par.get_submodule(source)._forward_hooks and not par.embed._forward_hooks  # (checked once)
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        with torch.no_grad():
            torch.testing.assert_close(par(ids), dense(ids), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=rf"sum_grads_over_group: {kind}'s parameter '[.0-9a-z]+': its gradient is "
                                             rf"the same on every rank"):  # (the sum's own check, first)
            par(ids).square().sum().backward()
    # a residual sum of the row layer's output and the (plain) embedding's; a rank's block of its rows
    # (the model's own split: summed rightly); half the column layer's output (each rank's block of it)
    assert all(hasattr(torch._C._functions, step) for step in _ELEMENTWISE)  # (torch's names, each)
    for kind in ("residual", "own_split_residual", "scaled_columns"):
        torch.manual_seed(0)
        dense = _NormedMLP(kind).double()
        plan = {"up": "colwise", "down": "rowwise", "out_norm": "replicated_with_grad_allreduce"}
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        if p > 1 and kind == "residual":
            with pytest.raises(ValueError, match=r"'out_norm' \(LayerNorm\) is named 'replicated_with_grad_allreduce' "
                                                 r".*its input is computed elementwise from the output of 'down' \(a "
                                                 r"residual sum\), whole and alike on every rank.*Name it in the plan: "
                                                 r"'out_norm': 'replicate'"):
                par(ids)
            assert not par.down._forward_hooks and len(par.out_norm._forward_pre_hooks) == 1  # (the sum's own)
            continue
        dense.split = False
        got, want = par(ids), dense(ids)
        torch.testing.assert_close(got, want if kind == "residual" else block(want, 0, r, p) if kind ==
                                   "own_split_residual" else block(want, -1, r, p), rtol=1e-12, atol=1e-12)
        got.square().sum().backward()
        want.square().sum().backward()
        for name, q in dense.out_norm.named_parameters():
            torch.testing.assert_close(par.out_norm.get_parameter(name).grad, q.grad, rtol=0,
                                       atol=1e-12 * q.grad.abs().max().item(), msg=lambda m: f"{kind} {name}: {m}")
    torch.manual_seed(0)
    dense = _NormedMLP().double()
    par = tp_kernels.parallelize(copy.deepcopy(dense), {**layers, "norm": "replicate", "out_norm": "replicate"})
    par(ids).square().sum().backward()
    dense(ids).square().sum().backward()
    assert_dense_grads(par, dense, 1e-11)  # (the embedding's, through two norms and a sum of p: 1e-12 is tight)

    if p == 1:
        return
    # the model's own split; the whole output beside a block of the up layer's columns, or of its own rows
    for kind, dim in (("own_split", 0), ("columns", -1), ("sequence", 0)):
        torch.manual_seed(0)
        dense = _NormedMLP(kind).double()
        par = tp_kernels.parallelize(copy.deepcopy(dense), {**layers, "out_norm": "replicated_with_grad_allreduce"})
        dense.split = False
        got, want = par(ids), dense(ids)
        torch.testing.assert_close(got, block(want, dim, r, p), rtol=1e-12, atol=1e-12)
        got.square().sum().backward()
        want.square().sum().backward()
        for name, q in dense.out_norm.named_parameters():
            torch.testing.assert_close(par.out_norm.get_parameter(name).grad, q.grad, rtol=0,
                                       atol=1e-12 * q.grad.abs().max().item(), msg=lambda m: f"{kind} {name}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_summed_gradients_of_whole_inputs(world):
    world.run(check_summed_gradients_of_whole_inputs)


def test_hugging_face_style_names_and_their_errors():
    """Hugging Face's style names are styles too ('embedding_rowwise' is 'vocab'), an unknown style
    lists them, a row layer whose input is whole refuses sequence parallelism, a (style, how) entry
    that the style does not take says which it takes, and a module kept with its gradients summed
    stays the module it was."""
    model = nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"unknown style 'diagonal'; expected one of 'colwise', .*'embedding_rowwise'"):
        tp_kernels.parallelize(model, {"2": "diagonal"})
    with pytest.raises(ValueError, match=r"'rowwise_split_input' \(a row layer whose input is whole\) does not go with "
                                         "sequence_parallel=True"):
        tp_kernels.parallelize(model, {"2": "rowwise_split_input"}, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"plan\['2'\]: 'rowwise' takes \('rowwise', 'partial'\) \(its output left "
                                         r"each rank's partial sum\) or 'rowwise' alone \(summed\), got \('rowwise', "
                                         r"'sequence'\)"):
        tp_kernels.parallelize(model, {"2": ("rowwise", "sequence")})  # (only experts take it)
    with pytest.raises(ValueError, match=r"'moe_tp_experts' takes .*\('moe_tp_experts', 'sequence'\) \(called with "
                                         r"each rank's block of the tokens\)"):
        tp_kernels.parallelize(model, {"2": ("moe_tp_experts", "whole")})
    norm = model[1]
    tp_kernels.parallelize(model, {"0": "embedding_rowwise", "1": "replicated_with_grad_allreduce",
                                   "2": "rowwise_split_input"})
    assert isinstance(model[0], tp_kernels.VocabParallelEmbedding) and model[1] is norm
    assert isinstance(model[2], tp_kernels.RowParallelLinear) and not model[2].input_is_parallel
    with pytest.raises(ValueError, match="module: expected an nn.Module"):
        tp_kernels.grads.sum_grads_over_group([norm.weight])
    with pytest.raises(ValueError, match="module: holds '0.weight', a parallel layer's block"):
        tp_kernels.grads.sum_grads_over_group(model)
    other = nn.Sequential(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)))
    for style in ("replicated_with_grad_allreduce", "replicated_with_output_grad_allreduce"):
        with pytest.raises(ValueError, match=rf"plan: '0' \({style}\) holds the parallel layer '0.1'"):
            tp_kernels.parallelize(other, {"0": style, "0.1": "colwise"})
    assert isinstance(other[0][1], nn.Linear)  # untouched
    gated = nn.Sequential(nn.Linear(4, 1), nn.Linear(4, 4))  # (kept, its output's gradient summed: on one rank nothing)
    gate = gated[0]
    tp_kernels.parallelize(gated, {"0": "replicated_with_output_grad_allreduce", "1": "colwise"})
    assert gated[0] is gate
    # a gradient summed where nothing is split: every rank's is the whole one, the sum p times it
    for style, call in (("replicated_with_grad_allreduce", "sum_grads_over_group"),
                        ("replicated_with_output_grad_allreduce", "sum_output_grads_over_group"),
                        (("mla_kv_a_proj", 1), "sum_output_grads_over_group")):
        alone = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 3))
        with pytest.raises(ValueError, match=rf"plan: '0' is '{style if isinstance(style, str) else style[0]}', which "
                                             rf"sums a gradient over the group, but the plan splits nothing of "
                                             rf"Sequential .* call tp_kernels.grads.{call}$"):
            tp_kernels.parallelize(alone, {"0": style, "1": "replicate"})
        assert type(alone[0]) is nn.Linear and not alone[0]._forward_pre_hooks and not alone[0]._forward_hooks
    from torch.distributed.tensor.parallel import SequenceParallel

    alone = nn.Sequential(nn.LayerNorm(4))  # (torch's SequenceParallel: the model may split the sequence itself)
    tp_kernels.parallelize(alone, {"0": SequenceParallel()})
    before = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 3))  # (split by an earlier call: summed)
    tp_kernels.parallelize(before, {"1": "colwise"})
    tp_kernels.parallelize(before, {"0": "replicated_with_grad_allreduce"})
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 3))
    rep = tp_kernels.parallelize(copy.deepcopy(dense), {"0": "colwise_rep", "1": "rowwise_rep"})  # (transformers')
    assert rep[0].gather_output and not rep[1].input_is_parallel
    x = torch.randn(5, 4)
    torch.testing.assert_close(rep(x), dense(x))
