"""Checkpoints of a tensor-parallel model that any tensor-parallel size (or the dense model)
loads: the full state dict, and the sharded one for ``torch.distributed.checkpoint``."""

from __future__ import annotations

from typing import Dict, Mapping

import torch
import torch.nn as nn

from . import _collectives as coll
from ._agreement import agree
from .layers import sharded_blocks

__all__ = ["full_state_dict", "load_full_state_dict", "sharded_state_dict"]


def full_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` with every parallel layer's blocks joined into the full tensors:
    the dense model's state dict, under the same names (:func:`parallelize` keeps them), on every
    rank. One all-gather per sharded parameter, in the state dict's order, on every rank of the
    group; the other entries are this rank's, detached. Each rank then holds the whole model, one
    more time: for checkpoints that any tensor-parallel size (or the dense model) can load with
    :func:`load_full_state_dict`."""
    blocks, group, groups_error = sharded_blocks(module)
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
    blocks, group, groups_error = sharded_blocks(module)
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
    blocks, _, groups_error = sharded_blocks(module)
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
