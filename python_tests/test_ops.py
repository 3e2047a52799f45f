"""The three primitives: pipelined schedule against the reference, and against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tp_kernels import ops
from helpers import assert_close, block, rank_world


def _case(op, m_per_rank, k, n, dtype, seed=0, device="cpu"):
    """Full float inputs for ``op`` and this rank's arguments (drawn on the CPU, then moved)."""
    r, p = rank_world()
    g = torch.Generator().manual_seed(seed)
    m = m_per_rank * p
    if op == "all_gather_matmul":
        x_full = torch.randn(m, 3, k, generator=g)  # [m, 3, k], gathered along dim 0
        w_full = torch.randn(n * p, k, generator=g)
        b_full = torch.randn(n * p, generator=g)
        args = (block(x_full, 0, r, p), block(w_full, 0, r, p), block(b_full, 0, r, p))
    else:
        x_full = torch.randn(m, 3, k * p, generator=g)
        w_full = torch.randn(n, k * p, generator=g)
        b_full = torch.randn(n, generator=g)
        args = (block(x_full, -1, r, p), block(w_full, 1, r, p), b_full)
    args = tuple(t.to(device=device, dtype=dtype).contiguous() for t in args)
    return args, tuple(t.to(device) for t in (x_full, w_full, b_full))


def _run(op, args, dy, **kw):
    """Forward and backward of ``op``; returns the output and the grads of (x, weight, bias)."""
    leaves = [t.clone().requires_grad_() for t in args]
    y = getattr(ops, op)(*leaves, **kw)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def check_pipelined_matches_reference(op, m_per_rank, device="cpu"):
    """For num_chunks 1..5, the pipelined schedule gives the reference's output and grads."""
    r, p = rank_world()
    args, _ = _case(op, m_per_rank, 11, 7, torch.float32, device=device)
    out_shape = getattr(ops, op)(*args, backend="reference").shape
    dy = torch.randn(out_shape, generator=torch.Generator().manual_seed(1)).to(device)  # same on every rank
    y_ref, grads_ref = _run(op, args, dy, backend="reference")
    for c in range(1, 6):
        y, grads = _run(op, args, dy, backend="pipelined", num_chunks=c)
        # chunked GEMMs need not round like the whole one: float32 tolerance, not bitwise
        assert_close(f"{op} num_chunks={c} y", y, y_ref.double())
        for name, g, g_ref in zip(("dx", "dw", "db"), grads, grads_ref):
            assert_close(f"{op} num_chunks={c} {name}", g, g_ref.double())


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
@pytest.mark.parametrize("m_per_rank", [7, 3, 1])
def test_pipelined_matches_reference(world, op, m_per_rank):
    world.run(check_pipelined_matches_reference, op, m_per_rank)


def check_against_float64(op, dtype_name, backend, device="cpu"):
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    args, (x_full, w_full, b_full) = _case(op, 5, 13, 17, dtype, device=device)
    # the math of each op on the full (rounded) tensors, in float64 and in plain `dtype`
    full = [t.to(dtype) for t in (x_full, w_full, b_full)]

    def dense(d):
        x, w, b = (t.to(d) for t in full)
        y = F.linear(x, w, b)
        if op == "all_gather_matmul":
            return block(y, -1, r, p)
        if op == "matmul_reduce_scatter":
            return block(y, 0, r, p)
        return y

    y = getattr(ops, op)(*args, backend=backend)
    terms = 1 if op == "all_gather_matmul" else p
    assert_close(f"{op} y", y, dense(torch.float64), dense(dtype), terms=terms)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["reference", "pipelined", "auto"])
def test_ops_against_float64(world, op, dtype, backend):
    world.run(check_against_float64, op, dtype, backend)


def check_empty_and_frozen(op):
    """m = 0 rows works; a frozen weight gets no gradient and costs no re-gather."""
    args, _ = _case(op, 0, 11, 7, torch.float32)
    for backend in ("reference", "pipelined"):
        y = getattr(ops, op)(*args, backend=backend)
        assert y.shape[0] == 0
    args, _ = _case(op, 3, 11, 7, torch.float32)
    x = args[0].clone().requires_grad_()
    y = getattr(ops, op)(x, args[1], None, backend="pipelined", num_chunks=2)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_empty_batch_and_frozen_weight(world2, op):
    world2.run(check_empty_and_frozen, op)
