"""Parameters that data parallelism shards further: FSDP2 over a tensor-parallel model.

``torch.distributed.fsdp.fully_shard`` over the data-parallel ranks turns each parameter of a
tensor-parallel model into a ``DTensor`` over its data-parallel mesh: ``Shard(0)`` of the tensor
the rank would hold without it (its tensor-parallel block, or a parameter every rank of the group
holds whole), and ``Replicate()`` over the mesh dims that replicate it (HSDP's). During the forward
and backward FSDP2 hands the layers the whole tensor, so they compute as without it; what needs the
whole model outside them (the gradient's norm, the full state dict) sees through the ``DTensor``
here, with no other ``DTensor`` layout taken (a ``ValueError`` names the parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

__all__ = ["Rows", "copy_rows_", "data_parallel_mesh", "distribute_like", "dtensor_types", "first_copy",
           "from_local_like", "full", "is_sharded", "local", "mesh_groups", "rows"]


def dtensor_types():
    """``(DTensor, Replicate, Shard)``, where this torch keeps them."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard


def is_sharded(t) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter, or its gradient, that FSDP2 shards)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local tensor where it is a ``DTensor``, else ``t``."""
    return t.to_local() if is_sharded(t) else t


def _check_placements(t, name: str) -> None:
    _, Replicate, Shard = dtensor_types()
    for placement in t.placements:
        if not (type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)):
            raise ValueError(f"{name}: a DTensor placed {tuple(t.placements)}; tp_kernels takes a parameter that data "
                             "parallelism shards further only as FSDP2 shards it, Shard(0) (or Replicate(), HSDP's) "
                             "over the data-parallel mesh")


def data_parallel_mesh(module: torch.nn.Module):
    """The one mesh over which the parameters of ``module`` are ``DTensor`` s (FSDP2's data-parallel
    mesh), or None where none is; ``ValueError`` for several meshes, or another layout."""
    meshes = {}
    for name, param in module.named_parameters():
        if is_sharded(param):
            _check_placements(param, f"module: parameter {name!r}")
            meshes.setdefault(id(param.device_mesh), (name, param.device_mesh))
    if len(meshes) > 1:
        names = ", ".join(repr(name) for name, _ in meshes.values())
        raise ValueError(f"module: its parameters are DTensors over {len(meshes)} meshes ({names}); tp_kernels "
                         "takes one data-parallel mesh")
    return next(iter(meshes.values()))[1] if meshes else None


def mesh_groups(mesh) -> List[object]:
    """The process group of each dim of ``mesh``."""
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def first_copy(mesh) -> bool:
    """Whether this rank holds the first copy of what is replicated over ``mesh`` (coordinate 0 in
    every dim): a parameter every data-parallel rank holds whole counts there only."""
    return all(c == 0 for c in mesh.get_coordinate())


@dataclass(frozen=True)
class Rows:
    """This rank's part of a tensor that data parallelism shards along dim 0."""

    local: torch.Tensor  # its rows
    start: int  # where they start along dim 0
    counted: bool  # whether a sum over the mesh counts them: False on the copies of a Replicate() dim but the first

    def among(self, start: int, length: int) -> Tuple[int, int]:
        """``(lo, hi)``: the rows of ``[start, start + length)`` this rank holds (none where
        ``hi <= lo``); of its local tensor, rows ``lo - self.start`` on."""
        return max(start, self.start), min(start + length, self.start + self.local.shape[0])


def rows(t: torch.Tensor, name: str) -> Rows:
    """``t`` (a ``DTensor`` as FSDP2 places it) as this rank's rows of it."""
    _, Replicate, _ = dtensor_types()
    _check_placements(t, name)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coordinate = t.device_mesh.get_coordinate()
    counted = all(c == 0 for c, placement in zip(coordinate, t.placements) if type(placement) is Replicate)
    return Rows(t.to_local(), offset[0] if t.dim() else 0, counted)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: gathered over its mesh where it is a ``DTensor`` (a collective every rank
    of the mesh makes), else ``t``."""
    return t.full_tensor() if is_sharded(t) else t


def distribute_like(param: torch.Tensor, whole: torch.Tensor, name: str):
    """``whole`` (a tensor of ``param``'s shape) as ``param`` is sharded: a ``DTensor`` of this rank's
    rows of it, on ``param``'s mesh and placements, with no communication."""
    held = rows(param, name)
    part = whole.narrow(0, held.start, held.local.shape[0]) if whole.dim() else whole
    return from_local_like(param, part.contiguous())


def from_local_like(param: torch.Tensor, part: torch.Tensor):
    """``part`` (this rank's rows, as ``param`` holds its own) as a ``DTensor`` placed as ``param``."""
    DTensor, _, _ = dtensor_types()
    return DTensor.from_local(part, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


@torch.no_grad()
def copy_rows_(target: torch.Tensor, value: torch.Tensor, start: int = 0) -> None:
    """``target[start : start + len(value)].copy_(value)`` along dim 0, where ``target`` may be a
    ``DTensor`` as FSDP2 places it: then only the rows this rank holds, into its local tensor."""
    if not is_sharded(target):
        (target.narrow(0, start, value.shape[0]) if target.dim() else target).copy_(value)
        return
    held = rows(target, "target")
    lo, hi = held.among(start, value.shape[0])
    if hi > lo:
        held.local.narrow(0, lo - held.start, hi - lo).copy_(value.narrow(0, lo - start, hi - lo))
