"""Embedding split along the vocabulary (or, :func:`shard_embedding_dim`, along its embedding dim)."""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _collectives as coll
from . import settings
from ._agreement import agree, describe
from ._checks import check_divisible, check_float_dtype, check_int, check_replaceable, check_tensor
from ._data_parallel import copy_rows_
from .layers import ParameterSplit, ShareGroupOnCopy, block_of, check_sequence_dim, split_block, split_in_place
from .mappings import gather_last_dim, reduce_from_into, reduce_scatter_dim0

__all__ = ["ID_DTYPES", "VocabParallelEmbedding", "check_embedding", "check_embedding_dim", "check_index_range",
           "out_of_range", "shard_embedding_dim"]

#: The dtypes of ids the embedding (``F.embedding``) takes.
ID_DTYPES = (torch.int64, torch.int32)


def _can_sync(t: torch.Tensor) -> bool:
    """Whether a host-side look at ``t`` is allowed (not while compiling or capturing a graph)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def out_of_range(ids: torch.Tensor, size: int, allowed: Optional[int] = None) -> torch.Tensor:
    """The mask of the entries of ``ids`` outside ``[0, size)`` (and other than ``allowed``)."""
    bad = (ids < 0) | (ids >= size)
    return bad if allowed is None else bad & (ids != allowed)


def check_index_range(name: str, ids: torch.Tensor, size: int, allowed: Optional[int] = None) -> bool:
    """Raise ValueError unless every entry of ``ids`` is in ``[0, size)`` (or equals ``allowed``);
    return whether it looked.

    Skipped (False) while compiling or capturing a CUDA graph, where it would need a host sync, and
    with ``TP_KERNELS_CHECK_IDS=0`` (:func:`tp_kernels.settings.ids_checked`), where its host sync
    is not wanted: the caller's lookup must then fail on an id out of range itself, on every rank
    (where a rank would mask it as another rank's id).
    """
    if ids.numel() == 0:
        return True
    if not settings.ids_checked() or not _can_sync(ids):
        return False
    # the smallest and the largest id first, read back at once: one op, one copy to the host (the
    # mask below, the error's, is four ops and a copy)
    low, high = torch.aminmax(ids)
    low, high = torch.stack((low, high)).tolist() if ids.is_cuda else (int(low), int(high))
    if low >= 0 and high < size:
        return True
    bad = out_of_range(ids, size, allowed)
    if bool(bad.any()):
        first = ids[bad].flatten()[0].item()
        raise ValueError(f"{name}: index {first} is out of range for a vocabulary of {size}")
    return True


def check_embedding(name: str, embedding: nn.Module) -> Optional[float]:
    """What a :class:`VocabParallelEmbedding` must scale its rows by to stand for ``embedding``
    (None: nothing), or a ``ValueError`` naming ``name`` where it cannot stand for it (see
    :func:`tp_kernels._checks.check_replaceable`).

    A subclass of ``nn.Embedding`` with a forward of its own is taken when that forward is the
    lookup times a constant, in the weight's dtype (Gemma's and MiniCPM 3's scaled word
    embeddings: ``sqrt(hidden)``): its forward is run on a two-row table of ones and random
    values, and must return exactly those rows times one number. Anything else (a norm, an added
    term) is refused, as is such a subclass on the meta device, whose forward computes nothing."""
    scale = None
    if isinstance(embedding, nn.Embedding) and type(embedding).forward is not nn.Embedding.forward \
            and not (embedding._forward_pre_hooks or embedding._forward_hooks):
        kind = type(embedding).__name__
        weight = embedding.weight
        if weight.device.type == "meta":
            raise ValueError(f"{name}: {kind} is an nn.Embedding with a forward of its own, which cannot be run on "
                             "the meta device to tell whether a parallel embedding computes it: parallelize it with "
                             "its weights")
        rows = torch.randn(2, embedding.embedding_dim, generator=torch.Generator().manual_seed(0)).to(weight)
        rows[0] = 1
        probe = copy.copy(embedding)  # (its buffers and attributes; a two-row table of its own)
        probe._parameters = {**embedding._parameters, "weight": nn.Parameter(rows, requires_grad=False)}
        probe.padding_idx = None
        with torch.no_grad():
            out = probe(torch.tensor([0, 1], device=weight.device))
        found = out[0, 0].item() if isinstance(out, torch.Tensor) and out.shape == rows.shape else None
        if found is None or out.dtype != rows.dtype or not torch.equal(
                out, rows * torch.tensor(found, dtype=rows.dtype, device=rows.device)):
            raise ValueError(f"{name}: {kind} is an nn.Embedding with a forward of its own, which is not the lookup "
                             "times a constant (as Gemma's scaled word embedding is), so a parallel embedding would "
                             "not compute it")
        scale = found
    check_replaceable(name, embedding, nn.Embedding, own_forward=scale is not None)
    return None if scale == 1.0 else scale


def check_embedding_dim(name: str, embedding: nn.Module, p: int) -> None:
    """What :func:`shard_embedding_dim` checks before it changes anything: a ``ValueError`` naming
    ``name`` unless ``embedding`` is an ``nn.Embedding`` whose columns it can split over ``p``
    ranks (a subclass as :func:`check_embedding` takes it; no ``max_norm``, which renormalizes each
    whole row; an ``embedding_dim`` p divides; not split already)."""
    if isinstance(embedding, nn.Module) and "parameter_splits" in embedding.__dict__:
        raise ValueError(f"{name}: this {type(embedding).__name__} is split already")
    check_embedding(name, embedding)
    if embedding.max_norm is not None:
        raise ValueError(f"{name}: max_norm={embedding.max_norm} renormalizes each whole row, of which a rank "
                         "holds columns: split it by rows (a vocabulary split) or drop max_norm")
    if embedding.embedding_dim % p:
        raise ValueError(f"{name}: embedding_dim={embedding.embedding_dim}, which the tensor-parallel size {p} does "
                         "not divide")


def shard_embedding_dim(embedding: nn.Module, group=None) -> nn.Module:
    """Split ``embedding``, an ``nn.Embedding``, along its embedding dim, in place: rank r keeps
    columns ``[r D/p, (r+1) D/p)`` of every row, looks up its columns of the ids' rows, and the
    ranks' columns are all-gathered along the last dim, so every rank returns the whole embedding
    ``[..., D]`` (its gradient split back: each rank's columns of the table's). A table too large
    for one device thus holds ``1/p`` of its bytes on each, with no id range to mask and no sum
    (fairscale's ``ParallelEmbedding``; transformers' ``embedding_colwise``, which
    :func:`tp_kernels.parallelize` takes). The weight becomes this rank's columns, a
    :class:`tp_kernels.layers.ParameterSplit` along dim 1 in ``parameter_splits``, so the state
    dicts, :func:`tp_kernels.clip_grad_norm_` and the checkpoints treat it as a layer's weight.
    Checked first (:func:`check_embedding_dim`); with fingerprints on, each call is agreed with the
    group (the ids' shape and dtype). Returns ``embedding``; with one rank nothing changes but
    ``parameter_splits``."""
    group = coll.resolve_group(group)
    p = coll.group_size(group)
    check_embedding_dim("embedding", embedding, p)
    # (this rank's columns; embedding_dim stays D, its output's)
    split_in_place(embedding, {"weight": (1, ParameterSplit(group, (embedding.embedding_dim,)))})
    if p == 1:
        return embedding
    call = f"{type(embedding).__name__} (split along its embedding dim by shard_embedding_dim)"

    def before(mod, args):
        ids = args[0] if args else None
        agree(call, group, lambda: None, lambda _: f"input {describe(ids)}", hint=ids)

    def after(mod, args, output):
        return gather_last_dim(output, group)

    embedding.register_forward_pre_hook(before)
    embedding.register_forward_hook(after)
    return embedding


class VocabParallelEmbedding(ShareGroupOnCopy, nn.Module):
    """``nn.Embedding`` whose ``[num_embeddings, embedding_dim]`` table is split by rows.

    Rank r holds rows ``[r*V/p, (r+1)*V/p)``; where p does not divide V, ``c = ceil(V/p)`` rows
    each, rows ``[r*c, (r+1)*c)`` of the table padded at its end with zero rows that no id looks
    up (Megatron-LM's and vLLM's padded vocabulary; the embedding is unchanged). Each rank looks
    up the ids in its range, zeroes the others, and the results are all-reduced, so every rank
    returns the full embedding; with ``sequence_parallel=True`` they are reduce-scattered along
    dim 0 instead (Megatron's sequence-parallel embedding, half the bytes of the all-reduce), or
    along ``sequence_dim``, so each rank returns its block of the sequence, as the
    sequence-parallel layers take it.

    Args:
        num_embeddings: vocabulary size ``V``.
        embedding_dim: ``D``.
        padding_idx: as in ``nn.Embedding`` (that row gets no gradient and starts at zero).
        sequence_parallel: return this rank's block of dim 0 (the sequence, ``[s, b]`` ids first)
            of the embedding, ``[s/p, ..., D]``; dim 0 of the ids must be divisible by p.
        sequence_dim: with ``sequence_parallel``, the dim of the ids that is the sequence instead
            of dim 0: 1 for batch-first ids ``[b, s]``, whose embedding is then ``[b, s/p, D]``
            (its block copied out unless the dims before it are 1).
        group: process group (default: the tensor-parallel group).
        init_method: ``f(full_weight)`` initializing the full ``[V, D]`` table in place;
            default: ``nn.Embedding``'s (standard normal). Seed every rank alike.
        device, dtype: of the weight.
        output_scale: a number the rows looked up are multiplied by, in the weight's dtype (Gemma's
            scaled word embedding, ``sqrt(hidden)``; :meth:`from_embedding` finds it); None: none.

    Shapes: input ``[...]`` integer ids in ``[0, V)``; ``weight`` ``[ceil(V/p), D]``; output ``[..., D]``
    (``[s/p, ..., D]`` for ids ``[s, ...]`` with sequence parallelism; ``[b, s/p, D]`` for ids ``[b, s]``
    with ``sequence_dim=1``).
    """

    #: the parameters of which each rank holds a block, and the dim they are split along
    sharded_parameters = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx: Optional[int] = None,
                 sequence_parallel: bool = False, group=None,
                 init_method: Optional[Callable[[torch.Tensor], object]] = None, device=None, dtype=None,
                 output_scale: Optional[float] = None, sequence_dim: int = 0):
        super().__init__()
        check_int("num_embeddings", num_embeddings)
        check_sequence_dim(sequence_dim, sequence_parallel)
        check_int("embedding_dim", embedding_dim)
        check_float_dtype("dtype", dtype)
        if padding_idx is not None:
            given = padding_idx
            if padding_idx < 0:  # (counted from the end, as nn.Embedding counts it)
                padding_idx += num_embeddings
            if not 0 <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx: must be within num_embeddings ({num_embeddings}), got {given}")
        self.group = coll.resolve_group(group)
        self.tp_size = coll.group_size(self.group)
        self.tp_rank = coll.group_rank(self.group)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = sequence_dim
        if output_scale is not None and (isinstance(output_scale, bool) or not isinstance(output_scale, (int, float))):
            raise ValueError(f"output_scale: expected a number or None, got {output_scale!r}")
        self.output_scale = output_scale
        self.split_parts, self.split_blocks = (num_embeddings,), (self.tp_size,)  # the rows: one part (layers.block_of)
        # ceil(V/p) rows each, the last blocks ending in padding where p does not divide V
        self.num_embeddings_per_partition, self.pad_rows = split_block(num_embeddings, self.tp_size, self.tp_rank)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition - self.pad_rows
        self._init_method = init_method
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, device=device, dtype=dtype)
        )
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the table as the constructor does: this rank's rows of a full table drawn as
        ``nn.Embedding`` draws it (or by ``init_method``), the padding row zero, so ranks seeded
        alike hold rows of one table. For an embedding made on the meta device, after
        ``to_empty()``."""
        master = torch.empty(self.num_embeddings, self.embedding_dim, device=self.weight.device,
                             dtype=self.weight.dtype)
        if self._init_method is None:
            nn.init.normal_(master)
        else:
            self._init_method(master)
        if self.padding_idx is not None:
            with torch.no_grad():
                master[self.padding_idx].fill_(0)
        self.load_full_weight(master)

    @property
    def _local_padding_idx(self) -> Optional[int]:
        pad = self.padding_idx
        if pad is None or not self.vocab_start_index <= pad < self.vocab_end_index:
            return None
        return pad - self.vocab_start_index

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full ``[num_embeddings, embedding_dim]`` table in place."""
        check_tensor("weight", weight, dim=2)
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"weight: expected the full shape {(self.num_embeddings, self.embedding_dim)}, got {tuple(weight.shape)}"
            )
        copy_rows_(self.weight, block_of(weight, self.sharded_parameters["weight"], self))  # (FSDP2's rows too)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        """A parallel embedding holding this rank's rows of ``embedding``'s table (and, where its
        forward scales the rows, Gemma's, scaling them alike: :func:`check_embedding`)."""
        kwargs.setdefault("output_scale", check_embedding("embedding", embedding))
        for option in ("max_norm", "sparse", "scale_grad_by_freq"):
            if getattr(embedding, option):
                raise ValueError(f"embedding: {option}={getattr(embedding, option)!r} is not supported")
        device = kwargs.pop("device", None) or embedding.weight.device
        dtype = kwargs.pop("dtype", None) or embedding.weight.dtype
        kwargs.setdefault("padding_idx", embedding.padding_idx)
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, device="meta", dtype=dtype, **kwargs)
        layer.to_empty(device=device)
        layer.load_full_weight(embedding.weight.detach())
        return layer

    def _check(self, input_) -> bool:
        """The input's checks (a ``ValueError`` naming it); whether its ids' range was looked at
        (:func:`check_index_range`)."""
        d = self.sequence_dim
        check_tensor("input", input_, min_dim=d + 1 if self.sequence_parallel else 0)
        if self.sequence_parallel:
            check_divisible(f"input.shape[{d}]", input_.shape[d], self.tp_size)
        if input_.dtype not in ID_DTYPES:
            raise ValueError(f"input: expected ids of dtype torch.int64 or torch.int32, got {input_.dtype}")
        if input_.device != self.weight.device:
            raise ValueError(f"input: device {input_.device} does not match the weight's device {self.weight.device}")
        return check_index_range("input", input_, self.num_embeddings)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        checked = agree("VocabParallelEmbedding", self.group, lambda: self._check(input_),
                        lambda _: f"{type(self).__name__}({self.extra_repr()}), input {describe(input_)}, "
                                  f"weight {describe(self.weight)}",
                        hint=self.weight)
        if self.tp_size == 1:
            return self._scaled(F.embedding(input_, self.weight, self.padding_idx))
        if self.sequence_parallel:  # (the ids' blocks stacked first: the lookup is then scattered along dim 0)
            input_ = coll.blocks_first(input_, self.sequence_dim, self.tp_size)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        if not checked:  # (compiling, capturing, TP_KERNELS_CHECK_IDS=0) an id out of [0, V), which every rank
            # masks, indexes past this rank's table instead: the lookup fails on every rank, as nn.Embedding's
            # (an IndexError on the CPU, a device-side assert on CUDA), where it would embed to zeros
            local_ids = local_ids.masked_fill(out_of_range(input_, self.num_embeddings),
                                              self.num_embeddings_per_partition)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)  # [..., D], this rank's rows
        out = self._scaled(out.masked_fill(outside.unsqueeze(-1), 0))
        if self.sequence_parallel:  # sum over ranks, this rank's block: [..., s/p, ..., D]
            return reduce_scatter_dim0(out, self.group)
        return reduce_from_into(out, self.group)  # sum over ranks: [..., D]

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` times ``output_scale`` in their dtype (the op Gemma's embedding does: bit for bit)."""
        if self.output_scale is None:
            return rows
        return rows * torch.tensor(self.output_scale, dtype=rows.dtype, device=rows.device)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"
        s += f", output_scale={self.output_scale}" if self.output_scale is not None else ""
        s += f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        s += ", sequence_parallel=True" if self.sequence_parallel else ""
        return s + (f", sequence_dim={self.sequence_dim}" if self.sequence_dim else "")
