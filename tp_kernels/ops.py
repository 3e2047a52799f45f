"""The three tensor-parallel primitives, differentiable, on any backend.

With ``p`` ranks in ``group`` and dim 0 gathered/scattered rank-major (or the dim ``gather_dim`` /
``scatter_dim`` names: a batch-first ``[b, s/p, k]``'s 1, its blocks stacked along dim 0):

=========================  =====================  ==========================================
op                         math                   shapes (leading dims after the first kept)
=========================  =====================  ==========================================
``all_gather_matmul``      ``AG(x) Wᵀ + b``       x ``[m/p, ..., k]``, W ``[n/p, k]`` → ``[m, ..., n/p]``
``matmul_reduce_scatter``  ``RS(x Wᵀ) + b``       x ``[m, ..., k/p]``, W ``[n, k/p]`` → ``[m/p, ..., n]``
``matmul_all_reduce``      ``AR(x Wᵀ) + b``       x ``[..., k/p]``, W ``[n, k/p]`` → ``[..., n]``
=========================  =====================  ==========================================

The backward passes are made of the same primitives (docs/architecture.md):

* ``all_gather_matmul``: ``dx = matmul_reduce_scatter(dy, Wᵀ)``; ``dW = dyᵀ AG(x)``, with
  ``AG(x)`` re-gathered (only the shard is saved) while ``dx`` multiplies.
* ``matmul_reduce_scatter``: ``dx = all_gather_matmul(dy, Wᵀ)``, which also yields ``AG(dy)``
  for ``dW = AG(dy)ᵀ x`` and ``db = Σ AG(dy)`` (so the bias gradient is complete).
* ``matmul_all_reduce``: local GEMMs (``dy`` is replicated).

``backend`` is ``"reference"`` (collective, then GEMM), ``"pipelined"`` (chunked overlap,
:mod:`tp_kernels.schedule`), ``"fused"`` (peer memory inside one node,
:mod:`tp_kernels.backends.fused`) or ``"auto"``; what runs is decided once per call
(:func:`tp_kernels.dispatch.resolve`; :func:`select_backend` answers the same question).
``num_chunks=None`` takes the schedule's default. Every argument is checked, and the call agreed
with the group's other ranks (:mod:`tp_kernels._agreement`), before any collective starts.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import _collectives as coll
from . import _library
from ._agreement import agree, describe
from ._checks import check_choice, check_divisible, check_linear_args, check_split_dim, functorch_transforms, wants_grad
from ._op_table import OPS
from .dispatch import check_runnable, resolve, select_backend
from .schedule import resolve_num_chunks
from .settings import BACKEND_NAMES, deciding

__all__ = [
    "BACKEND_NAMES",
    "all_gather_matmul",
    "linear_with_grad_all_reduce",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "select_backend",
]


def _out_lead(op: str, x_shape, p: int) -> list:
    """The leading dims of ``op``'s output for an input of ``x_shape`` (dim 0 gathered or
    scattered)."""
    lead = list(x_shape[:-1])
    if op == "all_gather_matmul":
        lead[0] *= p
    elif op == "matmul_reduce_scatter":
        lead[0] //= p
    return lead


def run(op: str, x, weight, bias, group, backend: str, num_chunks: Optional[int], x_name: str = "x",
        prepare: Optional[Callable] = None, dim=0, dim_name: str = "dim",
        about: Optional[Callable[[], str]] = None) -> torch.Tensor:
    """Check the tensors (errors name the input ``x_name``) and agree on the call with the group
    (:func:`tp_kernels._agreement.agree`) before any communication, decide the implementation once
    (:func:`tp_kernels.dispatch.resolve`), run ``torch.ops.tp_kernels.<op>``
    (:func:`tp_kernels._library.op`) on the input as 2-D ``[rows, k]`` and restore its leading
    dims. ``group`` was resolved by the caller; ``prepare(x)``, the caller's own checks (of
    ``backend`` and ``num_chunks`` by the public ops below; the layers check theirs once, when
    they are made) and preparation of ``x``, runs first, in the agreement too. ``dim`` (checked as
    the argument ``dim_name``): the dim of ``x`` gathered or scattered, when not 0. The op runs on
    rows that are the blocks of that dim stacked rank-major: a gathered shard as it is, its output's
    blocks then joined along ``dim`` (:func:`tp_kernels._collectives.join_blocks`); a scattered
    input's blocks stacked first (:func:`tp_kernels._collectives.blocks_first`), the output this
    rank's block as it comes. One copy either way (none when the dims before ``dim`` are all 1), and
    one of the gradient in the backward. ``about()``: the caller as the ranks must agree on it too (a
    layer's configuration), asked for the fingerprint only."""

    p = coll.group_size(group)

    def check():
        x_ = prepare(x) if prepare is not None else x
        checked = check_linear_args(x_, weight, bias, x_name=x_name, min_dim=OPS[op].min_dim)
        d = check_split_dim(dim_name, dim, checked[0], x_name)
        if op == "matmul_reduce_scatter":
            check_divisible(f"{x_name}.shape[{d}]", checked[0].shape[d], p)
        return (*checked, d)

    if p == 1:
        # one rank: nothing to agree on, gather, scatter or overlap. The op is the linear layer
        # itself, as nn.Linear is, on every backend (differentiable to any order; to torch.compile,
        # an aten node it may fuse), once the arguments are checked and a named backend that
        # cannot run the call has said so (auto says why at debug level). Torch's GEMM, not the
        # native one: on an H200 the pipelined call at m = 16 took 0.159 ms where F.linear took
        # 0.137, and 18.6 us more host time (docs/benchmarks.md)
        coll.check_alive(group)
        x, weight, bias, _ = check()
        if backend != "reference":  # (with one rank resolve reads x's device, dtype and size alone: any dims)
            resolve(op, backend, x, p, group, weight, bias, num_chunks)
        return F.linear(x, weight, bias)

    def fingerprint(checked) -> str:
        x_, w, b, d = checked
        return ((f"{about()}, " if about is not None else "") +
                f"{x_name} {describe(x_)}, weight {describe(w)}, bias {describe(b)}, backend {backend}, "
                f"num_chunks {num_chunks}" + (f", {dim_name} {d}" if d else "") + deciding(backend))

    x, weight, bias, dim = agree(op, group, check, fingerprint, hint=x)
    if not OPS[op].forward_communicates and not functorch_transforms() and not wants_grad((x, weight, bias)):
        # a forward that communicates nothing, whose backward is not recorded (no_grad, inference:
        # a decode step's column layers): the local GEMM itself, as with one rank, without the op,
        # once a backend named that cannot run the call has said so (nothing to decide or measure)
        check_runnable(op, backend, x, p, group, weight)
        return F.linear(x, weight, bias)
    # the op's rows, rank-major along dim 0: a gathered shard is one block as it is; the p blocks
    # of a scattered dim are stacked first
    lead = coll.blocks_first(x, dim, p) if op == "matmul_reduce_scatter" else x
    # 2-D as it is: a reshape costs ~2 µs of host time
    x2d = lead if lead.dim() == 2 else lead.reshape(-1, lead.shape[-1])
    impl = resolve(op, backend, x2d, p, group, weight, bias, num_chunks)  # (raises where the backend cannot run)
    out = _library.op(op)(x2d, weight, bias, coll.group_name(group), impl)
    if x2d is x:
        return out
    shape = (*_out_lead(op, lead.shape, p), weight.shape[0])
    # not a view of the 2-D result, which is ours alone (FSDP2 warns of a module whose output is a
    # view, as a language model's head's is)
    out = coll.UNSAFE_VIEW(out, shape) if out.is_contiguous() else out.reshape(shape)
    return coll.join_blocks(out, dim, p) if op == "all_gather_matmul" else out


def _public(op: str, x, weight, bias, group, backend, num_chunks, dim=0, dim_name: str = "dim") -> torch.Tensor:
    """A public op's call: :func:`run`, its options checked with its tensors (where they need it: a
    backend of :data:`BACKEND_NAMES` and the default chunks need none, and a good call's host time is
    three function calls less)."""
    group = coll.resolve_group(group)

    def check_options(x):
        check_choice("backend", backend, BACKEND_NAMES)
        resolve_num_chunks(OPS[op].primitive, num_chunks)  # validates
        return x

    prepare = None if num_chunks is None and backend in BACKEND_NAMES else check_options
    return run(op, x, weight, bias, group, backend, num_chunks, prepare=prepare, dim=dim, dim_name=dim_name)


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    backend: str = "auto",
    num_chunks: Optional[int] = None,
    gather_dim: int = 0,
) -> torch.Tensor:
    """``Y = AG(X) Wᵀ + b``: all-gather dim 0, then multiply by this rank's weight shard.

    Args:
        x: ``[m/p, ..., k]``, this rank's block of dim 0 (rank-major).
        weight: ``[n/p, k]``, this rank's rows of the full ``[n, k]`` weight.
        bias: ``[n/p]`` or None.
        gather_dim: the dim of ``x`` to gather, if not 0 (any but the last; ``[b, s/p, k]`` →
            ``[b, s, n/p]`` with 1): the GEMMs run on ``x`` as it is, and the gathered blocks of
            the output are joined along that dim, a copy unless the dims before it are all 1.
    Returns:
        ``[m, ..., n/p]``.
    """
    return _public("all_gather_matmul", x, weight, bias, group, backend, num_chunks, gather_dim, "gather_dim")


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    backend: str = "auto",
    num_chunks: Optional[int] = None,
    scatter_dim: int = 0,
) -> torch.Tensor:
    """``Y = RS(X Wᵀ) + b``: multiply by this rank's input-dim shard, reduce-scatter dim 0.

    Args:
        x: ``[m, ..., k/p]``, this rank's block of the last dim; ``m`` divisible by p.
        weight: ``[n, k/p]``, this rank's columns of the full ``[n, k]`` weight.
        bias: ``[n]`` (full) or None; added once, after the reduction.
        scatter_dim: the dim of the output to scatter, if not 0 (any but the last; ``[b, s, k/p]``
            → ``[b, s/p, n]`` with 1), its size divisible by p: the GEMMs run on ``x`` with the
            blocks of that dim stacked first, a copy unless the dims before it are all 1; the
            output is this rank's block as it comes.
    Returns:
        ``[m/p, ..., n]``: rows ``[r*m/p, (r+1)*m/p)`` of dim 0 on rank r.
    """
    return _public("matmul_reduce_scatter", x, weight, bias, group, backend, num_chunks, scatter_dim, "scatter_dim")


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    backend: str = "auto",
    num_chunks: Optional[int] = None,
) -> torch.Tensor:
    """``Y = AR(X Wᵀ) + b``: multiply by this rank's input-dim shard, all-reduce (sum).

    Args:
        x: ``[..., k/p]``, this rank's block of the last dim.
        weight: ``[n, k/p]``, this rank's columns of the full ``[n, k]`` weight.
        bias: ``[n]`` (full) or None; added once, after the reduction.
    Returns:
        ``[..., n]``, the same on every rank.
    """
    return _public("matmul_all_reduce", x, weight, bias, group, backend, num_chunks)


def linear_with_grad_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    backend: str = "auto",
    num_chunks: Optional[int] = None,
) -> torch.Tensor:
    """``Y = X Wᵀ + b`` locally, with ``dX`` all-reduced in backward (column-parallel, no SP).

    Args:
        x: ``[..., k]``, replicated on every rank.
        weight: ``[n/p, k]``; bias: ``[n/p]`` or None.
    Returns:
        ``[..., n/p]``. Backward: ``dX = matmul_all_reduce(dY, W)``, ``dW`` computed meanwhile.
    """
    return _public("linear_with_grad_all_reduce", x, weight, bias, group, backend, num_chunks)
