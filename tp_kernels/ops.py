"""The three tensor-parallel primitives, differentiable, on any backend.

With ``p`` ranks in ``group`` and dim 0 gathered/scattered rank-major:

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
:mod:`tp_kernels.backends.fused`) or ``"auto"`` (see :func:`select_backend`). ``num_chunks=None`` takes the schedule's default.
Every argument is checked before any collective starts.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from . import _comm, _library, autotune  # noqa: F401  (_library registers torch.ops.tp_kernels.*)
from ._checks import check_divisible, check_linear_args
from ._library import group_name
from .backends import BACKENDS, fused, native
from .schedule import resolve_num_chunks

__all__ = [
    "BACKEND_NAMES",
    "all_gather_matmul",
    "linear_with_grad_all_reduce",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "select_backend",
]

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto",) + tuple(BACKENDS)


def check_backend(backend) -> str:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKEND_NAMES))}, got {backend!r}")
    return backend


def select_backend(op: str, backend: str, x: torch.Tensor, p: int, group=None,
                   weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                   num_chunks: Optional[int] = None) -> str:
    """The implementation that runs ``op`` for this call (a key of
    ``backends.IMPLEMENTATIONS``), resolving ``"pipelined"``, ``"fused"`` and ``"auto"``.

    * ``"pipelined"`` runs the native extension (``"native"``: cuBLASLt and NCCL, the same chunk
      schedule) for CUDA tensors it supports, else the portable schedule on
      ``torch.distributed``; the reason is logged at debug level.
    * ``"fused"`` runs over peer memory (:mod:`tp_kernels.backends.fused`) and raises a
      ``ValueError`` with the reason where it cannot (host tensors, a group across nodes or
      without peer access, no native extension): it has no portable form to fall back on.
    * ``"auto"`` chooses among the backends allowed for it that can run the call
      (:func:`tp_kernels.autotune.candidates`; by default the reference, plus the fused and
      native paths where ``TP_KERNELS_AUTO_FUSED``/``TP_KERNELS_AUTO_NATIVE`` switch them on),
      measuring them on the first call of each shape class when there are several
      (:func:`tp_kernels.autotune.choose`); with one rank it runs the reference. It says why
      at debug level. ``op`` is the public op (``linear_with_grad_all_reduce`` is measured by
      its backward's all-reduce); ``bias`` and ``num_chunks`` are the call's, for measuring.

    Every input of the decision is the same on all ranks of the group, so they all decide alike
    (the first fused call of a group checks its peer access collectively; a measurement agrees
    the figures across the ranks).
    """
    check_backend(backend)
    if backend == "reference":
        return backend
    w = x if weight is None else weight
    if backend == "fused":
        reason = fused.unsupported_reason(x, w, group)
        if reason is not None:
            raise ValueError(f"backend: 'fused' cannot run {op} (p={p}, x {tuple(x.shape)} {x.dtype} on "
                             f"{x.device}): {reason}. Use 'pipelined' or 'auto' there.")
        return "fused"
    if backend == "pipelined":
        reason = native.unsupported_reason(x, w, group)
        if reason is None:
            return "native"
        if x.is_cuda:
            logger.debug("pipelined %s (p=%d, x %s %s): the portable schedule, not the native one: %s", op, p,
                         tuple(x.shape), x.dtype, reason)
        return "pipelined"
    impls, why = autotune.candidates(x, w, group, p)
    if why and logger.isEnabledFor(logging.DEBUG):
        logger.debug("auto backend for %s (p=%d, x %s %s on %s): candidates %s; left out: %s", op, p,
                     tuple(x.shape), x.dtype, x.device.type, impls, "; ".join(why))
    if len(impls) == 1:
        return impls[0]
    chunks = resolve_num_chunks(_OPS[op][0] if op in _OPS else op, num_chunks)
    return autotune.choose(op, impls, x, w, bias, group, chunks)


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


#: op -> (the schedule entry giving its chunk default, the fewest input dims it accepts)
_OPS = {
    "all_gather_matmul": ("all_gather_matmul", 2),
    "matmul_reduce_scatter": ("matmul_reduce_scatter", 2),
    "matmul_all_reduce": ("matmul_all_reduce", 1),
    "linear_with_grad_all_reduce": ("matmul_all_reduce", 1),
}


def _run(op: str, x, weight, bias=None, *, group=None, backend: str = "auto", num_chunks=None,
         x_name: str = "x") -> torch.Tensor:
    """Check every argument (before any communication; errors name the input ``x_name``), pick
    the backend, run ``torch.ops.tp_kernels.<op>`` on the flattened input and restore its leading
    dims. The public ops and the layers both come through here."""
    schedule_op, min_dim = _OPS[op]
    group = _comm.resolve_group(group)
    check_backend(backend)
    num_chunks = resolve_num_chunks(schedule_op, num_chunks)
    x, weight, bias = check_linear_args(x, weight, bias, x_name=x_name, min_dim=min_dim)
    p = _comm.group_size(group)
    lead = list(x.shape[:-1])
    if op == "all_gather_matmul":
        lead[0] *= p
    elif op == "matmul_reduce_scatter":
        lead[0] = check_divisible(f"{x_name}.shape[0]", x.shape[0], p)
    x2d = _flatten(x)
    impl = select_backend(op, backend, x2d, p, group, weight, bias, num_chunks)
    out = getattr(torch.ops.tp_kernels, op)(x2d, weight, bias, group_name(group), impl, num_chunks)
    return out.reshape(*lead, weight.shape[0])


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    backend: str = "auto",
    num_chunks: Optional[int] = None,
) -> torch.Tensor:
    """``Y = AG(X) Wᵀ + b``: all-gather dim 0, then multiply by this rank's weight shard.

    Args:
        x: ``[m/p, ..., k]``, this rank's block of dim 0 (rank-major).
        weight: ``[n/p, k]``, this rank's rows of the full ``[n, k]`` weight.
        bias: ``[n/p]`` or None.
    Returns:
        ``[m, ..., n/p]``.
    """
    return _run("all_gather_matmul", x, weight, bias, group=group, backend=backend, num_chunks=num_chunks)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    backend: str = "auto",
    num_chunks: Optional[int] = None,
) -> torch.Tensor:
    """``Y = RS(X Wᵀ) + b``: multiply by this rank's input-dim shard, reduce-scatter dim 0.

    Args:
        x: ``[m, ..., k/p]``, this rank's block of the last dim; ``m`` divisible by p.
        weight: ``[n, k/p]``, this rank's columns of the full ``[n, k]`` weight.
        bias: ``[n]`` (full) or None; added once, after the reduction.
    Returns:
        ``[m/p, ..., n]``: rows ``[r*m/p, (r+1)*m/p)`` of dim 0 on rank r.
    """
    return _run("matmul_reduce_scatter", x, weight, bias, group=group, backend=backend, num_chunks=num_chunks)


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
    return _run("matmul_all_reduce", x, weight, bias, group=group, backend=backend, num_chunks=num_chunks)


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
    return _run("linear_with_grad_all_reduce", x, weight, bias, group=group, backend=backend, num_chunks=num_chunks)
