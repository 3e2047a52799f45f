"""``backend="auto"``'s measured choice (tp_kernels.autotune): its candidates, the measurement
on the first call of a shape class and its reuse, the ranks' agreement, and when it does not
measure. On the CPU the candidates that can be measured are the reference and the portable
pipelined schedule (named through set_auto_candidates); the fused and native ones need a GPU.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch

import test_ops
from helpers import assert_close, rank_world
from tp_kernels import _collectives, _extension, autotune, dispatch, ops, parallel_state, settings
from tp_kernels.backends import fused, parse, pipelined_native
from tp_kernels.schedule import DEFAULT_NUM_CHUNKS

built = pytest.mark.skipif(_extension._C is None, reason="the native module is not built")


def stand_in_group(name="g", p=2):
    """What dispatch and autotune read of a process group (its name and size), for decisions made
    without one."""
    return SimpleNamespace(group_name=name, size=lambda: p)


OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "linear_with_grad_all_reduce")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("TP_KERNELS_AUTO_CANDIDATES", "TP_KERNELS_AUTOTUNE", "TP_KERNELS_AUTO_FUSED",
                 "TP_KERNELS_AUTO_NATIVE", "TP_KERNELS_FUSED_ALL_REDUCE"):
        monkeypatch.delenv(name, raising=False)
    yield
    autotune.set_auto_candidates(None)
    autotune.set_autotune(None)
    autotune.forget()


def test_candidates_on_the_cpu(monkeypatch):
    x = torch.randn(4, 8)
    impls, why = dispatch.candidates(x, x, None, 2)
    assert impls == ["reference"]
    # host tensors are the reason, with the native module loaded or not
    for name in ("fused", "pipelined"):
        assert f"{name}: x is on cpu, not on a CUDA device" in why, why
    assert dispatch.candidates(x, x, None, 1) == (["reference"], ["one rank, nothing to overlap"])
    # the native path switched on for auto but unable to run here: the portable schedule does not
    # stand in for it unless named (it measured slower than the reference on the CPU)
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    impls, why = dispatch.candidates(x, x, None, 2)
    assert impls == ["reference"] and "pipelined: x is on cpu, not on a CUDA device" in why, why
    monkeypatch.delenv("TP_KERNELS_AUTO_NATIVE")
    autotune.set_auto_candidates(["reference", "pipelined"])  # the order named does not matter
    assert dispatch.candidates(x, x, None, 2)[0] == ["pipelined", "reference"]
    autotune.set_auto_candidates(["pipelined"])
    assert dispatch.candidates(x, x, None, 2)[0] == ["pipelined"]
    autotune.set_auto_candidates(["fused"])  # cannot run here: the reference does
    impls, why = dispatch.candidates(x, x, None, 2)
    assert impls == ["reference"] and any("fused: " in w and ("CUDA" in w or "extension" in w) for w in why)
    autotune.set_auto_candidates(None)
    monkeypatch.setenv("TP_KERNELS_AUTO_CANDIDATES", "reference, pipelined")
    assert autotune.get_auto_candidates() == ("reference", "pipelined")
    assert dispatch.candidates(x, x, None, 2)[0] == ["pipelined", "reference"]


def test_candidates_when_the_fast_paths_are_supported(monkeypatch):
    """Named fast paths are candidates without their TP_KERNELS_AUTO_* switch; by default they
    need it; "pipelined" is the native path when it is supported."""
    x = torch.randn(4, 8)
    monkeypatch.setattr(fused, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.setattr(settings, "AUTO_FUSED_DEFAULT", False)
    monkeypatch.setattr(settings, "AUTO_NATIVE_DEFAULT", False)
    impls, why = dispatch.candidates(x, x, None, 2)
    assert impls == ["reference"] and why[0].startswith("fused: not switched on for 'auto' (TP_KERNELS_AUTO_FUSED=1")
    assert why[1] == f"pipelined: {settings.AUTO_NATIVE_OFF}"
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    assert dispatch.candidates(x, x, None, 2)[0] == ["native", "reference"]
    monkeypatch.setenv("TP_KERNELS_AUTO_FUSED", "1")
    assert dispatch.candidates(x, x, None, 2)[0] == ["fused", "native", "reference"]
    monkeypatch.delenv("TP_KERNELS_AUTO_NATIVE")
    monkeypatch.delenv("TP_KERNELS_AUTO_FUSED")
    autotune.set_auto_candidates(["fused", "pipelined"])
    assert dispatch.candidates(x, x, None, 2)[0] == ["fused", "native"]


def test_the_fused_path_is_no_candidate_where_the_native_one_cannot_run(monkeypatch):
    """The fused path needs what the native one needs (the extension, CUDA tensors): where the
    native path cannot run a call, the fused one is left out with the native one's reason, its own
    check (whose first call of a group is collective) not asked."""
    x = torch.randn(4, 8)
    asked = []
    monkeypatch.setattr(fused, "unsupported_reason", lambda *args: asked.append(args))  # (None: it could run)
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda x, w, g: "no native path here")
    monkeypatch.setenv("TP_KERNELS_AUTO_FUSED", "1")
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    impls, why = dispatch.candidates(x, x, None, 2)
    assert impls == ["reference"] and why == ["fused: no native path here", "pipelined: no native path here"]
    assert asked == []


def test_a_lone_candidate_runs_unmeasured(monkeypatch):
    """Where ``"auto"`` has one candidate, it runs that one's first variant (the schedule's default
    chunks) unmeasured: the measurement chooses among candidates."""
    x, w = torch.randn(8, 16), torch.randn(8, 16)
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda *args: None)
    monkeypatch.setattr(autotune, "choose", lambda op, variants, *args: pytest.fail(f"measured {variants}"))
    autotune.set_auto_candidates(["pipelined"])
    assert dispatch.resolve("matmul_all_reduce", "auto", x, 2, stand_in_group(), w) == "native:4"


@built
def test_a_measured_fused_algorithm_runs_only_where_it_can(monkeypatch):
    """The fused all-reduce algorithm measured for a size class runs a call of that class only
    where it can all-reduce the call's rows: scatter-gather needs a row a rank, and a call of fewer
    runs two-shot."""
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda *args: None)
    monkeypatch.setattr(fused, "unsupported_reason", lambda *args: None)
    monkeypatch.setattr(autotune, "choose", lambda op, variants, *args: "fused:scatter_gather")
    autotune.set_auto_candidates(["fused", "reference"])
    w = torch.randn(8, 16)
    for rows, want in ((1, "fused:two_shot"), (2, "fused:scatter_gather")):
        assert dispatch.resolve("matmul_all_reduce", "auto", torch.randn(rows, 16), 2, stand_in_group(), w) == want


@built
def test_the_capture_paths_of_a_fused_backend_that_cannot_run_are_an_error(monkeypatch):
    """``capture_paths`` of a named ``"fused"`` (what a CUDA graph capture needs made first) raises
    where the fused all-reduce cannot run, as the call would; where it can, the fused and native
    paths."""
    x, group = torch.randn(64), stand_in_group()
    monkeypatch.setattr(pipelined_native, "unsupported_collective_reason", lambda *args: None)
    monkeypatch.setattr(fused, "unsupported_collective_reason", lambda *args: "no peer access here")
    with pytest.raises(ValueError, match="backend: 'fused' cannot run all_reduce .*: no peer access here"):
        dispatch.capture_paths("fused", x, group)
    monkeypatch.setattr(fused, "unsupported_collective_reason", lambda *args: None)
    assert dispatch.capture_paths("fused", x, group) == ["fused", "native"]


def check_auto_compiles_whole_while_the_logger_says_why():
    """With the dispatch and autotune loggers at debug level, a call of ``backend="auto"`` still
    compiles whole (``fullgraph=True``): nothing is said while torch.compile traces (a logger call
    there would break the graph), with one candidate and with two over a shape class never
    measured (the first then runs, unmeasured), and the result is the eager one."""
    rank_world()
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(4, 6, generator=g), torch.randn(5, 6, generator=g)
    loggers = [logging.getLogger(name) for name in ("tp_kernels.dispatch", "tp_kernels.autotune")]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
    try:
        def call(x):
            return ops.matmul_all_reduce(x, w, backend="auto")

        for candidates in (None, ("reference", "pipelined")):
            autotune.forget()
            with settings.overriding(auto_candidates=candidates):
                compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(x)
                torch.testing.assert_close(compiled, call(x))
    finally:
        for logger in loggers:
            logger.setLevel(logging.NOTSET)
        autotune.forget()


@pytest.mark.parametrize("world", [2], indirect=True)
def test_auto_compiles_whole_while_the_dispatch_logger_says_why(world):
    world.run(check_auto_compiles_whole_while_the_logger_says_why)


def test_the_group_key_is_a_constant_of_a_trace():
    """``coll.group_key`` (what ``auto``'s decisions are keyed by) carries what
    ``torch.compiler.assume_constant_result`` puts on a function, set without importing dynamo:
    dynamo calls it while tracing, where torch 2.11's cannot trace the ``id()`` of a process group
    it takes (the test above failed to compile there). Fails on a torch that marks otherwise."""
    marked = torch.compiler.assume_constant_result(lambda: None)
    assert vars(marked), "assume_constant_result put nothing on the function"
    assert {k: getattr(_collectives.group_key, k, None) for k in vars(marked)} == vars(marked)


def test_auto_measures_the_native_path_in_several_chunk_counts(monkeypatch):
    """Unless the call names its chunks, the native path of an op split by rows is measured in the
    schedule's default count first, then each other count of NATIVE_CHUNK_CHOICES that splits its
    rows otherwise; the all-gather's ring as it is."""
    def variants(op, m, p, named=False):
        x, w = torch.empty(m, 16, device="meta"), torch.empty(8, 16, device="meta")
        return dispatch._variants("native", op, x, w, p, DEFAULT_NUM_CHUNKS.get(op, 4), named)

    assert dispatch.NATIVE_CHUNK_CHOICES[0] == DEFAULT_NUM_CHUNKS["matmul_all_reduce"]
    assert variants("matmul_all_reduce", 8, 2) == ["native:4", "native:2", "native:1"]
    assert variants("matmul_all_reduce", 2, 2) == ["native:4", "native:1"]  # (4 chunks of 2 rows are 2)
    assert variants("matmul_all_reduce", 1, 2) == ["native:4"]
    assert variants("matmul_reduce_scatter", 8, 2) == ["native:4", "native:2", "native:1"]  # 4 rows a block
    assert variants("matmul_reduce_scatter", 4, 2) == ["native:4", "native:1"]
    assert variants("linear_with_grad_all_reduce", 8, 2) == ["native:4", "native:2", "native:1"]
    assert variants("all_gather_matmul", 8, 2) == ["native:1"]
    assert variants("matmul_all_reduce", 8, 2, named=True) == ["native:4"]
    # through resolve: what auto hands the measurement, with and without num_chunks
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    measured = []
    monkeypatch.setattr(autotune, "choose", lambda op, v, *args: measured.append(list(v)) or v[-1])
    x, w = torch.randn(8, 16), torch.randn(8, 16)
    assert dispatch.resolve("matmul_all_reduce", "auto", x, 2, None, w) == "reference"
    assert dispatch.resolve("matmul_all_reduce", "auto", x, 2, None, w, num_chunks=2) == "reference"
    assert measured == [["native:4", "native:2", "native:1", "reference"], ["native:2", "reference"]]


@pytest.mark.parametrize("bad", [[], ["reference", "reference"], ["naive"], "reference"])
def test_bad_candidates_are_named(bad):
    with pytest.raises(ValueError, match=r"names: expected distinct names among \('fused', 'pipelined', "
                                         r"'reference'\)"):
        autotune.set_auto_candidates(bad)


def test_bad_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv("TP_KERNELS_AUTO_CANDIDATES", "reference,nccl")
    with pytest.raises(ValueError, match="TP_KERNELS_AUTO_CANDIDATES: expected distinct names.*'nccl'"):
        autotune.get_auto_candidates()
    monkeypatch.setenv("TP_KERNELS_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="TP_KERNELS_AUTOTUNE: expected 0 or 1"):
        autotune.autotune_enabled()
    with pytest.raises(ValueError, match="enabled: expected a bool"):
        autotune.set_autotune("yes")
    autotune.set_autotune(False)
    assert autotune.autotune_enabled() is False


@pytest.mark.parametrize("variable, getter", [
    ("TP_KERNELS_AUTO_NATIVE", "auto_native"), ("TP_KERNELS_AUTO_FUSED", "auto_fused"),
    ("TP_KERNELS_AUTOTUNE", "autotune_enabled"), ("TP_KERNELS_FINGERPRINTS", "fingerprints_enabled"),
    ("TP_KERNELS_CHECK_IDS", "ids_checked"), ("TP_KERNELS_NCCL_BLOCKING", "nccl_blocking")])
def test_each_switch_reads_0_or_1_and_nothing_else(monkeypatch, variable, getter):
    """Each 0/1 environment switch reads 0 as off and 1 as on; any other value (2, true, yes)
    is a ValueError naming the variable, at every read."""
    read = getattr(settings, getter)
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(variable, value)
        assert read() is on, (variable, value)
    for bad in ("2", "true", "yes", " 1"):
        monkeypatch.setenv(variable, bad)
        for _ in range(2):
            with pytest.raises(ValueError, match=rf"{variable}: expected 0 or 1, got '{bad}'"):
                read()


def test_the_other_settings_refuse_what_is_not_theirs(monkeypatch):
    """A stream priority that is a bool, and a fused all-reduce algorithm the native module does
    not know, are ValueErrors naming the setting."""
    with pytest.raises(ValueError, match="priority: expected an int, got True"):
        settings.set_comm_stream_priority(True)
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "three_shot")
    with pytest.raises(ValueError, match=r"TP_KERNELS_FUSED_ALL_REDUCE: expected one of \('one_shot', 'two_shot'\), "
                                         r"got 'three_shot'"):
        settings.forced_all_reduce_algorithm(("one_shot", "two_shot"))
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "two_shot")
    assert settings.forced_all_reduce_algorithm(("one_shot", "two_shot")) == "two_shot"


def test_auto_state_takes_only_the_backends_allowed():
    """A fast path is a candidate of "auto" where it is allowed (named, or none named) and named or
    switched on: named candidates without it leave it off, whatever its switch says."""
    cases = [((None, False, False), (False, False)), ((None, True, True), (True, True)),
             ((None, False, True), (True, False)), ((("reference",), True, True), (False, False)),
             ((("pipelined", "reference"), False, True), (False, True)),
             ((("fused",), False, False), (True, False))]
    for (candidates, native, fused_switch), on in cases:
        state = settings.AutoState(candidates, native, fused_switch, True, None)
        assert (state.fused_on, state.native_on) == on, state
        assert state.fast_path_on is any(on), state


def test_auto_state_without_a_fast_path_ignores_what_changes_nothing(monkeypatch):
    """With no fast path a candidate, "auto"'s state does not read whether it measures or the fused
    algorithm forced: one state, whatever they say (so ranks set apart there still agree)."""
    for variable in ("TP_KERNELS_AUTO_CANDIDATES", "TP_KERNELS_AUTO_NATIVE", "TP_KERNELS_AUTO_FUSED"):
        monkeypatch.delenv(variable, raising=False)
    with settings.overriding(auto_candidates=None, autotune=None):
        monkeypatch.setenv("TP_KERNELS_AUTOTUNE", "0")
        quiet = settings.auto_state()
        monkeypatch.setenv("TP_KERNELS_AUTOTUNE", "1")
        monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "one_shot")
        assert settings.auto_state() is quiet and (quiet.measures, quiet.fused_all_reduce) == (None, None)
        monkeypatch.setenv("TP_KERNELS_AUTO_FUSED", "1")  # a fast path on: both read
        assert (settings.auto_state().measures, settings.auto_state().fused_all_reduce) == (True, "one_shot")


def test_overriding_gives_back_what_was_set(monkeypatch):
    """settings.overriding sets its settings inside the block, each checked as its setter checks
    it, and after it gives back exactly what was set before: a setter's value, or none (the
    environment variable read again), also where the block raised or a value was refused."""
    monkeypatch.setenv("TP_KERNELS_TIMEOUT_S", "40")
    settings.set_fingerprints(True)
    try:
        with settings.overriding(timeout=3, fingerprints=False, auto_candidates=["reference"], autotune=False,
                                 comm_stream_priority=0, ids_checked=False):
            assert (settings.get_timeout(), settings.fingerprints_enabled(), settings.get_auto_candidates(),
                    settings.autotune_enabled(), settings.get_comm_stream_priority(), settings.ids_checked()) == (
                        3.0, False, ("reference",), False, 0, False)
        assert settings.fingerprints_enabled() is True and settings.get_auto_candidates() is None
        assert settings.ids_checked() is True
        monkeypatch.setenv("TP_KERNELS_CHECK_IDS", "0")  # (the setter wins over the variable)
        with settings.overriding(ids_checked=True):
            assert settings.ids_checked() is True
        assert settings.ids_checked() is False
        with pytest.raises(ValueError, match="enabled: expected a bool or None, got 0"):
            settings.set_ids_checked(0)
        assert settings.nccl_blocking() is settings.NCCL_BLOCKING_DEFAULT is None  # (blocking_mode decides)
        monkeypatch.setenv("TP_KERNELS_NCCL_BLOCKING", "1")
        assert settings.nccl_blocking() is True
        with settings.overriding(nccl_blocking=False):
            assert settings.nccl_blocking() is False
        assert settings.nccl_blocking() is True
        monkeypatch.setenv("TP_KERNELS_NCCL_BLOCKING", "yes")
        with pytest.raises(ValueError, match="TP_KERNELS_NCCL_BLOCKING: expected 0 or 1, got 'yes'"):
            settings.nccl_blocking()
        monkeypatch.delenv("TP_KERNELS_NCCL_BLOCKING")
        with pytest.raises(ValueError, match="enabled: expected a bool or None, got 1"):
            settings.set_nccl_blocking(1)
        assert settings.gemm_streams() == settings.GEMM_STREAMS_DEFAULT == 1
        monkeypatch.setenv("TP_KERNELS_GEMM_STREAMS", "2")
        assert settings.gemm_streams() == 2
        with settings.overriding(gemm_streams=1):
            assert settings.gemm_streams() == 1
        assert settings.gemm_streams() == 2
        for bad in ("3", "two", "2.0"):
            monkeypatch.setenv("TP_KERNELS_GEMM_STREAMS", bad)
            with pytest.raises(ValueError, match=rf"TP_KERNELS_GEMM_STREAMS: expected one of \(1, 2\), got '{bad}'"):
                settings.gemm_streams()
        monkeypatch.delenv("TP_KERNELS_GEMM_STREAMS")
        for bad in (0, 3, 2.0, True, "2"):
            with pytest.raises(ValueError, match=r"count: expected one of \(1, 2\), got "):
                settings.set_gemm_streams(bad)
        assert settings.gemm_streams() == 1
        assert settings.gemm_tuning() == settings.GEMM_TUNING_DEFAULT == 0
        monkeypatch.setenv("TP_KERNELS_GEMM_TUNING", " 8 ")
        assert settings.gemm_tuning() == 8
        with settings.overriding(gemm_tuning=0):
            assert settings.gemm_tuning() == 0
        assert settings.gemm_tuning() == 8
        for bad in ("1", "33", "-2", "eight", "8.0"):
            monkeypatch.setenv("TP_KERNELS_GEMM_TUNING", bad)
            with pytest.raises(ValueError, match=rf"TP_KERNELS_GEMM_TUNING: expected 0 \(off\) or 2..32 proposals, "
                                                 rf"got '{bad}'"):
                settings.gemm_tuning()
        monkeypatch.delenv("TP_KERNELS_GEMM_TUNING")
        for bad in (1, 33, -1, 8.0, True, "8"):
            with pytest.raises(ValueError, match=r"candidates: expected 0 \(off\) or 2..32 proposals, got "):
                settings.set_gemm_tuning(bad)
        settings.set_gemm_tuning(32)
        assert settings.gemm_tuning() == 32
        settings.set_gemm_tuning(None)
        assert settings.gemm_tuning() == 0
        monkeypatch.setenv("TP_KERNELS_TIMEOUT_S", "50")  # (none was set: the variable is read again)
        assert settings.get_timeout() == 50.0 and settings.get_comm_stream_priority() == settings.HIGHEST_PRIORITY
        with pytest.raises(RuntimeError, match="inside"), settings.overriding(timeout=2):
            raise RuntimeError("inside")
        with pytest.raises(ValueError, match="seconds: expected a positive number"):
            with settings.overriding(fingerprints=False, timeout=-1):
                pass
        assert settings.get_timeout() == 50.0 and settings.fingerprints_enabled() is True
        with pytest.raises(ValueError, match="overriding: expected settings among timeout, .*got color"):
            with settings.overriding(color=1):
                pass
    finally:
        settings.set_fingerprints(None)


@pytest.mark.parametrize("store", [True, False], ids=["environ-store", "environ-get"])
def test_a_setting_follows_its_environment_variable_from_one_read_to_the_next(monkeypatch, store):
    """Read at every use, parsed once per value: a change, an empty value, a malformed one (raised
    at every read, not remembered) and a removal each show at the next read, whether the variable
    is read from os.environ's store or through os.environ.get."""
    if not store:
        class Environ:  # os.environ without its store
            get = staticmethod(os.environ.get)

        variable = settings._Variable("TP_KERNELS_TIMEOUT_S", settings._parse_timeout, settings.DEFAULT_TIMEOUT_S,
                                      environ=Environ())
        assert variable._store is None
        monkeypatch.setattr(settings, "_TIMEOUT", variable)
    monkeypatch.delenv("TP_KERNELS_TIMEOUT_S", raising=False)
    assert settings.get_timeout() == settings.DEFAULT_TIMEOUT_S
    for value in ("12", "13.5", "12"):
        monkeypatch.setenv("TP_KERNELS_TIMEOUT_S", value)
        assert settings.get_timeout() == float(value)
    monkeypatch.setenv("TP_KERNELS_TIMEOUT_S", "")
    assert settings.get_timeout() == settings.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("TP_KERNELS_TIMEOUT_S", "soon")
    for _ in range(2):
        with pytest.raises(ValueError, match="TP_KERNELS_TIMEOUT_S: expected a positive number"):
            settings.get_timeout()
    monkeypatch.setenv("TP_KERNELS_TIMEOUT_S", "7")
    assert settings.get_timeout() == 7.0
    monkeypatch.delenv("TP_KERNELS_TIMEOUT_S")
    assert settings.get_timeout() == settings.DEFAULT_TIMEOUT_S


def _variants(op, m, p, impls=("fused", "native", "reference")):
    """What "auto" measures of these candidates for an op on an [m, 16] input, weight [8, 16]."""
    x, w = torch.empty(m, 16, device="meta"), torch.empty(8, 16, device="meta")
    chunks = DEFAULT_NUM_CHUNKS[op]
    return [v for impl in impls for v in dispatch._variants(impl, op, x, w, p, chunks)]


@built
def test_each_fused_all_reduce_algorithm_is_a_variant(monkeypatch):
    assert _variants("matmul_all_reduce", 1, 2) == [
        "fused:one_shot", "fused:two_shot", "native:4", "reference"]  # scatter_gather needs m >= p
    assert _variants("matmul_all_reduce", 8, 2) == [
        "fused:one_shot", "fused:two_shot", "fused:scatter_gather", "native:4", "reference"]
    assert _variants("matmul_reduce_scatter", 8, 2) == ["fused:4", "native:4", "reference"]
    assert _variants("all_gather_matmul", 8, 2) == ["fused:1", "native:1", "reference"]
    # the row layer's backward all-reduces as matmul_all_reduce does: by the same algorithms
    x, w = torch.empty(8, 16, device="meta"), torch.empty(8, 16, device="meta")
    assert dispatch._variants("fused", "linear_with_grad_all_reduce", x, w, 2, 4) == [
        "fused:one_shot", "fused:two_shot", "fused:scatter_gather"]
    # a plain all-reduce of the communicator: each algorithm, the size thresholds' pick first
    assert dispatch.collective_variants("fused", "all_reduce", torch.empty(64), 2) == [
        "fused:one_shot", "fused:two_shot", "fused:scatter_gather"]
    assert dispatch.collective_variants("native", "all_reduce", torch.empty(64), 2) == ["native:1"]
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "two_shot")  # forced: not measured
    assert _variants("matmul_all_reduce", 8, 2) == ["fused:two_shot", "native:4", "reference"]
    assert dispatch.collective_variants("fused", "all_reduce", torch.empty(64), 2) == ["fused:two_shot"]
    # unmeasured, the first runs: the algorithm the size thresholds pick comes first
    monkeypatch.delenv("TP_KERNELS_FUSED_ALL_REDUCE")
    big = fused.MAX_BYTES["two_shot"] // 16  # rows of a [m, 8] fp32 all-reduce past the two-shot threshold
    assert _variants("matmul_all_reduce", big, 2)[0] == "fused:scatter_gather"
    assert dispatch.collective_variants("fused", "all_reduce", torch.empty(big * 8), 2)[0] == "fused:scatter_gather"


def test_a_named_fused_backend_is_asked_about_the_calls_own_tensors(monkeypatch):
    """check_runnable (and resolve, whose first step it is) asks the fused path about the call's
    input and weight (x standing for a weight the call has none of), and raises its reason naming
    the call; the other backends are not asked (they fall back or run anywhere)."""
    asked = []
    monkeypatch.setattr(fused, "unsupported_reason", lambda x, w, g: asked.append((x, w, g)) or "no peer access")
    x, w, group = torch.randn(4, 8), torch.randn(6, 8), stand_in_group()
    message = (r"backend: 'fused' cannot run matmul_all_reduce \(p=2, x \(4, 8\) torch.float32 on cpu\): "
               r"no peer access\. Use 'pipelined' or 'auto' there\.")
    with pytest.raises(ValueError, match=message):
        dispatch.check_runnable("matmul_all_reduce", "fused", x, 2, group, w)
    with pytest.raises(ValueError, match=message):
        dispatch.check_runnable("matmul_all_reduce", "fused", x, 2, group)
    with pytest.raises(ValueError, match=message):
        dispatch.resolve("matmul_all_reduce", "fused", x, 2, group, w)
    assert [tuple(map(id, call)) for call in asked] == [(id(x), id(w), id(group)), (id(x), id(x), id(group)),
                                                        (id(x), id(w), id(group))]
    for backend in ("reference", "pipelined", "auto"):
        dispatch.check_runnable("matmul_all_reduce", backend, x, 2, group, w)
    assert len(asked) == 3


def test_a_fused_communicator_runs_its_other_collectives_on_nccl(monkeypatch):
    """backend="fused" for a plain collective: the all-reduce over peer memory (or the fused path's
    reason, raised), every other collective on the group's NCCL communicator, where the fused
    path (the all-reduce only) is not asked."""
    x, group = torch.randn(64), stand_in_group()
    asked = []
    monkeypatch.setattr(pipelined_native, "unsupported_collective_reason", lambda *a: None)
    monkeypatch.setattr(fused, "unsupported_collective_reason", lambda c, x, g: asked.append(c) or "no peer access")
    assert [dispatch.resolve_collective(c, "fused", x, group, 0)
            for c in ("broadcast", "all_gather", "gather", "reduce_scatter")] == ["native:1"] * 4
    assert asked == []
    with pytest.raises(ValueError, match=r"backend: 'fused' cannot run all_reduce \(p=2, .*\): no peer access"):
        dispatch.resolve_collective("all_reduce", "fused", x, group)
    assert asked == ["all_reduce"]


@built
def test_a_graph_capture_makes_the_paths_the_collectives_may_take(monkeypatch):
    """capture_paths: what a CUDA graph capture of a communicator's collectives needs made first,
    by backend, where the native path could run them (stood in for: no GPU here); "fused" runs its
    other collectives on the NCCL communicator, so it needs both."""
    x, group = torch.randn(64), stand_in_group()
    monkeypatch.setattr(pipelined_native, "unsupported_collective_reason", lambda *a: None)
    monkeypatch.setattr(fused, "unsupported_collective_reason", lambda *a: None)
    assert [dispatch.capture_paths(b, x, group) for b in ("reference", "pipelined", "fused")] == [
        [], ["native"], ["fused", "native"]]
    monkeypatch.setattr(settings, "AUTO_FUSED_DEFAULT", False)
    monkeypatch.setattr(settings, "AUTO_NATIVE_DEFAULT", False)
    assert dispatch.capture_paths("auto", x, group) == []
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    assert dispatch.capture_paths("auto", x, group) == ["native"]
    monkeypatch.setenv("TP_KERNELS_AUTO_FUSED", "1")
    assert dispatch.capture_paths("auto", x, group) == ["fused", "native"]
    assert dispatch.capture_paths("fused", x, stand_in_group("one", 1)) == []
    monkeypatch.setattr(pipelined_native, "unsupported_collective_reason", lambda *a: "not on a CUDA device")
    assert [dispatch.capture_paths(b, x, group) for b in ("pipelined", "fused", "auto")] == [[], [], []]


@built
def test_a_measured_algorithm_is_what_the_fused_all_reduce_runs(monkeypatch):
    big = fused.MAX_BYTES["two_shot"]  # elements of bf16: twice the threshold in bytes

    def algorithm(m, p):
        x, w = torch.empty(m, 16, dtype=torch.bfloat16, device="meta"), torch.empty(1, 16, device="meta")
        return dispatch.fused_all_reduce_algorithm("matmul_all_reduce", x, w, p)

    assert algorithm(big, 2) == "scatter_gather"
    autotune._algorithms[(autotune.size_class(big), 1, 2, torch.bfloat16)] = "one_shot"  # as a measurement does
    assert algorithm(big, 2) == "one_shot"
    assert algorithm(big - 1, 2) == "one_shot"  # same size class
    assert algorithm(big, 4) == "scatter_gather"  # another p
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "two_shot")  # the environment wins
    assert algorithm(big, 2) == "two_shot"
    autotune.forget()
    assert autotune.measured_algorithm(big, 1, 2, torch.bfloat16) is None
    assert [autotune.size_class(m) for m in (1, 2, 3, 4, 5, 4096, 4097)] == [1, 2, 4, 4, 8, 4096, 8192]
    with pytest.raises(ValueError, match="algorithm: scatter_gather needs at least p = 4 rows, got 3"):
        fused.check_algorithm("scatter_gather", 3, 4)
    assert fused.check_algorithm("scatter_gather", 4, 4) == "scatter_gather"  # (a row each)
    with pytest.raises(ValueError, match="algorithm: expected one of"):
        fused.check_algorithm("ring", 8, 2)


def test_forget_drops_one_groups_decisions():
    g1, g2 = stand_in_group("a"), stand_in_group("b")

    def decision(name, choice):
        return autotune.Decision("matmul_all_reduce", name, "cpu", torch.float32, 1, 8, 4, 4, False,
                                 ("fused:one_shot", "reference"), (1.0, 2.0), choice)

    autotune._decisions.update({("k1",): (g1, decision("a", "reference")), ("k2",): (g2, decision("b", "reference"))})
    if _extension._C is not None:  # a fused choice names its algorithm
        autotune._decisions[("k1",)] = (g1, decision("a", "fused:one_shot"))
        assert autotune.decisions()[0].algorithm == "one_shot"
        autotune._algorithms[(8, 4, 1, torch.float32)] = "one_shot"
    assert autotune.decisions()[1].algorithm is None
    autotune.forget(g1)
    assert [d.group_name for d in autotune.decisions()] == ["b"] and not autotune._algorithms
    assert autotune.forget in parallel_state._TEARDOWNS  # what destroy_model_parallel calls per group
    autotune.forget()
    assert autotune.decisions() == []


def test_no_measurement_while_compiling(monkeypatch):
    """While torch.compile traces (or a graph is captured) the first candidate runs, unless the
    class was measured before; nothing is remembered."""
    group = stand_in_group()
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    variants = ["pipelined:2", "reference"]
    assert autotune.choose("matmul_all_reduce", variants, x, w, None, group) == "pipelined:2"
    assert autotune.decisions() == []
    key = ("matmul_all_reduce", _collectives.group_key(group, x.device), x.dtype, 4, 3, 8, False, tuple(variants))

    def measured(choice):
        autotune._decisions[key] = (group, autotune.Decision("matmul_all_reduce", "g", "cpu", x.dtype, 2, 4, 3, 8,
                                                             False, tuple(variants), (2.0, 1.0), choice))

    measured("reference")
    assert autotune.choose("matmul_all_reduce", variants, x, w, None, group) == "reference"
    # the class's measurement, whichever of its variants comes first (the fused all-reduce's
    # first is the algorithm measured fastest, so the order changes once the class is measured)
    measured("pipelined:2")
    assert autotune.choose("matmul_all_reduce", variants[::-1], x, w, None, group) == "pipelined:2"
    measured("reference")
    autotune.set_autotune(False)
    assert autotune.choose("matmul_all_reduce", variants, x, w, None, group) == "pipelined:2"


def test_a_call_like_an_earlier_one_is_not_resolved_again(monkeypatch):
    """Once "auto" has resolved a call, a call like it (the op, shapes, dtype, device, group,
    bias or not, chunks, the settings of "auto") gets the same name without its candidates or
    variants made again; a setting changed, a decision made or dropped, another shape: resolved
    anew. Nothing is kept while torch.compile traces, nor from a choice made while nothing could
    be measured."""
    x, w = torch.randn(8, 16), torch.randn(8, 16)
    group = stand_in_group()
    asked = []
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda *a: asked.append("native") or None)
    monkeypatch.setattr(autotune, "choose", lambda op, variants, *args: asked.append("choose") or variants[-1])
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")

    def resolve(x=x, num_chunks=None, bias=None):
        asked.clear()
        return dispatch.resolve("matmul_all_reduce", "auto", x, 2, group, w, bias, num_chunks), list(asked)

    assert resolve() == ("reference", ["native", "choose"])
    assert resolve() == ("reference", [])  # kept
    assert resolve(x=torch.randn(9, 16)) == ("reference", ["native", "choose"])  # another m
    assert resolve(num_chunks=2) == ("reference", ["native", "choose"])
    assert resolve(bias=torch.randn(8)) == ("reference", ["native", "choose"])
    assert resolve(x=x.double()) == ("reference", ["native", "choose"])
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "0")  # a setting: at the next call
    assert resolve() == ("reference", [])  # (nothing to choose among: no candidate asked)
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    assert resolve() == ("reference", [])  # the earlier settings' entry
    monkeypatch.setattr(autotune, "choose", lambda op, variants, *args: asked.append("choose") or variants[0])
    autotune.forget()  # a decision dropped (or made): everything resolved anew
    assert resolve() == ("native:4", ["native", "choose"])
    assert resolve() == ("native:4", [])
    autotune.set_auto_candidates(["reference", "pipelined"])
    assert resolve() == ("native:4", ["native", "choose"])
    autotune.set_auto_candidates(None)
    # while nothing can be measured, a choice is not kept (a later eager call measures)
    autotune.forget()
    monkeypatch.setattr(autotune, "unmeasurable_reason", lambda x: "a CUDA graph is being captured")
    assert resolve() == ("native:4", ["native", "choose"])
    assert resolve() == ("native:4", ["native", "choose"])


def test_nothing_is_kept_while_compiling_or_saying_why(monkeypatch, caplog):
    x, w = torch.randn(8, 16), torch.randn(8, 16)
    group = stand_in_group()
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda *a: None)
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    monkeypatch.setenv("TP_KERNELS_AUTOTUNE", "0")
    monkeypatch.setattr(dispatch, "_is_compiling", lambda: True)
    assert dispatch.resolve("matmul_all_reduce", "auto", x, 2, group, w) == "native:4"
    assert dispatch._resolved == {}
    monkeypatch.setattr(dispatch, "_is_compiling", torch.compiler.is_compiling)
    with caplog.at_level(logging.DEBUG, logger="tp_kernels.dispatch"):
        for _ in range(2):  # each call says why
            assert dispatch.resolve("matmul_all_reduce", "auto", x, 2, group, w) == "native:4"
    assert dispatch._resolved == {}
    assert sum("candidates ['native', 'reference']" in r.message for r in caplog.records) == 2
    assert dispatch.resolve("matmul_all_reduce", "auto", x, 2, group, w) == "native:4"
    assert len(dispatch._resolved) == 1
    monkeypatch.setattr(dispatch, "RESOLVED_MAX", 1)  # full: dropped, to be resolved again
    assert dispatch.resolve("matmul_all_reduce", "auto", x[:4], 2, group, w) == "native:4"
    assert [key[3] for key in dispatch._resolved] == [(4, 16)]
    # one rank: the reference, and auto says why when asked
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tp_kernels.dispatch"):
        assert dispatch.resolve("matmul_all_reduce", "auto", x, 1, group, w) == "reference"
    assert any("candidates ['reference']; left out: one rank, nothing to overlap" in r.message
               for r in caplog.records), caplog.records


def test_a_collective_like_an_earlier_one_is_not_resolved_again(monkeypatch):
    x = torch.randn(64)
    group = stand_in_group()
    asked = []
    monkeypatch.setattr(pipelined_native, "unsupported_collective_reason",
                        lambda *a: asked.append("native") or None)
    monkeypatch.setattr(autotune, "choose_collective",
                        lambda collective, variants, *args: asked.append("choose") or variants[-1])
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")

    def resolve(x=x, peer=-1):
        asked.clear()
        return dispatch.resolve_collective("broadcast", "auto", x, group, peer), list(asked)

    assert resolve(peer=0) == ("reference", ["native", "choose"])
    assert resolve(peer=0) == ("reference", [])
    assert resolve(peer=1) == ("reference", ["native", "choose"])  # another root
    assert resolve(x=torch.randn(65), peer=0) == ("reference", ["native", "choose"])
    assert resolve(x=x.view(8, 8), peer=0) == ("reference", [])  # the elements, not the shape
    autotune.forget()
    assert resolve(peer=0) == ("reference", ["native", "choose"])
    # an empty tensor moves nothing: the reference on every backend, nothing asked or measured
    for backend in ("auto", "pipelined", "fused"):
        asked.clear()
        assert dispatch.resolve_collective("all_reduce", backend, torch.empty(0), group) == "reference"
        assert asked == [], backend


# --- on 2 gloo ranks ----------------------------------------------------------------------------


def check_measured_choice(names=("reference", "pipelined"), device="cpu"):
    """Every op with backend="auto" over several candidates: measured once per shape class, the
    same figures and choice on every rank, the fastest chosen, results (and grads) equal to the
    reference's."""
    r, p = rank_world()
    autotune.set_auto_candidates(names)
    try:
        seen = []
        for op in OPS:
            base = op if op != "linear_with_grad_all_reduce" else "matmul_all_reduce"
            for m_per_rank in (3, 5, 11):  # 3 and 5 share a size class of the rows, 11 does not
                args, _ = test_ops._case(base, m_per_rank, 11, 6, torch.float32, seed=m_per_rank, device=device)
                if op == "linear_with_grad_all_reduce":  # x replicated, W (n/p, k)
                    args = tuple(t.to(device) for t in (
                        torch.randn(m_per_rank * p, 3, 12, generator=torch.Generator().manual_seed(3)),
                        torch.randn(6, 12, generator=torch.Generator().manual_seed(4 + r)), args[2][:6].cpu()))
                shape = getattr(ops, op)(*args, backend="reference").shape
                dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
                y_ref, grads_ref = test_ops._run(op, args, dy, backend="reference")
                before = len(autotune.decisions())
                y, grads = test_ops._run(op, args, dy, backend="auto")
                made = autotune.decisions()[before:]
                assert len(made) == (0 if m_per_rank == 5 else 1), (op, m_per_rank, made)
                assert_close(f"auto {op} y", y, y_ref.double())
                for name, g, g_ref in zip(("dx", "dw", "db"), grads, grads_ref):
                    assert_close(f"auto {op} {name}", g, g_ref.double())
                seen += made
        for d in seen:
            best = d.variants[min(range(len(d.variants)), key=d.times_s.__getitem__)]
            assert all(t > 0 for t in d.times_s) and d.choice == best and d.algorithm == parse(best).algorithm
        lw = [d for d in seen if d.op == "linear_with_grad_all_reduce"]
        assert [(d.n, d.k) for d in lw] == [(12, 6)] * 2  # its backward's all-reduce: (m, 6) x (6, 12)
        return [(d.op, d.m_class, d.n, d.k, d.variants, d.times_s, d.choice) for d in seen]
    finally:
        autotune.set_auto_candidates(None)
        autotune.forget()


def test_measured_choice(world2):
    per_rank = world2.run(check_measured_choice)
    assert per_rank[0] == per_rank[1]  # the same figures and choices on both ranks
    for op, _, _, _, variants, *_ in per_rank[0]:  # the portable schedule in the op's default chunks
        primitive = op if op != "linear_with_grad_all_reduce" else "matmul_all_reduce"
        assert variants == (f"pipelined:{DEFAULT_NUM_CHUNKS[primitive]}", "reference"), (op, variants)
    # rows: 3 m_per_rank gathered by all_gather_matmul, 3 m_per_rank p for the others
    assert [(op, m) for op, m, *_ in per_rank[0]] == [(op, m) for op in OPS
                                                       for m in ((16, 64) if op == "all_gather_matmul" else (32, 128))]


def check_what_auto_measures():
    """What auto's measurement of a shape class runs: each candidate WARMUP untimed and REPEATS
    timed times, on the primitive's own operands (for linear_with_grad_all_reduce, its backward's
    all-reduce: dy [m, n/p] by W as [k, n/p]), each run's output the all-reduced product itself
    (the collective waited for); the decision names the group's size, and moves the generation on
    (what a choice made from the decisions stays true for)."""
    from collections import Counter

    from tp_kernels import _timing

    r, p = rank_world()
    seen = []
    run_variant = autotune._run_variant

    def recording(primitive, variant, x, w, b, group):
        out = run_variant(primitive, variant, x, w, b, group)
        seen.append((primitive, variant, tuple(x.shape), tuple(w.shape), out, x.detach().clone(), w.detach().clone()))
        return out

    autotune._run_variant = recording
    autotune.set_auto_candidates(["reference", "pipelined"])
    try:
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))  # replicated
        w = torch.randn(6, 12, generator=torch.Generator().manual_seed(2 + r)).requires_grad_()  # W [n/p, k]
        before = autotune.generation()
        ops.linear_with_grad_all_reduce(x, w, backend="auto")
        (d,) = autotune.decisions()
        assert d.op == "linear_with_grad_all_reduce" and d.p == p and autotune.generation() > before
        assert {(prim, xs, ws) for prim, _, xs, ws, *_ in seen} == {("matmul_all_reduce", (5, 6), (12, 6))}
        assert sorted(Counter(v for _, v, *_ in seen).items()) == [
            (v, autotune.WARMUP + autotune.REPEATS) for v in sorted(d.variants)]
        # in turns, the order rotated each round, warm-up rounds first
        assert [v for _, v, *_ in seen] == [d.variants[b] for rounds in (autotune.WARMUP, autotune.REPEATS)
                                             for _, b in _timing.turns(len(d.variants), rounds)]
        for _, v, _, _, out, xm, wm in seen:
            assert isinstance(out, torch.Tensor), (v, out)
            torch.testing.assert_close(out, ops.matmul_all_reduce(xm, wm, backend="reference"))
    finally:
        autotune._run_variant = run_variant
        autotune.set_auto_candidates(None)
        autotune.forget()


def test_what_auto_measures(world2):
    world2.run(check_what_auto_measures)


def test_point_to_point_is_never_measured(monkeypatch):
    """``send`` and ``recv`` under ``"auto"`` run their first variant, unmeasured (one side alone
    cannot time them), before anything asks the group."""
    from tp_kernels._op_table import POINT_TO_POINT

    monkeypatch.setattr(autotune, "_measured", lambda *args, **kwargs: pytest.fail("measured"))
    for collective in sorted(POINT_TO_POINT):
        assert autotune.choose_collective(collective, ["native", "reference"], torch.zeros(3), None, peer=1) == "native"
    assert autotune.decisions() == []


def test_nothing_is_measured_inside_a_torch_func_transform():
    """Under a torch.func transform the input is the transform's wrapper, of no storage the native
    paths could read: nothing is measured there (the class's decision, or its first variant)."""
    seen = []
    torch.func.vmap(lambda t: seen.append(autotune.unmeasurable_reason(t)) or t)(torch.zeros(2, 3))
    assert seen == ["a torch.func transform is active"]
    assert autotune.unmeasurable_reason(torch.zeros(2)) is None


def check_the_slowest_rank_decides():
    """Rank 0 finds the pipelined schedule slow, rank 1 the reference, slower still: each alone
    would choose differently; both choose the pipelined schedule, whose slowest rank is faster."""
    r, _ = rank_world()
    slow = {0: ("pipelined", 0.15), 1: ("reference", 0.3)}[r]
    run_variant = autotune._run_variant

    def delayed(primitive, variant, *args):
        out = run_variant(primitive, variant, *args)
        if variant.partition(":")[0] == slow[0]:
            time.sleep(slow[1])  # after the collectives: the other rank does not wait for it
        return out

    autotune._run_variant = delayed
    autotune.set_auto_candidates(["reference", "pipelined"])
    try:
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        assert ops.matmul_all_reduce(x, w, backend="auto").shape == (4, 6)
        (d,) = autotune.decisions()
        assert d.times_s[d.variants.index("reference")] >= 0.3
        assert 0.15 <= d.times_s[d.variants.index("pipelined:4")] < 0.3
        return d.choice
    finally:
        autotune._run_variant = run_variant
        autotune.set_auto_candidates(None)
        autotune.forget()


def test_the_slowest_rank_decides(world2):
    assert world2.run(check_the_slowest_rank_decides) == ["pipelined:4", "pipelined:4"]


def check_ranks_that_disagree_get_an_error():
    """The measurement's own agreement, behind the call's fingerprint (which finds this first:
    tests of their own in test_disagreement.py); here with fingerprints off."""
    r, _ = rank_world()
    autotune.set_auto_candidates(["reference", "pipelined"])
    settings.set_fingerprints(False)
    try:
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        bias = torch.randn(6) if r == 1 else None
        with pytest.raises(RuntimeError, match=r"backend='auto': the ranks of group .* disagree on the call to "
                                               r"measure.*rank 0: matmul_all_reduce m=4 n=6 k=8 torch.float32 "
                                               r"bias=False p=2 candidates=pipelined:4,reference; rank 1: .*bias=True"):
            ops.matmul_all_reduce(x, w, bias, backend="auto")
        assert autotune.decisions() == []
        # a collective's root is part of the call measured: ranks that name different roots too
        with pytest.raises(RuntimeError, match=r"disagree on the call to measure.*rank 0: broadcast m=8 n=0 k=0 "
                                               r"torch.float32 bias=False p=2 peer=0 .*rank 1: .* peer=1 "):
            autotune.choose_collective("broadcast", ["reference", "native:1"], torch.ones(8),
                                       _collectives.resolve_group(None), r)
        assert autotune.decisions() == []
        # nothing was left in flight: the group still works
        return ops.matmul_all_reduce(x, w, backend="reference").shape
    finally:
        autotune.set_auto_candidates(None)
        settings.set_fingerprints(None)


def test_ranks_that_disagree_get_an_error(world2):
    assert world2.run(check_ranks_that_disagree_get_an_error) == [(4, 6), (4, 6)]


def check_the_fused_algorithm_measured_fastest_is_remembered():
    """``choose`` among the fused all-reduce's algorithms and the reference (each run stood in for
    by a sleep of its time): the fastest chosen; a fused choice's algorithm remembered for the size
    class of the all-reduce's rows (and run there by the fused all-reduce), a choice of another
    class that is none remembering none."""
    _, p = rank_world()
    group = _collectives.resolve_group(None)
    run_variant = autotune._run_variant
    seconds = {"fused:one_shot": 0.02, "fused:two_shot": 0.005, "reference": 0.03}
    autotune._run_variant = lambda primitive, variant, *args: time.sleep(seconds[variant])
    try:
        w = torch.randn(4, 8)  # n = 4
        chosen = [autotune.choose("matmul_all_reduce", list(seconds), torch.randn(6, 8), w, None, group)]
        seconds.update({"fused:two_shot": 0.04, "reference": 0.001})
        chosen.append(autotune.choose("matmul_all_reduce", list(seconds), torch.randn(16, 8), w, None, group))
        return (chosen, [autotune.measured_algorithm(m, 4, p, torch.float32) for m in (5, 8, 9, 16)],
                autotune.measured_algorithm(8, 4, p + 1, torch.float32),
                dispatch.fused_all_reduce_algorithm("matmul_all_reduce", torch.randn(7, 8), w, p))
    finally:
        autotune._run_variant = run_variant
        autotune.forget()


@built
def test_the_fused_algorithm_measured_fastest_is_remembered(world2):
    assert world2.run(check_the_fused_algorithm_measured_fastest_is_remembered) == [
        (["fused:two_shot", "reference"], ["two_shot", "two_shot", None, None], None, "two_shot")] * 2


def check_without_measuring():
    autotune.set_auto_candidates(["reference", "pipelined"])
    autotune.set_autotune(False)
    try:
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        y = ops.matmul_all_reduce(x, w, backend="auto")
        assert_close("auto unmeasured y", y, ops.matmul_all_reduce(x, w, backend="reference").double())
        return (ops.select_backend("matmul_all_reduce", "auto", x, 2, _collectives.resolve_group(None), w),
                autotune.decisions())
    finally:
        autotune.set_auto_candidates(None)
        autotune.set_autotune(None)


def test_without_measuring_the_first_candidate_runs(world2):
    assert world2.run(check_without_measuring) == [("pipelined:4", [])] * 2


def test_the_benchmark_reports_what_auto_measured():
    from tp_kernels.bench import measure

    probe = torch.empty(4, 8)
    assert measure._resolved("matmul_all_reduce", "auto", probe, 2, None, None, []) == "reference"
    autotune.set_auto_candidates(["reference", "pipelined"])
    made = [autotune.Decision("matmul_all_reduce", "0", "cpu", torch.float32, 2, 4, 8, 8, False,
                              ("pipelined:4", "reference"), (2.0, 1.0), "reference")]
    assert measure._resolved("matmul_all_reduce", "auto", probe, 2, None, None, made) == "reference (measured)"
    assert measure._resolved("matmul_all_reduce", "auto", probe, 2, None, None, []) == "measured before"
    assert measure._resolved("matmul_all_reduce", "pipelined", probe, 2, None, None, []) == "pipelined:4"
    assert measure._resolved("matmul_all_reduce", "pipelined", probe, 2, None, 2, []) == "pipelined:2"  # (as asked)
