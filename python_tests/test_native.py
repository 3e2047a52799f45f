"""The native pipelined backend's CPU-checkable parts: routing, argument checks, the
communicator's validation, and the weight layouts the native GEMM takes.

The native ops themselves need a GPU: python_tests/test_gpu.py runs them.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings as hypothesis_settings, strategies as st

import tp_kernels
from tp_kernels import _extension, ops, parallel_state, settings
from tp_kernels.backends import IMPLEMENTATIONS, Impl, pipelined_native

built = pytest.mark.skipif(_extension._C is None, reason="the native module is not built")


def test_routing_on_cpu_keeps_the_portable_backends(caplog):
    x = torch.randn(4, 8)
    with caplog.at_level(logging.DEBUG, logger="tp_kernels.dispatch"):
        assert ops.select_backend("matmul_all_reduce", "pipelined", x, 2) == "pipelined:4"
        assert ops.select_backend("matmul_all_reduce", "auto", x, 2) == "reference"
        assert ops.select_backend("matmul_all_reduce", "reference", x, 2) == "reference"
    # auto says why it did not pick the native path
    assert any("reference" in r.message and "not on a CUDA device" in r.message for r in caplog.records)


def test_routing_when_the_native_path_is_supported(monkeypatch, caplog):
    """What CUDA tensors get: pipelined -> native with several ranks, as auto (once switched on);
    with one rank every backend runs the reference (the linear layer itself)."""
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    monkeypatch.setenv("TP_KERNELS_AUTOTUNE", "0")  # the order without measuring (measuring needs a group)
    x = torch.randn(4, 8)
    for p in (2, 8):
        assert ops.select_backend("all_gather_matmul", "pipelined", x, p) == "native:1"
        assert ops.select_backend("all_gather_matmul", "pipelined", x, p, num_chunks=3) == "native:3"
        assert ops.select_backend("all_gather_matmul", "reference", x, p) == "reference"
    for backend in ("pipelined", "auto", "reference"):
        assert ops.select_backend("all_gather_matmul", backend, x, 1, num_chunks=3) == "reference"
    assert ops.select_backend("all_gather_matmul", "auto", x, 2) == "native:1"
    with caplog.at_level(logging.DEBUG, logger="tp_kernels.dispatch"):
        assert ops.select_backend("all_gather_matmul", "auto", x, 1) == "reference"
    assert any("one rank" in r.message for r in caplog.records)


def test_auto_does_not_pick_the_native_path_until_enabled(monkeypatch, caplog):
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.delenv("TP_KERNELS_AUTO_NATIVE", raising=False)
    monkeypatch.setenv("TP_KERNELS_AUTOTUNE", "0")
    x = torch.randn(4, 8)
    assert settings.auto_native() is settings.AUTO_NATIVE_DEFAULT
    monkeypatch.setattr(settings, "AUTO_NATIVE_DEFAULT", False)
    with caplog.at_level(logging.DEBUG, logger="tp_kernels.dispatch"):
        assert ops.select_backend("matmul_all_reduce", "auto", x, 2) == "reference"
    assert any("TP_KERNELS_AUTO_NATIVE=1" in r.message for r in caplog.records)
    assert ops.select_backend("matmul_all_reduce", "pipelined", x, 2) == "native:4"  # asked for: used
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    assert ops.select_backend("matmul_all_reduce", "auto", x, 2) == "native:4"
    monkeypatch.setattr(settings, "AUTO_NATIVE_DEFAULT", True)
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "0")
    assert ops.select_backend("matmul_all_reduce", "auto", x, 2) == "reference"
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "yes")
    with pytest.raises(ValueError, match="TP_KERNELS_AUTO_NATIVE"):
        ops.select_backend("matmul_all_reduce", "auto", x, 2)


def test_routing_falls_back_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(pipelined_native, "unsupported_reason",
                        lambda x, w, g: "dtype torch.float64 is not supported natively")
    x = torch.randn(4, 8)
    with caplog.at_level(logging.DEBUG, logger="tp_kernels.dispatch"):
        assert ops.select_backend("matmul_reduce_scatter", "auto", x, 4) == "reference"
    assert any("float64 is not supported natively" in r.message for r in caplog.records)


def test_unsupported_reasons_on_this_machine(monkeypatch):
    """Host tensors are refused for their device, with the extension or without it (the reason
    that holds on every install); a CUDA tensor without the extension, for the extension."""
    w = torch.randn(3, 8)
    cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda", 0), shape=(4, 8),
                           numel=lambda: 32)
    for reason in (_extension._reason, "not built: test"):
        monkeypatch.setattr(_extension, "_reason", reason)
        if reason == "not built: test":
            monkeypatch.setattr(_extension, "_C", None)
        assert pipelined_native.unsupported_reason(torch.randn(4, 8), w, None) == "x is on cpu, not on a CUDA device"
        assert (pipelined_native.unsupported_collective_reason("all_gather", torch.randn(4, 8), None)
                == "x is on cpu, not on a CUDA device")
    assert pipelined_native.unsupported_reason(cuda, w, None) == "the native extension is unavailable: not built: test"
    assert (pipelined_native.unsupported_collective_reason("all_reduce", cuda, None)
            == "the native extension is unavailable: not built: test")


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_native_implementation_refuses_host_tensors(op):
    """Called directly (as torch.ops.tp_kernels.* with impl "native:2"), it raises, naming why:
    the native module checks its arguments (or is missing)."""
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises((ValueError, RuntimeError), match="x: expected a CUDA tensor|native extension is unavailable"):
        getattr(torch.ops.tp_kernels, op)(x, w, None, "", "native:2")


@pytest.mark.parametrize("name", ["native", "native:0", "native:two_shot", "reference:2", "nccl:2", "fused:", ""])
def test_implementation_names_that_name_nothing_are_refused(name):
    with pytest.raises(ValueError, match="impl: expected"):
        getattr(torch.ops.tp_kernels, "matmul_all_reduce")(torch.randn(4, 8), torch.randn(6, 8), None, "", name)


def test_implementation_names(monkeypatch):
    """Names parse to what they name; a fused all-reduce algorithm is one of the native module's
    list, and without the module a name of one is refused with the install's reason (a ValueError
    naming ``impl``, as for any name that names nothing here)."""
    from tp_kernels.backends import parse

    assert parse("reference") == Impl("reference")
    assert parse("native:4") == Impl("native", num_chunks=4) and parse("native:4").name == "native:4"
    assert parse("pipelined:1").module is IMPLEMENTATIONS["pipelined"]
    assert parse("fused:2") == Impl("fused", num_chunks=2)
    if _extension._C is not None:
        assert parse("fused:two_shot") == Impl("fused", algorithm="two_shot")
        assert parse("fused:two_shot").name == "fused:two_shot"
        with pytest.raises(ValueError, match="impl: expected .* got 'fused:three_shot'"):
            parse("fused:three_shot")
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "_reason", "not built: test")
    with pytest.raises(ValueError, match="impl: 'fused:one_shot' names an all-reduce algorithm of the fused path: "
                                         "the native extension is unavailable: not built: test"):
        parse.__wrapped__("fused:one_shot")  # (past parse's cache of names parsed with the module)


def test_backward_names():
    """The all-gather's and reduce-scatter's backward (the other primitive) runs on the forward's
    backend in that primitive's own default chunks; the reference, and a named algorithm, as they are."""
    from tp_kernels.backends import backward_name

    assert backward_name("native:4", "all_gather_matmul") == "native:1"  # a reduce-scatter's backward
    assert backward_name("native:1", "matmul_reduce_scatter") == "native:4"  # an all-gather's
    assert backward_name("pipelined:2", "matmul_reduce_scatter") == "pipelined:4"
    assert backward_name("fused:4", "all_gather_matmul") == "fused:1"
    assert backward_name("reference", "all_gather_matmul") == "reference"
    if _extension._C is not None:  # (the fused algorithms are the extension's)
        assert backward_name("fused:two_shot", "matmul_reduce_scatter") == "fused:two_shot"


def test_every_implementation_has_the_three_primitives():
    for name, impl in IMPLEMENTATIONS.items():
        for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
            assert callable(getattr(impl, op)), (name, op)
    assert "native" not in ops.BACKEND_NAMES  # an implementation, not a name users pass


@built
def test_weight_layouts():
    """What the Python side passes as it is (row- or column-major, padded rows), and what it copies;
    the native side reads the layout of what it gets (python_tests/test_boundary.py)."""
    def layout(w):
        x = torch.empty(3, w.shape[1])
        refs = {name: _extension._C.TensorRef(name, t.data_ptr(), list(t.shape), list(t.stride()), "float32", 0)
                for name, t in (("x", x), ("weight", w), ("out", torch.empty(3, w.shape[0])),
                                ("workspace", torch.empty(0, dtype=torch.uint8)))}
        refs["workspace"] = _extension._C.TensorRef("workspace", 0, [0], [1], "uint8", 0)
        got = _extension._C.linear_problem(bias=None, **refs)
        return got["ldw"], got["w_col_major"]

    w = torch.randn(6, 8)
    assert layout(w) == (8, False) and _extension.gemm_weight(w) is w
    wt = torch.randn(8, 6).t()  # [6, 8] stored column-major, as backward's W^T
    assert layout(wt) == (6, True) and _extension.gemm_weight(wt) is wt  # columns of n = 6
    wide = torch.randn(6, 11)[:, :8]  # row-major with a padded row
    assert layout(wide) == (11, False) and _extension.gemm_weight(wide) is wide
    strided = torch.randn(12, 16)[::2, ::2]  # neither: copied to row-major
    copy = _extension.gemm_weight(strided)
    assert copy.is_contiguous() and torch.equal(copy, strided) and layout(copy) == (8, False)
    with pytest.raises(ValueError, match="weight: expected a row-major or column-major weight"):
        layout(strided)


def _native_layout_error(x, weight, bias=None):
    """What the native GEMM's checks say of ``x``, ``weight`` and ``bias`` as they are
    (``_C.linear_problem``, the tensors named as on device 0), or None when they take them."""
    refs = {name: _extension._C.TensorRef(name, t.data_ptr(), list(t.shape), list(t.stride()), "float32", 0)
            for name, t in (("x", x), ("weight", weight), ("out", torch.empty(*x.shape[:-1], weight.shape[0])),
                            ("bias", bias)) if t is not None}
    refs["workspace"] = _extension._C.TensorRef("workspace", 0, [0], [1], "uint8", 0)
    try:
        _extension._C.linear_problem(**{"bias": None, **refs})
    except ValueError as exc:
        return str(exc)
    return None


def _strided(shape, strides):
    """A float32 tensor of ``shape`` with these ``strides`` (any: rows apart, transposed,
    overlapping, broadcast), over distinct values."""
    size = 1 + sum(max(n - 1, 0) * s for n, s in zip(shape, strides))
    return torch.arange(size, dtype=torch.float32).as_strided(shape, strides)


@built
@hypothesis_settings(max_examples=1000, deadline=None)
@given(x_shape=st.lists(st.integers(0, 3), min_size=2, max_size=3), x_strides=st.lists(st.integers(0, 7), min_size=3,
       max_size=3), n=st.integers(0, 3), w_strides=st.lists(st.integers(0, 7), min_size=2, max_size=2),
       b_stride=st.integers(0, 2))
@example(x_shape=[2, 1, 3], x_strides=[1, 0, 1], n=2, w_strides=[3, 1], b_stride=1)  # one-row matrices that overlap
@example(x_shape=[0, 2], x_strides=[0, 0, 0], n=0, w_strides=[0, 0], b_stride=0)  # empty, and strides of nothing
def test_the_python_side_passes_what_the_native_gemm_takes(x_shape, x_strides, n, w_strides, b_stride):
    """Whatever the layout of x (``[m, k]`` or ``[batch, m, k]``, dims empty too) and of the weight,
    what the Python side passes (``_gemm_input``, ``gemm_weight``) has the same values and is taken
    by the native GEMM's checks; and it is the tensor itself whenever those checks take that as it
    is: a copy only where one is needed. An empty tensor's strides are any (torch calls it
    contiguous whatever they are): the native checks take it, and it is passed as it is. A bias
    (of one product: a batch takes none) is passed contiguous."""
    x = _strided(x_shape, x_strides[:len(x_shape)])
    weight = _strided([n, x_shape[-1]], w_strides)
    bias = _strided([n], [b_stride])
    if len(x_shape) == 2:
        assert _native_layout_error(_extension._gemm_input(x), _extension.gemm_weight(weight),
                                    bias.contiguous()) is None
    passed_x, passed_w = _extension._gemm_input(x), _extension.gemm_weight(weight)
    assert torch.equal(passed_x, x) and torch.equal(passed_w, weight)
    assert _native_layout_error(passed_x, passed_w) is None
    assert (passed_x is x) == (_native_layout_error(x, passed_w) is None), (x.shape, x.stride())
    assert (passed_w is weight) == (_native_layout_error(passed_x, weight) is None), (weight.shape, weight.stride())
    assert (passed_x is x) >= (x.numel() == 0) and (passed_w is weight) >= (weight.numel() == 0)


def test_comm_stream_priority(monkeypatch):
    monkeypatch.setattr(settings, "_priority", None)
    monkeypatch.delenv("TP_KERNELS_COMM_STREAM_PRIORITY", raising=False)
    assert settings.get_comm_stream_priority() < -1000  # the highest the device has
    monkeypatch.setenv("TP_KERNELS_COMM_STREAM_PRIORITY", "0")
    assert settings.get_comm_stream_priority() == 0
    monkeypatch.setenv("TP_KERNELS_COMM_STREAM_PRIORITY", "high")
    with pytest.raises(ValueError, match="TP_KERNELS_COMM_STREAM_PRIORITY"):
        settings.get_comm_stream_priority()
    tp_kernels.set_comm_stream_priority(-1)
    assert settings.get_comm_stream_priority() == -1
    for bad in (1.5, True, "0"):
        with pytest.raises(ValueError, match=f"priority: expected an int, got {bad!r}"):
            tp_kernels.set_comm_stream_priority(bad)
    assert settings.get_comm_stream_priority() == -1


def test_a_groups_communicator_is_made_in_the_nccl_mode_set_then(monkeypatch):
    """The native path's communicator of a group is made in NCCL's blocking mode where
    settings.nccl_blocking says so when it is made, and kept per mode: a call after the mode
    changed gets (or makes) the communicator of that mode, not the other's. (The NCCL here has no
    ncclCommRevoke: its default is the nonblocking mode.)"""
    made = []

    class FakeC:
        NCCL_UNIQUE_ID_BYTES = 128

        @staticmethod
        def nccl_unique_id():
            return bytes(128)

        @staticmethod
        def nccl_can_revoke():
            return False

        class Communicator:
            def __init__(self, uid, rank, size, device, priority, timeout_s, blocking):
                self.timeout_s, self.blocking = timeout_s, blocking
                made.append(blocking)

    class Group:  # a group of 2 as the registry sees it
        group_name = "g"

        def size(self):
            return 2

        def rank(self):
            return 0

    monkeypatch.setattr(_extension, "require", lambda: FakeC)
    monkeypatch.setattr(pipelined_native.coll, "host_route", lambda group, device: (group, device))
    monkeypatch.setattr(pipelined_native.coll, "all_gather_bytes", lambda uid, group, device: [uid, uid])
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(pipelined_native, "_communicators", {})
    pipelined_native._nccl_can_revoke.cache_clear()
    try:
        group, device = Group(), torch.device("cuda", 0)
        nonblocking = pipelined_native.communicator(group, device)
        assert nonblocking.blocking is False and pipelined_native.communicator(group, device) is nonblocking
        with settings.overriding(nccl_blocking=True):
            blocking = pipelined_native.communicator(group, device)
            assert blocking.blocking is True and pipelined_native.communicator(group, device) is blocking
        assert pipelined_native.communicator(group, device) is nonblocking and made == [False, True]
    finally:
        pipelined_native._nccl_can_revoke.cache_clear()


class _Comm:
    """A communicator as the native path's Python reads it: its device and second GEMM stream."""
    device, gemm_stream, timeout_s = 0, 22, 300.0


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_the_gemms_second_stream_reaches_the_primitive_where_two_are_set(monkeypatch, op):
    """With settings.gemm_streams 2 each native op passes its communicator's second GEMM stream as
    ``side`` (the primitive's side_stream, with a workspace of its own: _extension.call); with 1,
    none."""
    calls = []
    monkeypatch.setattr(pipelined_native, "communicator", lambda group, device: _Comm())
    monkeypatch.setattr(pipelined_native.coll, "group_size", lambda group: 2)
    monkeypatch.setattr(pipelined_native.coll, "group_rank", lambda group: 0)
    monkeypatch.setattr(_extension, "require", lambda: type("C", (), {op: staticmethod(lambda: None)}))
    monkeypatch.setattr(_extension, "current_stream", lambda device: (0, 11))
    monkeypatch.setattr(_extension, "call", lambda fn, comm, **kw: calls.append(kw))
    x, w = torch.randn(8, 6), torch.randn(4, 6)
    for count, side in ((1, None), (2, (0, 22))):
        with settings.overriding(gemm_streams=count):
            getattr(pipelined_native, op)(x, w, None, None, Impl("native", 4))
        assert calls[-1]["side"] == side and calls[-1]["stream"] == (0, 11)


def test_call_passes_the_side_streams_own_workspace(monkeypatch):
    """_extension.call with ``side``: ``side_stream`` (the handle) and ``side_workspace`` (that
    stream's workspace, not the call's stream's) beside ``workspace`` and ``stream``."""
    monkeypatch.setattr(_extension, "_workspaces", {(0, 11): (None, "main ws"), (0, 22): (None, "side ws")})
    got = []
    _extension.call(lambda *context, **args: got.append((context, args)), "comm", stream=(0, 11), side=(0, 22), x=1)
    assert got == [(("comm",), {"x": 1, "workspace": "main ws", "side_stream": 22, "side_workspace": "side ws",
                               "stream": 11})]
    _extension.call(lambda *context, **args: got.append(args), stream=(0, 11), x=1)
    assert "side_stream" not in got[-1] and "side_workspace" not in got[-1]
    assert _extension.has_workspace((0, 22)) and not _extension.has_workspace((0, 33))


def test_a_call_that_multiplies_passes_the_gemm_tuning_set_then(monkeypatch):
    """_extension.call hands settings.gemm_tuning (with the timeout that bounds its waits, and
    GEMM_TUNING_ITERS) to the extension before a function that multiplies, once per change; none
    while tuning stays off, nor for a function that does not multiply."""
    told = []
    monkeypatch.setattr(_extension, "require", lambda: SimpleNamespace(
        set_gemm_tuning=lambda **kw: told.append(kw)))
    monkeypatch.setattr(_extension, "_tuning_set", (0, None))
    monkeypatch.setattr(_extension, "_workspaces", {(0, 11): (None, "ws")})
    ran = []

    def fn(**args):
        ran.append(args)

    _extension.call(fn, stream=(0, 11), x=1)
    assert told == [] and len(ran) == 1  # off, as the extension starts
    with settings.overriding(gemm_tuning=8, timeout=7.5):
        _extension.call(fn, stream=None, gemm=False, x=1)
        assert told == []  # (nothing multiplies)
        _extension.call(fn, stream=(0, 11), x=1)
        _extension.call(fn, stream=(0, 11), x=1)
        assert told == [{"candidates": 8, "iters": settings.GEMM_TUNING_ITERS, "timeout_s": 7.5}]
        with settings.overriding(timeout=9.0):
            _extension.call(fn, stream=(0, 11), x=1)
        assert told[-1] == {"candidates": 8, "iters": settings.GEMM_TUNING_ITERS, "timeout_s": 9.0}
        _extension.call(fn, stream=(0, 11), x=1)
        assert told[-1]["timeout_s"] == 7.5 and len(told) == 3
    _extension.call(fn, stream=(0, 11), x=1)
    assert told[-1] == {"candidates": 0, "iters": settings.GEMM_TUNING_ITERS, "timeout_s": settings.DEFAULT_TIMEOUT_S}
    _extension.call(fn, stream=(0, 11), x=1)
    assert len(told) == 4 and [args.get("workspace") for args in ran] == ["ws", None] + ["ws"] * 6


def test_a_capture_needs_the_second_gemm_streams_workspace_made_first(monkeypatch):
    """Under a CUDA graph capture the native ops refuse (the path is not runnable, saying why) where
    two GEMM streams are asked for and the second one's workspace is not made yet, as where the
    communicator is not: its first call makes it, outside a capture. The collectives, which
    multiply nothing, do not need it."""
    group = object()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(pipelined_native.coll, "group_size", lambda group: 2)
    monkeypatch.setattr(pipelined_native.coll, "group_key", lambda group, device: (id(group), "g", 0))
    monkeypatch.setattr(pipelined_native, "_communicators", {})
    monkeypatch.setattr(_extension, "_workspaces", {})
    monkeypatch.setattr(pipelined_native, "_nccl_can_revoke", lambda: True)  # (the extension's answer)
    x = torch.randn(4, 6)
    assert "communicator is made on its first call" in pipelined_native._capture_reason(x, group, gemms=True)
    pipelined_native._communicators[pipelined_native._key(group, x.device)] = (group, _Comm())
    assert pipelined_native._capture_reason(x, group, gemms=True) is None  # one stream: nothing more to make
    with settings.overriding(gemm_streams=2):
        assert "second GEMM stream" in pipelined_native._capture_reason(x, group, gemms=True)
        assert pipelined_native._capture_reason(x, group, gemms=False) is None
        _extension._workspaces[(0, 22)] = (None, "side ws")
        assert pipelined_native._capture_reason(x, group, gemms=True) is None


def test_destroy_model_parallel_closes_the_groups_communicators(monkeypatch):
    closed = []

    class FakeComm:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)
            if self.name == "failed":
                raise RuntimeError("tp_kernels: aborted earlier")

    g1, g2 = object(), object()
    monkeypatch.setattr(pipelined_native, "_communicators", {
        (1, "a", 0): (g1, FakeComm("a")), (2, "b", 0): (g2, FakeComm("b")), (3, "c", 0): (g1, FakeComm("failed"))})
    native_teardown = pipelined_native.destroy_communicators
    assert native_teardown in parallel_state._TEARDOWNS  # what destroy_model_parallel calls per group
    native_teardown(g1)  # an aborted communicator's error is not raised again
    assert sorted(closed) == ["a", "failed"] and list(pipelined_native._communicators) == [(2, "b", 0)]
    native_teardown()
    assert closed[-1] == "b" and not pipelined_native._communicators


@built
def test_the_extension_says_whether_nccl_can_revoke_as_its_version_does():
    """``_C.nccl_can_revoke()`` (what blocking mode's default and the communicator's making read):
    whether the NCCL loaded has ``ncclCommRevoke``, new in NCCL 2.28.9."""
    C = _extension._C
    assert C.nccl_can_revoke() is (C.runtime_info()["nccl_version"] >= 22809)


@built
def test_gemm_tuning_refuses_what_is_out_of_range_before_touching_the_gpu():
    """_C.set_gemm_tuning: a ValueError naming the argument out of range, with no CUDA call (this
    runs without a GPU); the range of proposals is the one settings.set_gemm_tuning takes.
    forget_gemm_plans and gemm_plans make no CUDA call either."""
    C = _extension.require()
    top = settings.GEMM_TUNING_MAX
    for (candidates, iters, timeout_s), name in (((1, 5, 10.0), "candidates"), ((top + 1, 5, 10.0), "candidates"),
                                                 ((-1, 5, 10.0), "candidates"), ((8, 0, 10.0), "iters"),
                                                 ((8, 1001, 10.0), "iters"), ((8, 5, 0.0), "timeout_s"),
                                                 ((8, 5, float("inf")), "timeout_s"),
                                                 ((8, 5, float("nan")), "timeout_s")):
        with pytest.raises(ValueError, match=f"^{name}: GEMM tuning "):
            C.set_gemm_tuning(candidates=candidates, iters=iters, timeout_s=timeout_s)
    for candidates in (2, top, 0):  # (ends off, as _extension last told it)
        C.set_gemm_tuning(candidates=candidates, iters=settings.GEMM_TUNING_ITERS, timeout_s=10.0)
    C.forget_gemm_plans()
    assert C.gemm_plans() == []


@built
def test_nccl_unique_ids():
    a, b = _extension._C.nccl_unique_id(), _extension._C.nccl_unique_id()
    assert isinstance(a, bytes) and len(a) == len(b) == _extension._C.NCCL_UNIQUE_ID_BYTES == 128
    assert a != b


@built
def test_communicator_rejects_bad_arguments_before_touching_the_gpu():
    uid = _extension._C.nccl_unique_id()
    C = _extension._C.Communicator
    with pytest.raises(RuntimeError, match="unique_id must be 128 bytes, got 5"):
        C(b"short", 0, 2, 0, 0, 10.0)
    with pytest.raises(RuntimeError, match=r"rank 2 is not in \[0, 2\)"):
        C(uid, 2, 2, 0, 0, 10.0)
    with pytest.raises(RuntimeError, match="timeout_s must be positive"):
        C(uid, 0, 2, 0, 0, 0.0)


@built
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_communicator_without_a_gpu_is_a_clear_error():
    # the source is named relative to the project, not by the folder the extension was built in
    with pytest.raises(RuntimeError, match=r"^cudaGetDevice.*failed: CUDA error \d+ \(.+\) at csrc/[\w/]+\.(cpp|h):\d+$"):
        _extension._C.Communicator(_extension._C.nccl_unique_id(), 0, 1, 0, 0, 10.0)


@built
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_blocking_communicator_finds_nccl_revoke_before_touching_the_gpu():
    """Blocking mode needs ncclCommRevoke (NCCL 2.28.9 and later), looked up in the NCCL loaded:
    with the one built against (the runtime's), the lookup passes and the GPU's absence is the error;
    a mode the NCCL cannot bound would be refused first, naming the variable that asks for it."""
    C = _extension._C
    major, minor, patch = (int(v) for v in _extension._build["nccl"].split("."))
    if (major, minor, patch) < (2, 28, 9):
        with pytest.raises(RuntimeError, match="blocking mode needs ncclCommRevoke .* TP_KERNELS_NCCL_BLOCKING"):
            C.Communicator(C.nccl_unique_id(), 0, 1, 0, 0, 10.0, blocking=True)
    else:
        with pytest.raises(RuntimeError, match=r"^cudaGetDevice.*failed: CUDA error"):
            C.Communicator(C.nccl_unique_id(), 0, 1, 0, 0, 10.0, blocking=True)


@built
def test_device_ops_check_arguments_before_touching_the_gpu():
    C = _extension._C

    def ref(name, data, count=10, dtype="float32"):
        return C.TensorRef(name, data, [count], [1], dtype, 0)

    with pytest.raises(ValueError, match=r"inputs: p must be in \[1, 8\], got 9"):
        C.reduce_partials([ref(f"inputs[{q}]", 64) for q in range(9)], ref("out", 64), 0)
    with pytest.raises(ValueError, match="inputs\\[1\\]: expected a non-null data pointer"):
        C.reduce_partials([ref("inputs[0]", 64), ref("inputs[1]", 0)], ref("out", 64), 0)
    with pytest.raises(ValueError, match=r"inputs\[1\]: expected \[10\] \(the shape of inputs\[0\]\)"):
        C.reduce_partials([ref("inputs[0]", 64), ref("inputs[1]", 64, 9)], ref("out", 64), 0)
    with pytest.raises(ValueError, match="inputs\\[0\\]: expected dtype float32, float16, bfloat16"):
        C.reduce_partials([ref("inputs[0]", 64, dtype="uint8")], ref("out", 64, dtype="uint8"), 0)
    C.reduce_partials([ref("inputs[0]", 0, 0), ref("inputs[1]", 0, 0)], ref("out", 0, 0), 0)  # nothing to do
    with pytest.raises(ValueError, match="error code 1 must be nonzero"):
        C.wait_flags([8, 16], [3, 0], 1000, 64, 0)
    with pytest.raises(ValueError, match=r"error code 0 must be nonzero, with MISMATCH_BIT \(0x40000000\) clear"):
        C.wait_flags([8], [C.MISMATCH_BIT | 5], 1000, 64, 0)
    assert C.MISMATCH_BIT == 0x40000000
    with pytest.raises(ValueError, match="expect: one expected value per flag, or none"):
        C.wait_flags([8, 16], [3, 4], 1000, 64, 0, [7])
    with pytest.raises(ValueError, match="null flag 0"):
        C.wait_flags([0], [5], 1000, 64, 0)
    with pytest.raises(ValueError, match="null error word"):
        C.wait_flags([8], [5], 1000, 0, 0)
    with pytest.raises(ValueError, match="one error code per flag"):
        C.wait_flags([8, 16], [5], 1000, 64, 0)
    with pytest.raises(ValueError, match="takes 0 to 8 flags, got 9"):
        C.wait_flags([8] * 9, [5] * 9, 1000, 64, 0)
    C.wait_flags([], [], 1000, 64, 0)  # nothing to wait for: no device needed
    with pytest.raises(ValueError, match="values: one value per flag"):
        C.write_flags([8, 16], [1], 0)
    with pytest.raises(ValueError, match="null flag 1"):
        C.write_flags([8, 0], [1, 1], 0)
    with pytest.raises(ValueError, match="write_flags takes 0 to 8 flags, got 9"):
        C.write_flags([8] * 9, [1] * 9, 0)
    C.write_flags([], [], 0)  # nothing to write: no device needed


@built
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_driver_calls_without_a_driver_are_a_clear_error():
    C = _extension._C
    assert C.stream_memory_ops_available() is False
    with pytest.raises(RuntimeError, match="write_flag: the CUDA driver does not provide cuStreamWriteValue32"):
        C.write_flag(1, 1, 0)
    # the kernels are launched through the driver too: the same error, before any memory is touched
    with pytest.raises(RuntimeError, match="the CUDA driver does not provide"):
        C.wait_flags([8], [5], 1000, 64, 0)
    ref = [C.TensorRef(f"inputs[{q}]", 64, [10], [1], "float32", 0) for q in range(2)]
    with pytest.raises(RuntimeError, match="the CUDA driver does not provide"):
        C.reduce_partials(ref, C.TensorRef("out", 64, [10], [1], "float32", 0), 0)


@built
@pytest.mark.skipif(torch.cuda.is_available(), reason="no GEMM may have run in this process")
def test_gemm_plans_are_read_without_a_device():
    """``_C.gemm_plans`` lists the plans cuBLASLt made, reading no device: none without a GPU."""
    assert _extension._C.gemm_plans() == []


def test_the_benchmarks_keep_the_plans_of_the_problem_they_ran():
    """:func:`tp_kernels.bench.extension.cublaslt_plans`: the plans of one problem (its rows, columns,
    depth, batch, weight layout and dtype all alike), each cut to ``PLAN_FIELDS``."""
    from tp_kernels.bench.extension import PLAN_FIELDS, cublaslt_plans

    def plan(m, n=8192, k=3584, batch=1, w_col_major=False, dtype="bfloat16", waves=1.0, ldx=3584):
        return {"device": 0, "m": m, "n": n, "k": k, "batch": batch, "ldx": ldx, "ldw": k, "ldy": n, "dtype": dtype,
                "bias": False, "w_col_major": w_col_major, "workspace_bytes": 1 << 25, "algo_id": 66,
                "tile_id": 23, "stages_id": 0, "splitk": 1, "reduction_scheme": 0, "swizzle": 0, "custom_option": 0,
                "inner_shape_id": 0, "cluster_shape_id": 3, "waves": waves, "workspace_needed": 0,
                "tuning_timed": 0, "tuning_first_ms": -1.0, "tuning_chosen_ms": -1.0, "tuning_note": ""}

    plans = [plan(2048, waves=1.7), plan(2048, waves=1.7, ldx=4096), plan(8192, waves=6.8), plan(2048, batch=8),
             plan(2048, w_col_major=True), plan(2048, dtype="float16"), plan(2048, n=4096), plan(2048, k=1024)]
    got = cublaslt_plans(2048, 8192, 3584, plans=plans)
    assert got == [{f: plans[0][f] for f in PLAN_FIELDS}] * 2  # the two leading dims' plans, nothing else
    assert list(got[0]) == list(PLAN_FIELDS) and got[0]["waves"] == 1.7
    assert cublaslt_plans(8192, 8192, 3584, plans=plans)[0]["waves"] == 6.8
    assert [q["batch"] for q in cublaslt_plans(2048, 8192, 3584, batch=8, plans=plans)] == [8]
    assert len(cublaslt_plans(2048, 8192, 3584, w_col_major=True, plans=plans)) == 1
    assert cublaslt_plans(2048, 8192, 3584, dtype="float32", plans=plans) == []


def test_the_benchmarks_time_cublaslts_proposals_against_its_first(monkeypatch):
    """:func:`tp_kernels.bench.extension.gemm_candidates`: ``_C.gemm_candidates``'s proposals, each
    with its algorithm's fields and time, and the first's time over the fastest that ran (one that
    cuBLASLt would not run, -1, passed over; None when the first did not run)."""
    from tp_kernels.bench import extension

    def algo(waves, ms, tile_id=23):
        return {"algo_id": 66, "tile_id": tile_id, "stages_id": 0, "splitk": 1, "reduction_scheme": 0, "swizzle": 0,
                "custom_option": 0, "inner_shape_id": 0, "cluster_shape_id": 3, "waves": waves,
                "workspace_needed": 0, "ms": ms}

    seen = {}

    def fake_call(fn, *context, stream, **args):
        seen.update(args, stream=stream)
        return fn()

    found = [algo(1.7, 0.30), algo(3.4, -1.0, 20), algo(0.85, 0.25, 24)]
    monkeypatch.setattr(extension._extension, "require", lambda: type("C", (), {"gemm_candidates": lambda: found}))
    monkeypatch.setattr(extension._extension, "call", fake_call)
    monkeypatch.setattr(extension._extension, "current_stream", lambda device: (device, 1234))
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    got = extension.gemm_candidates(x, w, y, iters=5)
    assert seen["count"] == extension.CANDIDATES and seen["iters"] == 5 and seen["x"] is x and seen["stream"][1] == 1234
    assert seen["timeout_s"] == settings.get_timeout()
    assert [c["tile_id"] for c in got["candidates"]] == [23, 20, 24]
    assert list(got["candidates"][0]) == ["waves", *extension.ALGO_FIELDS, "ms"]  # (the algorithm named whole)
    assert got["first_over_fastest"] == pytest.approx(0.30 / 0.25)
    found[:] = [algo(1.7, -1.0), algo(0.85, 0.25)]
    assert extension.gemm_candidates(x, w, y, iters=5)["first_over_fastest"] is None
    found[:] = [algo(1.7, 0.3)]
    assert extension.gemm_candidates(x, w, y, iters=5, count=1)["first_over_fastest"] == 1.0


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_native_implementation_without_the_extension_names_the_reason(monkeypatch, op):
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "_reason", "not built: test")
    with pytest.raises(RuntimeError, match="the native extension is unavailable: not built: test"):
        getattr(pipelined_native, op)(torch.randn(4, 8), torch.randn(6, 8), None, None, Impl("native", 2))


def test_the_native_communicators_are_blocking_by_default_where_nccl_can_revoke(monkeypatch):
    """``pipelined_native.blocking_mode``: as ``set_nccl_blocking`` says where it is set; by default
    NCCL's blocking mode where the NCCL loaded has ``ncclCommRevoke`` (2.28.9 and later: what
    bounds a blocked call), else the nonblocking one; the extension asked once."""
    from tp_kernels.backends import pipelined_native

    reads = []

    def native(can_revoke):
        def nccl_can_revoke():
            reads.append(can_revoke)
            return can_revoke
        return type("C", (), {"nccl_can_revoke": staticmethod(nccl_can_revoke)})

    try:
        for blocking in (True, False):
            monkeypatch.setattr(pipelined_native._extension, "require", lambda b=blocking: native(b))
            pipelined_native._nccl_can_revoke.cache_clear()
            assert pipelined_native.blocking_mode() is blocking and pipelined_native.blocking_mode() is blocking
            for chosen in (True, False):
                with settings.overriding(nccl_blocking=chosen):
                    assert pipelined_native.blocking_mode() is chosen
            monkeypatch.setenv("TP_KERNELS_NCCL_BLOCKING", "0" if blocking else "1")
            assert pipelined_native.blocking_mode() is not blocking
            monkeypatch.delenv("TP_KERNELS_NCCL_BLOCKING")
        assert reads == [True, False]  # (once each: the answer cached)
    finally:
        pipelined_native._nccl_can_revoke.cache_clear()
