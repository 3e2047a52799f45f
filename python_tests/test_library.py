"""The custom ops: torch.library.opcheck, and torch.compile of a parallel MLP equal to eager."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import tp_kernels
from tp_kernels._collectives import group_name
from helpers import assert_close, block, rank_world

OPS = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "linear_with_grad_all_reduce"]


def check_opcheck(op, device="cpu"):
    r, p = rank_world()
    group = group_name(dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    rows = 2 * p if op == "matmul_reduce_scatter" else 3
    impls = ["reference", "pipelined:2"]
    if device == "cuda" and tp_kernels.extension_status()["built"]:
        impls.append("native:2")  # what "pipelined" runs on CUDA tensors
    for impl in impls:
        for bias in (True, False):
            x = torch.randn(rows, 5, generator=g).to(device).requires_grad_()
            w = torch.randn(4, 5, generator=g).to(device).requires_grad_()
            b = torch.randn(4, generator=g).to(device).requires_grad_() if bias else None
            torch.library.opcheck(getattr(torch.ops.tp_kernels, op), (x, w, b, group, impl))


@pytest.mark.parametrize("world", [1, 2], indirect=True)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(world, op):
    world.run(check_opcheck, op)


class _Recorder:
    """A torch.compile backend that records the captured graphs' call targets."""

    def __init__(self):
        self.targets = []

    def __call__(self, gm, example_inputs):
        self.targets += [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward


def check_compiled_mlp(sequence_parallel, backend, device="cpu", sequence_dim=0):
    """A column-row pair compiled (each op one opaque node; with ``sequence_dim=1``, batch-first,
    the moves of the sequence plain aten around them) gives the eager output and gradients."""
    r, p = rank_world()
    torch.manual_seed(0)
    sequence = {"sequence_parallel": sequence_parallel, "sequence_dim": sequence_dim}
    fc1 = tp_kernels.ColumnParallelLinear(8, 6 * p, device=device, **sequence)
    fc2 = tp_kernels.RowParallelLinear(6 * p, 8, device=device, **sequence)
    model = nn.Sequential(fc1, nn.GELU(), fc2)
    shape = (3, 2 * p, 8) if sequence_dim else (2 * p, 3, 8)
    x_full = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    x_in = block(x_full, sequence_dim, r, p) if sequence_parallel else x_full

    def run(m):
        x = x_in.clone().requires_grad_()
        y = m(x)
        y.square().sum().backward()
        grads = [q.grad.clone() for q in model.parameters()] + [x.grad]
        model.zero_grad(set_to_none=True)
        return [y.detach()] + grads

    eager = run(model)
    torch._dynamo.reset()
    if backend == "record":
        recorder = _Recorder()
        compiled = run(torch.compile(model, backend=recorder))
        ops = torch.ops.tp_kernels
        wanted = ({ops.all_gather_matmul, ops.matmul_reduce_scatter} if sequence_parallel
                  else {ops.linear_with_grad_all_reduce, ops.matmul_all_reduce})
        assert wanted <= set(recorder.targets), recorder.targets  # each op is one opaque node
    else:
        compiled = run(torch.compile(model, backend=backend))
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert_close(f"compiled result {i}", c, e.double())


@pytest.mark.parametrize("sequence_parallel, sequence_dim", [(False, 0), (True, 0), (True, 1)])
@pytest.mark.parametrize("backend", ["record", "inductor"])
def test_compiled_mlp_matches_eager(world2, sequence_parallel, sequence_dim, backend):
    world2.run(check_compiled_mlp, sequence_parallel, backend, sequence_dim=sequence_dim, deadline_s=600)


class _Subclass(torch.Tensor):
    """A tensor subclass that changes nothing (torch's default ``__torch_function__``)."""


class _OpsSeen(TorchDispatchMode):
    """A dispatch mode that lists the ops it sees, and runs them."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def check_eager_calls_skip_the_dispatcher(op_name):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from tp_kernels import _library

    r, p = rank_world()
    group = group_name(dist.group.WORLD)
    op = _library.op(op_name)
    dispatched = []
    real = op.op
    op.op = lambda *args: dispatched.append(1) or real(*args)
    try:
        g = torch.Generator().manual_seed(r)
        rows = 2 * p if op_name == "matmul_reduce_scatter" else 3
        x, w, b = (torch.randn(*s, generator=g) for s in ((rows, 5), (4, 5), (4,)))
        grads = []
        for call in (op, real):  # directly, then through the dispatcher: the same values and gradients
            xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
            y = call(xs, ws, bs, group, "reference")
            (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
            grads.append([y.detach(), xs.grad, ws.grad, bs.grad])
        assert dispatched == []  # the first call, with its backward, never reached the dispatcher
        for got, want in zip(*grads):
            assert torch.equal(got, want)
        with torch.no_grad():
            assert torch.equal(op(x, w, b, group, "reference"), grads[0][0]) and dispatched == []
            # A tensor subclass (DTensor, say) goes through the dispatcher, where it can intercept the op
            sub = op(x.as_subclass(_Subclass), w, b, group, "reference")
            assert type(sub) is _Subclass and torch.equal(sub.as_subclass(torch.Tensor), grads[0][0])
            assert dispatched == [1]
        # Traced or faked, the call is the one op
        gm = make_fx(lambda a, c, d: op(a, c, d, group, "reference"))(x, w, b)
        assert getattr(torch.ops.tp_kernels, op_name).default in [n.target for n in gm.graph.nodes]
        with FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b), group, "reference")
        assert fake.shape == grads[0][0].shape and len(dispatched) == 3
        # A dispatch mode alone (no function mode, plain tensors) sees the one op too
        with _OpsSeen() as seen, torch.no_grad():
            assert torch.equal(op(x, w, b, group, "reference"), grads[0][0])
        assert seen.ops[0] is getattr(torch.ops.tp_kernels, op_name).default and len(dispatched) == 4, seen.ops
    finally:
        op.op = real


@pytest.mark.parametrize("world", [1, 2], indirect=True)
@pytest.mark.parametrize("op", OPS)
def test_eager_calls_skip_the_dispatcher_and_traced_ones_do_not(world, op):
    world.run(check_eager_calls_skip_the_dispatcher, op)




def check_gradients_are_first_order():
    """A gradient through the layers, the mappings, the embedding or the cross-entropy taken with
    ``create_graph=True`` (to differentiate it again) raises, naming what it went through: its
    second derivative would need collectives no formula has, and came out silently wrong before
    (by 0.09 on a column -> row pair, with only PyTorch's warning). Without it, the same
    gradients are taken as ever."""
    r, p = rank_world()
    torch.manual_seed(0)
    fc1, fc2 = tp_kernels.ColumnParallelLinear(4, 2 * p), tp_kernels.RowParallelLinear(2 * p, 3)
    emb = tp_kernels.VocabParallelEmbedding(4 * p, 4)
    m = tp_kernels.mappings
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(r), requires_grad=True)
    cases = {  # name in the message: (loss, the tensor it is differentiated by)
        "matmul_all_reduce": (lambda: fc2(fc1(x).tanh()).tanh().sum(), x),
        "gather_from_tensor_model_parallel_region": (lambda: m.gather_from_tensor_model_parallel_region(
            m.copy_to_tensor_model_parallel_region(x)).tanh().sum(), x),  # the first formula to run
        "gather_from_sequence_parallel_region": (lambda: m.gather_from_sequence_parallel_region(x).tanh().sum(), x),
        "reduce_from_tensor_model_parallel_region": (lambda: emb(torch.tensor([0, 4 * p - 1])).tanh().sum(),
                                                     emb.weight),
        "vocab_parallel_cross_entropy": (
            lambda: tp_kernels.vocab_parallel_cross_entropy(x, torch.tensor([0, 1, 2 * p])).sum(), x),
    }
    for name, (loss_of, leaf) in cases.items():
        with pytest.raises(RuntimeError, match=f"tp_kernels: {name}: its gradient cannot be differentiated again"):
            torch.autograd.grad(loss_of(), leaf, create_graph=True)
        (grad,) = torch.autograd.grad(loss_of(), leaf)
        assert grad.shape == leaf.shape and torch.isfinite(grad).all(), name


def test_gradients_are_first_order(world2):
    world2.run(check_gradients_are_first_order)


def check_one_rank_is_a_linear_layer():
    """With one rank, a layer is ``F.linear`` itself, as ``nn.Linear`` is, on every backend that
    runs the call: a gradient penalty (a second derivative) through a column -> row pair equals
    the dense model's in float64, on every layout; ``"fused"``, which cannot run on host tensors,
    says so (a 3-D input as a 2-D one)."""
    torch.manual_seed(0)
    dense1, dense2 = torch.nn.Linear(4, 6).double(), torch.nn.Linear(6, 3).double()
    x = torch.randn(5, 2, 4, dtype=torch.float64)

    def penalty(f1, f2, params):
        xx = x.clone().requires_grad_()
        (dx,) = torch.autograd.grad(f2(f1(xx).tanh()).tanh().sum(), xx, create_graph=True)
        return torch.autograd.grad(dx.square().sum(), params)

    want = penalty(dense1, dense2, [*dense1.parameters(), *dense2.parameters()])
    for backend, sp, gather in itertools.product(["auto", "reference", "pipelined"], [False, True], [False, True]):
        fc1 = tp_kernels.ColumnParallelLinear.from_linear(dense1, backend=backend, sequence_parallel=sp,
                                                          gather_output=gather)
        fc2 = tp_kernels.RowParallelLinear.from_linear(dense2, backend=backend, sequence_parallel=sp)
        got = penalty(fc1, fc2, [*fc1.parameters(), *fc2.parameters()])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{backend} sp={sp}: {m}")
    for call in (lambda: tp_kernels.matmul_all_reduce(x, dense1.weight, backend="fused"),
                 lambda: tp_kernels.all_gather_matmul(x.reshape(10, 4), dense1.weight, backend="fused"),
                 lambda: tp_kernels.RowParallelLinear.from_linear(dense1, backend="fused")(x)):
        with pytest.raises(ValueError, match="backend: 'fused' cannot run"):
            call()


@pytest.mark.parametrize("world", [1], indirect=True)
def test_one_rank_is_a_linear_layer(world):
    world.run(check_one_rank_is_a_linear_layer)
