"""Export a model made of tp_kernels layers to ONNX, one model per rank, the communication as nodes.

Each rank calls :func:`export` on its own model (its weight shards) with the group alive: the
model is traced by ``torch.onnx.export`` (the dynamo exporter), which translates tp_kernels'
custom ops by :func:`translation_table` (passed to the exporter, nothing of torch patched):

=====================================  ================================================================
custom op                              ONNX nodes (``Gemm`` with ``transB=1``: ``x Wᵀ``)
=====================================  ================================================================
``all_gather_matmul``                  ``AllGather(axis=0)``, ``Gemm`` (+ bias)
``matmul_reduce_scatter``              ``Gemm``, ``ReduceScatter(axis=0)``, ``Add`` bias
``matmul_all_reduce``                  ``Gemm``, ``AllReduce``, ``Add`` bias
``linear_with_grad_all_reduce``        ``Gemm`` (+ bias): a local product (the all-reduce is its backward's)
``all_reduce``                         ``AllReduce`` (the mappings, the vocabulary-parallel embedding,
                                       :class:`tp_kernels.Communicator`)
``all_gather``, ``reduce_scatter``     ``AllGather(axis=0)``, ``ReduceScatter(axis=0)``
=====================================  ================================================================

The collective nodes are ONNX Runtime's (:mod:`tp_kernels.onnx._collective_ops`), with
``group_size`` the group's size; with one rank there are none. The rank's shards are the
model's initializers. The backends do not matter: every backend's op has these semantics. When
the model's ops run over one group of several ranks (or groups alike in size and in this rank's
place), the model's metadata says its size and this rank's rank there
(:func:`tp_kernels.onnx._collective_ops.stamp`), which :func:`tp_kernels.onnx.cpu_session` checks.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Optional, Set, Tuple

import onnx
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript import values

from .. import _collectives as coll
from .. import _library  # noqa: F401  (registers torch.ops.tp_kernels.*)
from . import _collective_ops

__all__ = ["OPSET", "export", "translation_table"]

#: The opset the models are exported at (and the least one :func:`export` takes).
OPSET = 18

_domain = values.Opset(_collective_ops.DOMAIN, _collective_ops.VERSION)


def _collective(name: str) -> values.Op:
    """An onnxscript op of ONNX Runtime's collective ``name``, with a schema of our own (not
    registered anywhere: it only tells the exporter the node's inputs and attributes)."""
    types = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)", "tensor(int64)",
             "tensor(int32)", "tensor(bool)"]
    schema = OpSchema(
        name, _collective_ops.DOMAIN, _collective_ops.VERSION,
        inputs=[OpSchema.FormalParameter("input", "T")],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", types, "")],
        attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT, "") for a in _collective_ops.OPS[name]],
    )
    return values.Op(_domain, name, schema)


_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER = (_collective(n) for n in ("AllReduce", "AllGather", "ReduceScatter"))


#: The groups the translations of the export under way met: (size, this rank's rank there).
_groups_met: Set[Tuple[int, int]] = set()


def _size(group: str) -> int:
    resolved = coll.group_from_name(group)
    p = coll.group_size(resolved)
    _groups_met.add((p, coll.group_rank(resolved)))
    return p


def _all_reduce(x, group: str):
    return _ALL_REDUCE(x) if _size(group) > 1 else op.Identity(x)


def _all_gather(x, group: str):
    p = _size(group)
    return _ALL_GATHER(x, group_size=p, axis=0) if p > 1 else op.Identity(x)


def _reduce_scatter(x, group: str):
    p = _size(group)
    return _REDUCE_SCATTER(x, group_size=p, axis=0) if p > 1 else op.Identity(x)


def _gemm(x, weight, bias=None):
    return op.Gemm(x, weight, transB=1) if bias is None else op.Gemm(x, weight, bias, transB=1)


def _add_bias(y, bias):
    return y if bias is None else op.Add(y, bias)


# The translations: each takes the custom op's arguments (tensors as ONNX values, the rest as they
# are) and builds its nodes.


def _all_gather_matmul(x, weight, bias, group: str, impl: str):
    return _gemm(_all_gather(x, group), weight, bias)


def _matmul_reduce_scatter(x, weight, bias, group: str, impl: str):
    return _add_bias(_reduce_scatter(_gemm(x, weight), group), bias)


def _matmul_all_reduce(x, weight, bias, group: str, impl: str):
    return _add_bias(_all_reduce(_gemm(x, weight), group), bias)


def _linear(x, weight, bias, group: str, impl: str):
    return _gemm(x, weight, bias)


def _plain(collective: Callable):
    def translate(x, group: str, impl: str):
        return collective(x, group)

    return translate


def translation_table() -> Dict[Any, Callable]:
    """The ONNX translations of tp_kernels' custom ops, as ``torch.onnx.export``'s
    ``custom_translation_table`` takes them (see the module doc)."""
    ops = torch.ops.tp_kernels
    return {
        ops.all_gather_matmul.default: _all_gather_matmul,
        ops.matmul_reduce_scatter.default: _matmul_reduce_scatter,
        ops.matmul_all_reduce.default: _matmul_all_reduce,
        ops.linear_with_grad_all_reduce.default: _linear,
        ops.all_reduce.default: _plain(_all_reduce),
        ops.all_gather.default: _plain(_all_gather),
        ops.reduce_scatter.default: _plain(_reduce_scatter),
    }


@contextlib.contextmanager
def _quiet_registry():
    """Silence the exporter's warnings about other libraries' ops it cannot register (torchvision's,
    when it is not installed): they say nothing about this model."""
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry.level
    registry.setLevel(logging.ERROR)
    try:
        yield
    finally:
        registry.setLevel(level)


def export(model: torch.nn.Module, args: tuple, f=None, *, kwargs: Optional[dict] = None,
           opset_version: int = OPSET, input_names=None, output_names=None,
           dynamic_shapes=None) -> onnx.ModelProto:
    """This rank's ONNX model of ``model`` called on ``args`` (and ``kwargs``): its layers' shards
    as initializers, their communication as ONNX Runtime's collective nodes (module doc).

    Call it on every rank of the group, which must be alive (the nodes say its size). The model is
    traced without gradients, in the mode it is in (call ``model.eval()`` first, as for any
    export). ``f``: a path or file to write the model to too. ``opset_version`` (at least
    :data:`OPSET`), ``input_names``, ``output_names`` and ``dynamic_shapes`` are
    ``torch.onnx.export``'s. Returns the model, checked by ``onnx.checker``.
    """
    if isinstance(opset_version, bool) or not isinstance(opset_version, int) or opset_version < OPSET:
        raise ValueError(f"opset_version: expected an int >= {OPSET}, got {opset_version!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    args = args if isinstance(args, tuple) else (args,)
    _groups_met.clear()
    with torch.no_grad(), contextlib.redirect_stdout(None), _quiet_registry():  # the exporter's progress lines
        program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, opset_version=opset_version,
                                    custom_translation_table=translation_table(), input_names=input_names,
                                    output_names=output_names, dynamic_shapes=dynamic_shapes, verbose=False)
    proto = program.model_proto
    if len(_groups_met) == 1:  # the group the model was made for (module doc)
        _collective_ops.stamp(proto, *_groups_met.pop())
    _groups_met.clear()
    onnx.checker.check_model(proto)
    if f is not None:
        onnx.save(proto, f)
    return proto
