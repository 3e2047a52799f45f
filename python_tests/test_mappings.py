"""Megatron's mappings, with exact rank-valued identities (every value is a small integer)."""

from __future__ import annotations

import pytest
import torch

from tp_kernels import mappings as M
from helpers import rank_world


def _leaf(t):
    return t.clone().requires_grad_()


def check_mappings():
    r, p = rank_world()
    tri = p * (p + 1) / 2  # sum over ranks of (rank + 1)
    one = torch.full((2, 3), float(r + 1))

    # copy_to: identity forward, all-reduce backward
    x = _leaf(torch.arange(6.0).reshape(2, 3))
    y = M.copy_to_tensor_model_parallel_region(x)
    assert torch.equal(y, x)
    y.backward(one)
    assert torch.equal(x.grad, torch.full((2, 3), tri))

    # reduce_from: all-reduce forward (input untouched), identity backward
    x = _leaf(one)
    y = M.reduce_from_tensor_model_parallel_region(x)
    assert torch.equal(y, torch.full((2, 3), tri)) and torch.equal(x, one)
    y.backward(one * 10)
    assert torch.equal(x.grad, one * 10)

    # scatter_to (last dim): this rank's block forward, all-gather backward
    x = _leaf(torch.arange(3.0 * p).repeat(2, 1))  # [2, 3p]
    y = M.scatter_to_tensor_model_parallel_region(x)
    assert torch.equal(y, torch.arange(3.0 * r, 3.0 * r + 3).repeat(2, 1))
    y.backward(one)
    assert torch.equal(x.grad, torch.arange(1.0, p + 1).repeat_interleave(3).repeat(2, 1))

    # gather_from (last dim): all-gather forward, split backward
    x = _leaf(one)
    y = M.gather_from_tensor_model_parallel_region(x)
    assert torch.equal(y, torch.arange(1.0, p + 1).repeat_interleave(3).repeat(2, 1))
    y.backward(torch.arange(3.0 * p).repeat(2, 1))
    assert torch.equal(x.grad, torch.arange(3.0 * r, 3.0 * r + 3).repeat(2, 1))

    # scatter_to_sequence (dim 0): block forward, all-gather backward
    x = _leaf(torch.arange(2.0 * p).unsqueeze(1).repeat(1, 3))  # [2p, 3], row i holds i
    y = M.scatter_to_sequence_parallel_region(x)
    assert torch.equal(y, torch.arange(2.0 * r, 2.0 * r + 2).unsqueeze(1).repeat(1, 3))
    y.backward(one)
    assert torch.equal(x.grad, torch.arange(1.0, p + 1).repeat_interleave(2).unsqueeze(1).repeat(1, 3))

    # gather_from_sequence: all-gather forward; reduce-scatter (or split) backward
    for reduce in (True, False):
        x = _leaf(one)
        y = M.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=reduce)
        assert torch.equal(y, torch.arange(1.0, p + 1).repeat_interleave(2).unsqueeze(1).repeat(1, 3))
        y.backward(torch.full((2 * p, 3), float(r + 1)))
        assert torch.equal(x.grad, torch.full((2, 3), tri if reduce else float(r + 1)))

    # reduce_scatter_to_sequence: reduce-scatter forward, all-gather backward
    x = _leaf(torch.full((2 * p, 3), float(r + 1)))
    y = M.reduce_scatter_to_sequence_parallel_region(x)
    assert torch.equal(y, torch.full((2, 3), tri))
    y.backward(one)
    assert torch.equal(x.grad, torch.arange(1.0, p + 1).repeat_interleave(2).unsqueeze(1).repeat(1, 3))

    # group size 1: every mapping is the identity
    if p == 1:
        x = torch.randn(2, 3)
        for f in (M.copy_to_tensor_model_parallel_region, M.reduce_from_tensor_model_parallel_region,
                  M.scatter_to_tensor_model_parallel_region, M.gather_from_tensor_model_parallel_region,
                  M.scatter_to_sequence_parallel_region, M.gather_from_sequence_parallel_region,
                  M.reduce_scatter_to_sequence_parallel_region):
            assert f(x) is x


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_mappings_exact(world):
    world.run(check_mappings)
