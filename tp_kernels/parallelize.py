"""Shard an existing dense model in place, by a plan of name patterns."""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import re
import weakref
from typing import Dict, Mapping, Optional

import torch
import torch.nn as nn

from . import _collectives as coll
from . import _data_parallel as dp
from . import rng
from ._agreement import agree, exchange_views
from ._checks import check_replaceable, functorch_transforms
from .embedding import VocabParallelEmbedding, check_embedding, check_embedding_dim, shard_embedding_dim
from .experts import PARAMETER_STYLES, check_styles, shard_experts, shard_parameters, share_identity_expert
from .grads import sum_grads_over_group, sum_output_grads_over_group
from ._torch_styles import describe, is_torch_style, output_as_dtensor, redistribute, translate
from .layers import (ColumnParallelLinear, RowParallelLinear, check_output_sizes, check_sequence_dim,
                     share_input_gathers, sharded_blocks)
from .mappings import SEQUENCE_BLOCK

__all__ = ["ALIASES", "STYLES", "parallelize"]

#: plan style -> (module type it applies to, what replaces it)
STYLES = {
    "colwise": (nn.Linear, ColumnParallelLinear),
    "colwise_gather_output": (nn.Linear, ColumnParallelLinear),  # gather_output=True
    "packed_colwise": (nn.Linear, ColumnParallelLinear),  # two outputs packed side by side: output_sizes halves
    "rowwise": (nn.Linear, RowParallelLinear),
    "rowwise_split_input": (nn.Linear, RowParallelLinear),  # input_is_parallel=False
    "vocab": (nn.Embedding, VocabParallelEmbedding),
    # kept as it is, its weight split along the embedding dim, its output's columns gathered
    # (embedding.shard_embedding_dim): a table too large for one device (transformers' name)
    "embedding_colwise": (nn.Embedding, None),
    # kept as it is, the gradients of its parameters summed over the group (grads.sum_grads_over_group)
    "replicated_with_grad_allreduce": (nn.Module, None),
    # kept as it is, the expert weights the plan names by parameter (experts.PARAMETER_STYLES) split,
    # its output summed over the group (experts.shard_experts)
    "moe_tp_experts": (nn.Module, None),
    # kept as it is, its expert weights, named "experts" by parameter, split into whole experts (each
    # rank ceil(E/p) of them), the routes to other ranks' experts skipped, its output summed over the group
    # (experts.shard_experts): transformers' ep_dispatch_experts with DistributedConfig's
    # ep_implementation="all_reduce", over the tensor-parallel group
    "moe_ep_experts": (nn.Module, None),
    # kept as it is, its input divided by the group's size (experts.share_identity_expert): an
    # identity ("zero-computation") expert inside "moe_tp_experts" experts, whose output their sum
    # over the group would count p times (LongCat-Flash's)
    "moe_identity_expert": (nn.Module, None),
    # kept as it is, the parameters the plan names split (experts.shard_parameters): per-head
    # vectors it applies to this rank's heads (attention sinks)
    "local_params": (nn.Module, None),
    # kept as it is: every rank holds it whole and runs it alike (the same as leaving it out)
    "replicate": (nn.Module, None),
    # kept as it is, its inputs and outputs moved between layouts before and after its forward
    # (gathered or split along a dim: _torch_styles.redistribute): torch's PrepareModuleInput /
    # PrepareModuleOutput, which a plan gives as those objects
    "redistribute": (nn.Module, None),
    # kept as it is, the gradient of its output's last columns (DeepSeek's rotary key) summed over
    # the group (grads.sum_output_grads_over_group); ("mla_kv_a_proj", columns), or the model's
    # config.qk_rope_head_dim columns
    "mla_kv_a_proj": (nn.Linear, None),
    # kept as it is, the gradient of its whole output summed over the group
    # (grads.sum_output_grads_over_group): a module every rank runs alike whose output scales a term
    # each rank holds its partial sum of (a shared expert's gate, where the expert's row layer leaves
    # its output partial: sequence_parallel_plan writes it)
    "replicated_with_output_grad_allreduce": (nn.Module, None),
}
#: the styles of a module the plan splits parameters of, by their names
_OWNERS = ("moe_tp_experts", "moe_ep_experts", "local_params")
#: the styles of a module every rank holds whole and runs alike, a gradient of it summed over the group
_REPLICATED = ("replicated_with_grad_allreduce", "replicated_with_output_grad_allreduce")
#: the styles whose gradient is summed over the group, each rank holding its heads' share of it where the
#: plan splits the heads around them (Qwen 3's per-head norms, DeepSeek's latent key/value projection):
#: where every rank computes it whole, the sum counts it p times
_SUMMED_GRADIENTS = (*_REPLICATED, "mla_kv_a_proj")
#: the styles of a mixture's experts, shard_experts' modules
_EXPERTS = ("moe_tp_experts", "moe_ep_experts")
#: the styles of a module kept whose parameters, its submodules' too, the plan takes care of (summed, split,
#: or, "replicate", said to be whole)
_WHOLE_SUBTREES = (*_REPLICATED, "replicate", *_EXPERTS, "moe_identity_expert")
#: the styles whose output a plan may leave each rank's partial sum, (style, "partial"), for a
#: torch style around them to reduce (Partial())
_PARTIAL_OUTPUTS = (*_EXPERTS, "rowwise")
#: the second items of a (style, how) entry: experts' or a row layer's output left each rank's partial sum;
#: experts called with each rank's block of the tokens (sequence parallelism)
_HOW = ("partial", "sequence")
#: other names of a style: Hugging Face's, so that a transformers model's own ``tp_plan`` is a plan
#: ("all_reduce": a module whose output is each rank's partial sum, by its parameters the plan splits
#: by name, Inkling's shared experts: what "moe_tp_experts" does; "colwise_rep" and "rowwise_rep",
#: transformers' names for a column layer's output gathered and a row layer's input whole)
ALIASES = {"embedding_rowwise": "vocab", "ep_dispatch_experts": "moe_ep_experts", "grouped_gemm": "experts",
           "all_reduce": "moe_tp_experts", "colwise_rep": "colwise_gather_output",
           "rowwise_rep": "rowwise_split_input", "ep_router": "replicate"}
#: ("ep_router": transformers' router of experts split into whole experts, in its versions whose
#: ep_plan leaves the experts "moe_tp_experts", 5.17: it skips the routes to other ranks' experts,
#: which "moe_ep_experts" skips itself, so the router is kept whole: see read_expert_parallelism)


def read_expert_parallelism(plan: Mapping[str, object]) -> Dict[str, object]:
    """``plan``, its experts named ``"moe_tp_experts"`` (or ``("moe_tp_experts", "partial")``)
    whose weights it names all ``"experts"`` (``"grouped_gemm"``: whole experts a rank) named
    ``"moe_ep_experts"``, which is what those entries mean together: transformers' ep_plan over its
    tp_plan in its versions (5.17) that keep the experts' tp_plan entry and put the routing to this
    rank's experts in an ``"ep_router"`` router. Every other entry as it is."""
    read = dict(plan)
    for pattern, value in plan.items():
        how = value[1] if isinstance(value, (tuple, list)) and len(value) == 2 and value[1] in _HOW else None
        name = value[0] if how else value
        if not isinstance(pattern, str) or not isinstance(name, str) or ALIASES.get(name, name) != "moe_tp_experts":
            continue
        weights = [v for k, v in plan.items()
                   if isinstance(k, str) and k.startswith(pattern + ".") and "." not in k[len(pattern) + 1:]]
        if weights and all(isinstance(v, str) and ALIASES.get(v, v) == "experts" for v in weights):
            read[pattern] = "moe_ep_experts" if how is None else ("moe_ep_experts", how)
    return read


def _style(pattern: str, value) -> tuple:
    """A plan's value as ``(style, outputs)``: a style (outputs None), or ``("colwise",
    output_sizes)`` or ``("colwise", output_sizes, head_size)`` (outputs ``(output_sizes,
    head_size or None)``, the column layer's arguments), or ``("mla_kv_a_proj", columns)``
    (outputs the columns), or experts' ``("moe_tp_experts", "partial")`` or a row layer's
    ``("rowwise", "partial")`` (outputs ``"partial"``: the output left each rank's partial sum), or
    experts' ``("moe_tp_experts", "sequence")`` (outputs ``"sequence"``: under sequence
    parallelism, each rank calling them with its block of the tokens, whatever
    ``sequence_parallel`` says).
    (torch's styles are read for each module they apply to:
    :func:`tp_kernels._torch_styles.translate`.)"""
    if value == "redistribute":
        raise ValueError(f"plan[{pattern!r}]: 'redistribute' moves a module's inputs or outputs between layouts, "
                         "which a plan says with torch's PrepareModuleInput or PrepareModuleOutput")
    if isinstance(value, str):
        return _known(pattern, value), None
    if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == "mla_kv_a_proj":
        return value[0], value[1]
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str) and \
            isinstance(value[1], str) and ALIASES.get(value[0], value[0]) in _PARTIAL_OUTPUTS:
        style = ALIASES.get(value[0], value[0])
        if value[1] not in _HOW or (value[1] == "sequence" and style not in _EXPERTS):
            also = f", ({value[0]!r}, 'sequence') (called with each rank's block of the tokens)" \
                if style in _EXPERTS else ""
            raise ValueError(f"plan[{pattern!r}]: {value[0]!r} takes ({value[0]!r}, 'partial') (its output left each "
                             f"rank's partial sum){also} or {value[0]!r} alone (summed), got {value!r}")
        return style, value[1]
    if isinstance(value, (tuple, list)) and len(value) in (2, 3) and value[0] in ("colwise", "colwise_gather_output"):
        sizes = tuple(value[1]) if isinstance(value[1], (tuple, list)) else value[1]
        return value[0], (sizes, value[2] if len(value) == 3 else None)
    raise ValueError(f"plan[{pattern!r}]: expected a style ({', '.join(map(repr, STYLES))}), ('colwise', "
                     "output_sizes) or ('colwise', output_sizes, head_size) (or 'colwise_gather_output' so), "
                     f"('mla_kv_a_proj', columns), ('moe_tp_experts', 'partial' or 'sequence') or ('rowwise', "
                     "'partial'), got "
                     f"{value!r}")


def _known(pattern: str, style: str) -> str:
    style = ALIASES.get(style, style)
    if style not in STYLES and style not in PARAMETER_STYLES:
        raise ValueError(f"plan[{pattern!r}]: unknown style {style!r}; expected one of "
                         f"{', '.join(map(repr, dict.fromkeys([*STYLES, *ALIASES, *PARAMETER_STYLES])))}")
    return style


def parallelize(module: nn.Module, plan: Mapping[str, object], *, group=None,
                sequence_parallel: bool = False, strict: bool = True, sequence_dim: int = 0) -> nn.Module:
    """Replace, in place, the submodules of ``module`` that ``plan`` names by parallel layers.

    ``plan`` maps ``fnmatch`` patterns over qualified submodule names (``"layers.*.mlp.fc1"``)
    to a style: ``"colwise"`` (``nn.Linear`` → :class:`ColumnParallelLinear`),
    ``"colwise_gather_output"`` (the same, its output gathered whole on every rank,
    ``gather_output=True``: an output layer whose logits the model's own code, a generation loop,
    takes whole), ``"rowwise"`` (``nn.Linear`` → :class:`RowParallelLinear`, input already
    parallel; ``("rowwise", "partial")``: its output left each rank's partial sum,
    ``reduce_results=False``, for a torch style around it to reduce, ``Partial()``),
    ``"rowwise_split_input"`` (the same, its input whole on every rank, split here,
    ``input_is_parallel=False``), ``"vocab"`` (``nn.Embedding`` →
    :class:`VocabParallelEmbedding`; Hugging Face's ``"embedding_rowwise"`` too),
    ``"embedding_colwise"`` (an ``nn.Embedding`` kept, its table split along the embedding dim,
    its output's columns gathered: :func:`tp_kernels.embedding.shard_embedding_dim`),
    ``"replicated_with_grad_allreduce"`` (any module, kept as it is, its parameters' gradients
    summed over the group in every backward: a per-head norm, a layer norm under sequence
    parallelism; :func:`tp_kernels.grads.sum_grads_over_group`), ``"packed_colwise"`` (an
    ``nn.Linear`` of two outputs side by side, ``[gate; up]``: the column layer with ``output_sizes``
    its halves) or ``"moe_tp_experts"`` (a mixture's experts, kept, their 3-D weights split by
    parameter-name entries of the plan, ``"layers.*.experts.gate_up_proj": "packed_colwise"``, in
    the styles of :data:`tp_kernels.experts.PARAMETER_STYLES`, and their output summed over the
    group: :func:`tp_kernels.experts.shard_experts`) or ``"moe_ep_experts"`` (the same, its
    experts split whole, ``ceil(E/p)`` a rank, by ``"experts"`` entries for its weights: expert
    parallelism over the group, transformers' ``ep_dispatch_experts`` and ``grouped_gemm``, so that
    ``{**model.tp_plan, **model.ep_plan}`` is a plan; ``"moe_tp_experts"`` experts whose weights
    the plan names all ``"grouped_gemm"``, their router ``"ep_router"`` (kept whole), are
    ``"moe_ep_experts"`` (transformers 5.17's form of that plan: :func:`read_expert_parallelism`);
    either as ``(style, "partial")``, their output left each rank's partial sum, for a module
    around them whose torch style reduces it, ``PrepareModuleOutput(output_layouts=Partial(),
    desired_output_layouts=Shard(1))``: one reduce-scatter where a sum and a split would be two
    moves, as :func:`sequence_parallel_plan` writes it; or as ``(style, "sequence")``, called with
    each rank's block of the tokens, whatever ``sequence_parallel`` says: Gemma 4's decoder layer's
    own experts under :func:`sequence_parallel_plan`), ``"moe_identity_expert"`` (an identity
    expert inside ``"moe_tp_experts"`` experts, LongCat-Flash's, kept, its input divided by p for
    the experts' sum: :func:`tp_kernels.experts.share_identity_expert`; an ``nn.Identity`` inside
    experts without it is an error) or ``"mla_kv_a_proj"`` (DeepSeek's
    ``kv_a_proj_with_mqa``, kept, the gradient of its output's rotary key columns, the model's
    ``config.qk_rope_head_dim`` or ``("mla_kv_a_proj", columns)``, summed over the group:
    :func:`tp_kernels.grads.sum_output_grads_over_group`), ``"replicated_with_output_grad_allreduce"``
    (any module, kept, the gradient of its whole output summed over the group, the same function:
    a module whose output scales a term each rank holds its partial sum of, a shared expert's gate
    where that expert's row layer leaves its output partial, as :func:`sequence_parallel_plan`
    writes it), ``"local_params"`` (any module, kept,
    the parameters the plan names split, a per-head vector ``"attn.sinks": "colwise"`` as its heads
    are: :func:`tp_kernels.experts.shard_parameters`) or ``"replicate"`` (kept as it is, whole on
    every rank: the same as leaving it out). These are Hugging Face's style names, so that a
    transformers model's own ``model.tp_plan`` is a plan.

    A fused projection, several outputs side
    by side in one ``nn.Linear`` (``[q, k, v]``, ``[gate, up]``), takes ``("colwise",
    output_sizes)``: each output is split across the ranks (the layer's ``output_sizes``), where
    a plain ``"colwise"`` would give rank 0 the first outputs whole; ``("colwise", output_sizes,
    head_size)`` for attention whose keys and values have fewer heads than there are ranks
    (grouped-query or multi-query attention: those heads are replicated, see
    :class:`ColumnParallelLinear`'s ``head_size``; the module holding it, a transformers attention
    with an int ``num_key_value_groups``, gets this rank's ratio, :func:`_key_value_groups`); a
    plain ``"colwise"`` of such an attention's key or value projection is read so where its heads
    are fewer than the ranks and divide them, and one whose heads the ranks cannot each hold whole is
    a ``ValueError`` (:func:`_replicated_heads`). Each
    replacement holds this rank's shard of the existing weights, so a dense model computes the same
    function afterwards (the code around the layers must use the local sizes, e.g. heads per rank).

    With ``sequence_parallel=True`` the layers are built with sequence parallelism: the
    activations outside the column-row pairs (an embedding's output, a row layer's output, up to the
    next column layer) are this rank's block of dim 0, ``[s/p, ...]`` (ids ``[s, ...]``, sequence
    first), and the column layers gather it back, so the dense model's own code runs unchanged
    where it takes the sequence length inside a pair from a column layer's output (not from the
    block's input); experts (``"moe_tp_experts"``, ``"moe_ep_experts"``) take this rank's block of
    the tokens, gather them and reduce-scatter their output (see
    :func:`tp_kernels.experts.shard_experts`); the parameters every rank holds whole and applies to
    its block (the norms, a router) then need :func:`tp_kernels.allreduce_sequence_parallel_grads`.
    ``sequence_dim=1`` splits dim 1 instead, for a batch-first model (``[b, s/p, ...]``, ids
    ``[b, s]``: torch's ``Shard(1)``); the experts take their tokens in any layout. A model whose
    own code takes the sequence length or the positions from the embedding's output, or a module's
    sequence length from its input (transformers' models do), needs a plan of torch's styles
    instead, which gathers the sequence at such a module's input (below).

    A plan written for torch's ``parallelize_module`` is a plan too: a value may be one of torch's
    style objects (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
    ``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``: TorchTitan's
    plans), read for the module it applies to with its own sequence parallelism, whatever
    ``sequence_parallel`` says (:mod:`tp_kernels._torch_styles`); ``group`` may be a one-dim
    ``DeviceMesh``.

    A parameter that several modules hold (an embedding tied to the output layer) stays one
    parameter: the plan must replace every module holding it and split it alike (``"vocab"`` and
    ``"colwise"`` both split dim 0 of ``[V, D]``), and the replacements then hold one block.

    A vocabulary (or a column layer's output) that p does not divide is padded, each rank holding
    ``ceil(V/p)`` rows: the embedding is unchanged, and an output layer's padded logits are
    ``-inf`` (see :class:`ColumnParallelLinear`).

    With ``strict=False`` a pattern that matches nothing is passed over (a plan written for a
    family of models, naming modules some of them lack: DeepSeek-V2's, ``q_proj`` or ``q_b_proj``);
    else it is an error.

    Everything is checked before anything is replaced: an unknown style, a pattern that matches
    nothing (with ``strict``), a style applied to the wrong module type (or a parameter's style to a module, a
    module's to a parameter, or to a parameter of a module not named ``"moe_tp_experts"``,
    ``"moe_ep_experts"`` or ``"local_params"``), experts the plan leaves a parameter of whole, a row layer's ``in_features`` or an output
    size the group's size does not divide, one module given two styles, or a tied parameter the
    plan would split apart raise ``ValueError`` naming the pattern and the module's path. The
    checks are agreed with the group, whatever the fingerprint setting (a plan wrong on one rank
    only, or plans that differ, raise on every rank), and then that every rank holds the same dense
    model (a digest of its parameters' and buffers' names, shapes, dtypes and a sample of their
    values): ranks that drew their weights from different random states raise ``RuntimeError``,
    rather than each keep its shard of another model. A module the plan does not name that holds
    parameters and takes a column layer's output, or one named ``"replicated_with_grad_allreduce"``
    that takes a tensor whole on every rank, raises ``ValueError`` at its first call
    (:func:`_watch_first_calls`). Returns ``module``.
    """
    group = coll.resolve_group(group)
    p = coll.group_size(group)
    hint = next(iter(module.parameters()), None) if isinstance(module, nn.Module) else None
    # (agreed, as initialize_model_parallel is: a rank whose plan fails raises its ValueError, the
    # others a RuntimeError naming it, and ranks given different plans all raise, before anything
    # is replaced; then that every rank holds the same dense weights)
    named, chosen, style_of, split_styles, ties, as_dtensor, also_moved, key_value_groups = agree(
        "parallelize", group, lambda: _resolve(module, plan, p, strict, sequence_parallel, sequence_dim),
        lambda _: f"plan {_digest(repr([(str(k), describe(v)) for k, v in plan.items()]))}, "
                  f"sequence_parallel {sequence_parallel}, sequence_dim {sequence_dim!r}, strict {strict}, "
                  f"{type(module).__name__}",
        hint=hint, always=True)
    if p > 1:
        _agree_on_weights(module, group, hint)

    # Build each replacement once, then swap every name under which the module is reachable
    # (a module shared under two names must not stay dense under the one the plan missed).
    replaced: Dict[int, nn.Module] = {}
    for name, (style, outputs, seq) in chosen.items():
        old = module.get_submodule(name)
        if id(old) in replaced:
            continue
        build = STYLES[style][1]
        sequence = {"sequence_parallel": seq is not None, **({"sequence_dim": seq} if seq is not None else {})}
        if build is None:  # kept (its gradients summed, or its experts split, once all is built)
            replaced[id(old)] = old
        elif style == "vocab":
            replaced[id(old)] = build.from_embedding(old, group=group, **sequence)
        elif style in ("colwise", "colwise_gather_output", "packed_colwise"):
            sizes, head_size = outputs or (None, None)
            replaced[id(old)] = build.from_linear(old, group=group, **sequence,
                                                  output_sizes=sizes, head_size=head_size,
                                                  gather_output=style == "colwise_gather_output")
        else:  # (a row layer; with its output left partial, ("rowwise", "partial"), not reduced)
            replaced[id(old)] = build.from_linear(
                old, group=group, **sequence, input_is_parallel=style == "rowwise",
                **({"reduce_results": False} if outputs == "partial" else {}))
    for name, m in named:
        if id(m) in replaced:
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name), attr, replaced[id(m)])
    for holder_name, groups in key_value_groups.items():  # (transformers' attention: _key_value_groups)
        module.get_submodule(holder_name).num_key_value_groups = groups
    for (first, first_attr), *others in ties:  # tied again: one parameter, as in the dense model
        for holder, attr in others:
            setattr(replaced[holder], attr, getattr(replaced[first], first_attr))
    # (torch's loss_parallel: a column layer's output a DTensor; each layer once, however many names)
    for layer in {id(m): m for m in (module.get_submodule(name) for name in as_dtensor)}.values():
        output_as_dtensor(layer, group)
    kept = {id(m): (m, style, outputs) for m, style, outputs in
            ((module.get_submodule(name), style, outputs) for name, (style, outputs, _) in chosen.items()
             if STYLES[style][1] is None)}
    for m, style, outputs in kept.values():  # (each once, under however many names)
        if style in _EXPERTS:
            shard_experts(m, split_styles[id(m)], group, sequence_parallel=sequence_parallel or outputs == "sequence",
                          partial_output=outputs == "partial")
        elif style == "local_params" and split_styles.get(id(m)):
            shard_parameters(m, split_styles[id(m)], group)
        elif style == "mla_kv_a_proj":
            sum_output_grads_over_group(m, style_of[id(m)][2], group)
        elif style == "replicated_with_output_grad_allreduce":
            sum_output_grads_over_group(m, None, group)
        elif style == "moe_identity_expert":
            share_identity_expert(m, group)
        elif style == "embedding_colwise":
            shard_embedding_dim(m, group)
        elif style == "replicated_with_grad_allreduce":
            sum_grads_over_group(m, group)
    # the modules a PrepareModule* style moves the inputs or outputs of: those it names, and those kept as
    # another style has them and moved too (sequence_parallel_plan's attention with per-head parameters of
    # its own, "local_params")
    moved = [(m, style_of[id(m)][2]) for m, style, _ in kept.values() if style == "redistribute"] + \
        [(module.get_submodule(name), moves) for name, moves in also_moved]
    for m, moves in moved:
        redistribute(m, moves, group)
    if p > 1:
        _watch_first_calls(module, chosen)
        _dropout_per_rank(module, group)
        # (a module's sequence-parallel column layers: one gather of their input; so the column layers of a
        # module a PrepareModule* style gathers the sequence into: one gather of its deferred input)
        share_input_gathers(module, [m for m, moves in moved if moves.gathers_sequence])
    return module


def _dropout_of(holder: nn.Module) -> list:
    """What says whether ``holder`` drops anything: ``(module, attribute)`` of each dropout it holds,
    an ``nn.Dropout``'s ``p``, or a float attribute named for a dropout (transformers' attention's
    ``attention_dropout``, which it passes to its attention function; ``resid_pdrop``)."""
    found = []
    for m in holder.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            found.append((m, "p"))
        found += [(m, attr) for attr, value in vars(m).items() if type(value) is float
                  and ("dropout" in attr.lower() or "pdrop" in attr.lower())]
    return found


def _dropping(drops) -> bool:
    """Whether any of ``drops`` (:func:`_dropout_of`) is above 0 now."""
    return any(getattr(m, attr) > 0 for m, attr in drops)


def _dropout_per_rank(module: nn.Module, group) -> None:
    """Run the dropout that draws on what each rank holds of its own from that rank's own random
    stream (:func:`tp_kernels.rng.rank_fork`), in training mode: in a module holding column layers
    and their row layer, from the output of its column layers to the input of its row layer
    (attention dropout on this rank's heads, dropout on its hidden units), and from the output of a
    row layer that reduce-scatters along the sequence to the end of the module's forward (this
    rank's block: Seed-OSS's residual dropout inside its attention and its MLP, under sequence
    parallelism). Hooks on the column and row layers (:class:`_RankDropout`), of each module that
    holds a dropout above 0 now (:func:`_dropout_of`; nothing hooked elsewhere, no cost). Elsewhere,
    a dropout module (``nn.Dropout``, above 0 now) given this rank's block of the sequence as a
    sequence-parallel collective made it (:data:`tp_kernels.mappings.SEQUENCE_BLOCK`: a row
    layer's reduce-scattered output, a module's output a ``PrepareModule*`` style splits: Phi-3's
    decoder layer dropping its attention's and its MLP's outputs under sequence parallelism) draws
    from this rank's stream too, by its own hooks. Without them every rank drew from the default
    stream, alike, and dropped its heads, or its block, with the other ranks' masks; what is drawn
    where the ranks hold the same activations (a row layer's output summed whole) is the default
    stream's, alike on every rank, as before, and so is a dropout that a module's own code draws
    on its block without a dropout module (``F.dropout``), or on what it computed from the block.
    A transformers model's gradient checkpointing (torch's checkpoint of a decoder layer's forward,
    its hooks left outside) draws the forward's masks again: each fork opens and closes inside the
    layer's forward, its seed drawn from the stream the checkpoint restores. Passed over (the
    default stream) under ``torch.compile``, a ``torch.func`` transform and a CUDA graph
    capture."""
    holders = {}
    for name, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, ColumnParallelLinear) and not m.gather_output:
            holder = module.get_submodule(name.rpartition(".")[0])
            holders[id(holder)] = holder
    forked = set()  # (the dropout modules of the hooked holders themselves: drawn inside their forks)
    for holder in holders.values():
        columns = [m for m in holder.children() if isinstance(m, ColumnParallelLinear) and not m.gather_output]
        rows = [m for m in holder.modules() if isinstance(m, RowParallelLinear) and m.input_is_parallel]
        drops = _dropout_of(holder)
        if not rows or not _dropping(drops):
            continue
        forked.update(id(m) for m in holder.children())
        streams = _RankDropout(columns[0].group, drops)
        for layer in columns:
            layer.register_forward_hook(streams.open)
        for layer in rows:
            layer.register_forward_pre_hook(streams.close)
            if layer.sequence_parallel:  # (it reduce-scatters along the sequence: after it, this rank's block)
                layer.register_forward_hook(streams.open)
        holder.register_forward_hook(streams.close, always_call=True)
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and id(m) not in forked and m.p > 0:
            streams = _RankDropout(group, [(m, "p")])
            m.register_forward_pre_hook(streams.open_on_block)
            m.register_forward_hook(streams.close, always_call=True)


class _RankDropout:
    """:func:`_dropout_per_rank`'s hooks of one module: ``open`` (a column layer's output, a
    sequence-parallel row layer's) enters this rank's stream where the module draws now (training
    mode, a dropout above 0, not under ``torch.compile``, a ``torch.func`` transform or a CUDA graph
    capture); ``close`` (a row layer's input, the module's end however its forward ends) leaves
    it."""

    def __init__(self, group, drops) -> None:
        self.group, self.drops, self.fork = group, drops, None

    def open(self, layer, args, output) -> None:
        if self.fork is not None or not layer.training or torch.compiler.is_compiling() or \
                functorch_transforms() or rng.capturing() or not _dropping(self.drops):
            return
        fork = rng.rank_fork(self.group)
        fork.__enter__()
        self.fork = fork

    def open_on_block(self, module, args) -> None:
        """``open``, where the module's input is this rank's block of the sequence
        (:data:`tp_kernels.mappings.SEQUENCE_BLOCK`)."""
        if args and getattr(args[0], SEQUENCE_BLOCK, False):
            self.open(module, args, None)

    def close(self, *_) -> None:
        if self.fork is not None:
            fork, self.fork = self.fork, None
            fork.__exit__(None, None, None)


def _whole(layer: nn.Module) -> bool:
    """Whether ``layer`` (one of this library's) returns its output whole and alike on every rank:
    a row layer that sums its output, a column layer that gathers it, an embedding that sums its
    rows, none of them along the sequence."""
    if isinstance(layer, RowParallelLinear):
        return layer.reduce_results and not layer.sequence_parallel
    if isinstance(layer, ColumnParallelLinear):
        return layer.gather_output
    return isinstance(layer, VocabParallelEmbedding) and not layer.sequence_parallel


def _watch_first_calls(module: nn.Module, chosen: Dict[str, tuple]) -> None:
    """Check, at each watched module's first call, that its parameters' gradients come out the dense
    model's, by what its input is. Two mistakes of a plan are silently wrong gradients:

    - a module the plan does not name that holds parameters (beside a column layer, inside the
      module holding it) takes a column layer's output (or a view of it), each rank's block of its
      columns: its parameters would then take on each rank that block's share of their gradient
      (transformers' Apertus, whose learnable activation runs on the MLP's column outputs). The
      plan names it ``"replicated_with_grad_allreduce"`` (its gradients summed over the group) or
      ``"replicate"`` (it applies them to something else);
    - a module the plan names ``"replicated_with_grad_allreduce"`` takes, as its first tensor
      argument, a tensor whole and alike on every rank (the output of a row layer that sums it, a
      column layer that gathers it or an embedding that sums it, a view of all of it, or, where
      gradients are taken (autograd records the steps), a tensor computed from it by elementwise
      steps alone: :data:`_ELEMENTWISE`, a residual sum), and no rank's block of anything (a
      column layer's output, a sequence-parallel block): every rank computes the whole gradient,
      which the sum counts p times (a norm of the residual stream named so without sequence
      parallelism). The plan names it ``"replicate"``, or not at all.

    Either raises ``ValueError`` naming the module and the layer whose output it took, where
    gradients are taken (else a gradient that reaches the parameters later does). Forward hooks,
    each removed after its first call (none where there is nothing to watch): no cost after the
    first forward."""
    named = dict(module.named_modules(remove_duplicate=False))
    columns = {id(m): name for name, m in named.items() if isinstance(m, ColumnParallelLinear) and not m.gather_output}
    covered = set()  # (the modules the plan names, but those it only moves, and everything inside one whose
    # gradients it takes care of whole)
    for name, (style, _, _) in chosen.items():
        if style != "redistribute":
            covered.update(id(m) for m in (named[name].modules() if style in _WHOLE_SUBTREES else [named[name]]))
    watched: Dict[int, tuple] = {}  # id(module) -> (its name, it, whether the plan sums its gradients)
    for parent_name in dict.fromkeys(name.rpartition(".")[0] for name in columns.values()):  # (each holder once)
        parent = module.get_submodule(parent_name)
        for inner_name, inner in parent.named_modules(prefix=parent_name):
            if inner is not parent and id(inner) not in covered and id(inner) not in watched and \
                    next(inner.parameters(recurse=False), None) is not None:
                watched[id(inner)] = (inner_name, inner, False)
    for name, (style, _, _) in chosen.items():
        m = named[name]
        if style == "replicated_with_grad_allreduce" and _trained(m, True):
            watched.setdefault(id(m), (name, m, True))
    if not watched:
        return
    sources = {id(m): name for name, m in named.items() if id(m) in columns or _whole(m)}
    outputs: Dict[int, tuple] = {}  # id(a watched layer's output) -> (a weak reference to it, the layer's name,
    # whether it is whole)
    whole_steps: Dict[int, tuple] = {}  # id(a whole output's autograd node) -> (the node, the layer's name): held
    # until the first call ends
    handles = []

    def finish(*_):  # (every hook removed: each watched module called once, or the model's first call done)
        if torch.compiler.is_compiling():  # (traced, they check nothing: left for the first eager call)
            return
        for h in handles:
            h.remove()
        handles.clear()
        watched.clear()
        outputs.clear()
        whole_steps.clear()

    def record(layer, args, output):
        if not torch.compiler.is_compiling():
            out = output[0] if isinstance(output, tuple) else output
            outputs[id(out)] = (weakref.ref(out), sources[id(layer)], id(layer) not in columns)
            if id(layer) not in columns and out.grad_fn is not None:
                whole_steps[id(out.grad_fn)] = (out.grad_fn, sources[id(layer)])

    def source_of(x, whole: bool):
        """The layer whose output ``x`` is, or a view of: for ``whole``, a view of all of it (a part
        may be a rank's block, the model's own split)."""
        for t in (x, x._base):
            entry = outputs.get(id(t)) if t is not None else None
            if entry is not None and entry[0]() is t and entry[2] == whole and \
                    (not whole or t.numel() == x.numel()):
                return entry[1]
        return None

    def computed_from_whole(x):
        """The layer of whose whole output ``x`` is computed by elementwise steps alone (a residual
        sum); None where none is found within a few steps."""
        stack, seen = [x.grad_fn] if x.grad_fn is not None else [], set()
        while stack and len(seen) < 32:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            entry = whole_steps.get(id(node))
            if entry is not None and entry[0] is node:
                return entry[1]
            if node.name() in _ELEMENTWISE:
                stack.extend(n for n, _ in node.next_functions if n is not None)
        return None

    def check(name: str, m: nn.Module, summed: bool, handle):
        def hook(_, args, kwargs):
            if torch.compiler.is_compiling():
                return
            handle[0].remove()
            watched.pop(id(m), None)
            tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
            fed = next(filter(None, (source_of(x, False) for x in tensors)), None)  # (a column layer's block)
            try:
                if not summed and fed is not None:
                    params = _trained(m, False)
                    _misplaced_gradient(m, params, _shared_message(name, m, fed, params))
                elif summed and fed is None and tensors and not any(getattr(x, SEQUENCE_BLOCK, False) for x in tensors):
                    whole = source_of(tensors[0], True)  # (the graph walked only where no view of one is found)
                    computed = None if whole else computed_from_whole(tensors[0])
                    if whole or computed:
                        _misplaced_gradient(m, _trained(m, True),
                                            _summed_message(name, m, whole or computed, not whole))
            except ValueError:
                finish()  # (the model's first call ends here)
                raise
            if not watched:
                finish()
        return hook

    for layer_name in sources.values():
        handles.append(named[layer_name].register_forward_hook(record))
    for name, m, summed in list(watched.values()):
        handle = [None]
        handle[0] = m.register_forward_pre_hook(check(name, m, summed, handle), with_kwargs=True)
        handles.append(handle[0])
    handles.append(module.register_forward_hook(finish))


#: the autograd steps through which a tensor computed from a whole one is whole and alike on every
#: rank too (:func:`_watch_first_calls`): sums, scalings, dropout, casts, copies
_ELEMENTWISE = frozenset({"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward0",
                          "RsubBackward1", "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
                          "NativeDropoutBackward0", "ToCopyBackward0", "CloneBackward0"})


def _trained(m: nn.Module, recurse: bool) -> list:
    """The names of ``m``'s parameters that take gradients (its own, or its submodules' too)."""
    return [attr for attr, q in m.named_parameters(recurse=recurse) if q.requires_grad]


def _pattern(name: str) -> str:
    """The plan's pattern for ``name`` in every layer: ``"model.layers.*.mlp.act_fn"``."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def _shared_message(name: str, m: nn.Module, source: str, params: list) -> str:
    """The error of a module the plan does not name, ``m`` (``name``) holding ``params``, fed by
    the column layer ``source``."""
    return (f"tp_kernels: parallelize: {name!r} ({type(m).__name__}) holds parameters ({', '.join(params)}) that "
            f"the plan keeps whole, and takes the output of the column layer {source!r}, each rank's block of its "
            "columns: its gradient on each rank would be that block's share, not the dense one. Name it in the "
            f"plan: {_pattern(name)!r}: 'replicated_with_grad_allreduce' (its gradients summed over the group: where "
            "it acts on each column, or each head, alone; one that mixes the columns, a norm over all of them, needs "
            "them whole: 'colwise_gather_output' for the column layer), or 'replicate' (it applies its parameters "
            "to something else)")


def _summed_message(name: str, m: nn.Module, source: str, computed: bool) -> str:
    """The error of a module the plan names ``"replicated_with_grad_allreduce"``, ``m`` (``name``),
    whose input is the whole output of ``source`` (``computed``: computed from it elementwise)."""
    what = f"computed elementwise from the output of {source!r} (a residual sum)" if computed else \
        f"the output of {source!r}"
    return (f"tp_kernels: parallelize: {name!r} ({type(m).__name__}) is named 'replicated_with_grad_allreduce' "
            f"(its gradients summed over the group), but its input is {what}, whole and alike on "
            "every rank: every rank computes its whole gradient, and the sum would count it once per rank. Name it "
            f"in the plan: {_pattern(name)!r}: 'replicate' (or leave it out); 'replicated_with_grad_allreduce' is "
            "for a module run on each rank's block (a column layer's output, a sequence-parallel block)")


def _misplaced_gradient(m: nn.Module, params: list, message: str) -> None:
    """What :func:`_watch_first_calls` does on finding ``m`` fed wrongly: raise ``message`` now where
    its parameters ``params`` (their names in ``m``; none: nothing) take gradients, else on any
    gradient that reaches them later (the forward is the dense model's: only a gradient is wrong)."""
    if not params:
        return
    if torch.is_grad_enabled():
        raise ValueError(message)

    def refuse(_):
        raise ValueError(message)

    for attr in params:
        m.get_parameter(attr).register_hook(refuse)


def _resolve(module: nn.Module, plan: Mapping[str, object], p: int, strict: bool, sequence_parallel: bool,
             sequence_dim):
    """:func:`parallelize`'s checks, which change nothing: ``(named, chosen, style_of, split_styles,
    ties, as_dtensor, also_moved, key_value_groups)``, what it replaces and keeps (``chosen``: ``{name: (style,
    outputs, sequence dim or None)}``; ``split_styles``: ``{id(module): {attribute: style}}``, the
    parameters the plan splits by name; ``as_dtensor``: the column layers whose output is handed on
    as a DTensor; ``also_moved``: ``[(name, moves)]``, the modules a kept style names that a torch
    ``PrepareModule*`` style moves too; ``key_value_groups``: :func:`_key_value_groups`), or a
    ``ValueError`` naming the pattern and the module."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"plan: expected a non-empty mapping of name patterns to styles, got {plan!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict: expected a bool, got {strict!r}")
    check_sequence_dim(sequence_dim, sequence_parallel)
    plan = read_expert_parallelism(plan)
    named = [(name, m) for name, m in module.named_modules(remove_duplicate=False) if name]
    # each parameter by its qualified name: (name, its module's name, its module, its attribute)
    params = [(f"{name}.{attr}" if name else attr, name, m, attr)
              for name, m in [("", module)] + named for attr, _ in m.named_parameters(recurse=False)]
    # name -> (style, outputs: (output_sizes, head_size) or None, the sequence dim of its sequence
    # parallelism or None)
    chosen: Dict[str, tuple] = {}
    sequence_of: Dict[int, tuple] = {}  # id(module) -> (its sequence dim or None, name)
    as_dtensor = []  # the names of the column layers whose output is handed on as a DTensor
    style_of: Dict[int, tuple] = {}  # id(module) -> (style, name, outputs): one style per module object
    moves_of: Dict[int, tuple] = {}  # id(module) -> (name, its Moves): torch's PrepareModule* styles
    by_parameter: Dict[int, Dict[str, tuple]] = {}  # id(module) -> {attribute: (style, its name)}
    for pattern, entry in plan.items():
        torch_style = is_torch_style(entry)  # (read for each module it applies to)
        style, outputs = ("replicate", None) if torch_style else _style(pattern, entry)
        hits = [(name, m) for name, m in named if fnmatch.fnmatchcase(name, pattern)]
        matched = {id(m) for _, m in hits}  # (a module it names: not its parameters too)
        parameter_hits = [hit for hit in params if fnmatch.fnmatchcase(hit[0], pattern) and id(hit[2]) not in matched]
        if not hits and not parameter_hits:
            if not strict:
                continue
            raise ValueError(f"plan: pattern {pattern!r} matches no submodule or parameter of {type(module).__name__} "
                             "(strict=False passes over such patterns)")
        for name, owner_name, owner, attr in parameter_hits:
            if torch_style:
                raise ValueError(f"plan[{pattern!r}]: {type(entry).__name__} applies to a module, but {name!r} is a "
                                 "parameter")
            if outputs is not None or style not in PARAMETER_STYLES:
                raise ValueError(f"plan[{pattern!r}]: {name!r} is a parameter, which takes one of "
                                 f"{', '.join(map(repr, PARAMETER_STYLES))} (of a module the plan names "
                                 f"{' or '.join(map(repr, _OWNERS))}), not {_describe(style, outputs)}")
            first_style, first_name = by_parameter.setdefault(id(owner), {}).setdefault(attr, (style, name))
            if first_style != style:
                raise ValueError(f"plan: {name!r} is matched as {style!r}, but the same parameter ({first_name!r}) "
                                 f"as {first_style!r}")
        if hits and style not in STYLES:
            raise ValueError(f"plan[{pattern!r}]: {style!r} splits a parameter (of a module the plan names "
                             f"{' or '.join(map(repr, _OWNERS))}), but {hits[0][0]!r} is a {type(hits[0][1]).__name__}")
        for name, m in hits:
            sequence, dtensor = sequence_dim if sequence_parallel else None, False
            if torch_style:
                style, outputs, sequence, dtensor = translate(pattern, entry, m)
            expected = STYLES.get(style, (None,))[0]
            if not isinstance(m, expected):
                raise ValueError(
                    f"plan[{pattern!r}]: style {style!r} applies to {expected.__name__}, but {name!r} is a {type(m).__name__}"
                )
            try:
                if style == "vocab":  # (a subclass whose replacement would lose something; Gemma's scaled one taken)
                    check_embedding(repr(name), m)
                elif style == "embedding_colwise":
                    check_embedding_dim(repr(name), m, p)
                elif STYLES[style][1] is not None:
                    check_replaceable(repr(name), m, expected)  # a subclass whose replacement would lose something
            except ValueError as exc:
                raise ValueError(f"plan[{pattern!r}]: {exc}") from None
            if style in ("rowwise_split_input", "embedding_colwise") and sequence is not None:
                what = "a row layer whose input is" if style == "rowwise_split_input" else "an embedding whose output is"
                raise ValueError(f"plan[{pattern!r}]: {name!r}: {style!r} ({what} whole) does not go with "
                                 "sequence_parallel=True")
            # (a column's or a vocabulary's rows are padded)
            if STYLES[style][1] is RowParallelLinear and m.in_features % p:
                raise ValueError(f"plan[{pattern!r}]: {name!r} ({style}) has in_features={m.in_features}, which the "
                                 f"tensor-parallel size {p} does not divide")
            given = outputs
            if style == "mla_kv_a_proj":  # (the columns: given, or the model's)
                given = _rope_columns(pattern, module) if outputs is None else outputs
                if type(given) is not int or not 0 < given < m.out_features:
                    raise ValueError(f"plan[{pattern!r}]: {name!r} ('mla_kv_a_proj'): the rotary key's columns "
                                     f"must be an int in [1, {m.out_features}) (its out_features), got {given!r}")
            elif style == "packed_colwise":  # ('colwise', its two halves)
                if m.out_features % 2:
                    raise ValueError(f"plan[{pattern!r}]: {name!r} ('packed_colwise': two outputs side by side) has "
                                     f"an odd out_features={m.out_features}")
                given = ((m.out_features // 2,) * 2, None)
            elif style == "colwise" and given is None:  # (a transformers attention's keys and values)
                given = _replicated_heads(pattern, name, m, module, p)
            if given == "partial" and sequence is not None:
                raise ValueError(f"plan[{pattern!r}]: {name!r}: {'experts' if style in _EXPERTS else 'a row layer'} "
                                 f"whose output is left partial, {_describe(style, given)}, do not go with sequence "
                                 "parallelism, under which the output is reduce-scattered there")
            if given is not None and given not in _HOW and style not in ("mla_kv_a_proj", "redistribute"):
                try:
                    check_output_sizes(given[0], m.out_features, p, given[1])
                except ValueError as exc:
                    raise ValueError(f"plan[{pattern!r}]: {name!r}: {exc}") from None
            if style == "redistribute":  # (moves, kept apart: a module the plan keeps may be moved as well)
                first_name, first_moves = moves_of.setdefault(id(m), (name, given))
                if first_moves != given:
                    raise ValueError(f"plan: {name!r} is matched as {_describe(style, given)}, but the same module "
                                     f"({first_name!r}) as {_describe(style, first_moves)}")
                continue
            first_style, first_name, first_outputs = style_of.setdefault(id(m), (style, name, given))
            if (first_style, first_outputs) != (style, given):
                raise ValueError(
                    f"plan: {name!r} is matched as {_describe(style, given)}, but the same module ({first_name!r}) "
                    f"as {_describe(first_style, first_outputs)}"
                )
            first_sequence, first_name = sequence_of.setdefault(id(m), (sequence, name))
            if first_sequence != sequence:
                raise ValueError(f"plan: {name!r} is matched with the sequence split along "
                                 f"{'no dim' if sequence is None else f'dim {sequence}'}, but the same module "
                                 f"({first_name!r}) along {'no dim' if first_sequence is None else f'dim {first_sequence}'}")
            chosen[name] = (style, given, sequence)
            if dtensor and name not in as_dtensor:
                as_dtensor.append(name)
    also_moved = []  # (name, moves) of the modules the plan keeps (its style) and moves too
    for key, (name, moves) in moves_of.items():
        if key not in style_of:
            style_of[key] = ("redistribute", name, moves)
            chosen[name] = ("redistribute", moves, None)
        elif STYLES[style_of[key][0]][1] is not None:
            first_style, first_name, first_outputs = style_of[key]
            raise ValueError(f"plan: {name!r} is matched as {_describe('redistribute', moves)}, but the same module "
                             f"({first_name!r}) as {_describe(first_style, first_outputs)}, which replaces it: a "
                             "replaced layer's input and output layouts are its torch style's")
        else:
            also_moved.append((name, moves))

    for name, owner_name, owner, attr in params:  # the modules whose parameters the plan splits, each checked whole
        if id(owner) not in by_parameter:
            continue
        style, first_name = by_parameter[id(owner)].get(attr, (None, name))
        if style is not None and style_of.get(id(owner), (None,))[0] not in _OWNERS:
            raise ValueError(f"plan: {first_name!r} is split by parameter name ({style!r}), which only a parameter "
                             f"of a module the plan names {' or '.join(map(repr, _OWNERS))} is; "
                             f"{owner_name or 'the model'!r} is a {type(owner).__name__} the plan "
                             f"{'names ' + repr(style_of[id(owner)][0]) if id(owner) in style_of else 'does not name'}")
    split_styles = {owner: {attr: how for attr, (how, _) in held.items()} for owner, held in by_parameter.items()}
    for name, (style, _, _) in chosen.items():
        if style in _OWNERS:
            m = module.get_submodule(name)
            split = split_styles.get(id(m), {})
            if not split and style in _EXPERTS:  # (a 'local_params' module may hold none in this model)
                example = "'experts'" if style == "moe_ep_experts" else "'packed_colwise'"
                raise ValueError(f"plan: {name!r} is {style!r}, but the plan splits none of its parameters: name "
                                 f"each expert weight ('{name}.gate_up_proj': {example}, ...)")
            if not split:
                continue
            try:
                check_styles(m, split, p, every=style in _EXPERTS, by_expert=style == "moe_ep_experts")
            except ValueError as exc:
                raise ValueError(f"plan: {name!r} ({style!r}): {exc}") from None

    for name, (style, _, _) in chosen.items():  # a module kept whole holds no parallel layer, now or to be
        if style in _EXPERTS:  # (run whole on every rank inside experts whose output is summed: p times)
            identities = [(n, chosen.get(n, (None,))[0]) for n, sub in named
                          if n.startswith(name + ".") and isinstance(sub, nn.Identity)]
            for inner, inner_style in identities:
                if style == "moe_ep_experts" or inner_style != "moe_identity_expert":
                    raise ValueError(
                        f"plan: {name!r} ({style!r}) holds the identity expert {inner!r}, which every rank would run "
                        "whole and the sum over the group count once per rank: " +
                        ("name it 'moe_identity_expert'" if style == "moe_tp_experts" else
                         "expert parallelism leaves no rank to run it alone; split these experts by hidden units"))
        if style == "moe_identity_expert" and not any(
                name.startswith(owner + ".") and chosen[owner][0] == "moe_tp_experts" for owner in chosen):
            raise ValueError(f"plan: {name!r} ('moe_identity_expert') divides its input by the group's size, for "
                             "the sum of the 'moe_tp_experts' experts it is inside; it is inside none")
        if style in _REPLICATED:
            inner = [n for n, sub in named if n.startswith(name + ".") and (
                getattr(type(sub), "sharded_parameters", None) or "parameter_splits" in sub.__dict__
                or id(sub) in by_parameter or chosen.get(n, (style,))[0] not in (style, "replicate"))]
            if inner:
                raise ValueError(f"plan: {name!r} ({style}) holds the parallel layer {inner[0]!r}, whose "
                                 "gradients must not be summed over the group: name the modules every rank holds "
                                 "whole")
    _check_something_split(module, plan, chosen)

    ties = _ties(module, named, style_of)
    return named, chosen, style_of, split_styles, ties, as_dtensor, also_moved, _key_value_groups(module, chosen, p)


def _check_something_split(module: nn.Module, plan: Mapping[str, object], chosen: Dict[str, tuple]) -> None:
    """A ``ValueError`` for a plan whose styles sum a gradient over the group (:data:`_SUMMED_GRADIENTS`)
    where nothing makes the ranks' activations differ: no style splits a layer, a parameter or the
    activations themselves (``"redistribute"``), and ``module`` holds no parallel layer already.
    Every rank's gradient is then the whole one, and their sum p times it, silently (a
    transformers ``tp_plan`` whose split layers' patterns, under ``strict=False``, matched no
    name of this model, its norms' did). Not for a plan of torch styles: torch's
    ``SequenceParallel`` takes its input as this rank's block of the sequence, which the model's
    own code may have split."""
    if any(is_torch_style(entry) for entry in plan.values()):
        return
    summed = [(name, style) for name, (style, _, _) in chosen.items() if style in _SUMMED_GRADIENTS]
    if not summed or any(style not in (*_SUMMED_GRADIENTS, "replicate") for style, _, _ in chosen.values()):
        return
    if sharded_blocks(module)[0]:
        return  # (a model parallelized before, by another plan or by hand: its layers split)
    name, style = summed[0]
    raise ValueError(f"plan: {name!r} is {style!r}, which sums a gradient over the group, but the plan splits nothing "
                     f"of {type(module).__name__} (no layer, parameter or activation): every rank's gradient is the "
                     "whole one, and the sum would be the group's size times it. Split the layers around it, or leave "
                     "it out; where the model splits its activations itself, call tp_kernels.grads."
                     f"{'sum_grads' if style == 'replicated_with_grad_allreduce' else 'sum_output_grads'}_over_group")


def _replicated_heads(pattern: str, name: str, layer: nn.Linear, model: nn.Module, p: int) -> Optional[tuple]:
    """What a plain ``"colwise"`` of ``layer`` in a transformers attention (its holder with an int
    ``head_dim`` and ``num_key_value_groups``, and a ``config.num_attention_heads``) must be so that
    each rank holds whole heads: None where p divides its heads (split as they are);
    ``((out_features,), head_dim)`` for the key or value projection of fewer heads than ranks, which
    divide p (grouped- or multi-query attention: each head replicated on p / heads ranks, as vLLM
    does, and the attention's ``num_key_value_groups`` made this rank's, :func:`_key_value_groups`),
    where a split by columns would cut heads apart and the attention's view of them fail; a
    ``ValueError`` for heads that cannot be split whole. None too for a layer that is not the
    attention's query, key or value projection (its heads neither the query heads nor a group's)."""
    holder = model.get_submodule(name.rpartition(".")[0])
    head_dim, groups = getattr(holder, "head_dim", None), getattr(holder, "num_key_value_groups", None)
    queries = getattr(getattr(holder, "config", None), "num_attention_heads", None)
    if not all(type(v) is int and v > 0 for v in (head_dim, groups, queries)) or layer.out_features % head_dim:
        return None
    heads = layer.out_features // head_dim
    if heads % p == 0 or heads not in (queries, queries / groups):
        return None
    kind = "query" if heads == queries else "key/value"
    if heads == queries or p % heads or queries % p:
        raise ValueError(f"plan[{pattern!r}]: {name!r} ('colwise') holds {heads} {kind} heads of head_dim {head_dim} "
                         f"(its attention's, of {queries} query heads): {p} ranks cannot each hold whole heads (the "
                         "query heads must split evenly, and the key/value heads split evenly or divide the ranks)")
    return (layer.out_features,), head_dim


def _key_value_groups(module: nn.Module, chosen: Dict[str, tuple], p: int) -> Dict[str, int]:
    """``{name: this rank's num_key_value_groups}`` of each module holding a column layer whose
    heads the plan replicates on several ranks (keys and values of fewer heads than ranks,
    ``("colwise", sizes, head_size)``), where the module is an attention of transformers' (an int
    ``num_key_value_groups``: query heads a key/value head): this rank's query heads (``H / p``)
    over the one key/value head it holds. The dense ratio (``H / KV``) would have its eager
    attention (and its SDPA with a mask) repeat the key ``H / KV`` times for ``H / p`` query heads:
    a shape error. Outputs split into ``b < p`` blocks scale the ratio by ``b / p``; the layers of
    one module must agree, and the ratio must stay whole (a ``ValueError`` naming them)."""
    groups: Dict[str, tuple] = {}  # holder's name -> (the first layer's name, its blocks)
    for name, (style, given, _) in chosen.items():
        if style != "colwise" or not given or given[1] is None:
            continue
        blocks = min(check_output_sizes(given[0], module.get_submodule(name).out_features, p, given[1])[1])
        holder_name = name.rpartition(".")[0]
        dense = getattr(module.get_submodule(holder_name), "num_key_value_groups", None)
        if blocks == p or type(dense) is not int:
            continue
        first_name, first = groups.setdefault(holder_name, (name, blocks))
        if first != blocks:
            raise ValueError(f"plan: {name!r} splits its heads into {blocks} blocks and {first_name!r} into {first}: "
                             f"{holder_name!r}'s num_key_value_groups ({dense}) cannot be this rank's ratio for both")
        if dense * blocks % p:
            raise ValueError(f"plan: {name!r}'s heads in {blocks} blocks over {p} ranks leave {holder_name!r} "
                             f"(num_key_value_groups={dense}) no whole number of query heads a key/value head")
    return {holder_name: module.get_submodule(holder_name).num_key_value_groups * blocks // p
            for holder_name, (_, blocks) in groups.items()}


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _agree_on_weights(module: nn.Module, group, hint) -> None:
    """That every rank of ``group`` holds the same dense ``module`` (names, shapes, dtypes, and a
    sample of up to 64 values of each parameter and buffer: one all-gather of a digest), or a
    ``RuntimeError`` on every rank: ranks that built it from different random draws would each keep
    its shard of another model, silently."""
    h = hashlib.blake2b(digest_size=8)
    samples = []
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        h.update(f"{name} {list(t.shape)} {t.dtype};".encode())
        if t.device.type != "meta" and t.numel():
            flat = dp.local(t.detach()).reshape(-1)  # (a DTensor's: this rank's rows)
            samples.append(flat[:: max(1, flat.numel() // 64)][:64].contiguous().view(torch.uint8).reshape(-1))
    if samples:  # (one copy to the host)
        h.update(torch.cat([x.to(samples[0].device) for x in samples]).cpu().numpy().tobytes())
    views = exchange_views(h.hexdigest(), *coll.host_route(group, hint))
    if len(set(views)) > 1:
        listing = ", ".join(f"rank {q}: {v}" for q, v in enumerate(views))
        raise RuntimeError(f"tp_kernels: parallelize: the ranks of group {group.group_name!r} hold different dense "
                           f"models (a digest of each parameter's and buffer's name, shape, dtype and a sample of its "
                           f"values: {listing}), so the shards they would keep are not of one model: seed every rank "
                           "alike (torch.manual_seed) before building it, or load the same checkpoint on each")


def _rope_columns(pattern: str, model: nn.Module) -> int:
    """How many columns of a DeepSeek multi-head latent attention's ``kv_a_proj_with_mqa`` are the
    rotary key: its model's (text) ``config.qk_rope_head_dim``, as transformers' plans assume."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    columns = getattr(config, "qk_rope_head_dim", None)
    if columns is None:
        raise ValueError(f"plan[{pattern!r}]: 'mla_kv_a_proj' sums the gradient of the projection's rotary key "
                         f"columns, but this {type(model).__name__} has no config.qk_rope_head_dim to say how many: "
                         "write ('mla_kv_a_proj', columns)")
    return columns


def _describe(style: str, outputs) -> str:
    """A plan's value as it was written (lists for the sizes)."""
    if outputs is None:
        return repr(style)
    if style in ("mla_kv_a_proj", "redistribute") or outputs in _HOW:
        return repr((style, outputs))
    sizes, head_size = outputs
    sizes = list(sizes) if isinstance(sizes, tuple) else sizes
    return repr((style, sizes) if head_size is None else (style, sizes, head_size))


def _ties(module: nn.Module, named, style_of: Dict[int, tuple]) -> list:
    """The parameters that several modules of ``module`` hold (tied weights: an embedding and the
    output layer), where the plan replaces one of them: each as ``[(id(module), attribute), ...]``,
    for the replacements to hold one parameter again. A ``ValueError`` unless the plan replaces
    every module holding it and splits it alike (each replacement then holds the same block)."""
    holders: Dict[int, Dict[tuple, str]] = {}  # id(parameter) -> {(id(module), attribute): its name}
    for name, m in [("", module)] + named:
        for attr, param in m.named_parameters(recurse=False):
            holders.setdefault(id(param), {}).setdefault((id(m), attr), f"{name}.{attr}" if name else attr)
    ties = []
    for held in holders.values():
        if len(held) < 2 or not any(key[0] in style_of for key in held):
            continue
        # how each holder's replacement holds it: (style, the dim it splits, or None: whole, outputs)
        splits = {}
        for (mid, attr), name in held.items():
            style, _, outputs = style_of.get(mid, (None, None, None))
            build = STYLES[style][1] if style else None
            splits[name] = (style if build else None, build.sharded_parameters.get(attr) if build else None, outputs)
        if (any(style is None for style, _, _ in splits.values())
                or len({(d, outputs) for _, d, outputs in splits.values()}) > 1):
            def how(style, d, outputs):
                if style is None:
                    return "left dense"
                parts = "" if outputs is None else f" of outputs {list(outputs[0])}"
                parts += "" if outputs is None or outputs[1] is None else f" of heads of {outputs[1]}"
                return f"{style}{parts}, " + ("whole" if d is None else f"split along dim {d}")

            listing = ", ".join(f"{name!r} ({how(*split)})" for name, split in splits.items())
            raise ValueError(f"plan: {listing} are one parameter (tied); replace every module that holds it, "
                             "splitting it alike (an embedding 'vocab' and its output layer 'colwise'), or untie them")
        ties.append(list(held))
    return ties
