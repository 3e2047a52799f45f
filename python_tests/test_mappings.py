"""Megatron's mappings, with exact rank-valued identities (every value is a small integer)."""

from __future__ import annotations

import pytest
import torch

from tp_kernels import mappings as M
from helpers import CopiedBytes, block, rank_world


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


def check_sequence_dim_mappings():
    """The sequence-parallel mappings along ``sequence_dim`` (a batch-first ``[b, s, h]``: 1, or
    -2): each is the dim-0 mapping of the tensor with that dim moved first, forward and backward,
    and gives a contiguous tensor in the caller's layout, copying at most the whole tensor once
    each way beyond what the dim-0 mapping copies (the blocks joined after a gather, stacked before
    a reduce-scatter; a split's block); a dim that is the last one, or that p does not divide, is a ValueError
    naming it."""
    r, p = rank_world()
    g = torch.Generator().manual_seed(r)  # (different data on each rank)
    x = torch.randn(3, 2 * p, 4, generator=g, dtype=torch.float64)
    dy_full, dy_block = torch.randn(3, 2 * p, 4, generator=g, dtype=torch.float64), torch.randn(3, 2, 4, generator=g,
                                                                                                dtype=torch.float64)
    front = lambda t: t.transpose(0, 1).contiguous()  # noqa: E731
    whole = 0 if p == 1 else x.numel() * x.element_size()  # (bytes; one rank copies nothing)
    # (mapping, input, output gradient, options, bytes copied beyond the dim-0 mapping's: forward, backward)
    cases = [(M.scatter_to_sequence_parallel_region, x, dy_block, {}, (whole // p, whole)),  # (dim 0's block: a view)
             (M.gather_from_sequence_parallel_region, x[:, :2].contiguous(), dy_full, {}, (whole, whole)),
             (M.gather_from_sequence_parallel_region, x[:, :2].contiguous(), dy_full,
              {"tensor_parallel_output_grad": False}, (whole, whole // p)),
             (M.reduce_scatter_to_sequence_parallel_region, x, dy_block, {}, (whole, whole))]
    for f, inp, dy, kw, extra in cases:
        for dim in (1, -2):
            mine, ref = _leaf(inp), _leaf(front(inp))
            outs, copied = [], []
            for leaf, grad, options in ((mine, dy, {"sequence_dim": dim}), (ref, front(dy), {})):
                with CopiedBytes() as forward:
                    outs.append(f(leaf, **options, **kw))
                with CopiedBytes() as backward:
                    outs[-1].backward(grad)
                copied.append((forward.floating, backward.floating))
            y, want = outs
            assert y.is_contiguous() and torch.equal(y, want.transpose(0, 1)), (f.__name__, kw, dim)
            assert torch.equal(mine.grad, ref.grad.transpose(0, 1)), (f.__name__, kw, dim)
            more = tuple(a - b for a, b in zip(*copied))
            assert more == extra, f"{f.__name__} {kw} dim {dim}: copied {more} bytes more than dim 0, not {extra}"
    with pytest.raises(ValueError, match=r"sequence_dim: expected a dim of input other than its last, in \[-3, 1\] "
                                         r"for input of shape \(3, 4, 4\), got 2"):
        M.scatter_to_sequence_parallel_region(torch.zeros(3, 4, 4), sequence_dim=2)
    if p > 1:
        with pytest.raises(ValueError, match=rf"input.shape\[1\] \({2 * p + 1}\) is not divisible"):
            M.reduce_scatter_to_sequence_parallel_region(torch.zeros(3, 2 * p + 1, 4), sequence_dim=1)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_sequence_dim_mappings(world):
    world.run(check_sequence_dim_mappings)


def check_gather_for_column_layers():
    """``gather_for_column_layers``: the gathered input of two column layers (which leave their
    partial input gradients for its one reduce-scatter) and of a computation of its own (an output
    every rank computes whole, whose gradient is complete on every rank: its backward keeps this
    rank's block of it), gathered along dim 1, the second layer taking it reshaped (``view(-1, h)``,
    as a mixture of experts' block hands its experts the tokens): the outputs and the input's
    gradient are the dense ones, in float64; a ``torch.compile``d call (a plain gather, each column
    layer then all-reducing its own) gives them too. A part of it, or another order of it, is not
    taken as it (its gradient then comes by autograd)."""
    import copy

    import tp_kernels

    r, p = rank_world()
    torch.manual_seed(0)
    dense_a, dense_b = torch.nn.Linear(4, 2 * p).double(), torch.nn.Linear(4, 3 * p).double()
    a, b = (tp_kernels.ColumnParallelLinear.from_linear(copy.deepcopy(m)) for m in (dense_a, dense_b))
    x = torch.randn(3, 2 * p, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def model(g, first, second):
        return first(g), second(g.view(-1, 4)).view(*g.shape[:-1], -1), g.square() * 3

    full = x.clone().requires_grad_()
    want = model(full, dense_a, dense_b)
    g = torch.Generator().manual_seed(2)
    dys = [torch.randn(t.shape, dtype=torch.float64, generator=g) for t in want]
    torch.autograd.backward(want, dys)
    columns = [lambda t: block(t, -1, r, p)] * 2 + [lambda t: t]  # (this rank's columns; the own output whole)
    for compiled in (False, True):
        mine = block(x, 1, r, p).clone().requires_grad_()

        def run(m):
            return model(M.gather_for_column_layers(m, sequence_dim=1), a, b)

        got = torch.compile(run, backend="aot_eager")(mine) if compiled else run(mine)
        for y, w, part in zip(got, want, columns):
            torch.testing.assert_close(y, part(w.detach()), rtol=1e-12, atol=1e-12)
        torch.autograd.backward(got, [part(dy) for dy, part in zip(dys, columns)])
        torch.testing.assert_close(mine.grad, block(full.grad, 1, r, p), rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"compiled {compiled}: {m}")
        torch._dynamo.reset()
    if p > 1:
        group = tp_kernels._collectives.resolve_group(None)
        gathered = M.gather_for_column_layers(block(x, 1, r, p).clone().requires_grad_(), sequence_dim=1)
        assert M.partial_grads_of(gathered, group)[1] and M.partial_grads_of(gathered.view(-1, 4), group)[1]
        assert not M.partial_grads_of(gathered[:, :1], group)[1]
        assert not M.partial_grads_of(gathered.transpose(0, 1), group)[1]
        assert not M.partial_grads_of(gathered.view(-1)[4:].view(-1, 4), group)[1]
        assert not M.partial_grads_of(gathered[:1], group)[1]  # where it starts, but not all of it
        # only column layers of its own group take it unread, or leave their gradients in it
        unread = M.gather_for_column_layers(block(x, 1, r, p).clone().requires_grad_(), sequence_dim=1)
        other = object()  # another group
        assert M.deferred_block(unread, group) is unread
        assert M.deferred_block(unread, other) is None and not M.partial_grads_of(unread, other)[1]
        assert unread.gathered() is unread.gathered()  # gathered once
        assert M.deferred_block(unread, group) is None  # read: gathered, its block no longer stands for it
        # an op of torch's writing in place on it writes the gathered tensor, which later reads see
        written = M.gather_for_column_layers(block(x, 1, r, p).clone(), sequence_dim=1)
        assert written.mul_(2) is written and torch.equal(written.gathered(), 2 * x)
        assert torch.equal(written + 0, 2 * x)
        # a backward run again over the graph it kept gives the same gradient (the partial
        # gradients left by the first are not added to the second's)
        mine = block(x, 1, r, p).clone().requires_grad_()
        outs = model(M.gather_for_column_layers(mine, sequence_dim=1), a, b)
        loss = sum((y * part(dy)).sum() for y, dy, part in zip(outs, dys, columns))
        loss.backward(retain_graph=True)
        first, mine.grad = mine.grad, None
        loss.backward()
        torch.testing.assert_close(mine.grad, first, rtol=0, atol=0)
        torch.testing.assert_close(first, block(full.grad, 1, r, p), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_gather_for_column_layers(world):
    world.run(check_gather_for_column_layers)


def check_mappings_under_torch_func():
    """Every public mapping under ``torch.func`` (docs/api.md): ``grad`` of a loss through it is
    autograd's gradient of the same loss, and ``vmap`` of it over a leading batch dim is the mapping
    of each entry, stacked (its collectives run entry by entry, alike on every rank; the mapping's
    dims, ``sequence_dim`` too, those of one entry). ``gather_for_column_layers`` there is a plain
    gather (no :class:`DeferredGather`, which the transforms cannot trace)."""
    from torch.func import grad, vmap

    r, p = rank_world()
    g = torch.Generator().manual_seed(r)  # (different data on each rank)
    x = torch.randn(2 * p, 2 * p, 3 * p, generator=g, dtype=torch.float64)
    weight = torch.randn(2 * p * p, 2 * p * p, 3 * p * p, generator=torch.Generator().manual_seed(7),
                         dtype=torch.float64)
    cases = {
        "copy_to_tensor_model_parallel_region": M.copy_to_tensor_model_parallel_region,
        "reduce_from_tensor_model_parallel_region": M.reduce_from_tensor_model_parallel_region,
        "scatter_to_tensor_model_parallel_region": M.scatter_to_tensor_model_parallel_region,
        "gather_from_tensor_model_parallel_region": M.gather_from_tensor_model_parallel_region,
        "scatter_to_sequence_parallel_region": M.scatter_to_sequence_parallel_region,
        "scatter_to_sequence_parallel_region, sequence_dim 1":
            lambda t: M.scatter_to_sequence_parallel_region(t, sequence_dim=1),
        "gather_from_sequence_parallel_region": M.gather_from_sequence_parallel_region,
        "gather_from_sequence_parallel_region, tensor_parallel_output_grad False":
            lambda t: M.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False),
        "reduce_scatter_to_sequence_parallel_region": M.reduce_scatter_to_sequence_parallel_region,
        "gather_for_column_layers": M.gather_for_column_layers,
        "gather_for_column_layers, sequence_dim -2": lambda t: M.gather_for_column_layers(t, sequence_dim=-2),
        "reduce_scatter_to_sequence_parallel_region, sequence_dim 1":
            lambda t: M.reduce_scatter_to_sequence_parallel_region(t, sequence_dim=1),
    }
    for name, f in cases.items():
        def loss(v, f=f):  # (weighted: every element of the output a gradient of its own)
            y = f(v)
            return (y * weight[: y.shape[0], : y.shape[1], : y.shape[2]]).sum() + y.square().sum()

        leaf = x.clone().requires_grad_()
        loss(leaf).backward()
        got = grad(loss)(x)
        assert type(got) is torch.Tensor, name
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"grad, {name}: {m}")
        batch = torch.stack([x, 2 * x + 1])
        mapped = vmap(f)(batch)
        assert type(mapped) is torch.Tensor, name
        stacked = torch.stack([f(entry) + 0 for entry in batch])  # (+ 0: a DeferredGather read)
        torch.testing.assert_close(mapped, stacked, rtol=0, atol=0, msg=lambda m: f"vmap, {name}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_mappings_under_torch_func(world):
    world.run(check_mappings_under_torch_func)
