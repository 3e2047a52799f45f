"""The three primitives: pipelined schedule against the reference, and against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tp_kernels import ops
from helpers import CopiedBytes, assert_close, block, matrix_products, rank_world


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


def check_pipelined_follows_the_schedule(op):
    """The portable pipelined backend runs one collective per chunk of the schedule
    (:mod:`tp_kernels.schedule`), in its order: all-gather + GEMM sends each shard but the last
    multiplied as ``num_chunks`` pieces at each of the p - 1 ring steps; GEMM + reduce-scatter
    reduce-scatters rows ``chunk_bounds(m/p, num_chunks)[j]`` of every destination's block; GEMM +
    all-reduce all-reduces rows ``chunk_bounds(m, num_chunks)[j]``."""
    from unittest import mock

    from tp_kernels import _collectives as coll
    from tp_kernels.schedule import chunk_bounds

    r, p = rank_world()
    args, _ = _case(op, 5, 4, 3, torch.float32)
    rows = args[0].shape[0] * args[0].shape[1]  # (the 2-D rows the backends get: [m, 3, k] flattened)
    ran, inside = [], []  # (the collectives the backend starts, not those they start in turn)

    def recording(name, f, rows_of):
        def run(*a, **kw):
            if not inside:
                ran.append((name, rows_of(a, kw)))
            inside.append(name)
            try:
                return f(*a, **kw)
            finally:
                inside.pop()
        return mock.patch.object(coll, name, run)

    for c in (1, 2, 3, 7):
        ran.clear()
        with recording("all_reduce", coll.all_reduce, lambda a, kw: a[0].shape[0]), \
                recording("reduce_scatter_dim0", coll.reduce_scatter_dim0, lambda a, kw: kw["out"].shape[0]), \
                recording("ring_exchange", coll.ring_exchange, lambda a, kw: a[0].shape[0]), torch.no_grad():
            getattr(ops, op)(*args, backend="pipelined", num_chunks=c)
        want = {"all_gather_matmul": [("ring_exchange", b - a) for _ in range(p - 1)
                                      for a, b in chunk_bounds(rows, c)],
                "matmul_reduce_scatter": [("reduce_scatter_dim0", b - a) for a, b in chunk_bounds(rows // p, c)],
                "matmul_all_reduce": [("all_reduce", b - a) for a, b in chunk_bounds(rows, c)]}[op]
        assert ran == want, (c, ran)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_pipelined_follows_the_schedule(world, op):
    world.run(check_pipelined_follows_the_schedule, op)


def check_layouts(op, device="cpu"):
    """x and the weight in the layouts callers hand over (x's leading dims swapped in memory, its
    last dim strided, its rows broadcast; the weight column-major, or its rows apart): every
    backend, chunked or not, gives the output and gradients the reference gives their contiguous
    copies."""
    args, _ = _case(op, 2, 6, 5, torch.float32, device=device)
    x, w, b = args
    rows = x.flatten(0, 1)  # [m, k]: what the backends get as it is
    layouts = {"x leading dims swapped": (x.transpose(0, 1).contiguous().transpose(0, 1), w),
               "x last dim strided": (torch.stack([x, x], -1)[..., 0], w),
               "x rows broadcast": (x[:, :1].expand_as(x), w),
               "x 2-D, rows apart": (torch.cat([rows, rows], 1)[:, :rows.shape[1]], w),
               "x 2-D, column-major": (rows.t().contiguous().t(), w),
               "w column-major": (x, w.t().contiguous().t()),
               "w rows apart": (x, torch.cat([w, w], 1)[:, :w.shape[1]])}
    for layout, (xv, wv) in layouts.items():
        assert not (xv.is_contiguous() and wv.is_contiguous()), layout
        y_shape = getattr(ops, op)(xv.contiguous(), w, b, backend="reference").shape
        dy = torch.randn(y_shape, generator=torch.Generator().manual_seed(3)).to(device)
        y_ref, grads_ref = _run(op, (xv.contiguous(), wv.contiguous(), b), dy, backend="reference")
        for backend, chunks in (("reference", None), ("pipelined", 1), ("pipelined", 3), ("auto", None)):
            leaves = [t.detach().requires_grad_() for t in (xv, wv, b)]  # (views kept as they are)
            y = getattr(ops, op)(*leaves, backend=backend, num_chunks=chunks)
            y.backward(dy)
            what = f"{op} {backend}:{chunks} {layout}"
            assert_close(f"{what} y", y, y_ref.double())
            for name, leaf, g_ref in zip(("dx", "dw", "db"), leaves, grads_ref):
                assert_close(f"{what} {name}", leaf.grad, g_ref.double())


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                                "linear_with_grad_all_reduce"])
def test_layouts_of_x_and_the_weight(world2, op):
    world2.run(check_layouts, op)


def check_backward_chunks():
    """The backward of an all-gather + GEMM (a GEMM + reduce-scatter) and of a GEMM +
    reduce-scatter (an all-gather + GEMM) runs on the forward's backend in its own primitive's
    default chunks, whatever the forward's; the grads are the reference's."""
    from unittest import mock

    from tp_kernels import _library

    ran, real = [], _library.run

    def recording(primitive, name, *args):
        ran.append((primitive, name))
        return real(primitive, name, *args)

    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        args, _ = _case(op, 2, 5, 4, torch.float32)
        dy = torch.randn(getattr(ops, op)(*args, backend="reference").shape, generator=torch.Generator().manual_seed(2))
        _, grads_ref = _run(op, args, dy, backend="reference")
        with mock.patch.object(_library, "run", recording):
            _, grads = _run(op, args, dy, backend="pipelined", num_chunks=3)
        for name, g, g_ref in zip(("dx", "dw", "db"), grads, grads_ref):
            assert_close(f"{op} {name}", g, g_ref.double())
    assert ran == [("all_gather_matmul", "pipelined:3"), ("matmul_reduce_scatter", "pipelined:4"),
                   ("matmul_reduce_scatter", "pipelined:3"), ("all_gather_matmul", "pipelined:1")], ran


def test_backward_runs_in_its_own_primitives_chunks(world2):
    world2.run(check_backward_chunks)


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


def check_gather_and_scatter_dims(device="cpu", dtype=torch.float64):
    """``gather_dim`` / ``scatter_dim`` other than 0 (a batch-first ``[b, s/p, k]``, s/p = 1 too,
    and a dim inside a 4-D input, counted from either end): each rank's output is the dense
    product's block of that dim (in float64, of the same rounded inputs), contiguous, and so are
    the gradients, on both backends; the dim is checked, on every rank, before anything moves."""
    r, p = rank_world()
    g = torch.Generator().manual_seed(0)

    def draw(*shape):  # (rounded to dtype, held in float64)
        return torch.randn(shape, generator=g).to(dtype).double()

    for shape, dim in [((3, 2 * p, 5), 1), ((2, 3, 2 * p, 5), -2), ((1, 2 * p, 5), 1), ((3, p, 5), 1)]:
        d = dim % len(shape)
        x_col, w_col, b_col = draw(*shape), draw(4 * p, 5), draw(4 * p)
        x_row, w_row, b_row = draw(*shape[:-1], 3 * p), draw(4, 3 * p), draw(4)
        cases = [("all_gather_matmul", (block(x_col, d, r, p), block(w_col, 0, r, p), block(b_col, 0, r, p)),
                  (x_col, w_col, b_col), {"gather_dim": dim}, (lambda t: block(t, -1, r, p)),
                  (lambda gx, gw, gb: (block(gx, d, r, p), block(gw, 0, r, p), block(gb, 0, r, p)))),
                 ("matmul_reduce_scatter", (block(x_row, -1, r, p), block(w_row, 1, r, p), b_row),
                  (x_row, w_row, b_row), {"scatter_dim": dim}, (lambda t: block(t, d, r, p)),
                  (lambda gx, gw, gb: (block(gx, -1, r, p), block(gw, 1, r, p), gb)))]
        for op, mine, full, kw, out_block, grad_blocks in cases:
            dense = [t.clone().requires_grad_() for t in full]
            want = F.linear(*dense)
            dy = draw(*want.shape)
            want.backward(dy)
            for backend in ("reference", "pipelined"):
                leaves = [t.to(device, dtype, copy=True).requires_grad_() for t in mine]
                y = getattr(ops, op)(*leaves, backend=backend, **kw)
                what = f"{op} {shape} dim {dim} {backend}"
                assert y.is_contiguous(), what
                assert_close(f"{what} y", y, out_block(want.detach()).to(device))
                y.backward(out_block(dy).to(device, dtype))
                for name, leaf, grad in zip(("x", "weight", "bias"), leaves, grad_blocks(*(t.grad for t in dense))):
                    assert_close(f"{what} d{name}", leaf.grad, grad.to(device))
    x, w = torch.randn(3, 2, 5, device=device), torch.randn(4, 5, device=device)
    for bad in (2, -1, 3, -4, True, 1.0, False, 0.0):
        with pytest.raises(ValueError, match=r"gather_dim: expected a dim of x other than its last, in \[-3, 1\] "
                                             rf"for x of shape \(3, 2, 5\), got {bad!r}"):
            ops.all_gather_matmul(x, w, gather_dim=bad)
    if p > 1:
        odd = torch.randn(2, 2 * p + 1, 5, device=device)
        with pytest.raises(ValueError, match=rf"x.shape\[1\] \({2 * p + 1}\) is not divisible"):
            ops.matmul_reduce_scatter(odd, w, scatter_dim=1)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_gather_and_scatter_dims(world):
    world.run(check_gather_and_scatter_dims)


def check_dims_copy_once():
    """Along dim 1 of a batch-first ``[b, s, k]`` (b > 1), each op copies one tensor in the forward,
    the gathered output (``all_gather_matmul``: its blocks joined) or the scattered input
    (``matmul_reduce_scatter``: its blocks stacked), and one in the backward, that tensor's
    gradient: the bytes counted beyond the same call's along dim 0 of ``[s, b, k]``."""
    r, p = rank_world()
    b, s, k, n = 3, 2 * p, 5, 4
    for op, rows, dim_name in (("all_gather_matmul", s // p, "gather_dim"), ("matmul_reduce_scatter", s, "scatter_dim")):
        for backend in ("reference", "pipelined"):
            copied = {}
            for dim in (0, 1):
                g = torch.Generator().manual_seed(r)
                x = torch.randn(rows, b, k, generator=g)
                x = (x.transpose(0, 1).contiguous() if dim else x).requires_grad_()
                w = torch.randn(n, k, generator=g, requires_grad=True)
                with CopiedBytes() as forward:
                    y = getattr(ops, op)(x, w, backend=backend, **{dim_name: dim})
                with CopiedBytes() as backward:
                    torch.autograd.grad(y, (x, w), torch.ones_like(y))
                copied[dim] = forward.floating, backward.floating
            one = 4 * (y.numel() if op == "all_gather_matmul" else x.numel())
            extra = tuple(a - b for a, b in zip(copied[1], copied[0]))
            assert extra == (one, one), f"{op} {backend}: dim 1 copied {extra} bytes (forward, backward) more than " \
                                        f"dim 0, not one tensor of {one} each way"


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_gather_and_scatter_dims_copy_once(world):
    world.run(check_dims_copy_once)


def check_empty_and_frozen(op):
    """m = 0 rows works; a frozen weight gets no gradient, and its backward computes none (the
    product of the weight's shape runs only where the weight takes a gradient)."""
    def case(m_per_rank):  # (linear_with_grad_all_reduce: the column layer's weight, x whole)
        column = op == "linear_with_grad_all_reduce"
        args, full = _case("all_gather_matmul" if column else op, m_per_rank, 11, 7, torch.float32)
        return (full[0], *args[1:]) if column else args

    args = case(0)
    for backend in ("reference", "pipelined"):
        y = getattr(ops, op)(*args, backend=backend)
        assert y.shape[0] == 0
    args = case(3)
    for trained in (False, True):
        x, w = args[0].clone().requires_grad_(), args[1].clone().requires_grad_(trained)
        y = getattr(ops, op)(x, w, None, backend="pipelined", num_chunks=2)
        seen = []
        with matrix_products(seen):
            y.sum().backward()
        products = [mnk[:2] for mnk, *_ in seen]  # (the output shapes)
        assert x.grad is not None and x.grad.shape == x.shape
        assert (w.grad is not None) == trained
        assert (tuple(w.shape) in products) == trained, (trained, products)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                                "linear_with_grad_all_reduce"])
def test_empty_batch_and_frozen_weight(world2, op):
    world2.run(check_empty_and_frozen, op)


def check_random_shapes():
    """Random shapes, leading dims, chunk counts and backends for every op, against float64
    (forward and all three gradients). Every rank draws the same examples (derandomized), so
    the collectives stay matched."""
    from hypothesis import given, settings, strategies as st

    r, p = rank_world()

    @settings(derandomize=True, database=None, deadline=None, max_examples=30)
    @given(
        op=st.sampled_from(["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]),
        m_per_rank=st.integers(0, 9),
        lead=st.integers(1, 3),
        k=st.integers(1, 12),
        n=st.integers(1, 12),
        bias=st.booleans(),
        backend=st.sampled_from(["reference", "pipelined", "auto"]),
        num_chunks=st.one_of(st.none(), st.integers(1, 7)),
    )
    def one(op, m_per_rank, lead, k, n, bias, backend, num_chunks):
        g = torch.Generator().manual_seed(m_per_rank * 1000 + k * 31 + n)
        m = m_per_rank * p
        if op == "all_gather_matmul":
            x_full, w_full = torch.randn(m, lead, k, generator=g), torch.randn(n * p, k, generator=g)
            b_full = torch.randn(n * p, generator=g)
            x, w, b = block(x_full, 0, r, p), block(w_full, 0, r, p), block(b_full, 0, r, p)
        else:
            x_full, w_full = torch.randn(m, lead, k * p, generator=g), torch.randn(n, k * p, generator=g)
            b_full = torch.randn(n, generator=g)
            x, w, b = block(x_full, -1, r, p), block(w_full, 1, r, p), b_full
        dy_full = torch.randn(m, lead, n * p if op == "all_gather_matmul" else n, generator=g)
        # float64 reference on the full tensors, and again on their absolute values: the second
        # gives each result's magnitude scale |A| |B| (some results cancel to almost nothing)
        def reference(transform):
            xr, wr, br = (transform(t).double().requires_grad_() for t in (x_full, w_full, b_full))
            yr = F.linear(xr, wr, br if bias else None)
            yr.backward(transform(dy_full).double())
            db = br.grad if bias else None
            if op == "all_gather_matmul":
                return block(yr, -1, r, p), (block(xr.grad, 0, r, p), block(wr.grad, 0, r, p),
                                             None if db is None else block(db, 0, r, p))
            if op == "matmul_reduce_scatter":
                return block(yr, 0, r, p), (block(xr.grad, -1, r, p), block(wr.grad, 1, r, p), db)
            return yr, (block(xr.grad, -1, r, p), block(wr.grad, 1, r, p), db)

        want_y, want = reference(lambda t: t)
        scale_y, scales = reference(torch.abs)
        dy = {"all_gather_matmul": lambda t: block(t, -1, r, p),
              "matmul_reduce_scatter": lambda t: block(t, 0, r, p)}.get(op, lambda t: t)(dy_full)
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = getattr(ops, op)(leaves[0], leaves[1], leaves[2] if bias else None,
                             backend=backend, num_chunks=num_chunks)
        y.backward(dy)
        label = f"{op} m/p={m_per_rank} lead={lead} k={k} n={n} {backend} c={num_chunks}"
        max_of = lambda t: t.abs().max().item() if t.numel() else 0.0
        assert_close(f"{label} y", y, want_y.detach(), scale=max_of(scale_y))
        for name, leaf, ref_grad, ref_scale in zip(("dx", "dw", "db"), leaves, want, scales):
            if ref_grad is None:
                assert leaf.grad is None, f"{label}: a gradient for the absent bias"
                continue
            assert_close(f"{label} {name}", leaf.grad, ref_grad, scale=max_of(ref_scale))

    one()


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_random_shapes_against_float64(world):
    world.run(check_random_shapes)
