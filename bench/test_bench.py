"""The ops and the layers (forward+backward) on every backend, at models' shapes (see conftest)."""

import math

import pytest
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


@pytest.mark.parametrize("call", ["f_linear", "reference", "pipelined", "auto"])
def test_host_time(benchmark, world, call):
    """Host time of one eager call on tiny host tensors (m = 16, k = n = 64, float32): what
    tp_kernels' Python adds over ``F.linear`` (``f_linear``, the baseline) before any GEMM or
    communication cost. Compare the medians; one rank: nothing is communicated."""
    group, _ = world
    if dist.get_world_size(group) != 1:
        pytest.skip("a one-rank group: the figure is the host time of the call, not of a collective")
    x, w = torch.randn(16, 64), torch.randn(64, 64)
    fn = ((lambda: torch.nn.functional.linear(x, w)) if call == "f_linear"
          else (lambda: ops.matmul_all_reduce(x, w, group=group, backend=call)))
    assert torch.equal(fn(), torch.nn.functional.linear(x, w))
    benchmark.extra_info.update({"call": call, "shape": [16, 64, 64]})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny GEMM: no thread pool's wake-up in the figure
    try:
        benchmark.pedantic(fn, rounds=200, iterations=100, warmup_rounds=5)
    finally:
        torch.set_num_threads(threads)
