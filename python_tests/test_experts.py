"""Mixture-of-experts weights under tensor parallelism (tp_kernels.experts, and parallelize's
"moe_tp_experts" style) and expert parallelism over the same group ("moe_ep_experts"): against the
dense module in float64, on 1, 2 and 4 gloo ranks."""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tp_kernels
from helpers import (adam_atol, adam_drift, assert_close, assert_dense_grads, assert_same_loss_and_backward,
                     fingerprints_set, full_grads, rank_world, skip_unless_own_plan)
from tp_kernels import experts as experts_module
from tp_kernels.experts import check_styles, shard_experts, share_identity_expert

E, H, I, TOKENS, TOP = 4, 6, 8, 10, 2  # experts, hidden, each expert's hidden units, tokens, experts per token


class Experts(nn.Module):
    """A mixture's experts as Hugging Face keeps them: one 3-D parameter per projection, the
    gate's and the up projection's rows packed in ``gate_up_proj`` (``[E, 2I, H]``), or, with
    ``transposed=True``, ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` (Llama 4's layout); with
    ``bias``, an output bias per expert. It runs experts ``0 .. num_experts - 1`` (an id
    ``num_experts``, a route to an expert held elsewhere, is skipped)."""

    def __init__(self, transposed: bool = False, bias: bool = False):
        super().__init__()
        self.transposed = transposed
        self.num_experts = E
        shapes = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj = nn.Parameter(torch.randn(*shapes[0], dtype=torch.float64) / H ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(*shapes[1], dtype=torch.float64) / I ** 0.5)
        if bias:  # (an output bias every rank would hold whole)
            self.down_bias = nn.Parameter(torch.randn(E, H, dtype=torch.float64))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate_up, down = self.gate_up_proj[e], self.down_proj[e]
            if self.transposed:
                gate_up, down = gate_up.t(), down.t()
            gate, up = F.linear(hidden[token], gate_up).chunk(2, dim=-1)
            bias = self.down_bias[e] if hasattr(self, "down_bias") else None
            y = F.linear(F.silu(gate) * up, down, bias) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


class RoutedExperts(Experts):
    """:class:`Experts` that run only the experts some token is routed to, as transformers' loop
    does (its ``expert_hit``): where no route reaches them, neither their weights nor the tokens are
    used."""

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            if e == self.num_experts:  # (a route to an expert held elsewhere)
                continue
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e], self.down_bias[e]) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


class ClampedExperts(Experts):
    """:class:`Experts` that run every route, as transformers' batched experts do (``batched_mm``):
    an id past the last expert (a route to an expert held elsewhere) is clamped to the last and
    its product kept, relying on its routing weight being zero there, which expert parallelism
    gives it."""

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for slot in range(top_k_index.shape[-1]):
            ids = top_k_index[:, slot].clamp(max=self.num_experts - 1)
            gate, up = torch.einsum("th,tih->ti", hidden, self.gate_up_proj[ids]).chunk(2, dim=-1)
            y = torch.einsum("ti,thi->th", F.silu(gate) * up, self.down_proj[ids]) + self.down_bias[ids]
            out = out + y * top_k_weights[:, slot, None]
        return out


STYLES = {False: {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"},
          True: {"gate_up_proj": "packed_rowwise", "down_proj": "colwise"}}
#: each split: (the module's layout, transposed; whether it has an output bias; the styles)
SPLITS = {"packed_colwise": (False, False, STYLES[False]), "packed_rowwise": (True, False, STYLES[True]),
          # (the output bias whole, added by rank 0: "rowwise", a 2-D bias of the summed outputs)
          "packed_colwise_bias": (False, True, {**STYLES[False], "down_bias": "rowwise"}),
          "packed_rowwise_bias": (True, True, {**STYLES[True], "down_bias": "rowwise"}),
          "experts": (False, True, {"gate_up_proj": "experts", "down_proj": "experts", "down_bias": "experts"})}


def routed(seed: int, device="cpu"):
    """Tokens, the experts each is routed to, and their weights (differentiable), alike on every rank."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, H, generator=g, dtype=torch.float64).to(device).requires_grad_()
    logits = torch.randn(TOKENS, E, generator=g, dtype=torch.float64).to(device).requires_grad_()
    weights, index = logits.softmax(-1).topk(TOP, dim=-1)
    return hidden, logits, index, weights


def _assert_expert_grads(par, dense, styles) -> None:
    """The full gradients of ``par``'s split expert weights (``styles``) are ``dense``'s."""
    grads = full_grads(par)
    for name in styles:
        torch.testing.assert_close(grads[name], getattr(dense, name).grad, rtol=1e-12, atol=1e-13,
                                   msg=lambda m: f"{name}.grad: {m}")


def check_experts_against_dense(split, device="cpu", module=Experts):
    """Each rank holds its block of every expert (of the gate and of the up projection each, packed
    in one parameter), or (``"experts"``) whole experts of its own, ``E/p`` of them, with their
    biases; the summed output, and the gradients of the hidden states, of the router's logits
    (through the routing weights) and of the full expert weights, are the dense module's: also
    for experts that run the routes to experts held elsewhere (``module``
    :class:`ClampedExperts`), whose weights there are zero."""
    r, p = rank_world()
    transposed, bias, styles = SPLITS[split]
    torch.manual_seed(0)
    dense = module(transposed, bias).to(device)
    par = shard_experts(copy.deepcopy(dense), styles)
    for name, (dim, how) in par.parameter_splits.items():  # this rank's block of the gate's, and of the up's
        param, want = getattr(par, name), getattr(dense, name).detach()
        parts = want.split(how.split_parts, dim)
        assert torch.equal(param, torch.cat([part.chunk(p, dim)[r] for part in parts], dim)), name
    assert par.num_experts == (E // p if split == "experts" else E)
    # a frozen weight stays frozen; with one rank each parameter is its own block, the same object
    frozen = copy.deepcopy(dense)
    held = dict(frozen.named_parameters(recurse=False))
    first = next(iter(par.parameter_splits))
    held[first].requires_grad_(False)
    frozen = shard_experts(frozen, styles)
    assert not getattr(frozen, first).requires_grad and all(
        getattr(frozen, name).requires_grad for name in frozen.parameter_splits if name != first)
    assert all((getattr(frozen, name) is held[name]) == (p == 1) for name in frozen.parameter_splits)
    outs = []
    for model in (dense, par):
        hidden, logits, index, weights = routed(1, device)
        y = model(hidden, index, weights)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=device).view_as(y)).sum().backward()
        outs.append((y.detach(), hidden.grad, logits.grad))
    for name, want, got in zip(("output", "hidden.grad", "logits.grad"), *outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
    full = tp_kernels.full_state_dict(par)
    for name in styles:
        assert torch.equal(full[name], getattr(dense, name).detach()), name
    _assert_expert_grads(par, dense, styles)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("split", list(SPLITS))
def test_experts_against_dense(world, split):
    world.run(check_experts_against_dense, split)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_experts_that_run_every_route_against_dense(world):
    world.run(check_experts_against_dense, "experts", "cpu", ClampedExperts)


def check_experts_partial_output(split):
    """``partial_output=True``: each rank's output is its partial sum, which the group's sum makes
    the dense module's output, and with the output's gradient whole on every rank the gradients of
    the hidden states, of the router's logits and of the expert weights are the dense module's;
    with sequence parallelism, or not a bool, it is a ValueError."""
    r, p = rank_world()
    transposed, bias, styles = SPLITS[split]
    torch.manual_seed(0)
    dense = Experts(transposed, bias)
    par = shard_experts(copy.deepcopy(dense), styles, partial_output=True)
    outs = []
    for model in (dense, par):
        hidden, logits, index, weights = routed(1)
        y = model(hidden, index, weights)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        outs.append((y.detach(), hidden.grad, logits.grad))
    summed = outs[1][0].clone()
    if p > 1:
        dist.all_reduce(summed)
        assert not torch.allclose(outs[1][0], outs[0][0]), "each rank's output is the whole sum"
    for name, want, got in zip(("output", "hidden.grad", "logits.grad"), outs[0], (summed, *outs[1][1:])):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
    _assert_expert_grads(par, dense, styles)
    with pytest.raises(ValueError, match=r"partial_output: experts under sequence parallelism reduce-scatter their "
                                         r"output themselves"):
        shard_experts(copy.deepcopy(dense), styles, partial_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"partial_output: expected a bool, got 'yes'"):
        shard_experts(copy.deepcopy(dense), styles, partial_output="yes")


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("split", ["packed_colwise", "packed_colwise_bias", "experts"])
def test_experts_partial_output(world, split):
    world.run(check_experts_partial_output, split)


def check_whole_bias_after_a_failed_call():
    """The output bias kept whole, added by one rank (``"rowwise"`` of a 2-D ``[experts, out]``
    bias): a call whose forward raises (tokens of the wrong width) leaves it the module's own
    parameter on every rank, and the next call is the dense module's."""
    r, p = rank_world()
    transposed, bias, styles = SPLITS["packed_colwise_bias"]
    torch.manual_seed(0)
    dense = Experts(transposed, bias)
    par = shard_experts(copy.deepcopy(dense), styles)
    held = par.down_bias
    hidden, _, index, weights = routed(1)
    with pytest.raises(RuntimeError):
        par(hidden[:, :-1], index, weights)
    assert par._parameters["down_bias"] is held, type(par._parameters["down_bias"])
    torch.testing.assert_close(par(hidden, index, weights), dense(hidden, index, weights), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_whole_bias_after_a_failed_call(world):
    world.run(check_whole_bias_after_a_failed_call)


def check_rank_without_routes(device="cpu"):
    """Expert parallelism where every token is routed to rank 0's experts, and the other ranks'
    experts, which run only the experts routed to (:class:`RoutedExperts`), use neither their
    weights nor the tokens: the backward still sums the hidden states' and routing weights'
    gradients on every rank (without which the ranks' collectives no longer match, and the group
    aborts), and every rank's expert weights get a gradient, zero where no route reached them, as
    the dense module's; the output and every gradient are the dense module's, and an SGD step with
    momentum and weight decay gives its weights."""
    r, p = rank_world()
    torch.manual_seed(0)
    dense = RoutedExperts(bias=True).to(device)
    par = shard_experts(copy.deepcopy(dense), SPLITS["experts"][2])
    c = -(-E // p)
    outs = []
    for model in (dense, par):
        hidden, logits, _, _ = routed(1, device)
        weights, index = logits[:, :c].softmax(-1).topk(min(TOP, c), dim=-1)  # (experts [0, c): rank 0's)
        y = model(hidden, index, weights)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=device).view_as(y)).sum().backward()
        outs.append((y.detach(), hidden.grad, logits.grad))
    for name, want, got in zip(("output", "hidden.grad", "logits.grad"), *outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
    for name, q in par.named_parameters():
        assert q.grad is not None, f"{name}: no gradient on rank {r}"
    grads = full_grads(par)
    for name, q in dense.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}.grad: {m}")
    for model in (dense, par):
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1).step()
    full = tp_kernels.full_state_dict(par)
    for name, q in dense.named_parameters():
        torch.testing.assert_close(full[name], q.detach(), rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_rank_without_routes(world):
    world.run(check_rank_without_routes)


class _SharedExperts(nn.Module):
    """Shared experts kept as 3-D parameters and run on every token with a per-token gate each
    (Inkling's): ``gate_proj`` and ``up_proj`` ``[n, I, H]``, ``down_proj`` ``[n, H, I]``."""

    def __init__(self, n=2):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(n, I, H, dtype=torch.float64) / H ** 0.5)
        self.up_proj = nn.Parameter(torch.randn(n, I, H, dtype=torch.float64) / H ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(n, H, I, dtype=torch.float64) / I ** 0.5)

    def forward(self, hidden, gammas):
        x = hidden.unsqueeze(0).expand(self.gate_proj.shape[0], -1, -1)
        activated = F.silu(torch.bmm(x, self.gate_proj.transpose(1, 2))) * torch.bmm(x, self.up_proj.transpose(1, 2))
        return torch.bmm(activated * gammas.t().unsqueeze(-1), self.down_proj.transpose(1, 2)).sum(0)


def check_all_reduce_style():
    """transformers' ``"all_reduce"`` (Inkling's shared experts: 3-D weights split by parameter
    name, each rank's output a partial sum) is what ``"moe_tp_experts"`` does: the output and the
    gradients of the hidden states, of the gates and of the weights are the dense module's; on a
    module holding parameters the plan does not split, it is refused."""
    torch.manual_seed(0)
    dense = nn.ModuleDict({"shared": _SharedExperts()})
    plan = {"shared": "all_reduce", "shared.gate_proj": "colwise", "shared.up_proj": "colwise",
            "shared.down_proj": "rowwise"}
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    outs = []
    for model in (dense, par):
        hidden, _, _, _ = routed(1)
        gammas = torch.rand(TOKENS, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        gammas.requires_grad_()
        y = model["shared"](hidden, gammas)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        outs.append((y.detach(), hidden.grad, gammas.grad))
    for name, want, got in zip(("output", "hidden.grad", "gammas.grad"), *outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
    assert_dense_grads(par, dense, 1e-12)
    with pytest.raises(ValueError, match=r"plan: 'shared' \('moe_tp_experts'\): styles: _SharedExperts also holds "
                                         r"\['down_proj'\]"):
        tp_kernels.parallelize(copy.deepcopy(dense), {k: v for k, v in plan.items() if k != "shared.down_proj"})


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_all_reduce_style(world):
    world.run(check_all_reduce_style)


def check_experts_sequence_parallel(split, device="cpu"):
    """Under sequence parallelism each rank holds a block of the tokens, and the router's ids and
    weights for it (a router run on its sequence block): the experts, split either way, gather
    them and reduce-scatter their output, so each rank gets its block of the dense output, and its
    block of the gradients of the hidden states and of the router's logits; the expert weights'
    gradients, joined, are the dense ones. Arguments of other token counts, or of no dim 0, are
    named."""
    r, p = rank_world()
    transposed, bias, styles = SPLITS[split]
    torch.manual_seed(0)
    dense = Experts(transposed, bias).to(device)
    par = shard_experts(copy.deepcopy(dense), styles, sequence_parallel=True)
    g = torch.Generator().manual_seed(1)
    tokens = 3 * p
    hidden = torch.randn(tokens, H, generator=g, dtype=torch.float64).to(device)
    logits = torch.randn(tokens, E, generator=g, dtype=torch.float64).to(device)
    scale = torch.linspace(-1, 1, tokens * H, dtype=torch.float64, device=device).view(tokens, H)
    mine = slice(3 * r, 3 * r + 3)
    outs = []
    for model, rows in ((dense, slice(None)), (par, mine)):
        x, z = hidden[rows].clone().requires_grad_(), logits[rows].clone().requires_grad_()
        weights, index = z.softmax(-1).topk(TOP, dim=-1)
        y = model(x, index, weights)
        (y * scale[rows]).sum().backward()
        outs.append((y.detach(), x.grad, z.grad))
    for name, want, got in zip(("output", "hidden.grad", "logits.grad"), *outs):
        torch.testing.assert_close(got, want[mine], rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
    _assert_expert_grads(par, dense, styles)
    with pytest.raises(ValueError, match=r"every tensor argument must be this rank's block of the tokens, along "
                                         r"dim 0, but they are args\[0\] \[3, 6\] .*args\[1\] \[2, 2\]"):
        par(hidden[mine], index[:2], weights[:2])
    with pytest.raises(ValueError, match=r"every tensor argument must be this rank's block of the tokens, along "
                                         r"dim 0, but they are args\[0\] \[\] float64"):  # (no dim 0 at all)
        par(hidden[mine][0, 0], index[0, 0], weights[0, 0])


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("split", ["packed_colwise", "packed_colwise_bias", "experts"])
def test_experts_sequence_parallel(world, split):
    world.run(check_experts_sequence_parallel, split)


class _SequenceFirstMoE(nn.Module):
    """A small language model of our own, sequence first (ids ``[s, b]``): an embedding, a layer
    norm, a router and experts (and the residual), and an output layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, H, dtype=torch.float64)
        self.norm = nn.LayerNorm(H, dtype=torch.float64)
        self.router = nn.Linear(H, E, bias=False, dtype=torch.float64)
        self.experts = Experts(bias=True)
        self.head = nn.Linear(H, 16, dtype=torch.float64)

    def forward(self, ids):
        x = self.embed(ids)
        tokens = self.norm(x).reshape(-1, H)
        weights, index = self.router(tokens).softmax(-1).topk(TOP, dim=-1)
        return self.head(x + self.experts(tokens, index, weights).view_as(x))


def check_parallelize_moe_sequence_parallel(split):
    """``parallelize(..., sequence_parallel=True)`` of a sequence-first mixture of experts: the
    embedding's output is each rank's sequence block, on which the norm and the router run; the
    experts (either split) gather the tokens and reduce-scatter their output; the output layer
    gathers the sequence. The logits, and every gradient (the norm's and the router's summed with
    ``allreduce_sequence_parallel_grads``), are the dense model's."""
    _, p = rank_world()
    torch.manual_seed(0)
    dense = _SequenceFirstMoE()
    styles = SPLITS[split][2]
    if "down_bias" not in styles:
        del dense.experts.down_bias
    experts_style = "moe_ep_experts" if split == "experts" else "moe_tp_experts"
    plan = {"embed": "vocab", "experts": experts_style, "head": "colwise_gather_output",
            **{f"experts.{name}": style for name, style in styles.items()}}
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan, sequence_parallel=True)
    ids = torch.randint(0, 16, (2 * p, 3), generator=torch.Generator().manual_seed(1))
    want, got = dense(ids), par(ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want.square().sum().backward()
    got.square().sum().backward()
    tp_kernels.allreduce_sequence_parallel_grads([*par.norm.parameters(), *par.router.parameters()])
    assert_dense_grads(par, dense, 1e-12)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("split", ["packed_colwise", "packed_colwise_bias", "experts"])
def test_parallelize_moe_sequence_parallel(world, split):
    world.run(check_parallelize_moe_sequence_parallel, split)


def _moe_model(kind: str, moe_intermediate: int = 8, experts: int = 4, implementation: Optional[str] = None):
    """A small transformers mixture of experts of ``experts`` routed experts, float64, its experts
    run by transformers' plain loop (``experts_implementation="eager"``: its grouped GEMM takes no
    float64) where that loop skips the routes to experts held elsewhere, as expert parallelism needs
    (transformers 5.18 on), else by its batched GEMM (``"batched_mm"``); or by ``implementation``."""
    import transformers

    if implementation is None:
        implementation = "eager" if experts_module._transformers_version() >= \
            experts_module.LOOP_SKIPS_ELSEWHERE_SINCE else "batched_mm"
    common = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=64, attn_implementation="sdpa", experts_implementation=implementation)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=moe_intermediate, num_local_experts=experts,
                                            num_experts_per_tok=2, **common)
        model_class = transformers.MixtralForCausalLM
    elif kind == "qwen3_moe":  # (its first layer a dense MLP)
        config = transformers.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=moe_intermediate,
                                             num_experts=experts, num_experts_per_tok=2, head_dim=4, mlp_only_layers=[0],
                                             **common)
        model_class = transformers.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":  # (a shared expert beside the routed ones, its output gated; a dense first layer)
        config = transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=moe_intermediate,
                                             shared_expert_intermediate_size=12, num_experts=experts,
                                             num_experts_per_tok=2, mlp_only_layers=[0], **common)
        model_class = transformers.Qwen2MoeForCausalLM
    elif kind == "qwen3_next":  # a gated shared expert its plan splits; linear attention in its first layer (its
        # values 8 wide, not the hidden size: the collectives of sequence_parallel_plan's test are told by size)
        config = transformers.Qwen3NextConfig(
            intermediate_size=24, moe_intermediate_size=moe_intermediate, shared_expert_intermediate_size=12,
            num_experts=experts, num_experts_per_tok=2, head_dim=4, linear_num_value_heads=4, linear_num_key_heads=4,
            linear_key_head_dim=4, linear_value_head_dim=2, layer_types=["linear_attention", "full_attention"],
            **common)
        model_class = transformers.Qwen3NextForCausalLM
    elif kind == "deepseek_v2":  # multi-head latent attention split over the ranks, its rotary key shared
        config = transformers.DeepseekV2Config(
            intermediate_size=24, moe_intermediate_size=moe_intermediate, n_routed_experts=experts, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, **common)
        model_class = transformers.DeepseekV2ForCausalLM
    elif kind == "longcat_flash":  # two identity ("zero-computation") experts among the routed ones
        config = transformers.LongcatFlashConfig(
            ffn_hidden_size=24, num_layers=1, expert_ffn_hidden_size=moe_intermediate, n_routed_experts=4,
            zero_expert_num=2, moe_topk=2, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            head_dim=4, v_head_dim=4, **{k: v for k, v in common.items() if k != "num_hidden_layers"})
        model_class = transformers.LongcatFlashForCausalLM
    else:  # DeepSeek-V3: a dense first layer, a shared expert beside the routed ones
        config = transformers.DeepseekV3Config(
            intermediate_size=24, moe_intermediate_size=moe_intermediate, n_routed_experts=experts, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=8, kv_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, **common)
        model_class = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return model_class(config).double()


def _ep_plan(model: nn.Module) -> dict:
    """A transformers model's expert-parallel plan: its ``ep_plan``, or in transformers versions
    without that property (5.17), its ``_ep_plan`` over its config's base-model entries."""
    if hasattr(type(model), "ep_plan"):
        return dict(model.ep_plan)
    config_plan = getattr(model.config, "base_model_ep_plan", None) or {}
    return {**{f"{model.base_model_prefix}.{k}": v for k, v in config_plan.items()},
            **(getattr(model, "_ep_plan", None) or {})}


def _plan(model: nn.Module, parallelism: str) -> dict:
    """A transformers model's own plan: ``"tp"``, its ``tp_plan`` (its experts ``"moe_tp_experts"``,
    their ``gate_up_proj`` ``"packed_colwise"`` and ``down_proj`` ``"rowwise"`` by parameter name);
    ``"ep"``, its ``ep_plan`` over it (its experts ``"ep_dispatch_experts"``, their weights
    ``"grouped_gemm"``: whole experts a rank; in transformers 5.17, the experts' tp_plan entry kept
    and their router ``"ep_router"``); ``"ep_router"``, that 5.17 form whatever the version."""
    if parallelism == "tp":
        plan = dict(model.tp_plan)
    else:
        plan = {**model.tp_plan, **_ep_plan(model)}
        for pattern, style in list(plan.items()):
            if parallelism == "ep_router" and style == "ep_dispatch_experts":
                plan[pattern] = model.tp_plan[pattern]
                plan[pattern.rpartition(".")[0] + ".gate"] = "ep_router"
    want = {"tp": {"moe_tp_experts", "packed_colwise", "rowwise"}, "ep": {"grouped_gemm"},
            "ep_router": {"moe_tp_experts", "grouped_gemm"}}
    assert want[parallelism] <= {plan[k] for k in plan if ".experts" in k}, plan
    assert parallelism != "ep_router" or "ep_router" in plan.values(), plan
    return plan


def check_hugging_face_moe(kind, parallelism="tp", experts=4):
    """A transformers mixture of experts parallelized by its own plan (:func:`_plan`: its experts
    split by hidden units, or whole experts a rank, ``ceil(experts/p)`` of them, padded with zero
    experts where p does not divide ``experts``): the logits and loss are the dense model's in
    float64, so is the gradient of every parameter and the norm ``clip_grad_norm_`` takes of it,
    and greedy generation gives the dense model's tokens.

    Mixtral's and DeepSeek-V3's routers compute their softmax in float32, so the routing weights'
    gradient is rounded to float32, on each rank its share of it before the sum: what depends on
    it is held to float32's precision of its magnitude (Qwen 3's router casts back: float64).

    DeepSeek-V2's attention is split too (its plan names both ``q_proj`` and ``q_b_proj``, of which
    a model has one: ``strict=False``), and the rotary key part of ``kv_a_proj_with_mqa``'s output,
    which every rank's heads use, has its gradient summed (``"mla_kv_a_proj"``): without that sum
    the projection's gradient is not the dense one's. LongCat-Flash routes tokens to identity
    experts too (``"moe_identity_expert"``: their input divided by p, for the sum over the
    group). Qwen 3 Next's plan splits its gated shared expert, and names a dense MLP beside the
    mixture that none of its layers holds here (``strict=False``); its linear attention's
    projections are gathered whole."""
    r, p = rank_world()
    dense = _moe_model(kind, experts=experts)
    plan = _plan(dense, parallelism)
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan, strict=kind not in ("deepseek_v2", "qwen3_next"))
    if parallelism == "ep" and p > 1:  # (rank r: experts [r c, (r+1) c) of the dense model's, then zero ones)
        c = -(-experts // p)
        for dense_layer, layer in zip(dense.model.layers, par.model.layers):
            if hasattr(layer.mlp, "experts"):
                assert layer.mlp.experts.num_experts == c
                for name, q in layer.mlp.experts.named_parameters():
                    want = dense_layer.mlp.experts.get_parameter(name)[r * c:(r + 1) * c]
                    assert torch.equal(q[:len(want)], want) and not q[len(want):].any(), name
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    identity_tokens = []  # (LongCat's identity experts drew tokens: what their style is for)
    for layer in dense.model.layers if kind == "longcat_flash" else ():
        layer.mlp.experts.identity_expert.register_forward_hook(lambda m, a, out: identity_tokens.append(len(out)))
    assert_same_loss_and_backward(dense, par, ids)
    assert sum(identity_tokens) > 0 or kind != "longcat_flash", identity_tokens
    for name, q in par.named_parameters():  # (a rank whose experts no route reached too: zeros, as the dense model's)
        assert q.grad is not None, f"{name}: no gradient on rank {r}"
    eps = 1e-12 if kind == "qwen3_moe" else 4 * torch.finfo(torch.float32).eps
    total = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in dense.parameters()]))
    torch.testing.assert_close(tp_kernels.clip_grad_norm_(par, 1e9), total, rtol=eps, atol=0)
    assert_dense_grads(par, dense, eps)
    if kind == "deepseek_v2" and p > 1 and parallelism == "tp":  # why: the rotary key's gradient, each rank's heads' share
        unsummed = tp_kernels.parallelize(copy.deepcopy(dense), {k: v for k, v in plan.items() if v != "mla_kv_a_proj"},
                                          strict=False)
        unsummed(ids, labels=ids).loss.backward()
        name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        grad = dense.get_parameter(name).grad
        off = (full_grads(unsummed)[name] - grad).abs().max().item()
        assert off > 100 * eps * grad.abs().max().item(), off
    if kind == "mixtral":
        par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
        with torch.no_grad():
            tokens = [model.generate(ids, max_new_tokens=4, do_sample=False) for model in (dense, par)]
        assert torch.equal(tokens[0], tokens[1]), tokens


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe", "qwen3_next", "deepseek_v2", "deepseek_v3",
                                  "longcat_flash"])
def test_hugging_face_moe(world, kind):
    if kind == "qwen2_moe":
        skip_unless_own_plan("Qwen2MoeConfig", "layers.*.mlp.experts", "moe_tp_experts")
    if kind == "qwen3_next":
        skip_unless_own_plan("Qwen3NextConfig", "layers.*.mlp.shared_expert.down_proj", "rowwise")
    world.run(check_hugging_face_moe, kind)


def check_plain_loop_without_the_skip():
    """Whole experts a rank run by transformers' plain loop in a version whose loop does not skip
    the id of a route to an expert held elsewhere (the installed version read as 5.17 here): the
    plan is a ValueError naming the experts and the implementations that skip it, before anything
    changes; experts sharded under one of those and switched to the loop afterwards, a ValueError on
    every rank at the call, before the loop runs (where on a GPU its out-of-range id is a device-side
    assert that ends the process's CUDA context). The batched GEMM then gives the dense logits."""
    from unittest import mock

    dense = _moe_model("mixtral", implementation="eager")
    model = copy.deepcopy(dense)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    with mock.patch.object(experts_module, "_transformers_version", return_value=(5, 17)):
        with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts'.*MixtralExperts runs transformers "
                                             r".*plain loop.*'eager'.*'batched_mm' or 'grouped_mm'.*5\.18 or later"):
            tp_kernels.parallelize(model, _plan(dense, "ep"))
        experts = model.model.layers[0].mlp.experts
        assert experts.num_experts == 4 and experts.gate_up_proj.shape[0] == 4  # (unchanged)
        model.set_experts_implementation("batched_mm")
        par = tp_kernels.parallelize(model, _plan(dense, "ep"))
        assert_close("logits", par(ids).logits, dense(ids).logits)
        par.set_experts_implementation("eager")
        with pytest.raises(ValueError, match=r"MixtralExperts \(experts sharded by shard_experts\): MixtralExperts "
                                             r"runs transformers .*plain loop"):
            par(ids)
        par.set_experts_implementation("batched_mm")
        assert_close("logits", par(ids).logits, dense(ids).logits)


def test_plain_loop_without_the_skip(world2):
    pytest.importorskip("transformers")
    world2.run(check_plain_loop_without_the_skip)


def _gpt_oss(experts: str, intermediate: int = 8):
    """A small GPT-OSS (4 heads, 2 key/value heads, a sliding and a full attention layer, 4 experts
    with biases) in float64, its experts run by ``experts`` (an ``experts_implementation``)."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=32, hidden_size=16, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        attn_implementation="eager", experts_implementation=experts, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(config).double()


def check_gpt_oss_loop_without_the_skip():
    """GPT-OSS's experts (their biases too) whole a rank by its own plans, ``{**tp_plan,
    **ep_plan}``: its plain loop, which in every version so far counts ``num_experts`` classes in
    its one_hot, is a ValueError naming it before anything changes; its batched GEMM gives the
    dense logits in float64."""
    dense = _gpt_oss("eager")
    plan = {**dense.tp_plan, **_ep_plan(dense)}
    model = copy.deepcopy(dense)
    with pytest.raises(ValueError, match=r"GptOssExperts's plain loop of experts \(experts_implementation='eager'\) "
                                         r"does not skip .*'batched_mm' or 'grouped_mm'"):
        tp_kernels.parallelize(model, plan)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # (unchanged)
    model.set_experts_implementation("batched_mm")
    par = tp_kernels.parallelize(model, plan)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    assert_close("logits", par(ids).logits, dense(ids).logits)


#: GPT-OSS's attention and experts split, where its own plan splits the embedding alone: its heads
#: (their sinks, "local_params", as the heads), its experts whole a rank with their biases
GPT_OSS_PLAN = {"model.embed_tokens": "embedding_rowwise",
                **{f"model.layers.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")},
                "model.layers.*.self_attn.o_proj": "rowwise",
                "model.layers.*.self_attn": "local_params", "model.layers.*.self_attn.sinks": "colwise",
                "model.layers.*.mlp.experts": "moe_ep_experts",
                **{f"model.layers.*.mlp.experts.{name}": "experts"
                   for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")},
                "lm_head": "colwise_gather_output"}


#: the same, its experts split by hidden units, every rank a block of each (vLLM's default for it):
#: its weights are transposed, [experts, in, out], so "rowwise" splits the gate's and up projection's
#: outputs (interleaved, in whole pairs) and "colwise" the down projection's inputs; their biases,
#: [experts, out], "colwise" split as those outputs, "rowwise" whole, added by one rank
GPT_OSS_HIDDEN_UNITS_PLAN = {**{k: v for k, v in GPT_OSS_PLAN.items() if ".mlp.experts" not in k},
                             "model.layers.*.mlp.experts": "moe_tp_experts",
                             "model.layers.*.mlp.experts.gate_up_proj": "rowwise",
                             "model.layers.*.mlp.experts.gate_up_proj_bias": "colwise",
                             "model.layers.*.mlp.experts.down_proj": "colwise",
                             "model.layers.*.mlp.experts.down_proj_bias": "rowwise"}


def check_gpt_oss_attention_and_experts(sequence, experts):
    """GPT-OSS by :data:`GPT_OSS_PLAN` (on 4 ranks its 2 key/value heads one a rank pair,
    replicated), or :data:`GPT_OSS_HIDDEN_UNITS_PLAN` (its experts run by its plain loop or by the
    batched GEMM), or under sequence parallelism by :func:`tp_kernels.sequence_parallel_plan` of
    either: its logits, every gradient (the sinks', the experts' biases') and their norm are the
    dense model's in float64. Split by hidden units, its interleaved gate and up outputs packed apart, or in
    blocks of half pairs, are a ``ValueError``."""
    r, p = rank_world()
    hidden_units = experts != "whole"
    dense = _gpt_oss(experts if hidden_units else "batched_mm")
    plan = dict(GPT_OSS_HIDDEN_UNITS_PLAN if hidden_units else GPT_OSS_PLAN)
    if hidden_units and p > 1:
        packed = {**plan, "model.layers.*.mlp.experts.gate_up_proj": "packed_rowwise"}
        with pytest.raises(ValueError, match=r"GptOssExperts interleaves its gate's and its up projection's columns "
                                             r"in 'gate_up_proj' .*use 'rowwise'"):
            tp_kernels.parallelize(copy.deepcopy(dense), packed)
        halves = _gpt_oss(experts, intermediate=6).model.layers[0].mlp.experts  # (12 columns: 3 a rank of 4)
        with pytest.raises(ValueError, match=r"dim 2 of 'gate_up_proj' \(12, interleaved gate and up columns\) cannot "
                                             r"be split into 4 blocks of whole \(gate, up\) pairs"):
            check_styles(halves, {"gate_up_proj": "rowwise"}, 4, every=False)
        # (and so its bias, [experts, out]: the same outputs, interleaved)
        with pytest.raises(ValueError, match=r"dim 1 of 'gate_up_proj_bias' \(12, interleaved gate and up values\) "
                                             r"cannot be split into 4 blocks of whole \(gate, up\) pairs"):
            check_styles(halves, {"gate_up_proj_bias": "colwise"}, 4, every=False)
        with pytest.raises(ValueError, match=r"GptOssExperts interleaves its gate's and its up projection's values "
                                             r"in 'gate_up_proj_bias' .*use 'colwise'"):
            check_styles(halves, {"gate_up_proj_bias": "packed_colwise"}, 2, every=False)
    if p > 2:
        for name in ("k_proj", "v_proj"):
            plan[f"model.layers.*.self_attn.{name}"] = ("colwise", [8], 4)
    if sequence:
        plan = tp_kernels.sequence_parallel_plan(dense, plan)
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    assert par.model.layers[0].self_attn.sinks.shape == (4 // p,)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_backward(dense, par, ids)
    assert_dense_grads(par, dense, 1e-12)
    torch.testing.assert_close(tp_kernels.clip_grad_norm_(par, 1e9),
                               torch.nn.utils.clip_grad_norm_(dense.parameters(), 1e9), rtol=1e-12, atol=0)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("sequence", [False, True], ids=["tensor", "sequence"])
@pytest.mark.parametrize("experts", ["whole", "eager", "batched_mm"])
def test_gpt_oss_attention_and_experts(world, sequence, experts):
    pytest.importorskip("transformers")
    world.run(check_gpt_oss_attention_and_experts, sequence, experts)


def test_gpt_oss_loop_without_the_skip(world2):
    skip_unless_own_plan("GptOssConfig", "layers.*.mlp.experts", "ep_dispatch_experts", plan="base_model_ep_plan")
    world2.run(check_gpt_oss_loop_without_the_skip)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("kind, parallelism", [("mixtral", "ep"), ("qwen3_moe", "ep"), ("deepseek_v3", "ep"),
                                               ("mixtral", "ep_router"), ("deepseek_v3", "ep_router")])
def test_hugging_face_moe_expert_parallel(world, kind, parallelism):
    """Whole experts a rank, by the model's ep_plan over its tp_plan, or by that plan in the form of
    transformers 5.17 (its experts' tp_plan entry kept, their router "ep_router")."""
    world.run(check_hugging_face_moe, kind, parallelism)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_hugging_face_moe_uneven_experts(world, kind):
    """5 experts (Qwen2-MoE's 60 do not divide by 8 either): 3 and 2 on 2 ranks (the second's block
    padded by a zero expert); 2, 2, 1 and none on 4 (the last rank's block all padding, so it holds
    no expert of the model)."""
    world.run(check_hugging_face_moe, kind, "ep", 5)


def check_moe_checkpoint_across_sizes(path, parallelism="tp", experts=4):
    """A mixture of experts parallelized over every rank takes an Adam step and saves
    ``sharded_state_dict`` and ``sharded_optimizer_state_dict`` with torch.distributed.checkpoint
    (each packed expert weight, and its moments, as its gate's and its up projection's entries,
    ``"...gate_up_proj[dim1][0]"`` and ``[1]``; whole experts a rank, ``"ep"``, as one entry of
    which each rank holds rows, without the padding that ends the last ranks' blocks where p does
    not divide ``experts``); offline, ``dense_state_dict`` of the checkpoint is the dense
    model's weights and Adam moments; the same model over half the ranks loads both and holds the
    dense weights and moments. (Qwen 3 MoE: its gradients are float64's throughout.) ``"gpt_oss"``:
    GPT-OSS's experts split by hidden units, their biases split or whole (added by one rank)."""
    import torch.distributed as dist
    from test_parallelize import _assert_dense_checkpoint, _assert_dense_moments, _load_with_dcp, _save_with_dcp

    r, p = rank_world()

    def build():
        return _gpt_oss("eager") if parallelism == "gpt_oss" else _moe_model("qwen3_moe", experts=experts)

    dense = build()
    plan = {**GPT_OSS_HIDDEN_UNITS_PLAN, **{f"model.layers.*.self_attn.{name}": ("colwise", [8], 4)
                                           for name in ("k_proj", "v_proj")}} \
        if parallelism == "gpt_oss" else _plan(dense, parallelism)
    wide = tp_kernels.parallelize(copy.deepcopy(dense), plan)
    entries = tp_kernels.sharded_state_dict(wide)
    if parallelism != "gpt_oss":
        packed = "model.layers.1.mlp.experts.gate_up_proj"
        assert ([k for k in entries if k.startswith(packed)] == [f"{packed}[dim1][0]", f"{packed}[dim1][1]"]
                if p > 1 and parallelism == "tp" else packed in entries), list(entries)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    lr, eps = 0.1, 1e-8
    opts = [torch.optim.Adam(model.parameters(), lr=lr, eps=eps) for model in (dense, wide)]
    for model in (dense, wide):
        model(ids, labels=ids).loss.backward()
    atol = adam_atol(lr, adam_drift(wide, dense, eps), steps=1)  # (a key bias's gradient is rounding alone)
    for opt in opts:
        opt.step()
    _save_with_dcp(wide, opts[1], f"{path}/moe")
    dist.barrier()
    if r == 0:
        _assert_dense_checkpoint(f"{path}/moe", dense, opts[0], atol=atol)
    tp_kernels.initialize_model_parallel(max(p // 2, 1))
    try:
        torch.manual_seed(1)
        narrow = tp_kernels.parallelize(build().apply(_reset), plan)
        narrow_opt = _load_with_dcp(narrow, f"{path}/moe")
        full = tp_kernels.full_state_dict(narrow)
        for key, value in dense.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-10, atol=atol, msg=lambda m: f"{key}: {m}")
        _assert_dense_moments(narrow, narrow_opt, dense, opts[0])
    finally:
        tp_kernels.destroy_model_parallel()


def _reset(m: nn.Module) -> None:
    """Other weights than the dense model's (replaced by a load)."""
    with torch.no_grad():
        for q in m.parameters(recurse=False):
            q.normal_()


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("parallelism, experts", [("tp", 4), ("ep", 4), ("ep", 5), ("gpt_oss", 4)])
def test_moe_checkpoint_across_sizes(world, tmp_path, parallelism, experts):
    world.run(check_moe_checkpoint_across_sizes, str(tmp_path), parallelism, experts)


def check_expert_plan_errors():
    """Every plan the experts cannot be split by is a ValueError naming the pattern, the module or
    the parameter, raised before anything is replaced (the model still dense after each)."""

    _, p = rank_world()
    dense = _moe_model("mixtral", moe_intermediate=3)  # (3 hidden units: not split over 2 ranks)
    plan, experts = _plan(dense, "tp"), "model.layers.*.mlp.experts"
    # (whole experts as the ep_plan of transformers 5.18 on writes them, whatever the version)
    ep_plan = {**plan, experts: "ep_dispatch_experts", f"{experts}.gate_up_proj": "grouped_gemm",
               f"{experts}.down_proj": "grouped_gemm"}
    bad = {
        "gate_up_proj": ({**plan, f"{experts}.gate_up_proj": "packed_colwise"}, r"gate_up_proj.*3.*2 equal blocks"),
        "no_parameters": ({k: v for k, v in plan.items() if not k.startswith(f"{experts}.")},
                          r"moe_tp_experts', but the plan splits none of its parameters"),
        "owner_not_experts": ({k: v for k, v in plan.items() if k != experts},
                              r"split by parameter name.*does not name"),
        "vocab_on_parameter": ({**plan, f"{experts}.down_proj": "vocab"}, r"is a parameter, which takes one of"),
        "sizes_on_parameter": ({**plan, f"{experts}.down_proj": ("colwise", [6])},
                               r"down_proj' is a parameter, which takes one of .* not \('colwise'"),
        "parameter_matched_twice": ({**plan, "model.layers.0.mlp.experts.down_proj": "colwise"},
                                    r"plan: 'model.layers.0.mlp.experts.down_proj' is matched as 'colwise', but the "
                                    r"same parameter \('model.layers.0.mlp.experts.down_proj'\) as 'rowwise'"),
        "packed_rowwise_on_linear": ({**plan, "model.layers.*.self_attn.o_proj": "packed_rowwise"},
                                     r"splits a parameter .*o_proj' is a Linear"),
        "no_rope_dim": ({**plan, "model.layers.*.self_attn.k_proj": "mla_kv_a_proj"},
                        r"MixtralForCausalLM has no config.qk_rope_head_dim.*\('mla_kv_a_proj', columns\)"),
        "rope_dim_out_of_range": ({**plan, "model.layers.*.self_attn.k_proj": ("mla_kv_a_proj", 16)},
                                  r"k_proj' \('mla_kv_a_proj'\): the rotary key's columns must be an int in \[1, 16\)"),
        "rope_dim_no_int": ({**plan, "model.layers.*.self_attn.k_proj": ("mla_kv_a_proj", 4.0)},
                            r"the rotary key's columns must be an int in \[1, 16\) \(its out_features\), got 4.0"),
        "nothing_matched": ({**plan, "model.nothing.*": "colwise"}, r"'model.nothing.\*' matches no submodule.*strict"),
        "experts_split_both_ways_under_tp": ({**plan, f"{experts}.gate_up_proj": "grouped_gemm",
                                              f"{experts}.down_proj": "colwise"},
                                             r"\('moe_tp_experts'\): styles: \['gate_up_proj'\] split whole experts "
                                             r"\('experts'\) and \['down_proj'\] each"),
        "hidden_units_under_ep": ({**ep_plan, f"{experts}.down_proj": "colwise", f"{experts}.gate_up_proj": "rowwise"},
                                  r"\('moe_ep_experts'\): styles: expert parallelism splits whole experts: every style must be 'experts'"),
        "split_both_ways": ({**ep_plan, f"{experts}.down_proj": "colwise"},
                            r"\['gate_up_proj'\] split whole experts \('experts'\) and \['down_proj'\] each"),
        "ep_without_parameters": ({k: v for k, v in ep_plan.items() if not k.startswith(f"{experts}.")},
                                  r"moe_ep_experts', but .*gate_up_proj': 'experts'"),
        "gate_up_unpacked": ({**plan, f"{experts}.gate_up_proj": "colwise"},
                             r"styles\['gate_up_proj'\]: MixtralExperts keeps its gate's and its up projection's "
                             r"rows one after the other .* 'colwise' would give a rank gate rows or up rows.*"
                             r"use 'packed_colwise'"),
        "identity_outside_experts": ({**ep_plan, "model.layers.*.mlp.gate": "moe_identity_expert"},
                                     r"mlp.gate' \('moe_identity_expert'\) divides its input .*it is inside none"),
        "experts_output_unknown": ({**plan, experts: ("moe_tp_experts", "sum")},
                                   r"'moe_tp_experts' takes \('moe_tp_experts', 'partial'\) \(its output left each "
                                   r"rank's partial sum\), \('moe_tp_experts', 'sequence'\) \(called with each rank's "
                                   r"block of the tokens\) or 'moe_tp_experts' alone \(summed\), got "
                                   r"\('moe_tp_experts', 'sum'\)"),
    }
    for case, (bad_plan, message) in bad.items():
        if case == "gate_up_proj" and p == 1:
            continue  # (one rank holds it whole)
        model = copy.deepcopy(dense)
        with pytest.raises(ValueError, match=message):
            tp_kernels.parallelize(model, bad_plan)
        assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear, case  # nothing replaced
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), dense.parameters())), case
    with pytest.raises(ValueError, match=r"strict: expected a bool, got 'yes'"):
        tp_kernels.parallelize(copy.deepcopy(dense), plan, strict="yes")
    model = tp_kernels.parallelize(_moe_model("mixtral"), {**plan, "model.nothing.*": "colwise"}, strict=False)
    assert "parameter_splits" in model.model.layers[0].mlp.experts.__dict__  # (the rest of the plan applied)
    experts_module = copy.deepcopy(Experts(bias=True))
    with pytest.raises(ValueError, match=r"also holds \[.down_bias.\].*count once per rank"):
        check_styles(experts_module, STYLES[False], 2)
    with pytest.raises(ValueError, match=r"styles\['down_bias'\]: 'packed_rowwise' takes a 3-D one, a matrix "
                                         r"per expert \(\[experts, out, in\]\), but 'down_bias' has shape \[4, 6\]"):
        check_styles(experts_module, {**STYLES[False], "down_bias": "packed_rowwise"}, 2)
    with pytest.raises(ValueError, match=r"styles\['w'\]: Experts holds no parameter 'w'"):
        check_styles(experts_module, {"w": "rowwise"}, 2)
    with pytest.raises(ValueError, match=r"styles\['down_proj'\]: unknown style 'packed'"):
        check_styles(experts_module, {"down_proj": "packed"}, 2)
    attention = nn.Module()
    attention.sinks = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"styles\['sinks'\]: dim 0 of 'sinks' \(3\) cannot be split into 2 equal"):
        check_styles(attention, {"sinks": "colwise"}, 2, every=False)
    with pytest.raises(ValueError, match=r"'rowwise' takes a 2-D one.* or a 3-D one.*'sinks' has shape \[3\]"):
        check_styles(attention, {"sinks": "rowwise"}, 2, every=False)
    attention.scales = nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"styles\['scales'\]: 'rowwise' keeps a 2-D bias whole, added by one rank "
                                         r"of those whose outputs are summed, which only a mixture's experts' are"):
        check_styles(attention, {"scales": "rowwise"}, 2, every=False)
    longcat = _moe_model("longcat_flash")
    with pytest.raises(ValueError, match=r"experts' \('moe_tp_experts'\) holds the identity expert "
                                         r"'model.layers.0.mlp.experts.identity_expert', .*name it 'moe_identity_expert'"):
        tp_kernels.parallelize(longcat, {k: v for k, v in longcat.tp_plan.items() if v != "moe_identity_expert"})
    with_identity = nn.Sequential(Experts())
    with_identity[0].identity_expert = nn.Identity()
    with pytest.raises(ValueError, match=r"plan: '0' \('moe_ep_experts'\) holds the identity expert "
                                         r"'0.identity_expert', .*: expert parallelism leaves no rank to run it alone; "
                                         r"split these experts by hidden units"):
        tp_kernels.parallelize(with_identity, {"0": "moe_ep_experts", "0.gate_up_proj": "experts",
                                               "0.down_proj": "experts", "0.identity_expert": "moe_identity_expert"})
    attention = nn.Sequential(nn.Module())  # (an identity expert inside a module the plan names, but not experts)
    attention[0].sinks, attention[0].identity_expert = nn.Parameter(torch.zeros(4)), nn.Identity()
    with pytest.raises(ValueError, match=r"plan: '0.identity_expert' \('moe_identity_expert'\) divides its input by "
                                         r"the group's size, .*it is inside none"):
        tp_kernels.parallelize(attention, {"0": "local_params", "0.sinks": "colwise",
                                           "0.identity_expert": "moe_identity_expert"})
    with pytest.raises(ValueError, match=r"sequence_parallel: expected a bool, got 'yes'"):
        shard_experts(Experts(), STYLES[False], sequence_parallel="yes")
    with pytest.raises(ValueError, match=r"mlp.experts': experts whose output is left partial, \('moe_tp_experts', 'partial'\), do not go with "
                                         r"sequence parallelism, under which the output is reduce-scattered there"):
        tp_kernels.parallelize(copy.deepcopy(dense), {**plan, experts: ("moe_tp_experts", "partial")},
                               sequence_parallel=True)
    shard_experts(experts := Experts(), STYLES[False])
    with pytest.raises(ValueError, match="sharded already"):
        shard_experts(experts, STYLES[False])
    whole = SPLITS["experts"][2]
    # (whole experts that p does not divide: split all the same, the last blocks padded)
    assert check_styles(Experts(bias=True), whole, 8)["gate_up_proj"] == (0, (4,))
    unnumbered = Experts(bias=True)
    unnumbered.num_experts = 2
    with pytest.raises(ValueError, match=r"module: expert parallelism .* its num_experts must be its number of "
                                         r"experts, dim 0 of every parameter \(\[4\]\); got 2"):
        check_styles(unnumbered, whole, 2)

    unnumbered.num_experts = 4.0  # (the count, but no int)
    with pytest.raises(ValueError, match=r"its num_experts must be its number of experts, dim 0 of every parameter "
                                         r"\(\[4\]\); got 4.0"):
        check_styles(unnumbered, whole, 2)

    class Unrouted(Experts):
        def forward(self, hidden, top_k_index, *, top_k_weights=None):
            return hidden

    with pytest.raises(ValueError, match=r"calls Unrouted as transformers' experts are, \(hidden_states, "
                                         r"top_k_index, top_k_weights\), but its forward takes \['hidden', "
                                         r"'top_k_index'\]"):
        check_styles(Unrouted(bias=True), whole, 2)
    if p > 1:  # (an identity expert takes the tokens first, which it divides by p)
        identity = share_identity_expert(nn.Identity())
        torch.testing.assert_close(identity(torch.ones(2, 3)), torch.full((2, 3), 1 / p))
        with pytest.raises(TypeError, match=r"Identity \(an identity expert, share_identity_expert\) takes the "
                                            r"tokens, a floating-point tensor, first"):
            identity(torch.ones(2, 3, dtype=torch.long))
    if p > 1:  # (the call's routing arguments, checked on every rank before the sum)
        par = shard_experts(Experts(bias=True), whole)
        hidden, _, index, weights = routed(1)
        with pytest.raises(ValueError, match=r"top_k_index: expected a tensor of integer expert ids, got "
                                             r"\[10, 2\] float64"):
            par(hidden, weights, weights)
        with pytest.raises(ValueError, match=r"top_k_index: expected a tensor of integer expert ids, got "
                                             r"\[10, 2\] bool"):
            par(hidden, index > 0, weights)
        with pytest.raises(ValueError, match=r"hidden: expected floating-point hidden states, got \[10, 2\] int64"):
            par(index, index, weights)
        with pytest.raises(ValueError, match=r"top_k_weights: expected floating-point routing weights of "
                                             r"top_k_index's shape \[10, 2\], got \[10, 1\] float64"):
            par(hidden, top_k_weights=weights[:, :1], top_k_index=index)
        torch.testing.assert_close(par(hidden, top_k_weights=weights, top_k_index=index), par(hidden, index, weights))


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_expert_plan_errors(world):
    world.run(check_expert_plan_errors)


def test_whole_experts_by_their_weights_entries():
    """Experts named ``"moe_tp_experts"`` whose weights the plan names all ``"grouped_gemm"``
    (transformers 5.17's expert-parallel plan) are read as ``"moe_ep_experts"``, a ``"partial"`` or
    ``"sequence"`` kept with them; not where one of their own weights is split otherwise, and not
    by a parameter of a module inside them."""
    from tp_kernels.parallelize import read_expert_parallelism

    weights = {"layers.*.experts.gate_up_proj": "grouped_gemm", "layers.*.experts.down_proj": "grouped_gemm"}
    for value, read in (("moe_tp_experts", "moe_ep_experts"),
                        (("moe_tp_experts", "partial"), ("moe_ep_experts", "partial")),
                        (("moe_tp_experts", "sequence"), ("moe_ep_experts", "sequence"))):
        plan = {"layers.*.experts": value, **weights}
        assert read_expert_parallelism(plan) == {**plan, "layers.*.experts": read}, value
        mixed = {**plan, "layers.*.experts.down_proj": "colwise"}
        assert read_expert_parallelism(mixed) == mixed, value
    inner = {"layers.*.experts": "moe_tp_experts", "layers.*.experts.gate_up_proj": "grouped_gemm",
             "layers.*.experts.shared.down_proj": "colwise"}
    assert read_expert_parallelism(inner)["layers.*.experts"] == "moe_ep_experts"


def check_experts_ranks_disagree(split):
    """With fingerprints on, ranks that routed different numbers of tokens to the experts raise the
    same RuntimeError, naming each rank's view, before the output's sum moves; the group works
    afterwards."""
    r, p = rank_world()
    transposed, bias, styles = SPLITS[split]
    torch.manual_seed(0)
    dense = Experts(transposed, bias)
    par = shard_experts(copy.deepcopy(dense), styles)
    hidden, _, index, weights = routed(1)
    n = TOKENS - r  # (each rank its own count)
    views = r"rank 0: Experts.*args\[0\] \[10, 6\] float64.*rank 1: .*args\[0\] \[9, 6\]"
    with fingerprints_set(True), pytest.raises(RuntimeError, match=f"disagree.*{views}"):
        par(hidden[:n], index[:n], weights[:n])
    torch.testing.assert_close(par(hidden, index, weights), dense(hidden, index, weights), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("split", ["packed_colwise", "packed_colwise_bias", "experts"])
def test_experts_ranks_disagree(world2, split):
    world2.run(check_experts_ranks_disagree, split)


def check_packed_linear():
    """``"packed_colwise"`` on an ``nn.Linear`` of two outputs side by side (``[gate; up]``): each
    rank holds its block of each half, and the layer computes the dense one's blocks; an odd
    ``out_features`` is a ValueError."""
    r, p = rank_world()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(4, 8 * p, dtype=torch.float64))
    par = tp_kernels.parallelize(copy.deepcopy(dense), {"0": "packed_colwise"})
    gate, up = dense[0].weight.detach().chunk(2)
    assert torch.equal(par[0].weight, torch.cat([gate.chunk(p)[r], up.chunk(p)[r]]))
    x = torch.randn(3, 4, dtype=torch.float64)
    want_gate, want_up = dense(x).chunk(2, dim=-1)
    torch.testing.assert_close(par(x), torch.cat([want_gate.chunk(p, -1)[r], want_up.chunk(p, -1)[r]], -1),
                               rtol=1e-12, atol=1e-13)
    with pytest.raises(ValueError, match=r"plan\['0'\]: '0' \('packed_colwise'.*odd out_features=7"):
        tp_kernels.parallelize(nn.Sequential(nn.Linear(4, 7)), {"0": "packed_colwise"})


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_packed_linear(world):
    world.run(check_packed_linear)


def check_hugging_face_moe_grouped_gemm(device="cpu", dtype="float32", parallelism="tp", implementation="grouped_mm"):
    """Mixtral in ``dtype`` with transformers' own default for its experts (a grouped GEMM over the
    tokens sorted by expert, ``torch._grouped_mm``; or ``implementation``: ``"batched_mm"``, a
    batched GEMM over the (token, expert) pairs), parallelized by its plan (:func:`_plan`): its
    logits and its experts' gradients are the float64 dense model's within the dense ``dtype``
    model's own error (float32: to 1e-6 of their size). 32 hidden units an expert: each rank's
    block of them is rows of at least 16 bytes at p = 4, as the grouped GEMM needs. Whole experts a
    rank (``"ep"``), the routes to other ranks' experts reach these kernels as their sentinel rows."""
    ref = _moe_model("mixtral", moe_intermediate=32, implementation="eager").to(device)  # float64, the plain loop
    plain = copy.deepcopy(ref).to(getattr(torch, dtype))
    plain.config._experts_implementation = implementation  # (grouped_mm: transformers' default, where it runs)
    par = tp_kernels.parallelize(copy.deepcopy(plain), _plan(plain, parallelism))
    used = par.model.layers[0].mlp.experts.config._experts_implementation
    assert used == implementation, used
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    outs = [model(ids, labels=ids) for model in (ref, plain, par)]
    assert_close("logits", outs[2].logits, outs[0].logits, outs[1].logits)
    for out in outs:
        out.loss.backward()
    grads = full_grads(par)
    plain_params = dict(plain.named_parameters())
    for name, q in ref.named_parameters():
        if ".experts." in name:
            assert_close(f"{name}.grad", grads[name], q.grad, plain_params[name].grad)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("parallelism, implementation", [("tp", "grouped_mm"), ("ep", "grouped_mm"),
                                                         ("ep", "batched_mm")])
def test_hugging_face_moe_grouped_gemm(world, parallelism, implementation):
    world.run(check_hugging_face_moe_grouped_gemm, "cpu", "float32", parallelism, implementation)


def check_sum_output_grads_over_group():
    """``grads.sum_output_grads_over_group``: the output unchanged; the gradient of its last columns
    summed over the group, of the others each rank's own (``columns=None``: all of them summed); a
    module whose output has fewer columns (or, None, no dim) raises ValueError naming it, as does a
    bad ``columns``."""
    r, p = rank_world()
    torch.manual_seed(0)
    proj = nn.Linear(3, 5, bias=False, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    want = proj(x)
    tp_kernels.grads.sum_output_grads_over_group(proj, 2)
    y = proj(x)
    assert torch.equal(y, want)
    weights = torch.arange(1.0, 11.0, dtype=torch.float64).view(2, 5) * (r + 1)  # each rank its own
    (y * weights).sum().backward()
    summed = weights.clone()
    summed[:, 3:] = torch.arange(1.0, 11.0, dtype=torch.float64).view(2, 5)[:, 3:] * (p * (p + 1) // 2)
    torch.testing.assert_close(proj.weight.grad, summed.t() @ x.detach(), rtol=1e-14, atol=0)
    whole = tp_kernels.grads.sum_output_grads_over_group(nn.Linear(3, 5, bias=False, dtype=torch.float64), None)
    (whole(x) * weights).sum().backward()
    everyone = torch.arange(1.0, 11.0, dtype=torch.float64).view(2, 5) * (p * (p + 1) // 2)
    torch.testing.assert_close(whole.weight.grad, everyone.t() @ x.detach(), rtol=1e-14, atol=0)
    for columns in (0, 2.0, True):
        with pytest.raises(ValueError, match=r"columns: expected an int >= 1"):
            tp_kernels.grads.sum_output_grads_over_group(nn.Linear(3, 5), columns)
    if p > 1:
        narrow = tp_kernels.grads.sum_output_grads_over_group(nn.Linear(3, 1), 2)
        with pytest.raises(ValueError, match=r"Linear's output is \[2, 1\] float32.*no last 2 columns"):
            narrow(torch.randn(2, 3))
        scalar = tp_kernels.grads.sum_output_grads_over_group(_Sum(), None)
        with pytest.raises(ValueError, match=r"_Sum's output is \[\] float32.*no last dim"):
            scalar(torch.randn(2, 3))
        with fingerprints_set(True), pytest.raises(RuntimeError, match=r"disagree.*rank 0: Linear.*output \[3, 5\]"
                                                                         r".*rank 1: Linear.*output \[2, 5\]"):
            proj(torch.randn(3 if r == 0 else 2, 3, dtype=torch.float64))  # (rank 0 one row more)


class _Sum(nn.Module):
    def forward(self, x):
        return x.sum()


def check_sum_output_grads_refuses_a_whole_gradient():
    """The first backward through ``grads.sum_output_grads_over_group``'s sum whose gradient there
    is not zero on every rank compares that gradient across the ranks: the same on every rank (the
    output scales a tensor every rank holds whole), every rank raises ValueError naming the module,
    and no gradient reaches its parameters; each rank's own part passes, and is summed. A forward
    without a gradient, and a backward whose gradient there is zero on every rank, check nothing."""
    r, p = rank_world()
    torch.manual_seed(0)  # (the modules and the inputs alike on every rank)
    x = torch.randn(4, 3, dtype=torch.float64)
    whole = torch.randn(4, 5, dtype=torch.float64)
    for columns, what in ((None, "its output"), (2, "its output's last 2 columns")):
        module = tp_kernels.grads.sum_output_grads_over_group(nn.Linear(3, 5, dtype=torch.float64), columns)
        with torch.no_grad():
            module(x)
        (module(x) * 0).sum().backward()  # (zero everywhere: nothing told)
        module.zero_grad(set_to_none=True)
        with pytest.raises(ValueError, match=rf"Linear: the gradient of {what} is the same on every rank of the "
                                             rf"group: .* count it {p} times"):
            (module(x) * whole).sum().backward()
        assert module.weight.grad is None and module.bias.grad is None
    part = tp_kernels.grads.sum_output_grads_over_group(nn.Linear(3, 5, dtype=torch.float64), None)
    (part(x) * whole * (r + 1)).sum().backward()  # (each rank's part: passes)
    summed = whole * (p * (p + 1) // 2)
    torch.testing.assert_close(part.weight.grad, summed.t() @ x, rtol=1e-14, atol=1e-14)
    part.zero_grad(set_to_none=True)
    (part(x) * whole).sum().backward()  # (checked once: a whole gradient later is summed, unchecked)
    torch.testing.assert_close(part.weight.grad, (whole * p).t() @ x, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_sum_output_grads_refuses_a_whole_gradient(world):
    world.run(check_sum_output_grads_refuses_a_whole_gradient)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_sum_output_grads_over_group(world):
    world.run(check_sum_output_grads_over_group)


def check_sum_grads_over_group():
    """``grads.sum_grads_over_group``: the gradient of each parameter the module holds that wants
    one is summed over the group in each backward, before it accumulates (two backwards: twice
    the sum of every rank's), a parameter the module uses twice summed once, a frozen parameter
    left without a gradient; the module returned."""
    r, p = rank_world()
    torch.manual_seed(0)
    shared, norm = nn.Linear(3, 3, bias=False, dtype=torch.float64), nn.LayerNorm(3, dtype=torch.float64)
    norm.bias.requires_grad_(False)
    model = nn.Sequential(shared, norm, shared)
    dense = copy.deepcopy(model)
    assert tp_kernels.grads.sum_grads_over_group(model) is model
    inputs = [torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(q)) for q in range(p)]
    for x in inputs:  # (every rank's backward, on the dense copy here: their sum)
        dense(x).square().sum().backward()
    for _ in range(2):
        model(inputs[r]).square().sum().backward()
    for name, param in model.named_parameters():
        want = dense.get_parameter(name).grad
        if name == "1.bias":
            assert param.grad is None and want is None
            continue
        torch.testing.assert_close(param.grad, 2 * want, rtol=1e-12, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_sum_grads_over_group(world):
    world.run(check_sum_grads_over_group)


def check_sum_grads_refuses_a_whole_gradient():
    """The first backward whose gradient of a parameter ``grads.sum_grads_over_group`` hooks is
    not zero on every rank compares it across the ranks before the sum: the same on every rank (the
    module ran on a tensor whole on every rank), every rank raises ValueError naming the module and
    the parameter, and the gradient does not accumulate; each rank's share passes, and is summed. A
    backward whose gradient is zero on every rank checks nothing."""
    r, p = rank_world()
    torch.manual_seed(0)  # (the module and the input alike on every rank)
    dense = nn.LayerNorm(4, dtype=torch.float64)
    norm = tp_kernels.grads.sum_grads_over_group(copy.deepcopy(dense))
    x = torch.randn(3, 4, dtype=torch.float64)
    (norm(x) * 0).sum().backward()  # (zero everywhere: nothing told)
    norm.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=rf"LayerNorm's parameter '(weight|bias)': its gradient is the same on every "
                                         rf"rank of the group: .* count it {p} times"):
        norm(x).square().sum().backward()
    assert norm.weight.grad is None or norm.bias.grad is None
    share = torch.randn(3, 4, dtype=torch.float64) * (r + 1)  # (each rank's own)
    norm.zero_grad(set_to_none=True)
    (norm(x) * share).sum().backward()
    (dense(x) * share * (p * (p + 1) // 2) / (r + 1)).sum().backward()
    for name, param in norm.named_parameters():
        torch.testing.assert_close(param.grad, dense.get_parameter(name).grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_sum_grads_refuses_a_whole_gradient(world):
    world.run(check_sum_grads_refuses_a_whole_gradient)


def check_sum_grads_over_group_compiled_while_collected():
    """A compiled forward of a module ``grads.sum_grads_over_group`` hooks, during whose compilation
    the cycle collector frees a module it had hooked earlier (here at a fixed point: in the
    backend, after the trace, before the compiled code runs; in a test suite, wherever a collection
    falls): the compiled call runs and sums the gradient, where the registry's entry, removed then
    by a weak reference's callback, raised a ``KeyError`` in torch.compile's code. The next eager
    hook drops the freed module's entries."""
    import gc

    r, p = rank_world()
    summed = tp_kernels.grads._SUMMED

    def collecting(gm, example_inputs):
        gc.collect()
        return gm

    torch._dynamo.reset()  # (which collects)
    gc.disable()
    try:
        old = tp_kernels.grads.sum_grads_over_group(nn.Linear(3, 3, dtype=torch.float64))
        old(torch.zeros(1, 3, dtype=torch.float64))
        old.cycle = [old]  # (freed by the cycle collector only)
        hooked_before = [id(old.weight), id(old.bias)]
        del old
        assert all(key in summed and summed[key]() is not None for key in hooked_before) or p == 1
        torch.manual_seed(0)
        model = nn.Linear(3, 2, dtype=torch.float64)
        dense = copy.deepcopy(model)
        assert tp_kernels.grads.sum_grads_over_group(model) is model
        inputs = [torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(q)) for q in range(p)]
        torch.compile(model, backend=collecting)(inputs[r]).square().sum().backward()
    finally:
        gc.enable()
        torch._dynamo.reset()
    for x in inputs:
        dense(x).square().sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, dense.get_parameter(name).grad, rtol=1e-12, atol=0,
                                   msg=lambda m: f"{name}: {m}")
    if p > 1:
        assert any(ref() is None for ref in summed.values())  # (kept while compiled)
        later = tp_kernels.grads.sum_grads_over_group(nn.Linear(3, 3))
        later(torch.zeros(1, 3))
        assert all(ref() is not None for ref in summed.values()) and later.weight.grad is None


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_sum_grads_over_group_compiled_while_collected(world):
    world.run(check_sum_grads_over_group_compiled_while_collected)


def check_hugging_face_local_params(kind, sequence=False):
    """transformers models whose attention applies per-head parameters of its own (``"local_params"``,
    each split as the heads are, ``"colwise"`` on a 1-D parameter): Granite SWA's attention sinks,
    and Beam's per-head gate bias (beside its experts and per-head norms), by their own plans, or
    (``sequence``) under sequence parallelism by :func:`tp_kernels.sequence_parallel_plan` of them
    (the attention kept, ``"local_params"``, and moved too: its input gathered). The logits and
    every gradient are the dense model's; both models force their attention's softmax and sink
    scaling to float32, so to float32's precision of their size."""
    import transformers

    r, p = rank_world()
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)  # (every rank the same weights)
    if kind == "granite_swa":
        dense = transformers.GraniteSWAForCausalLM(transformers.GraniteSWAConfig(**common))
        held = "self_attn.sinks"
    else:
        dense = transformers.BeamForCausalLM(transformers.BeamConfig(
            head_dim=4, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, experts_implementation="eager",
            **common))
        held = "self_attn.gate_bias"
    dense = dense.double()
    with torch.no_grad():  # (made zero: each head its own value)
        for layer in dense.model.layers:
            layer.get_parameter(held).normal_()
    plan = dict(dense.tp_plan)
    assert plan["model.layers.*.self_attn"] == "local_params", plan
    if sequence:
        plan = tp_kernels.sequence_parallel_plan(dense, plan)
        assert plan["model.layers.*.self_attn"] == "local_params" and "model.layers.1.self_attn" in plan, plan
    par = tp_kernels.parallelize(copy.deepcopy(dense), plan, strict=False)
    whole = dense.model.layers[0].get_parameter(held).detach()
    assert torch.equal(par.model.layers[0].get_parameter(held), whole.chunk(p)[r])
    seen = []
    par.model.layers[1].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    want, got = dense(ids, labels=ids), par(ids, labels=ids)
    assert seen == [8 // p if sequence else 8], seen  # (the decoder layers on each rank's block of the sequence)
    eps = 4 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=eps * want.logits.abs().max().item())
    want.loss.backward()
    got.loss.backward()
    assert_dense_grads(par, dense, 2 * eps)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("kind", ["granite_swa", "beam"])
@pytest.mark.parametrize("sequence", [False, True])
def test_hugging_face_local_params(world, kind, sequence):
    skip_unless_own_plan({"granite_swa": "GraniteSWAConfig", "beam": "BeamConfig"}[kind], "layers.*.self_attn",
                         "local_params")
    world.run(check_hugging_face_local_params, kind, sequence)


def check_moe_under_fully_sharded_data_parallel(path, parallelism="tp", experts=4):
    """Tensor parallelism 2 x FSDP2 over the 2 data-parallel ranks (``fully_shard`` of each layer
    and of the model) on 4 ranks, Qwen 3 MoE of ``experts`` experts by its plan (:func:`_plan`;
    with ``"ep"`` its experts whole, two a rank, FSDP2's rows one expert each; of 5 experts, 3 a
    rank, the second rank's third padding, FSDP2's rows 2 and 1): each data-parallel rank takes
    half the batch, and ``clip_grad_norm_`` gives the dense model's norm, an SGD step with momentum
    its weights, ``full_state_dict`` its state dict; the ``dcp`` checkpoint of the sharded state
    dicts (the packed expert weights' pieces along dim 1, which FSDP2's rows of dim 0 leave whole;
    the padded experts' rows as chunks) is, offline, the dense weights and momenta; a model sharded
    alike resumes from it, and its next step is the dense model's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from test_parallelize import _assert_dense_checkpoint, _save_with_dcp

    r, _ = rank_world()
    tp_kernels.initialize_model_parallel(2)
    try:
        dp = tp_kernels.get_data_parallel_rank()
        tag = tp_kernels.get_data_parallel_group().group_name  # (a mesh named anew: torch caches them by value)
        mesh = DeviceMesh.from_group(tp_kernels.get_data_parallel_group(), "cpu", mesh_dim_names=(f"moe{tag}",))
        dense = _moe_model("qwen3_moe", experts=experts)
        plan = _plan(dense, parallelism)

        def sharded(model):
            model = tp_kernels.parallelize(model, plan)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        def sgd(model):
            return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

        def step(model, opt, ids):
            mine = ids[2 * dp: 2 * dp + 2] if model is not dense else ids  # (FSDP2 averages over the ranks)
            model(mine, labels=mine).loss.backward()
            if model is dense:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            else:
                total = tp_kernels.clip_grad_norm_(model, 1e9)
            opt.step()
            opt.zero_grad()
            return total

        def assert_dense(model):
            for key, value in tp_kernels.full_state_dict(model).items():
                torch.testing.assert_close(value, dense.state_dict()[key], rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{key}: {m}")

        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 32, (4, 6), generator=g) for _ in range(2)]
        par = sharded(copy.deepcopy(dense))
        dense_opt, opt = sgd(dense), sgd(par)
        torch.testing.assert_close(step(par, opt, batches[0]), step(dense, dense_opt, batches[0]), rtol=1e-12, atol=0)
        assert_dense(par)
        _save_with_dcp(par, opt, f"{path}/fsdp")
        if r == 0:
            _assert_dense_checkpoint(f"{path}/fsdp", dense, dense_opt, moments=("momentum_buffer",))
        torch.manual_seed(3)
        fresh = sharded(_moe_model("qwen3_moe", experts=experts).apply(_reset))
        fresh_opt = sgd(fresh)
        state = {"model": tp_kernels.sharded_state_dict(fresh),
                 "optim": tp_kernels.sharded_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(state, checkpoint_id=f"{path}/fsdp")
        tp_kernels.load_sharded_optimizer_state_dict(fresh, fresh_opt, state["optim"])
        assert_dense(fresh)
        torch.testing.assert_close(step(fresh, fresh_opt, batches[1]), step(dense, dense_opt, batches[1]),
                                   rtol=1e-12, atol=0)
        assert_dense(fresh)
    finally:
        tp_kernels.destroy_model_parallel()


@pytest.mark.parametrize("parallelism,experts", [("tp", 4), ("ep", 4), ("ep", 5)])
def test_moe_under_fully_sharded_data_parallel(world4, tmp_path, parallelism, experts):
    world4.run(check_moe_under_fully_sharded_data_parallel, str(tmp_path), parallelism, experts)
