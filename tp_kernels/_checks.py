"""Argument checks shared by the ops and layers, and the autograd helpers they share (formulas
differentiable once, :func:`differentiable_once`; the eager form of an autograd function,
:func:`with_eager_form` and :func:`apply_function`; whether a call records a gradient).

Every check runs before any collective is issued and raises ``ValueError`` naming the
argument, so a bad call fails on the rank that made it instead of hanging its peers.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch

from ._data_parallel import is_sharded


def check_int(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def check_choice(name: str, value, choices):
    """``value`` if it is one of ``choices``, else a ValueError naming ``name``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_float_dtype(name: str, dtype) -> None:
    """``dtype`` is None (torch's default) or a floating-point ``torch.dtype`` (parameters are)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{name}: expected a floating-point torch.dtype (parameters learn), got {dtype!r}")


def check_divisible(name: str, value: int, p: int) -> int:
    """``value // p``, or a ValueError when ``p`` does not divide ``value``."""
    if value % p:
        raise ValueError(f"{name} ({value}) is not divisible by the tensor-parallel size {p}")
    return value // p


def check_split_dim(name: str, dim, x, x_name: str = "input") -> int:
    """``dim`` as a dim of ``x`` other than its last (the one a linear layer multiplies), counted
    from 0 (a negative ``dim`` counts from the end, as in torch): the dim a block of the sequence is
    split along (``[b, s/p, h]``: 1); 0, the default, whatever ``x`` is (its rows). A ``ValueError``
    naming ``name`` otherwise."""
    if type(dim) is int and dim == 0:
        return 0
    d = dim + x.dim() if isinstance(dim, int) and not isinstance(dim, bool) and dim < 0 else dim
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= d < x.dim() - 1:
        raise ValueError(f"{name}: expected a dim of {x_name} other than its last, in [{-x.dim()}, {x.dim() - 2}] "
                         f"for {x_name} of shape {tuple(x.shape)}, got {dim!r}")
    return d


def check_replaceable(name: str, module, base: type, *, own_forward: bool = False) -> None:
    """A ``ValueError`` naming ``name`` unless ``module`` is a ``base`` (``nn.Linear``,
    ``nn.Embedding``) that a parallel layer can stand for: ``base`` itself, or a subclass with
    ``base``'s forward and nothing but its parameters (``weight``, ``bias``), with no hooks
    registered. A subclass with a forward of its own, or parameters, buffers or submodules of its
    own (a LoRA adapter, a quantized layer), or a hook, would lose them, and the model its
    function, silently. ``own_forward``: the caller found the subclass's forward to be one the
    parallel layer computes (an embedding's lookup times a constant), so its forward, and the
    buffers it keeps out of the state dict, are no loss."""
    if not isinstance(module, base):
        raise ValueError(f"{name}: expected an nn.{base.__name__}, got {type(module).__name__}")
    kind = type(module).__name__
    distributed = [n for n, q in module.named_parameters(recurse=False) if is_sharded(q)]
    if distributed:
        raise ValueError(f"{name}: this {kind}'s {', '.join(map(repr, distributed))} are DTensors (sharded by FSDP2's "
                         "fully_shard, or by torch's tensor parallelism), which a parallel layer cannot take: "
                         "parallelize the dense model first, then shard it with fully_shard")
    hooks = [h for h in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
             if getattr(module, h, None)]
    if hooks:
        raise ValueError(f"{name}: this {kind} has hooks registered on it ({', '.join(hooks)}), which a parallel "
                         "layer would not run: replace it first, then register them on the replacement")
    if type(module) is base:
        return
    if type(module).forward is not base.forward and not own_forward:
        raise ValueError(f"{name}: {kind} is an nn.{base.__name__} with a forward of its own, which a parallel layer "
                         "would not run")
    kept_out = module._non_persistent_buffers_set if own_forward else set()
    extra = ([n for n, _ in module.named_parameters(recurse=False) if n not in ("weight", "bias")]
             + [n for n, _ in module.named_buffers(recurse=False) if n not in kept_out]
             + [n for n, _ in module.named_children()])
    if extra:
        raise ValueError(f"{name}: {kind} is an nn.{base.__name__} that also holds {', '.join(map(repr, extra))}, "
                         "which a parallel layer would drop")


def check_tensor(name: str, t, *, min_dim: int = 0, dim: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor, got shape {tuple(t.shape)}")
    if t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dims, got shape {tuple(t.shape)}")
    return t


def check_linear_args(
    x, weight, bias, *, x_name: str = "x", weight_name: str = "weight", min_dim: int = 2
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Validate ``F.linear``-style arguments and apply autocast.

    Returns ``(x, weight, bias)``, cast to the autocast dtype when autocast is enabled on the
    input's device (the casts are differentiable, as in ``F.linear`` under autocast).
    """
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() >= min_dim
            and weight.dim() == 2 and (bias is None or (isinstance(bias, torch.Tensor) and bias.dim() == 1))):
        # one test on the path of a good call (each check_tensor call costs host time); which
        # argument is wrong, and how, is said by check_tensor
        check_tensor(x_name, x, min_dim=min_dim)
        check_tensor(weight_name, weight, dim=2)
        if bias is not None:
            check_tensor("bias", bias, dim=1)
    if not weight.is_floating_point():
        raise ValueError(f"{weight_name}: expected a floating-point tensor, got {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"{x_name}: expected the last dim to be {k} to match {weight_name} "
            f"{(n, k)}, got {x_name} of shape {tuple(x.shape)}"
        )
    if bias is not None and bias.shape[0] != n:
        raise ValueError(
            f"bias: expected {n} elements to match {weight_name} {(n, k)}, got shape {tuple(bias.shape)}"
        )
    device, dtype = weight.device, weight.dtype
    if x.device != device or (bias is not None and bias.device != device):
        name, t = (x_name, x) if x.device != device else ("bias", bias)
        raise ValueError(f"{name}: device {t.device} does not match {weight_name}'s device {device}")
    if _any_autocast() and x.is_floating_point() and _autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if x.dtype != dtype or (bias is not None and bias.dtype != dtype):
        name, t = (x_name, x) if x.dtype != dtype else ("bias", bias)
        raise ValueError(f"{name}: dtype {t.dtype} does not match {weight_name}'s dtype {dtype}")
    return x, weight, bias


#: whether a torch.func transform (grad, vjp, jacrev, vmap, ...) is active
functorch_transforms = torch._C._are_functorch_transforms_active

#: whether autocast is on for any device (one C call, where torch has it), before asking for one
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (e.g. meta)
        return False


def _second_derivative_error(what: str) -> RuntimeError:
    return RuntimeError(f"tp_kernels: {what}: its gradient cannot be differentiated again (backward with "
                        "create_graph=True, double backward): the tensor-parallel formulas are first order")


class _FirstOrder(torch.autograd.Function):
    """The identity on a gradient that a ``torch.func`` transform records a graph of, made to depend
    on ``anchors`` (the tensors its formula took: what a second derivative differentiates it by):
    its own backward, a second derivative, raises (:func:`differentiable_once`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad, what, *anchors):
        return grad.view_as(grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.what = inputs[1]

    @staticmethod
    def backward(ctx, _):
        raise _second_derivative_error(ctx.what)


def _under_transform(ctx) -> bool:
    """Whether a backward runs for a ``torch.func`` transform (its grad level, or ``vjp``'s
    pullback called after): its node is then of the function functorch makes around the
    autograd function, which is not a ``torch.autograd.Function``."""
    return not issubclass(getattr(ctx, "_forward_cls", torch.autograd.Function), torch.autograd.Function)


def differentiable_once(what: str) -> Callable[[Callable], Callable]:
    """Decorate ``backward(ctx, *grads)``, the autograd formula of ``what``, so that a backward that
    records a graph of the gradient (``create_graph=True``: to differentiate it again) raises a
    ``RuntimeError`` naming ``what`` before it runs: the second derivative would need collectives
    that no formula here has, and would be silently wrong. (In a backward, grad mode is on exactly
    when a graph is recorded.) Every rank runs the same backward, so every rank raises. Under a
    ``torch.func`` transform, which records that graph whether or not anything differentiates it
    again (``torch.func.grad``, ``vjp``, ``jacrev``), the backward runs as a first-order one does,
    recording nothing (its collectives write into buffers, which autograd refuses to record), and
    each gradient it returns raises that error only where a second derivative reaches it
    (:class:`_FirstOrder`, made to depend on the formula's gradients in and saved tensors)."""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def first_order(ctx, *grads):
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            if not _under_transform(ctx):
                raise _second_derivative_error(what)
            anchors = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor)]
            with torch.no_grad():
                out = backward(ctx, *grads)
            single = not isinstance(out, tuple)
            out = tuple(_FirstOrder.apply(g, what, *anchors) if isinstance(g, torch.Tensor) else g
                        for g in ((out,) if single else out))
            return out[0] if single else out

        return first_order

    return decorate


def with_eager_form(function: type) -> type:
    """Class decorator of an autograd function in the form ``torch.func``'s transforms take
    (``forward`` without ``ctx``, a ``setup_context``): ``function.eager``, the same function in
    the form with ``ctx`` (its forward ``function.forward`` then ``function.setup_context``, its
    backward ``function.backward``), which :func:`apply_function` runs outside the transforms.
    ``torch.autograd.Function.apply`` binds a ``setup_context`` function's arguments to its
    forward's signature (``inspect.signature``) on every call: about 13 µs a call on the CPU VM,
    against 3 µs for the form with ``ctx`` (a decode step of a layer's mapping, every op that
    records a gradient)."""

    def forward(ctx, *args):
        out = function.forward(*args)
        function.setup_context(ctx, args, out)
        return out

    function.eager = type(f"{function.__name__}_eager", (torch.autograd.Function,),
                          {"forward": staticmethod(forward), "backward": staticmethod(function.backward)})
    return function


def apply_function(function: type, *args):
    """``function.apply(*args)``, every argument passed, for an autograd function of
    :func:`with_eager_form`. In eager calls outside ``torch.func``'s transforms (not traced by
    ``torch.compile``, which traces ``apply`` itself): its eager form, or, when no gradient is
    recorded (grad mode off, no tensor argument requiring one), its forward alone (what ``apply``
    computes then, without making the function's node: ~0.6 µs, not 3)."""
    if functorch_transforms() or torch.compiler.is_compiling():
        return function.apply(*args)
    if wants_grad(args):
        return function.eager.apply(*args)
    return function.forward(*args)


def wants_grad(args) -> bool:
    """Whether a call of these arguments records a gradient: grad mode on and a tensor among them
    requiring one."""
    return _grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


_grad_enabled = torch.is_grad_enabled  # (bound once: each attribute lookup on torch costs host time)
