"""The ops and the layers (forward+backward) on every backend, at models' shapes (see conftest)."""

import math

import torch
import torch.distributed as dist

import tp_kernels
from tp_kernels import ops
from tp_kernels.bench.measure import buffer_sets

def _shares(case, tp: int, world: int):
    """``(x shape, W shape)`` of one rank: real shards when the group has ``tp`` ranks; with one
    rank, the operands of one rank's GEMM in a ``tp``-way split (the gathered x for column)."""
    if world == tp:
        return case.local(tp)
    if case.kind == "column":
        return (case.m, case.k), (case.n // tp, case.k)
    return (case.m, case.k // tp), (case.n, case.k // tp)


def _run(benchmark, fn, device, rounds, n, info):
    benchmark.extra_info.update(info)
    calls = iter(range(1 << 62))

    def call():
        fn(next(calls) % n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    benchmark.pedantic(call, rounds=rounds, warmup_rounds=2, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None and stats.stats.median > 0:
        benchmark.extra_info["tflops"] = info["flops"] / stats.stats.median / 1e12


def test_op(benchmark, world, rounds, case, tp, dtype, backend):
    group, device = world
    p = dist.get_world_size(group)
    dtype = getattr(torch, dtype)
    x_shape, w_shape = _shares(case, tp, p)
    if case.target == "all_gather_matmul" and p == tp:
        x_shape = (case.m // tp, case.k)
    n = buffer_sets((math.prod(x_shape) + math.prod(w_shape)) * torch.empty((), dtype=dtype).element_size(),
                    device.type == "cuda")
    xs = [torch.randn(x_shape, device=device, dtype=dtype) for _ in range(n)]
    ws = [torch.randn(w_shape, device=device, dtype=dtype) for _ in range(n)]
    op = getattr(ops, case.target)
    out = op(xs[0], ws[0], group=group, backend=backend)
    m_out = case.m // tp if case.target == "matmul_reduce_scatter" and p == tp else case.m
    assert out.shape == (m_out, w_shape[0]) and torch.isfinite(out).all()
    flops = 2.0 * case.m * w_shape[0] * w_shape[1]
    _run(benchmark, lambda i: op(xs[i], ws[i], group=group, backend=backend), device, rounds, n,
         {**case.as_dict(), "tp": tp, "ranks": p, "backend": backend, "flops": flops})


def test_layer(benchmark, world, rounds, case, tp, dtype, backend):
    group, device = world
    p = dist.get_world_size(group)
    dtype = getattr(torch, dtype)
    x_shape, w_shape = _shares(case, tp, p)
    cls = tp_kernels.ColumnParallelLinear if case.kind == "column" else tp_kernels.RowParallelLinear
    in_f, out_f = (case.k, case.n) if p == tp else (w_shape[1], w_shape[0])
    if case.kind == "column" and case.sequence_parallel and p == tp:
        x_shape = (case.m // tp, case.k)
    layer = cls(in_f, out_f, sequence_parallel=case.sequence_parallel, backend=backend, device=device,
                dtype=dtype, group=group)
    n = buffer_sets(math.prod(x_shape) * torch.empty((), dtype=dtype).element_size(), device.type == "cuda")
    xs = [torch.randn(x_shape, device=device, dtype=dtype, requires_grad=True) for _ in range(n)]
    dy = torch.randn_like(layer(xs[0]))

    def step(i):
        xs[i].grad = None
        layer.zero_grad(set_to_none=True)
        layer(xs[i]).backward(dy)

    step(0)
    assert xs[0].grad.shape == xs[0].shape and torch.isfinite(layer.weight.grad).all()
    flops = 3 * 2.0 * case.m * w_shape[0] * w_shape[1]
    _run(benchmark, step, device, rounds, n,
         {**case.as_dict(), "tp": tp, "ranks": p, "backend": backend, "flops": flops})
