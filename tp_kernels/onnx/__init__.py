"""Tensor-parallel models out of PyTorch: per-rank ONNX models with explicit collectives.

* :func:`export`: this rank's model of a model made of tp_kernels layers (built directly or by
  :func:`tp_kernels.parallelize`), traced by ``torch.onnx.export`` with tp_kernels' custom ops
  translated to ``Gemm`` and ONNX Runtime's ``com.microsoft`` collectives.
* :func:`shard`: this rank's model of a dense ``onnx.ModelProto``, by a plan in the style of
  ``parallelize``.
* :func:`cpu_session`: an ONNX Runtime CPU session of a per-rank model whose collectives run over
  ``torch.distributed`` (stand-ins for the kernels of ONNX Runtime's NCCL builds).

docs/onnx.md says what is exported, how the nodes map to ONNX Runtime's and how to run them.
Needs the ``onnx`` extra (``pip install tp_kernels[onnx]``: onnx, onnxscript, onnxruntime,
onnxruntime-extensions); the rest of tp_kernels imports without it.
"""

try:
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    import onnxruntime_extensions  # noqa: F401
    import onnxscript  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise ImportError(f"tp_kernels.onnx needs the onnx extra (pip install 'tp_kernels[onnx]'): {exc}") from exc

from ._collective_ops import DOMAIN
from .export import OPSET, export, translation_table
from .runtime import STANDIN_DOMAIN, cpu_session, standin_model
from .shard import STYLES, shard

__all__ = ["DOMAIN", "OPSET", "STANDIN_DOMAIN", "STYLES", "cpu_session", "export", "shard", "standin_model",
           "translation_table"]
