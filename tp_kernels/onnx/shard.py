"""Shard a dense ONNX model for one rank of a tensor-parallel group, by a plan like ``parallelize``'s.

:func:`shard` splits the weights the plan names and follows, node by node, how each value is
laid out on the ranks: *replicated* (every rank holds all of it) or *split* along one axis (this
rank holds its contiguous block, ``rank * size/p`` on). Where a node cannot take a value as it is
laid out, the collective that fixes it is inserted before it, so the rank's model computes the
dense model's outputs:

* ``"colwise"`` (a ``MatMul`` or ``Gemm`` with a weight initializer): this rank's output columns
  (and bias); its input is made replicated; its output is split along the last axis.
* ``"rowwise"`` (``MatMul``/``Gemm``): this rank's input rows of the weight; its input is taken
  split along the last axis (a replicated one is sliced locally, as ``input_is_parallel=False``
  does), its partial product is summed by an ``AllReduce``, then a ``Gemm``'s bias is added once.
* ``"vocab"`` (a ``Gather`` of an initializer table along axis 0): this rank's rows of the table;
  ids outside them look up row 0 and are zeroed, and an ``AllReduce`` sums the ranks' lookups.
* Elementwise ops (with broadcasting), ``Transpose``, ``Reshape`` (when the split axis stays the
  outermost of the dims it is merged with or split into), ``Softmax``/``LayerNormalization``/
  reductions/``Slice``/``Split``/``Concat``/``Gather`` along other axes, ``MatMul`` of two
  activations (split along a batch axis, the rows of the first or the columns of the second, or
  both along the contracted axis: then an ``AllReduce``), ``Shape`` (of the global shape) keep a
  split; a replicated operand that a split one meets is sliced locally.
* Any other node, and every graph output, gets its inputs replicated first: an ``AllGather``
  (ONNX Runtime's ``com.microsoft`` nodes, :mod:`tp_kernels.onnx._collective_ops`).

A pattern matches a node's name, its weight initializer's name, or, for a model exported by
``torch.onnx``, a module path the exporter recorded for the node (``attn.q_proj``), so the plan of
``parallelize`` for a module serves its ONNX export too.
"""

from __future__ import annotations

import ast
import fnmatch
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import _collective_ops

__all__ = ["STYLES", "shard"]

#: plan style -> the node types it applies to
STYLES = {"colwise": ("MatMul", "Gemm"), "rowwise": ("MatMul", "Gemm"), "vocab": ("Gather",)}

_UNARY = {"Abs", "Cast", "Ceil", "Celu", "Clip", "Cos", "Dropout", "Elu", "Erf", "Exp", "Floor", "Gelu",
          "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Log", "Mish", "Neg", "Not",
          "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt", "Tan",
          "Tanh", "ThresholdedRelu"}
_BROADCAST = {"Add", "And", "BitShift", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max",
              "Mean", "Min", "Mod", "Mul", "Or", "Pow", "PRelu", "Sub", "Sum", "Where", "Xor"}
_REDUCE = {"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
           "ReduceProd", "ReduceSum", "ReduceSumSquare"}

Split = Optional[int]  # None: replicated; else the axis this rank holds a block of


def shard(model: onnx.ModelProto, plan: Mapping[str, str], world_size: int, rank: int) -> onnx.ModelProto:
    """Rank ``rank``'s model of the dense ``model`` for a tensor-parallel group of ``world_size``.

    ``plan`` maps ``fnmatch`` patterns (over node names, weight initializer names and recorded
    module paths: module doc) to ``"colwise"``, ``"rowwise"`` or ``"vocab"``. Everything is
    checked first: an unknown style, a pattern that matches nothing, a style on a node of another
    type, a weight that is no initializer, a split size ``world_size`` does not divide, or one
    node given two styles raise ``ValueError`` naming the pattern and the node. ``model`` is not
    changed; the returned model's collectives take ``group_size=world_size`` (``AllReduce``:
    over all the runtime's ranks), and its metadata says ``world_size`` and ``rank``
    (:func:`tp_kernels.onnx._collective_ops.stamp`; with one rank it is a copy of ``model``).
    """
    if not isinstance(model, onnx.ModelProto):
        raise ValueError(f"model: expected an onnx.ModelProto, got {type(model).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"plan: expected a non-empty mapping of name patterns to styles, got {plan!r}")
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"world_size, rank: expected 0 <= rank < world_size, got rank {rank} of {world_size}")
    sharder = _Sharder(model, plan, world_size, rank)  # checks the plan
    if world_size == 1:  # nothing to split, nothing to communicate
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    out = sharder.run()
    _collective_ops.stamp(out, world_size, rank)
    return out


def _label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type} node #{index}"


def _scopes(node: onnx.NodeProto) -> List[str]:
    """The module paths torch.onnx recorded for ``node`` (none for other exporters)."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                return [s for s in ast.literal_eval(prop.value) if isinstance(s, str) and s]
            except (ValueError, SyntaxError):
                return []
    return []


class _Sharder:
    def __init__(self, model: onnx.ModelProto, plan: Mapping[str, str], p: int, r: int):
        self.p, self.r = p, r
        self.model = onnx.shape_inference.infer_shapes(model)
        graph = self.model.graph
        self.consts: Dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self.consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        self.shapes: Dict[str, Optional[List[Optional[int]]]] = {}
        self.types: Dict[str, int] = {}
        for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
            t = vi.type.tensor_type
            self.types[vi.name] = t.elem_type
            if t.HasField("shape"):
                self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        for name, value in self.consts.items():
            self.shapes[name] = list(value.shape)
        self.uses: Dict[str, int] = {}
        for node in graph.node:
            for x in node.input:
                self.uses[x] = self.uses.get(x, 0) + 1
        self.split: Dict[str, Split] = {}
        self.nodes: List[onnx.NodeProto] = []
        self.new_consts: Dict[str, np.ndarray] = {}
        self.gathered: Dict[str, str] = {}
        self.sliced: Dict[Tuple[str, int], str] = {}
        self.fresh = 0
        self.styles = self._match(plan)

    # --- the plan ------------------------------------------------------------------------------

    def _weight(self, node: onnx.NodeProto) -> Optional[str]:
        index = 0 if node.op_type == "Gather" else 1
        return node.input[index] if len(node.input) > index else None

    def _match(self, plan: Mapping[str, str]) -> Dict[int, Tuple[str, str]]:
        nodes = list(self.model.graph.node)
        styles: Dict[int, Tuple[str, str]] = {}
        for pattern, style in plan.items():
            if not isinstance(style, str) or style not in STYLES:
                fused = " (a fused projection, ('colwise', output_sizes), is split by tp_kernels.parallelize only)" \
                    if isinstance(style, (tuple, list)) else ""
                raise ValueError(f"plan[{pattern!r}]: unknown style {style!r}; expected one of "
                                 f"{', '.join(map(repr, STYLES))}{fused}")
            hits = [(i, n) for i, n in enumerate(nodes)
                    if any(fnmatch.fnmatchcase(c, pattern) for c in [n.name, self._weight(n) or ""] + _scopes(n)
                           if c)]
            if not hits:
                raise ValueError(f"plan: pattern {pattern!r} matches no node, initializer or module path of the model")
            typed = [(i, n) for i, n in hits if n.op_type in STYLES[style]]
            if not typed:
                found = ", ".join(sorted({f"{_label(n, i)!r} is a {n.op_type}" for i, n in hits})[:3])
                raise ValueError(f"plan[{pattern!r}]: style {style!r} applies to {' or '.join(STYLES[style])} nodes, "
                                 f"but {found}")
            for i, n in typed:
                styles.setdefault(i, (style, pattern))
                if styles[i][0] != style:
                    raise ValueError(f"plan: {_label(n, i)!r} is matched as {style!r} by {pattern!r} and as "
                                     f"{styles[i][0]!r} by {styles[i][1]!r}")
                self._check_weight(n, i, style, pattern)
        return styles

    def _check_weight(self, node: onnx.NodeProto, index: int, style: str, pattern: str) -> None:
        label, w = _label(node, index), self._weight(node)
        if w not in self.consts or self.consts[w].ndim != 2:
            raise ValueError(f"plan[{pattern!r}]: {label!r} ({style}) needs a 2-D initializer "
                             f"{'table' if style == 'vocab' else 'weight'}, got {w!r}")
        rows, cols = self.consts[w].shape
        trans_b = node.op_type == "Gemm" and _attr(node, "transB", 0)
        if node.op_type == "Gemm" and _attr(node, "transA", 0):
            raise ValueError(f"plan[{pattern!r}]: {label!r} is a Gemm with transA=1, which is not supported")
        if node.op_type == "Gather" and _attr(node, "axis", 0) != 0:
            raise ValueError(f"plan[{pattern!r}]: {label!r} gathers along axis {_attr(node, 'axis', 0)}, not the "
                             "table's rows (axis 0)")
        what, size = {"colwise": ("out_features", rows if trans_b else cols),
                      "rowwise": ("in_features", cols if trans_b else rows),
                      "vocab": ("num_embeddings", rows)}[style]
        if size % self.p:
            raise ValueError(f"plan[{pattern!r}]: {label!r} ({style}) has {what}={size}, which the world size "
                             f"{self.p} does not divide")

    # --- building blocks -------------------------------------------------------------------------

    def _name(self, base: str) -> str:
        self.fresh += 1
        return f"{base}__tp{self.fresh}"

    def _const(self, base: str, value: np.ndarray) -> str:
        name = self._name(base)
        self.new_consts[name] = value
        self.consts[name] = value
        self.shapes[name] = list(value.shape)
        return name

    def _emit(self, op_type: str, inputs: List[str], outputs: Optional[List[str]] = None, domain: str = "",
              **attrs) -> List[str]:
        outputs = outputs or [self._name(f"{op_type.lower()}")]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain or None, **attrs))
        return outputs

    def _rank(self, name: str) -> Optional[int]:
        shape = self.shapes.get(name)
        return None if shape is None else len(shape)

    def _dim(self, name: str, axis: int) -> Optional[int]:
        shape = self.shapes.get(name)
        return None if shape is None or axis >= len(shape) else shape[axis]

    def _replicated(self, name: str) -> str:
        """``name`` whole on this rank: itself, or its all-gather."""
        axis = self.split.get(name)
        if axis is None or not name:
            return name
        if name not in self.gathered:
            out = self._emit("AllGather", [name], [self._name(name + "_gathered")],
                             domain=_collective_ops.DOMAIN, group_size=self.p, axis=axis)[0]
            self.shapes[out] = self.shapes.get(name)
            self.gathered[name] = out
        return self.gathered[name]

    def _block(self, name: str, axis: int) -> Optional[str]:
        """This rank's block along ``axis`` of the replicated ``name`` (a constant sliced here, an
        activation by a ``Slice`` node), or None when its size there is unknown or indivisible."""
        size = self._dim(name, axis)
        if size is None or size % self.p:
            return None
        key = (name, axis)
        if key not in self.sliced:
            lo, hi = self.r * size // self.p, (self.r + 1) * size // self.p
            if name in self.consts:
                value = np.take(self.consts[name], np.arange(lo, hi), axis=axis)
                self.sliced[key] = self._const(name, np.ascontiguousarray(value))
            else:
                args = [self._const(f"{name}_{k}", np.array([v], dtype=np.int64)) for k, v in
                        (("starts", lo), ("ends", hi), ("axes", axis))]
                self.sliced[key] = self._emit("Slice", [name] + args)[0]
        return self.sliced[key]

    def _split_weight(self, name: str, axis: int) -> str:
        """The weight ``name`` cut to this rank's block along ``axis``, under its own name when no
        other node uses it."""
        value = np.take(self.consts[name], np.arange(self.r * self.consts[name].shape[axis] // self.p,
                                                     (self.r + 1) * self.consts[name].shape[axis] // self.p), axis=axis)
        if self.uses.get(name, 0) == 1:
            self.new_consts[name] = np.ascontiguousarray(value)
            self.consts[name] = self.new_consts[name]
            return name
        return self._block(name, axis)

    def _copy(self, node: onnx.NodeProto, inputs: List[str], split: Split = None) -> None:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        new.input.extend(inputs)
        self.nodes.append(new)
        for out in node.output:
            self.split[out] = split

    def _all_replicated(self, node: onnx.NodeProto) -> None:
        self._copy(node, [self._replicated(x) for x in node.input])

    # --- the walk ------------------------------------------------------------------------------

    def run(self) -> onnx.ModelProto:
        graph = self.model.graph
        for i, node in enumerate(graph.node):
            inner = {x for a in node.attribute for g in list(a.g.node if a.HasField("g") else []) +
                     [n for sub in a.graphs for n in sub.node] for x in g.input}
            if any(self.split.get(x) is not None for x in inner):
                raise ValueError(f"shard: {_label(node, i)!r} ({node.op_type}) has a subgraph that uses a value this "
                                 "rank holds only a block of, which is not supported")
            style = self.styles.get(i)
            if style is not None:
                getattr(self, f"_{style[0]}")(node)
            elif all(self.split.get(x) is None for x in node.input):
                self._copy(node, list(node.input))
            else:
                getattr(self, f"_op_{node.op_type}", self._default)(node)
        # every graph output whole, gathered in the graph's order of them (the same on every rank: an
        # order that differed, a set's, which varies from process to process, would pair one rank's
        # collective with another's)
        for name in dict.fromkeys(o.name for o in graph.output):
            if self.split.get(name) is not None:
                local = self._name(name + "_local")
                for node in self.nodes:
                    node.output[:] = [local if o == name else o for o in node.output]
                    node.input[:] = [local if x == name else x for x in node.input]
                self.split[local] = self.split[name]
                self._emit("AllGather", [local], [name], domain=_collective_ops.DOMAIN, group_size=self.p,
                           axis=self.split[local])
        return self._model()

    def _model(self) -> onnx.ModelProto:
        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        graph = out.graph
        del graph.node[:]
        graph.node.extend(self.nodes)
        used = {x for n in self.nodes for x in n.input} | {o.name for o in graph.output}
        inits = []
        for init in graph.initializer:
            if init.name in used:
                value = self.new_consts.pop(init.name, None)
                inits.append(init if value is None else numpy_helper.from_array(value, init.name))
        inits += [numpy_helper.from_array(v, k) for k, v in self.new_consts.items() if k in used]
        del graph.initializer[:]
        graph.initializer.extend(inits)
        del graph.value_info[:]  # the shapes inferred were the dense model's
        if any(n.domain == _collective_ops.DOMAIN for n in self.nodes) and not any(
                o.domain == _collective_ops.DOMAIN for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(_collective_ops.DOMAIN, _collective_ops.VERSION))
        onnx.checker.check_model(out)
        return out

    # --- the planned nodes -----------------------------------------------------------------------

    def _colwise(self, node: onnx.NodeProto) -> None:
        a, w = self._replicated(node.input[0]), node.input[1]
        out_axis = 0 if node.op_type == "Gemm" and _attr(node, "transB", 0) else 1  # the weight's output axis
        width = self.consts[w].shape[out_axis]
        inputs = [a, self._split_weight(w, out_axis)]
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            c = node.input[2]  # a bias [n] (or [m, n]) is split with the columns; a broadcast one is kept
            last = (self._rank(c) or 1) - 1
            split_c = self._block(c, last) if self._dim(c, last) == width else c
            if split_c is None:
                raise ValueError(f"colwise {node.name or 'Gemm'!r}: its bias {c!r} cannot be split")
            inputs.append(split_c)
        rank = self._rank(node.output[0]) or self._rank(node.input[0]) or 2
        self._copy(node, inputs, rank - 1)

    def _rowwise(self, node: onnx.NodeProto) -> None:
        x, w = node.input[0], node.input[1]
        last = (self._rank(x) or 2) - 1
        if self.split.get(x) != last:
            x = self._block(self._replicated(x), last)
            if x is None:
                raise ValueError(f"rowwise {_label(node, 0)!r}: its input's last dim is unknown or indivisible")
        trans_b = node.op_type == "Gemm" and _attr(node, "transB", 0)
        partial = self._name(node.output[0] + "_partial")
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
        new = onnx.NodeProto()
        new.CopyFrom(node)
        new.input[:] = [x, self._split_weight(w, 1 if trans_b else 0)]
        new.output[:] = [partial]
        if bias is not None:  # added once, after the sum
            for attr in list(new.attribute):
                if attr.name == "beta":
                    new.attribute.remove(attr)
        self.nodes.append(new)
        if bias is None:
            self._emit("AllReduce", [partial], [node.output[0]], domain=_collective_ops.DOMAIN)
        else:
            summed = self._emit("AllReduce", [partial], domain=_collective_ops.DOMAIN)[0]
            beta = _attr(node, "beta", 1.0)
            if beta != 1.0:
                bias = self._emit("Mul", [bias, self._const("beta", np.array(beta, dtype=np.float32))])[0]
            self._emit("Add", [summed, bias], [node.output[0]])
        self.split[node.output[0]] = None

    def _vocab(self, node: onnx.NodeProto) -> None:
        table, ids = node.input[0], self._replicated(node.input[1])
        v = self.consts[table].shape[0]
        lo, hi = self.r * v // self.p, (self.r + 1) * v // self.p
        dtype = np.int32 if self.types.get(node.input[1]) == onnx.TensorProto.INT32 else np.int64
        start, end = (self._const(f"{table}_{k}", np.array(x, dtype=dtype)) for k, x in (("start", lo), ("end", hi)))
        below = self._emit("Less", [ids, start])[0]
        above = self._emit("GreaterOrEqual", [ids, end])[0]
        outside = self._emit("Or", [below, above])[0]
        shifted = self._emit("Sub", [ids, start])[0]
        local = self._emit("Where", [outside, self._const("zero_id", np.array(0, dtype=dtype)), shifted])[0]
        rows = self._emit("Gather", [self._split_weight(table, 0), local], axis=0)[0]
        mask = self._emit("Unsqueeze", [outside, self._const("last_axis", np.array([-1], dtype=np.int64))])[0]
        zero = self._const("zero", np.zeros((), dtype=self.consts[table].dtype))
        masked = self._emit("Where", [mask, zero, rows])[0]
        self._emit("AllReduce", [masked], [node.output[0]], domain=_collective_ops.DOMAIN)
        self.split[node.output[0]] = None

    # --- propagation through the other nodes -------------------------------------------------------

    def _default(self, node: onnx.NodeProto) -> None:
        if node.op_type in _UNARY:
            self._copy(node, list(node.input), self.split.get(node.input[0]))
        elif node.op_type in _BROADCAST:
            self._broadcast(node)
        elif node.op_type in _REDUCE:
            self._reduce(node)
        else:
            self._all_replicated(node)

    def _broadcast(self, node: onnx.NodeProto) -> None:
        out_rank = self._rank(node.output[0])
        if out_rank is None or any(x and self._rank(x) is None for x in node.input):
            return self._all_replicated(node)
        axes = {self.split[x] + out_rank - self._rank(x) for x in node.input if self.split.get(x) is not None}
        if len(axes) != 1:
            return self._all_replicated(node)
        axis = axes.pop()
        inputs = []
        for x in node.input:
            if not x or self.split.get(x) is not None:
                inputs.append(x)
                continue
            aligned = axis - (out_rank - self._rank(x))
            if aligned < 0 or self._dim(x, aligned) == 1:
                inputs.append(x)  # broadcast along the split axis: the same on every rank
                continue
            block = self._block(x, aligned)
            if block is None:
                return self._all_replicated(node)
            inputs.append(block)
        self._copy(node, inputs, axis)

    def _axes(self, node: onnx.NodeProto, rank: int, input_index: int = 1) -> Optional[List[int]]:
        """The axes a node acts on (its ``axes`` input or attribute), non-negative; None if unknown."""
        if len(node.input) > input_index and node.input[input_index]:
            value = self.consts.get(node.input[input_index])
            if value is None:
                return None
            axes = value.reshape(-1).tolist()
        else:
            axes = _attr(node, "axes", None)
            if axes is None:
                return list(range(rank))  # every axis
        return [a % rank for a in axes]

    def _reduce(self, node: onnx.NodeProto, keep: Optional[bool] = None) -> None:
        """A node that acts on some axes of its first input and keeps them (``keep``, else its
        ``keepdims``) or drops them: the split follows unless it is one of them."""
        x = node.input[0]
        rank, axis = self._rank(x), self.split[x]
        axes = None if rank is None else self._axes(node, rank)
        if axes is None or axis in axes:
            return self._all_replicated(node)
        keep = _attr(node, "keepdims", 1) if keep is None else keep
        self._copy(node, list(node.input), axis if keep else axis - sum(a < axis for a in axes))

    def _op_Softmax(self, node: onnx.NodeProto) -> None:
        rank, axis = self._rank(node.input[0]), self.split[node.input[0]]
        if rank is None or _attr(node, "axis", -1) % rank == axis:
            return self._all_replicated(node)
        self._copy(node, list(node.input), axis)

    _op_LogSoftmax = _op_Softmax

    def _op_LayerNormalization(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        rank, axis = self._rank(x), self.split[x]
        if (rank is None or axis >= _attr(node, "axis", -1) % rank
                or any(self.split.get(i) is not None for i in node.input[1:])):
            return self._all_replicated(node)
        self._copy(node, list(node.input), axis)

    def _op_Transpose(self, node: onnx.NodeProto) -> None:
        rank, axis = self._rank(node.input[0]), self.split[node.input[0]]
        perm = _attr(node, "perm", None) or list(reversed(range(rank)))
        self._copy(node, list(node.input), list(perm).index(axis))

    def _op_Reshape(self, node: onnx.NodeProto) -> None:
        x, target = node.input[0], node.input[1]
        axis, shape_in = self.split[x], self.shapes.get(x)
        spec = self.consts.get(target)
        shape_out = self.shapes.get(node.output[0])
        if (spec is None or shape_in is None or shape_out is None or None in shape_in or None in shape_out
                or self.split.get(target) is not None):
            return self._all_replicated(node)
        out_axis = _reshaped_axis(shape_in, shape_out, axis, self.p)
        if out_axis is None or spec[out_axis] == 0:
            return self._all_replicated(node)
        local = spec.copy()
        if local[out_axis] > 0:
            local[out_axis] //= self.p
        self._copy(node, [x, self._const(target, local)], out_axis)

    def _op_Shape(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        rank, axis = self._rank(x), self.split[x]
        if rank is None:
            return self._all_replicated(node)
        scale = np.ones(rank, dtype=np.int64)
        scale[axis] = self.p
        start, end = _attr(node, "start", 0), _attr(node, "end", rank)
        local = self._emit("Shape", [x], **{a.name: helper.get_attribute_value(a) for a in node.attribute})[0]
        self._emit("Mul", [local, self._const("shape_scale", scale[start:end])], [node.output[0]])
        self.split[node.output[0]] = None

    def _op_Concat(self, node: onnx.NodeProto) -> None:
        rank = self._rank(node.output[0])
        axes = {self.split[x] for x in node.input if self.split.get(x) is not None}
        if rank is None or len(axes) != 1 or _attr(node, "axis", 0) % rank in axes:
            return self._all_replicated(node)
        axis = axes.pop()
        inputs = [x if self.split.get(x) is not None else self._block(x, axis) for x in node.input]
        if None in inputs:
            return self._all_replicated(node)
        self._copy(node, inputs, axis)

    def _op_Slice(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        rank, axis = self._rank(x), self.split[x]
        axes = None if rank is None else self._axes(node, rank, input_index=3)
        if axes is None or axis in axes or any(self.split.get(i) is not None for i in node.input[1:]):
            return self._all_replicated(node)
        self._copy(node, list(node.input), axis)

    def _op_Split(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        rank, axis = self._rank(x), self.split[x]
        if rank is None or _attr(node, "axis", 0) % rank == axis:
            return self._all_replicated(node)
        self._copy(node, list(node.input), axis)

    def _op_Gather(self, node: onnx.NodeProto) -> None:
        data, indices = node.input
        rank, axis = self._rank(data), self.split.get(data)
        along = None if rank is None else _attr(node, "axis", 0) % rank
        if axis is None or self.split.get(indices) is not None or along == axis or self._rank(indices) is None:
            return self._all_replicated(node)
        self._copy(node, [data, indices], axis if axis < along else axis - 1 + self._rank(indices))

    def _op_MatMul(self, node: onnx.NodeProto) -> None:
        a, b = node.input
        ra, rb, ro = self._rank(a), self._rank(b), self._rank(node.output[0])
        sa, sb = self.split.get(a), self.split.get(b)
        if None in (ra, rb, ro) or ra < 2 or rb < 2:
            return self._all_replicated(node)
        if sa == ra - 1 and sb == rb - 2:  # both split along the contracted axis: partial sums
            partial = self._name(node.output[0] + "_partial")
            self._copy(node, [a, b])
            self.nodes[-1].output[:] = [partial]
            self._emit("AllReduce", [partial], [node.output[0]], domain=_collective_ops.DOMAIN)
            self.split[node.output[0]] = None
            return
        # the output axis each operand's split maps to: a batch axis, the rows of a, the columns of b
        out_a = None if sa is None or sa == ra - 1 else (ro - 2 if sa == ra - 2 else sa + ro - ra)
        out_b = None if sb is None or sb == rb - 2 else (ro - 1 if sb == rb - 1 else sb + ro - rb)
        if (sa is not None and out_a is None) or (sb is not None and out_b is None) or (
                out_a is not None and out_b is not None and out_a != out_b):
            return self._all_replicated(node)
        axis = out_a if out_a is not None else out_b
        inputs = [a, b]
        if axis < ro - 2:  # a batch axis: the other operand, if replicated and not broadcast, is sliced
            for i, (x, rx, sx) in enumerate(((a, ra, sa), (b, rb, sb))):
                aligned = axis - (ro - rx)
                if sx is None and aligned >= 0 and self._dim(x, aligned) != 1:
                    inputs[i] = self._block(x, aligned)
                    if inputs[i] is None:
                        return self._all_replicated(node)
        self._copy(node, inputs, axis)

    def _op_Unsqueeze(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        rank_out, axis = self._rank(node.output[0]), self.split[x]
        axes = None if rank_out is None else self._axes(node, rank_out)
        if axes is None:
            return self._all_replicated(node)
        kept = [i for i in range(rank_out) if i not in axes]
        self._copy(node, list(node.input), kept[axis])

    def _op_Squeeze(self, node: onnx.NodeProto) -> None:
        self._reduce(node, keep=False)


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _reshaped_axis(shape_in: List[int], shape_out: List[int], axis: int, p: int) -> Optional[int]:
    """Where a split along ``axis`` of ``shape_in`` lands in ``shape_out`` after a reshape, when it
    stays a contiguous block per rank: the split axis must be the outermost of the input dims
    merged or split with it (the others before it of size 1), and the outermost output dim of
    that group (past dims of size 1) must be divisible by p. None otherwise."""
    i = o = 0
    while i < len(shape_in) or o < len(shape_out):
        # the next group: the fewest dims on each side with equal products
        i0, o0 = i, o
        pi = shape_in[i] if i < len(shape_in) else 1
        po = shape_out[o] if o < len(shape_out) else 1
        i, o = i + 1, o + 1
        while pi != po:
            if pi < po and i < len(shape_in):
                pi *= shape_in[i]
                i += 1
            elif po < pi and o < len(shape_out):
                po *= shape_out[o]
                o += 1
            else:
                return None
        if i0 <= axis < i:
            if any(shape_in[k] != 1 for k in range(i0, axis)):
                return None  # an outer dim before the split one: the block would not be contiguous
            for k in range(o0, min(o, len(shape_out))):
                if shape_out[k] != 1:
                    return k if shape_out[k] % p == 0 else None
            return None
    return None
