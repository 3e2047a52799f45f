"""The chunk schedule shared by the pipelined backends."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from tp_kernels.schedule import DEFAULT_NUM_CHUNKS, boundaries, chunk_bounds, resolve_num_chunks, ring, ring_source


@given(m=st.integers(0, 5000), c=st.integers(1, 64))
def test_chunks_cover_rows_in_order(m, c):
    bounds = chunk_bounds(m, c)
    assert len(bounds) == min(m, c)
    if not bounds:
        assert m == 0
        return
    starts = [a for a, _ in bounds]
    ends = [b for _, b in bounds]
    assert starts == [0] + ends[:-1] and ends[-1] == m  # contiguous, in order, covering m
    assert boundaries(m, c) == (0, *ends)  # (the chunks as the native module takes them)
    sizes = [b - a for a, b in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the longer chunks come first


def test_chunk_examples():
    assert chunk_bounds(7, 3) == ((0, 3), (3, 5), (5, 7))
    assert chunk_bounds(2, 5) == ((0, 1), (1, 2))
    assert chunk_bounds(0, 4) == ()
    assert boundaries(7, 3) == (0, 3, 5, 7) and boundaries(0, 4) == (0,)
    # made once for each size, and immutable: a call's host time does not go to making them again,
    # and no caller can change another's
    assert chunk_bounds(7, 3) is chunk_bounds(7, 3) and boundaries(7, 3) is boundaries(7, 3)
    assert ring(1, 4) is ring(1, 4) and isinstance(ring(1, 4).sources, tuple)
    with pytest.raises(ValueError, match="num_chunks"):
        chunk_bounds(4, 0)
    for m in (-1, -2):
        with pytest.raises(ValueError, match=rf"m: expected a non-negative int, got {m}"):
            chunk_bounds(m, 2)


@given(p=st.integers(1, 16), r=st.integers(0, 15))
def test_ring_visits_every_shard_once(p, r):
    r %= p
    order = [ring_source(r, s, p) for s in range(p)]
    assert order[0] == r  # the local shard first: nothing to wait for
    assert sorted(order) == list(range(p))
    # what rank r multiplies at step s+1 is what rank r-1 multiplied at step s (it forwards it)
    assert all(ring_source(r, s + 1, p) == ring_source((r - 1) % p, s, p) for s in range(p - 1))
    assert ring(r, p) == (tuple(order), (r + 1) % p, (r - 1) % p)  # (the ring as the native module takes it)


def test_resolve_num_chunks():
    assert resolve_num_chunks("matmul_all_reduce", None) == DEFAULT_NUM_CHUNKS["matmul_all_reduce"]
    assert resolve_num_chunks("all_gather_matmul", 3) == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_chunks"):
            resolve_num_chunks("all_gather_matmul", bad)
