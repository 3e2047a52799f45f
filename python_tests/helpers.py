"""Helpers of the tests: rank info, shards and tolerance checks (used inside the ranks), which
transformers plans a test can read (:func:`skip_unless_own_plan`), and the matrix products a
block runs (:func:`matrix_products`).

Tolerances follow one rule. Every result is compared with a float64 reference computed from
the same (already rounded) inputs.

* float32: the largest error is at most 1e-6 of the largest reference magnitude, or of a given
  ``scale``: for sums with heavy cancellation (a bias gradient over few rows), the magnitude
  of the summed terms, ``max(|A| |B|)`` for a product ``A B``.
* bfloat16/float16: the largest error is at most ``2 * terms`` times plain PyTorch's own
  largest error in that precision (the same computation done densely, in one process), plus
  one unit in the last place at the largest magnitude. ``terms`` is the number of per-rank
  partial results summed across ranks to make the value (p for a reduced tensor, 1
  otherwise): each partial is rounded once and each sum step once more, so a sum of p
  partials carries at most 2p - 1 roundings where the dense GEMM carries one.
* a sum over ranks of inputs given whole (an all-reduce): ``summed``, the float64 sum of the
  terms' magnitudes, sets the scale, since a partial sum can be as large as that, whatever the
  result's size; and the unit in the last place counts ``(terms - 1) / 2`` times at least, since
  each of the ``terms - 1`` additions of an algorithm that adds in that precision (NCCL's ring)
  rounds by up to half a unit, in another order than plain PyTorch's, whose own error can be 0 by
  chance where there are few elements.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tp_kernels
from tp_kernels import _torch_version, settings


def torch_before(major: int, minor: int, why: str):
    """A strict ``xfail`` mark for the torch releases before ``major.minor`` (pyproject.toml admits
    some: the oldest is tested by CI), saying why the test fails there; strict, so that it is
    dropped once it passes."""
    return pytest.mark.xfail(_torch_version._release(torch.__version__) < (major, minor), reason=f"torch < {major}.{minor}: {why}", strict=True)


def rank_world():
    return dist.get_rank(), dist.get_world_size()


def fingerprints_set(enabled: bool):
    """Fingerprints on (or off) within the block, then as before."""
    return settings.overriding(fingerprints=enabled)


class CopiedBytes(TorchDispatchMode):
    """Within the block, the bytes that aten's copies write (``clone``, ``copy_``, ``_to_copy``,
    which ``contiguous``, ``reshape`` and ``to`` call), floating-point and other tensors apart:
    ``floating`` and ``other``."""

    COPIES = (torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)

    def __init__(self):
        super().__init__()
        self.floating = self.other = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.COPIES:
            written = args[0] if func is torch.ops.aten.copy_.default else out
            size = written.numel() * written.element_size()
            if written.is_floating_point():
                self.floating += size
            else:
                self.other += size
        return out


def library_timeout(seconds: float):
    """tp_kernels' timeout (:func:`tp_kernels.set_timeout`) ``seconds`` inside; the one before, after."""
    return settings.overriding(timeout=seconds)


def block(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Rank ``rank``'s block of ``t`` along ``dim`` (``parts`` equal blocks)."""
    size = t.shape[dim] // parts
    return t.narrow(dim, rank * size, size)


def held_rows(n: int, rank: int, parts: int) -> int:
    """How many rows of a dim of ``n`` rank ``rank``'s padded block holds (:func:`padded_block`),
    the rest of its ``ceil(n/parts)`` being padding."""
    rows = -(-n // parts)
    return min(rows, max(0, n - rank * rows))


def padded_block(t: torch.Tensor, dim: int, rank: int, parts: int, fill: float = 0.0) -> torch.Tensor:
    """Rank ``rank``'s block of ``t`` along ``dim`` padded at its end with ``fill`` to a multiple of
    ``parts``: ``ceil(n/parts)`` rows each, the last blocks ending in (or made of) the padding."""
    n = t.shape[dim]
    rows = -(-n // parts)
    shape = list(t.shape)
    shape[dim] = rows * parts - n
    return block(torch.cat([t, t.new_full(shape, fill)], dim), dim, rank, parts)


def max_err(actual: torch.Tensor, ref64: torch.Tensor) -> float:
    return (actual.detach().double() - ref64.detach()).abs().max().item() if ref64.numel() else 0.0


def assert_close(name, actual, ref64, plain=None, *, terms=1, scale=None, summed=None):
    """Check ``actual`` against the float64 reference (see the module docstring): ``scale`` or
    ``summed`` (a sum over ranks: the terms' magnitudes summed, in float64) in place of the
    reference's largest magnitude."""
    assert actual is not None, f"{name}: missing (no gradient?)"
    assert tuple(actual.shape) == tuple(ref64.shape), f"{name}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    assert scale is None or summed is None, f"{name}: scale or summed, not both"
    if ref64.numel() == 0:
        return
    units = 1.0
    if summed is not None:
        scale, units = summed.max().item(), max(1.0, (terms - 1) / 2)
    scale = ref64.abs().max().item() if scale is None else float(scale)
    err = max_err(actual, ref64)
    if actual.dtype in (torch.float32, torch.float64):
        bound = 1e-6 * scale
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} (1e-6 of scale {scale:.3e})"
        return
    assert plain is not None, f"{name}: a low-precision check needs the plain PyTorch result"
    plain_err = max_err(plain, ref64)
    ulp = torch.finfo(actual.dtype).eps * scale
    bound = 2 * terms * plain_err + units * ulp
    assert err <= bound, (
        f"{name}: max error {err:.3e} > {bound:.3e} = 2*{terms}*plain error {plain_err:.3e} + {units:g} ulp {ulp:.3e}"
    )


def full_grads(model) -> dict:
    """Every parameter's gradient of a parallelized ``model`` joined whole, by the dense model's
    names: ``tp_kernels.full_state_dict`` of the gradients in the weights' place (the weights put
    back after). One collective per sharded parameter, on every rank."""
    params = list(model.parameters())
    weights = [q.detach().clone() for q in params]
    with torch.no_grad():
        for q in params:
            q.copy_(q.grad)
    try:
        return {name: value.clone() for name, value in tp_kernels.full_state_dict(model).items()}
    finally:
        with torch.no_grad():
            for q, w in zip(params, weights):
                q.copy_(w)


def adam_drift(par, dense, eps: float) -> float:
    """What Adam (``eps``) may make of the rounding between the parallelized ``par``'s gradients,
    joined whole (:func:`full_grads`), and ``dense``'s, per unit of learning rate: its first step
    moves an element by ``lr * g / (|g| + eps)``, so a gradient ``g`` that differs by ``d`` moves
    it up to ``lr * d * eps / (|g| + eps)^2`` apart, ``lr * d / eps`` where the gradient is zero
    but for rounding (a key bias's, whose shift softmax ignores: float64's rounding of 1e-15 then
    1e-8 at lr 0.1, where a machine summing in another order differs by that much). The largest of
    ``d * eps / (|g| + eps)^2``. One collective per sharded parameter, on every rank."""
    grads = full_grads(par)
    return max((((grads[name] - q.grad).abs() * eps) / (q.grad.abs() + eps) ** 2).max().item()
               for name, q in dense.named_parameters() if q.grad is not None)


def adam_atol(lr: float, drift: float, steps: int) -> float:
    """How far apart ``steps`` Adam steps at ``lr`` may move two models' parameters whose
    gradients differed by ``drift`` (:func:`adam_drift`, the largest over the steps): twice
    ``lr * drift`` a step, and 1e-10 at least."""
    return max(2 * steps * lr * drift, 1e-10)


def assert_dense_grads(par, dense, eps: float) -> None:
    """Every gradient of the parallelized ``par``, joined whole, is ``dense``'s, to ``eps`` of the
    largest value of each (1e-12: float64's own rounding; a float32 step inside the model: more)."""
    grads = full_grads(par)
    for name, q in dense.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, rtol=0, atol=eps * q.grad.abs().max().item(),
                                   msg=lambda m: f"{name}.grad: {m}")


def assert_same_loss_and_backward(dense, par, ids, **kwargs) -> None:
    """A causal language model and its parallelized copy on ``ids`` (its own labels; ``kwargs``,
    an attention mask, to both): the logits and the loss are the dense ones in float64 closeness;
    then each model's loss is backpropagated, for the caller to compare the gradients."""
    want, got = dense(ids, labels=ids, **kwargs), par(ids, labels=ids, **kwargs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=0)
    want.loss.backward()
    got.loss.backward()


def skip_unless_own_plan(config_class: str, entry: str, style: str, plan: str = "base_model_tp_plan") -> None:
    """Skip where the installed transformers has no ``config_class``, or where its models' own
    plan (the config's ``plan``: ``base_model_tp_plan``, or ``base_model_ep_plan``) does not give
    ``entry`` the ``style`` a test of that plan reads (transformers 5.17's Qwen2-MoE plan splits no experts, its Granite SWA plan
    leaves the attention sinks whole): another version's plan, which ``parallelize`` applies as
    it is."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_class, None)
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    given = (getattr(config, plan, None) or {}).get(entry)
    if given != style:
        pytest.skip(f"transformers {transformers.__version__}: {config_class}'s {plan} gives {entry!r} {given!r}, "
                    f"not {style!r}")


@contextlib.contextmanager
def matrix_products(seen):
    """Record in ``seen`` each matrix product run meanwhile, as ``(m, n, k)`` and which operands are
    read transposed (column-major). (Products as the library's Python runs them: ``F.linear``,
    ``torch.mm``, ``Tensor.mm`` and ``torch.addmm``.)"""
    linear, mm, tensor_mm, addmm = F.linear, torch.mm, torch.Tensor.mm, torch.addmm

    def note(a, b):
        seen.append(((a.shape[0], b.shape[1], a.shape[1]), a.stride(-1) != 1, b.stride(-1) != 1))

    def linear_(x, w, bias=None):
        note(x, w.t())
        return linear(x, w, bias)

    def mm_(a, b, **kw):
        note(a, b)
        return mm(a, b, **kw)

    def tensor_mm_(a, b):
        note(a, b)
        return tensor_mm(a, b)

    def addmm_(c, a, b, **kw):
        note(a, b)
        return addmm(c, a, b, **kw)

    with mock.patch.object(F, "linear", linear_), mock.patch.object(torch, "mm", mm_), \
            mock.patch.object(torch.Tensor, "mm", tensor_mm_), mock.patch.object(torch, "addmm", addmm_):
        yield
