"""torch's tensor-parallel styles as entries of a :func:`tp_kernels.parallelize` plan.

A plan written for ``torch.distributed.tensor.parallel.parallelize_module`` (TorchTitan's, for
one) maps module names to ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput`` and ``PrepareModuleInputOutput`` objects, whose
layouts (``Replicate()``, ``Shard(d)``, ``Partial()``: each rank's partial sum) say how a module's
inputs and outputs lie across the ranks.
:func:`translate` reads one, for the module it is applied to, as what ``parallelize`` builds: a
style of :data:`tp_kernels.parallelize.STYLES`, and the sequence dim of a layer's sequence
parallelism (``Shard(1)``: 1) or None; a ``PrepareModule*`` one as the moves of the module's
inputs and outputs between layouts, which :func:`redistribute` makes with the mappings. The
module then computes on plain tensors what it computes on torch's DTensors; a column layer whose
style keeps its output a DTensor (``use_local_output=False``: the logits of torch's
``loss_parallel``) hands it on as one (:func:`output_as_dtensor`).

A ``PrepareModuleInput`` that gathers the sequence gathers it for the column layers inside the
module (:func:`tp_kernels.mappings.gather_for_column_layers`): they leave their partial input
gradients for one reduce-scatter, as torch's DTensors reduce-scatter their sum once, rather than
each all-reducing its own. In eager calls the gather is deferred
(:class:`tp_kernels.mappings.DeferredGather`): a module that reads only its input's shape
(TorchTitan's attention and transformers' take the sequence length from it) leaves it to its
column layers, which gather it once with their GEMMs (:class:`tp_kernels.layers.SharedInputGather`),
where torch gathers before them.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .mappings import (gather_for_column_layers, gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)

__all__ = ["Moves", "describe", "is_torch_style", "output_as_dtensor", "redistribute", "translate"]

#: a move of one tensor between layouts: ("gather" | "scatter", dim), dim -1 the last (the hidden
#: units), another the sequence; ("reduce_scatter", dim) of a partial sum, dim the sequence; or
#: ("all_reduce", None)
Move = Tuple[str, Optional[int]]


@dataclasses.dataclass(frozen=True)
class Moves:
    """What a ``PrepareModule*`` style moves: positional inputs by index, keyword inputs by
    name, outputs by index (0 for a module returning one tensor)."""
    inputs: Tuple[Tuple[int, Move], ...] = ()
    kwargs: Tuple[Tuple[str, Move], ...] = ()
    outputs: Tuple[Tuple[int, Move], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.inputs or self.kwargs or self.outputs)

    @property
    def gathers_sequence(self) -> bool:
        """Whether an input is gathered along the sequence (for the module's column layers:
        :func:`tp_kernels.mappings.gather_for_column_layers`, deferred in eager calls)."""
        return any(move == "gather" and dim != -1 for _, (move, dim) in self.inputs + self.kwargs)


def is_torch_style(value) -> bool:
    """Whether ``value`` is one of torch's ``ParallelStyle`` objects."""
    if isinstance(value, (str, tuple, list)):  # (parallelize's own entries: no import)
        return False
    try:
        from torch.distributed.tensor.parallel.style import ParallelStyle
    except ImportError:  # (a torch without distributed)
        return False
    return isinstance(value, ParallelStyle)


def describe(value) -> str:
    """A plan's value as text that is the same on every rank: a torch style by its class and
    attributes (its own repr carries its address), anything else by its repr."""
    if not is_torch_style(value):
        return repr(value)
    return f"{type(value).__name__}({', '.join(f'{k}={describe(v)}' for k, v in sorted(vars(value).items()))})"


def _layout(placement):
    """A placement as ``("replicate", None)``, ``("shard", dim)``, ``("partial", None)`` (a sum)
    or ``("other", placement)``; None for None (an input left alone)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if placement is None:
        return None
    if type(placement) is Replicate:
        return "replicate", None
    if type(placement) is Shard:
        return "shard", placement.dim
    if type(placement) is Partial and placement.reduce_op == "sum":
        return "partial", None
    return "other", placement


def translate(pattern: str, style, module: nn.Module) -> Tuple[str, object, Optional[int], bool]:
    """``(style, outputs, sequence, as_dtensor)``: torch's ``style`` applied to ``module`` as
    :func:`tp_kernels.parallelize` takes it (``outputs``: the :class:`Moves` of a
    ``"redistribute"``, ``"partial"`` for a row layer whose output is left each rank's partial
    sum, ``RowwiseParallel(output_layouts=Partial())``, else None; ``sequence``: the sequence dim
    of a layer under sequence parallelism, else None; ``as_dtensor``: a column layer's output handed on as a DTensor,
    ``use_local_output=False``, for torch's ``loss_parallel``: :func:`output_as_dtensor`), or a
    ``ValueError`` naming ``pattern`` and what cannot be taken."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel)

    kind = type(style).__name__
    where = f"plan[{pattern!r}]: {kind}"

    def refuse(why: str):
        raise ValueError(f"{where}: {why}")

    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        given, wanted = _layout(style.input_layouts[0]), _layout(style.output_layouts[0])
        as_dtensor = not style.use_local_output
        if as_dtensor and not (isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear)
                               and wanted == ("shard", -1)):
            refuse("use_local_output=False: tp_kernels hands on a DTensor only as a column layer's output split "
                   "along its last dim (torch's loss_parallel: ColwiseParallel(output_layouts=Shard(-1), "
                   "use_local_output=False) on an nn.Linear); elsewhere keep the outputs local")
        embedding = isinstance(module, nn.Embedding)
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            refuse(f"applies to nn.Linear or nn.Embedding, but the module is a {type(module).__name__}")
        if embedding and given != ("replicate", None):
            refuse(f"on an nn.Embedding takes the ids whole, input_layouts=Replicate(), not {_shown(given)}")
        if isinstance(style, ColwiseParallel):
            if embedding:
                if wanted != ("replicate", None):
                    refuse("on an nn.Embedding leaves each rank its columns of the lookups, which no tp_kernels "
                           "layer does: output_layouts=Replicate() gathers them (tp_kernels' 'embedding_colwise')")
                return "embedding_colwise", None, None, False
            sequence = _sequence(given, "input_layouts", refuse)
            if wanted == ("shard", -1):
                return "colwise", None, sequence, as_dtensor
            if wanted == ("replicate", None):
                return "colwise_gather_output", None, sequence, False
            refuse(f"output_layouts={_shown(wanted)}: a column layer's output is this rank's columns, "
                   "Shard(-1), or gathered, Replicate()")
        if wanted == ("partial", None) and not embedding:  # (its output each rank's term of the sum, not reduced)
            if given != ("shard", -1):
                refuse(f"output_layouts=Partial() takes the input split along the last dim, input_layouts=Shard(-1), "
                       f"not {_shown(given)}")
            return "rowwise", "partial", None, False
        sequence = _sequence(wanted, "output_layouts", refuse)
        if embedding:
            return "vocab", None, sequence, False
        if given == ("shard", -1):
            return "rowwise", None, sequence, False
        if given == ("replicate", None):
            if sequence is not None:
                refuse("input_layouts=Replicate() with a sequence-sharded output: under sequence parallelism a "
                       "row layer takes its input split along the last dim, Shard(-1)")
            return "rowwise_split_input", None, None, False
        refuse(f"input_layouts={_shown(given)}: a row layer takes its input split along the last dim, "
               "Shard(-1), or whole, Replicate()")
    if isinstance(style, SequenceParallel):  # (its parameters whole, applied to each rank's block)
        return "replicated_with_grad_allreduce", None, None, False
    if isinstance(style, (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)):
        into = style.prepare_module_input if isinstance(style, PrepareModuleInputOutput) else style
        out_of = style.prepare_module_output if isinstance(style, PrepareModuleInputOutput) else style
        inputs = kwargs = outputs = ()
        if not isinstance(style, PrepareModuleOutput):
            given = into.input_layouts or ()
            inputs = _moves(given, into.desired_input_layouts or (), refuse, [f"input {i}" for i in range(len(given))])
            names = list(into.input_kwarg_layouts)
            kwargs = tuple((names[i], move) for i, move in _moves(
                [into.input_kwarg_layouts[k] for k in names], [into.desired_input_kwarg_layouts.get(k) for k in names],
                refuse, [f"input {k!r}" for k in names]) if move is not None)
        if not isinstance(style, PrepareModuleInput):
            given = out_of.output_layouts
            outputs = _moves(given, out_of.desired_output_layouts, refuse, [f"output {i}" for i in range(len(given))])
        moves = Moves(tuple(m for m in inputs if m[1] is not None), kwargs,
                      tuple(m for m in outputs if m[1] is not None))
        return ("redistribute", moves, None, False) if moves else ("replicate", None, None, False)
    refuse("is not one of the styles tp_kernels takes: ColwiseParallel, RowwiseParallel, SequenceParallel, "
           "PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput")


def _shown(layout) -> str:
    """A layout as torch writes it."""
    return "Replicate()" if layout[0] == "replicate" else f"Shard({layout[1]})" if layout[0] == "shard" else \
        "Partial()" if layout[0] == "partial" else repr(layout[1])


def _sequence(layout, what: str, refuse) -> Optional[int]:
    """The sequence dim a layer's ``layout`` (its input's for a column layer, its output's for a
    row layer) splits, or None for a whole one."""
    if layout == ("replicate", None):
        return None
    if layout[0] == "shard" and layout[1] >= 0:
        return layout[1]
    refuse(f"{what}={_shown(layout)}: expected Replicate() or the sequence, Shard(d) with d >= 0 (sequence "
           "parallelism along d)")


def _moves(given, wanted, refuse, labels) -> Tuple[Tuple[int, Optional[Move]], ...]:
    """``(index, move or None)`` for each pair of layouts (None where nothing moves); ``labels``
    name them in errors."""
    moves = []
    for i, (a, b, label) in enumerate(zip(given, wanted, labels)):
        a, b = _layout(a), _layout(b)
        if a is None or b is None or a == b:
            moves.append((i, None))
        elif a[0] == "shard" and b == ("replicate", None):
            moves.append((i, ("gather", a[1])))
        elif a == ("replicate", None) and b[0] == "shard":
            moves.append((i, ("scatter", b[1])))
        elif a == ("partial", None) and b == ("replicate", None):
            moves.append((i, ("all_reduce", None)))
        elif a == ("partial", None) and b[0] == "shard" and b[1] >= 0:
            moves.append((i, ("reduce_scatter", b[1])))
        else:
            refuse(f"{label}: from {_shown(a)} to {_shown(b)}, which tp_kernels does not move (it gathers a Shard(d) "
                   "to Replicate(), splits a Replicate() to Shard(d), and sums a Partial() to Replicate() or, "
                   "reduce-scattered, to Shard(d) with d >= 0, the sequence)")
    return tuple(moves)


def _move(x, move: Move, group, what: str):
    """``x`` moved with the mappings; an error of theirs about it (a dim it does not have) names
    ``what``, the module's input or output."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: expected a tensor to move ({move[0]} along dim {move[1]}), got {type(x).__name__}")
    direction, dim = move
    try:
        if direction == "all_reduce":
            return reduce_from_tensor_model_parallel_region(x, group)
        if direction == "reduce_scatter":
            return reduce_scatter_to_sequence_parallel_region(x, group, sequence_dim=dim)
        if dim == -1:
            f = gather_from_tensor_model_parallel_region if direction == "gather" else \
                scatter_to_tensor_model_parallel_region
            return f(x, group)
        if direction == "gather":
            # (checked and agreed as the public mapping; then gathered for the column layers, which leave
            # their partial input gradients for one reduce-scatter: mappings.gather_for_column_layers)
            return gather_for_column_layers(x, group, sequence_dim=dim)
        return scatter_to_sequence_parallel_region(x, group, sequence_dim=dim)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from exc


def _tokens_flat(x, move: Move, like, moved):
    """``moved(x)``, the output ``x`` moved along a sequence dim; where ``x`` is the module's tokens
    flat, ``[b*s, h]`` of its moved input ``like``, ``[b, s, h]``, in that order (Llama 4's mixture
    of experts returns ``hidden_states.reshape(-1, h)``'s), moved as ``[b, s, h]``, and returned
    flat again, ``[b*s/p, h]``."""
    direction, dim = move
    if not (isinstance(x, torch.Tensor) and direction in ("reduce_scatter", "scatter") and dim is not None
            and dim >= 0 and like is not None and x.dim() == 2 and len(like) >= 3 and dim < len(like) - 1
            and x.shape[0] == math.prod(like[:-1])):
        return moved(x)
    return moved(x.view(*like[:-1], x.shape[-1])).flatten(0, -2)


def output_as_dtensor(layer: nn.Module, group) -> nn.Module:
    """Register on the column layer ``layer`` a hook that hands its output on as a DTensor over
    ``group``'s mesh, ``Shard(-1)`` (each rank's columns: the layer's own output, no copy), as
    torch's ``ColwiseParallel(use_local_output=False)`` does, for torch's ``loss_parallel``. Where p
    does not divide ``out_features`` (a padded vocabulary), the columns this rank holds, its padding
    left out: the DTensor is split unevenly, as ``torch.chunk`` splits."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group, layer.weight.device.type)
    held = layer.out_features_per_partition - layer.pad_rows

    def after(_, args, output):
        shape = (*output.shape[:-1], layer.out_features)
        if layer.pad_rows:
            output = output.narrow(-1, 0, held)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(output, mesh, (Shard(output.dim() - 1),), run_check=False, shape=shape,
                                  stride=stride)

    layer.register_forward_hook(after)
    return layer


def _positional_names(module: nn.Module) -> Tuple[str, ...]:
    """The names of ``module``'s forward's parameters that a call may pass by position, in order
    (up to a ``*args``; none where its signature cannot be read)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    names = []
    for q in parameters:
        if q.kind is q.VAR_POSITIONAL or q.kind not in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD):
            break
        names.append(q.name)
    return tuple(names)


def redistribute(module: nn.Module, moves: Moves, group) -> nn.Module:
    """Register on ``module`` the hooks that move its inputs before its forward and its outputs
    after it (``moves``), with the mappings: a ``Shard(d)`` gathered to ``Replicate()`` (for the
    column layers it feeds: :func:`tp_kernels.mappings.gather_for_column_layers`), a
    ``Replicate()`` split to ``Shard(d)`` (backward: gathered), a ``Partial()`` (each rank's partial
    sum: experts that leave their output so) summed to ``Replicate()`` or reduce-scattered to
    ``Shard(d)`` (backward: the gradient as it is, or gathered). An input's layout applies to it
    however the call passes it: one given by position (``input_layouts``) to the parameter of the
    forward's signature at that position passed by keyword too, one given by name
    (``input_kwarg_layouts``) to that parameter passed by position too (where torch's styles pass
    such an input over, and the module would get it in the wrong layout). Two layouts for one
    parameter that differ are a ``ValueError`` here; an input or output a move names that the call
    does not have, a ``ValueError`` on every rank, before anything moves. An output that is the
    module's tokens flat, ``[b*s, h]`` of its first moved input's ``[b, s, h]``, is moved along the
    sequence as that and handed on flat (:func:`_tokens_flat`: Llama 4's mixture of experts)."""
    name = type(module).__name__
    names, by_name = _positional_names(module), dict(moves.kwargs)
    for i, move in moves.inputs:
        other = by_name.get(names[i]) if i < len(names) else None
        if other is not None and other != move:
            raise ValueError(f"{name}: its PrepareModule style gives input {i} ({names[i]!r} in its forward) two "
                             f"layouts, by position and by name, that move it differently: {move} and {other}")

    moved_shape = [None]  # (the shape of the input the last call's moves gave the module)

    def missing(what: str, have: str, hint: str = "its forward's signature has no such input, or the call left it "
                "out"):
        raise ValueError(f"{name}: its PrepareModule style moves {what}, which this call does not have ({have}): "
                         f"{hint}")

    if moves.inputs or moves.kwargs:
        def before(_, args, kwargs):
            where = {}  # (the input each move takes, by position or by name: each once)
            for i, move in moves.inputs:
                slot = i if i < len(args) else names[i] if i < len(names) and names[i] in kwargs else None
                if slot is None:
                    missing(f"input {i}", f"{len(args)} positional, keywords {sorted(kwargs)}")
                where[slot] = move
            for key, move in moves.kwargs:
                at = names.index(key) if key in names else None
                slot = key if key in kwargs else at if at is not None and at < len(args) else None
                if slot is None:
                    missing(f"input {key!r}", f"{len(args)} positional, keywords {sorted(kwargs)}")
                where[slot] = move
            args, kwargs = list(args), dict(kwargs)
            for slot, move in where.items():
                if isinstance(slot, int):
                    args[slot] = _move(args[slot], move, group, f"{name} input {slot}")
                else:
                    kwargs[slot] = _move(kwargs[slot], move, group, f"{name} input {slot!r}")
            slot = next(iter(where))  # (the first input moved: the hidden states)
            first = args[slot] if isinstance(slot, int) else kwargs[slot]
            moved_shape[0] = tuple(first.shape) if isinstance(first, torch.Tensor) else None
            return tuple(args), kwargs

        module.register_forward_pre_hook(before, with_kwargs=True)
    if moves.outputs:
        def after(_, args, output):
            single = not isinstance(output, (tuple, list))
            outs = [output] if single else list(output)
            for i, _move_ in moves.outputs:
                if i >= len(outs):
                    missing(f"output {i}", f"{len(outs)} outputs", "output_layouts counts the module's outputs")
            for i, move in moves.outputs:
                outs[i] = _tokens_flat(outs[i], move, moved_shape[0],
                                       lambda x: _move(x, move, group, f"{name} output {i}"))
            return outs[0] if single else type(output)(outs)

        module.register_forward_hook(after)
    return module
