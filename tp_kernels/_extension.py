"""The one place that loads the native extension ``tp_kernels._C``, and that turns tensors into
its arguments.

Importing tp_kernels never fails for lack of it (or of a GPU): the reason it is unavailable is
kept and reported by :func:`extension_status`.

``_C`` is built for one CUDA major (``_C_build.json``, written next to it by its build, says which,
and what it was built with). It uses the CUDA runtime, ``libnccl.so.2`` and the cuBLASLt of that
major from the NVIDIA wheels a CUDA torch of that major depends on (CUDA 13:
``nvidia-cuda-runtime``, ``nvidia-nccl-cu13``, ``nvidia-cublas``; CUDA 12:
``nvidia-cuda-runtime-cu12``, ``nvidia-nccl-cu12``, ``nvidia-cublas-cu12``); tp_kernels installs
none of them. Its RPATH finds them next to an installed package (``$ORIGIN/../nvidia/...``); so
that any layout works (an editable install in a source tree, too), they are first loaded here by
path from wherever those wheels are installed. When the installed torch is built for another CUDA
major, ``_C`` is not loaded: the pure-PyTorch backends run, and the reason says which build of
tp_kernels to install.

Every tensor crosses into ``_C`` as it is, through :func:`call`, and the native side reads it
into a ``_C.TensorRef`` (pointer, shape, strides, dtype name, device) named after the function's
parameter (``arg`` in ``csrc/bindings.cpp``; :func:`tensor_ref` shows what it reads), then checks
it once (``csrc/include/tp_kernels/boundary.h``): a bad one raises ``ValueError`` naming the
argument.
The lists both sides use (dtypes, ops, all-reduce algorithms, workspace regions) and the limits
(``MAX_RANKS``, ...) are defined in C++ and read from ``_C``.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import os
from typing import Optional, Tuple

import torch

from . import settings
from .settings import BACKEND_NAMES


def _build_record(spec) -> Optional[dict]:
    """``_C_build.json`` next to the module ``spec`` found, or None (a build that wrote none)."""
    if not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "_C_build.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _torch_cuda_major() -> Optional[int]:
    """The CUDA major this torch is built for, or None for a CPU build."""
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


def _preload(libraries) -> None:
    """Load each ``(directory under site-packages, file)`` from wherever the NVIDIA wheels are."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ModuleNotFoundError, ValueError):
        spec = None
    roots = [os.path.dirname(loc) for loc in (spec.submodule_search_locations or [])] if spec else []
    for directory, name in libraries:
        for root in roots:
            path = os.path.join(root, directory, name)
            if os.path.isfile(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break


def _load():
    """``(the module or None, build record or None, why it is None)``."""
    spec = importlib.util.find_spec("tp_kernels._C")
    if spec is None:
        return None, None, ("not built: this installation of tp_kernels has no native extension; the pure-PyTorch "
                            "backends are used")
    record = _build_record(spec)
    build = record or {}
    major, torch_major = build.get("cuda_major"), _torch_cuda_major()
    if major is not None and torch_major is not None and major != torch_major:
        return None, record, (
            f"tp_kernels._C is built for CUDA {major} ({build.get('cuda')}), this torch {torch.__version__} for CUDA "
            f"{torch.version.cuda}: the pure-PyTorch backends are used. Install the CUDA {torch_major} build of "
            f"tp_kernels: TP_KERNELS_CUDA_MAJOR={torch_major} pip install --force-reinstall --no-deps <tp_kernels "
            "source> (no CUDA toolkit is needed)")
    try:
        _preload(build.get("libraries", ()))
        return importlib.import_module("tp_kernels._C"), record, None
    except (ImportError, OSError) as exc:  # built, but cannot load here (e.g. a missing library)
        wheels = build.get("wheels") or "the NVIDIA CUDA runtime, NCCL and cuBLAS wheels"
        return None, record, (
            f"tp_kernels._C (CUDA {major}) failed to load: {exc}. It uses the libraries of {wheels}, which a "
            f"CUDA {major} torch installs; with a CPU torch, install them yourself to use it")


_C, _build, _reason = _load()


def extension_status() -> dict:
    """Whether the native module is importable and a CUDA device usable, with reasons.

    Returns a dict: ``built`` (bool: the native module is importable), ``reason`` (str or None),
    ``build`` (what the installed module was built with: CUDA major and version, architectures,
    NCCL and cuBLAS versions, the wheels it uses; None without one), ``native`` (the loaded
    module's view: CUDA runtime/driver, NCCL and cuBLASLt versions, ``device_count`` and
    ``device_error``; else None), ``torch_cuda`` (the CUDA version this torch is built for, or
    None), ``cuda_available`` (torch sees a CUDA device), ``cuda_reason`` (str or None),
    ``backends`` (names usable now: ``"fused"`` needs the native module and a CUDA device).
    """
    cuda = torch.cuda.is_available()
    if cuda:
        cuda_reason = None
    elif torch.version.cuda is None:
        cuda_reason = "this torch build has no CUDA support"
    else:
        cuda_reason = "no CUDA device is visible"
    return {
        "built": _C is not None,
        "reason": _reason,
        "build": _build,
        "native": None if _C is None else _C.runtime_info(),
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "cuda_reason": cuda_reason,
        "backends": [b for b in BACKEND_NAMES if b != "fused" or (_C is not None and cuda)],
    }


def unavailable() -> Optional[str]:
    """Why the native module cannot be used here, or None when it can."""
    return None if _C is not None else f"the native extension is unavailable: {_reason}"


def require():
    """The native module; ``RuntimeError`` with the reason when it cannot be used here."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    return _C


_dtype_names: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` without ``torch.``, as the native module names dtypes."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).rpartition(".")[2]
    return name


#: ``_C.DTYPES`` as torch dtypes, for the tests on a call's path (empty without ``_C``)
NATIVE_DTYPES = frozenset(getattr(torch, name) for name in _C.DTYPES) if _C is not None else frozenset()


def unsupported_tensors_reason(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why the native module cannot take these tensors here, or None (what every native path
    needs: a CUDA device, the module, a dtype of ``_C.DTYPES``, no empty dimension). The device
    comes first: tensors off the GPU are refused for that, with the extension built or not."""
    if not x.is_cuda:
        return f"x is on {x.device.type}, not on a CUDA device"
    if _C is None:
        return unavailable()
    if x.dtype not in NATIVE_DTYPES:
        return f"dtype {x.dtype} is not supported natively ({', '.join(_C.DTYPES)})"
    if x.numel() == 0 or weight.numel() == 0:
        return f"an empty dimension (x {tuple(x.shape)}, weight {tuple(weight.shape)})"
    return None


def unsupported_collective_reason(reduces: bool, x: torch.Tensor) -> Optional[str]:
    """Why the native module cannot take this collective's input here, or None: a CUDA device, the
    module and, for a collective that sums (``reduces``), a dtype of ``_C.DTYPES`` (the others
    move any dtype, as bytes)."""
    if not x.is_cuda:
        return f"x is on {x.device.type}, not on a CUDA device"
    if _C is None:
        return unavailable()
    if reduces and x.dtype not in NATIVE_DTYPES:
        return f"dtype {x.dtype} is not summed natively ({', '.join(_C.DTYPES)})"
    return None


def tensor_ref(name: str, t: torch.Tensor):
    """``t`` as the native module reads a tensor argument called ``name`` (``_C.tensor_ref``: its
    data pointer, shape, strides, dtype and CUDA device, -1 for host memory); ``ValueError``
    naming ``name`` when ``t`` is no tensor. Native functions take the tensors themselves
    (:func:`call`); this is for a TensorRef kept across calls."""
    return _C.tensor_ref(name, t)


#: A CUDA stream as the native functions take it: (device index, its ``cudaStream_t`` as an int).
StreamRef = Tuple[int, int]

# torch's raw handle of a device's current stream: about 0.2 µs, where torch.cuda.current_stream
# makes a Stream object (several µs). Not in a torch without CUDA, where no CUDA tensor arrives.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: int) -> StreamRef:
    """The current stream of CUDA device ``device`` (an index)."""
    return device, _current_raw_stream(device)


def stream_ref(stream: "torch.cuda.Stream") -> StreamRef:
    """``stream`` as the native functions take it."""
    return stream.device_index, stream.cuda_stream


#: cuBLASLt workspace per stream; cuBLAS recommends 32 MiB on Hopper.
WORKSPACE_BYTES = 32 * 2**20
#: StreamRef -> (workspace, its TensorRef): made once, as the workspace never moves
_workspaces: dict = {}


def _workspace_ref(stream: StreamRef):
    """The TensorRef of ``stream``'s cuBLASLt workspace, made on its first use under that stream
    (the caching allocator ties a block to the stream it is made on)."""
    entry = _workspaces.get(stream)
    if entry is None:
        device, handle = stream
        current = torch.cuda.current_stream(device)
        owner = current if current.cuda_stream == handle else torch.cuda.ExternalStream(handle, device=device)
        with torch.cuda.stream(owner):
            ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device))
        entry = _workspaces[stream] = (ws, tensor_ref("workspace", ws))
    return entry[1]


#: The GEMM tuning the extension has now: (proposals, timeout) as last passed to
#: ``_C.set_gemm_tuning`` (its own default: off).
_tuning_set: tuple = (settings.GEMM_TUNING_DEFAULT, None)


def _apply_gemm_tuning() -> None:
    """Pass :func:`tp_kernels.settings.gemm_tuning` (and, with it on, the timeout, which bounds
    its waits) to the extension where it changed since the last call that multiplies: the plans
    made from then on follow it."""
    global _tuning_set
    candidates = settings.gemm_tuning()
    if candidates == 0 == _tuning_set[0]:
        return
    wanted = (candidates, settings.get_timeout() if candidates else None)
    if wanted != _tuning_set:
        require().set_gemm_tuning(candidates=candidates, iters=settings.GEMM_TUNING_ITERS,
                                  timeout_s=wanted[1] or settings.DEFAULT_TIMEOUT_S)
        _tuning_set = wanted


def call(fn, *context, stream: Optional[StreamRef], gemm: bool = True, side: Optional[StreamRef] = None,
         **args):
    """``fn(*context, **args)`` for a native function ``fn`` of ``_C``, enqueued on ``stream``; what
    ``fn`` returns.

    The tensors in ``args`` go as they are (a list of tensors too; None stays None): the native
    side reads each into the TensorRef of the argument named by its keyword, and makes the device
    of the group or the input current for the call (``csrc/include/tp_kernels/device_guard.h``),
    so the caller need not. Then ``workspace`` (``stream``'s cuBLASLt workspace, for functions
    that multiply: ``gemm``) and ``stream``. ``stream`` is None for tensors not on a CUDA device:
    ``fn``'s checks then reject them before anything runs. ``side``: a second stream the
    pipelined primitives' GEMMs alternate with (passed as ``side_stream``, with its own workspace,
    ``side_workspace``). For those, the GEMM tuning set (:func:`_apply_gemm_tuning`) first.
    """
    if gemm:
        _apply_gemm_tuning()
        args["workspace"] = torch.empty(0, dtype=torch.uint8) if stream is None else _workspace_ref(stream)
    if side is not None:
        args["side_stream"], args["side_workspace"] = side[1], _workspace_ref(side)
    return fn(*context, **args, stream=0 if stream is None else stream[1])


def has_workspace(stream: StreamRef) -> bool:
    """Whether ``stream``'s cuBLASLt workspace is made (a CUDA graph capture cannot make it)."""
    return stream in _workspaces


def gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[n, k]`` as the native GEMMs take it: as it is when it is row-major or
    column-major (a transposed view, as backward passes use; rows or columns may be apart), else a
    row-major copy (``contiguous`` keeps an empty one as it is: its strides are any, and the native
    side takes them). The layouts are those ``weight_layout`` in ``csrc/boundary.cpp`` takes (it
    checks the weight it gets); python_tests/test_native.py holds the two to the same layouts."""
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        (n, k), (s0, s1) = weight.shape, weight.stride()
        if not (((k <= 1 or s1 == 1) and (n <= 1 or (s0 >= k and s0 > 0)))  # row-major
                or ((n <= 1 or s0 == 1) and (k <= 1 or (s1 >= n and s1 > 0)))):  # column-major
            return weight.contiguous()
    return weight


def _gemm_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[m, k]`` or ``[batch, m, k]`` as it is when the native GEMM takes its layout (a
    contiguous last dim; rows, and the batch's matrices, that may be apart but do not overlap:
    ``row_stride`` and ``linear_args`` in ``csrc/boundary.cpp``), else a contiguous copy (an empty
    x as it is: its strides are any); other tensors as they are (the native side checks them)."""
    if isinstance(x, torch.Tensor) and 2 <= x.dim() <= 3:
        shape, strides = x.shape, x.stride()
        m, k, s0, s1 = shape[-2], shape[-1], strides[-2], strides[-1]
        if (k > 1 and s1 != 1) or (m > 1 and (s0 < k or s0 < 1)):
            return x.contiguous()
        if len(shape) == 3 and shape[0] > 1 and strides[0] < m * (s0 if m > 1 else max(1, k)):
            return x.contiguous()
    return x


def _stream(t: torch.Tensor) -> Optional[StreamRef]:
    return current_stream(t.get_device()) if isinstance(t, torch.Tensor) and t.is_cuda else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Y = X Wᵀ + b`` through the native cuBLASLt GEMM, on the current stream of x's device (no
    autograd).

    Args:
        x: ``[m, k]`` CUDA tensor, float32/float16/bfloat16, or ``[batch, m, k]``: ``batch``
            products with the one weight (no bias). Used as it is when its last dim is contiguous
            and its rows (and matrices) do not overlap, though they may be apart; otherwise a
            contiguous copy is made.
        weight: ``[n, k]``, same dtype and device, row- or column-major (a transposed view is
            used as it is; another layout is copied); bias: ``[n]`` or None.
        out: ``[m, n]`` (``[batch, m, n]``), same dtype and device, last dim contiguous (e.g. rows
            of a larger buffer), written in place; None for a new tensor.
    Returns:
        ``[m, n]`` (``out`` when given), accumulated in float32.
    Raises:
        ValueError naming the argument (checked by the native module) for anything else.
    """
    C = require()
    x, weight = _gemm_input(x), gemm_weight(weight)
    bias = bias.contiguous() if isinstance(bias, torch.Tensor) else bias
    y = out if out is not None else x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],))
    call(C.linear, x=x, weight=weight, bias=bias, out=y, stream=_stream(x))  # host tensors: rejected there
    if x.shape[-1] == 0:  # an empty sum: the bias alone (the GEMM wrote nothing)
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    return y


def reduce_partials(inputs, out: torch.Tensor) -> torch.Tensor:
    """``out = inputs[0] + ... + inputs[p-1]``, in that order with fp32 accumulation, on the
    current stream (the fused path's deterministic reduction); returns ``out``."""
    C = require()
    call(C.reduce_partials, inputs=list(inputs), out=out, stream=_stream(out), gemm=False)
    return out
