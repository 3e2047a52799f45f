"""The raw collectives (``tp_kernels._collectives``) on their own: what the ops, layers and
checkpoints build on without checking it again. The layout helpers undo each other."""

from __future__ import annotations

import math

import torch
from hypothesis import given, strategies as st

from tp_kernels import _collectives as coll


@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=4), pick=st.integers(0, 3), p=st.integers(1, 4))
def test_blocks_cut_and_joined(shape, pick, p):
    """The layouts of every gather and scatter along a dim other than 0: ``join_stacked`` joins the
    blocks of a ``[p, *shape]`` tensor along ``dim`` as ``torch.cat`` does, and ``join_blocks``
    (``dim`` counted from either end) those of ``[p*b, ...]``, each contiguous, and a new tensor
    (not a view) unless the dims before ``dim`` are all 1 (then a view that autograd does not
    track as one), ``dim`` is 0 or there is one block; ``blocks_first`` cuts them apart again, contiguous (block r of
    the result is block r of ``dim``). Blocks one wide included: a reshape alone gave a view that
    is not contiguous there."""
    dim = pick % len(shape)
    stacked = torch.arange(p * math.prod(shape)).reshape(p, *shape)
    want = torch.cat(list(stacked), dim)
    joined = [coll.join_blocks(stacked.flatten(0, 1), d, p) for d in (dim, dim - len(shape))]
    if dim:
        joined.append(coll.join_stacked(stacked, dim))
    for got in joined:
        assert torch.equal(got, want) and got.is_contiguous(), (shape, dim, p)
        assert got._base is None or math.prod(shape[:dim]) == 1 or p == 1, "a view of the gathered blocks"
    cut = coll.blocks_first(want, dim, p)
    assert cut.is_contiguous() and torch.equal(cut, stacked.flatten(0, 1)), (shape, dim, p)
