"""The chunk schedule of the ``pipelined`` backend, defined once.

The portable backend (``tp_kernels.backends.pipelined``) follows these boundaries and this order,
and the native one (``tp_kernels.backends.pipelined_native``) passes them to the native code, so
the CPU tests exercise the schedule the GPU runs.

* :func:`chunk_bounds` splits ``m`` rows into contiguous, nearly equal chunks.
* All-gather + GEMM is a ring (:func:`ring`): at step ``s`` rank ``r`` multiplies the shard of
  rank ``(r - s) mod p`` while the next shard arrives from rank ``r - 1``; each shard travels as
  ``num_chunks`` messages of :func:`chunk_bounds` ``(m/p, num_chunks)``.
* GEMM + reduce-scatter: chunk ``j`` is rows :func:`chunk_bounds` ``(m/p, num_chunks)[j]`` of
  *every* destination's block; its reduce-scatter runs while chunk ``j + 1`` multiplies.
* GEMM + all-reduce: chunk ``j`` is rows :func:`chunk_bounds` ``(m, num_chunks)[j]``; its
  all-reduce runs while chunk ``j + 1`` multiplies.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

from ._op_table import ALL_GATHER_MATMUL, MATMUL_ALL_REDUCE, MATMUL_REDUCE_SCATTER

__all__ = ["DEFAULT_NUM_CHUNKS", "Ring", "boundaries", "chunk_bounds", "resolve_num_chunks", "ring", "ring_source"]

#: Chunks per primitive when ``num_chunks=None``. All-gather + GEMM already pipelines over the p
#: ring steps, so it sends each shard whole; the reductions split m in 4 (docs/architecture.md).
DEFAULT_NUM_CHUNKS = {ALL_GATHER_MATMUL: 1, MATMUL_REDUCE_SCATTER: 4, MATMUL_ALL_REDUCE: 4}

#: How many ``(m, num_chunks)`` (and ``(rank, world_size)``) the schedule keeps made: each call of
#: a native or portable chunked path asks for its chunks, a decode loop's with a handful of sizes.
CACHED_SHAPES = 1024


@functools.lru_cache(maxsize=CACHED_SHAPES)
def chunk_bounds(m: int, num_chunks: int) -> Tuple[Tuple[int, int], ...]:
    """Split ``range(m)`` into ``min(num_chunks, m)`` contiguous ``(start, end)`` chunks.

    The first ``m % c`` chunks are one row longer than the rest; no chunk is empty, so
    ``m = 0`` gives no chunks. Made once for each ``(m, num_chunks)`` (a tuple, shared).
    """
    if m < 0:
        raise ValueError(f"m: expected a non-negative int, got {m}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks: expected a positive int, got {num_chunks}")
    c = min(num_chunks, m)
    if c == 0:
        return ()
    base, extra = divmod(m, c)
    bounds, start = [], 0
    for j in range(c):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


@functools.lru_cache(maxsize=CACHED_SHAPES)
def boundaries(m: int, num_chunks: int) -> Tuple[int, ...]:
    """The chunks of :func:`chunk_bounds` as their boundaries ``(0, b1, ..., m)``, as the native
    module takes them. Made once for each ``(m, num_chunks)``: a native call's host time went 2 µs
    to making them (on the 2-core VM; a cached one takes 0.2)."""
    return (0,) + tuple(end for _, end in chunk_bounds(m, num_chunks))


def ring_source(rank: int, step: int, world_size: int) -> int:
    """Whose shard rank ``rank`` multiplies at ring step ``step`` of all-gather + GEMM."""
    return (rank - step) % world_size


class Ring(NamedTuple):
    """Rank ``r``'s view of the all-gather ring: ``sources[s]`` is whose shard it multiplies at
    step ``s`` (its own first); it forwards each shard to ``next`` and receives from ``prev``."""

    sources: Tuple[int, ...]
    next: int
    prev: int


@functools.lru_cache(maxsize=CACHED_SHAPES)
def ring(rank: int, world_size: int) -> Ring:
    """The ring of :func:`ring_source`: shards travel from rank ``r - 1`` to rank ``r``. Made once
    for each ``(rank, world_size)`` (2.5 µs of an all-gather's host time on the 2-core VM)."""
    return Ring(tuple(ring_source(rank, s, world_size) for s in range(world_size)), (rank + 1) % world_size,
                (rank - 1) % world_size)


def resolve_num_chunks(op: str, num_chunks: Optional[int]) -> int:
    """Validate a user's ``num_chunks`` (positive int) or pick the default for primitive ``op``."""
    if num_chunks is None:
        return DEFAULT_NUM_CHUNKS[op]
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise ValueError(f"num_chunks: expected a positive int or None, got {num_chunks!r}")
    return num_chunks
