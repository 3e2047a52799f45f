"""Checkpoints of a tensor-parallel model that any tensor-parallel size (or the dense model)
loads: the full state dict, and the sharded ones (the model's, the optimizer's) for
``torch.distributed.checkpoint``."""

from __future__ import annotations

import re
from typing import Dict, Mapping

import torch
import torch.nn as nn

from . import _collectives as coll
from . import _data_parallel as dp
from ._agreement import agree
from .layers import block_index, block_of, full_of, local_sizes, sharded_blocks, with_padding

__all__ = ["dense_state_dict", "full_state_dict", "load_full_state_dict", "load_sharded_optimizer_state_dict",
           "sharded_optimizer_state_dict", "sharded_state_dict"]


def full_state_dict(module: nn.Module, *, cpu_offload: bool = False,
                    rank0_only: bool = False) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` with every parallel layer's blocks joined into the full tensors:
    the dense model's state dict, under the same names (:func:`parallelize` keeps them). One
    collective per sharded parameter, in the state dict's order, on every rank of the group; the
    other entries are this rank's, detached. For checkpoints that any tensor-parallel size (or the
    dense model) can load with :func:`load_full_state_dict`.

    Args:
        module: the model (its layers' groups must be one group).
        cpu_offload: move each full tensor to the CPU as soon as it is joined (the other entries
            too), so that the device holds at most one full tensor more than the model at a time;
            else every tensor stays on its device.
        rank0_only: join the blocks on the group's rank 0 only (a gather rather than an
            all-gather), which returns the whole dict; the other ranks return ``{}``. Else every
            rank returns it, and holds the whole model once more while it lives.
    Both options must be the same on every rank (agreed, with the rest of the call).

    A model that FSDP2 shards further over the data-parallel ranks (``fully_shard``) gives the same
    dict: each of its tensors first gathered over the data-parallel mesh (one more collective per
    tensor, on every rank of the mesh), then joined over the group; ``rank0_only`` keeps it on the
    group's rank 0 of every data-parallel replica.
    """
    blocks, group, groups_error = sharded_blocks(module)
    state = module.state_dict()

    def check():
        if groups_error:
            raise ValueError(groups_error)
        for name, flag in (("cpu_offload", cpu_offload), ("rank0_only", rank0_only)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected a bool, got {flag!r}")
        return dp.data_parallel_mesh(module)

    mesh = agree("full_state_dict", group, check,
                 lambda mesh: f"{len(state)} entries, {len(blocks)} sharded, cpu_offload {cpu_offload}, "
                              f"rank0_only {rank0_only}, data-parallel mesh {None if mesh is None else tuple(mesh.shape)}",
                 hint=next(iter(state.values()), None))
    keep = not rank0_only or coll.group_rank(group) == 0
    full = {}
    for key, value in state.items():
        if mesh is not None:
            value = dp.full(value)  # (FSDP2: the tensor as the rank would hold it without data parallelism)
        if key in blocks:
            _, dim, layer = blocks[key]
            block = value.movedim(dim, 0).contiguous()  # the rank's block along dim, as dim 0
            if rank0_only:
                out = torch.empty((coll.group_size(group) * block.shape[0], *block.shape[1:]), dtype=block.dtype,
                                  device=block.device) if keep else None
                stacked = coll.gather(block, out, 0, group).wait()
                if not keep:
                    continue
            else:
                stacked = coll.all_gather_dim0(block, group).wait()  # [p*d, ...] along dim
            value = full_of(stacked.movedim(0, dim), dim, layer).contiguous()
        if keep:
            full[key] = value.cpu() if cpu_offload else value
    return full


def sharded_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` for ``torch.distributed.checkpoint``: each parallel layer's
    ``sharded_parameters`` as a ``DTensor`` over its group (``Shard(dim)``: this rank's block of
    the full tensor, sharing the parameter's memory), every other entry as it is (the same on
    every rank of the group), all detached from autograd. With one rank, plain tensors.

    A column layer of several outputs (``output_sizes``) holds a block of each output, which no
    one ``Shard`` of the fused tensor describes: its sharded parameters are entries
    ``"<name>[j]"``, one per output ``j``, each a ``DTensor`` of that output (with one rank too, as
    plain tensors, so that checkpoints move between sizes). A layer whose outputs are heads
    (``head_size``), some of which several ranks may hold (replicated key/value heads), saves one
    plain entry per head, ``"<name>[j][h]"``, on each rank holding it: ``dcp`` saves a head once
    and loads it into every rank holding it, whatever the tensor-parallel size.

    ``dcp.save(sharded_state_dict(model), checkpoint_id=path)`` writes each block once, with its
    place in the full tensor; ``dcp.load(sharded_state_dict(model), checkpoint_id=path)`` reads
    into the model's own parameters in place, whatever tensor-parallel size saved it. The plain
    ``state_dict()`` must not go to ``dcp``: it names every rank's block as one tensor, which
    ``dcp`` takes for a replicated one and saves from one rank only.

    A layer whose split dim p does not divide (a padded vocabulary) saves its rows of the full
    tensor, without its padding (a ``DTensor`` sharded unevenly, as ``torch.chunk`` splits); the
    padding rows of its parameters are set to zero here, so that a model made on the meta device
    and loaded through this dict holds no uninitialized memory there.

    A model that FSDP2 shards further over the data-parallel ranks (its parameters ``DTensor`` s
    over the data-parallel mesh) saves each rank's rows of its block as a ``DTensor`` over the group
    and the mesh, so the checkpoint is the same dense model's; a layer of several outputs, of heads
    or a padded one is then refused (``ValueError``): FSDP2's rows cut across its pieces along dim 0
    (packed expert weights, whose pieces lie along another dim, are taken)."""
    state = {key: value.detach() for key, value in module.state_dict(keep_vars=True).items()}
    entries, _, blocks = _entries(module)
    with torch.no_grad():
        for param, dim, layer in blocks.values():
            if layer.pad_rows:  # no checkpoint holds it: zero, not what to_empty() left there
                param.narrow(dim, param.shape[dim] - layer.pad_rows, layer.pad_rows).zero_()
    out: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        out.update(entries(key, value))
    return out


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, object]:
    """``optimizer``'s state for ``torch.distributed.checkpoint``, as :func:`sharded_state_dict`
    gives the model's: torch's ``get_optimizer_state_dict(module, optimizer)`` (the state keyed by
    parameter name, made first where the optimizer has taken no step, so that ``dcp.load`` has
    tensors to read into), with each state tensor of a sharded parameter (Adam's moments, a
    momentum) a ``DTensor`` split as its parameter is (for a layer of several outputs, under
    ``"<name>[j]"`` as there). Save it with ``dcp.save``; to resume, ``dcp.load`` into a fresh one,
    then :func:`load_sharded_optimizer_state_dict`."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer)
    entries, _, _ = _entries(module)
    split: Dict[str, Dict[str, object]] = {}
    for name, per_param in state["state"].items():
        for k, v in per_param.items():
            for entry, value in entries(name, v).items():
                split.setdefault(entry, {})[k] = value
    state["state"] = split
    return state


def load_sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                                      state: Dict[str, object]) -> None:
    """Give ``optimizer`` the state that ``dcp.load`` read into ``state`` (a
    :func:`sharded_optimizer_state_dict`): torch's ``set_optimizer_state_dict``, with this rank's
    blocks of the ``DTensor`` s (a layer's outputs' blocks joined again)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    _, join, blocks = _entries(module)
    mesh = dp.data_parallel_mesh(module)

    def local_of(v):
        # (FSDP2: the state over the group and the mesh, of a sharded parameter or of one of its
        # pieces, as this rank's rows; the others' are the mesh's already)
        return v.to_local() if hasattr(v, "to_local") and (mesh is None or len(v.placements) > mesh.ndim) else v

    joined = join({name: {k: local_of(v) for k, v in per_param.items()} for name, per_param in state["state"].items()})
    if mesh is not None:  # (FSDP2: a sharded parameter's state back to the mesh's, placed as the parameter is)
        for name in blocks.keys() & joined.keys():
            joined[name] = {k: dp.from_local_like(blocks[name][0], v) if isinstance(v, torch.Tensor) and v.dim()
                            and not dp.is_sharded(v) else v for k, v in joined[name].items()}
    set_optimizer_state_dict(module, optimizer, {**state, "state": joined})


def _entries(module: nn.Module):
    """``(entries, join, blocks)`` for the sharded state dicts of ``module`` (``blocks``: its
    sharded parameters, as :func:`tp_kernels.layers.sharded_blocks` gives them).

    ``entries(key, tensor)``: the entries under which ``tensor`` is saved, ``{key: tensor}`` unless
    ``key`` names a parameter of which this rank holds a block and ``tensor`` has that block's shape
    (the parameter, or its optimizer state): then ``{key: DTensor}``, split as the parameter is, or,
    for a layer of several outputs, ``{"key[j]": DTensor of output j}`` (``"key[dimD][j]"`` where
    the outputs lie side by side along a dim D other than 0: packed expert weights), or, for a layer of outputs
    made of heads (``head_size``), ``{"key[j][h]": head h of output j}`` for each head this rank
    holds, a plain tensor (held by several ranks where it is replicated, saved once by ``dcp``). All
    views of ``tensor``; with one rank, plain tensors. ``join(per_name)``: the optimizer's state by
    name again, the entries of each key joined into its block (as the parameter holds it)."""
    blocks, group, groups_error = sharded_blocks(module)
    if groups_error:
        raise ValueError(groups_error)
    mesh = dp.data_parallel_mesh(module)
    if mesh is not None:
        # (padded on any rank of the group, not only this one: every rank refuses alike; pieces side
        # by side along another dim, packed expert weights', FSDP2's rows of dim 0 leave whole)
        irregular = [key for key, (_, dim, layer) in blocks.items()
                     if dim == 0 and (len(layer.split_parts) > 1 or getattr(layer, "head_size", None) is not None
                                      or layer.split_parts[0] % layer.tp_size)]
        if irregular:
            raise ValueError(f"module: FSDP2 shards its parameters further over the data-parallel ranks, and "
                             f"{irregular[0]!r} is of a layer of several outputs, of heads or a padded one, whose "
                             "pieces along dim 0 FSDP2's rows cut across: no DTensor describes them, so the sharded "
                             "state dicts do not take it; checkpoint such a model with full_state_dict and "
                             "load_full_state_dict")
    if coll.group_size(group) == 1:
        sharded = lambda tensor, dim, full: tensor  # noqa: E731
    else:
        sharded = _as_dtensor(group) if mesh is None else _over_group_and_mesh(group, mesh)

    def pieces(key: str, tensor: torch.Tensor, dim: int, layer) -> Dict[str, torch.Tensor]:
        """``tensor`` (a block of ``key``) by entry name: its outputs, or their heads."""
        head = getattr(layer, "head_size", None)
        along = f"[dim{dim}]" if dim else ""  # (what dense_state_dict joins them along, offline)
        out = {}
        for j, piece in enumerate(tensor.split(local_sizes(layer), dim)):
            if head is None:
                out[f"{key}{along}[{j}]"] = piece
                continue
            first = block_index(layer, j) * (piece.shape[dim] // head)  # the first head it holds
            for i, one in enumerate(piece.split(head, dim)):
                out[f"{key}[{j}][{first + i}]"] = one
        return out

    def entries(key: str, tensor) -> Dict[str, object]:
        if key not in blocks or not isinstance(tensor, torch.Tensor) or tensor.shape != blocks[key][0].shape:
            if key in blocks and isinstance(tensor, torch.Tensor) and tensor.dim() and blocks[key][2].tp_size > 1:
                # (a factored state: saved as one tensor, dcp would keep one rank's and give it to all)
                raise ValueError(f"optimizer: a state tensor of {key!r} has shape {list(tensor.shape)}, not its "
                                 f"block's {list(blocks[key][0].shape)} (a factored optimizer, as Adafactor's row "
                                 "and column statistics): where it lies in the full tensor is unknown, so it cannot "
                                 "be saved sharded; use an optimizer whose state has the parameter's shape")
            return {key: tensor}
        _, dim, layer = blocks[key]
        parts = layer.split_parts
        if getattr(layer, "head_size", None) is not None:  # (whatever p replicates: the same entries at every p)
            return pieces(key, tensor, dim, layer)
        if len(parts) == 1:  # its rows of the full tensor, without the padding at the end
            held = tensor.narrow(dim, 0, tensor.shape[dim] - layer.pad_rows) if layer.pad_rows else tensor
            return {key: sharded(held, dim, parts[0])}
        return {name: sharded(piece, dim, size)
                for (name, piece), size in zip(pieces(key, tensor, dim, layer).items(), parts)}

    def join(per_name: Dict[str, Dict[str, object]]) -> Dict[str, Dict[str, object]]:
        joined = dict(per_name)
        for key, (param, dim, layer) in blocks.items():
            if layer.pad_rows and key in joined:  # the padding again (zero: it never has a gradient)
                held = (*param.shape[:dim], param.shape[dim] - layer.pad_rows, *param.shape[dim + 1:])
                joined[key] = {k: with_padding(v, dim, layer.pad_rows) if tuple(getattr(v, "shape", ())) == held else v
                               for k, v in joined[key].items()}
            several = len(layer.split_parts) > 1 or getattr(layer, "head_size", None) is not None
            names = list(pieces(key, param.detach(), dim, layer)) if several else []
            if not names or names[0] not in joined:
                continue
            per_piece = [joined.pop(name) for name in names]
            whole = dict(joined.get(key, {}))
            for k in per_piece[0]:
                whole[k] = torch.cat([piece[k] for piece in per_piece], dim)
            joined[key] = whole
        return joined

    return entries, join, blocks


def _over_group_and_mesh(group, mesh):
    """``sharded(block, dim, full)`` for a model FSDP2 shards further over ``mesh``: ``block`` (a
    ``DTensor`` over ``mesh``, FSDP2's rows of this rank's block) as a ``DTensor`` over the group and
    the mesh, ``Shard(dim)`` over the group then the block's own placements, of a tensor ``full``
    long along ``dim``, sharing the block's memory. The two-dimensional mesh is made on the first
    call (its layout, the mesh of each rank of the group, found in one all-gather over the group)."""
    from torch.distributed.device_mesh import DeviceMesh

    DTensor, _, Shard = dp.dtensor_types()
    made: list = []

    def both():
        if not made:
            mine = torch.tensor(mesh.mesh.flatten().tolist(), dtype=torch.int64)
            views = coll.all_gather_bytes(mine.numpy().tobytes(), *coll.host_route(group))
            grid = torch.stack([torch.frombuffer(bytearray(v), dtype=torch.int64) for v in views])
            groups = [group, *dp.mesh_groups(mesh)]
            # (names of these groups: torch keeps meshes by value, and one of destroyed groups must not come back)
            made.append(DeviceMesh.from_group(groups, mesh.device_type, mesh=grid.view(len(views), *mesh.shape),
                                              mesh_dim_names=tuple(f"tp_kernels.{g.group_name}" for g in groups)))
        return made[0]

    def sharded(block, dim: int, full: int):
        shape = list(block.shape)
        shape[dim] = full
        return DTensor.from_local(dp.local(block), both(), [Shard(dim), *block.placements], run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    return sharded


def _as_dtensor(group):
    """``sharded(block, dim, full)``: ``block`` as a ``DTensor`` over ``group``, ``Shard(dim)`` of a
    tensor ``full`` long along ``dim``, sharing ``block``'s memory (the group's mesh made once per
    device type)."""
    from torch.distributed.device_mesh import DeviceMesh

    DTensor, _, Shard = dp.dtensor_types()

    meshes: Dict[str, object] = {}  # device type -> the group's mesh

    def sharded(block: torch.Tensor, dim: int, full: int):
        if block.device.type not in meshes:
            meshes[block.device.type] = DeviceMesh.from_group(group, block.device.type)
        shape = list(block.shape)
        shape[dim] = full
        return DTensor.from_local(block, meshes[block.device.type], [Shard(dim)], run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    return sharded


#: an entry of a sharded state dict that holds one output (``"qkv.weight[1]"``; along a dim other
#: than 0, ``"experts.gate_up_proj[dim1][1]"``) or one head of it (``"qkv.weight[1][0]"``) of a fused
#: layer, and what follows it in a flattened key (``".exp_avg"``)
_ENTRY = re.compile(r"(.+?)(?:\[dim(\d+)\])?\[(\d+)\](?:\[(\d+)\])?(\..+)?")


def dense_state_dict(state_dict: Mapping[str, object]) -> Dict[str, object]:
    """A state dict read whole from a checkpoint of :func:`sharded_state_dict` (and of
    :func:`sharded_optimizer_state_dict`) as the dense model names it: the entries of each output
    of a fused layer, ``"qkv.weight[1]"``, and of each head, ``"qkv.weight[1][0]"``, joined along
    dim 0 into ``"qkv.weight"`` (those of packed expert weights, ``"experts.gate_up_proj[dim1][1]"``,
    along the dim they name), in nested dicts too (an optimizer's ``state``); everything else as
    it is. For converting a checkpoint offline, with no process group: torch's
    ``dcp_to_torch_save(path, file)``, ``torch.load(file)``, then this. A ``ValueError`` names an
    entry whose outputs or heads are not all there."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
    out: Dict[str, object] = {}
    pieces: Dict[str, list] = {}  # the joined key -> [((output, head), key, value)]
    dims: Dict[str, set] = {}  # the joined key -> the dims its entries name (one)
    for key, value in state_dict.items():
        match = _ENTRY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            out[key] = dense_state_dict(value) if isinstance(value, Mapping) else value
            continue
        base, dim, output, head, rest = match.groups()
        joined = base + (rest or "")
        out.setdefault(joined, None)  # (keeps the entries' place in the order)
        dims.setdefault(joined, set()).add(int(dim or 0))
        pieces.setdefault(joined, []).append(((int(output), -1 if head is None else int(head)), key, value))
    for joined, found in pieces.items():
        found.sort(key=lambda item: item[0])
        outputs: Dict[int, list] = {}
        for (output, head), _, _ in found:
            outputs.setdefault(output, []).append(head)
        heads_whole = all(heads == [-1] or heads == list(range(len(heads))) for heads in outputs.values())
        if sorted(outputs) != list(range(len(outputs))) or not heads_whole or len(dims[joined]) > 1:
            raise ValueError(f"state_dict: the entries of {joined!r} are not every output (and head) of it: "
                             f"{[key for _, key, _ in found]}")
        out[joined] = _join([dense_state_dict(v) if isinstance(v, Mapping) else v for _, _, v in found], joined,
                            *dims[joined])
    return out


def _join(values: list, name: str, dim: int):
    """The pieces of one tensor (or of one optimizer state: dicts of them) joined along ``dim``; a
    value that is not split (a step count) must be the same in every piece."""
    first = values[0]
    if isinstance(first, Mapping):
        return {k: _join([v[k] for v in values], f"{name}.{k}", dim) for k in first}
    if isinstance(first, torch.Tensor) and first.dim():
        return torch.cat(values, dim)
    if any(not (v is first or (torch.equal(v, first) if isinstance(first, torch.Tensor) else v == first))
           for v in values[1:]):
        raise ValueError(f"state_dict: the pieces of {name!r} hold different values: {values}")
    return first


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a full (dense) state dict into ``module``: each parallel layer takes its block of each
    of its ``sharded_parameters`` (checked against the full shape first), everything else is
    loaded as it is, by ``module.load_state_dict(..., strict=strict)``, whose result it returns.
    No communication: every rank reads the same full state dict (``torch.load`` of one file, or
    :func:`full_state_dict` of a model of another tensor-parallel size). A model that FSDP2 shards
    further over the data-parallel ranks takes its rows of each such block, as its parameters hold
    them."""
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
        want[dim] = sum(layer.split_parts)
        if not isinstance(full, torch.Tensor) or list(full.shape) != want:
            raise ValueError(f"state_dict[{key!r}]: expected the full shape {want} (this rank holds "
                             f"{list(param.shape)} of it, split along dim {dim}), got "
                             f"{list(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__}")
        local[key] = block_of(full, dim, layer)
    if dp.data_parallel_mesh(module) is not None:  # (FSDP2: this rank's rows of each)
        for key, target in module.state_dict(keep_vars=True).items():
            value = local.get(key)
            if dp.is_sharded(target) and isinstance(value, torch.Tensor) and value.shape == target.shape:
                local[key] = dp.distribute_like(target, value.to(target.device), f"state_dict[{key!r}]")
    return module.load_state_dict(local, strict=strict)
