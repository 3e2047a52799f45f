"""Shard an existing dense model in place, by a plan of name patterns."""

from __future__ import annotations

import fnmatch
from typing import Dict, Iterable, Mapping

import torch
import torch.nn as nn

from . import _collectives as coll
from ._agreement import agree, describe
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["STYLES", "allreduce_sequence_parallel_grads", "parallelize"]

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

    Everything is checked before anything is replaced: an unknown style, a pattern that matches
    nothing, a style applied to the wrong module type, a split size the group's size does not
    divide, or one module given two styles raise ``ValueError`` naming the pattern and the
    module's path. Returns ``module``.
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
    return module


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
