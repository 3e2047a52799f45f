"""The experts of a mixture of experts under tensor parallelism: every rank holds its block of
every expert, or whole experts of its own.

A mixture of experts keeps its experts' weights as 3-D parameters, one matrix per expert
(Hugging Face's ``*Experts`` modules: ``gate_up_proj`` ``[E, 2I, H]``, the gate's and the up
projection's rows one after the other, and ``down_proj`` ``[E, H, I]``), and runs them in its own
code, not through ``nn.Linear``. :func:`shard_experts` splits each such parameter in place, every
expert's matrix as a column or a row layer splits its weight, so that each rank computes every
expert's share of the hidden units for every token routed to it, and the ranks' outputs are summed:
Megatron-LM's tensor-parallel experts, and transformers' ``moe_tp_experts`` style. Their biases
(GPT-OSS's ``[E, out]``): one of the split outputs is split as they are, one of the summed outputs
is kept whole and added by one rank. :func:`tp_kernels.parallelize` calls it for a plan's
``"moe_tp_experts"`` modules.

Or the ranks split the experts themselves (expert parallelism over the tensor-parallel group,
``"experts"`` for every parameter: transformers' ``ep_dispatch_experts`` with ``grouped_gemm``,
``DistributedConfig(ep_implementation="all_reduce")``): each rank holds ``c = ceil(E/p)`` whole
experts and runs them on the tokens routed to them, of the tokens every rank holds alike; a route
to an expert held elsewhere reaches this rank's experts as the expert id ``c`` with weight 0, which
transformers' experts skip (where a plain loop of theirs does not, an error names the
implementations that do: :func:`unskipped_elsewhere`), and the ranks' outputs are summed as
above. No token moves, so no count is read back to the host; each expert's matrices stay whole (a GEMM as large as the dense
model's), and any expert count will do (where p does not divide it, the last ranks' blocks end in
zero experts that no route reaches, as ``torch.chunk`` and a ``DTensor``'s ``Shard`` split it:
Qwen1.5-MoE's 60 over 8 ranks), where the hidden-unit split needs each expert's hidden units
divided.

The router stays whole on every rank (it must route alike: it sees the same tokens and holds the
same weights). In the backward, the gradients of the experts' floating-point inputs (the hidden
states and the routing weights) are each rank's share, summed over the group.

:func:`shard_parameters` is the split alone, for a module that applies parameters of its own to
this rank's heads (an attention's per-head sinks, ``[heads]``): transformers' ``local_params``.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from . import _collectives as coll
from ._agreement import agree, describe
from ._checks import apply_function, with_eager_form
from .layers import ParameterSplit, split_block, split_in_place
from .mappings import all_gather_op, copy_to, gather_dim0, partial_grads_of, reduce_from, reduce_scatter_dim0

__all__ = ["PARAMETER_STYLES", "WHOLE_EXPERTS", "check_styles", "shard_experts", "shard_parameters",
           "share_identity_expert"]

#: a parameter style -> ({the parameter's number of dims: the dim it splits, None: kept whole}, the
#: parts that dim is made of, each split into p blocks). Hugging Face's names, by the dims as the
#: parameter holds them: of a 3-D ``[experts, out, in]`` parameter, ``"colwise"`` splits each
#: expert's output rows, ``"rowwise"`` its input columns (of a transposed ``[experts, in, out]``
#: one, GPT-OSS's, ``"rowwise"`` splits its outputs, ``"colwise"`` its inputs), ``"packed_*"`` the
#: same for two matrices packed side by side (``[gate; up]``), each split on its own, so a rank
#: holds its block of the gate and the same block of the up projection; of a 2-D ``[experts, out]``
#: bias, ``"colwise"`` (``"packed_colwise"``) splits its outputs as its weight's are, and
#: ``"rowwise"``, the bias of outputs the ranks sum (a row split's: the down projection's), keeps
#: it whole, added by one rank (:func:`shard_experts`); of a 1-D one, a value per output (per head),
#: ``"colwise"`` splits it as the outputs are. ``"experts"`` splits dim 0, whole experts: of a 3-D
#: weight, and of a 2-D ``[experts, out]`` bias.
PARAMETER_STYLES = {"colwise": ({1: 0, 2: 1, 3: 1}, 1), "rowwise": ({2: None, 3: 2}, 1),
                    "packed_colwise": ({2: 1, 3: 1}, 2), "packed_rowwise": ({3: 2}, 2), "experts": ({2: 0, 3: 0}, 1)}
#: the style that splits whole experts: a module's styles are all it (expert parallelism) or none
WHOLE_EXPERTS = "experts"


def shard_experts(module: nn.Module, styles: Mapping[str, str], group=None, *,
                  sequence_parallel: bool = False, partial_output: bool = False) -> nn.Module:
    """Shard the expert weights of ``module`` in place, and make its forward tensor-parallel.

    ``styles`` maps each parameter of ``module`` (its own, by name: ``{"gate_up_proj":
    "packed_colwise", "down_proj": "rowwise"}``) to a style of :data:`PARAMETER_STYLES`; each is a
    3-D parameter, one matrix per expert, and becomes this rank's block of it (of each part, the
    ``tp_rank``-th of p equal blocks), so the state dict, :func:`tp_kernels.clip_grad_norm_` and the
    checkpoints (:mod:`tp_kernels.checkpoints`) treat it as they treat a parallel layer's weight.
    Then, on every forward, the floating-point tensors ``module`` is called with (the hidden
    states, the routing weights) pass unchanged (their gradients summed over the group in the
    backward; the hidden states a torch style gathered for the module around them,
    :func:`tp_kernels.mappings.gather_for_column_layers`, as they are or reshaped whole, leave
    theirs for that gather's one reduce-scatter), and its output, each rank's partial sum over
    its blocks of the hidden units, is summed over the group. With fingerprints on (:func:`tp_kernels.settings.set_fingerprints`),
    the call is agreed with the group first (the shapes and dtypes of every tensor argument), so
    ranks that routed different token counts raise together, before the sum.

    With ``"experts"`` for every parameter (expert parallelism: a 3-D weight's or a 2-D
    ``[experts, out]`` bias's dim 0), each rank holds experts ``[r c, (r+1) c)`` whole, ``c =
    ceil(E/p)`` (where p does not divide E, the last ranks' blocks end in zero experts, which no
    route reaches and whose gradients are zero), and ``module.num_experts`` becomes ``c``.
    ``module`` is called as transformers' experts are,
    ``(hidden_states, top_k_index, top_k_weights)`` (its forward's first three parameters, by
    position or name), the expert ids global; it gets this rank's local ids, and for a route to an
    expert held elsewhere the id ``c`` with weight 0, which it must skip, or run as another id times
    that weight (transformers' experts do: their loop's ``expert_idx == self.num_experts``, and the
    grouped and batched GEMMs' sentinel rows, which ``_is_expert_parallel``, set here, turns on;
    their plain loops before transformers 5.18, and GPT-OSS's and Nemotron-H's, do not, and are a
    ``ValueError`` here and on each call: :func:`unskipped_elsewhere`). Its output is summed as
    above, and the gradient of each routing weight comes from the rank holding its expert.

    With ``sequence_parallel=True`` each rank calls ``module`` with its own block of the tokens
    (dim 0 of every tensor argument: the hidden states ``[T/p, ...]``, the expert ids and routing
    weights ``[T/p, k]``, as a router run on this rank's sequence block gives them): they are
    gathered along dim 0 first (the gradients of the floating-point ones reduce-scattered back),
    and the summed output reduce-scattered, so each rank gets its block of it, ``[T/p, ...]``:
    Megatron-LM's experts under sequence parallelism. A router (any parameter every rank holds
    whole and applies to its block) then needs :func:`tp_kernels.allreduce_sequence_parallel_grads`.

    With ``partial_output=True`` (not with ``sequence_parallel``) the output is left each rank's
    partial sum, its gradient taken as it comes (whole on every rank), for a module around
    ``module`` that sums it with the rest of its output: a torch style's ``Partial()`` output,
    reduce-scattered along the sequence (``PrepareModuleOutput(output_layouts=Partial(),
    desired_output_layouts=Shard(1))``), one move where a sum and a split would be two.

    Every parameter ``module`` holds must be named (a parameter every rank held whole, an
    expert's output bias, would be added p times: ``"rowwise"`` keeps such a 2-D ``[experts, out]``
    bias of the summed outputs whole on every rank, rank 0 adds it, the others a zero, and its
    gradient, rank 0's, is summed to every rank, in the backward; a bias of the split outputs,
    ``"colwise"``, is split as they are) and its parts must divide by the group's size (but for
    whole experts; where gate and up outputs are interleaved, GPT-OSS's, into whole pairs);
    each is checked (:func:`check_styles`), with the ``ValueError`` naming it, before anything
    changes. Returns ``module``; with one rank, its parameters stay the same objects, and nothing
    is hooked.
    """
    group = coll.resolve_group(group)
    p, r = coll.group_size(group), coll.group_rank(group)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel: expected a bool, got {sequence_parallel!r}")
    if not isinstance(partial_output, bool):
        raise ValueError(f"partial_output: expected a bool, got {partial_output!r}")
    if partial_output and sequence_parallel:
        raise ValueError("partial_output: experts under sequence parallelism reduce-scatter their output "
                         "themselves; leave it partial only without sequence_parallel")
    splits = check_styles(module, styles, p, every=True)
    _split(module, splits, group)
    if p == 1:  # (nothing to sum)
        return module
    once = [name for name, (dim, _) in splits.items() if dim is None]  # (kept whole, added by one rank)
    held: Dict[str, nn.Parameter] = {}  # (a bias added by one rank, during a call: the parameter itself)
    by_expert = _by_expert(styles)
    local = signature = routing = None
    if by_expert:
        local = module.num_experts = split_block(module.num_experts, p, r)[0]  # (this rank's experts, padding too)
        signature = _routing_arguments(module)  # (made once: it binds every call)
        routing = tuple(signature.parameters)[:3]  # (hidden states, expert ids, weights)
        if hasattr(module, "_is_expert_parallel"):  # (transformers' grouped GEMMs then skip the sentinel rows)
            module._is_expert_parallel = True
    call = (f"{type(module).__name__} (experts sharded by shard_experts"
            f"{', sequence parallel' if sequence_parallel else ', output partial' if partial_output else ''})")

    def tensors(args, kwargs):
        return [(f"args[{i}]", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)] + \
               [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]

    def summed_grads(x):  # every rank's tokens (sequence parallel: gathered); the gradient summed over the group
        if not isinstance(x, torch.Tensor):
            return x
        if sequence_parallel:
            return gather_dim0(x, group) if x.is_floating_point() else all_gather_op(x, group)
        if not x.is_floating_point():
            return x
        # (the tokens a torch style gathered for the module: their gradient left for its one reduce-scatter)
        x, left = partial_grads_of(x, group)
        return x if left else copy_to(x, group)

    def check(args, kwargs, given):
        if sequence_parallel:  # (every tensor argument a block of the same tokens)
            rows = {t.shape[0] if t.dim() else None for _, t in given}
            if len(rows) > 1 or None in rows:
                raise ValueError(f"{call}: every tensor argument must be this rank's block of the tokens, along "
                                 f"dim 0, but they are {', '.join(f'{where} {describe(t)}' for where, t in given)}")
        if not by_expert:
            return None
        unskipped = unskipped_elsewhere(module)
        if unskipped:
            raise ValueError(f"{call}: {unskipped}")
        return _bind_routing(call, signature, routing, args, kwargs)

    def before(mod, args, kwargs):
        for name in once:  # (rank 0's is the bias, the others' zero: its gradient, rank 0's, summed to every rank)
            held[name] = mod._parameters[name]
            mod._parameters[name] = copy_to(held[name], group) * (1.0 if r == 0 else 0.0)
        given = tensors(args, kwargs)
        bound = agree(call, group, lambda: check(args, kwargs, given),
                      lambda _: ", ".join(f"{where} {describe(t)}" for where, t in given),
                      hint=given[0][1] if given else None)
        if not by_expert:
            return tuple(summed_grads(a) for a in args), {k: summed_grads(v) for k, v in kwargs.items()}
        index = summed_grads(bound.arguments[routing[1]]) - r * local  # (this rank's ids; any other is elsewhere)
        elsewhere = (index < 0) | (index >= local)
        bound.arguments[routing[1]] = index.masked_fill(elsewhere, local)
        bound.arguments[routing[2]] = summed_grads(bound.arguments[routing[2]]).masked_fill(elsewhere, 0)
        return (tuple(a if i in (1, 2) else summed_grads(a) for i, a in enumerate(bound.args)),
                {k: summed_grads(v) for k, v in bound.kwargs.items()})

    def after(mod, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"tp_kernels: {call} returned a {type(output).__name__}; its output must be one tensor, "
                            "the sum of its experts' outputs, which is summed over the group")
        summed = output if partial_output else reduce_scatter_dim0(output, group) if sequence_parallel else \
            reduce_from(output, group)
        if by_expert and torch.is_grad_enabled():  # (args: what before gave the module; see _AfterInputs)
            inputs = [q for q in mod.parameters() if q.requires_grad]
            inputs += [t for _, t in tensors(args, kwargs) if t.requires_grad]
            return apply_function(_AfterInputs, summed, *inputs)
        return summed

    def restore(*_):
        for name, param in held.items():
            module._parameters[name] = param
        held.clear()

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)
    if once:
        module.register_forward_hook(restore, always_call=True)
    return module


@with_eager_form
class _AfterInputs(torch.autograd.Function):
    """``output`` itself, made to depend on ``inputs`` (the experts' parameters and the tensors
    they were called with): backward, its gradient, and a zero one for each input. Under expert
    parallelism a rank whose experts no route reached computes its output without its inputs or its
    experts' weights, so the backward of the inputs' collectives (the sum of their gradients over
    the group) would not run there while it runs on the other ranks, and its weights would get no
    gradient. Through this the collectives run on every rank, in the same order, and every weight
    gets a gradient, zero for an expert no token reached, as the dense model's weight of every
    expert has: an optimizer's momentum and weight decay step it as they step the dense model's,
    and FSDP2 reduce-scatters it on every data-parallel rank. (The cost: a zero added to each
    weight's gradient, a pass over its memory.) In the form ``torch.func``'s transforms take."""

    generate_vmap_rule = True

    @staticmethod
    def forward(output, *inputs):
        return output.view_as(output)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs[1:]]

    @staticmethod
    def backward(ctx, dy):
        return (dy, *(torch.zeros((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.inputs))


def share_identity_expert(module: nn.Module, group=None) -> nn.Module:
    """Divide the input of ``module``, an identity ("zero-computation") expert inside experts that
    :func:`shard_experts` splits by hidden units, by the group's size on every forward: every rank
    runs it whole on the tokens routed to it, and the experts' output is summed over the group,
    which would count its output p times (LongCat-Flash's ``identity_expert``: transformers'
    ``moe_identity_expert``). The gradients of its input are each rank's share, summed with the
    experts' inputs'. Returns ``module``; with one rank, nothing is hooked."""
    group = coll.resolve_group(group)
    p = coll.group_size(group)
    if p == 1:
        return module

    def before(mod, args):
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            raise TypeError(f"tp_kernels: {type(mod).__name__} (an identity expert, share_identity_expert) takes "
                            "the tokens, a floating-point tensor, first")
        return (args[0] / p, *args[1:])

    module.register_forward_pre_hook(before)
    return module


def _gate_and_up(module: nn.Module, name: str, dims: int) -> Optional[Tuple[int, bool]]:
    """``(dim, interleaved)``: the dim of ``module``'s ``name`` (of ``dims`` dims) that holds a
    gate's and an up projection's outputs, as transformers' experts say of their ``gate_up_proj``
    and its bias (``has_gate``; dim 1, or 2 of a weight with ``is_transposed``), and whether they
    are interleaved, ``[gate 0, up 0, gate 1, up 1, ...]`` (``is_concatenated=False``: GPT-OSS's),
    rather than one after the other; None where nothing says so."""
    if name not in ("gate_up_proj", "gate_up_proj_bias") or not getattr(module, "has_gate", False) or \
            not hasattr(module, "is_concatenated"):
        return None
    return 2 if dims == 3 and getattr(module, "is_transposed", False) else 1, not module.is_concatenated


def _by_expert(styles: Mapping[str, str]) -> bool:
    """Whether ``styles`` split whole experts (expert parallelism), checked to be all or none."""
    whole = [name for name, style in styles.items() if style == WHOLE_EXPERTS]
    if whole and len(whole) < len(styles):
        others = sorted(set(styles) - set(whole))
        raise ValueError(f"styles: {whole} split whole experts ({WHOLE_EXPERTS!r}) and {others} each expert's hidden "
                         "units; the parameters of one module's experts are split one way")
    return bool(whole)


#: The first transformers version whose experts' plain loop (``experts_implementation="eager"``)
#: skips the id ``num_experts``: before it, the loop counts ``num_experts`` classes in its
#: ``one_hot``, so that id is out of range there (a RuntimeError on the CPU, on a GPU a device-side
#: assert, after which the process's CUDA context is lost). Its other implementations skip it.
LOOP_SKIPS_ELSEWHERE_SINCE = (5, 18)
#: transformers' experts whose plain loop does not skip that id in the versions since either
#: (5.24): GPT-OSS's one_hot counts num_experts classes, Nemotron-H's loop indexes past its experts.
LOOPS_WITHOUT_SKIP = ("GptOssExperts", "NemotronHExperts")


@functools.lru_cache(maxsize=None)
def _transformers_version() -> tuple:
    """The installed transformers' (major, minor), read once."""
    import transformers

    return tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])


def unskipped_elsewhere(module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot skip the routes to experts held elsewhere (the id ``num_experts``,
    which expert parallelism hands it), or ``None``: the experts of a transformers model run by
    a plain loop that does not (every one before :data:`LOOP_SKIPS_ELSEWHERE_SINCE`, and those of
    :data:`LOOPS_WITHOUT_SKIP`). Read on each call (a model's ``set_experts_implementation``
    changes it); any other module is taken to skip that id, as :func:`shard_experts` says it
    must."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.") or not hasattr(cls.forward, "__wrapped__"):
        return None  # (not transformers' experts, whose forward dispatches on the implementation)
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in (None, "eager") or (
            cls.__name__ not in LOOPS_WITHOUT_SKIP and _transformers_version() >= LOOP_SKIPS_ELSEWHERE_SINCE):
        return None
    import transformers

    fix = ("run expert parallelism with experts_implementation='batched_mm' or 'grouped_mm' "
           "(model.set_experts_implementation)")
    if cls.__name__ in LOOPS_WITHOUT_SKIP:
        return (f"{cls.__name__}'s plain loop of experts (experts_implementation={implementation!r}) does not skip "
                f"the routes to experts held elsewhere (the id num_experts) in transformers "
                f"{transformers.__version__}; {fix}")
    since = ".".join(map(str, LOOP_SKIPS_ELSEWHERE_SINCE))
    return (f"{cls.__name__} runs transformers {transformers.__version__}'s plain loop of experts "
            f"(experts_implementation={implementation!r}), which does not skip the routes to experts held "
            f"elsewhere (the id num_experts: its one_hot counts num_experts classes); {fix}, or use transformers "
            f"{since} or later")


def _routing_arguments(module: nn.Module) -> inspect.Signature:
    """The first three parameters of ``module``'s forward, which expert parallelism reads as
    ``(hidden_states, top_k_index, top_k_weights)``, as a signature that binds a call's arguments
    (whatever follows them too), made once."""
    names = [name for name, q in inspect.signature(module.forward).parameters.items()
             if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)][:3]
    if len(names) < 3:
        raise ValueError(f"module: expert parallelism calls {type(module).__name__} as transformers' experts are, "
                         f"(hidden_states, top_k_index, top_k_weights), but its forward takes {names}")
    return inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
                             + [inspect.Parameter("rest", inspect.Parameter.VAR_POSITIONAL),
                                inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD)])


def _bind_routing(call: str, signature: inspect.Signature, routing: tuple, args, kwargs) -> inspect.BoundArguments:
    """The call's arguments, bound by :func:`_routing_arguments`' ``signature``, after checking that
    the routing ones (``routing``, its first three names) are what expert parallelism remaps:
    integer expert ids and floating-point weights of the same shape."""
    hidden, index, weights = routing
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"{call}: expected ({', '.join(routing)}, ...): {exc}") from None
    got = [bound.arguments[name] for name in routing]
    if not (isinstance(got[1], torch.Tensor) and not got[1].is_floating_point() and not got[1].is_complex()
            and got[1].dtype != torch.bool):
        raise ValueError(f"{call}: {index}: expected a tensor of integer expert ids, got {describe(got[1])}")
    if not (isinstance(got[2], torch.Tensor) and got[2].is_floating_point() and got[2].shape == got[1].shape):
        raise ValueError(f"{call}: {weights}: expected floating-point routing weights of {index}'s shape "
                         f"{list(got[1].shape)}, got {describe(got[2])}")
    if not (isinstance(got[0], torch.Tensor) and got[0].is_floating_point()):
        raise ValueError(f"{call}: {hidden}: expected floating-point hidden states, got {describe(got[0])}")
    return bound


def shard_parameters(module: nn.Module, styles: Mapping[str, str], group=None, *, every: bool = False) -> nn.Module:
    """Replace each parameter of ``module`` that ``styles`` names (``{"sinks": "colwise"}``) by this
    rank's block of it, in place, as :data:`PARAMETER_STYLES` splits it; its module's
    ``parameter_splits`` says how, for the state dicts, the norm and the checkpoints. Nothing else
    changes: for a module that applies each block to this rank's own heads or hidden units. Checked
    first (:func:`check_styles`; ``every``: every parameter of ``module`` must be named). Returns
    ``module``; with one rank, its parameters stay the same objects."""
    group = coll.resolve_group(group)
    _split(module, check_styles(module, styles, coll.group_size(group), every=every), group)
    return module


def _split(module: nn.Module, splits: Mapping[str, tuple], group) -> None:
    """Split the parameters of ``module`` as :func:`check_styles`' ``splits`` say (those kept whole,
    dim None, stay)."""
    split_in_place(module, {name: (dim, ParameterSplit(group, parts))
                            for name, (dim, parts) in splits.items() if dim is not None})


def check_styles(module: nn.Module, styles: Mapping[str, str], p: int, *, every: bool = True,
                 by_expert: Optional[bool] = None) -> Dict[str, tuple]:
    """What :func:`shard_experts` (and :func:`shard_parameters`) checks before it changes anything:
    ``{name: (the dim it splits, the sizes of its parts)}`` for each parameter ``styles`` names, or
    a ``ValueError`` naming the argument (and the parameter) that cannot be split so; with
    ``every``, one too if ``module`` holds a parameter ``styles`` does not name. Styles that split
    whole experts (``"experts"``) must be all of them (or, with ``by_expert`` given, all or none as
    it says), and ``module.num_experts`` the number of experts they split."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(styles, Mapping) or not styles:
        raise ValueError(f"styles: expected a non-empty mapping of parameter names to styles, got {styles!r}")
    if "parameter_splits" in module.__dict__:
        raise ValueError(f"module: this {type(module).__name__}'s experts are sharded already")
    held = dict(module.named_parameters())
    splits: Dict[str, tuple] = {}
    for name, style in styles.items():
        if name not in module._parameters or module._parameters[name] is None:
            raise ValueError(f"styles[{name!r}]: {type(module).__name__} holds no parameter {name!r} of its own "
                             f"(it holds {sorted(held)})")
        if style not in PARAMETER_STYLES:
            raise ValueError(f"styles[{name!r}]: unknown style {style!r}; expected one of "
                             f"{', '.join(map(repr, PARAMETER_STYLES))}")
        param = module._parameters[name]
        dims, parts = PARAMETER_STYLES[style]
        if param.dim() not in dims:
            kinds = {1: "a 1-D one, a value per output", 2: "a 2-D one, a row per expert ([experts, out])",
                     3: "a 3-D one, a matrix per expert ([experts, out, in])"}
            raise ValueError(f"styles[{name!r}]: {style!r} takes {' or '.join(kinds[n] for n in dims)}, but "
                             f"{name!r} has shape {list(param.shape)}")
        dim = dims[param.dim()]
        if dim is None:  # (whole, added by one rank: only where the ranks' outputs are summed, the experts')
            if not every:
                raise ValueError(f"styles[{name!r}]: {style!r} keeps a 2-D bias whole, added by one rank of those "
                                 f"whose outputs are summed, which only a mixture's experts' are (shard_experts); "
                                 f"{type(module).__name__}'s are not")
            splits[name] = (None, None)
            continue
        size = param.shape[dim]
        layout = _gate_and_up(module, name, param.dim())
        if layout is not None and dim == layout[0]:
            what = ("rows" if dim == 1 else "columns") if param.dim() == 3 else "values"
            if parts == 1 and not layout[1]:
                raise ValueError(f"styles[{name!r}]: {type(module).__name__} keeps its gate's and its up projection's "
                                 f"{what} one after the other in {name!r} (transformers' has_gate and "
                                 f"is_concatenated), so {style!r} would give a rank gate {what} or up {what}, not its "
                                 f"block of each: use {'packed_' + style!r}")
            if parts == 2 and layout[1]:
                raise ValueError(f"styles[{name!r}]: {type(module).__name__} interleaves its gate's and its up "
                                 f"projection's {what} in {name!r} ([gate 0, up 0, gate 1, up 1, ...]: transformers' "
                                 f"is_concatenated=False), so {style!r} would give a rank two blocks of hidden units "
                                 f"its other parameters' blocks do not match: use {style[len('packed_'):]!r}")
            if layout[1] and size % (2 * p):
                raise ValueError(f"styles[{name!r}]: dim {dim} of {name!r} ({size}, interleaved gate and up "
                                 f"{what}) cannot be split into {p} blocks of whole (gate, up) pairs for the "
                                 f"tensor-parallel size {p}")
        if size % (parts * p) and style != WHOLE_EXPERTS:  # (whole experts: the last blocks padded)
            raise ValueError(f"styles[{name!r}]: dim {dim} of {name!r} ({size}"
                             f"{f', {parts} packed parts of {size / parts:g}' if parts > 1 else ''}) cannot be split "
                             f"into {p} equal blocks{' each' if parts > 1 else ''} for the tensor-parallel size {p}")
        splits[name] = (dim, (size // parts,) * parts)
    split_experts = _by_expert(styles)
    if by_expert is not None and split_experts != by_expert:
        raise ValueError("styles: " + (f"expert parallelism splits whole experts: every style must be {WHOLE_EXPERTS!r}"
                                       if by_expert else f"these parameters are split by hidden units or heads, not "
                                       f"by {WHOLE_EXPERTS!r} (whole experts: expert parallelism's style)")
                         + f", got {dict(styles)}")
    if split_experts:
        experts = {module._parameters[name].shape[0] for name in styles}
        count = getattr(module, "num_experts", None)
        if type(count) is not int or {count} != experts:  # (one count, of every parameter)
            raise ValueError(f"module: expert parallelism hands {type(module).__name__} this rank's expert ids, "
                             "its num_experts for an expert held elsewhere, so its num_experts must be its number "
                             f"of experts, dim 0 of every parameter ({sorted(experts)}); got {count!r}")
        _routing_arguments(module)
        unskipped = unskipped_elsewhere(module)
        if unskipped:
            raise ValueError(f"module: {unskipped}")
    whole = sorted(set(held) - set(splits))
    if whole and every:
        raise ValueError(f"styles: {type(module).__name__} also holds {whole}, which every rank would hold whole "
                         "and whose share of the output the sum over the ranks would count once per rank: name "
                         "every parameter of the experts")
    return splits
