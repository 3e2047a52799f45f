"""The primitives as ``torch.library`` custom ops (``torch.ops.tp_kernels.*``).

They are defined on a ``torch.library.Library`` (:func:`_define`; the three that write into an
argument with ``torch.library.custom_op``) and called through :func:`op`, which runs an eager
call's body without the dispatcher. Each op has a fake (meta) implementation, so
``torch.compile`` treats it as one opaque node (no graph break inside it), and its backward is
registered with ``register_autograd`` as another custom op. The ops take 2-D tensors, the group
by name (``""``: this process alone) and an implementation name (``"native:4"``,
``"fused:two_shot"``: :mod:`tp_kernels.backends`), decided before the call by
:func:`tp_kernels.dispatch.select_backend`; the backward runs on the same implementation (an
all-gather's or reduce-scatter's backward primitive in its own chunks:
:func:`tp_kernels.backends.backward_name`). :mod:`tp_kernels.ops` checks the arguments and decides
before calling them.

Backward ops return an empty tensor for a gradient that is not needed (a custom op cannot
return None); the autograd wrappers turn those back into None.

The plain collectives of :class:`tp_kernels.Communicator` are custom ops too (``all_reduce``,
``all_reduce_out``, ``all_reduce_inplace``, ``all_gather``, ``reduce_scatter``, ``gather``,
``broadcast``, ``broadcast_copy``), over dim 0 of contiguous tensors, with the implementation
decided before the call (:func:`tp_kernels.dispatch.resolve_collective`). The formula of each that
makes a new tensor is a backward that raises (:func:`_no_gradient`: serving runs without gradients;
:mod:`tp_kernels.mappings` has the differentiable ones); one that writes, called with a gradient
recorded, copies such an op's result in (:func:`_define_mutating`).

Every op takes part in a collective (but :func:`refuse_gradient`, which raises), so every op is
marked as having side effects (``torch.fx.node.has_side_effect``): a compiled graph keeps it where
this rank does not use its result, since the peers wait for it.
"""

import inspect
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import increment_version
from torch.fx.node import has_side_effect

from . import _collectives as coll
from ._checks import differentiable_once, functorch_transforms, wants_grad, with_eager_form
from ._op_table import collective_output_shape
from .backends import backward_name, run, run_collective

__all__: list = []  # the ops are torch.ops.tp_kernels.*

try:
    from torch.library import infer_schema as _infer_schema
except ImportError:  # torch 2.4
    from torch._library.infer_schema import infer_schema as _infer_schema

_LIB = torch.library.Library("tp_kernels", "DEF")


#: every op of this module by name, as an :class:`_Op`
_OPS: Dict[str, "_Op"] = {}


def op(name: str) -> Callable:
    """``torch.ops.tp_kernels.<name>`` as callers here call it (:class:`_Op`: in plain eager
    calls, without the dispatcher)."""
    return _OPS[name]


#: the tensor types an op's body may take without the dispatcher (a parameter is a tensor)
_PLAIN = (Tensor, torch.nn.Parameter)
#: what :func:`_route` answers
_BODY, _FUNCTION, _DISPATCHER = range(3)


def _route(args) -> int:
    """How a call runs: the op's body as it is (:data:`_BODY`) or through its autograd formula
    (:data:`_FUNCTION`, a gradient is needed) when it may skip the dispatcher, that is with no
    ``torch.compile`` tracing, no dispatch or function mode (``make_fx``, export, fake tensors),
    no functorch transform, and every tensor a plain tensor or parameter (no subclass that would
    intercept the op); otherwise through ``torch.ops.tp_kernels`` (:data:`_DISPATCHER`), where
    all of those see one op."""
    if _is_compiling() or _dispatch_modes() or _function_modes() or functorch_transforms():
        return _DISPATCHER
    grad = False
    for a in args:
        if isinstance(a, Tensor):
            if type(a) not in _PLAIN:
                return _DISPATCHER
            grad = grad or a.requires_grad
    return _FUNCTION if grad and _grad_enabled() else _BODY


# what _route asks, bound once (each attribute lookup on ``torch`` costs host time on every call)
_is_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled
_dispatch_modes, _function_modes = torch._C._len_torch_dispatch_stack, torch._C._is_torch_function_mode_enabled


class _Op:
    """An op defined by :func:`_define` or :func:`_define_mutating`, with ``register_fake`` and
    ``register_autograd`` as on a ``torch.library.custom_op``. Called, it runs its implementation
    directly when nothing traces or transforms the call (:func:`_route`): as it is when no gradient
    is needed (then bumping the version counter of each tensor it writes, as the dispatcher's
    ADInplaceOrView kernel does), else through a ``torch.autograd.Function`` of the registered
    formula, the same one the dispatcher's autograd kernel runs; otherwise through the dispatcher
    (an op that writes has no formula: a call of one that records a gradient runs what
    :func:`_define_mutating` says instead). The direct call saves the host time of the dispatcher
    and of its Python wrappers (about 6 µs a call, 14 µs for a ``custom_op`` that writes). Under a
    ``torch.func`` transform with a gradient needed, the formula runs as a ``torch.autograd.Function``
    around the dispatcher's op (:attr:`transformed`: torch's own function for a registered formula
    has no ``setup_context``, which the transforms need; its forward, batched by ``vmap``, runs each
    entry of the batch in turn)."""

    def __init__(self, name: str, fn: Callable, custom=None, written: Tuple[int, ...] = (),
                 recorded: Optional[Callable] = None):
        self.qualname = f"tp_kernels::{name}"
        self.custom = custom  # the torch.library.custom_op of an op that writes, else None
        self.recorded = recorded  # what a call of an op that writes runs instead when it records a gradient
        self.op = custom if custom is not None else getattr(torch.ops.tp_kernels, name)
        self.fn = fn
        self.written = written  # positions of the arguments it writes
        self.function: Optional[type] = None  # the autograd.Function, once a formula is registered
        self.transformed: Optional[type] = None  # the same around the dispatcher's op, for torch.func
        # Every op here takes part in a collective with its peers, so none may be dropped from a
        # compiled graph because its result goes unused on this rank (Communicator.gather off the
        # root, a result kept on one rank only): the peers would wait for it.
        has_side_effect(getattr(torch.ops.tp_kernels, name).default)

    def __call__(self, *args):
        route = _route(args)
        if route == _BODY:
            out = self.fn(*args)
            for i in self.written:
                increment_version(args[i])
            return out
        if self.custom is not None and wants_grad(args):
            self.recorded(*args)
            return None
        if self.function is not None and route == _FUNCTION:
            return self.function.apply(*args)
        if self.transformed is not None and functorch_transforms() and wants_grad(args):
            return self.transformed.apply(*args)
        return self.op(*args)

    def register_fake(self, fn: Callable) -> Callable:
        if self.custom is not None:
            return self.custom.register_fake(fn)
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_no_gradient(self, call: str) -> None:
        """Make the op's formula a backward that raises, naming ``Communicator.<call>``
        (:func:`_no_gradient`): what it returns may flow into a loss, but the backward is refused."""
        self.register_autograd(_no_gradient(call), setup_context=_input_shapes)

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """Make ``backward`` the op's formula, first order (:func:`tp_kernels._checks.differentiable_once`)."""
        name = self.qualname.partition("::")[2]
        backward = differentiable_once(name)(backward)
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=_LIB)
        formula = {"setup_context": staticmethod(setup_context), "backward": staticmethod(backward)}
        # (eager calls, outside torch.func's transforms: the form whose apply binds no arguments)
        self.function = with_eager_form(type(f"{name}_autograd", (torch.autograd.Function,),
                                             {"forward": staticmethod(self.fn), **formula})).eager
        op = self.op
        self.transformed = type(f"{name}_transformed", (torch.autograd.Function,), {
            "forward": staticmethod(lambda *args: op(*args)), "generate_vmap_rule": True, **formula})


def _define(fn: Callable) -> _Op:
    """``tp_kernels::<fn's name>``, its schema read from ``fn``'s annotations, with ``fn`` as its
    implementation on every device: a plain ``torch.library.Library`` registration (as vLLM's
    ``direct_register_custom_op``), which the dispatcher calls with less host time per call than
    a ``torch.library.custom_op`` (about 6 µs less, measured on a 2-core VM). Only for ops that
    mutate none of their inputs; those that do are ``custom_op``s, which bump the version counters
    of what they write."""
    name = fn.__name__
    _LIB.define(name + _infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    _OPS[name] = _Op(name, fn)
    return _OPS[name]


def _define_mutating(*written: str, recorded: Callable) -> Callable[[Callable], _Op]:
    """``tp_kernels::<fn's name>`` as a ``torch.library.custom_op`` that writes into the arguments
    named ``written`` (it bumps their version counters, and torch.compile functionalizes it), called
    as an :class:`_Op`. It has no formula: a call that records a gradient runs ``recorded(*args)``
    instead, the op that makes a new tensor (whose formula refuses) copied into what it writes, so
    that what it wrote takes that history, compiled as eagerly. (A formula would have to mark what
    the op wrote as its output, ``mark_dirty``, and torch.compile's tracing of that lost the
    refusal: on torch 2.11 and 2.12 what was written kept its old history, the identity, or had none
    for ``out``; on later ones too where only the written tensor required grad.)"""

    def define(fn: Callable) -> _Op:
        name = fn.__name__
        custom = torch.library.custom_op(f"tp_kernels::{name}", mutates_args=written)(fn)
        names = list(inspect.signature(fn).parameters)
        _OPS[name] = _Op(name, fn, custom, tuple(names.index(w) for w in written), recorded)
        return _OPS[name]

    return define


def _no_gradient(call: str) -> Callable:
    """The formula of a plain collective, ``Communicator.<call>``: a backward whose gradients are
    :func:`refuse_gradient`'s, so that running it raises a ``RuntimeError`` naming the call. The
    collectives of :class:`tp_kernels.Communicator` serve inference, and a gradient for them has no
    one meaning (a sum over the ranks, or Megatron's identity where the loss is the same on every
    rank): :mod:`tp_kernels.mappings` says which, per function. A forward with gradients enabled
    (inference without ``torch.no_grad()``) still runs, compiled or not: only the backward raises,
    on every rank, as every rank runs it."""

    def backward(ctx, *grads):
        return tuple(None if shape is None else refuse_gradient(grads[0], shape, call) for shape in ctx.shapes)

    return backward


def _input_shapes(ctx, inputs, output) -> None:
    ctx.shapes = [list(a.shape) if isinstance(a, Tensor) else None for a in inputs]


@_define
def refuse_gradient(grad: Tensor, shape: List[int], call: str) -> Tensor:
    """The gradient of a collective that has none: raises, naming ``Communicator.<call>`` (an op,
    so that torch.compile traces a backward that raises only when it runs)."""
    raise RuntimeError(
        f"tp_kernels: Communicator.{call} has no gradient: for training, use the layers or "
        "tp_kernels.mappings (their collectives say what the gradient is), or run inference under "
        "torch.no_grad() or torch.inference_mode()")


@refuse_gradient.register_fake
def _(grad, shape, call):
    return grad.new_empty(shape)


def _size(name: str) -> int:
    return coll.group_size(coll.group_from_name(name))


def _setup_context(ctx, inputs, output):
    x, weight, bias, group, impl = inputs
    ctx.save_for_backward(x, weight)
    ctx.args, ctx.has_bias = (group, impl), bias is not None


def _fake_grads(dy, x, weight, group, impl, need_dx, need_dw, need_db):
    """Shapes of a backward op's (dx, dW, db); empty where not needed."""
    return (x.new_empty(x.shape if need_dx else (0,)), weight.new_empty(weight.shape if need_dw else (0,)),
            dy.new_empty((dy.shape[1],) if need_db else (0,)))


def _register_backward(forward_op, backward_op) -> None:
    """Make ``backward_op(dy, x, weight, group, impl, need_dx, need_dw, need_db)`` the autograd
    formula of ``forward_op(x, weight, bias, group, impl)``."""

    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        grads = backward_op(dy, x, weight, *ctx.args, *need)
        return tuple(t if n else None for t, n in zip(grads, need)) + (None, None)

    forward_op.register_autograd(backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# all_gather_matmul: (m/p, k) -(AG)-> (m, k) x (k, n/p) -> (m, n/p)


@_define
def all_gather_matmul(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, impl: str) -> Tensor:
    out, _ = run("all_gather_matmul", impl, x, weight, bias, coll.group_from_name(group))
    return out


@all_gather_matmul.register_fake
def _(x, weight, bias, group, impl):
    return x.new_empty((x.shape[0] * _size(group), weight.shape[0]))


@_define
def all_gather_matmul_backward(dy: Tensor, x: Tensor, weight: Tensor, group: str, impl: str, need_dx: bool,
                               need_dw: bool, need_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    g = coll.group_from_name(group)
    dy = dy.contiguous()
    # Kick off the re-gather of x first, so that it travels while dx multiplies.
    gather = coll.all_gather_dim0(x, g) if need_dw else None
    # dx: (m, n/p) x (n/p, k) -(RS)-> (m/p, k)
    dx = run("matmul_reduce_scatter", backward_name(impl, "matmul_reduce_scatter"), dy, weight.t(), None, g) \
        if need_dx else None
    # dW: (n/p, m) x (m, k) -> (n/p, k), overlapping the tail of dx's reduce-scatter
    dw = dy.t().mm(gather.wait()) if need_dw else weight.new_empty(0)
    db = dy.sum(0) if need_db else dy.new_empty(0)
    return (dx.wait() if need_dx else x.new_empty(0)), dw, db


all_gather_matmul_backward.register_fake(_fake_grads)


_register_backward(all_gather_matmul, all_gather_matmul_backward)


# ---------------------------------------------------------------------------------------------
# matmul_reduce_scatter: (m, k/p) x (k/p, n) -(RS)-> (m/p, n), bias added once after


@_define
def matmul_reduce_scatter(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, impl: str) -> Tensor:
    return run("matmul_reduce_scatter", impl, x, weight, bias, coll.group_from_name(group)).wait()


@matmul_reduce_scatter.register_fake
def _(x, weight, bias, group, impl):
    return x.new_empty((x.shape[0] // _size(group), weight.shape[0]))


@_define
def matmul_reduce_scatter_backward(dy: Tensor, x: Tensor, weight: Tensor, group: str, impl: str, need_dx: bool,
                                   need_dw: bool, need_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    g = coll.group_from_name(group)
    dy = dy.contiguous()
    if need_dx:
        # dx: (m/p, n) -(AG)-> (m, n) x (n, k/p) -> (m, k/p); keeps AG(dy) for dW and db
        dx, dy_full = run("all_gather_matmul", backward_name(impl, "all_gather_matmul"), dy, weight.t(), None, g)
    else:
        dx, dy_full = x.new_empty(0), coll.all_gather_dim0(dy, g).wait()
    dw = dy_full.t().mm(x) if need_dw else weight.new_empty(0)  # (n, m) x (m, k/p)
    # db over every rank's rows: the bias was added once to each shard
    db = dy_full.sum(0) if need_db else dy.new_empty(0)
    return dx, dw, db


matmul_reduce_scatter_backward.register_fake(_fake_grads)


_register_backward(matmul_reduce_scatter, matmul_reduce_scatter_backward)


# ---------------------------------------------------------------------------------------------
# matmul_all_reduce: (m, k/p) x (k/p, n) -(AR)-> (m, n), bias added once after


@_define
def matmul_all_reduce(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, impl: str) -> Tensor:
    return run("matmul_all_reduce", impl, x, weight, bias, coll.group_from_name(group)).wait()


@matmul_all_reduce.register_fake
def _(x, weight, bias, group, impl):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _ar_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    # dy is replicated on every rank: the gradients are local GEMMs.
    dx = dy.mm(weight) if ctx.needs_input_grad[0] else None  # (m, n) x (n, k/p)
    dw = dy.t().mm(x) if ctx.needs_input_grad[1] else None  # (n, m) x (m, k/p)
    db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db, None, None


matmul_all_reduce.register_autograd(_ar_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# linear_with_grad_all_reduce (column-parallel, no SP): (m, k) x (k, n/p) -> (m, n/p) locally;
# backward dx = matmul_all_reduce(dy, W) with dW computed while dx reduces


@_define
def linear_with_grad_all_reduce(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, impl: str) -> Tensor:
    return torch.nn.functional.linear(x, weight, bias)


@linear_with_grad_all_reduce.register_fake
def _(x, weight, bias, group, impl):
    return x.new_empty((x.shape[0], weight.shape[0]))


@_define
def linear_with_grad_all_reduce_backward(dy: Tensor, x: Tensor, weight: Tensor, group: str, impl: str,
                                         need_dx: bool, need_dw: bool, need_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    dy = dy.contiguous()
    # dx: (m, n/p) x (n/p, k) -(AR)-> (m, k)
    dx = run("matmul_all_reduce", impl, dy, weight.t(), None, coll.group_from_name(group)) if need_dx else None
    dw = dy.t().mm(x) if need_dw else weight.new_empty(0)  # (n/p, m) x (m, k), while dx reduces
    db = dy.sum(0) if need_db else dy.new_empty(0)
    return (dx.wait() if need_dx else x.new_empty(0)), dw, db


linear_with_grad_all_reduce_backward.register_fake(_fake_grads)


_register_backward(linear_with_grad_all_reduce, linear_with_grad_all_reduce_backward)


# ---------------------------------------------------------------------------------------------
# The plain collectives (tp_kernels.Communicator), over dim 0 of contiguous tensors


def _output(collective: str, x: Tensor, p: int, receives: bool = True) -> Optional[Tensor]:
    shape = collective_output_shape(collective, x.shape, p, receives)
    return None if shape is None else x.new_empty(shape)


def _collective(collective: str, x: Tensor, group: str, impl: str, peer: int = -1) -> Tensor:
    """``collective`` of ``x`` into a new tensor (for ``gather`` off the root: an empty one)."""
    g = coll.group_from_name(group)
    receives = collective != "gather" or coll.group_rank(g) == peer
    out = _output(collective, x, coll.group_size(g), receives)
    if out is None:
        run_collective(collective, impl, x, None, peer, g)
        return x.new_empty((0,) + tuple(x.shape[1:]))
    return run_collective(collective, impl, x, out, peer, g)


@_define
def all_reduce(x: Tensor, group: str, impl: str) -> Tensor:
    return _collective("all_reduce", x, group, impl)


@all_reduce.register_fake
def _(x, group, impl):
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # (as the body: a new contiguous tensor)


all_reduce.register_no_gradient("all_reduce")


def _check_written(name: str, t: Tensor) -> None:
    """A tensor a plain collective's op writes must be contiguous: the implementations write its
    memory as one block (a strided one would keep its values, silently)."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: the tensor the op writes must be contiguous, got shape {list(t.shape)} with strides "
                         f"{list(t.stride())}")


@_define_mutating("out", recorded=lambda x, out, group, impl: out.copy_(all_reduce(x, group, impl)))
def all_reduce_out(x: Tensor, out: Tensor, group: str, impl: str) -> None:
    _check_written("out", out)
    run_collective("all_reduce", impl, x, out, -1, coll.group_from_name(group))


@all_reduce_out.register_fake
def _(x, out, group, impl):
    _check_written("out", out)
    return None


@_define_mutating("x", recorded=lambda x, group, impl: x.copy_(all_reduce(x, group, impl)))
def all_reduce_inplace(x: Tensor, group: str, impl: str) -> None:
    _check_written("x", x)
    run_collective("all_reduce", impl, x, x, -1, coll.group_from_name(group))


@all_reduce_inplace.register_fake
def _(x, group, impl):
    _check_written("x", x)
    return None


@_define
def all_gather(x: Tensor, group: str, impl: str) -> Tensor:
    return _collective("all_gather", x, group, impl)


@all_gather.register_fake
def _(x, group, impl):
    return _output("all_gather", x, _size(group))


all_gather.register_no_gradient("all_gather")


@_define
def reduce_scatter(x: Tensor, group: str, impl: str) -> Tensor:
    return _collective("reduce_scatter", x, group, impl)


@reduce_scatter.register_fake
def _(x, group, impl):
    return _output("reduce_scatter", x, _size(group))


reduce_scatter.register_no_gradient("reduce_scatter")


@_define
def gather(x: Tensor, dst: int, group: str, impl: str) -> Tensor:
    return _collective("gather", x, group, impl, dst)


@gather.register_fake
def _(x, dst, group, impl):
    if coll.group_rank(coll.group_from_name(group)) == dst:
        return _output("gather", x, _size(group))
    return x.new_empty((0,) + tuple(x.shape[1:]))


gather.register_no_gradient("gather")


@_define
def broadcast_copy(x: Tensor, src: int, group: str, impl: str) -> Tensor:
    """Rank ``src``'s ``x`` in a new contiguous tensor: what a ``broadcast`` that records a
    gradient (refused) copies into ``x``."""
    out = x.clone(memory_format=torch.contiguous_format)
    run_collective("broadcast", impl, out, out, src, coll.group_from_name(group))
    return out


@broadcast_copy.register_fake
def _(x, src, group, impl):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


broadcast_copy.register_no_gradient("broadcast")


@_define_mutating("x", recorded=lambda x, src, group, impl: x.copy_(broadcast_copy(x, src, group, impl)))
def broadcast(x: Tensor, src: int, group: str, impl: str) -> None:
    _check_written("x", x)
    run_collective("broadcast", impl, x, x, src, coll.group_from_name(group))


@broadcast.register_fake
def _(x, src, group, impl):
    _check_written("x", x)
    return None

