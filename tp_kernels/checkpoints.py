"""Checkpoints of a tensor-parallel model that any tensor-parallel size (or the dense model)
loads: the full state dict, and the sharded ones (the model's, the optimizer's) for
``torch.distributed.checkpoint``."""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Tuple

import torch
import torch.nn as nn

from . import _collectives as coll
from . import _data_parallel as dp
from ._agreement import agree
from .layers import block_index, block_of, full_of, local_sizes, sharded_blocks, split_block, with_padding

__all__ = ["dense_state_dict", "full_state_dict", "load_full_state_dict", "load_sharded_optimizer_state_dict",
           "sharded_optimizer_state_dict", "sharded_state_dict"]


def full_state_dict(module: nn.Module, *, cpu_offload: bool = False,
                    rank0_only: bool = False) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` with every parallel layer's blocks joined into the full tensors,
    each contiguous (as ``safetensors`` saves them): the dense model's state dict, under the same
    names (:func:`parallelize` keeps them). One
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
    and the mesh, so the checkpoint is the same dense model's. Where FSDP2's rows cut across the
    pieces of a block along dim 0 (a layer of several outputs, of heads, or a padded one), each
    entry above holds the rows of it this rank holds as one chunk at its place (torch's
    ``LocalShardsWrapper`` in a ``DTensor`` of the entry's shape, which ``dcp`` saves and loads in
    place): the same entries, so the same checkpoint. Packed expert weights, whose pieces lie along
    another dim, FSDP2's rows leave whole."""
    state = {key: value.detach() for key, value in module.state_dict(keep_vars=True).items()}
    entries, _, blocks = _entries(module)
    with torch.no_grad():
        for key, (param, dim, layer) in blocks.items():
            if not layer.pad_rows:  # (else no checkpoint holds it: zero, not what to_empty() left there)
                continue
            start = param.shape[dim] - layer.pad_rows
            if dim == 0:  # (FSDP2: the rows of it this rank holds)
                dp.copy_rows_(param, torch.zeros((layer.pad_rows, *param.shape[1:]), dtype=param.dtype,
                                                 device=param.device), start)
            else:
                param.narrow(dim, start, layer.pad_rows).zero_()
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
    holds, a plain tensor (held by several ranks where it is replicated, saved once by ``dcp``)
    (:func:`_layout`). Under FSDP2, where its rows cut across those entries along dim 0, each entry
    is the chunk of it this rank holds (:func:`_chunks`). All views of ``tensor``; with one rank,
    plain tensors. ``join(per_name)``: the optimizer's state by name again, the entries of each key
    joined into its block (as the parameter holds it; under FSDP2 its rows of it)."""
    blocks, group, groups_error = sharded_blocks(module)
    if groups_error:
        raise ValueError(groups_error)
    mesh = dp.data_parallel_mesh(module)
    # (FSDP2: the layers whose pieces along dim 0 FSDP2's rows cut across, saved as chunks; pieces
    # side by side along another dim, packed expert weights', FSDP2's rows of dim 0 leave whole)
    chunked = set() if mesh is None else {key for key, (param, dim, layer) in blocks.items()
                                          if dim == 0 and not _one_block(layer) and dp.is_sharded(param)}
    if coll.group_size(group) == 1:
        sharded = lambda tensor, dim, full: tensor  # noqa: E731
    else:
        sharded = _as_dtensor(group) if mesh is None else _over_group_and_mesh(group, mesh)

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
        if key in chunked:
            return _chunks(key, tensor, layer)
        layout = _layout(key, dim, layer)
        # (the whole block as it is: FSDP2's, a DTensor, whose rows a narrow along dim 0 would gather)
        rows = [tensor if length == tensor.shape[dim] else tensor.narrow(dim, start, length)
                for _, start, length, _, _ in layout]
        if getattr(layer, "head_size", None) is not None:  # (whatever p replicates: the same entries at every p)
            return {name: piece for (name, *_), piece in zip(layout, rows)}
        return {name: sharded(piece, dim, full) for (name, _, _, _, full), piece in zip(layout, rows)}

    def join(per_name: Dict[str, Dict[str, object]]) -> Dict[str, Dict[str, object]]:
        joined = dict(per_name)
        for key, (param, dim, layer) in blocks.items():
            if key in chunked:
                _join_chunks(joined, key, param, layer)
                continue
            if layer.pad_rows and key in joined:  # the padding again (zero: it never has a gradient)
                held = (*param.shape[:dim], param.shape[dim] - layer.pad_rows, *param.shape[dim + 1:])
                joined[key] = {k: with_padding(v, dim, layer.pad_rows) if tuple(getattr(v, "shape", ())) == held else v
                               for k, v in joined[key].items()}
            several = len(layer.split_parts) > 1 or getattr(layer, "head_size", None) is not None
            names = [name for name, *_ in _layout(key, dim, layer)] if several else []
            if not names or names[0] not in joined:
                continue
            per_piece = [joined.pop(name) for name in names]
            whole = dict(joined.get(key, {}))
            for k in per_piece[0]:
                whole[k] = torch.cat([piece[k] for piece in per_piece], dim)
            joined[key] = whole
        return joined

    return entries, join, blocks


def _one_block(layer) -> bool:
    """Whether each rank's block of ``layer``'s split dim is one block of the full tensor, the
    ranks' all alike (one ``Shard`` describes it): one part that p divides, not made of heads."""
    return getattr(layer, "head_size", None) is None and len(layer.split_parts) == 1 and \
        layer.split_parts[0] % layer.tp_size == 0


def _layout(key: str, dim: int, layer) -> List[Tuple[str, int, int, int, int]]:
    """The entries of ``key``, a block of ``layer`` along ``dim``: ``(name, start, length, offset,
    full)`` each, rows ``[start, start + length)`` of the block along ``dim`` being rows ``[offset,
    offset + length)`` of the entry's tensor, ``full`` long. The block's rows of the full tensor
    (``key``, without the padding at its end), or, for a layer of several outputs, each output's
    block (``"key[j]"``; ``"key[dimD][j]"`` where they lie along a dim D other than 0), or, for a
    layer whose outputs are heads, each head (``"key[j][h]"``, h counted in output j)."""
    p, r = layer.tp_size, layer.tp_rank
    head = getattr(layer, "head_size", None)
    if head is None and len(layer.split_parts) == 1:
        full = layer.split_parts[0]
        rows, padding = split_block(full, p, r)
        return [(key, 0, rows - padding, min(r * rows, full), full)]
    along = f"[dim{dim}]" if dim else ""
    out, start = [], 0
    for j, (size, part) in enumerate(zip(local_sizes(layer), layer.split_parts)):
        if head is None:
            out.append((f"{key}{along}[{j}]", start, size, block_index(layer, j) * size, part))
        else:
            first = block_index(layer, j) * (size // head)  # the first head it holds
            out.extend((f"{key}[{j}][{first + i}]", start + i * head, head, 0, head) for i in range(size // head))
        start += size
    return out


def _local_shards_wrapper():
    try:
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    except ImportError:
        try:
            from torch.distributed._tensor._shards_wrapper import LocalShardsWrapper
        except ImportError:
            raise ValueError(f"module: FSDP2 shards its parameters further, and a layer of several outputs, of heads "
                             f"or a padded one is saved in chunks, by LocalShardsWrapper, which torch "
                             f"{torch.__version__} lacks; checkpoint such a model with full_state_dict") from None
    return LocalShardsWrapper


def _chunks(key: str, tensor, layer) -> Dict[str, object]:
    """FSDP2: the entries of ``key`` (:func:`_layout`) from ``tensor``, FSDP2's rows of this rank's
    block along dim 0 (a ``DTensor`` over the data-parallel mesh; the parameter or its optimizer
    state), where its rows cut across the entries: each a ``DTensor`` of the entry's full shape whose
    local tensor is the one chunk of it this rank holds, at its place (torch's
    ``LocalShardsWrapper``, ``dcp``'s chunks that no placement describes), a view of ``tensor``'s
    rows; of an entry it holds no row of, an empty chunk at the entry's end, which no chunk holding
    rows shares (``dcp`` keeps one of the chunks several ranks name alike: a replicated head's)."""
    DTensor, _, _ = dp.dtensor_types()
    wrapper = _local_shards_wrapper()
    held = dp.rows(tensor, f"{key} (as FSDP2 places it)")
    out = {}
    for name, start, length, offset, full in _layout(key, 0, layer):
        lo, hi = held.among(start, length)
        rows, at = ((held.local.narrow(0, lo - held.start, hi - lo), offset + lo - start) if hi > lo
                    else (held.local.narrow(0, 0, 0), full))
        shape = torch.Size((full, *rows.shape[1:]))
        out[name] = DTensor.from_local(wrapper([rows], [(at,) + (0,) * (rows.dim() - 1)]), tensor.device_mesh,
                                       tensor.placements, run_check=False, shape=shape,
                                       stride=torch.empty(shape, device="meta").stride())
    return out


def _join_chunks(joined: Dict[str, Dict[str, object]], key: str, param, layer) -> None:
    """The optimizer's state of ``key`` in ``joined`` from its entries' chunks (:func:`_chunks`),
    in place: each state tensor as FSDP2's rows of the block, a plain tensor (its padding zero)."""
    layout = _layout(key, 0, layer)
    per_piece = [joined.get(name, {}) for name, *_ in layout]
    states = {k for piece in per_piece for k, v in piece.items() if dp.is_sharded(v)
              and hasattr(dp.local(v), "local_shards")}
    if not states:
        return
    held = dp.rows(param, key)
    whole = dict(joined.get(key, {}))
    for name, *_ in layout:
        if name != key:
            joined.pop(name, None)
    for k in states:
        rows = None
        for (_, start, length, _, _), piece in zip(layout, per_piece):
            chunk = dp.local(piece[k]).local_shards()[0]
            rows = chunk.new_zeros(held.local.shape) if rows is None else rows
            lo, hi = held.among(start, length)
            if hi > lo:
                rows.narrow(0, lo - held.start, hi - lo).copy_(chunk)
        whole[k] = rows
    joined[key] = whole


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
