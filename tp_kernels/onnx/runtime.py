"""Run a per-rank ONNX model in ONNX Runtime's CPU build, its collectives over ``torch.distributed``.

ONNX Runtime's CPU build has no kernel for the ``com.microsoft`` collectives (its NCCL builds
do, for ``AllReduce`` and ``AllGather``). :func:`cpu_session` makes a session of this rank's model
in which stand-ins run them: Python ops of onnxruntime-extensions with the same op types and
attributes, in that library's domain (``ai.onnx.contrib``; Python ops can be registered in no
other), over a ``torch.distributed`` group, in float32 or float64 (a stand-in for each, the float64
one's op type suffixed: :data:`STANDIN_TYPES`); a float16 or bfloat16 collective, a type its Python
ops do not take, moves as float32 between two ``Cast`` nodes (summed in float32, rounded once). It
is how the per-rank models are tested on the CPU (several gloo processes, one rank each), and a way
to run them without a GPU build.

Every rank makes its session at the same time (the ranks agree there on their models' collectives,
each checks that its model was made for its rank, and ranks whose models say no rank check that
they do not hold the same one), then runs its model with inputs of the same
shapes at the same time, as it would make the calls in PyTorch; each collective is bounded by
:func:`tp_kernels.get_timeout`. A stand-in that fails cannot raise (onnxruntime-extensions would
end the process): it keeps its error, and the session's ``run`` raises it once ONNX Runtime
returns.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.distributed as dist
from onnxruntime_extensions import PyCustomOpDef, default_opset_domain, get_library_path, onnx_op

from .. import _collectives as coll
from .. import parallel_state
from .._agreement import DIGEST_BYTES, agree
from . import _collective_ops

__all__ = ["STANDIN_DOMAIN", "cpu_session", "standin_model"]

#: Where the stand-ins live (the only domain onnxruntime-extensions registers Python ops in).
STANDIN_DOMAIN = default_opset_domain()

#: The group the stand-ins run over (set by cpu_session; one per process at a time).
_group = None


#: The element types the stand-ins take: ONNX's -> (the suffix of their op types, onnxruntime-extensions'
#: type). Its Python ops take no float16 nor bfloat16: :data:`WIDENED` move as float32.
STANDIN_TYPES: Dict[int, Tuple[str, int]] = {
    onnx.TensorProto.FLOAT: ("", PyCustomOpDef.dt_float),
    onnx.TensorProto.DOUBLE: ("Float64", PyCustomOpDef.dt_double),
}
#: The element types of collectives cast to float32 around their stand-in (and back).
WIDENED = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


#: The error the first stand-in to fail met in the run under way, with its op type, for
#: :meth:`_Session.run` to raise: onnxruntime-extensions passes no exception of a Python op on (one
#: raised there ends the process), so a stand-in keeps it here and hands ONNX Runtime zeros.
_failed: List[Tuple[str, BaseException]] = []


def _standing_in(op_type: str, out_shape, dtype, collective: Callable[[], np.ndarray]) -> np.ndarray:
    """``collective()``, or zeros of ``out_shape`` where it raises (its error kept in :data:`_failed`)
    or a stand-in of this run failed before (so no rank waits on a collective this one skips past
    the timeout again)."""
    if not _failed:
        try:
            return collective()
        except Exception as exc:  # whatever the collective raised: a peer past the timeout, a dead group
            _failed.append((op_type, exc))
    return np.zeros(out_shape, dtype=dtype)


def _resized(shape, axis: int, times: int = 1, over: int = 1) -> Tuple[int, ...]:
    """``shape`` with dim ``axis`` times ``times``, over ``over``."""
    out = list(shape)
    out[axis] = out[axis] * times // over
    return tuple(out)


def _along(x: np.ndarray, axis: int, dim0_collective) -> np.ndarray:
    """``dim0_collective`` (:func:`coll.all_gather_dim0`, :func:`coll.reduce_scatter_dim0`) of ``x``
    along ``axis``, over the session's group."""
    t = _tensor(x).movedim(axis, 0).contiguous()
    return dim0_collective(t, _group).wait().movedim(0, axis).contiguous().numpy()


def _all_reduce(x):
    return _standing_in("AllReduce", x.shape, x.dtype,
                        lambda: coll.all_reduce(_tensor(x), _group, inplace=True).wait().numpy())


def _all_gather(x, group_size, axis):
    return _standing_in("AllGather", _resized(x.shape, axis, times=group_size), x.dtype,
                        lambda: _along(x, axis, coll.all_gather_dim0))


def _reduce_scatter(x, group_size, axis):
    return _standing_in("ReduceScatter", _resized(x.shape, axis, over=group_size), x.dtype,
                        lambda: _along(x, axis, coll.reduce_scatter_dim0))


for _suffix, _type in STANDIN_TYPES.values():  # each stand-in, in each type
    for _op, _body in (("AllReduce", _all_reduce), ("AllGather", _all_gather), ("ReduceScatter", _reduce_scatter)):
        onnx_op(op_type=_op + _suffix, inputs=[_type], outputs=[_type],
                attrs={name: PyCustomOpDef.dt_int64 for name in _collective_ops.OPS[_op]})(_body)


class _Session(ort.InferenceSession):
    """The session :func:`cpu_session` returns: its :meth:`run` raises the error of a stand-in that
    failed (:data:`_failed`)."""

    def run(self, output_names, input_feed, run_options=None):
        """``InferenceSession.run``; a ``RuntimeError`` where a collective node failed (its error
        chained), the outputs not returned."""
        _failed.clear()
        outputs = super().run(output_names, input_feed, run_options)
        if _failed:
            op_type, exc = _failed[0]
            _failed.clear()
            raise RuntimeError(f"tp_kernels.onnx: a collective {op_type} node of this rank's model failed, so the "
                               f"session's outputs were not made (the nodes after it ran on zeros, without "
                               f"communicating): {exc}") from exc
        return outputs


def _collective(node: onnx.NodeProto) -> Optional[str]:
    """The collective (a key of ``_collective_ops.OPS``) ``node`` is, in ONNX Runtime's domain or as a
    stand-in (its op type suffixed by its type's, :data:`STANDIN_TYPES`); None for another node."""
    if node.domain == _collective_ops.DOMAIN:
        return node.op_type if node.op_type in _collective_ops.OPS else None
    if node.domain == STANDIN_DOMAIN:
        for suffix, _ in STANDIN_TYPES.values():
            op = node.op_type[:len(node.op_type) - len(suffix)] if node.op_type.endswith(suffix) else None
            if op in _collective_ops.OPS:
                return op
    return None


def _collective_nodes(model: onnx.ModelProto) -> List[onnx.NodeProto]:
    return [n for n in model.graph.node if _collective(n) is not None]


def _check_model(model: onnx.ModelProto, group) -> Tuple[object, onnx.ModelProto, List[int], bool]:
    """The group the stand-ins run over (``group`` or its host twin), :func:`standin_model`'s copy of
    ``model``, its collectives' element types and whether its metadata says its rank. A
    ``ValueError`` naming the argument where there is no such group, where ``model``'s metadata says
    another group size or another rank than this rank's in ``group``
    (:func:`_collective_ops.made_for`), where a collective node's ``group_size`` is not the group's
    size (naming the first such node; an ``AllReduce`` has none to check), or where one moves a type
    the stand-ins do not."""
    host = parallel_state.host_group(group)
    if host is None:
        raise ValueError(f"group: {group.group_name!r} carries no host tensors ({dist.get_backend(group)}) and "
                         "has no host twin, and the stand-ins run on the host: pass a gloo group of the same ranks")
    p, r = coll.group_size(group), coll.group_rank(group)
    made = _collective_ops.made_for(model)
    if made is not None and made != (p, r):
        raise ValueError(f"model: it is rank {made[1]}'s model of a group of {made[0]} (its metadata "
                         f"{_collective_ops.RANK_KEY!r}, {_collective_ops.GROUP_SIZE_KEY!r}), and this process is "
                         f"rank {r} of the group of {p}; run each rank's model on the rank it was made for")
    for node in _collective_nodes(model):
        size = next((a.i for a in node.attribute if a.name == "group_size"), p)
        if size != p:
            raise ValueError(f"model: its {node.op_type} node {node.name!r} spans {size} ranks (group_size), the "
                             f"group {p}; run each rank's model on a group of the size it was made for")
    types = _collective_types(model)
    return host, _standins(model, types), types, made is not None


#: what a rank sends for its model in :func:`_refuse_copies` where its metadata says its rank
_SAID = bytes(DIGEST_BYTES)


def _refuse_copies(serialized: bytes, said: bool, host, group_name: str) -> None:
    """A ``RuntimeError`` on every rank where ranks whose models do not say which rank's they are
    (``said`` false: no :func:`_collective_ops.made_for` metadata, a model made elsewhere or its
    metadata stripped) hold the same model, nodes and initializers alike: one rank's model loaded
    on several ranks, which would run unnoticed, its shards counted as each of theirs. One bounded
    all-gather of a digest of each rank's ``serialized`` model, the bytes its session is made of
    (``_SAID`` for a model whose metadata says its rank, checked against it before)."""
    mine = _SAID if said else hashlib.blake2b(serialized, digest_size=DIGEST_BYTES).digest()
    digests = coll.all_gather_bytes(mine, host, torch.device("cpu"))
    alike: Dict[bytes, List[int]] = {}
    for q, digest in enumerate(digests):
        alike.setdefault(digest, []).append(q)
    copies = [ranks for digest, ranks in alike.items() if digest != _SAID and len(ranks) > 1]
    if copies:
        raise RuntimeError(
            f"tp_kernels.onnx.cpu_session: {'; '.join(f'ranks {ranks}' for ranks in copies)} of group {group_name!r} "
            f"hold the same model, and its metadata does not say which rank's it is "
            f"({_collective_ops.RANK_KEY!r}, {_collective_ops.GROUP_SIZE_KEY!r}): load each rank's own model. "
            "A model rightly the same on every rank (nothing split) says its rank there: tp_kernels.onnx.export "
            "and shard write it, onnx.helper.set_model_props writes it back")


def _type_name(elem_type: int) -> str:
    """torch's name of an ONNX element type where there is one (``float32``), else ONNX's (``string``)."""
    T = onnx.TensorProto
    return {T.FLOAT: "float32", T.DOUBLE: "float64", T.FLOAT16: "float16"}.get(elem_type) or \
        T.DataType.Name(elem_type).lower()


def _collectives_in_order(model: onnx.ModelProto, types: List[int]) -> str:
    """What every rank's model must agree on: its collective nodes, in order, with their attributes
    in the schema's order and their element types (not their names, nor the shards)."""
    def attributes(node, elem_type):
        given = {a.name: a.i for a in node.attribute}
        return ", ".join([*(f"{name}={given.get(name)}" for name in _collective_ops.OPS[_collective(node)]),
                          _type_name(elem_type)])

    nodes = _collective_nodes(model)
    return ", ".join(f"{_collective(n)}({attributes(n, t)})" for n, t in zip(nodes, types)) or "no collectives"


def _collective_types(model: onnx.ModelProto) -> List[int]:
    """The element type of each collective node's input, in the graph's order, as ONNX's type
    inference finds it with each collective taken for an ``Identity`` (which keeps the type; the
    shapes that makes, which the model's own may contradict, are not read: ONNX's inference, not
    strict, keeps going past them); float32 where it cannot tell (a value of a custom op's)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for node in probe.graph.node:
        if _collective(node) is not None:
            node.domain, node.op_type = "", "Identity"
            del node.attribute[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(probe).graph
    except (onnx.shape_inference.InferenceError, ValueError):  # (not a model inference takes: the default)
        inferred = probe.graph
    known = {i.name: i.data_type for i in inferred.initializer}
    known.update((v.name, v.type.tensor_type.elem_type) for v in (*inferred.input, *inferred.value_info,
                                                                  *inferred.output))
    return [known.get(n.input[0]) or onnx.TensorProto.FLOAT for n in _collective_nodes(model)]


def _standins(model: onnx.ModelProto, types: List[int]) -> onnx.ModelProto:
    """:func:`standin_model` of ``model`` whose collectives move ``types``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes, moved, of_type = [], False, iter(types)
    for given in model.graph.node:
        node = onnx.NodeProto()
        node.CopyFrom(given)
        elem_type = next(of_type) if _collective(node) is not None else None
        if elem_type is None or node.domain != _collective_ops.DOMAIN:
            nodes.append(node)
            continue
        widened = elem_type in WIDENED
        if not widened and elem_type not in STANDIN_TYPES:
            raise ValueError(f"model: its {node.op_type} node {node.name!r} moves {_type_name(elem_type)}, a type the "
                             "CPU stand-ins do not move: float32 and float64 (float16 and bfloat16 as float32)")
        node.domain, moved = STANDIN_DOMAIN, True
        node.op_type += STANDIN_TYPES[onnx.TensorProto.FLOAT if widened else elem_type][0]
        if not widened:
            nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        node.input[0], node.output[0] = f"{y}__standin_float32_in", f"{y}__standin_float32_out"
        nodes += [onnx.helper.make_node("Cast", [x], [node.input[0]], to=onnx.TensorProto.FLOAT), node,
                  onnx.helper.make_node("Cast", [node.output[0]], [y], to=elem_type)]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    if moved and not any(o.domain == STANDIN_DOMAIN for o in out.opset_import):
        out.opset_import.append(onnx.helper.make_opsetid(STANDIN_DOMAIN, 1))
    return out


def standin_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose collective nodes are stand-ins, for a session with them: in
    :data:`STANDIN_DOMAIN`, attributes unchanged, op types suffixed by their element type's
    (:data:`STANDIN_TYPES`: none for float32); one of float16 or bfloat16 between a ``Cast`` to
    float32 and one back. A ``ValueError`` naming the node for another type."""
    return _standins(model, _collective_types(model))


def cpu_session(model, group=None, sess_options: Optional[ort.SessionOptions] = None) -> ort.InferenceSession:
    """An ONNX Runtime CPU session of this rank's ``model`` (a ModelProto or a path) whose
    collectives run over ``group`` (default: the tensor-parallel group) by the stand-ins (module
    doc), on the host: over ``group``, or for an NCCL group over its host twin
    (:func:`tp_kernels.parallel_state.host_group`). Nodes run one at a time, in the same order on
    every rank.

    Every rank of ``group`` makes its session at the same time: they agree, bounded, that their
    models have the same collective nodes in the same order, of the same element types, or all
    raise before anything runs. The collectives move float32 or float64; float16 and bfloat16 as
    float32 (:func:`standin_model`); a collective of another type is a ``ValueError`` naming it.
    A model whose metadata (``export``'s and ``shard``'s) says another rank or group size, or one
    of whose collective nodes spans another number of ranks (``group_size``), is a ``ValueError``
    naming it on its rank, and a ``RuntimeError`` on the others; ranks whose models say no rank and
    are the same model (one rank's, loaded on several) all raise a ``RuntimeError`` naming them. A
    collective that fails in a run (a peer past the timeout) is a ``RuntimeError`` from the
    session's ``run``."""
    global _group
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(model)
    group = coll.resolve_group(group)
    host, standins, _, said = agree("tp_kernels.onnx.cpu_session", group, lambda: _check_model(model, group),
                                    lambda checked: _collectives_in_order(model, checked[2]), always=True)
    serialized = standins.SerializeToString()
    if coll.group_size(group) > 1:
        _refuse_copies(serialized, said, host, group.group_name)
    _group = host
    options = sess_options or ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    return _Session(serialized, options, providers=["CPUExecutionProvider"])
