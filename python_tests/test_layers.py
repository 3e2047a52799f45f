"""Column- and row-parallel layers against a dense single-process nn.Linear.

Every rank builds the same dense layer and inputs (same seed), runs its shard, and compares
output, input gradient and weight/bias gradients with the float64 reference (helpers.py).
Sizes are odd: in = 13·p, out = 17·p, batch 7, and a sequence dim of 5·p.
"""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tp_kernels
from helpers import assert_close, block, rank_world

DTYPES = ["float32", "bfloat16"]


def _dense_case(dtype, bias, in_f, out_f, seq, batch=7, seed=0, device="cpu"):
    """Dense layer, inputs and output grad in ``dtype`` on ``device``, with the float64 reference
    and the plain-PyTorch result of the same forward/backward (drawn on the CPU, then moved, so
    every device sees the same numbers)."""
    torch.manual_seed(seed)
    dense = nn.Linear(in_f, out_f, bias=bias).to(device=device, dtype=dtype)
    x = torch.randn(seq, batch, in_f).to(device=device, dtype=dtype)
    dy = torch.randn(seq, batch, out_f).to(device=device, dtype=dtype)

    def run(d):
        xx = x.to(d, copy=True).requires_grad_()
        w = dense.weight.detach().to(d).requires_grad_()
        b = dense.bias.detach().to(d).requires_grad_() if bias else None
        y = F.linear(xx, w, b)
        y.backward(dy.to(d))
        return {"y": y.detach(), "dx": xx.grad, "dw": w.grad, "db": None if b is None else b.grad}

    return dense, x, dy, run(torch.float64), run(dtype)


def check_column(dtype_name, bias, sequence_parallel, gather_output, skip_bias_add, backend, num_chunks=None,
                 device="cpu"):
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    dense, x, dy, ref, plain = _dense_case(dtype, bias, 13 * p, 17 * p, 5 * p, device=device)
    layer = tp_kernels.ColumnParallelLinear.from_linear(
        dense, gather_output=gather_output, sequence_parallel=sequence_parallel,
        skip_bias_add=skip_bias_add, backend=backend, num_chunks=num_chunks,
    )
    assert layer.weight.shape == (17, 13 * p) and layer.weight.dtype == dtype

    def out_view(t):  # what this rank's output holds of a full [s, b, out] tensor
        return t if gather_output else block(t, -1, r, p)

    def in_view(t):  # what this rank's input holds of a full [s, b, in] tensor
        return block(t, 0, r, p) if sequence_parallel else t

    xin = in_view(x).clone().requires_grad_()
    y = layer(xin)
    if skip_bias_add:
        y, b = y
        if bias:
            assert b.shape == ((17 * p,) if gather_output else (17,))
            y = y + b
        else:
            assert b is None
    y.backward(out_view(dy))
    assert_close("y", y, out_view(ref["y"]), out_view(plain["y"]))
    assert_close("dx", xin.grad, in_view(ref["dx"]), in_view(plain["dx"]), terms=p)
    assert_close("dw", layer.weight.grad, block(ref["dw"], 0, r, p), block(plain["dw"], 0, r, p))
    if bias:
        assert_close("db", layer.bias.grad, block(ref["db"], 0, r, p), block(plain["db"], 0, r, p))


def check_row(dtype_name, bias, sequence_parallel, input_is_parallel, skip_bias_add, backend, num_chunks=None,
              device="cpu"):
    r, p = rank_world()
    dtype = getattr(torch, dtype_name)
    dense, x, dy, ref, plain = _dense_case(dtype, bias, 13 * p, 17 * p, 5 * p, device=device)
    layer = tp_kernels.RowParallelLinear.from_linear(
        dense, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
        skip_bias_add=skip_bias_add, backend=backend, num_chunks=num_chunks,
    )
    assert layer.weight.shape == (17 * p, 13)

    def in_view(t):
        return block(t, -1, r, p) if input_is_parallel else t

    def out_view(t):
        return block(t, 0, r, p) if sequence_parallel else t

    xin = in_view(x).clone().requires_grad_()
    y = layer(xin)
    if skip_bias_add:
        y, b = y
        if bias:
            y = y + b
    y.backward(out_view(dy))
    assert_close("y", y, out_view(ref["y"]), out_view(plain["y"]), terms=p)
    assert_close("dx", xin.grad, in_view(ref["dx"]), in_view(plain["dx"]))
    assert_close("dw", layer.weight.grad, block(ref["dw"], 1, r, p), block(plain["dw"], 1, r, p))
    if bias:
        # the full bias gradient, complete on every rank (also under sequence parallelism)
        assert_close("db", layer.bias.grad, ref["db"], plain["db"])


def check_layer_grid(kind, dtype_name, backend, device="cpu"):
    """Every flag combination of one layer kind, in one call to the ranks."""
    check = check_column if kind == "column" else check_row
    for bias, sp, flag, skip in itertools.product([True, False], repeat=4):
        if kind == "row" and sp and not flag:
            continue  # sequence parallelism needs input_is_parallel (tested as an error)
        try:
            check(dtype_name, bias, sp, flag, skip, backend, device=device)
        except AssertionError as exc:
            names = ("bias", "sequence_parallel", "gather_output" if kind == "column" else "input_is_parallel",
                     "skip_bias_add")
            raise AssertionError(f"{kind} {dtype_name} {backend} {dict(zip(names, (bias, sp, flag, skip)))}: {exc}")


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["reference", "pipelined"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_layer_matches_dense(world, kind, dtype, backend):
    world.run(check_layer_grid, kind, dtype, backend)


def check_autocast(device="cpu"):
    """Mixed precision: float32 parameters under ``torch.autocast`` to bfloat16. Each layer computes
    as ``F.linear`` does under autocast: a bfloat16 output within the tolerance rule of the float64
    result of the bfloat16 operands, float32 gradients of its float32 parameters, and the input
    gradient in the input's dtype."""
    r, p = rank_world()
    low = torch.bfloat16
    torch.manual_seed(0)
    dense = nn.Linear(13 * p, 17 * p).to(device)
    x = torch.randn(5, 7, 13 * p, device=device)
    dy = torch.randn(5, 7, 17 * p, device=device).to(low)

    def dense_run(d):  # the operands autocast hands F.linear, in d (float64: the reference)
        xx = x.to(low).to(d).requires_grad_()
        w, b = (t.detach().to(low).to(d).requires_grad_() for t in (dense.weight, dense.bias))
        y = F.linear(xx, w, b)
        y.backward(dy.to(d))
        return {"y": y.detach(), "dx": xx.grad, "dw": w.grad, "db": b.grad}

    ref, plain = dense_run(torch.float64), dense_run(low)
    column = tp_kernels.ColumnParallelLinear.from_linear(dense)
    row = tp_kernels.RowParallelLinear.from_linear(dense, input_is_parallel=True)
    for name, layer, x_of, y_of, w_dim, reduced in [("column", column, lambda t: t, lambda t: block(t, -1, r, p), 0, 1),
                                                    ("row", row, lambda t: block(t, -1, r, p), lambda t: t, 1, p)]:
        xin = x_of(x).clone().requires_grad_()
        with torch.autocast(torch.device(device).type, dtype=low):
            y = layer(xin)
        assert y.dtype == low, f"{name}: output {y.dtype}"
        y.backward(y_of(dy))
        grads = {"dx": xin.grad, "dw": layer.weight.grad, "db": layer.bias.grad}
        assert all(g.dtype == torch.float32 for g in grads.values()), {k: g.dtype for k, g in grads.items()}
        # each a bfloat16 gradient cast to float32, exactly: compared as the bfloat16 it was
        grads = {k: g.to(low) for k, g in grads.items()}
        assert_close(f"{name} y", y, y_of(ref["y"]), y_of(plain["y"]), terms=reduced)
        assert_close(f"{name} dx", grads["dx"], x_of(ref["dx"]), x_of(plain["dx"]), terms=p // reduced)
        assert_close(f"{name} dw", grads["dw"], block(ref["dw"], w_dim, r, p), block(plain["dw"], w_dim, r, p))
        db_of = (lambda t: block(t, 0, r, p)) if name == "column" else (lambda t: t)
        assert_close(f"{name} db", grads["db"], db_of(ref["db"]), db_of(plain["db"]))


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_layers_under_autocast(world):
    world.run(check_autocast)


def check_chunks(kind):
    for c in range(1, 6):
        if kind == "column":
            check_column("float32", True, True, False, False, "pipelined", num_chunks=c)
            check_column("float32", True, False, False, False, "pipelined", num_chunks=c)
        else:
            check_row("float32", True, True, True, False, "pipelined", num_chunks=c)
            check_row("float32", True, False, True, False, "pipelined", num_chunks=c)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_layer_pipelined_num_chunks(world4, kind):
    world4.run(check_chunks, kind)


def check_default_init(tp_size_expected):
    r, p = rank_world()
    assert p == tp_size_expected
    for seed in (0, 1):
        torch.manual_seed(seed)
        dense = nn.Linear(13 * p, 17 * p)
        torch.manual_seed(seed)
        col = tp_kernels.ColumnParallelLinear(13 * p, 17 * p)
        torch.manual_seed(seed)
        row = tp_kernels.RowParallelLinear(13 * p, 17 * p)
        # the same full matrix as nn.Linear under the same seed, whatever p is
        assert torch.equal(col.weight, block(dense.weight, 0, r, p))
        assert torch.equal(col.bias, block(dense.bias, 0, r, p))
        assert torch.equal(row.weight, block(dense.weight, 1, r, p))
        assert torch.equal(row.bias, dense.bias)
    # a custom init_method initializes the full weight; the bias starts at zero
    col = tp_kernels.ColumnParallelLinear(13 * p, 17 * p, init_method=lambda w: nn.init.constant_(w, 0.5))
    assert torch.all(col.weight == 0.5) and torch.all(col.bias == 0)
    torch.manual_seed(3)
    full = torch.empty(17 * p, 13 * p)
    nn.init.xavier_normal_(full)
    torch.manual_seed(3)
    row = tp_kernels.RowParallelLinear(13 * p, 17 * p, bias=False, init_method=nn.init.xavier_normal_)
    assert row.bias is None and torch.equal(row.weight, block(full, 1, r, p))
    # meta device: no initialization, shapes only
    meta = tp_kernels.ColumnParallelLinear(13 * p, 17 * p, device="meta")
    assert meta.weight.is_meta and meta.weight.shape == (17, 13 * p)
    text = repr(col)
    assert f"tp_size={p}" in text and f"out_features={17 * p}" in text


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_default_init_same_full_matrix(world):
    world.run(check_default_init, world.world_size)


def check_meta_then_reset_parameters():
    """A layer made on the meta device, moved with ``to_empty`` and initialized by
    ``reset_parameters()`` holds what one made directly holds under the same seed (``nn.Linear``'s
    and ``nn.Embedding``'s full matrices, or ``init_method``'s), as with the dense modules."""
    r, p = rank_world()

    def orthogonal(w):
        return nn.init.orthogonal_(w)

    makers = {
        "column": lambda **kw: tp_kernels.ColumnParallelLinear(6, 4 * p, **kw),
        "row": lambda **kw: tp_kernels.RowParallelLinear(4 * p, 6, **kw),
        "row, no bias": lambda **kw: tp_kernels.RowParallelLinear(4 * p, 6, bias=False, **kw),
        "column, init_method": lambda **kw: tp_kernels.ColumnParallelLinear(6, 4 * p, init_method=orthogonal, **kw),
        "embedding": lambda **kw: tp_kernels.VocabParallelEmbedding(4 * p, 6, padding_idx=1, **kw),
        "embedding, init_method": lambda **kw: tp_kernels.VocabParallelEmbedding(4 * p, 6, init_method=orthogonal, **kw),
    }
    for name, make in makers.items():
        torch.manual_seed(11)
        direct = make()
        late = make(device="meta").to_empty(device="cpu")
        torch.manual_seed(11)
        late.reset_parameters()
        for (pname, got), want in zip(late.named_parameters(), direct.parameters()):
            assert torch.equal(got, want), (name, pname)
    torch.manual_seed(11)
    dense = nn.Linear(6, 4 * p)
    torch.manual_seed(11)
    col = makers["column"](device="meta").to_empty(device="cpu")
    col.reset_parameters()
    assert torch.equal(col.weight, block(dense.weight, 0, r, p)) and torch.equal(col.bias, block(dense.bias, 0, r, p))


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_meta_then_reset_parameters(world):
    world.run(check_meta_then_reset_parameters)

def check_load_full_weight():
    r, p = rank_world()
    torch.manual_seed(5)
    dense = nn.Linear(13 * p, 17 * p)
    col = tp_kernels.ColumnParallelLinear(13 * p, 17 * p)
    col.load_full_weight(dense.weight, dense.bias)
    assert torch.equal(col.weight, block(dense.weight, 0, r, p)) and torch.equal(col.bias, block(dense.bias, 0, r, p))
    row = tp_kernels.RowParallelLinear(13 * p, 17 * p, dtype=torch.bfloat16)
    before = row.bias.clone()
    row.load_full_weight(dense.weight)  # bias=None leaves the bias alone; dtype converted
    assert torch.equal(row.weight, block(dense.weight, 1, r, p).to(torch.bfloat16))
    assert torch.equal(row.bias, before)
    with pytest.raises(ValueError, match="weight"):
        row.load_full_weight(dense.weight.t())
    with pytest.raises(ValueError, match="bias"):
        tp_kernels.RowParallelLinear(13 * p, 17 * p, bias=False).load_full_weight(dense.weight, dense.bias)


def check_deepcopy_shares_group():
    """A copy of a layer shares its group (deep: nothing else; shallow: everything); pickling one
    (torch.save of the module) says what to save instead."""
    r, p = rank_world()
    for layer in (tp_kernels.ColumnParallelLinear(4, 2 * p), tp_kernels.RowParallelLinear(2 * p, 3),
                  tp_kernels.VocabParallelEmbedding(2 * p, 3)):
        twin = copy.deepcopy(layer)
        assert twin.group is layer.group
        assert twin.weight is not layer.weight and torch.equal(twin.weight, layer.weight)
        with torch.no_grad():
            twin.weight.add_(1)
        assert not torch.equal(twin.weight, layer.weight)
        x = torch.zeros(2, dtype=torch.long) if isinstance(layer, tp_kernels.VocabParallelEmbedding) else torch.randn(2, layer.weight.shape[1])
        twin(x)  # the copy communicates over the shared group
        shallow = copy.copy(layer)  # shares everything
        assert shallow.group is layer.group and shallow.weight is layer.weight
        with pytest.raises(TypeError, match=f"{type(layer).__name__} holds its process group, which cannot be "
                                            "pickled .* save the weights instead, with tp_kernels.full_state_dict"):
            torch.save(layer, io.BytesIO())


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_deepcopy_shares_group(world):
    world.run(check_deepcopy_shares_group)


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_load_full_weight(world):
    world.run(check_load_full_weight)


def check_column_of_several_outputs(gather_output, skip_bias_add, sequence_parallel, heads):
    """A column layer of fused outputs ([q, k, v] of sizes 4p, 2p, 2p) holds block r of each
    (not rows [r*out/p, (r+1)*out/p) of the fused matrix), so that each rank's output is the
    dense layer's outputs' blocks side by side, and a gathered output is the dense output in its
    own order; gradients are the dense ones' blocks; nn.Linear's full matrix under one seed.
    heads="replicated": k and v are one head of 2 each (head_size=2), held whole by every rank;
    each rank's output gradient of them is its share (a gathered output takes them from rank 0),
    and their gradients, summed over the ranks, are the dense ones."""
    r, p = rank_world()
    hd = 2 if heads == "replicated" else None
    sizes, k, s = [4 * p, hd or 2 * p, hd or 2 * p], 3 * p, 2 * p
    out_f = sum(sizes)
    torch.manual_seed(0)
    dense = nn.Linear(k, out_f, dtype=torch.float64)
    torch.manual_seed(0)
    made = tp_kernels.ColumnParallelLinear(k, out_f, output_sizes=sizes, head_size=hd, dtype=torch.float64)

    def ours(t, dim, share=False):  # this rank's blocks of each output along dim, side by side
        def mine(part, j):
            if j == 0 or hd is None or p == 1:
                return block(part, dim, r, p)
            return part / p if share else part  # one head, on every rank: this rank's share of its gradient
        return torch.cat([mine(part, j) for j, part in enumerate(t.split(sizes, dim))], dim)

    assert torch.equal(made.weight, ours(dense.weight, 0)) and torch.equal(made.bias, ours(dense.bias, 0))
    assert f"output_sizes={sizes}" in repr(made)
    layer = tp_kernels.ColumnParallelLinear.from_linear(dense, output_sizes=sizes, gather_output=gather_output,
                                                        skip_bias_add=skip_bias_add, head_size=hd,
                                                        sequence_parallel=sequence_parallel)
    assert torch.equal(layer.weight, made.weight)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, 3, k, generator=g, dtype=torch.float64)
    dy = torch.randn(s, 3, out_f, generator=g, dtype=torch.float64)
    xd = x.clone().requires_grad_()
    dense.zero_grad()
    want = dense(xd)
    want.backward(dy)
    xin = (block(x, 0, r, p) if sequence_parallel else x).clone().requires_grad_()
    got = layer(xin)
    if skip_bias_add:
        got, bias = got
        assert torch.equal(bias, dense.bias if gather_output else ours(dense.bias, 0))
        got = got + bias
    view = (lambda t, share=False: t) if gather_output else (lambda t, share=False: ours(t, -1, share))
    torch.testing.assert_close(got, view(want), rtol=1e-12, atol=1e-12)
    got.backward(view(dy, share=True))
    torch.testing.assert_close(xin.grad, block(xd.grad, 0, r, p) if sequence_parallel else xd.grad,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight.grad, ours(dense.weight.grad, 0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, ours(dense.bias.grad, 0), rtol=1e-12, atol=1e-12)
    other = tp_kernels.ColumnParallelLinear(k, out_f, output_sizes=sizes, head_size=hd, dtype=torch.float64)
    other.load_full_weight(dense.weight, dense.bias)
    assert torch.equal(other.weight, made.weight) and torch.equal(other.bias, made.bias)
    # each output loaded alone, as a checkpoint stores q_proj, k_proj and v_proj
    apart = tp_kernels.ColumnParallelLinear(k, out_f, output_sizes=sizes, head_size=hd, dtype=torch.float64)
    for j, (w, b) in reversed(list(enumerate(zip(dense.weight.split(sizes), dense.bias.split(sizes))))):
        apart.load_full_weight(w, b, output=j)
    assert torch.equal(apart.weight, made.weight) and torch.equal(apart.bias, made.bias)
    if hd is not None:
        return
    for bad, match in [(dict(output=3), r"output: expected the index of one of the layer's 3 outputs"),
                       (dict(output=True), "output: expected the index"),
                       (dict(output=1, bias=dense.bias), rf"bias: expected shape \({2 * p},\)")]:
        with pytest.raises(ValueError, match=match):
            apart.load_full_weight(dense.weight[: 2 * p], **bad)
    with pytest.raises(ValueError, match=r"weight: expected the full shape \(" + str(4 * p)):
        apart.load_full_weight(dense.weight, output=0)
    with pytest.raises(ValueError, match="output: only a column-parallel layer"):
        tp_kernels.RowParallelLinear(out_f, k).load_full_weight(dense.weight.t(), output=0)


def check_one_output_of_replicated_heads():
    """A column layer of one output of 2 heads (a separate k_proj or v_proj of grouped-query
    attention, ``output_sizes=[2 * d], head_size=d``; on 1 and 2 ranks split as rows are): on 4
    ranks each rank holds one whole head,
    the one its query heads attend with (shared with its neighbour), not half of one; its output,
    gathered output, gradients (summed over the ranks holding the head) and full state dict are the
    dense layer's; its sharded state dict has one entry per head, as a fused layer's."""
    r, p = rank_world()
    d, k = 3, 5
    torch.manual_seed(0)
    dense = nn.Linear(k, 2 * d, dtype=torch.float64)
    layer = tp_kernels.ColumnParallelLinear.from_linear(dense, output_sizes=[2 * d], head_size=d)
    gathered = tp_kernels.ColumnParallelLinear.from_linear(dense, output_sizes=[2 * d], head_size=d, gather_output=True)
    head = r * 2 // p if p > 2 else None  # p = 1, 2: the heads split as rows are
    mine = (lambda t, dim=0: t.narrow(dim, head * d, d)) if head is not None else (lambda t, dim=0: block(t, dim, r, p))
    assert layer.weight.shape == (d if head is not None else 2 * d // p, k)
    assert torch.equal(layer.weight, mine(dense.weight)) and "output_sizes=[6], head_size=3" in repr(layer)
    x = torch.randn(4, k, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(4, 2 * d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xd = x.clone().requires_grad_()
    want = dense(xd)
    want.backward(dy)
    torch.testing.assert_close(gathered(x), want, rtol=1e-12, atol=1e-12)
    xin = x.clone().requires_grad_()
    got = layer(xin)
    torch.testing.assert_close(got, mine(want, -1), rtol=1e-12, atol=1e-12)
    share = 2 / p if head is not None else 1  # each rank holding a head takes its share of the head's gradient
    got.backward(mine(dy, -1) * share)
    torch.testing.assert_close(xin.grad, xd.grad, rtol=1e-12, atol=1e-12)  # (the shares summed over the ranks)
    torch.testing.assert_close(layer.weight.grad, mine(dense.weight.grad), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, mine(dense.bias.grad), rtol=1e-12, atol=1e-12)
    state = tp_kernels.full_state_dict(layer)
    assert torch.equal(state["weight"], dense.weight) and torch.equal(state["bias"], dense.bias)
    entries = tp_kernels.sharded_state_dict(layer)
    held = [head] if head is not None else list(range(r * 2 // p, (r + 1) * 2 // p))
    assert sorted(entries) == sorted(f"{name}[0][{h}]" for name in ("weight", "bias") for h in held), sorted(entries)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_one_output_of_heads(world):
    world.run(check_one_output_of_replicated_heads)


def check_row_unreduced(input_is_parallel, skip_bias_add):
    """reduce_results=False: each rank returns its term of the sum, which summed over the group
    (as a caller does later) is the dense output, the bias in it once; every gradient is the dense
    one's block, the bias's complete on every rank."""
    r, p = rank_world()
    torch.manual_seed(0)
    dense = nn.Linear(3 * p, 5, dtype=torch.float64)
    layer = tp_kernels.RowParallelLinear.from_linear(dense, reduce_results=False, input_is_parallel=input_is_parallel,
                                                     skip_bias_add=skip_bias_add)
    assert "reduce_results=False" in repr(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3 * p, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    xd = x.clone().requires_grad_()
    want = dense(xd)
    want.backward(dy)
    xin = (block(x, -1, r, p) if input_is_parallel else x).clone().requires_grad_()
    term = layer(xin)
    if skip_bias_add:
        term, bias = term
        assert bias is layer.bias
    total = tp_kernels.mappings.reduce_from_tensor_model_parallel_region(term)  # the caller's sum
    if skip_bias_add:
        total = total + bias
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)
    total.backward(dy)
    torch.testing.assert_close(xin.grad, block(xd.grad, -1, r, p) if input_is_parallel else xd.grad,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight.grad, block(dense.weight.grad, 1, r, p), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="reduce_results: False cannot go with sequence_parallel=True"):
        tp_kernels.RowParallelLinear(3 * p, 5, sequence_parallel=True, reduce_results=False)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("input_is_parallel,skip_bias_add", [(True, False), (False, False), (True, True)])
def test_row_unreduced(world, input_is_parallel, skip_bias_add):
    world.run(check_row_unreduced, input_is_parallel, skip_bias_add)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("gather_output,skip_bias_add,sequence_parallel",
                         [(False, False, False), (True, False, False), (True, True, False), (False, True, True)])
@pytest.mark.parametrize("heads", ["split", "replicated"])
def test_column_of_several_outputs(world, gather_output, skip_bias_add, sequence_parallel, heads):
    world.run(check_column_of_several_outputs, gather_output, skip_bias_add, sequence_parallel, heads)


def check_rank_env():
    import os

    r, p = rank_world()
    return os.environ.get("TP_KERNELS_TEST_RANK_ENV")


def test_world_sets_per_rank_environment():
    from tp_kernels.testing import World

    with World(2, backend="gloo", env={"TP_KERNELS_TEST_RANK_ENV": "host-{rank}"}) as world:
        assert world.run(check_rank_env) == ["host-0", "host-1"]


def check_fails_on(failing, peer_waits=False):
    """This rank's index, or a ValueError on rank ``failing``; with ``peer_waits``, the other ranks
    wait in a barrier the failing rank never reaches."""
    import torch.distributed as dist

    r, p = rank_world()
    if r == failing:
        raise ValueError(f"rank {r} fails here")
    if peer_waits:
        dist.barrier()
    return r


def check_sleeps(seconds):
    import time

    time.sleep(seconds)
    return seconds


def test_a_world_names_the_ranks_that_failed_or_gave_no_answer_and_then_is_closed():
    """A function that raises on a rank: WorkerError naming the call, that rank and its traceback;
    a rank that gives no answer, waiting for the failed one, named too, within seconds of the
    failure, not the collective timeout; a call past its deadline: WorkerError saying so. After an
    error the world is closed, and says so; a world of no ranks is refused."""
    import time

    from tp_kernels.testing import World, WorkerError

    with pytest.raises(ValueError, match="world_size: expected a positive int, got 0"):
        World(0)
    world = World(2, backend="gloo", timeout_s=60.0)
    assert world.run(check_fails_on, -1) == [0, 1]  # (and again: the world is reused)
    with pytest.raises(WorkerError,
                       match=r"^check_fails_on on 2 ranks failed on ranks \[1\]\n--- rank 1 ---\n") as info:
        world.run(check_fails_on, 1)
    assert "ValueError: rank 1 fails here" in str(info.value) and "gave no answer" not in str(info.value)
    assert not world.alive
    with pytest.raises(WorkerError, match="this World is closed"):
        world.run(check_fails_on, -1)
    world = World(2, backend="gloo", timeout_s=60.0)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"failed on ranks \[1\]; ranks \[0\] gave no answer\n--- rank 1 ---"):
        world.run(check_fails_on, 1, True)
    assert time.monotonic() - start < 30 and not world.alive  # (a grace of seconds, then stopped: not 60 s)
    world = World(1, backend="gloo")
    with pytest.raises(WorkerError,
                       match=r"check_sleeps on 1 ranks: no answer within 0.5 s \(waiting for ranks \[0\]\)"):
        world.run(check_sleeps, 2.0, deadline_s=0.5)
    assert not world.alive


def test_a_world_collected_alive_stops_its_ranks_without_its_queues():
    """A World never closed, collected: its ranks are killed, and no queue is touched (a put starts a
    feeder thread, which a finalizer, running wherever the collector does, must not start)."""
    from unittest import mock

    from tp_kernels.testing import World

    world = World(1, backend="gloo")
    procs = list(world._procs)
    with mock.patch("multiprocessing.queues.Queue.put", side_effect=AssertionError("a queue was used")):
        world.__del__()
    for proc in procs:
        proc.join(timeout=10)
        assert not proc.is_alive()
    assert not world.alive
    world.close()  # (then closing is a no-op)


def test_single_process_without_torch_distributed():
    """Without init_process_group the layers act on one rank, like nn.Linear."""
    torch.manual_seed(0)
    dense = nn.Linear(13, 17)
    x = torch.randn(7, 13)
    col = tp_kernels.ColumnParallelLinear.from_linear(dense)
    row = tp_kernels.RowParallelLinear.from_linear(dense)
    assert col.tp_size == row.tp_size == 1
    assert tp_kernels.get_tensor_model_parallel_world_size() == 1 and tp_kernels.get_tensor_model_parallel_rank() == 0
    torch.testing.assert_close(col(x), dense(x), rtol=0, atol=0)
    torch.testing.assert_close(row(x), dense(x), rtol=1e-6, atol=1e-6)
    # 1-D input, as nn.Linear accepts
    torch.testing.assert_close(row(x[0]), dense(x[0]), rtol=1e-6, atol=1e-6)


def check_compiled_replicated_heads():
    """A column layer with a replicated key/value head compiles whole (fullgraph): the same output
    and gradients (the replicas' gradient sum included) as eager."""
    r, p = rank_world()
    torch.manual_seed(0)
    layer = tp_kernels.ColumnParallelLinear(6, 4 * p + 4, output_sizes=[4 * p, 2, 2], head_size=2)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))

    def run(fn):
        layer.zero_grad(set_to_none=True)
        out = fn(x)
        out.square().sum().backward()
        return [out.detach(), layer.weight.grad.clone(), layer.bias.grad.clone()]

    eager = run(layer)
    torch._dynamo.reset()
    compiled = run(torch.compile(layer, backend="aot_eager", fullgraph=True))
    for i, (got, want) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(got, want, msg=lambda m: f"output {i}: {m}")


def test_compiled_replicated_heads(world2):
    world2.run(check_compiled_replicated_heads, deadline_s=600)


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_own_pieces_of_rows_are_the_rows_of_the_own_pieces(shards):
    """A norm counts a replicated output's block once (``own_pieces``); of a block FSDP2 splits
    into ``shards`` runs of rows, the pieces each run counts are, together, those of the block."""
    from types import SimpleNamespace

    from tp_kernels.layers import own_pieces

    for r in range(4):  # [q, k, v] of 8, 2, 2 rows on 4 ranks: k and v replicated over pairs of ranks
        layer = SimpleNamespace(tp_size=4, tp_rank=r, split_parts=(8, 2, 2), split_blocks=(4, 2, 2))
        block_ = torch.arange(4 * 3, dtype=torch.float64).view(4, 3) + 100 * r
        whole = torch.cat(own_pieces(block_, 0, layer))
        assert whole.shape[0] == (4 if r % 2 == 0 else 2)  # the first rank of a pair counts k and v
        runs = block_.chunk(shards)
        starts = [sum(run.shape[0] for run in runs[:i]) for i in range(len(runs))]
        joined = [piece for run, start in zip(runs, starts) for piece in own_pieces(run, 0, layer, start=start)]
        assert torch.equal(torch.cat(joined), whole)



def check_torch_func(device="cpu", dtype=torch.float64, backend="auto"):
    """torch.func with the group's ranks (docs/api.md, Layers): vmap runs the layers and the
    collectives, each entry alike on every rank; torch.func.grad, vjp and jacrev through the layers
    (of their inputs and, by functional_call, of their parameters), a mapping and the
    cross-entropy give autograd's gradients, and vmap of grad the per-sample ones; a second
    derivative, and forward mode (jvp), raise on every rank, and the group still works. (On a GPU:
    test_gpu.py, float32 with the native path.)"""
    from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

    r, p = rank_world()
    torch.manual_seed(0)
    row = tp_kernels.RowParallelLinear(8, 6, dtype=dtype, device=device, backend=backend)
    col = tp_kernels.ColumnParallelLinear(8, 6, dtype=dtype, device=device, backend=backend)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 4, 8, generator=g, dtype=torch.float64).to(device, dtype)
    comm = tp_kernels.Communicator(device=device)
    for layer, x in ((col, xs), (row, block(xs, -1, r, p))):
        name = type(layer).__name__
        with torch.no_grad():
            batched = torch.stack([layer(xi) for xi in x])
            assert torch.equal(vmap(layer)(x), batched), name
        assert torch.equal(vmap(layer)(x), batched), f"{name}, its parameters wanting gradients"
        inp = x[0]

        def loss(v, layer=layer):
            return layer(v).square().sum()

        v = inp.clone().requires_grad_()
        layer.zero_grad()
        loss(v).backward()
        assert_close(f"torch.func.grad, {name}", grad(loss)(inp), v.grad)
        out, pull = vjp(layer, inp)
        assert_close(f"torch.func.vjp, {name}", pull(2 * out)[0], v.grad)
        # the output's Jacobian of the input, by the layers' formulas: the row layer's block of the
        # weight; the column layer's input gradient all-reduced, the sum of every rank's block
        weight = layer.weight.detach()
        if layer is col:
            weight = comm.all_reduce(weight)
        eye = torch.eye(inp.shape[0], dtype=dtype, device=device)
        assert_close(f"torch.func.jacrev, {name}", jacrev(layer)(inp), torch.einsum("ij,ok->iojk", eye, weight))
        # per-sample gradients: each row's share of the summed loss
        per_row = vmap(grad(loss))(inp.unsqueeze(1))
        assert_close(f"vmap(grad), {name}", per_row.squeeze(1), v.grad)
        # of the parameters, as functional training takes them
        params = {k: t.detach() for k, t in layer.named_parameters()}
        grads = grad(lambda ps, layer=layer: functional_call(layer, ps, (inp,)).square().sum())(params)
        for k, t in layer.named_parameters():
            assert_close(f"torch.func.grad of {k}, {name}", grads[k], t.grad)
        if p > 1:  # (with one rank a layer is F.linear: any order)
            with pytest.raises(RuntimeError, match="cannot be differentiated again"):
                grad(lambda u, loss=loss: grad(loss)(u).square().sum())(inp)
            # of the weight, through the input's gradient of a loss linear in the output (its gradient in a
            # constant: the weight reaches the input's gradient only as a tensor the formula saved)
            def linear(ps, u, layer=layer):
                return functional_call(layer, ps, (u,)).sum()

            with pytest.raises(RuntimeError, match="cannot be differentiated again"):
                grad(lambda ps, linear=linear: grad(linear, argnums=1)(ps, inp).square().sum())(params)
            with pytest.raises(RuntimeError, match="jvp"):
                jvp(layer, (inp,), (torch.ones_like(inp),))
    # a mapping, and the cross-entropy of logits split along the vocabulary
    x = xs[0]

    def reduced(v):
        return tp_kernels.mappings.reduce_from_tensor_model_parallel_region(v * (r + 1)).square().sum()

    v = x.clone().requires_grad_()
    reduced(v).backward()
    assert_close("torch.func.grad, reduce_from_tensor_model_parallel_region", grad(reduced)(x), v.grad)
    logits = torch.randn(5, 4 * p, generator=g, dtype=torch.float64).to(device, dtype)
    target = torch.randint(0, 4 * p, (5,), generator=g).to(device)
    weights = torch.arange(1.0, 6.0, dtype=dtype, device=device)

    def ce(z):
        return tp_kernels.vocab_parallel_cross_entropy(block(z, -1, r, p), target, 0.1).sum()

    z = logits.clone().requires_grad_()
    torch.nn.functional.cross_entropy(z, target, reduction="sum", label_smoothing=0.1).backward()
    assert_close("torch.func.grad, vocab_parallel_cross_entropy", block(grad(ce)(logits), -1, r, p),
                 block(z.grad, -1, r, p))  # (this rank's block: the others' columns are not its input)

    def entropy(z):
        return (tp_kernels.vocab_parallel_entropy(block(z, -1, r, p)) * weights).sum()

    z = logits.clone().requires_grad_()
    (torch.distributions.Categorical(logits=z).entropy() * weights).sum().backward()
    assert_close("torch.func.grad, vocab_parallel_entropy", block(grad(entropy)(logits), -1, r, p),
                 block(z.grad, -1, r, p))
    # the embedding's weight, by functional_call: every rank's rows of the dense gradient
    emb = tp_kernels.VocabParallelEmbedding(4 * p, 3, dtype=dtype, device=device)
    ids = torch.randint(0, 4 * p, (2, 5), generator=g).to(device)
    emb(ids).square().sum().backward()
    got = grad(lambda ps: functional_call(emb, ps, (ids,)).square().sum())({"weight": emb.weight.detach()})
    assert_close("torch.func.grad of the embedding's weight", got["weight"], emb.weight.grad)
    # collectives: of tensors that need no gradient inside a function torch.func differentiates,
    # and batched
    summed = vmap(comm.all_reduce)(torch.full((2, 3), float(r + 1), device=device))
    assert torch.equal(summed, torch.full((2, 3), float(p * (p + 1) // 2), device=device))
    w = torch.randn(3, generator=g).to(device)
    assert torch.equal(grad(lambda v: (v * comm.all_reduce(torch.ones(3, device=device))).sum())(w),
                       torch.full((3,), float(p), device=device))
    if p > 1:  # a Communicator collective has no gradient: its backward raises
        with pytest.raises(RuntimeError, match="Communicator.all_reduce has no gradient"):
            grad(lambda v: comm.all_reduce(v).sum())(w)
    # the group still works, alike on every rank
    return row(block(x, -1, r, p)).sum().item()


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_torch_func(world):
    """In float64 on the reference path, and in float32 on the portable pipelined schedule (its
    chunks written into a buffer); at 4 ranks the column layer's 6 outputs are padded."""
    for args in ((), ("cpu", torch.float32, "pipelined")):
        sums = world.run(check_torch_func, *args)
        assert len(set(sums)) == 1  # the row layer's all-reduced output, alike on every rank


def check_inference_runs_the_local_gemm(device="cpu", backend="auto"):
    """A column layer without sequence parallelism whose backward is not recorded (``no_grad``,
    ``inference_mode``, inputs and parameters without a gradient) runs its forward as the local
    GEMM itself, with no op of tp_kernels but the gathers it communicates (``gather_output``), and
    gives what the same call recording its backward gives (bit for bit on ``backend``'s reference;
    on the native path, whose forward ran cuBLASLt, within the tolerance); on host tensors a named
    backend that cannot run the call still says so; one that records its backward runs the op."""
    from tp_kernels import _library

    r, p = rank_world()
    torch.manual_seed(0)
    kw = {"device": device, "backend": backend}
    layers = {
        "plain": tp_kernels.ColumnParallelLinear(13, 17 * p, **kw),
        "gather_output": tp_kernels.ColumnParallelLinear(13, 17 * p, gather_output=True, **kw),
        "padded": tp_kernels.ColumnParallelLinear(13, 17 * p + 1, **kw),
        "replicated heads": tp_kernels.ColumnParallelLinear(13, 4 * p + 4, output_sizes=[4 * p, 2, 2], head_size=2,
                                                            **kw),
    }
    x = torch.randn(5, 3, 13, generator=torch.Generator().manual_seed(1)).to(device)
    exact = backend == "reference" or device == "cpu"  # (the op's forward on the native path is cuBLASLt's)
    called = []
    original = _library.op

    def counted(name):
        called.append(name)
        return original(name)

    _library.op = counted
    try:
        for name, layer in layers.items():
            called.clear()
            want = layer(x)
            assert want.requires_grad and "linear_with_grad_all_reduce" in called, (name, called)
            for context in (torch.no_grad, torch.inference_mode):
                called.clear()
                with context():
                    got = layer(x)
                assert not got.requires_grad, name
                assert "linear_with_grad_all_reduce" not in called, (name, context, called)
                assert called == (["all_gather"] if layer.gather_output else []), (name, context, called)
                if exact:
                    assert torch.equal(got, want.detach()), (name, context)
                else:  # (float32: torch's GEMM and cuBLASLt's differ in their last bits; -inf in the padding alike)
                    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
            layer.requires_grad_(False)  # grad mode on, nothing requiring a gradient
            called.clear()
            got = layer(x)
            assert "linear_with_grad_all_reduce" not in called and (not exact or torch.equal(got, want.detach())), name
            layer.requires_grad_(True)
    finally:
        _library.op = original
    if device == "cpu":
        fused = tp_kernels.ColumnParallelLinear(13, 17 * p, backend="fused")
        with torch.no_grad(), pytest.raises(ValueError, match="backend: 'fused' cannot run"):
            fused(x)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_inference_runs_the_local_gemm(world):
    world.run(check_inference_runs_the_local_gemm)
