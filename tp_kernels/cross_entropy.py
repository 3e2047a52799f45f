"""Cross-entropy, entropy, argmax, top-k and sampling over vocabulary-parallel logits, without
gathering them."""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple, Union

import torch

from . import _collectives as coll
from . import rng
from ._agreement import agree, describe
from ._checks import apply_function, check_choice, check_int, check_tensor, differentiable_once, with_eager_form
from .embedding import check_index_range, out_of_range
from .layers import split_block
from .mappings import all_gather_op, all_reduce_op

__all__ = ["REDUCTIONS", "vocab_parallel_argmax", "vocab_parallel_cross_entropy", "vocab_parallel_entropy",
           "vocab_parallel_sample", "vocab_parallel_topk"]

#: what ``vocab_parallel_cross_entropy`` may return: the loss per token, or as ``F.cross_entropy`` reduces it
REDUCTIONS = ("none", "sum", "mean")


def _shifted(logits: torch.Tensor, group) -> torch.Tensor:
    """``logits`` ``[N, v]`` (this rank's classes; v may be 0, a block of padding alone) in float32
    (float64's own), less each row's maximum over the whole vocabulary, so that their exponentials
    do not overflow. The communication is the custom ops' (torch.compile sees one node each, where
    it could not trace the group's own methods): every rank's row maxima, ``[1, N] -(AG)-> [p, N]``,
    then their max (exact)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    local_max = z.amax(dim=-1) if z.shape[-1] else z.new_full(z.shape[:1], float("-inf"))
    return z - all_gather_op(local_max.unsqueeze(0), group).amax(dim=0).unsqueeze(-1)


@with_eager_form
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The loss and, after it, what its backward needs, in the form ``torch.func``'s transforms take
    (a vmap rule generated: batched, its collectives run each entry of the batch in turn)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits, target, label_smoothing, ignore_index, group, start, vocab, checked):
        # logits: [N, v] this rank's classes [start, start + v) of the vocab (v may be 0: all padding)
        v_local = logits.shape[-1]
        z = _shifted(logits, group)  # [N, v]
        in_range = (target >= start) & (target < start + v_local)
        local_target = (target - start).masked_fill(~in_range, 0)
        if not checked:  # (compiling, capturing, TP_KERNELS_CHECK_IDS=0) a target out of [0, V), not ignored,
            # which every rank masks, indexes past this rank's classes instead: the gather fails on every
            # rank, as F.cross_entropy's does (a device-side assert on CUDA), where the loss would be wrong
            local_target = local_target.masked_fill(out_of_range(target, vocab, ignore_index), max(v_local, 1))
        # (no class here, a block of padding alone: no target either, gathered from a column of zeros)
        source = z if v_local else z.new_zeros(z.shape[0], 1)
        target_logit = source.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = z.exp()
        # One sum all-reduce: the target's logit (held by one rank), Σ exp(z) and, for
        # smoothing, Σ z over the whole vocabulary. [k, N] -(AR)-> [k, N]
        parts = [target_logit, exp.sum(dim=-1)] + ([z.sum(dim=-1)] if label_smoothing > 0 else [])
        stats = all_reduce_op(torch.stack(parts), group)
        log_z = stats[1].log()
        loss = log_z - stats[0]  # -log softmax(z)[target]
        if label_smoothing > 0:
            # mean over the *global* vocabulary of -log softmax(z)_j = log Z - Σ_j z_j / V
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab)
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(stats[1].unsqueeze(-1))
        return loss, softmax, local_target, in_range, ignored

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # (no zeros of the softmax's size for the outputs after the loss)
        ctx.save_for_backward(*output[1:])
        ctx.label_smoothing, ctx.vocab, ctx.dtype = inputs[2], inputs[6], inputs[0].dtype

    @staticmethod
    @differentiable_once("vocab_parallel_cross_entropy")
    def backward(ctx, dloss, *_):
        softmax, local_target, in_range, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        # d loss / d z_j = softmax_j - (1 - eps) [j == target] - eps / V
        grad = softmax - eps / ctx.vocab if eps > 0 else softmax.clone()
        if grad.shape[-1]:
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, local_target] -= (1.0 - eps) * in_range.to(grad.dtype)
        grad *= dloss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    group=None,
    *,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
    reduction: str = "none",
) -> torch.Tensor:
    """Per-token cross-entropy of logits split along the vocabulary (last dim).

    Equals ``F.cross_entropy(full_logits.reshape(-1, V), target.reshape(-1), reduction="none",
    label_smoothing=label_smoothing, ignore_index=ignore_index)`` reshaped to ``target``'s shape,
    where ``full_logits`` concatenates every rank's block. Smoothing spreads over the global
    vocabulary ``V``. Computed in float32 (float64 logits: in float64); the logits are never
    gathered (two small collectives of ``[N]``-sized statistics: an all-gather of each rank's row
    maxima, then one stacked sum).
    ``torch.compile`` traces it (the collectives are custom ops).

    Args:
        logits: ``[..., V/p]``, this rank's block of the vocabulary; any floating dtype.
        target: ``[...]`` integer class ids in ``[0, V)`` or ``ignore_index`` (loss 0, no gradient).
        label_smoothing: in ``[0, 1]``.
        group: process group (default: the tensor-parallel group).
        ignore_index: the target that stands for no class.
        vocab_size: ``V``, where the blocks are padded (the logits of an output layer whose
            ``out_features`` p does not divide: pass it): each rank's block is ``ceil(V/p)`` wide
            and the columns at or past ``V`` are no class (the loss equals ``F.cross_entropy``'s
            over the ``V`` real columns, whatever the padding holds). Default: the blocks'
            width times p.
        reduction: ``"none"`` (Megatron's: the loss per token), or, as ``F.cross_entropy``'s,
            ``"sum"`` or ``"mean"`` (over the tokens not ignored: NaN where all are).
    Returns:
        ``[...]`` loss per token (a scalar for ``"sum"`` and ``"mean"``), float32 (float64 for
        float64 logits).
    """
    group = coll.resolve_group(group)

    def check() -> Tuple[int, bool]:
        vocab = _check_logits(logits, vocab_size, group)
        check_tensor("target", target)
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise ValueError(f"target: expected an integer tensor of class ids, got {target.dtype}")
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"target: expected shape {tuple(logits.shape[:-1])} (logits' leading dims), got {tuple(target.shape)}"
            )
        if target.device != logits.device:
            raise ValueError(f"target: device {target.device} does not match logits' device {logits.device}")
        if not (isinstance(label_smoothing, (int, float)) and not isinstance(label_smoothing, bool)
                and 0.0 <= label_smoothing <= 1.0):
            raise ValueError(f"label_smoothing: expected a float in [0, 1], got {label_smoothing!r}")
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise ValueError(f"ignore_index: expected an int, got {ignore_index!r}")
        check_choice("reduction", reduction, REDUCTIONS)
        return vocab, check_index_range("target", target, vocab, allowed=ignore_index)

    # ranks whose blocks of the vocabulary differ in width would compute a wrong loss: agreed first
    vocab, checked = agree("vocab_parallel_cross_entropy", group, check,
                           lambda found: f"logits {describe(logits)}, target {describe(target)}, vocabulary "
                                         f"{found[0]}, label_smoothing {label_smoothing}, ignore_index "
                                         f"{ignore_index}, reduction {reduction}", hint=logits)
    classes, start = _classes(logits, vocab, group)
    loss = apply_function(_VocabParallelCrossEntropy, classes, target.reshape(-1), float(label_smoothing),
                          int(ignore_index), group, start, vocab, checked)[0]
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":  # (every rank holds every token's loss: no communication)
        return loss.sum() / (target != ignore_index).sum()
    return loss.reshape(target.shape)


@with_eager_form
class _VocabParallelEntropy(torch.autograd.Function):
    """The entropy and the softmax, in the form ``torch.func``'s transforms take."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits, group):
        z = _shifted(logits, group)  # [N, v]
        exp = z.exp()
        exp_z = torch.where(exp == 0, 0.0, exp * z)  # a -inf logit (masked, padding) adds 0, not NaN
        # One sum all-reduce of Σ exp(z) and Σ exp(z) z over the whole vocabulary: [2, N] -(AR)-> [2, N]
        stats = all_reduce_op(torch.stack([exp.sum(dim=-1), exp_z.sum(dim=-1)]), group)
        entropy = stats[0].log() - stats[1] / stats[0]  # log Z - E[z]
        softmax = exp.div_(stats[0].unsqueeze(-1))
        return entropy, softmax

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # (no zeros of the softmax's size for it)
        ctx.save_for_backward(output[1], output[0])
        ctx.dtype = inputs[0].dtype

    @staticmethod
    @differentiable_once("vocab_parallel_entropy")
    def backward(ctx, dentropy, _):
        softmax, entropy = ctx.saved_tensors
        # d H / d z_j = p_j (E[z] - z_j) = -p_j (H + log p_j): local, no communication
        grad = -(softmax * entropy.unsqueeze(-1) + torch.xlogy(softmax, softmax))
        return (grad * dentropy.unsqueeze(-1)).to(ctx.dtype), None


def vocab_parallel_entropy(logits: torch.Tensor, group=None, *, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token entropy of the softmax of logits split along the vocabulary (last dim):
    ``-Σ_j softmax(full_logits)_j log softmax(full_logits)_j``, where ``full_logits`` concatenates
    every rank's block, as reinforcement-learning losses regularize a policy with, computed without
    gathering the logits (an all-gather of the row maxima, then one stacked sum of ``[2, N]``);
    differentiable, its backward local. Computed in float32 (float64 logits: in float64). (The
    log-probability of a token is ``-vocab_parallel_cross_entropy`` without smoothing.)

    Args:
        logits: ``[..., V/p]``, this rank's block of the vocabulary; any floating dtype.
        group: process group (default: the tensor-parallel group).
        vocab_size: ``V``, where the blocks are padded, as for :func:`vocab_parallel_cross_entropy`:
            the columns at or past it are left out.
    Returns:
        ``[...]`` entropy per token, float32 (float64 for float64 logits).
    """
    group = coll.resolve_group(group)
    vocab = agree("vocab_parallel_entropy", group, lambda: _check_logits(logits, vocab_size, group),
                  lambda vocab: f"logits {describe(logits)}, vocabulary {vocab}", hint=logits)
    classes, _ = _classes(logits, vocab, group)
    return apply_function(_VocabParallelEntropy, classes, group)[0].reshape(logits.shape[:-1])


def vocab_parallel_argmax(logits: torch.Tensor, group=None, *, vocab_size: Optional[int] = None) -> torch.Tensor:
    """The index of the largest logit over the full vocabulary, per token, on every rank: the
    greedy choice of a decoder, without gathering the logits (``[..., V/p]`` -> ``[...]``, int64).
    Equals ``torch.argmax(full_logits, -1)``: the first of equal maxima, the first NaN of a row that
    has one. One all-gather of each rank's ``[2, N]`` candidates (value, index), where gathering the
    logits to pick from them moves ``[N, V/p]`` per rank. Not differentiable.

    Args:
        logits: ``[..., V/p]``, this rank's block of the vocabulary; any floating dtype.
        group: process group (default: the tensor-parallel group).
        vocab_size: ``V``, where the blocks are padded, as for :func:`vocab_parallel_cross_entropy`.
    """
    group = coll.resolve_group(group)
    vocab = agree("vocab_parallel_argmax", group, lambda: _check_logits(logits, vocab_size, group),
                  lambda vocab: f"logits {describe(logits)}, vocabulary {vocab}", hint=logits)
    classes, start = _classes(logits.detach(), vocab, group)  # [N, v]
    return _first_max(classes, start, vocab, group).reshape(logits.shape[:-1])


def vocab_parallel_sample(logits: torch.Tensor, group=None, *, temperature: Union[float, torch.Tensor] = 1.0,
                          generator: Optional[torch.Generator] = None,
                          vocab_size: Optional[int] = None) -> torch.Tensor:
    """A token drawn from ``softmax(full_logits / temperature)`` per row, the same on every rank,
    without gathering the logits (``[..., V/p]`` -> ``[...]``, int64): each rank adds Gumbel noise
    to its block, ``-log(E)`` with ``E`` exponential, and the largest noisy logit over the whole
    vocabulary, found as :func:`vocab_parallel_argmax` finds the largest logit (one all-gather of
    ``[2, N]``), is a sample (the Gumbel-max trick). Not differentiable.

    The noise of different ranks must be independent: by default each rank draws it from its own
    model-parallel stream (:mod:`tp_kernels.rng`, seeded by
    :func:`tp_kernels.model_parallel_manual_seed`, which must have been called), so a run seeded alike
    samples alike. A ``generator`` given instead (on the logits' device) must differ between the
    ranks, e.g. seeded ``seed + rank``: the same noise on every rank would not sample from the
    softmax. ``temperature=0`` is the argmax. A tensor of temperatures, one per row (the requests of
    a serving batch, each its own), samples each row at its own; a row at 0 takes its argmax. The
    noise is drawn in float32 (float64 for float64 logits), for every row whatever its temperature;
    a ``-inf`` logit (a masked class, the padding) is never drawn.

    Args:
        logits: ``[..., V/p]``, this rank's block of the vocabulary; any floating dtype.
        group: process group (default: the tensor-parallel group).
        temperature: a finite number ``>= 0``, or a floating tensor of them shaped ``logits.shape[:-1]``
            on the logits' device (checked on the host: one synchronization).
        generator: where the noise comes from (see above).
        vocab_size: ``V``, where the blocks are padded, as for :func:`vocab_parallel_cross_entropy`.
    """
    group = coll.resolve_group(group)

    per_row = isinstance(temperature, torch.Tensor)

    def check() -> int:
        vocab = _check_logits(logits, vocab_size, group)
        if per_row:
            if (temperature.shape != logits.shape[:-1] or not temperature.is_floating_point()
                    or temperature.device != logits.device):
                raise ValueError(f"temperature: expected a floating tensor of the rows' shape "
                                 f"{list(logits.shape[:-1])} on {logits.device}, got {describe(temperature)}")
            if not bool((torch.isfinite(temperature) & (temperature >= 0)).all()):
                raise ValueError("temperature: expected finite numbers >= 0, got a negative, NaN or infinite one")
        elif (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not 0 <= temperature < float("inf")):
            raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
        if generator is not None:
            if not isinstance(generator, torch.Generator):
                raise ValueError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
            if generator.device.type != logits.device.type:
                raise ValueError(f"generator: on {generator.device}, not on the logits' device {logits.device}")
        elif (per_row or temperature) and rng.MODEL_PARALLEL_RNG not in rng.get_rng_tracker().seeds():
            raise ValueError("generator: none given, and no model-parallel stream to draw the noise from: call "
                             "tp_kernels.model_parallel_manual_seed(seed) first, or pass a generator of each "
                             "rank's own")
        return vocab

    vocab = agree("vocab_parallel_sample", group, check,
                  lambda vocab: f"logits {describe(logits)}, vocabulary {vocab}, temperature "
                                f"{describe(temperature) if per_row else temperature}",
                  hint=logits)
    if not per_row and temperature == 0:
        return vocab_parallel_argmax(logits, group, vocab_size=vocab_size)
    classes, start = _classes(logits.detach(), vocab, group)  # [N, v]
    z = classes.to(torch.promote_types(classes.dtype, torch.float32))
    with rng.get_rng_tracker().fork() if generator is None else contextlib.nullcontext():
        noise = torch.empty_like(z).exponential_(generator=generator)
    if not per_row:
        return _first_max(z / temperature - noise.log(), start, vocab, group).reshape(logits.shape[:-1])
    t = temperature.reshape(-1, 1).to(z.dtype)
    sampled = t > 0  # (a row at 0: its logits as they are, the argmax)
    noisy = torch.where(sampled, z / torch.where(sampled, t, 1.0) - noise.log(), z)
    return _first_max(noisy, start, vocab, group).reshape(logits.shape[:-1])


def vocab_parallel_topk(logits: torch.Tensor, k: int, group=None, *,
                        vocab_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits over the full vocabulary and their indices, per token, largest
    first, on every rank: ``torch.topk(full_logits, k)`` (``[..., V/p]`` -> ``[..., k]`` values in
    the logits' dtype, int64 indices), as top-k sampling needs, without gathering the logits: each
    rank's own top ``k`` candidates, ``[2, N, k]``, in one all-gather. The values are torch's;
    equal values come by ascending index (torch's order among them is unspecified). NaN counts as
    the largest, as in torch. Each rank's candidates come from two ``topk`` over its block, not a
    sort of it. Not differentiable.

    Args:
        logits: ``[..., V/p]``, this rank's block of the vocabulary; any floating dtype.
        k: how many, ``1 <= k <= V``.
        group: process group (default: the tensor-parallel group).
        vocab_size: ``V``, where the blocks are padded, as for :func:`vocab_parallel_cross_entropy`.
    """
    group = coll.resolve_group(group)

    def check() -> int:
        vocab = _check_logits(logits, vocab_size, group)
        check_int("k", k)
        if k > vocab:
            raise ValueError(f"k: expected at most the vocabulary's {vocab} classes, got {k}")
        return vocab

    vocab = agree("vocab_parallel_topk", group, check,
                  lambda vocab: f"logits {describe(logits)}, vocabulary {vocab}, k {k}", hint=logits)
    classes, start = _classes(logits.detach(), vocab, group)  # [N, v]
    value, index = _top_of_block(classes, k)
    values, indices = _merge_candidates(value, index + start, k, vocab, group)
    shape = (*logits.shape[:-1], k)
    return values.to(logits.dtype).reshape(shape), indices.reshape(shape)


def _top_of_block(classes: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``min(k, v)`` candidates of ``classes`` ``[N, v]`` and their indices in it,
    largest first, equal values by ascending index, NaN first: what a stable descending sort
    gives first, without sorting the block. ``torch.topk`` finds the smallest value taken, ``t``
    (its order among equal values is unspecified); every value above ``t`` is taken, and of those
    equal to ``t`` the first by index, picked by a second ``topk`` over keys that rank them so; only
    the ``min(k, v)`` taken are sorted."""
    n, v = classes.shape
    m = min(k, v)
    if m in (0, v):
        value, index = torch.sort(classes, dim=-1, descending=True, stable=True)
        return value[:, :m], index[:, :m]
    t = torch.topk(classes, m, dim=-1).values[:, -1:]  # NaN is the largest, as in torch
    nan, t_nan = classes.isnan(), t.isnan()
    above = (classes > t) | (nan & ~t_nan)  # fewer than m
    tie = (classes == t) | (nan & t_nan)
    first = torch.arange(v, 0, -1, device=classes.device, dtype=torch.int32)  # v .. 1: the lower index, the larger
    key = torch.where(above, v + 1, torch.where(tie, first, 0))
    index = torch.topk(key, m, dim=-1).indices.sort(dim=-1).values  # the m taken, by index
    value = classes.gather(-1, index)
    order = torch.sort(value, dim=-1, descending=True, stable=True).indices
    return value.gather(-1, order), index.gather(-1, order)


def _first_max(scores: torch.Tensor, start: int, vocab: int, group) -> torch.Tensor:
    """The index in the vocabulary of the largest of every rank's ``scores`` ``[N, v]`` (its classes
    ``[start, start + v)``), ``[N]``: the first of equal maxima, or the first NaN, as torch.argmax."""
    if scores.shape[-1]:  # this rank's candidate
        value, index = scores.max(dim=-1, keepdim=True)
    else:  # a block of padding alone: none
        value, index = scores, scores.new_empty(scores.shape, dtype=torch.int64)
    return _merge_candidates(value, index + start, 1, vocab, group)[1][:, 0]


def _merge_candidates(value: torch.Tensor, index: torch.Tensor, k: int, vocab: int, group):
    """The ``k`` largest of every rank's candidates, ``(values [N, k] float64, indices [N, k]
    int64)``, largest first, equal values by ascending index, NaN first (as torch takes it).
    ``value`` and ``index`` ``[N, c]``: this rank's ``c <= k`` candidates and their indices in the
    vocabulary, largest first, equal values by ascending index."""
    missing = k - value.shape[-1]  # (a block narrower than k: filled with candidates no row picks first)
    fill = value.new_full((value.shape[0], missing), float("-inf"), dtype=torch.float64)
    value = torch.cat([value.double(), fill], -1)
    index = torch.cat([index, index.new_full((index.shape[0], missing), vocab)], -1).double()
    # [1, 2, N, k] -(AG)-> [p, 2, N, k], exact in float64: the values of any dtype, indices below 2^53
    both = all_gather_op(torch.stack([value, index]).unsqueeze(0), group)
    values = both[:, 0].permute(1, 0, 2).reshape(value.shape[0], -1)  # [N, p*k], rank-major: ascending index
    indices = both[:, 1].permute(1, 0, 2).reshape(value.shape[0], -1)
    # a filler never before a class of the same value (-inf): the classes first, then a stable sort by value
    real_first = torch.sort((indices >= vocab).to(torch.int8), dim=-1, stable=True).indices
    values, indices = values.gather(-1, real_first), indices.gather(-1, real_first)
    at = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
    return values.gather(-1, at), indices.gather(-1, at).to(torch.int64)


def _check_logits(logits, vocab_size, group) -> int:
    """The vocabulary ``V`` of ``logits`` ``[..., V/p]`` (``vocab_size`` where given, checked against
    the blocks' width), raising ``ValueError`` naming the argument."""
    check_tensor("logits", logits, min_dim=1)
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point tensor, got {logits.dtype}")
    p = coll.group_size(group)
    if vocab_size is None:
        return logits.shape[-1] * p
    check_int("vocab_size", vocab_size)
    width = split_block(vocab_size, p, 0)[0]
    if width != logits.shape[-1]:
        raise ValueError(f"vocab_size: {vocab_size} classes make blocks {width} wide on {p} ranks "
                         f"(ceil(V/p)), but logits' blocks are {logits.shape[-1]} wide")
    return vocab_size


def _classes(logits: torch.Tensor, vocab: int, group):
    """``(classes, start)``: this rank's logits as ``[N, v]``, its classes ``[start, start + v)``
    of the vocabulary, without the padding of its block."""
    width, padding = split_block(vocab, coll.group_size(group), coll.group_rank(group))
    return logits.reshape(-1, width).narrow(-1, 0, width - padding), coll.group_rank(group) * width
