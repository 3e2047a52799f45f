"""Implementations of the three primitives behind one interface, and the names that pick them.

Each implementation module provides, on 2-D tensors and without autograd, for an
:class:`Impl` (the resolved choice: implementation, chunks, algorithm):

* ``all_gather_matmul(x, weight, bias, group, impl) -> (out, gathered_x)``
  ``(m/p, k) -(AG)-> (m, k) x (k, n/p) -> (m, n/p)``; ``gathered_x`` is ``AG(x)``.
* ``matmul_reduce_scatter(x, weight, bias, group, impl) -> Pending``
  ``(m, k/p) x (k/p, n) -(RS)-> (m/p, n)``, bias added once after the reduction.
* ``matmul_all_reduce(x, weight, bias, group, impl) -> Pending``
  ``(m, k/p) x (k/p, n) -(AR)-> (m, n)``, bias added once after the reduction.

``weight`` is ``(n_out, k)`` as in ``F.linear`` and may be a transposed view. The reductions
return a :class:`tp_kernels._collectives.Pending` so that callers can overlap unrelated work
(the weight gradient) with the tail of the communication before calling ``wait()``.

The plain collectives of :class:`tp_kernels.Communicator` (``_op_table.COLLECTIVES``) take
``(x, out, peer, group, impl)`` (contiguous tensors, dim 0 gathered or scattered; ``peer`` the
root, destination or source; None for a tensor the rank does not have) and return the output.
``reference`` runs them all on ``torch.distributed``, ``native`` all on the group's NCCL
communicator, ``fused`` the all-reduce only (``"fused:<algorithm>"``); :func:`run_collective`
calls them, and :func:`prepare_capture` makes beforehand what a CUDA graph capture cannot.

The implementation to run is decided once per call, before it
(:func:`tp_kernels.dispatch.select_backend`, which also asks each module's
``unsupported_reason``); its name travels down with the call (the custom ops carry it) and
nothing here checks or decides again. Names: ``"reference"``; ``"pipelined:<chunks>"`` (the
portable schedule); ``"native:<chunks>"`` (the same schedule in the native extension, what
``backend="pipelined"`` runs on CUDA); ``"fused:<chunks>"`` (all-gather and reduce-scatter over
peer memory) and ``"fused:<algorithm>"`` (its all-reduce, e.g. ``"fused:two_shot"``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from .. import _collectives as coll, _extension
from ..schedule import DEFAULT_NUM_CHUNKS
from . import fused, peer_memory, pipelined, pipelined_native, reference

__all__ = ["IMPLEMENTATIONS", "Impl", "backward_name", "impl_name", "parse", "prepare_capture", "run",
           "run_collective"]

#: implementation name -> module
IMPLEMENTATIONS = {"reference": reference, "pipelined": pipelined, "native": pipelined_native, "fused": fused}


@dataclasses.dataclass(frozen=True)
class Impl:
    """A resolved implementation: which module runs, in how many chunks, by which algorithm
    (the fused all-reduce's)."""

    backend: str
    num_chunks: int = 1
    algorithm: Optional[str] = None

    @property
    def name(self) -> str:
        if self.backend == "reference":
            return "reference"
        return f"{self.backend}:{self.algorithm or self.num_chunks}"

    @property
    def module(self):
        return IMPLEMENTATIONS[self.backend]


@functools.lru_cache(maxsize=1024)
def impl_name(backend: str, num_chunks: int = 1, algorithm: Optional[str] = None) -> str:
    """``Impl(backend, num_chunks, algorithm).name``, remembered (making the frozen dataclass costs
    about 1 µs of host time a call)."""
    return Impl(backend, num_chunks, algorithm).name


@functools.lru_cache(maxsize=None)
def parse(name: str) -> Impl:
    """The :class:`Impl` an implementation name stands for; ``ValueError`` naming ``impl`` for a
    name that none does."""
    backend, _, param = name.partition(":")
    bad = ValueError(f"impl: expected 'reference', 'pipelined:<chunks>', 'native:<chunks>', 'fused:<chunks>' or "
                     f"'fused:<algorithm>', got {name!r}")
    if backend == "reference":
        if param:
            raise bad
        return Impl("reference")
    if backend not in IMPLEMENTATIONS or not param:
        raise bad
    if param.isdigit() and int(param) > 0:
        return Impl(backend, num_chunks=int(param))
    if backend == "fused":
        reason = _extension.unavailable()  # (the algorithms are the native module's list)
        if reason is not None:
            raise ValueError(f"impl: {name!r} names an all-reduce algorithm of the fused path: {reason}")
        if param in fused.algorithms():
            return Impl(backend, algorithm=param)
    raise bad


@functools.lru_cache(maxsize=None)
def backward_name(name: str, primitive: str) -> str:
    """The implementation that ``primitive``, the backward of a call whose forward ran on ``name``,
    runs on: the all-gather + GEMM of a reduce-scatter's backward, the GEMM + reduce-scatter of an
    all-gather's. The forward's backend, in ``primitive``'s own chunks (``DEFAULT_NUM_CHUNKS``): the
    forward's count splits another GEMM. A reduce-scatter's 4 chunks would cut its backward's ring
    into p × 4 GEMMs of m/(4p) rows (on an H100, [256 × 8192] × [8192 × 1024] ran at 137 TFLOP/s,
    the whole [8192 × 8192] × [8192 × 1024] at 662), and an all-gather's one piece a shard would
    leave its backward's reduce-scatter in one piece, nothing overlapped."""
    impl = parse(name)
    if impl.backend == "reference" or impl.algorithm is not None:
        return name
    return impl_name(impl.backend, DEFAULT_NUM_CHUNKS[primitive])


def run(primitive: str, name: str, x, weight, bias, group):
    """Primitive ``primitive`` on the implementation named ``name`` (see the module doc)."""
    impl = parse(name)
    return getattr(impl.module, primitive)(x, weight, bias, group, impl)


def run_collective(collective: str, name: str, x, out, peer: int, group):
    """Collective ``collective`` on the implementation named ``name`` (see the module doc)."""
    impl = parse(name)
    return getattr(impl.module, collective)(x, out, peer, group, impl)


def prepare_capture(backends, group, device, all_reduce_bytes: int) -> None:
    """Make, with every rank of ``group``, what the plain collectives of ``backends`` (``"native"``,
    ``"fused"``) need and a CUDA graph capture cannot make: the group's NCCL communicator; its
    peer-memory workspace, checked and grown to hold a fused all-reduce of ``all_reduce_bytes``
    by any algorithm."""
    if "native" in backends or "fused" in backends:
        with torch.cuda.device(device):
            pipelined_native.communicator(group, device)
    if "fused" in backends:
        # The regions' needs follow the bytes, whatever the dtype: count them as float32 elements.
        p, numel = coll.group_size(group), max(1, -(-all_reduce_bytes // 4))
        need = [max(sizes) for sizes in zip(*(peer_memory.all_reduce_needs(p, numel, torch.float32, a)
                                              for a in fused.algorithms()))]
        with torch.cuda.device(device):
            peer_memory.context(group, device, "all_reduce", need,
                                lambda: f"the capture of all-reduces of {all_reduce_bytes} bytes")
