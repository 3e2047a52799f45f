"""The collective nodes of tp_kernels' per-rank ONNX models: ONNX Runtime's, defined once.

ONNX Runtime's distributed (NCCL) builds run ``AllReduce`` and ``AllGather`` in the
``com.microsoft`` domain (``onnxruntime/core/graph/contrib_ops/collective_defs.cc``):
``AllReduce`` sums over the runtime's ranks and has no attribute; ``AllGather`` concatenates
along ``axis`` and says how many ranks take part in ``group_size``. ``ReduceScatter`` (the sum,
keeping this rank's block of ``axis``) has the same attributes as ``AllGather``; ONNX Runtime's
inference builds have no kernel for it (its training builds had one of another name), so a model
that contains one runs where a runtime provides it, e.g. :func:`tp_kernels.onnx.cpu_session`.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["DOMAIN", "OPS", "VERSION"]

DOMAIN = "com.microsoft"
VERSION = 1
#: op type -> its attributes (all ints), in the order ONNX Runtime's schema lists them
OPS: Dict[str, Tuple[str, ...]] = {
    "AllReduce": (),
    "AllGather": ("group_size", "axis"),
    "ReduceScatter": ("group_size", "axis"),
}
