"""A transformers decoder model's plan under sequence parallelism, made from its tensor-parallel plan.

transformers' models take the positions and the attention mask from the embedding's output, and
their attention takes the sequence length from its input, so ``parallelize``'s own sequence
parallelism (each column layer gathering its input) does not fit them. TorchTitan runs its models
otherwise, and so can they: the embedding's output whole, the sequence split at the first decoder
layer, the norms run on each rank's block of it, the sequence gathered at the input of each module
that holds the plan's layers (the attention, the MLP) and reduce-scattered by its row layer (a
mixture of experts' output, its experts' partial sums, by the module's output), the head
gathering it.
:func:`sequence_parallel_plan` writes that plan, of torch's styles beside the plan's own entries,
for :func:`tp_kernels.parallelize`.
"""

from __future__ import annotations

import fnmatch
import itertools
from typing import Dict, Mapping, Optional, Tuple

import torch.nn as nn

from ._torch_styles import is_torch_style
from .parallelize import _EXPERTS, _SUMMED_GRADIENTS, ALIASES, read_expert_parallelism

__all__ = ["sequence_parallel_plan"]

#: what the module holding the plan's row layer runs on: its input gathered
_ROW = "rowwise"
#: the style of a head whose output is gathered (the logits whole on every rank; transformers'
#: "colwise_rep" is read as it, :data:`ALIASES`)
_GATHERED_HEAD = "colwise_gather_output"


def _style_name(value) -> str:
    """The style of a plan's value (a tuple's first item), by its own name."""
    name = value[0] if isinstance(value, (tuple, list)) and value else value
    return ALIASES.get(name, name) if isinstance(name, str) else repr(name)


def _submodule(model: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm, by its class's name: what the ranks may run on their blocks
    of the sequence alone."""
    return "norm" in type(module).__name__.lower()


def _matches(layer: nn.Module, relative: str):
    """The modules of ``layer`` whose names (relative to it) a plan's entry matches."""
    return [m for name, m in layer.named_modules() if name and fnmatch.fnmatchcase(name, relative)]


#: the styles of the layers that leave their output whole on every rank, and their gradients as the
#: dense layer's: a module whose plan entries are all such (Phi 3's and OLMo 2's gathered projections,
#: "colwise_rep" and "rowwise_rep") computes its output whole, which the sequence plan then splits
_WHOLE_OUTPUTS = ("colwise_gather_output", "rowwise_split_input", "replicate")


def _kind(layer: nn.Module, name: str, styles, experts, rows, kept) -> str:
    """How the module ``name`` of ``layer`` (its entries' ``styles``) runs under the sequence plan:
    ``"moe"`` (it holds experts), ``"dense"`` (row layers of the plan, each reduce-scattering its
    output: none of those ``kept`` summing theirs whole), else ``"summed"`` (its output whole on
    every rank, then split), which, where it holds no row layer, each layer of the plan it holds
    must leave whole, its gradient the dense layer's: a ``ValueError`` naming one that leaves its
    output split along the hidden units, or whose gradient is summed over the group."""
    if any(_matches(layer, relative) for relative in experts):
        return "moe"
    matched = {relative for relative in rows if _matches(layer, relative)}
    if matched:  # (a row layer kept summing its output whole: the module's output whole)
        return "summed" if matched & kept else "dense"
    for relative, style in styles.items():
        if style not in _WHOLE_OUTPUTS and _matches(layer, relative):
            why = ("whose gradient is summed over the group (each rank's share of it where the module's heads are "
                   "split), but no 'rowwise' layer: every rank would compute the module whole, and the sum count "
                   "that gradient once per rank") if style in _SUMMED_GRADIENTS else \
                ("whose output is split along the hidden units, but no 'rowwise' layer, which would scatter the "
                 "module's output back along the sequence")
            raise ValueError(f"plan: {name} holds {relative!r} ({style!r}), {why}")
    return "summed"


#: the styles of the layers a mixture of experts may hold beside its experts, for its output to be
#: partial sums: column layers (the gathered tokens their input) and row layers (their outputs left
#: each rank's term: RowwiseParallel(output_layouts=Partial()))
_PARTIAL_SUMMANDS = ("colwise", "packed_colwise", _ROW)


def _gates(layer: nn.Module, owner: str, styles) -> Dict[int, str]:
    """The gates of the mixture of experts ``owner`` of ``layer`` that scale an expert beside the
    routed ones (Qwen 2 MoE's and Qwen 3 Next's ``sigmoid(shared_expert_gate(x)) *
    shared_expert(x)``), by id, each its name relative to the layer: a child ``<name>_gate`` of
    the mixture, an ``nn.Linear`` of one output (a scalar a token), beside a child ``<name>`` that
    holds a row layer of the plan (whose output, left partial, the gate then scales)."""
    block = layer.get_submodule(owner)
    rows = {id(m) for relative, style in styles.items() if style == _ROW for m in _matches(layer, relative)}
    children = dict(block.named_children())
    return {id(gate): f"{owner}.{name}_gate" for name, child in children.items()
            for gate in [children.get(f"{name}_gate")]
            if isinstance(gate, nn.Linear) and gate.out_features == 1 and any(id(m) in rows for m in child.modules())}


def _routes(module: nn.Module, counts, hidden) -> bool:
    """Whether ``module`` is a router of experts of ``counts`` experts: a weight ``[E, hidden]``
    among its parameters (Gemma 4's, beside its own norm and scales)."""
    return hidden is not None and any(q.shape == (count, hidden) for q in module.parameters() for count in counts)


def _partial_ok(layer: nn.Module, owner: str, styles, experts, hidden) -> Optional[Tuple[str, ...]]:
    """Whether the output of ``layer``'s mixture of experts ``owner`` is a sum of terms each rank
    computes its share of, so that the ranks' partial sums may go to one reduce-scatter: the plan
    names nothing inside it but the experts, column and row layers (DeepSeek's and Qwen 3 Next's
    shared experts: their row layer's output left partial) and modules it keeps whole, and every
    other module of it that holds parameters is a router (its weight ``[E, hidden]``, and any other
    parameter ``[E]``: its scores go to the routing, not to the output) or the gate of such a shared
    expert (:func:`_gates`: its output, the scale of a partial sum, takes each rank's share of the
    gradient, which the plan then sums over the group). A module held whole that adds to the output
    (Qwen 2 MoE's shared expert, where the plan leaves it whole) adds what the ranks compute alike,
    which a reduce-scatter would count p times: then the experts' output is summed (None). Returns
    the gates' names (relative to the layer), or None."""
    block = layer.get_submodule(owner)
    inner = {id(m) for relative in experts for top in _matches(layer, relative) for m in top.modules()}
    planned = set()
    for relative, style in styles.items():
        if relative in experts or any(relative.startswith(e + ".") for e in experts) or style == "replicate":
            continue  # (a module kept whole, transformers' "ep_router": a router, or not, as below)
        hits = _matches(layer, relative)
        if hits and style not in _PARTIAL_SUMMANDS:
            return None
        planned.update(id(m) for m in hits)
    sizes = {q.shape[0] for m in block.modules() if id(m) in inner for q in m.parameters(recurse=False)
             if q.dim() == 3}  # (the experts' count: their 3-D weights' first dim)
    if len(sizes) != 1 or hidden is None:
        return None
    count = sizes.pop()
    children = {id(child) for child in block.children()}
    gates = _gates(layer, owner, styles)
    for m in block.modules():
        own = [q.shape for q in m.parameters(recurse=False)]
        if not own or id(m) in inner or id(m) in planned or id(m) in gates:
            continue
        router = (id(m) in children and len(own) == len(list(m.parameters())) and (count, hidden) in own
                  and all(shape in ((count, hidden), (count,)) for shape in own))
        if not router:
            return None
    return tuple(gates.values())


def sequence_parallel_plan(model: nn.Module, plan: Optional[Mapping[str, object]] = None) -> Dict[str, object]:
    """The plan that runs ``model``, a transformers decoder model (its decoder layers one
    ``nn.ModuleList``), under sequence parallelism along dim 1 (its ``[b, s, h]``), made from its
    tensor-parallel ``plan`` (default: ``model.tp_plan``), as TorchTitan runs its models:

    * the embedding as the plan has it, its output whole (transformers takes the positions and
      the mask from it);
    * the first decoder layer's input split along the sequence (``PrepareModuleInput``), so that
      each rank runs the decoder layers on its block, ``[b, s/p, h]``;
    * each module of a decoder layer that holds a row layer of the plan (the attention, the MLP):
      its input gathered (``PrepareModuleInput``: the module's code sees the whole sequence), the
      plan's other entries inside it kept, and the row layer reduce-scattering its output back
      (``RowwiseParallel(output_layouts=Shard(1))``);
    * a module holding a mixture of experts (the plan's ``"moe_tp_experts"`` or
      ``"moe_ep_experts"``): its input gathered, its entries kept (the router runs on every token
      on every rank alike, so the routing, and a load-balancing loss from the router's logits, are
      the dense model's), the experts' output left each rank's partial sum (``(style,
      "partial")``), and the module's output reduce-scattered (``PrepareModuleInputOutput(...,
      output_layouts=Partial(), desired_output_layouts=Shard(1))``), one move; a row layer of the
      plan inside it (DeepSeek's and Qwen 3 Next's shared experts') leaves its output partial too
      (``RowwiseParallel(output_layouts=Partial())``), and a gate scaling that expert's term (Qwen
      3 Next's ``shared_expert_gate``: :func:`_gates`) runs whole, its output's gradient summed
      (``"replicated_with_output_grad_allreduce"``). That needs the module's output to be a sum
      of such terms: where it holds another module with parameters besides its router (whose
      weight is ``[E, hidden]``) and such gates, Qwen 2 MoE's shared expert run whole (as its own
      plan has it), or a plan entry but a column or row layer, the experts' output is summed
      whole and the module's split, an all-reduce and a split (its row layers' outputs summed
      whole, as the plan has them). The same module name in other layers holding a dense MLP
      (Qwen 3 MoE's first layers) is moved as the MLP is above (the owner's entries then per
      layer, ``layers.0.mlp``); a module some layers do not hold (a hybrid's attention and linear
      attention, Qwen 3 Next's) is moved in those that do;
    * a module whose entries leave their outputs whole (Phi 3's and OLMo 2's ``"colwise_rep"`` and
      ``"rowwise_rep"`` projections: gathered outputs, a split input's output summed): its input
      gathered, its output, whole on every rank, split (``PrepareModuleInputOutput``);
    * every other module of a decoder layer, and of the model beside the layers and the
      embedding, that holds parameters, a norm (by its class's name): run on each rank's block,
      its gradients summed (``SequenceParallel``);
    * any other module of a decoder layer holding parameters the plan leaves whole (DeepSeek-V3's
      attention): run whole on every rank, as the plan has it, on the gathered sequence, its output
      split (``PrepareModuleInputOutput``);
    * the head gathering the sequence (``ColwiseParallel(input_layouts=Shard(1))``), its output
      gathered too where the plan's head gathers it; a head the plan leaves whole takes the gathered
      sequence.

    Returns the plan (torch's style objects beside the plan's own entries, which the caller may
    change: the key/value projections' entries where the group's size exceeds their heads), for
    ``tp_kernels.parallelize(model, plan, group=...)``. Each module is moved by its forward's first
    input, by position or by name; the modules of every layer it names by one pattern,
    ``<layers>.*.<name>``, where that names no other module (fnmatch's ``*`` spans dots), else
    each layer's by its own name. A plan naming its layers under two prefixes of which one names
    no module (transformers' Llama 4 plan: ``layers.*`` and ``model.layers.*``) is read by the one
    that does, and an entry that names nothing in the decoder layers (Gemma 4's experts, in its
    dense models) is left out. Experts of the decoder layer itself (Gemma 4's mixtures) are
    called with each rank's block of the tokens, ``(style, "sequence")``: they gather them and
    reduce-scatter their output; their router (a module of the layer holding an ``[E, hidden]``
    weight) runs on the block, its gradients summed (``SequenceParallel()``). A ``ValueError``
    names what it cannot write so: a plan with
    torch's styles already; entries outside the decoder layers other than the embedding's and the
    head's; a module of the layers whose entries hold no row layer and no experts and leave its
    output split along the hidden units (a plan of column layers alone), or sum a gradient over the
    group (a per-head norm's, a latent key/value projection's: each rank's share of it where the
    module's heads are split, which every rank would compute whole); no decoder layers;
    a module beside them that holds parameters and is not a norm (by its class's name: what the
    ranks may run on their blocks of the sequence alone); a module of the layers that is a norm in
    some and not in others; a row layer's entry that would have to reduce-scatter in some layers
    and sum its output whole in others."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    if plan is None:
        plan = getattr(model, "tp_plan", None)
        if not plan:
            raise ValueError(f"plan: {type(model).__name__} has no tp_plan; pass the tensor-parallel plan")
    if not isinstance(plan, Mapping):
        raise ValueError(f"plan: expected a mapping of module names to styles, got {type(plan).__name__}")
    plan = read_expert_parallelism(plan)
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)

    for pattern, value in plan.items():
        if is_torch_style(value):
            raise ValueError(f"plan[{pattern!r}]: a style of torch's; this writes the plan of torch's styles from a "
                             "plan of tp_kernels' (or transformers') own entries")
    prefixes = {pattern.split(".*.")[0] for pattern in plan if ".*." in pattern}
    lists = {prefix for prefix in prefixes if isinstance(_submodule(model, prefix), nn.ModuleList)}
    if len(prefixes) > 1 and len(lists) == 1:  # (transformers' Llama 4 plan names its layers both from its text
        # model, "layers.*", and from the causal LM, "model.layers.*": the entries under a name that is no module's
        # name nothing)
        plan = {k: v for k, v in plan.items() if ".*." not in k or k.split(".*.")[0] in lists}
        prefixes = lists
    if len(prefixes) != 1:
        raise ValueError(f"plan: expected the entries of one list of decoder layers ('<layers>.*.<name>'), got "
                         f"{sorted(prefixes) or 'none'}")
    layers_name = prefixes.pop()
    layers = model.get_submodule(layers_name)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"plan: {layers_name!r} is not a list of decoder layers (an nn.ModuleList)")
    names = {id(m): name for name, m in model.named_modules()}
    every_name = [name for name, _ in model.named_modules(remove_duplicate=False)]

    def each_layer(relative: str, value) -> None:
        # (value for the module ``relative`` of every decoder layer: one pattern where it names those alone, else
        # each layer's own entry; fnmatch's "*" spans dots, so that "layers.*.norm" would name a norm inside a
        # layer's module too, NemotronH's Mamba mixer's, which its module runs whole)
        pattern, own = f"{layers_name}.*.{relative}", {f"{layers_name}.{i}.{relative}" for i in range(len(layers))}
        hits = [name for name in every_name if fnmatch.fnmatchcase(name, pattern)]
        out.update({pattern: value} if set(hits) <= own else {name: value for name in sorted(set(hits) & own)})

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    embedding_name = names.get(id(embedding)) if embedding is not None else None
    head_name = names.get(id(head)) if head is not None else None

    def moved(given, wanted) -> PrepareModuleInput:
        # (by position: the first input of each module it applies to, passed by position or by its
        # name, whatever that is: Qwen 3 MoE's dense MLP takes x, its experts' block hidden_states)
        return PrepareModuleInput(input_layouts=(given,), desired_input_layouts=(wanted,))

    inside: Dict[str, Dict[str, object]] = {}  # a decoder layer's module -> its entries (relative names)
    in_layers = {name for layer in layers  # (the names inside a decoder layer, of modules and parameters)
                 for name, _ in itertools.chain(layer.named_modules(), layer.named_parameters())}
    direct = {pattern[len(layers_name) + 3:] for pattern, value in plan.items()  # the decoder layer's own experts
              if pattern.startswith(f"{layers_name}.*.") and "." not in pattern[len(layers_name) + 3:]
              and _style_name(value) in _EXPERTS}  # (Gemma 4's), by name
    out: Dict[str, object] = {}
    for pattern, value in plan.items():
        if pattern.startswith(f"{layers_name}.*."):
            relative = pattern[len(layers_name) + 3:]
            owner = relative.split(".")[0]
            if not any(fnmatch.fnmatchcase(name, relative) for name in in_layers):
                continue  # (an entry that names nothing in these layers, left out: Gemma 4's experts, in its dense
                # models; Qwen 3 Next's dense MLP, where every layer holds a mixture)
            if owner in direct:  # (experts of the decoder layer itself, Gemma 4's: called with each rank's block of
                # the tokens, which they gather, their output reduce-scattered back; their weights' entries as they are)
                out[pattern] = (_style_name(value), "sequence") if owner == relative else value
                continue
            if owner == relative and _style_name(value) != "local_params":  # (an attention's own per-head
                # parameters, its sinks: kept with it, and the module moved too)
                raise ValueError(f"plan[{pattern!r}]: a module of the decoder layer itself; the plan's layers must "
                                 "lie inside its modules (the attention, the MLP), or be its per-head parameters "
                                 "('local_params') or its experts")
            inside.setdefault(owner, {})[relative] = value
        elif pattern == embedding_name:
            out[pattern] = value
        elif pattern != head_name:
            raise ValueError(f"plan[{pattern!r}]: outside the decoder layers, the embedding and the head, where the "
                             "sequence parallelism this plan writes does not say what it becomes")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    moves_of = {  # a module of a decoder layer, by how it runs: how its input and output move
        "dense": moved(Shard(1), Replicate()),  # (its row layers reduce-scatter their outputs)
        "partial": PrepareModuleInputOutput(  # (its experts' partial sums reduce-scattered: one move)
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), output_layouts=Partial(),
            desired_output_layouts=Shard(1)),
        "summed": PrepareModuleInputOutput(  # (its output whole on every rank: each rank's block of it)
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), output_layouts=Replicate(),
            desired_output_layouts=Shard(1))}
    for owner, entries in inside.items():
        styles = {relative: _style_name(value) for relative, value in entries.items()}
        experts = [relative for relative, style in styles.items() if style in _EXPERTS]
        rows = [relative for relative, style in styles.items()
                if style == _ROW and not any(relative.startswith(e + ".") for e in experts)]
        # (a row layer inside a mixture of experts, DeepSeek's shared experts', leaves its term of the
        # mixture's partial sum, or sums its output whole where the mixture's is whole)
        mixtures = [layer for layer in layers if any(_matches(layer, e) for e in experts)]
        kept = {row for row in rows if any(_matches(layer, row) for layer in mixtures)}
        # (None where a layer has no such module: a hybrid's attention in some layers, its linear attention
        # in the others, Qwen 3 Next's)
        kinds = [_kind(layer, f"{layers_name}.{i}.{owner}", styles, experts, rows, kept)
                 if layer._modules.get(owner) is not None else None for i, layer in enumerate(layers)]
        for row in set(rows) - kept:
            if any(kind != "dense" and _matches(layer, row) for layer, kind in zip(layers, kinds)):
                raise ValueError(f"plan: {layers_name}.*.{row} is a row layer of a module of some layers whose "
                                 "output must be whole (with another row layer that is inside a mixture of experts), "
                                 "and of others whose output it would reduce-scatter: write those layers' entries "
                                 "apart")
        gates = set()  # (the mixtures' shared experts' gates, where their sums are partial)
        if "moe" in kinds:  # (every mixture of experts of the owner alike: leave their sums partial, or not; not
            # where a row layer of theirs sums its output whole in another layer)
            each = [_partial_ok(layer, owner, styles, experts, hidden) for layer, kind in zip(layers, kinds)
                    if kind == "moe"]
            partial = None not in each and \
                not any(kind != "moe" and _matches(layer, row) for row in kept for layer, kind in zip(layers, kinds))
            gates = {gate for names in each for gate in names or ()} if partial else set()
            kinds = [("partial" if partial else "summed") if kind == "moe" else kind for kind in kinds]
        if len(set(kinds) - {None}) == 1 and owner not in entries:
            each_layer(owner, moves_of[next(kind for kind in kinds if kind)])
        else:  # (Qwen 3 MoE's dense first layers: a module of the same name, moved otherwise; an attention the
            # plan names itself, "local_params", whose pattern that entry holds)
            out.update({f"{layers_name}.{i}.{owner}": moves_of[kind] for i, kind in enumerate(kinds) if kind})
        for relative, value in entries.items():
            if relative in rows and relative not in kept:
                value = RowwiseParallel(output_layouts=Shard(1))
            elif relative in kept and "partial" in kinds:  # (a mixture's row layer: its term of the sum)
                value = RowwiseParallel(output_layouts=Partial())
            elif relative in experts and "partial" in kinds:
                value = (styles[relative], "partial")
            out[f"{layers_name}.*.{relative}"] = value
        for gate in sorted(gates):  # (its output's gradient, each rank's share, summed: a shared expert's scale)
            each_layer(gate, "replicated_with_output_grad_allreduce")
    out[f"{layers_name}.0"] = moved(Replicate(), Shard(1))

    # (the decoder layers' own experts' counts: their 3-D weights' first dim)
    counts = {q.shape[0] for layer in layers for name in direct if layer._modules.get(name) is not None
              for q in layer._modules[name].parameters() if q.dim() == 3}
    for name in sorted({name for layer in layers for name, child in layer.named_children()
                        if name not in inside and name not in direct}):
        # (a module some layers hold, and others not, or as None: a hybrid's)
        held = [child for child in (layer._modules.get(name) for layer in layers)
                if child is not None and _holds_parameters(child)]
        norms = {_is_norm(child) for child in held}
        if held and all(_routes(child, counts, hidden) for child in held):  # (the router of the layer's own experts:
            # run on each rank's block of the tokens, as the experts take them, its gradients summed)
            each_layer(name, SequenceParallel())
        elif norms == {True}:
            each_layer(name, SequenceParallel())
        elif norms == {False}:  # (a module the plan leaves whole, DeepSeek-V3's attention: run whole on every
            # rank, as the plan has it, on the gathered sequence, its output split)
            each_layer(name, moves_of["summed"])
        elif norms:
            raise ValueError(f"model: {layers_name}.*.{name} is a norm in some layers and not in others")
    base_name, _, _ = layers_name.rpartition(".")
    base = model.get_submodule(base_name) if base_name else model
    for name, child in base.named_children():
        full = f"{base_name}.{name}" if base_name else name
        if any(child is m for m in (layers, embedding, head)) or not _holds_parameters(child):
            continue
        if not _is_norm(child):
            raise ValueError(f"model: {full} ({type(child).__name__}) holds parameters the plan leaves whole and is "
                             "not a norm, which the ranks could run on their blocks of the sequence alone")
        out[full] = SequenceParallel()
    if head_name is not None:
        if head_name in plan:
            gathered = _style_name(plan[head_name]) == _GATHERED_HEAD
            out[head_name] = ColwiseParallel(input_layouts=Shard(1),
                                             **({"output_layouts": Replicate()} if gathered else {}))
        else:
            out[head_name] = moved(Shard(1), Replicate())
    return out
