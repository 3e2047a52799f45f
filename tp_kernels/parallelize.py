"""Shard an existing dense model in place, by a plan of name patterns; and what a training loop
over a tensor-parallel model needs of its gradients (sequence-parallel sums, the global norm) and
of its checkpoints (the full state dict, saved and loaded whatever the tensor-parallel size)."""

from __future__ import annotations

import fnmatch
import math
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives as coll
from ._agreement import agree, describe
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["STYLES", "allreduce_sequence_parallel_grads", "clip_grad_norm_", "full_state_dict",
           "load_full_state_dict", "parallelize", "sharded_state_dict"]

#: plan style -> (module type it applies to, what replaces it)
STYLES = {
    "colwise": (nn.Linear, ColumnParallelLinear),
    "rowwise": (nn.Linear, RowParallelLinear),
    "vocab": (nn.Embedding, VocabParallelEmbedding),
}


def _split_size(style: str, module) -> tuple:
    """(the name, the size) of the dimension that ``style`` splits ``module`` along."""
    if style == "colwise":
        return "out_features", module.out_features
    if style == "rowwise":
        return "in_features", module.in_features
    return "num_embeddings", module.num_embeddings


def parallelize(module: nn.Module, plan: Mapping[str, str], *, group=None, sequence_parallel: bool = False) -> nn.Module:
    """Replace, in place, the submodules of ``module`` that ``plan`` names by parallel layers.

    ``plan`` maps ``fnmatch`` patterns over qualified submodule names (``"layers.*.mlp.fc1"``)
    to a style: ``"colwise"`` (``nn.Linear`` → :class:`ColumnParallelLinear`), ``"rowwise"``
    (``nn.Linear`` → :class:`RowParallelLinear`, input already parallel) or ``"vocab"``
    (``nn.Embedding`` → :class:`VocabParallelEmbedding`). Each replacement holds this rank's
    shard of the existing weights, so a dense model computes the same function afterwards
    (the code around the layers must use the local sizes, e.g. heads per rank).

    With ``sequence_parallel=True`` the linear layers are built with sequence parallelism: the
    activations between a row layer and the next column layer are split along dim 0.

    A parameter that several modules hold (an embedding tied to the output layer) stays one
    parameter: the plan must replace every module holding it and split it alike (``"vocab"`` and
    ``"colwise"`` both split dim 0 of ``[V, D]``), and the replacements then hold one block.

    Everything is checked before anything is replaced: an unknown style, a pattern that matches
    nothing, a style applied to the wrong module type, a split size the group's size does not
    divide, one module given two styles, or a tied parameter the plan would split apart raise
    ``ValueError`` naming the pattern and the module's path. Returns ``module``.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"plan: expected a non-empty mapping of name patterns to styles, got {plan!r}")
    group = coll.resolve_group(group)
    p = coll.group_size(group)
    named = [(name, m) for name, m in module.named_modules(remove_duplicate=False) if name]
    chosen: Dict[str, str] = {}
    style_of: Dict[int, tuple] = {}  # id(module) -> (style, name): one style per module object
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}]: unknown style {style!r}; expected one of {', '.join(map(repr, STYLES))}")
        expected = STYLES[style][0]
        hits = [(name, m) for name, m in named if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ValueError(f"plan: pattern {pattern!r} matches no submodule of {type(module).__name__}")
        for name, m in hits:
            if not isinstance(m, expected):
                raise ValueError(
                    f"plan[{pattern!r}]: style {style!r} applies to {expected.__name__}, but {name!r} is a {type(m).__name__}"
                )
            size, value = _split_size(style, m)
            if value % p:
                raise ValueError(f"plan[{pattern!r}]: {name!r} ({style}) has {size}={value}, which the tensor-parallel "
                                 f"size {p} does not divide")
            first_style, first_name = style_of.setdefault(id(m), (style, name))
            if first_style != style:
                raise ValueError(
                    f"plan: {name!r} is matched as {style!r}, but the same module ({first_name!r}) as {first_style!r}"
                )
            chosen[name] = style

    ties = _ties(module, named, style_of)

    # Build each replacement once, then swap every name under which the module is reachable
    # (a module shared under two names must not stay dense under the one the plan missed).
    replaced: Dict[int, nn.Module] = {}
    for name, style in chosen.items():
        old = module.get_submodule(name)
        if id(old) in replaced:
            continue
        build = STYLES[style][1]
        if style == "vocab":
            replaced[id(old)] = build.from_embedding(old, group=group)
        elif style == "colwise":
            replaced[id(old)] = build.from_linear(old, group=group, sequence_parallel=sequence_parallel)
        else:
            replaced[id(old)] = build.from_linear(
                old, group=group, sequence_parallel=sequence_parallel, input_is_parallel=True
            )
    for name, m in named:
        if id(m) in replaced:
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name), attr, replaced[id(m)])
    for (first, first_attr), *others in ties:  # tied again: one parameter, as in the dense model
        for holder, attr in others:
            setattr(replaced[holder], attr, getattr(replaced[first], first_attr))
    return module


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
        splits = {}  # how each holder's replacement holds it: (style, the dim it splits, or None: whole)
        for (mid, attr), name in held.items():
            style = style_of.get(mid, (None,))[0]
            splits[name] = (style, STYLES[style][1].sharded_parameters.get(attr) if style else None)
        if any(style is None for style, _ in splits.values()) or len({d for _, d in splits.values()}) > 1:
            def how(style, d):
                return "left dense" if style is None else f"{style}, " + ("whole" if d is None else f"split along dim {d}")

            listing = ", ".join(f"{name!r} ({how(*split)})" for name, split in splits.items())
            raise ValueError(f"plan: {listing} are one parameter (tied); replace every module that holds it, "
                             "splitting it alike (an embedding 'vocab' and its output layer 'colwise'), or untie them")
        ties.append(list(held))
    return ties


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], group=None) -> None:
    """Sum the gradients of ``params`` over the tensor-parallel group, in place.

    Under sequence parallelism, a replicated parameter applied to this rank's sequence block
    (a layer norm between the parallel layers) gets only this block's share of its gradient.
    Call this after backward, before the optimizer step, with exactly those parameters; the
    parallel layers' own parameters (including a row-parallel bias) are already complete.
    Parameters without a gradient are skipped. One all-reduce for all of them.
    """
    params = list(params)
    group = coll.resolve_group(group)

    def check():
        for i, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise ValueError(f"params[{i}]: expected a tensor, got {type(param).__name__}")
        grads = [param.grad for param in params if param.grad is not None]
        for grad in grads[1:]:
            if grad.dtype != grads[0].dtype or grad.device != grads[0].device:
                raise ValueError("params: every gradient must share one dtype and device")
        return grads

    # a rank whose parameters have no gradients (or others) would skip the all-reduce: agreed first
    grads = agree("allreduce_sequence_parallel_grads", group, check,
                  lambda grads: f"{len(grads)} gradients of {sum(g.numel() for g in grads)} elements, "
                                f"{describe(grads[0]) if grads else 'none'}",
                  hint=next((p_.grad for p_ in params if isinstance(p_, torch.Tensor) and p_.grad is not None), None))
    if not grads or coll.group_size(group) == 1:
        return
    flat = coll.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group, inplace=True).wait()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _blocks(module) -> Tuple[Dict[str, tuple], object, Optional[str]]:
    """The parameters of ``module`` of which each rank holds a block, by state-dict name (a module
    reachable under several names under each): ``(parameter, the dim it is split along, its
    layer)``, from each parallel layer's ``sharded_parameters``; the group of those layers (the
    tensor-parallel group where there are none); and why not, when they use several groups."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected an nn.Module, got {type(module).__name__}")
    blocks, groups = {}, {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dims = getattr(type(m), "sharded_parameters", None)
        if dims:
            groups[id(m.group)] = m.group
            for name, dim in dims.items():
                if getattr(m, name) is not None:
                    blocks[f"{prefix}.{name}" if prefix else name] = (getattr(m, name), dim, m)
    if len(groups) > 1:
        return blocks, coll.resolve_group(None), (f"module: its parallel layers use {len(groups)} different groups; "
                                                  "this takes one tensor-parallel group")
    return blocks, next(iter(groups.values())) if groups else coll.resolve_group(None), None


def full_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` with every parallel layer's blocks joined into the full tensors:
    the dense model's state dict, under the same names (:func:`parallelize` keeps them), on every
    rank. One all-gather per sharded parameter, in the state dict's order, on every rank of the
    group; the other entries are this rank's, detached. Each rank then holds the whole model, one
    more time: for checkpoints that any tensor-parallel size (or the dense model) can load with
    :func:`load_full_state_dict`."""
    blocks, group, groups_error = _blocks(module)
    state = module.state_dict()

    def check():
        if groups_error:
            raise ValueError(groups_error)
        return state

    agree("full_state_dict", group, check, lambda state: f"{len(state)} entries, {len(blocks)} sharded",
          hint=next(iter(state.values()), None))
    full = {}
    for key, value in state.items():
        if key not in blocks:
            full[key] = value
            continue
        _, dim, _ = blocks[key]
        stacked = coll.all_gather_dim0(value.movedim(dim, 0).contiguous(), group).wait()  # [p*d, ...] along dim
        full[key] = stacked.movedim(0, dim).contiguous()
    return full


def sharded_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` for ``torch.distributed.checkpoint``: each parallel layer's
    ``sharded_parameters`` as a ``DTensor`` over its group (``Shard(dim)``: this rank's block of
    the full tensor, sharing the parameter's memory), every other entry as it is (the same on
    every rank of the group), all detached from autograd. With one rank, the plain state dict.

    ``dcp.save(sharded_state_dict(model), checkpoint_id=path)`` writes each block once, with its
    place in the full tensor; ``dcp.load(sharded_state_dict(model), checkpoint_id=path)`` reads
    into the model's own parameters in place, whatever tensor-parallel size saved it. The plain
    ``state_dict()`` must not go to ``dcp``: it names every rank's block as one tensor, which
    ``dcp`` takes for a replicated one and saves from one rank only."""
    blocks, group, groups_error = _blocks(module)
    if groups_error:
        raise ValueError(groups_error)
    state = {key: value.detach() for key, value in module.state_dict(keep_vars=True).items()}
    if coll.group_size(group) == 1 or not blocks:
        return state
    from torch.distributed.device_mesh import DeviceMesh
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor, Shard

    meshes: Dict[str, object] = {}  # device type -> the group's mesh
    for key, (_, dim, layer) in blocks.items():
        local = state[key]
        if local.device.type not in meshes:
            meshes[local.device.type] = DeviceMesh.from_group(group, local.device.type)
        shape = list(local.shape)
        shape[dim] *= layer.tp_size
        stride = torch.empty(shape, device="meta").stride()
        state[key] = DTensor.from_local(local, meshes[local.device.type], [Shard(dim)], run_check=False,
                                        shape=torch.Size(shape), stride=stride)
    return state


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a full (dense) state dict into ``module``: each parallel layer takes its block of each
    of its ``sharded_parameters`` (checked against the full shape first), everything else is
    loaded as it is, by ``module.load_state_dict(..., strict=strict)``, whose result it returns.
    No communication: every rank reads the same full state dict (``torch.load`` of one file, or
    :func:`full_state_dict` of a model of another tensor-parallel size)."""
    blocks, _, groups_error = _blocks(module)
    if groups_error:
        raise ValueError(groups_error)
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    local = dict(state_dict)
    for key, (param, dim, layer) in blocks.items():
        if key not in local:
            continue  # load_state_dict names it, when strict
        full = local[key]
        want = list(param.shape)
        want[dim] *= layer.tp_size
        if not isinstance(full, torch.Tensor) or list(full.shape) != want:
            raise ValueError(f"state_dict[{key!r}]: expected the full shape {want} (this rank holds "
                             f"{list(param.shape)} of it, split along dim {dim}), got "
                             f"{list(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__}")
        size = param.shape[dim]
        local[key] = full.narrow(dim, layer.tp_rank * size, size)
    return module.load_state_dict(local, strict=strict)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel model: the norm of the whole
    model's gradient, the same on every rank of the tensor-parallel group, and every gradient
    scaled by the same factor.

    Plain ``clip_grad_norm_`` on each rank sees only that rank's shards, so the ranks clip by
    different factors and the parameters every rank holds whole (a row-parallel bias, the norms)
    drift apart. Here the shards of the parallel layers' parameters (their
    ``sharded_parameters``) count on every rank and are summed over the group, and a parameter
    every rank holds whole counts once (rank 0's: under sequence parallelism, sum such gradients
    first with :func:`allreduce_sequence_parallel_grads`). One all-reduce of one number, on every
    rank whether or not it has gradients. Each gradient's norm is taken in float32 (float64 for
    float64 gradients) and the total in float64; the scale is ``min(1, max_norm / (total + 1e-6))``,
    as torch's.

    Args:
        module: the model (its parameters with a gradient take part, each once).
        max_norm: the largest norm the gradient keeps, >= 0.
        norm_type: the norm's order p: a positive number, or ``math.inf``.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the total is NaN or
            infinite, instead of scaling by it.
    Returns:
        The total norm before clipping, a float64 scalar (on the gradients' device), the same on
        every rank.
    """
    blocks, group, groups_error = _blocks(module)
    sharded = {id(param) for param, _, _ in blocks.values()}

    def check():
        if groups_error:
            raise ValueError(groups_error)
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
            raise ValueError(f"max_norm: expected a number >= 0, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ValueError(f"norm_type: expected a positive number or math.inf, got {norm_type!r}")
        params = [q for q in module.parameters() if q.grad is not None]
        for q in params[1:]:
            if q.grad.device != params[0].grad.device:
                raise ValueError(f"module: its gradients are on several devices ({params[0].grad.device}, "
                                 f"{q.grad.device})")
        return params

    # (a rank may hold no gradient: it still takes part in the all-reduce, and scales nothing)
    params = agree("clip_grad_norm_", group, check,
                   lambda params: f"max_norm {max_norm}, norm_type {norm_type}, error_if_nonfinite {error_if_nonfinite}",
                   hint=next((q.grad for q in module.parameters() if q.grad is not None), None))
    if params:
        device = params[0].grad.device
    else:  # nothing to clip here, but the group's all-reduce still needs this rank
        cuda = torch.cuda.is_available()
        device = coll.exchange_device(group, torch.device("cuda", torch.cuda.current_device()) if cuda else
                                      torch.device("cpu"))
    rank0 = coll.group_rank(group) == 0
    # what this rank adds to the total: its shards, and (rank 0) what every rank holds whole
    counted = [q.grad for q in params if id(q) in sharded or rank0]
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.promote_types(g.dtype, torch.float32)).double()
             for g in counted]
    inf = math.isinf(norm_type)
    if not norms:
        part = torch.zeros((), device=device, dtype=torch.float64)
    elif inf:
        part = torch.stack(norms).amax()
    else:
        part = torch.stack(norms).pow(norm_type).sum()
    part = part.reshape(1)  # the float64 number every rank adds (or, for inf, maxes) over the group
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = coll.all_reduce(part, group, op=op, inplace=True).wait()[0]
    if not inf:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"tp_kernels: clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}, so they cannot be clipped (error_if_nonfinite=True)")
    if params:
        _scale_grads(params, max_norm, total)
    return total


def _scale_grads(params, max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients of ``params`` by ``min(1, max_norm / (total + 1e-6))``: torch's own
    ``clip_grads_with_norm_`` where it has one (torch >= 2.6), else the same product per gradient."""
    clip = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip is not None:
        clip(params, max_norm, total)
        return
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for q in params:
        q.grad.mul_(scale.to(q.grad.dtype))
