"""The chunk schedule of the ``pipelined`` backend, defined once.

The portable backend (``tp_kernels.backends.pipelined``) follows exactly these boundaries and
this order, so the CPU tests exercise the schedule the native backend uses.

* :func:`chunk_bounds` splits ``m`` rows into contiguous, nearly equal chunks.
* All-gather + GEMM is a ring: at step ``s`` rank ``r`` multiplies the shard of rank
  :func:`ring_source` ``(r - s) mod p`` while the next shard arrives from rank ``r - 1``;
  each shard travels as ``num_chunks`` messages of :func:`chunk_bounds` ``(m/p, num_chunks)``.
* GEMM + reduce-scatter: chunk ``j`` is rows :func:`chunk_bounds` ``(m/p, num_chunks)[j]`` of
  *every* destination's block; its reduce-scatter runs while chunk ``j + 1`` multiplies.
* GEMM + all-reduce: chunk ``j`` is rows :func:`chunk_bounds` ``(m, num_chunks)[j]``; its
  all-reduce runs while chunk ``j + 1`` multiplies.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["DEFAULT_NUM_CHUNKS", "chunk_bounds", "resolve_num_chunks", "ring_source"]

#: Chunks per op when ``num_chunks=None``. All-gather + GEMM already pipelines over the p ring
#: steps, so it sends each shard whole; the reductions split m in 4 (see docs/architecture.md).
DEFAULT_NUM_CHUNKS = {"all_gather_matmul": 1, "matmul_reduce_scatter": 4, "matmul_all_reduce": 4}


def chunk_bounds(m: int, num_chunks: int) -> List[Tuple[int, int]]:
    """Split ``range(m)`` into ``min(num_chunks, m)`` contiguous ``(start, end)`` chunks.

    The first ``m % c`` chunks are one row longer than the rest; no chunk is empty, so
    ``m = 0`` gives no chunks.
    """
    if m < 0:
        raise ValueError(f"m: expected a non-negative int, got {m}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks: expected a positive int, got {num_chunks}")
    c = min(num_chunks, m)
    if c == 0:
        return []
    base, extra = divmod(m, c)
    bounds, start = [], 0
    for j in range(c):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_source(rank: int, step: int, world_size: int) -> int:
    """Whose shard rank ``rank`` multiplies at ring step ``step`` of all-gather + GEMM."""
    return (rank - step) % world_size


def resolve_num_chunks(op: str, num_chunks: Optional[int]) -> int:
    """Validate a user's ``num_chunks`` (positive int) or pick the default for ``op``."""
    if num_chunks is None:
        return DEFAULT_NUM_CHUNKS[op]
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise ValueError(f"num_chunks: expected a positive int or None, got {num_chunks!r}")
    return num_chunks
