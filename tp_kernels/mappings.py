"""Megatron's communication mappings as autograd functions.

Each is the identity when the group has one rank. "Tensor-parallel region" functions act on
the last dim; "sequence-parallel region" functions act on dim 0 (Megatron's ``[s, b, h]``).

==============================================  =====================  =====================
function                                        forward                backward
==============================================  =====================  =====================
``copy_to_tensor_model_parallel_region``        identity               all-reduce
``reduce_from_tensor_model_parallel_region``    all-reduce             identity
``scatter_to_tensor_model_parallel_region``     split last dim         all-gather last dim
``gather_from_tensor_model_parallel_region``    all-gather last dim    split last dim
``scatter_to_sequence_parallel_region``         split dim 0            all-gather dim 0
``gather_from_sequence_parallel_region``        all-gather dim 0       reduce-scatter dim 0
                                                                       (split if
                                                                       ``tensor_parallel_output_grad=False``)
``reduce_scatter_to_sequence_parallel_region``  reduce-scatter dim 0   all-gather dim 0
==============================================  =====================  =====================
"""

from __future__ import annotations

import torch

from . import _collectives as coll
from ._checks import check_divisible, check_tensor

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]


def _all_reduce(x, group):
    return coll.all_reduce(x, group).wait()


def _gather_dim0(x, group):
    return coll.all_gather_dim0(x, group).wait()


def _reduce_scatter_dim0(x, group):
    return coll.reduce_scatter_dim0(x, group).wait()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return coll.split(x, -1, group)

    @staticmethod
    def backward(ctx, dy):
        return coll.all_gather_last_dim(dy, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return coll.all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, dy):
        return coll.split(dy, -1, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return coll.split(x, 0, group)

    @staticmethod
    def backward(ctx, dy):
        return _gather_dim0(dy, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return _gather_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        if ctx.reduce:
            return _reduce_scatter_dim0(dy, ctx.group), None, None
        return coll.split(dy, 0, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _gather_dim0(dy, ctx.group), None


def _setup(x, group, *, last_dim=False, dim0=False):
    check_tensor("input_", x, min_dim=1)
    group = coll.resolve_group(group)
    p = coll.group_size(group)
    if last_dim:
        check_divisible("input_.shape[-1]", x.shape[-1], p)
    if dim0:
        check_divisible("input_.shape[0]", x.shape[0], p)
    return group, p


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward. ``[...] -> [...]``."""
    group, p = _setup(input_, group)
    return input_ if p == 1 else _CopyToRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, on a copy; identity backward. ``[...] -> [...]``."""
    group, p = _setup(input_, group)
    return input_ if p == 1 else _ReduceFromRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the last dim forward, all-gather backward. ``[..., d] -> [..., d/p]``."""
    group, p = _setup(input_, group, last_dim=True)
    return input_ if p == 1 else _ScatterToRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather of the last dim forward, split backward. ``[..., d/p] -> [..., d]``."""
    group, p = _setup(input_, group)
    return input_ if p == 1 else _GatherFromRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of dim 0 forward, all-gather backward. ``[s, ...] -> [s/p, ...]``."""
    group, p = _setup(input_, group, dim0=True)
    return input_ if p == 1 else _ScatterToSequenceRegion.apply(input_, group)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True, group=None
) -> torch.Tensor:
    """All-gather of dim 0 forward. ``[s/p, ...] -> [s, ...]``.

    Backward reduce-scatters the gradient (the consumer is tensor-parallel, so each rank holds a
    partial gradient), or just splits it when ``tensor_parallel_output_grad=False``.
    """
    group, p = _setup(input_, group)
    return input_ if p == 1 else _GatherFromSequenceRegion.apply(input_, group, bool(tensor_parallel_output_grad))


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter of dim 0 forward, all-gather backward. ``[s, ...] -> [s/p, ...]``."""
    group, p = _setup(input_, group, dim0=True)
    return input_ if p == 1 else _ReduceScatterToSequenceRegion.apply(input_, group)
