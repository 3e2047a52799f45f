"""Run a per-rank ONNX model in ONNX Runtime's CPU build, its collectives over ``torch.distributed``.

ONNX Runtime's CPU build has no kernel for the ``com.microsoft`` collectives (its NCCL builds
do, for ``AllReduce`` and ``AllGather``). :func:`cpu_session` makes a session of this rank's model
in which stand-ins run them: Python ops of onnxruntime-extensions with the same op types and
attributes, in that library's domain (``ai.onnx.contrib``; Python ops can be registered in no
other), over a ``torch.distributed`` group, in float32. It is how the per-rank models are tested
on the CPU (several gloo processes, one rank each), and a way to run them without a GPU build.

Every rank makes its session at the same time (the ranks agree there on their models' collectives
and each checks that its model was made for its rank), then runs its model with inputs of the same
shapes at the same time, as it would make the calls in PyTorch; each collective is bounded by
:func:`tp_kernels.get_timeout`. A stand-in that fails cannot raise (onnxruntime-extensions would
end the process): it keeps its error, and the session's ``run`` raises it once ONNX Runtime
returns.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.distributed as dist
from onnxruntime_extensions import PyCustomOpDef, default_opset_domain, get_library_path, onnx_op

from .. import _collectives as coll
from .. import parallel_state
from .._agreement import agree
from . import _collective_ops

__all__ = ["STANDIN_DOMAIN", "cpu_session", "standin_model"]

#: Where the stand-ins live (the only domain onnxruntime-extensions registers Python ops in).
STANDIN_DOMAIN = default_opset_domain()

#: The group the stand-ins run over (set by cpu_session; one per process at a time).
_group = None


def _tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


#: The error the first stand-in to fail met in the run under way, with its op type, for
#: :meth:`_Session.run` to raise: onnxruntime-extensions passes no exception of a Python op on (one
#: raised there ends the process), so a stand-in keeps it here and hands ONNX Runtime zeros.
_failed: List[Tuple[str, BaseException]] = []


def _standing_in(op_type: str, out_shape, collective: Callable[[], np.ndarray]) -> np.ndarray:
    """``collective()``, or zeros of ``out_shape`` where it raises (its error kept in :data:`_failed`)
    or a stand-in of this run failed before (so no rank waits on a collective this one skips past
    the timeout again)."""
    if not _failed:
        try:
            return collective()
        except Exception as exc:  # whatever the collective raised: a peer past the timeout, a dead group
            _failed.append((op_type, exc))
    return np.zeros(out_shape, dtype=np.float32)


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


_INT_ATTRS = {"group_size": PyCustomOpDef.dt_int64, "axis": PyCustomOpDef.dt_int64}


@onnx_op(op_type="AllReduce", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
def _all_reduce(x):
    return _standing_in("AllReduce", x.shape, lambda: coll.all_reduce(_tensor(x), _group, inplace=True).wait().numpy())


@onnx_op(op_type="AllGather", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float], attrs=_INT_ATTRS)
def _all_gather(x, group_size, axis):
    return _standing_in("AllGather", _resized(x.shape, axis, times=group_size),
                        lambda: _along(x, axis, coll.all_gather_dim0))


@onnx_op(op_type="ReduceScatter", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float],
         attrs=_INT_ATTRS)
def _reduce_scatter(x, group_size, axis):
    return _standing_in("ReduceScatter", _resized(x.shape, axis, over=group_size),
                        lambda: _along(x, axis, coll.reduce_scatter_dim0))


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


def _collective_nodes(model: onnx.ModelProto) -> List[onnx.NodeProto]:
    return [n for n in model.graph.node
            if n.domain in (_collective_ops.DOMAIN, STANDIN_DOMAIN) and n.op_type in _collective_ops.OPS]


def _check_model(model: onnx.ModelProto, group) -> object:
    """The group the stand-ins run over: ``group`` or its host twin. A ``ValueError`` naming the
    argument where there is none, where ``model``'s metadata says another group size or another
    rank than this rank's in ``group`` (:func:`_collective_ops.made_for`), or where a collective
    node's ``group_size`` is not the group's size (naming the first such node; an ``AllReduce``
    has none to check)."""
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
    return host


def _collectives_in_order(model: onnx.ModelProto) -> str:
    """What every rank's model must agree on: its collective nodes, in order, with their attributes
    in the schema's order (not their names, nor the shards)."""
    def attributes(node):
        given = {a.name: a.i for a in node.attribute}
        return ", ".join(f"{name}={given.get(name)}" for name in _collective_ops.OPS[node.op_type])

    return ", ".join(f"{n.op_type}({attributes(n)})" for n in _collective_nodes(model)) or "no collectives"


def standin_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose collective nodes are in :data:`STANDIN_DOMAIN` (op types and
    attributes unchanged), for a session with the stand-ins."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    moved = False
    for node in out.graph.node:
        if node.domain == _collective_ops.DOMAIN and node.op_type in _collective_ops.OPS:
            node.domain = STANDIN_DOMAIN
            moved = True
    if moved and not any(o.domain == STANDIN_DOMAIN for o in out.opset_import):
        out.opset_import.append(onnx.helper.make_opsetid(STANDIN_DOMAIN, 1))
    return out


def cpu_session(model, group=None, sess_options: Optional[ort.SessionOptions] = None) -> ort.InferenceSession:
    """An ONNX Runtime CPU session of this rank's ``model`` (a ModelProto or a path) whose
    collectives run over ``group`` (default: the tensor-parallel group) by the stand-ins (module
    doc), on the host: over ``group``, or for an NCCL group over its host twin
    (:func:`tp_kernels.parallel_state.host_group`). Nodes run one at a time, in the same order on
    every rank.

    Every rank of ``group`` makes its session at the same time: they agree, bounded, that their
    models have the same collective nodes in the same order, or all raise before anything runs.
    A model whose metadata (``export``'s and ``shard``'s) says another rank or group size, or one
    of whose collective nodes spans another number of ranks (``group_size``), is a ``ValueError``
    naming it on its rank, and a ``RuntimeError`` on the others. A collective that fails in a run (a
    peer past the timeout) is a ``RuntimeError`` from the session's ``run``."""
    global _group
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(model)
    group = coll.resolve_group(group)
    host = agree("tp_kernels.onnx.cpu_session", group, lambda: _check_model(model, group),
                 lambda _: _collectives_in_order(model), always=True)
    _group = host
    options = sess_options or ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    return _Session(standin_model(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
