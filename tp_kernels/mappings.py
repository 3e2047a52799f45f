"""Megatron's communication mappings as autograd functions.

Each is the identity when the group has one rank. "Tensor-parallel region" functions act on
the last dim; "sequence-parallel region" functions act on dim 0 (Megatron's ``[s, b, h]``), or on
the dim ``sequence_dim`` names (``[b, s, h]``: 1).
Each checks its input and agrees on the call with the group's other ranks before any collective
(:mod:`tp_kernels._agreement`).

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
``gather_for_column_layers``                    all-gather dim 0       reduce-scatter of the
                                                (deferred: gathered    column layers' partial
                                                when read, or by the   input gradients, plus
                                                column layers)         this rank's block of
                                                                       the rest
==============================================  =====================  =====================
"""

from __future__ import annotations

import torch

from . import _collectives as coll
from . import _library
from ._agreement import agree, describe
from ._checks import (apply_function, check_divisible, check_split_dim, check_tensor, differentiable_once,
                      functorch_transforms, wants_grad, with_eager_form)

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "gather_for_column_layers",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
]


#: the attribute that marks a tensor a sequence-parallel collective made: this rank's block of the
#: sequence, split or reduce-scattered (by the mappings here, which the embedding, the experts and
#: torch's styles' moves use, and by a row layer), for a dropout module given it to draw from this
#: rank's own stream (tp_kernels.parallelize)
SEQUENCE_BLOCK = "_tp_kernels_sequence_block"


def sequence_block(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked :data:`SEQUENCE_BLOCK` (but under ``torch.compile`` and ``torch.func``
    transforms, which trace it: there nothing draws from a rank's stream)."""
    if not torch.compiler.is_compiling() and not functorch_transforms():
        setattr(t, SEQUENCE_BLOCK, True)
    return t


# The collectives run as the custom ops of the plain collectives (torch.ops.tp_kernels.*, on
# torch.distributed), so that torch.compile and torch.export see each as one node (the
# cross-entropy's too).


def all_reduce_op(x, group):
    return _library.op("all_reduce")(x.contiguous(), coll.group_name(group), "reference")


def all_gather_op(x, group, dim: int = 0):
    """``[..., m, ...] -(AG)-> [..., p*m, ...]`` along ``dim`` (negative counts from the end),
    rank-major: the blocks gathered along dim 0 and joined along ``dim``
    (:func:`tp_kernels._collectives.join_blocks`: one copy, none for dim 0)."""
    stacked = _library.op("all_gather")(x.contiguous(), coll.group_name(group), "reference")
    return coll.join_blocks(stacked, dim, coll.group_size(group))


def reduce_scatter_op(x, group, dim: int = 0):
    """``[..., p*m, ...] -(RS)-> [..., m, ...]`` along ``dim``: this rank's block of the sum, the
    blocks stacked along dim 0 first (:func:`tp_kernels._collectives.blocks_first`: one copy, none
    for dim 0)."""
    stacked = coll.blocks_first(x, dim, coll.group_size(group))
    return _library.op("reduce_scatter")(stacked.contiguous(), coll.group_name(group), "reference")


class _Mapping(torch.autograd.Function):
    """A mapping's autograd function, in the form ``torch.func``'s transforms take: ``forward(x,
    group, *args)`` without ``ctx``, the arguments after ``x`` kept as ``ctx.args``, and a vmap rule
    generated (batched, its collectives run each entry of the batch in turn); each subclass with its
    eager form (:func:`tp_kernels._checks.with_eager_form`), which :func:`_on` runs outside the
    transforms."""

    generate_vmap_rule = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        with_eager_form(cls)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]


class _CopyToRegion(_Mapping):
    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    @differentiable_once("copy_to_tensor_model_parallel_region")
    def backward(ctx, dy):
        return all_reduce_op(dy, *ctx.args), None


class _ReduceFromRegion(_Mapping):
    @staticmethod
    def forward(x, group):
        return all_reduce_op(x, group)

    @staticmethod
    @differentiable_once("reduce_from_tensor_model_parallel_region")
    def backward(ctx, dy):
        return dy, None


class _ScatterToRegion(_Mapping):
    @staticmethod
    def forward(x, group):
        return coll.split(x, -1, group)

    @staticmethod
    @differentiable_once("scatter_to_tensor_model_parallel_region")
    def backward(ctx, dy):
        return all_gather_op(dy, *ctx.args, -1), None


class _GatherFromRegion(_Mapping):
    @staticmethod
    def forward(x, group):
        return all_gather_op(x, group, -1)

    @staticmethod
    @differentiable_once("gather_from_tensor_model_parallel_region")
    def backward(ctx, dy):
        return coll.split(dy, -1, *ctx.args), None


class _ScatterToSequenceRegion(_Mapping):
    @staticmethod
    def forward(x, group, dim):
        return coll.split(x, dim, group)

    @staticmethod
    @differentiable_once("scatter_to_sequence_parallel_region")
    def backward(ctx, dy):
        group, dim = ctx.args
        return all_gather_op(dy, group, dim), None, None


class _GatherFromSequenceRegion(_Mapping):
    @staticmethod
    def forward(x, group, tensor_parallel_output_grad, dim):
        return all_gather_op(x, group, dim)

    @staticmethod
    @differentiable_once("gather_from_sequence_parallel_region")
    def backward(ctx, dy):
        group, reduce, dim = ctx.args
        if reduce:
            return reduce_scatter_op(dy, group, dim), None, None, None
        return coll.split(dy, dim, group), None, None, None


class _ReduceScatterToSequenceRegion(_Mapping):
    @staticmethod
    def forward(x, group, dim):
        return reduce_scatter_op(x, group, dim)

    @staticmethod
    @differentiable_once("reduce_scatter_to_sequence_parallel_region")
    def backward(ctx, dy):
        group, dim = ctx.args
        return all_gather_op(dy, group, dim), None, None


class PartialGrads:
    """The input gradients that column layers fed by :func:`gather_for_column_layers` leave here,
    each rank's share of the sum (not all-reduced, as a column layer's own backward would), for
    the gather's backward to reduce-scatter at once: one reduce-scatter for the query, key and value
    projections, where each would all-reduce its own."""

    __slots__ = ("group", "grad")

    def __init__(self, group):
        self.group, self.grad = group, None

    def add(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad


#: the attribute of a gathered tensor that holds its :class:`PartialGrads`
PARTIAL_GRADS = "_tp_kernels_partial_grads"


class DeferredGather(torch.Tensor):
    """What :func:`gather_for_column_layers` returns in eager calls: a tensor of the gathered shape
    that holds this rank's ``block`` and gathers it only when something reads it. The column layers
    of ``group`` that share it (:class:`tp_kernels.layers.SharedInputGather`), handed it unread,
    take the block instead (:func:`deferred_block`): one ``all_gather_matmul`` of their weights, the
    gather overlapped with the GEMM. Anything else (an op of torch's on it, a view, a copy, its data
    pointer; a column layer alone) gathers it first, once, and computes on the gathered tensor
    (torch's ``__torch_dispatch__``, below autograd: the gradient it gets goes to the gather's
    backward as the gathered tensor's did). Its shape, dtype, device and strides (contiguous) are
    known without gathering, so a module that reads only them (transformers' attention takes the
    sequence length from its input) leaves the gather to its column layers."""

    @staticmethod
    def __new__(cls, block: torch.Tensor, group, dim: int):
        shape = list(block.shape)
        shape[dim] *= coll.group_size(group)
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=block.dtype, device=block.device,
                                                  requires_grad=False)
        # (the dim gathered as gather_dim: a tensor's dim is its method dim(), which code reading the
        # tensor's shape calls)
        out.block, out.group, out.gather_dim, out.whole = block, group, dim, None
        return out

    def gathered(self, by: str = "a read") -> torch.Tensor:
        """The gathered tensor (gathered on the first call, ``by`` what read it; nothing recorded by
        autograd). Every rank of the group must read it at the same point (a read on some ranks
        only, a print of its values inside ``if rank == 0``, waits for the others until the
        timeout, and then says so)."""
        if self.whole is None:
            try:
                with torch.no_grad():
                    self.whole = all_gather_op(self.block.detach(), self.group, self.gather_dim)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"tp_kernels: gathering a DeferredGather (the sequence a PrepareModuleInput gathers for a "
                    f"module's column layers, gathered when read: read here by {by}) failed: {exc}. Every rank of "
                    "the group must read it at the same point of the forward: a read on some ranks only (a print "
                    "of its values on one rank) waits for the others") from exc
        return self.whole

    def data_ptr(self) -> int:
        """The gathered tensor's (gathered, as a read): unread, the wrapper has no memory of its
        own, and torch's answer, 0, would make code comparing pointers take two for one."""
        return self.gathered("data_ptr()").data_ptr()

    def __repr__(self, *, tensor_contents=None) -> str:  # (not gathered: a collective one rank's print would wait on)
        return f"DeferredGather(block={self.block!r}, dim={self.gather_dim}, gathered={self.whole is not None})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        deferred = {}  # id(the gathered tensor) -> the DeferredGather it came from

        def whole(t):
            if isinstance(t, DeferredGather):
                deferred[id(t.gathered(str(func)))] = t
                return t.whole
            return t

        out = func(*torch.utils._pytree.tree_map(whole, args), **torch.utils._pytree.tree_map(whole, kwargs or {}))
        # (an op writing in place returns what it wrote: the DeferredGather, as torch's in-place ops return self)
        return torch.utils._pytree.tree_map(
            lambda t: deferred.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)


def deferred_block(x, group):
    """``x``'s :class:`DeferredGather` where it is one of ``group`` not yet gathered, else None."""
    if type(x) is DeferredGather and x.group is group and x.whole is None:
        return x
    return None


class _GatherForColumnLayers(torch.autograd.Function):
    """All-gather along ``dim`` (in eager calls, deferred: :class:`DeferredGather`); backward: the
    reduce-scatter of the partial gradients the column layers it fed left
    (:class:`PartialGrads`), plus this rank's block of the gradient that reached it by autograd
    (complete on every rank: what no column layer took)."""

    @staticmethod
    def forward(ctx, x, group, dim, partial):
        ctx.set_materialize_grads(False)
        ctx.group, ctx.dim, ctx.partial = group, dim, partial
        return DeferredGather(x, group, dim)

    @staticmethod
    @differentiable_once("gather_for_column_layers")
    def backward(ctx, dy):
        partial, ctx.partial.grad = ctx.partial.grad, None
        dx = None
        if partial is not None:
            dx = reduce_scatter_op(partial, ctx.group, ctx.dim)
        if dy is not None:
            mine = coll.split(dy, ctx.dim, ctx.group)
            dx = mine if dx is None else dx + mine
        return dx, None, None, None


class _IntoPartialGrads(torch.autograd.Function):
    """Identity forward; backward: the gradient left in a :class:`PartialGrads` (in the gathered
    tensor's ``shape``), none passed on."""

    @staticmethod
    def forward(ctx, x, partial, shape):
        ctx.partial, ctx.shape = partial, shape
        return x.view_as(x)

    @staticmethod
    @differentiable_once("a column layer fed by gather_for_column_layers")
    def backward(ctx, dx):
        ctx.partial.add(dx.reshape(ctx.shape))
        return None, None, None


def gather_for_column_layers(x, group=None, *, sequence_dim: int = 0):
    """``x``, this rank's block of ``sequence_dim``, gathered whole (checked and agreed as the
    public mappings are), for column layers without sequence parallelism to take: those it reaches
    as it is leave their partial input gradients for one reduce-scatter here
    (:class:`PartialGrads`, :func:`partial_grads_of`), anything else its gradient by autograd, of
    which the backward keeps this rank's block. In eager calls the gather is deferred
    (:class:`DeferredGather`: made when the tensor is read, or by the column layers that share it,
    overlapped with their GEMMs). (Traced by torch.compile, or under a ``torch.func`` transform: a
    plain gather, each column layer then all-reducing its own.)"""
    group, d = _agreed("gather_for_column_layers", x, group, sequence_dim=sequence_dim)
    if coll.group_size(group) == 1:
        return x
    if torch.compiler.is_compiling() or functorch_transforms():
        return _on(_GatherFromSequenceRegion, x, group, False, d)
    partial = PartialGrads(group)
    out = _GatherForColumnLayers.apply(x, group, d, partial)
    setattr(out, PARTIAL_GRADS, partial)
    return out


def partial_grads_of(x, group):
    """``x`` as a column layer (or experts) of ``group`` takes it: where it is a
    :func:`gather_for_column_layers` output of that group, or that output reshaped (a mixture of
    experts' ``hidden_states.view(-1, h)``: a view of all of it, in its order), a view that leaves
    its gradient there (and True), else ``x`` (and False)."""
    gathered = x
    if not wants_grad((x,)):  # (no input gradient to leave)
        return x, False
    if torch.compiler.is_compiling() or functorch_transforms():  # (the gather is a plain one there)
        return x, False
    if not hasattr(x, PARTIAL_GRADS) and x._base is not None and x._base.numel() == x.numel() and \
            x.is_contiguous() and x._base.is_contiguous() and x.storage_offset() == x._base.storage_offset():
        gathered = x._base
    partial = getattr(gathered, PARTIAL_GRADS, None)
    if partial is None or partial.group is not group:
        return x, False
    return _IntoPartialGrads.apply(x, partial, gathered.shape), True


# --- what the layers call (their arguments already checked and agreed with the group) ---------------


def _on(function, x, group, *args):
    """``function`` (a mapping's autograd function) of ``x``; ``x`` itself on one rank."""
    if coll.group_size(group) == 1:
        return x
    return apply_function(function, x, group, *args)


def _block_of(function, x, group, *args):
    """:func:`_on` of a mapping that splits the sequence: its output (on several ranks) marked
    this rank's block (:func:`sequence_block`)."""
    out = _on(function, x, group, *args)
    return out if out is x else sequence_block(out)


def copy_to(x, group):
    return _on(_CopyToRegion, x, group)


def reduce_from(x, group):
    return _on(_ReduceFromRegion, x, group)


def reduce_from_into(x, group):
    """:func:`reduce_from` of ``x``, a tensor the caller made for it and reads no more: in eager
    calls that record no gradient, its sum written into it (the collective in place: no copy, no
    new tensor), else a new tensor as :func:`reduce_from` makes."""
    if (coll.group_size(group) == 1 or wants_grad((x,)) or torch.compiler.is_compiling()
            or functorch_transforms() or not x.is_contiguous()):
        return reduce_from(x, group)
    _library.op("all_reduce_inplace")(x, coll.group_name(group), "reference")
    return x


def scatter_last_dim(x, group):
    return _on(_ScatterToRegion, x, group)


def gather_last_dim(x, group):
    return _on(_GatherFromRegion, x, group)


def reduce_scatter_dim0(x, group, dim: int = 0):
    """This rank's block of dim 0 (or ``dim``) of the sum over the group, its gradient gathered."""
    return _block_of(_ReduceScatterToSequenceRegion, x, group, dim)


def gather_dim0(x, group, dim: int = 0):
    """Every rank's block of dim 0 (or ``dim``), its gradient reduce-scattered back (a
    tensor-parallel consumer)."""
    return _on(_GatherFromSequenceRegion, x, group, True, dim)


# --- the public mappings: checked, and agreed with the group, before any collective -----------------


def _agreed(name: str, x, group, *, last_dim=False, sequence_dim=None, divisible=False, flags: str = ""):
    """The group a public mapping of ``x`` runs on, and the dim it acts on (``sequence_dim``
    checked: a dim of ``x`` other than its last, whose size p divides if ``divisible``), once ``x``
    is checked and the call agreed with the group's other ranks
    (:func:`tp_kernels._agreement.agree`)."""
    group = coll.resolve_group(group)

    def check():
        check_tensor("input", x, min_dim=1)
        p = coll.group_size(group)
        if last_dim:
            check_divisible("input.shape[-1]", x.shape[-1], p)
        if sequence_dim is None:
            return None
        d = check_split_dim("sequence_dim", sequence_dim, x)
        if divisible:
            check_divisible(f"input.shape[{d}]", x.shape[d], p)
        return d

    d = agree(name, group, check, lambda d: f"input {describe(x)}{'' if not d else f', sequence_dim {d}'}{flags}",
              hint=x)
    return group, d


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward. ``[...] -> [...]``."""
    return copy_to(input_, _agreed("copy_to_tensor_model_parallel_region", input_, group)[0])


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, on a copy; identity backward. ``[...] -> [...]``."""
    return reduce_from(input_, _agreed("reduce_from_tensor_model_parallel_region", input_, group)[0])


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the last dim forward, all-gather backward. ``[..., d] -> [..., d/p]``."""
    return scatter_last_dim(input_, _agreed("scatter_to_tensor_model_parallel_region", input_, group,
                                            last_dim=True)[0])


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather of the last dim forward, split backward. ``[..., d/p] -> [..., d]``."""
    return gather_last_dim(input_, _agreed("gather_from_tensor_model_parallel_region", input_, group)[0])


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None, *, sequence_dim: int = 0) -> torch.Tensor:
    """This rank's block of dim 0 forward, all-gather backward. ``[s, ...] -> [s/p, ...]``.

    ``sequence_dim``: the dim to split instead (``[b, s, h] -> [b, s/p, h]`` with 1)."""
    group, d = _agreed("scatter_to_sequence_parallel_region", input_, group, sequence_dim=sequence_dim,
                       divisible=True)
    return _block_of(_ScatterToSequenceRegion, input_, group, d)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True, group=None, *, sequence_dim: int = 0
) -> torch.Tensor:
    """All-gather of dim 0 forward. ``[s/p, ...] -> [s, ...]``.

    Backward reduce-scatters the gradient (the consumer is tensor-parallel, so each rank holds a
    partial gradient), or just splits it when ``tensor_parallel_output_grad=False``.
    ``sequence_dim``: the dim to gather instead (``[b, s/p, h] -> [b, s, h]`` with 1).
    """
    reduce = bool(tensor_parallel_output_grad)
    group, d = _agreed("gather_from_sequence_parallel_region", input_, group, sequence_dim=sequence_dim,
                       flags=f", tensor_parallel_output_grad {reduce}")
    return _on(_GatherFromSequenceRegion, input_, group, reduce, d)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None, *,
                                               sequence_dim: int = 0) -> torch.Tensor:
    """Reduce-scatter of dim 0 forward, all-gather backward. ``[s, ...] -> [s/p, ...]``.

    ``sequence_dim``: the dim to reduce-scatter instead (``[b, s, h] -> [b, s/p, h]`` with 1)."""
    group, d = _agreed("reduce_scatter_to_sequence_parallel_region", input_, group, sequence_dim=sequence_dim,
                       divisible=True)
    return _block_of(_ReduceScatterToSequenceRegion, input_, group, d)
