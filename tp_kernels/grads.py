"""What a training loop over a tensor-parallel model does with its gradients: the
sequence-parallel sums of the parameters every rank holds whole, and the whole model's norm."""

from __future__ import annotations

import math
import weakref
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives as coll
from . import _data_parallel as dp
from ._agreement import _recording, agree, describe
from ._checks import check_int
from .layers import own_pieces, sharded_blocks
from .mappings import copy_to

__all__ = ["allreduce_sequence_parallel_grads", "clip_grad_norm_", "sum_grads_over_group",
           "sum_output_grads_over_group"]


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], group=None) -> None:
    """Sum the gradients of ``params`` over the tensor-parallel group, in place.

    Under sequence parallelism, a replicated parameter applied to this rank's sequence block
    (a layer norm between the parallel layers) gets only this block's share of its gradient.
    Call this after backward, before the optimizer step, with exactly those parameters; the
    parallel layers' own parameters (including a row-parallel bias) are already complete.
    Parameters without a gradient are skipped. One all-reduce for all of them.
    (Where FSDP2 shards them further, each rank's rows of their gradients.)
    """
    params = list(params)
    group = coll.resolve_group(group)

    def check():
        for i, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise ValueError(f"params[{i}]: expected a tensor, got {type(param).__name__}")
        grads = [dp.local(param.grad) for param in params if param.grad is not None]  # (FSDP2: this rank's rows)
        for grad in grads[1:]:
            if grad.dtype != grads[0].dtype or grad.device != grads[0].device:
                raise ValueError("params: every gradient must share one dtype and device")
        return grads

    # a rank whose parameters have no gradients (or others) would skip the all-reduce: agreed first
    grads = agree("allreduce_sequence_parallel_grads", group, check,
                  lambda grads: f"{len(grads)} gradients of {sum(g.numel() for g in grads)} elements, "
                                f"{describe(grads[0]) if grads else 'none'}",
                  hint=next((p_.grad for p_ in params if isinstance(p_, torch.Tensor) and p_.grad is not None), None))
    if not grads or coll.group_size(group) == 1:
        return
    flat = coll.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group, inplace=True).wait()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def sum_grads_over_group(module: nn.Module, group=None) -> nn.Module:
    """Make the gradient of each parameter of ``module`` the sum over the group of every rank's, in
    every backward: for a parameter every rank holds whole but applies to its own part of the
    activations, whose gradient on each rank is that part's share (a per-head norm, Qwen 3's and
    Gemma 3's ``q_norm`` and ``k_norm``, applied to the rank's heads; a layer norm under sequence
    parallelism, applied to the rank's block of the sequence). Without the sum, the ranks would
    update it differently, and drift apart silently.

    Each backward's gradient is summed (one all-reduce per parameter, on the host's order of the
    backward, every rank alike) before it accumulates into ``.grad``, so gradient accumulation
    over micro-batches, DDP and FSDP2 (whose parameters the module holds when its forward runs)
    see the whole gradient. Installed as a forward pre-hook on ``module`` that hooks each parameter
    it holds then; returns ``module``. Nothing with one rank. :func:`parallelize`'s style
    ``"replicated_with_grad_allreduce"`` (Hugging Face's name) calls it.

    The gradient summed must be each rank's share. In the first backward whose gradient of a
    parameter is not zero on every rank (eager), it is compared across the ranks before the sum
    (a digest: one all-gather of three numbers): the same on every rank, the module ran on a tensor
    whole on every rank and the sum would count the gradient p times: every rank raises a
    ``ValueError`` naming the module and the parameter, before the gradient accumulates.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected an nn.Module, got {type(module).__name__}")
    held = sharded_blocks(module)[0]
    if held:
        raise ValueError(f"module: holds {next(iter(held))!r}, a parallel layer's block, whose gradient must not be "
                         "summed over the group: pass the modules whose parameters every rank holds whole")
    group = coll.resolve_group(group)
    if coll.group_size(group) == 1:
        return module

    def hook_parameters(mod, args):
        new = []
        for attr, param in mod.named_parameters():
            seen = _SUMMED.get(id(param))
            if param.requires_grad and (seen is None or seen() is not param):  # each parameter once
                param.register_hook(_summing(type(mod).__name__, attr, group))
                new.append(param)
        if new:
            _remember_summed(new)

    module.register_forward_pre_hook(hook_parameters)
    return module


def _summing(module_type: str, attr: str, group):
    """The hook of :func:`sum_grads_over_group` on the parameter ``attr`` of a module of type
    ``module_type`` (its name alone: a hook holding the module would keep it, and the parameter,
    alive through the parameter's hooks, which the cycle collector does not see): the gradient
    summed over the group; in the first backward whose gradient is not zero on every rank (eager),
    first a ``ValueError`` on every rank where it is the same on every rank
    (:func:`_same_on_every_rank`): the module ran on a tensor whole on every rank, and the sum
    would count its gradient p times."""
    checked: List[bool] = []

    def summed(grad: torch.Tensor) -> torch.Tensor:
        if _whole_at_first(grad, group, checked):
            raise ValueError(
                f"tp_kernels: sum_grads_over_group: {module_type}'s parameter {attr!r}: its gradient is "
                "the same on every rank of the group: each rank computed the whole gradient already (the module "
                "ran on a tensor whole on every rank: the residual stream without sequence parallelism, a row "
                f"layer's summed output), and the sum would count it {coll.group_size(group)} times. Sum only "
                "the gradients of a module run on each rank's part (this rank's heads, a sequence-parallel "
                "block); keep this one as it is ('replicate' in a plan)")
        return coll.all_reduce(grad, group).wait()

    return summed


def _whole_at_first(grad: torch.Tensor, group, checked: List[bool]) -> bool:
    """Whether ``grad`` is the same on every rank of ``group`` (:func:`_same_on_every_rank`), asked
    once: in the first eager backward (not traced, not captured) whose gradient is not zero on
    every rank, which then marks ``checked``; False at every other call, every rank alike."""
    if _recording() or checked:
        return False
    same = _same_on_every_rank(grad, group)
    if same is not None:
        checked.append(True)
    return bool(same)


def _same_on_every_rank(grad: torch.Tensor, group) -> Optional[bool]:
    """Whether every rank of ``group`` holds the same ``grad`` (each rank calls it): the ranks'
    digests of it compared (its sum, the sum of its squares and of each element times its
    position, in float64: what the same tensor gives on every rank, and different ones do not;
    one all-gather of three numbers). None where it is zero on every rank (nothing to tell)."""
    g = grad.detach().reshape(-1).to(torch.float64)
    positions = torch.arange(1, g.numel() + 1, dtype=torch.float64, device=g.device)
    digest = torch.stack([g.sum(), g.square().sum(), (g * positions).sum()])
    every = coll.all_gather_dim0(digest[None], group).wait()
    if not bool(every[:, 1].any()):
        return None
    return bool((every == every[0]).all())


def sum_output_grads_over_group(module: nn.Module, columns: Optional[int], group=None) -> nn.Module:
    """Sum over the group, in every backward, the gradient of the last ``columns`` columns of
    ``module``'s output (along its last dim; ``None``: all of it); the output itself is unchanged.

    For a module every rank holds whole and runs alike, a part of whose output each rank then
    applies to its own heads only: DeepSeek's multi-head latent attention projects the input to
    ``[compressed key/value, rotary key]`` (``kv_a_proj_with_mqa``), the first part through a
    column layer (which sums its own input's gradient) and the second straight into every head's
    key. Each rank's gradient of that second part is its heads' share; without the sum, the ranks
    would update the projection differently, silently. So, whole, for a module whose output scales a
    term each rank holds its partial sum of: a shared expert's gate (Qwen 2 MoE's and Qwen 3 Next's
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``), where that expert's row layer leaves its
    output partial for the mixture's one reduce-scatter. Installed as a forward hook (one
    all-reduce per backward); returns ``module``. Nothing with one rank. :func:`parallelize`'s
    styles ``"mla_kv_a_proj"`` (Hugging Face's name) and ``"replicated_with_output_grad_allreduce"``
    call it with the model's ``qk_rope_head_dim`` and with ``None``.

    The gradient summed must be each rank's part. In the first backward that reaches it (eager;
    not zero on every rank), the gradient before the sum is compared across the ranks (a digest
    of it: one all-gather of three numbers): the same on every rank, each rank already holds the
    whole gradient, which the sum would count once per rank (the output scales something every
    rank holds whole, a shared expert whose row layer sums its output, or feeds a column layer,
    which sums its input's gradient itself). Every rank then raises a ``ValueError`` naming the
    module, before the gradient reaches its parameters."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected an nn.Module, got {type(module).__name__}")
    if columns is not None:
        check_int("columns", columns)
    group = coll.resolve_group(group)
    if coll.group_size(group) == 1:
        return module
    checked: List[bool] = []  # (the first backward's check has run: every rank alike)

    def hook(mod, args, output):
        def check():
            if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[-1] < (columns or 0):
                raise ValueError(f"tp_kernels: sum_output_grads_over_group: {type(mod).__name__}'s output is "
                                 f"{describe(output) if isinstance(output, torch.Tensor) else type(output).__name__}, "
                                 f"which has no last {'dim' if columns is None else f'{columns} columns'}")

        # (agreed, as the layers' calls: ranks whose outputs differ raise together, before the backward's sum)
        agree(f"{type(mod).__name__} (sum_output_grads_over_group)", group, check,
              lambda _: f"output {describe(output)}, {'all' if columns is None else f'its last {columns}'} columns",
              hint=output)
        own, shared = (None, output) if columns is None else output.split([output.shape[-1] - columns, columns], -1)
        summed = copy_to(shared, group)
        # (registered outside traces, whose graph would hold it; a CUDA graph's captured forward registers it too:
        # its check runs in an eager backward, and _whole_at_first skips a captured one)
        if not torch.compiler.is_compiling() and not checked and summed.requires_grad:
            summed.register_hook(_check_parts(type(mod).__name__, columns, group, checked))
        return summed if own is None else torch.cat([own, summed], -1)

    module.register_forward_hook(hook)
    return module


def _check_parts(module_type: str, columns: Optional[int], group, checked: List[bool]):
    """The hook on the output of :func:`sum_output_grads_over_group`'s sum that checks, the first
    time a backward reaches one with a gradient not zero on every rank, that each rank's gradient
    there is its part, not the whole: a ``ValueError`` naming the module's type on every rank
    where it is the same on every rank (:func:`_same_on_every_rank`)."""

    def check(grad: torch.Tensor) -> None:
        if _whole_at_first(grad, group, checked):  # (checked: also by the hooks of other forwards' outputs)
            what = "its output" if columns is None else f"its output's last {columns} columns"
            raise ValueError(
                f"tp_kernels: sum_output_grads_over_group: {module_type}: the gradient of {what} is the "
                f"same on every rank of the group: each rank holds the whole gradient already, and the sum would "
                f"count it {coll.group_size(group)} times. Sum it only where each rank's output scales, or feeds, "
                "its own part (a shared expert whose row layer leaves its output partial, this rank's heads); where "
                "every rank uses it whole (a row layer's summed output, a column layer's input), keep the module "
                "as it is ('replicate' in a plan)")

    return check


#: id(parameter) -> the parameter whose gradients sum_grads_over_group sums (ids are reused: the
#: weak reference tells the parameter hooked from a later one; shared parameters are hooked once).
#: Only :func:`_remember_summed` changes it, never a weak reference's callback: a compiled forward
#: reads and writes this dict, and torch.compile's code rewrites it whole from what it read before
#: running, so an entry a collected parameter's callback removed in between raised a ``KeyError``.
_SUMMED: Dict[int, weakref.ref] = {}


def _remember_summed(params: List[torch.Tensor]) -> None:
    """Enter ``params`` in :data:`_SUMMED`; in eager code, first drop the entries of parameters
    collected since, in one pass per call (under torch.compile the pass over every entry would be
    traced, and guarded, at each new parameter: they wait for the next eager call)."""
    if not torch.compiler.is_compiling():
        for key in [key for key, ref in _SUMMED.items() if ref() is None]:
            del _SUMMED[key]
    for param in params:
        _SUMMED[id(param)] = weakref.ref(param)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel model: the norm of the whole
    model's gradient, the same on every rank of the tensor-parallel group, and every gradient
    scaled by the same factor.

    Plain ``clip_grad_norm_`` on each rank sees only that rank's shards, so the ranks clip by
    different factors and the parameters every rank holds whole (a row-parallel bias, the norms)
    drift apart. Here the shards of the parallel layers' parameters (their
    ``sharded_parameters``) count on every rank and are summed over the group (a replicated
    output's block once, on the first rank holding it), and a parameter every rank holds whole
    counts once (rank 0's: under sequence parallelism, sum such gradients first with
    :func:`allreduce_sequence_parallel_grads`). One all-reduce of one number, on every
    rank whether or not it has gradients. Each gradient's norm is taken in float32 (float64 for
    float64 gradients) and the total in float64; the scale is ``min(1, max_norm / (total + 1e-6))``,
    as torch's. Where FSDP2 shards the parameters further over the data-parallel ranks (``DTensor``
    s over its mesh), each rank counts its rows of them (an HSDP replica once) and the total is
    summed over the mesh's ranks too: one more all-reduce per mesh dim.

    Args:
        module: the model (its parameters with a gradient take part, each once).
        max_norm: the largest norm the gradient keeps, >= 0.
        norm_type: the norm's order p: a positive number, or ``math.inf``.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the total is NaN or
            infinite, instead of scaling by it.
    Returns:
        The total norm before clipping, a float64 scalar (on the gradients' device), the same on
        every rank.
    """
    blocks, group, groups_error = sharded_blocks(module)
    sharded = {id(param): (dim, layer) for param, dim, layer in blocks.values()}
    names = {id(q): name for name, q in module.named_parameters()} if isinstance(module, nn.Module) else {}

    def check():
        if groups_error:
            raise ValueError(groups_error)
        mesh = dp.data_parallel_mesh(module)
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
            raise ValueError(f"max_norm: expected a number >= 0, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ValueError(f"norm_type: expected a positive number or math.inf, got {norm_type!r}")
        params = [q for q in module.parameters() if q.grad is not None]
        for q in params[1:]:
            if q.grad.device != params[0].grad.device:
                raise ValueError(f"module: its gradients are on several devices ({params[0].grad.device}, "
                                 f"{q.grad.device})")
        # (FSDP2: each gradient this rank's rows of the parameter's, as the parameter is placed)
        parts = [dp.rows(q.grad, f"module: the gradient of {names[id(q)]!r}") if dp.is_sharded(q.grad) else
                 dp.Rows(q.grad, 0, mesh is None or dp.first_copy(mesh)) for q in params]
        return params, parts, mesh

    # (a rank may hold no gradient: it still takes part in the all-reduce, and scales nothing)
    params, parts, mesh = agree(
        "clip_grad_norm_", group, check,
        lambda checked: f"max_norm {max_norm}, norm_type {norm_type}, error_if_nonfinite {error_if_nonfinite}, "
                        f"data-parallel mesh {None if checked[2] is None else tuple(checked[2].shape)}",
        hint=next((q.grad for q in module.parameters() if q.grad is not None), None))
    if params:
        device = parts[0].local.device
    else:  # nothing to clip here, but the group's all-reduce still needs this rank
        cuda = torch.cuda.is_available()
        device = coll.exchange_device(group, torch.device("cuda", torch.cuda.current_device()) if cuda else
                                      torch.device("cpu"))
    rank0 = coll.group_rank(group) == 0
    # what this rank adds to the total: its shards (of a replicated output's block, the first rank
    # holding it), and (rank 0) what every rank holds whole; of each, with FSDP2, its rows, once
    counted = [piece for q, part in zip(params, parts) if part.counted
               for piece in (own_pieces(part.local, *sharded[id(q)], start=part.start) if id(q) in sharded else
                             [part.local] if rank0 else [])]
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.promote_types(g.dtype, torch.float32)).double()
             for g in counted]
    inf = math.isinf(norm_type)
    if not norms:
        part = torch.zeros((), device=device, dtype=torch.float64)
    elif inf:
        part = torch.stack(norms).amax()
    else:
        part = torch.stack(norms).pow(norm_type).sum()
    part = part.reshape(1)  # the float64 number every rank adds (or, for inf, maxes) over the group
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = coll.all_reduce(part, group, op=op, inplace=True).wait()
    for data_parallel in dp.mesh_groups(mesh) if mesh is not None else ():  # then over the data-parallel ranks
        total = coll.all_reduce(total, data_parallel, op=op, inplace=True).wait()
    total = total[0]
    if not inf:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"tp_kernels: clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}, so they cannot be clipped (error_if_nonfinite=True)")
    if params:
        _scale_grads(params, max_norm, total)
    return total


def _scale_grads(params, max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients of ``params`` by ``min(1, max_norm / (total + 1e-6))``: torch's own
    ``clip_grads_with_norm_`` where it has one (torch >= 2.6), else the same product per gradient."""
    plain = [q for q in params if not dp.is_sharded(q.grad)]
    clip = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip is not None and len(plain) == len(params):
        clip(params, max_norm, total)
        return
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for q in params:  # (an FSDP2 gradient: its local rows, in place)
        dp.local(q.grad).mul_(scale.to(q.grad.dtype))
