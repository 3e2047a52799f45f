"""Run a per-rank ONNX model in ONNX Runtime's CPU build, its collectives over ``torch.distributed``.

ONNX Runtime's CPU build has no kernel for the ``com.microsoft`` collectives (its NCCL builds
do, for ``AllReduce`` and ``AllGather``). :func:`cpu_session` makes a session of this rank's model
in which stand-ins run them: Python ops of onnxruntime-extensions with the same op types and
attributes, in that library's domain (``ai.onnx.contrib``; Python ops can be registered in no
other), over a ``torch.distributed`` group, in float32. It is how the per-rank models are tested
on the CPU (several gloo processes, one rank each), and a way to run them without a GPU build.

Every rank runs its model with inputs of the same shapes at the same time, as it would make the
calls in PyTorch; each collective is bounded by :func:`tp_kernels.get_timeout`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime_extensions import PyCustomOpDef, default_opset_domain, get_library_path, onnx_op

from .. import _collectives as coll
from . import _collective_ops

__all__ = ["STANDIN_DOMAIN", "cpu_session", "standin_model"]

#: Where the stand-ins live (the only domain onnxruntime-extensions registers Python ops in).
STANDIN_DOMAIN = default_opset_domain()

#: The group the stand-ins run over (set by cpu_session; one per process at a time).
_group = None


def _tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _check_size(op_type: str, group_size: int) -> None:
    p = coll.group_size(_group)
    if group_size != p:
        raise RuntimeError(f"{op_type}: the node's group_size is {group_size}, this session's group has {p} ranks "
                           "(run each rank's model on a group of the size it was made for)")


_INT_ATTRS = {"group_size": PyCustomOpDef.dt_int64, "axis": PyCustomOpDef.dt_int64}


@onnx_op(op_type="AllReduce", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
def _all_reduce(x):
    return coll.all_reduce(_tensor(x), _group, inplace=True).wait().numpy()


@onnx_op(op_type="AllGather", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float], attrs=_INT_ATTRS)
def _all_gather(x, group_size, axis):
    _check_size("AllGather", group_size)
    t = _tensor(x).movedim(axis, 0).contiguous()
    return coll.all_gather_dim0(t, _group).wait().movedim(0, axis).contiguous().numpy()


@onnx_op(op_type="ReduceScatter", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float],
         attrs=_INT_ATTRS)
def _reduce_scatter(x, group_size, axis):
    _check_size("ReduceScatter", group_size)
    t = _tensor(x).movedim(axis, 0).contiguous()
    return coll.reduce_scatter_dim0(t, _group).wait().movedim(0, axis).contiguous().numpy()


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
    doc). Nodes run one at a time, in the same order on every rank."""
    global _group
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(model)
    _group = coll.resolve_group(group)
    options = sess_options or ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    return ort.InferenceSession(standin_model(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
