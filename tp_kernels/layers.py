"""Column- and row-parallel linear layers (Megatron semantics), drop-in for ``nn.Linear``.

``Y = X Aᵀ + b`` with the full weight ``A`` of shape ``[out, in]``:

* :class:`ColumnParallelLinear` splits ``A`` by rows, ``A = [A_1; …; A_p]``: rank r holds
  ``A_r`` ``[out/p, in]`` and its bias block ``[out/p]``, and computes ``Y_r = X A_rᵀ + b_r``.
* :class:`RowParallelLinear` splits ``A`` by columns, ``A = [A_1 … A_p]``: rank r holds
  ``A_r`` ``[out, in/p]`` and multiplies its block of the input's last dim; the partial
  products are summed across ranks, then the full bias ``[out]`` is added once.

With ``sequence_parallel=True`` the activations outside the layer pair are split along dim 0
(Megatron's ``[s, b, h]``), or along ``sequence_dim`` (``[b, s, h]``: 1): the column layer
all-gathers its input and the row layer reduce-scatters its output, through :mod:`tp_kernels.ops`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _collectives as coll
from . import ops
from ._agreement import agree, describe
from ._checks import (apply_function, check_choice, check_divisible, check_float_dtype, check_int, check_linear_args,
                      check_replaceable, check_tensor, differentiable_once, functorch_transforms, with_eager_form)
from ._data_parallel import copy_rows_
from ._op_table import OPS
from .mappings import (all_reduce_op, copy_to, deferred_block, gather_last_dim, partial_grads_of, scatter_last_dim,
                       sequence_block)
from .settings import BACKEND_NAMES

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]

InitMethod = Callable[[torch.Tensor], object]


def _init_master(weight_shape, bias_len, fan_in, init_method, *, device, dtype):
    """The full (unsharded) weight and bias, drawn as ``nn.Linear`` draws them.

    ``init_method=None`` consumes the random stream exactly as ``nn.Linear(in, out)`` does on the
    same device and dtype, so a model built under the same seed gets the same full matrix,
    whatever p is. A given ``init_method`` initializes the weight; the bias is then zero
    (Megatron's convention).
    """
    master_w = torch.empty(weight_shape, device=device, dtype=dtype)
    master_b = None if bias_len is None else torch.empty(bias_len, device=device, dtype=dtype)
    if init_method is None:
        nn.init.kaiming_uniform_(master_w, a=math.sqrt(5))
        if master_b is not None:
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(master_b, -bound, bound)
    else:
        init_method(master_w)
        if master_b is not None:
            nn.init.zeros_(master_b)
    return master_w, master_b


class ShareGroupOnCopy:
    """``copy.deepcopy`` of a module holding ``self.group``: the copy shares the process group
    (which cannot be copied) and deep-copies everything else; ``copy.copy`` shares everything.
    Pickling one (``torch.save(model)``, a multiprocessing queue) is a ``TypeError`` saying what to
    save instead: a process group exists only in the processes that made it."""

    def __deepcopy__(self, memo):
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    def __copy__(self):
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self):
        if self.group is not None:
            raise TypeError(f"{type(self).__name__} holds its process group, which cannot be pickled (torch.save of "
                            "a whole model, a multiprocessing queue): save the weights instead, with "
                            "tp_kernels.full_state_dict or sharded_state_dict, and make the model again where they "
                            "are loaded")
        return dict(self.__dict__)


class _ParallelLinear(ShareGroupOnCopy, nn.Module):
    """What both layers share: group, sharded parameters, initialization and loading."""

    def __init__(self, in_features, out_features, bias, *, sequence_parallel, skip_bias_add,
                 group, init_method, device, dtype, backend, num_chunks, output_sizes=None, head_size=None,
                 sequence_dim=0):
        super().__init__()
        check_int("in_features", in_features)
        check_int("out_features", out_features)
        check_float_dtype("dtype", dtype)
        check_choice("backend", backend, BACKEND_NAMES)
        if num_chunks is not None:
            check_int("num_chunks", num_chunks)
        check_sequence_dim(sequence_dim, sequence_parallel)
        self.group = coll.resolve_group(group)
        self.tp_size = coll.group_size(self.group)
        self.tp_rank = coll.group_rank(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = bool(sequence_parallel)
        #: the dim of the activations that sequence parallelism splits (checked against each input)
        self.sequence_dim = sequence_dim
        self.skip_bias_add = bool(skip_bias_add)
        self.backend, self.num_chunks = backend, num_chunks
        self._init_method = init_method
        # each layer's sharded_parameters: rows of [out, in] (column-parallel), or columns
        #: rows of padding at the end of this rank's block of the split dim (a size p does not divide)
        self.pad_rows = 0
        #: the blocks each part of the split dim is split into: tp_size, or fewer for a part that is
        #: replicated (rank r holds block r * blocks // tp_size)
        self.split_blocks = (self.tp_size,)
        if self.sharded_parameters["weight"] == 0:
            #: the parts the split dim is made of (full sizes)
            self.split_parts, self.split_blocks = check_output_sizes(output_sizes, out_features, self.tp_size, head_size)
            self.head_size = head_size
            if plain_split(self):
                self.out_features_per_partition, self.pad_rows = split_block(out_features, self.tp_size, self.tp_rank)
            else:
                self.out_features_per_partition = sum(local_sizes(self))
            self.in_features_per_partition = in_features
            shape = (self.out_features_per_partition, in_features)
            bias_len = self.out_features_per_partition
        else:
            self.in_features_per_partition = check_divisible("in_features", in_features, self.tp_size)
            self.out_features_per_partition = out_features
            self.split_parts = (in_features,)
            shape = (out_features, self.in_features_per_partition)
            bias_len = out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_len, **factory))
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the weight and bias as the constructor does: this rank's shard of a full
        matrix drawn as ``nn.Linear`` draws it (or by ``init_method``), so ranks seeded alike hold
        shards of one matrix. For a layer made on the meta device, after ``to_empty()``."""
        master_w, master_b = _init_master(
            (self.out_features, self.in_features), self.out_features if self.bias is not None else None,
            self.in_features, self._init_method, device=self.weight.device, dtype=self.weight.dtype,
        )
        self._load(master_w, master_b)

    # -- sharding -------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, weight, bias):
        # (into FSDP2's rows too, where it shards the parameters further)
        copy_rows_(self.weight, block_of(weight, self.sharded_parameters["weight"], self))
        if bias is not None:
            copy_rows_(self.bias, block_of(bias, self.sharded_parameters.get("bias"), self))

    def load_full_weight(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                         output: Optional[int] = None) -> None:
        """Copy this rank's shard of a full ``[out, in]`` weight (and ``[out]`` bias) in place.

        ``bias=None`` leaves the bias as it is. Dtype and device are converted as by ``copy_``.
        ``output=j``, for a column layer of several outputs (``output_sizes``): ``weight`` (and
        ``bias``) are output ``j``'s alone, ``[output_sizes[j], in]`` (a checkpoint's ``q_proj``,
        ``k_proj`` or ``v_proj``, fused here), and only this rank's block of that output is written.
        """
        rows = self.out_features
        if output is not None:
            if self.sharded_parameters["weight"] != 0:
                raise ValueError("output: only a column-parallel layer has outputs to load one by one")
            parts = self.split_parts
            if isinstance(output, bool) or not isinstance(output, int) or not 0 <= output < len(parts):
                raise ValueError(f"output: expected the index of one of the layer's {len(parts)} outputs "
                                 f"(output_sizes={list(parts)}), got {output!r}")
            if len(parts) == 1:
                output = None  # the one output: the whole weight
        if output is not None:
            rows, sizes = parts[output], local_sizes(self)
            start, size = sum(sizes[:output]), sizes[output]  # where it lies in this rank's rows
        check_tensor("weight", weight, dim=2)
        if tuple(weight.shape) != (rows, self.in_features):
            raise ValueError(f"weight: expected the full shape {(rows, self.in_features)}, got {tuple(weight.shape)}")
        if bias is not None:
            if self.bias is None:
                raise ValueError("bias: this layer was built with bias=False")
            check_tensor("bias", bias, dim=1)
            if bias.shape[0] != rows:
                raise ValueError(f"bias: expected shape ({rows},), got {tuple(bias.shape)}")
        if output is None:
            self._load(weight, bias)
            return
        index = block_index(self, output)
        copy_rows_(self.weight, weight.narrow(0, index * size, size), start)
        if bias is not None:
            copy_rows_(self.bias, bias.narrow(0, index * size, size), start)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs):
        """A parallel layer holding this rank's shard of ``linear``'s weight and bias.

        ``kwargs`` are the constructor's keyword arguments; device and dtype default to
        ``linear``'s.
        """
        check_replaceable("linear", linear, nn.Linear)
        device = kwargs.pop("device", None) or linear.weight.device
        dtype = kwargs.pop("dtype", None) or linear.weight.dtype
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    device="meta", dtype=dtype, **kwargs)
        layer.to_empty(device=device)
        layer._load(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}, backend={self.backend!r}"
            + (f", sequence_dim={self.sequence_dim}" if self.sequence_dim else "")
        )

    def _op(self, op: str, input_, weight, bias, prepare=None, dim: Optional[int] = None):
        """Run ``op`` on this rank's weight; argument errors name ``input_``; ``prepare(input_)``
        checks and prepares the input first (agreed with the group as the op's own checks are).
        The ops of sequence parallelism gather or scatter ``sequence_dim`` (or ``dim``: a deferred
        gather's)."""
        if dim is None:
            dim = self.sequence_dim if OPS[op].splits_rows else 0
        return ops.run(op, input_, weight, bias, self.group, self.backend, self.num_chunks, x_name="input",
                       prepare=prepare, dim=dim, dim_name="sequence_dim", about=self._described)

    def _described(self) -> str:
        """The layer as its call's fingerprint shows it (:mod:`tp_kernels._agreement`): its class and
        configuration, on which the ranks must agree too (one gathering its output where another
        does not, or joining its outputs otherwise, would wait on a collective no peer makes, or
        differ from it silently)."""
        return f"{type(self).__name__}({self.extra_repr()})"


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X Aᵀ + b`` with ``A = [A_1; …; A_p]`` split along the output dim.

    Args:
        in_features, out_features: sizes of the full layer. Where p does not divide
            ``out_features`` (an output layer over a vocabulary such as GPT-2's 50257), each rank
            holds ``ceil(out/p)`` rows and the last blocks end in padding (zero rows, see
            :func:`split_block`), whose outputs are ``-inf``: no class to a softmax or
            :func:`~tp_kernels.vocab_parallel_cross_entropy` (which takes ``vocab_size=out`` for
            label smoothing), never the argmax, no gradient; ``gather_output`` drops them.
        bias: whether to learn a bias (this rank holds its ``[out/p]`` block).
        gather_output: all-gather the output's last dim, returning ``[..., out]`` on every rank
            instead of this rank's ``[..., out/p]``.
        output_sizes: the output as several outputs side by side (a fused projection: the
            ``[q, k, v]`` of attention, the ``[gate, up]`` of a gated MLP), their sizes summing to
            ``out_features``, each divisible by p: each is split across the ranks, so that rank r
            holds block r of each, ``[q_r, k_r, v_r]`` (vLLM's ``MergedColumnParallelLinear`` /
            ``QKVParallelLinear``). Default: one output.
        head_size: with ``output_sizes``, the size of an attention head, each output a whole
            number ``n`` of heads: an output whose heads p divides is split as above, one of fewer
            heads than ranks (the keys and values of grouped-query or multi-query attention, p a
            multiple of n) is replicated: each head is held whole by p/n consecutive ranks, rank r
            holding head ``r*n//p``, the head its query heads attend with (vLLM's replicated KV
            heads). Its gradient is summed over those ranks in backward, so they stay alike.
        sequence_parallel: the input is this rank's block of dim 0, ``[s/p, ..., in]``; it is
            all-gathered (overlapped with the GEMM) to give ``[s, ..., out/p]``.
        sequence_dim: with ``sequence_parallel``, the dim of the input that is split instead of
            dim 0, any but the last: 1 for a batch-first ``[b, s/p, in]`` (torch's ``Shard(1)``),
            gathered to ``[b, s, out/p]``. The GEMMs run on the input as it is; the gathered
            output's blocks are joined along that dim, a copy unless the dims before it are 1.
        skip_bias_add: return ``(Y without bias, bias)`` for a later fused add. With
            ``gather_output`` the returned bias is the full ``[out]``.
        group: process group (default: the tensor-parallel group).
        init_method: ``f(full_weight)`` initializing the full ``[out, in]`` weight in place;
            default: ``nn.Linear``'s initialization. Seed every rank alike.
        device, dtype: of the parameters.
        backend: ``"auto"``, ``"reference"``, ``"pipelined"`` or ``"fused"`` (see :mod:`tp_kernels.ops`).
        num_chunks: chunks of the pipelined schedule (default: the schedule's).

    Shapes: input ``[..., in]`` (``[s/p, ..., in]`` with sequence parallelism); ``weight``
    ``[out/p, in]``; output ``[..., out/p]`` (``[s, ..., out/p]``; last dim ``out`` with
    ``gather_output``).
    """

    #: the parameters of which each rank holds a block, and the dim they are split along (the
    #: others are whole on every rank)
    sharded_parameters = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, gather_output: bool = False,
                 sequence_parallel: bool = False, skip_bias_add: bool = False, group=None,
                 init_method: Optional[InitMethod] = None, device=None, dtype=None, backend: str = "auto",
                 num_chunks: Optional[int] = None, output_sizes: Optional[Sequence[int]] = None,
                 head_size: Optional[int] = None, sequence_dim: int = 0):
        self.gather_output = bool(gather_output)
        #: the :class:`SharedInputGather` of the column layers this one gathers its input with, if any
        self.shared_gather: Optional[SharedInputGather] = None
        super().__init__(in_features, out_features, bias, sequence_parallel=sequence_parallel,
                         skip_bias_add=skip_bias_add, group=group, init_method=init_method, device=device,
                         dtype=dtype, backend=backend, num_chunks=num_chunks, output_sizes=output_sizes,
                         head_size=head_size, sequence_dim=sequence_dim)

    def forward(self, input_: torch.Tensor):
        shared = self.shared_gather.output(self, input_) if self.shared_gather is not None else None
        if shared is not None:  # (gathered once with the other layers' GEMMs)
            return shared
        weight, full_bias = self._weight_and_bias()
        bias = None if self.skip_bias_add else full_bias
        if self.sequence_parallel:
            # [s/p, ..., in] -(AG)-> [s, ..., in] x [in, out/p] -> [s, ..., out/p]
            out = self._op("all_gather_matmul", input_, weight, bias)
        else:
            x, gathered = partial_grads_of(input_, self.group)
            if gathered:  # gathered for the column layers (a module's input): d(input) left there, partial
                out = self._local(x, weight, bias)
            else:  # [..., in] x [in, out/p] -> [..., out/p]; backward all-reduces d(input)
                out = self._op("linear_with_grad_all_reduce", input_, weight, bias)
        if self.gather_output:
            out = full_of(gather_last_dim(out, self.group), -1, self)  # [..., out]
        elif self.pad_rows:  # the columns past out_features: no output, -inf (softmax 0, never the argmax)
            # (in place, on the op's new output: no copy of the logits; autograd zeroes their gradient;
            # under a torch.func transform, whose outputs are views it may not write, on a copy)
            keep = self.out_features_per_partition - self.pad_rows
            if functorch_transforms():
                out = out.index_fill(-1, torch.arange(keep, keep + self.pad_rows, device=out.device), float("-inf"))
            else:
                out.narrow(-1, keep, self.pad_rows).fill_(float("-inf"))
        if not self.skip_bias_add:
            return out
        out_bias = full_bias
        if out_bias is not None and self.gather_output:
            out_bias = full_of(gather_last_dim(out_bias, self.group), -1, self)
        return out, out_bias

    def _weight_and_bias(self):
        """The weight and bias the GEMM takes: the parameters, or where outputs are replicated on
        several ranks, views whose gradients are summed over those ranks (:class:`_SumOverReplicas`)."""
        weight, bias = self.weight, self.bias
        if min(self.split_blocks) < self.tp_size and torch.is_grad_enabled():
            # replicated outputs: each rank's gradient of them is its heads' share, summed in backward
            weight, bias = apply_function(_SumOverReplicas, self.group, local_sizes(self), self.split_blocks,
                                                  [block_index(self, j) for j in range(len(self.split_parts))],
                                                  weight, bias)
        return weight, bias

    def _local(self, x, weight, bias):
        """``x Wᵀ + b`` on this rank's rows, nothing communicated: ``x`` was gathered whole for the
        column layers (:func:`tp_kernels.mappings.gather_for_column_layers`), whose backward
        reduces the input gradients they leave there, once for them all."""
        x, weight, bias = agree(
            "ColumnParallelLinear", self.group, lambda: check_linear_args(x, weight, bias, x_name="input"),
            lambda c: f"{self._described()}, input {describe(c[0])}, weight {describe(c[1])}, bias {describe(c[2])}, "
                      "gathered input",
            hint=x)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        parts = f", output_sizes={list(self.split_parts)}" if not plain_split(self) or self.head_size is not None else ""
        parts += f", head_size={self.head_size}" if self.head_size is not None else ""
        return super().extra_repr() + f", gather_output={self.gather_output}" + parts


class SharedInputGather:
    """The column layers under sequence parallelism of one module (:func:`share_input_gathers`),
    those it calls on one input (its query, key and value projections; its gate and up projections)
    gathering it once; or its column layers without sequence parallelism, those it calls on one
    :class:`tp_kernels.mappings.DeferredGather` not yet read (a gather torch's
    ``PrepareModuleInput`` left to them), gathering its block once: the first of them called runs
    one ``all_gather_matmul`` of their weights side by side (each layer's output a contiguous tensor
    of its own) and keeps the others' outputs for their calls on that input (also where the
    :class:`~tp_kernels.mappings.DeferredGather` was read meanwhile); in backward, one
    reduce-scatter of the input's gradient and one gather again, where each layer would make its
    own. The weights' concatenation is not kept for the backward: it is made again there from the
    layers' weights (:func:`_saved_as_parts`), so the memory the backward holds is what each
    layer's own call would hold (under saved-tensor hooks of the caller's, torch's non-reentrant
    checkpoint's, those decide: the checkpoint keeps nothing and recomputes it all).

    Until learned, the first layer called computes all of them (alike in what they gather with,
    :func:`_gathers_with`). Which layers share is learned in the module's first forward that runs
    eagerly outside saved-tensor hooks: the layers it calls on one tensor, once each, alike, share
    from then on (their weights joined in the same order), and nothing changes after. A call that
    does not follow (another input, a layer called twice) runs alone, what the group kept dropped,
    and changes nothing: so a forward and its recomputation by torch's checkpoint take the same
    path, and a model resumed from a checkpoint the same as the one that saved it, where the module
    calls all of them on one input (an attention's projections); where it does not (a block holding
    its attention's and its MLP's projections side by side), the forwards before it is learned
    compute the others' outputs on the first input for nothing. Under ``torch.compile`` and
    ``torch.func`` transforms, and for a layer called outside the module's forward or whose backend
    or dtype changed since, each runs alone. A learning forward that raises learns nothing."""

    def __init__(self, layers: Sequence["ColumnParallelLinear"]) -> None:
        self.layers = tuple(layers)
        self.groups: Optional[Dict[int, tuple]] = None  # id(layer) -> the layers it shares with, once learned
        self.seen: Optional[Dict[int, tuple]] = None  # (learning: id(input) -> (the input, the layers called on it))
        self.running = False
        self.held: Dict[tuple, tuple] = {}  # a group -> (the input it gathered, {id(layer): its output})

    def output(self, layer: "ColumnParallelLinear", input_: torch.Tensor) -> Optional[torch.Tensor]:
        """``layer``'s output for ``input_``, from its group's shared gather, while the module's
        forward runs; None where it runs alone."""
        if not self.running or torch.compiler.is_compiling() or functorch_transforms():
            return None
        group = self.layers if self.groups is None else self.groups.get(id(layer))  # (until learned: all of them)
        deferred = None if layer.sequence_parallel else deferred_block(input_, layer.group)
        if not layer.sequence_parallel and deferred is None and \
                (group not in self.held or self.held[group][0] is not input_):
            return None  # (handed its input whole, and not the one its group's GEMM took: nothing to gather)
        if self.seen is not None:  # (learning: the calls noted)
            self.seen.setdefault(id(input_), (input_, []))[1].append(layer)
        if group is None or len({_gathers_with(m) for m in group}) > 1:  # (a backend or dtype changed since)
            return None
        if group in self.held:
            gathered, outputs = self.held[group]
            out = outputs.pop(id(layer), None) if gathered is input_ else None
            if out is None or not outputs:  # (another input, or a layer called twice: alone, the rest dropped)
                del self.held[group]
            return out
        weights, biases = zip(*(m._weight_and_bias() for m in group))
        weight = torch.cat(weights)
        bias = None if all(b is None for b in biases) else \
            torch.cat([weight.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)])
        # (where saved-tensor hooks are on already, torch's checkpoint's or an offload's, they decide
        # what is kept: the checkpoint keeps nothing of the call, and recomputes the joined weights)
        with torch.autograd.graph.saved_tensors_hooks(*_saved_as_parts(weight, weights)) if not _saving_hooked() \
                else contextlib.nullcontext():
            out = layer._op("all_gather_matmul", input_, weight, bias) if deferred is None else \
                layer._op("all_gather_matmul", deferred.block, weight, bias, dim=deferred.gather_dim)
        outputs = {id(m): o.contiguous() for m, o in zip(group, out.split([w.shape[0] for w in weights], -1))}
        mine = outputs.pop(id(layer))
        self.held[group] = (input_, outputs)
        return mine

    def begin(self, *_) -> None:
        """The module's forward begins (its forward pre-hook): the one that learns, where none has."""
        self.running = True
        if self.groups is None and self.seen is None and not torch.compiler.is_compiling() and \
                not functorch_transforms() and not _saving_hooked():
            self.seen = {}

    def end(self, module, args, output) -> None:
        """The module's forward ends (its forward hook, however the forward ends): what no layer
        took dropped; after the learning forward, the groups (after one that raised, none: the next
        learns)."""
        self.running = False
        self.held.clear()
        seen, self.seen = self.seen, None
        if seen is not None and output is not None:  # (torch hands an always-called hook None where it raised)
            groups: Dict[int, tuple] = {}
            for _, called in seen.values():
                if len({id(m) for m in called}) < len(called):  # (a layer called twice on it)
                    continue
                alike: Dict[tuple, list] = {}
                for m in called:
                    alike.setdefault(_gathers_with(m), []).append(m)
                for together in alike.values():
                    if len(together) > 1:  # (in the layers' order: the joined weights as before learning)
                        group = tuple(m for m in self.layers if any(m is t for t in together))
                        groups.update((id(m), group) for m in group)
            self.groups = groups


def _saved_as_parts(joined: torch.Tensor, parts: Sequence[torch.Tensor]):
    """``saved_tensors_hooks`` under which autograd saves ``joined`` (``torch.cat(parts)``, a new
    tensor), or a view of it (its transpose, as a GEMM saves it), as its parts and the view's
    place, and joins them again when the backward takes it: no copy of them kept meanwhile."""
    storage = joined.untyped_storage().data_ptr()

    def pack(t):
        try:
            mine = t.untyped_storage().data_ptr() == storage
        except (RuntimeError, NotImplementedError):  # (a tensor without storage of its own: not ours)
            mine = False
        return (tuple(parts), t.size(), t.stride(), t.storage_offset()) if mine else t

    def unpack(saved):
        if not isinstance(saved, tuple):
            return saved
        parts_, size, stride, offset = saved
        return torch.cat(parts_).as_strided(size, stride, offset)

    return pack, unpack


def _saving_hooked() -> bool:
    """Whether saved-tensor hooks are on (torch's non-reentrant checkpoint's, an offload's): where
    this torch cannot say, False."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _gathers_with(layer: "ColumnParallelLinear") -> tuple:
    """What column layers that gather an input together must have alike."""
    return (id(layer.group), layer.backend, layer.num_chunks, layer.sequence_dim, layer.in_features,
            layer.weight.dtype, layer.weight.device)


def share_input_gathers(module: nn.Module, gathered_into: Sequence[nn.Module] = ()) -> None:
    """For each module in ``module`` holding several column layers (children) whose outputs are
    neither gathered, nor padded, nor their bias returned apart, alike in whether they are
    sequence-parallel: one :class:`SharedInputGather` of them, begun and ended by the module's
    forward hooks. Those without sequence parallelism only in the modules ``gathered_into``, whose
    input a torch style gathers along the sequence: they share the gather left to them
    (:class:`tp_kernels.mappings.DeferredGather`); elsewhere nothing gathers their input, and the
    hooks would cost each call for nothing."""
    into = {id(m) for m in gathered_into}
    for holder in module.modules():
        layers = [m for m in holder.children() if isinstance(m, ColumnParallelLinear) and not m.gather_output
                  and not m.skip_bias_add and not m.pad_rows and m.shared_gather is None]
        for sequence_parallel in (True, False) if id(holder) in into else (True,):
            alike = [m for m in layers if m.sequence_parallel == sequence_parallel]
            if len(alike) > 1:
                shared = SharedInputGather(alike)
                for m in alike:
                    m.shared_gather = shared
                holder.register_forward_pre_hook(shared.begin)
                holder.register_forward_hook(shared.end, always_call=True)


@with_eager_form
class _SumOverReplicas(torch.autograd.Function):
    """A column layer's weight and bias as they are (views); in backward, the gradient rows of each
    replicated output (``blocks[j] < p``: this rank holds block ``index[j]``) summed over the ranks
    holding the same block, in one all-reduce over the group: each slot of a ``[blocks, ...]``
    buffer holds its ranks' gradients, zeros elsewhere. The other rows' gradients are this rank's
    alone. (In the form ``torch.func``'s transforms take: a ``setup_context``, a vmap rule generated.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(group, sizes, blocks, index, weight, bias):
        return weight.view_as(weight), None if bias is None else bias.view_as(bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.sizes, ctx.blocks, ctx.index = inputs[:4]

    @staticmethod
    @differentiable_once("ColumnParallelLinear (replicated outputs)")
    def backward(ctx, d_weight, d_bias):
        replicated = [j for j, b in enumerate(ctx.blocks) if b < coll.group_size(ctx.group)]
        grads = [d_weight, d_bias]
        slots = []  # for each gradient and replicated output: a [blocks, rows, ...] buffer, flattened
        for g in grads:
            if g is None:
                continue
            pieces = g.split(ctx.sizes, 0)
            for j in replicated:
                buf = pieces[j].new_zeros((ctx.blocks[j], *pieces[j].shape))
                buf[ctx.index[j]] = pieces[j]
                slots.append(buf.reshape(-1))
        summed = all_reduce_op(torch.cat(slots), ctx.group)
        out, offset = [], 0
        for g in grads:
            if g is None:
                out.append(None)
                continue
            pieces = list(g.split(ctx.sizes, 0))
            for j in replicated:
                n = ctx.blocks[j] * pieces[j].numel()
                pieces[j] = summed[offset:offset + n].view(ctx.blocks[j], *pieces[j].shape)[ctx.index[j]]
                offset += n
            out.append(torch.cat(pieces, 0))
        return None, None, None, None, out[0], out[1]


class RowParallelLinear(_ParallelLinear):
    """``Y = X Aᵀ + b`` with ``A = [A_1 … A_p]`` split along the input dim.

    Args:
        in_features, out_features: sizes of the full layer; ``in_features`` divisible by p.
        bias: whether to learn a bias; it is full (``[out]``) and added once, after the reduction.
        input_is_parallel: the input is already this rank's block of the last dim,
            ``[..., in/p]`` (e.g. a column-parallel layer's output). If False the input is
            ``[..., in]`` and this rank's block is taken here.
        sequence_parallel: reduce-scatter the output along dim 0 instead of all-reducing it:
            ``[s, ..., in/p] -> [s/p, ..., out]``. Requires ``input_is_parallel``.
        sequence_dim: with ``sequence_parallel``, the dim of the output that is scattered instead
            of dim 0, any but the last: 1 for a batch-first ``[b, s, in/p] -> [b, s/p, out]``
            (torch's ``Shard(1)``), its size divisible by p; copies as the column layer's does.
        skip_bias_add: return ``(Y without bias, bias)``. Under sequence parallelism the returned
            bias carries an all-reduce in backward, so its gradient is still complete when added
            to this rank's sequence block.
        reduce_results: False returns this rank's partial product, unreduced, for the caller to
            sum over the group later (vLLM's ``reduce_results=False``: one all-reduce for several
            partial outputs, or one fused with what follows). The bias is in the partial sum of
            group rank 0 only, so that the sum holds it once; its gradient is still complete on
            every rank (``Σ dY``: the sum's backward gives every rank the same ``dY``). Not with
            ``sequence_parallel`` (its reduce-scatter is the reduction).
        group, init_method, device, dtype, backend, num_chunks: as for :class:`ColumnParallelLinear`.

    Shapes: input ``[..., in/p]``; ``weight`` ``[out, in/p]``; output ``[..., out]``
    (``[s/p, ..., out]`` with sequence parallelism), the same on every rank without it (with
    ``reduce_results=False``, this rank's term of the sum).
    """

    #: the parameters of which each rank holds a block, and the dim they are split along (the bias
    #: is whole on every rank)
    sharded_parameters = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, skip_bias_add: bool = False, group=None,
                 init_method: Optional[InitMethod] = None, device=None, dtype=None, backend: str = "auto",
                 num_chunks: Optional[int] = None, reduce_results: bool = True, sequence_dim: int = 0):
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "sequence_parallel: requires input_is_parallel=True (the input must already be "
                "split along its last dim)"
            )
        if sequence_parallel and not reduce_results:
            raise ValueError("reduce_results: False cannot go with sequence_parallel=True, whose reduce-scatter is "
                             "the reduction")
        self.input_is_parallel = bool(input_is_parallel)
        self.reduce_results = bool(reduce_results)
        super().__init__(in_features, out_features, bias, sequence_parallel=sequence_parallel,
                         skip_bias_add=skip_bias_add, group=group, init_method=init_method, device=device,
                         dtype=dtype, backend=backend, num_chunks=num_chunks, sequence_dim=sequence_dim)

    def _split_input(self, input_: torch.Tensor) -> torch.Tensor:
        """The full input ``[..., in]`` (``input_is_parallel=False``) as this rank's ``[..., in/p]``."""
        check_tensor("input", input_, min_dim=1)
        if input_.shape[-1] != self.in_features:
            raise ValueError(
                f"input: expected the last dim to be in_features={self.in_features} "
                f"(input_is_parallel=False), got shape {tuple(input_.shape)}"
            )
        return scatter_last_dim(input_, self.group)  # [..., in/p]

    def _check_block(self, input_: torch.Tensor) -> torch.Tensor:
        """This rank's block ``[..., in/p]`` (``input_is_parallel=True``); a full-width input is
        named as the likely mistake it is."""
        if (isinstance(input_, torch.Tensor) and self.tp_size > 1 and input_.dim() >= 1
                and input_.shape[-1] == self.in_features):
            raise ValueError(
                f"input: its last dim is the full in_features={self.in_features}, but this layer takes this rank's "
                f"block [..., {self.in_features_per_partition}] (input_is_parallel=True): pass input_is_parallel=False "
                "to have the layer split the input")
        return input_

    def forward(self, input_: torch.Tensor):
        prepare = self._check_block if self.input_is_parallel else self._split_input
        bias = None if self.skip_bias_add else self.bias
        if not self.reduce_results:
            # [..., in/p] x [in/p, out] -> [..., out], this rank's term of the sum (nothing communicated)
            x, weight, bias = check_linear_args(prepare(input_), self.weight, bias, x_name="input")
            out = F.linear(x, weight)
            if bias is not None:  # its value in rank 0's term, its gradient on every rank
                out = out + (bias if self.tp_rank == 0 else bias - bias.detach())
        elif self.sequence_parallel:
            # [s, ..., in/p] x [in/p, out] -(RS)-> [s/p, ..., out]
            out = sequence_block(self._op("matmul_reduce_scatter", input_, self.weight, bias, prepare))
        else:
            # [..., in/p] x [in/p, out] -(AR)-> [..., out]
            out = self._op("matmul_all_reduce", input_, self.weight, bias, prepare)
        if not self.skip_bias_add:
            return out
        out_bias = self.bias
        if out_bias is not None and self.sequence_parallel:
            out_bias = copy_to(out_bias, self.group)
        return out, out_bias

    def extra_repr(self) -> str:
        unreduced = "" if self.reduce_results else ", reduce_results=False"
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}" + unreduced


def check_sequence_dim(sequence_dim, sequence_parallel) -> None:
    """A layer's ``sequence_dim``: a non-negative int (the input's dims are known at each call,
    which checks it against them), not 0 only with ``sequence_parallel``."""
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int) or sequence_dim < 0:
        raise ValueError(f"sequence_dim: expected an int >= 0 (1 for a batch-first [b, s, h]), got {sequence_dim!r}")
    if sequence_dim and not sequence_parallel:
        raise ValueError(f"sequence_dim: {sequence_dim} splits the sequence, which only sequence_parallel=True does")


def check_output_sizes(output_sizes, out_features: int, p: int,
                       head_size: Optional[int] = None) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(sizes, blocks)``: ``output_sizes`` as a tuple, checked (positive ints summing to
    ``out_features``, each divisible by ``p``, or, with ``head_size``, each a whole number n of heads
    that p divides or that divides p), and the blocks each is split into: ``p``, or n for an output
    of fewer heads than ranks (replicated). ``((out_features,), (p,))`` for None."""
    if output_sizes is None:
        if head_size is not None:
            raise ValueError("head_size: goes with output_sizes (the outputs made of heads)")
        return (out_features,), (p,)
    if isinstance(output_sizes, (str, bytes)) or not isinstance(output_sizes, Sequence) or not output_sizes:
        raise ValueError(f"output_sizes: expected a non-empty sequence of ints, got {output_sizes!r}")
    if head_size is not None:
        check_int("head_size", head_size)
    blocks = []
    for j, size in enumerate(output_sizes):
        check_int(f"output_sizes[{j}]", size)
        if head_size is None:
            check_divisible(f"output_sizes[{j}]", size, p)
            blocks.append(p)
            continue
        heads, rest = divmod(size, head_size)
        if rest:
            raise ValueError(f"output_sizes[{j}] ({size}) is not a whole number of heads of head_size={head_size}")
        if heads % p and p % heads:
            raise ValueError(f"output_sizes[{j}]: its {heads} heads can neither be split over the tensor-parallel "
                             f"size {p} nor replicated on it ({p} is not a multiple of {heads})")
        blocks.append(p if heads % p == 0 else heads)
    if sum(output_sizes) != out_features:
        raise ValueError(f"output_sizes: {list(output_sizes)} sum to {sum(output_sizes)}, not to "
                         f"out_features={out_features}")
    return tuple(output_sizes), tuple(blocks)


def plain_split(layer: nn.Module) -> bool:
    """Whether ``layer``'s split dim is one part of which each rank holds its own block (of
    ``ceil(n/p)`` rows, the last blocks padded where p does not divide it): not several outputs,
    nor heads fewer than the ranks (replicated)."""
    return len(layer.split_parts) == 1 and layer.split_blocks[0] == layer.tp_size


def local_sizes(layer: nn.Module) -> Tuple[int, ...]:
    """The rows of each part of ``layer``'s split dim that a rank holds (its block of each)."""
    return tuple(size // blocks for size, blocks in zip(layer.split_parts, layer.split_blocks))


def block_index(layer: nn.Module, j: int, rank: Optional[int] = None) -> int:
    """Which block of part ``j`` of ``layer``'s split dim rank ``rank`` (default: this rank) holds:
    its own, or, for a replicated part, the one it shares with its neighbours."""
    rank = layer.tp_rank if rank is None else rank
    return rank * layer.split_blocks[j] // layer.tp_size


def own_pieces(t: torch.Tensor, dim: int, layer: nn.Module, start: int = 0) -> List[torch.Tensor]:
    """The pieces of ``t`` (a block as ``layer`` holds it along ``dim``, or its gradient) that no
    other rank holds too: all of it, but a replicated part only on the first rank holding its
    block. What a sum over the group (a norm) counts once. ``t`` may be rows ``[start, start +
    len(t))`` of the block along dim 0 only (FSDP2's shard of it)."""
    p, r = layer.tp_size, layer.tp_rank
    if min(layer.split_blocks) == p:
        return [t]
    own = [b == p or r % (p // b) == 0 for b in layer.split_blocks]
    if dim != 0:  # (rows of the block hold a piece of every part)
        return [piece for piece, mine in zip(t.split(local_sizes(layer), dim), own) if mine]
    pieces, offset = [], 0
    for size, mine in zip(local_sizes(layer), own):
        lo, hi = max(offset, start), min(offset + size, start + t.shape[0])
        if mine and hi > lo:
            pieces.append(t.narrow(0, lo - start, hi - lo))
        offset += size
    return pieces


def split_block(size: int, p: int, r: int) -> Tuple[int, int]:
    """``(rows, padding)``: how many rows of a dim of ``size`` rank ``r`` of ``p`` holds, and how
    many of them, at the end, are padding. Each rank holds ``ceil(size / p)``: rank r rows ``[r*c,
    (r+1)*c)`` of the full dim padded at its end to ``p*c`` (where p does not divide it, the last
    blocks end in padding, the layout of ``torch.chunk`` and of a ``DTensor``'s ``Shard``, and
    Megatron-LM's and vLLM's of a padded vocabulary)."""
    rows = -(-size // p)
    return rows, rows - min(rows, max(0, size - r * rows))


def block_of(full: torch.Tensor, dim: Optional[int], layer: nn.Module) -> torch.Tensor:
    """This rank's block of ``full`` split along ``dim``: of each of ``layer.split_parts`` (the
    parts that dim is made of, one for most layers), the ``tp_rank``-th of ``tp_size`` equal blocks,
    side by side (a view where there is one part, unless the block ends in padding, zeros: see
    :func:`split_block`); ``full`` itself where ``dim`` is None (a parameter held whole)."""
    if dim is None:
        return full
    r, p = layer.tp_rank, layer.tp_size
    if plain_split(layer):
        rows, padding = split_block(full.shape[dim], p, r)
        return with_padding(full.narrow(dim, min(r * rows, full.shape[dim]), rows - padding), dim, padding)
    return torch.cat([part.narrow(dim, block_index(layer, j) * size, size)
                      for j, (part, size) in enumerate(zip(full.split(layer.split_parts, dim), local_sizes(layer)))],
                     dim)


def with_padding(rows: torch.Tensor, dim: int, padding: int) -> torch.Tensor:
    """``rows`` followed along ``dim`` by ``padding`` zero rows (a rank's block of a dim that p does
    not divide, from its rows of the full tensor); ``rows`` itself where ``padding`` is 0."""
    if not padding:
        return rows
    shape = list(rows.shape)
    shape[dim] = padding
    return torch.cat([rows, rows.new_zeros(shape)], dim)


def full_of(blocks: torch.Tensor, dim: int, layer: nn.Module) -> torch.Tensor:
    """The full tensor whose blocks (:func:`block_of`) every rank's are: ``blocks`` is them side
    by side along ``dim``, rank-major (as an all-gather joins them). Where the dim is made of one
    part, ``blocks`` itself, or, where the blocks end in padding, a contiguous copy without it."""
    if plain_split(layer):
        size = layer.split_parts[0]
        return blocks if blocks.shape[dim] == size else blocks.narrow(dim, 0, size).contiguous()
    p = layer.tp_size
    pieces = [rank_block.split(local_sizes(layer), dim) for rank_block in blocks.chunk(p, dim)]
    # each block of each part once: from the first rank holding it (a replicated part's block is on p/blocks ranks)
    return torch.cat([pieces[r][j] for j, b in enumerate(layer.split_blocks) for r in range(0, p, p // b)], dim)


class ParameterSplit:
    """How a parameter sharded in place, outside the parallel layers, is split (an expert weight of
    a mixture of experts, :func:`tp_kernels.experts.shard_experts`): the attributes of a parallel
    layer that :func:`block_of`, :func:`full_of`, :func:`own_pieces` and the checkpoints read.
    ``parts``: the sizes of the parts its split dim is made of (one; two for a packed ``[gate;
    up]``), each split into ``p`` blocks, none replicated; one part p does not divide (whole
    experts) is split as :func:`split_block` says, this rank's block ending in ``pad_rows`` rows of
    padding."""

    head_size = None

    def __init__(self, group, parts: Sequence[int]):
        self.group = group
        self.tp_size = coll.group_size(group)
        self.tp_rank = coll.group_rank(group)
        self.split_parts = tuple(parts)
        self.split_blocks = (self.tp_size,) * len(self.split_parts)
        self.pad_rows = split_block(parts[0], self.tp_size, self.tp_rank)[1] if len(parts) == 1 else 0


def split_in_place(module: nn.Module, splits: Dict[str, tuple]) -> None:
    """Record ``splits`` (``{name: (dim, ParameterSplit)}``) as ``module.parameter_splits``, which
    :func:`sharded_blocks` reads, and replace each parameter they name by this rank's block of it
    (a copy; whether it requires a gradient kept). With one rank, the parameters stay the same
    objects. The callers check first: :func:`tp_kernels.experts.shard_parameters`,
    :func:`tp_kernels.embedding.shard_embedding_dim`."""
    module.parameter_splits = splits
    for name, (dim, split) in splits.items():
        if split.tp_size == 1:  # (the block is the whole parameter)
            continue
        param = module._parameters[name]
        with torch.no_grad():
            block = block_of(param.detach(), dim, split).clone()
        module._parameters[name] = nn.Parameter(block, requires_grad=param.requires_grad)


def sharded_blocks(module: nn.Module) -> Tuple[Dict[str, tuple], object, Optional[str]]:
    """The parameters of ``module`` of which each rank holds a block, by state-dict name (a module
    reachable under several names under each): ``(parameter, the dim it is split along, its
    layer)``, from each parallel layer's ``sharded_parameters`` (or, for a parameter sharded in
    place, ``(parameter, dim, its ParameterSplit)``, from its module's ``parameter_splits``); the
    group of those layers (the tensor-parallel group where there are none); and why not, when they
    use several groups."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected an nn.Module, got {type(module).__name__}")
    blocks, groups = {}, {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dims = getattr(type(m), "sharded_parameters", None)
        splits = {name: (dim, m) for name, dim in dims.items()} if dims else m.__dict__.get("parameter_splits", {})
        for name, (dim, split) in splits.items():
            groups[id(split.group)] = split.group
            if getattr(m, name) is not None:
                blocks[f"{prefix}.{name}" if prefix else name] = (getattr(m, name), dim, split)
    if len(groups) > 1:
        return blocks, coll.resolve_group(None), (f"module: its parallel layers use {len(groups)} different groups; "
                                                  "this takes one tensor-parallel group")
    return blocks, next(iter(groups.values())) if groups else coll.resolve_group(None), None
