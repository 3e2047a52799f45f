"""The fused (peer-memory) backend's CPU-checkable parts: routing and its errors, the
peer-topology decision, workspace sizing and growth, the all-reduce algorithm choice, and the
native checks made before any GPU call.

The fused ops themselves need a GPU: python_tests/test_gpu.py runs them with virtual ranks and
with several processes sharing one GPU.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import tp_kernels
from tp_kernels import _collectives, _extension, dispatch, ops, settings
from tp_kernels.backends import fused, peer_memory, pipelined_native
from tp_kernels.testing import VirtualRanks

from helpers import rank_world

built = pytest.mark.skipif(_extension._C is None, reason="the native module is not built")


def fake_cuda_tensor(shape=(4, 8), dtype=torch.bfloat16, index=0):
    """What unsupported_reason reads of a CUDA tensor, without a GPU."""
    return SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", index), shape=shape,
                           numel=lambda: shape[0] * shape[1])


class FakeGroup:
    group_name = "fake"


def test_explicit_fused_on_the_cpu_is_a_clear_error_before_any_collective():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"backend: 'fused' cannot run matmul_all_reduce .*not on a CUDA device.*"
                                         r"Use 'pipelined' or 'auto'"):
        ops.select_backend("matmul_all_reduce", "fused", x, 2)
    with pytest.raises(ValueError, match="backend: 'fused' cannot run all_gather_matmul"):
        tp_kernels.all_gather_matmul(x, torch.randn(3, 8), backend="fused")
    layer = tp_kernels.RowParallelLinear(8, 3, backend="fused")
    with pytest.raises(ValueError, match="backend: 'fused' cannot run"):
        layer(x)
    assert "fused" in ops.BACKEND_NAMES


def test_fused_with_one_process_is_checked_and_refused_on_the_cpu(world2):
    assert world2.run(check_fused_refused_on_cpu) == [True, True]


def check_fused_refused_on_cpu():
    r, p = rank_world()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="not on a CUDA device"):
        tp_kernels.matmul_reduce_scatter(x, torch.randn(3, 8), backend="fused")
    # nothing was started: the group still works
    return tp_kernels.matmul_all_reduce(x, torch.randn(3, 8), backend="reference").shape == (4, 3)


def test_unsupported_reasons_in_order(monkeypatch):
    x = fake_cuda_tensor()
    w = fake_cuda_tensor((3, 8))
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "_reason", "not built: test")
    assert "extension is unavailable: not built: test" in fused.unsupported_reason(x, w, None)
    monkeypatch.undo()
    if _extension._C is None:
        pytest.skip("the rest needs the native module")
    assert "float64 is not supported" in fused.unsupported_reason(fake_cuda_tensor(dtype=torch.float64), w, None)
    assert "empty dimension" in fused.unsupported_reason(fake_cuda_tensor((0, 8)), w, None)
    assert fused.unsupported_reason(x, w, None) is None  # one rank: the plain GEMM
    monkeypatch.setattr(_collectives, "group_size", lambda g: 1)
    assert fused.unsupported_reason(x, w, FakeGroup()) is None  # (a group of one, too: nothing of the device asked)
    monkeypatch.setattr(_collectives, "group_size", lambda g: 16)
    assert "16 ranks: the fused path supports at most 8" in fused.unsupported_reason(x, w, FakeGroup())
    monkeypatch.setattr(_collectives, "group_size", lambda g: 2)
    if not _extension._C.stream_memory_ops_available():
        assert "stream memory operations" in fused.unsupported_reason(x, w, FakeGroup())
    # past those, the group's topology decides (at most MAX_RANKS ranks); the collective alone has
    # the all-reduce only, summed in the native dtypes, on such a group
    monkeypatch.setattr(_extension._C, "stream_memory_ops_available", lambda: True)
    monkeypatch.setattr(peer_memory, "topology_reason", lambda group, device: f"topology of {group.group_name}")
    for p, reason in ((_extension._C.MAX_RANKS, "topology of fake"), (_extension._C.MAX_RANKS + 1, "at most")):
        monkeypatch.setattr(_collectives, "group_size", lambda g, p=p: p)
        assert reason in fused.unsupported_reason(x, w, FakeGroup())
        assert reason in fused.unsupported_collective_reason("all_reduce", x, FakeGroup())
    assert fused.unsupported_collective_reason("all_gather", x, FakeGroup()) == (
        "the fused path has no all_gather (only the all-reduce)")
    assert "dtype torch.float64 is not summed natively" in fused.unsupported_collective_reason(
        "all_reduce", fake_cuda_tensor(dtype=torch.float64), FakeGroup())


@built
def test_the_fused_all_reduce_runs_a_named_algorithm_and_one_rank_copies():
    """The fused ``matmul_all_reduce`` runs an algorithm its implementation names ("fused:4", a
    chunk count, is refused, naming the algorithms); the all-reduce alone of one rank is x itself,
    in ``out``."""
    from tp_kernels.backends import parse

    x, out = torch.randn(4, 8), torch.empty(4, 8)
    with pytest.raises(ValueError, match=r"impl: the fused all-reduce runs an algorithm of \('one_shot', 'two_shot', "
                                         r"'scatter_gather'\), named in the implementation .* got 'fused:4'"):
        fused.matmul_all_reduce(x, torch.randn(3, 8), None, None, parse("fused:4"))
    assert fused.all_reduce(x, out, None, None, parse("fused:one_shot")) is out and torch.equal(out, x)
    assert fused.all_reduce(x, x, None, None, parse("fused:one_shot")) is x


def test_a_fused_call_as_the_ranks_compare_it_when_they_grow():
    """What the ranks exchange, and list where they disagree, before growing their workspaces: the
    op, the shapes of x and the weight (none for the all-reduce alone), the dtype and how it runs."""
    x, w = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(3, 8)
    assert fused._call("all_gather_matmul", x, w, "4 chunks") == (
        "all_gather_matmul of x [4, 8], weight [3, 8] bfloat16, 4 chunks")
    assert fused._call("all_reduce", x, None, "one_shot") == "all_reduce of x [4, 8] bfloat16, one_shot"
    assert fused._call("matmul_reduce_scatter", x, w, None) == (
        "matmul_reduce_scatter of x [4, 8], weight [3, 8] bfloat16")


@pytest.mark.parametrize("case", ["one_node", "one_gpu", "two_hosts", "no_peer_access"])
def test_peer_topology_is_decided_alike_on_every_rank(monkeypatch, case):
    """Two all-gathers over the group's host route: host ids and devices, then every rank's verdict
    on its peer access; and how many of the ranks share this rank's GPU (the all-reduce kernel's
    grid is sized for them)."""
    g, twin = FakeGroup(), FakeGroup()
    me = peer_memory.host_id()
    other = me if case != "two_hosts" else bytes(16)
    rounds = []

    def all_gather_bytes(payload, group, device):
        assert group is twin and device == torch.device("cpu")  # (the host twin: no wait for the GPU)
        rounds.append(payload)
        if len(rounds) == 1:
            return [me + (0).to_bytes(4, "little"), other + (0 if case == "one_gpu" else 1).to_bytes(4, "little")]
        return [payload, b"\x00" if case == "no_peer_access" else b"\x01"]  # rank 1's verdict

    monkeypatch.setattr(_collectives, "all_gather_bytes", all_gather_bytes)
    monkeypatch.setattr(_collectives, "host_route", lambda group, hint=None: (twin, torch.device("cpu")))
    monkeypatch.setattr(_collectives, "group_size", lambda group: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) == (0, 1))
    monkeypatch.setattr(peer_memory, "_topology", {})
    reason = peer_memory.topology_reason(g, torch.device("cuda", 0))
    if case in ("one_node", "one_gpu"):
        assert reason is None and len(rounds) == 2 and rounds[1] == b"\x01"
        assert peer_memory.ranks_on_device(g, torch.device("cuda", 0)) == (2 if case == "one_gpu" else 1)
    elif case == "two_hosts":
        assert "spans several hosts" in reason and len(rounds) == 1
    else:
        assert "rank 1 of the group cannot reach every peer's GPU" in reason
    # decided once: the next call asks nobody
    assert peer_memory.topology_reason(g, torch.device("cuda", 0)) == reason and len(rounds) == (
        1 if case == "two_hosts" else 2)
    peer_memory.destroy_workspaces(g)
    assert not peer_memory._topology


def test_peer_topology_is_not_checked_inside_a_capture(monkeypatch):
    """Inside a CUDA graph capture (or torch.compile's tracing) the topology check, collectives
    over the host, cannot run: the fused path is refused for now, saying so, nothing exchanged
    and nothing remembered (the first eager call checks)."""
    def all_gather_bytes(*args):
        raise AssertionError("nothing is exchanged")

    monkeypatch.setattr(_collectives, "all_gather_bytes", all_gather_bytes)
    monkeypatch.setattr(peer_memory, "capturing", lambda: True)
    monkeypatch.setattr(peer_memory, "_topology", {})
    reason = peer_memory.topology_reason(FakeGroup(), torch.device("cuda", 0))
    assert "cannot run inside torch.compile tracing or a CUDA graph capture: run the op once eagerly" in reason
    assert peer_memory._topology == {}


def test_host_id_is_stable():
    assert peer_memory.host_id() == peer_memory.host_id() and len(peer_memory.host_id()) == 16


def test_hosts_of_one_name_booted_apart_are_two_hosts(monkeypatch):
    """A host id is its name and its boot: two machines of one host name (containers named alike)
    are not taken for one node."""
    import builtins
    import io

    real_open, boot = builtins.open, ["a"]

    def fake_open(path, *args, **kwargs):
        if path == "/proc/sys/kernel/random/boot_id":
            return io.StringIO(boot[0] + "\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(peer_memory.socket, "gethostname", lambda: "localhost")
    monkeypatch.setattr(builtins, "open", fake_open)
    first = peer_memory.host_id()
    boot[0] = "b"
    assert peer_memory.host_id() != first
    boot[0] = "a"
    assert peer_memory.host_id() == first


@built
def test_auto_routing_with_the_fused_path(monkeypatch, caplog):
    x = torch.randn(4, 8)  # as the weight too: a [4, 4] all-reduce, 64 bytes: one-shot by size
    monkeypatch.setattr(fused, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.setattr(pipelined_native, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.delenv("TP_KERNELS_AUTO_FUSED", raising=False)
    monkeypatch.delenv("TP_KERNELS_AUTO_CANDIDATES", raising=False)
    monkeypatch.delenv("TP_KERNELS_FUSED_ALL_REDUCE", raising=False)
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    monkeypatch.setenv("TP_KERNELS_AUTOTUNE", "0")  # the order without measuring (measuring needs a group)
    assert settings.auto_fused() is settings.AUTO_FUSED_DEFAULT
    monkeypatch.setattr(settings, "AUTO_FUSED_DEFAULT", False)
    assert dispatch.candidates(x, x, None, 2)[0] == ["native", "reference"]
    assert ops.select_backend("matmul_all_reduce", "auto", x, 2) == "native:4"
    assert ops.select_backend("matmul_all_reduce", "fused", x, 2) == "fused:one_shot"  # asked for: used
    assert ops.select_backend("all_gather_matmul", "fused", x, 2, num_chunks=3) == "fused:3"
    monkeypatch.setenv("TP_KERNELS_AUTO_FUSED", "1")
    assert dispatch.candidates(x, x, None, 2)[0] == ["fused", "native", "reference"]
    assert ops.select_backend("matmul_all_reduce", "auto", x, 2) == "fused:one_shot"
    assert ops.select_backend("matmul_all_reduce", "auto", x, 1) == "reference"  # nothing to overlap
    assert ops.select_backend("matmul_all_reduce", "pipelined", x, 2) == "native:4"
    monkeypatch.setattr(fused, "unsupported_reason", lambda x, w, g: "the group spans several hosts")
    with caplog.at_level(logging.DEBUG, logger="tp_kernels.dispatch"):
        assert ops.select_backend("matmul_all_reduce", "auto", x, 2) == "native:4"
    assert any("left out: fused: the group spans several hosts" in r.message for r in caplog.records)
    monkeypatch.setenv("TP_KERNELS_AUTO_FUSED", "maybe")
    with pytest.raises(ValueError, match="TP_KERNELS_AUTO_FUSED"):
        settings.auto_fused()


@built
def test_all_reduce_algorithm_by_size(monkeypatch):
    monkeypatch.delenv("TP_KERNELS_FUSED_ALL_REDUCE", raising=False)
    bf16 = torch.bfloat16
    assert fused.all_reduce_algorithm(16, 8192, 8, bf16) == "one_shot"  # 256 KiB
    assert fused.all_reduce_algorithm(17, 8192, 8, bf16) == "two_shot"
    assert fused.all_reduce_algorithm(512, 8192, 8, bf16) == "two_shot"  # 8 MiB
    assert fused.all_reduce_algorithm(513, 8192, 8, bf16) == "scatter_gather"
    assert fused.all_reduce_algorithm(4, 2**22, 8, bf16) == "two_shot"  # fewer rows than ranks
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "one_shot")
    assert fused.all_reduce_algorithm(8192, 8192, 8, bf16) == "one_shot"
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "three_shot")
    with pytest.raises(ValueError, match="TP_KERNELS_FUSED_ALL_REDUCE"):
        fused.all_reduce_algorithm(1, 1, 2, bf16)


@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_region_needs(dtype):
    es = torch.empty((), dtype=dtype).element_size()
    align = _extension._C.REGION_ALIGNMENT
    assert _extension._C.REGIONS == ("export", "inbox", "export2")

    def up(b):
        return -(-b // align) * align

    p, m, n, k = 8, 8192, 1000, 3584
    assert peer_memory.region_needs("all_gather_matmul", p, m, n, k, dtype) == [up(m // p * k * es), 0, 0]
    assert peer_memory.region_needs("matmul_reduce_scatter", p, m, n, k, dtype) == [0, up(m * n * es), 0]
    assert peer_memory.region_needs("matmul_all_reduce", p, 13, n, k, dtype, "one_shot") == [up(13 * n * es), 0, 0]
    per = _extension._C.two_shot_slice(13 * n, p, _extension.dtype_name(dtype))
    assert per * p >= 13 * n and (per * es) % 16 == 0 and per * es - (-(-13 * n // p)) * es < 16
    assert peer_memory.region_needs("matmul_all_reduce", p, 13, n, k, dtype, "two_shot") == [
        up(13 * n * es), 0, up(per * es)]
    block = -(-1001 // p)
    assert peer_memory.region_needs("matmul_all_reduce", p, 1001, n, k, dtype, "scatter_gather") == [
        up(block * n * es), up(p * block * n * es), 0]


def test_workspace_regions_grow_to_powers_of_two():
    mib = peer_memory.MIN_REGION_BYTES
    assert peer_memory.grown([0, 0, 0], [256, 0, 0]) == [mib, 0, 0]
    assert peer_memory.grown([mib, 0, 0], [mib, 0, 0]) is None
    assert peer_memory.grown([mib, 0, 0], [mib + 256, 3 * mib, 0]) == [2 * mib, 4 * mib, 0]
    assert peer_memory.grown([4 * mib, 8 * mib, 0], [mib, 0, 1]) == [4 * mib, 8 * mib, mib]
    # no workspace yet: a call that needs no region still gets one, for its flags
    assert peer_memory.grown(None, [0, 0, 0]) == [0, 0, 0]
    assert peer_memory.grown(None, [256, 0, mib + 1]) == [mib, 0, 2 * mib]
    assert peer_memory.grown(None, [4 * mib, 0, 0]) == [4 * mib, 0, 0]  # (a power of two is its own size)


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_ranks_that_grow_the_workspace_for_different_calls_all_raise(world):
    """The ranks' growth requests are compared before any buffer is freed or made: alike, they go
    on; a rank that differs makes every rank raise the same error, naming each rank's call."""
    results = world.run(check_growth_agreement)
    assert results[0][1] and len(set(results[q][1] for q in range(len(results)))) == 1
    assert all(ok for ok, _ in results)


def check_growth_agreement():
    r, p = rank_world()
    group = _collectives.resolve_group(None)
    mib = peer_memory.MIN_REGION_BYTES
    peer_memory.agree_on_growth("all_gather_matmul", [mib, 0, 0], "all_gather_matmul of x [4, 8]", group,
                                torch.device("cpu"))
    call = "all_gather_matmul of x [4, 8]" if r != p - 1 else "all_gather_matmul of x [3, 8]"
    with pytest.raises(RuntimeError) as info:
        peer_memory.agree_on_growth("all_gather_matmul", [mib, 0, 0], call, group, torch.device("cpu"))
    message = str(info.value)
    assert message.startswith(f"tp_kernels: fused all_gather_matmul: the ranks of group {group.group_name!r} "
                              "disagree on this call, so none of it ran and the group keeps its fused workspace")
    for q in range(p):
        shape = "[3, 8]" if q == p - 1 else "[4, 8]"
        assert f"rank {q}: all_gather_matmul of x {shape}, growing the regions to [{mib}, 0, 0]" in message
    # the same call growing to other sizes differs too (a rank whose workspace grew apart)
    with pytest.raises(RuntimeError, match=f"rank {p - 1}: x, growing the regions to \\[{2 * mib}, 0, 0\\]"):
        peer_memory.agree_on_growth("all_reduce", [2 * mib if r == p - 1 else mib, 0, 0], "x", group,
                                    torch.device("cpu"))
    # the group still works
    peer_memory.agree_on_growth("all_reduce", [mib, 0, 0], "x", group, torch.device("cpu"))
    return True, message


@built
def test_the_call_word_names_the_call():
    """What a fused call's ready flags carry: the same for the same call, another for any other
    op, algorithm, multiply or not, dtype, n, k, rows or chunking; never 0 (a clear flag) or 1
    (a release)."""
    C = _extension._C
    base = dict(op="matmul_all_reduce", algorithm="one_shot", gemm=True, dtype="bfloat16", n=64, k=32, bounds=[0, 16])
    word = C.fused_call_word(**base)
    assert word == C.fused_call_word(**base) and word > 1
    others = [dict(op="all_gather_matmul", algorithm=None), dict(op="matmul_reduce_scatter", algorithm=None),
              dict(algorithm="two_shot"), dict(algorithm="scatter_gather"), dict(gemm=False),
              dict(dtype="float16"), dict(dtype="float32"), dict(n=65), dict(k=33), dict(bounds=[0, 15]),
              dict(bounds=[0, 8, 16]), dict(bounds=[0, 16, 16])]
    words = [C.fused_call_word(**{**base, **o}) for o in others]
    assert word not in words and len(set(words)) == len(words)
    assert all(w > 1 for w in words)
    with pytest.raises(ValueError, match="algorithm: expected one of"):
        C.fused_call_word(**{**base, "algorithm": "three"})


def test_destroy_workspaces_frees_every_workspace_of_the_group(monkeypatch):
    released = []

    class FakeWorkspace:
        def __init__(self, group, name, fail=False):
            self.group, self.name, self.fail = group, name, fail

        def release(self, barrier):
            released.append((self.name, barrier))
            if self.fail == "device" or (self.fail == "peer" and barrier):
                raise RuntimeError("a peer is gone" if barrier else "the device did not finish")

    g1, g2 = object(), object()
    busy = FakeWorkspace(g2, "busy", fail="device")
    monkeypatch.setattr(peer_memory, "_workspaces", {1: FakeWorkspace(g1, "a"), 2: FakeWorkspace(g2, "b"),
                                                     3: FakeWorkspace(g1, "dead", fail="peer"), 4: busy})
    monkeypatch.setattr(peer_memory, "_unreleased", [])
    assert peer_memory.destroy_workspaces in tp_kernels.parallel_state._TEARDOWNS  # per destroyed group
    peer_memory.destroy_workspaces(g1)  # a failed barrier still frees this rank's buffer, without raising
    assert released == [("a", True), ("dead", True), ("dead", False)] and list(peer_memory._workspaces) == [2, 4]
    assert peer_memory._unreleased == []
    peer_memory.destroy_workspaces()
    assert released[3:] == [("b", True), ("busy", True), ("busy", False)] and not peer_memory._workspaces
    # a device that did not finish keeps its workspace, its buffers and context alive, not freed under its work
    assert peer_memory._unreleased == [busy]


@built
def test_control_block_starts_with_every_release_flag_set():
    C = _extension._C
    words = C.initial_control_block()
    assert len(words) == C.CONTROL_BYTES // 4
    # per region (export, inbox, export2): 8 ready flags (clear) then 8 release flags (set); the rest
    # (the one-shot kernel's block counters among it) zero
    expected = ([0] * C.MAX_RANKS + [1] * C.MAX_RANKS) * len(C.REGIONS)
    assert words[:len(expected)] == expected and not any(words[len(expected):])


@built
def test_native_fused_checks_before_touching_the_gpu():
    C = _extension._C
    with pytest.raises(RuntimeError, match=r"size must be in \[1, 8\], got 9"):
        C.PeerContext(0, 9, 0, [1] * 9, [0, 0, 0], 1.0, 1)
    with pytest.raises(RuntimeError, match=r"rank 2 is not in \[0, 2\)"):
        C.PeerContext(2, 2, 0, [1, 2], [0, 0, 0], 1.0, 1)
    with pytest.raises(RuntimeError, match="expected 2 workspace buffers, got 1"):
        C.PeerContext(0, 2, 0, [1], [0, 0, 0], 1.0, 1)
    with pytest.raises(RuntimeError, match="null workspace buffer of rank 1"):
        C.PeerContext(0, 2, 0, [1, 0], [0, 0, 0], 1.0, 1)
    with pytest.raises(RuntimeError, match="expected 3 region sizes"):
        C.PeerContext(0, 2, 0, [1, 2], [0, 0], 1.0, 1)
    with pytest.raises(RuntimeError, match="multiples of 256 bytes"):
        C.PeerContext(0, 2, 0, [1, 2], [100, 0, 0], 1.0, 1)
    with pytest.raises(RuntimeError, match="timeout_s must be positive"):
        C.PeerContext(0, 2, 0, [1, 2], [0, 0, 0], 0.0, 1)
    for sharing in (0, 3):
        with pytest.raises(RuntimeError, match=rf"sharing \(the ranks on this GPU\) must be in \[1, 2\], got {sharing}"):
            C.PeerContext(0, 2, 0, [1, 2], [0, 0, 0], 1.0, sharing)
    with pytest.raises(RuntimeError, match="a CUDA IPC handle is 64 bytes, got 3"):
        C.ipc_open(b"abc", 0)
    with pytest.raises(ValueError, match=r"p: must be in \[1, 8\], got 9"):
        C.fused_region_needs("all_gather_matmul", 9, 8, 8, 8, "float32")
    with pytest.raises(ValueError, match="algorithm: expected one of one_shot, two_shot, scatter_gather, got 'three'"):
        C.fused_region_needs("matmul_all_reduce", 2, 8, 8, 8, "float32", "three")
    with pytest.raises(ValueError, match="op: expected one of all_gather_matmul, matmul_reduce_scatter, "
                                         "matmul_all_reduce, got 'matmul'"):
        C.fused_region_needs("matmul", 2, 8, 8, 8, "float32")
    with pytest.raises(ValueError, match="dtype: unknown dtype 'float64'"):
        C.fused_region_needs("all_gather_matmul", 2, 8, 8, 8, "float64")


@built
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_fused_native_calls_without_a_gpu_are_clear_errors():
    C = _extension._C
    with pytest.raises(RuntimeError, match=r"cudaGetDevice.*failed: CUDA error"):
        C.PeerContext(0, 2, 0, [1, 2], [0, 0, 0], 1.0, 1)
    with pytest.raises(RuntimeError, match=r"cudaGetDevice.*failed: CUDA error"):
        C.workspace_alloc(1 << 20, 0)


@built
def test_the_fused_ops_run_in_phases():
    C = _extension._C
    assert [C.fused_phases("all_gather_matmul"), C.fused_phases("matmul_reduce_scatter")] == [2, 2]
    assert [C.fused_phases("matmul_all_reduce", a) for a in C.ALL_REDUCE_ALGORITHMS] == [2, 3, 3]
    with pytest.raises(ValueError, match="algorithm: expected one of"):
        C.fused_phases("matmul_all_reduce", "ring")
    assert C.ALL_PHASES == -1


@pytest.mark.parametrize("phases", [[2, 2], [2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3], [1], []])
def test_virtual_ranks_enqueue_every_ranks_phase_before_the_next_phase_of_any(phases):
    """Phase k of every rank comes before phase k + 1 of any, so every signal a wait needs (sent in
    an earlier phase) is enqueued before that wait: one host thread can drive the ranks."""
    from tp_kernels.testing import phase_order

    order = phase_order(phases)
    assert sorted(order) == [(q, k) for q, n in enumerate(phases) for k in range(n)]  # each once
    position = {step: i for i, step in enumerate(order)}
    for q, n in enumerate(phases):
        for k in range(n):
            assert all(position[(q, k)] < position[(r, k + 1)] for r in range(len(phases)) if k + 1 < phases[r])
            if k:
                assert position[(q, k - 1)] < position[(q, k)]  # a rank's own phases in order


def test_the_rank_order_sum_adds_in_float32_in_rank_order_then_rounds():
    """The GPU tests' expected fused all-reduce: the parts added in float32 (bfloat16 adding 256 + 1
    + 1 would stay at 256), in rank order (1e8 + 1 - 1e8 is 0 in float32, 1e8 - 1e8 + 1 is 1),
    then rounded to the dtype asked."""
    from tp_kernels.testing import rank_order_sum

    parts = [torch.full((3,), v, dtype=torch.bfloat16) for v in (256.0, 1.0, 1.0)]
    got = rank_order_sum(parts, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.tolist() == [258.0] * 3
    parts = [torch.tensor([v]) for v in (1e8, 1.0, -1e8)]
    assert rank_order_sum(parts, torch.float32).item() == 0.0
    assert rank_order_sum([parts[0], parts[2], parts[1]], torch.float32).item() == 1.0  # (1e8 - 1e8 + 1)
    assert rank_order_sum(parts, torch.float64).dtype == torch.float64


def test_virtual_ranks_check_their_arguments():
    if _extension._C is None:
        with pytest.raises(RuntimeError, match="extension is unavailable"):
            VirtualRanks(2)
        return
    for p in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match=r"p: expected an int in \[1, 8\]"):
            VirtualRanks(p)
    with pytest.raises(ValueError, match="timeout_s: expected a positive number"):
        VirtualRanks(2, timeout_s=0)


def test_virtual_ranks_keep_what_they_could_not_free(monkeypatch):
    """close: once the device has finished, every rank's buffer is freed; a device that has not
    finished within the timeout keeps the buffers and contexts (peer_memory._unreleased), raises,
    and the object starts afresh."""
    from tp_kernels.testing import virtual_ranks

    freed, waits, outcome = [], [], {}

    def synchronize(what, device):
        assert what.startswith("VirtualRanks.close") and device == torch.device("cuda", 1)
        waits.append(what)
        if "error" in outcome:
            raise outcome["error"]

    monkeypatch.setattr(virtual_ranks, "synchronize", synchronize)
    monkeypatch.setattr(_extension, "require", lambda: SimpleNamespace(
        workspace_free=lambda base, device: freed.append((base, device))))
    monkeypatch.setattr(peer_memory, "_unreleased", [])

    def ranks():
        vr = object.__new__(VirtualRanks)
        vr.device, vr.bases, vr.regions, vr.contexts = torch.device("cuda", 1), [11, 12], [64, 0, 0], ["c0", "c1"]
        return vr

    vr = ranks()
    vr.close()
    assert freed == [(11, 1), (12, 1)] and (vr.bases, vr.regions, vr.contexts) == ([], None, [])
    vr.close()  # nothing left: nothing waited for or freed again
    assert len(waits) == 1 and len(freed) == 2 and peer_memory._unreleased == []
    outcome["error"] = RuntimeError("did not complete within 0.2 s")
    busy = ranks()
    with pytest.raises(RuntimeError, match="did not complete within 0.2 s"):
        busy.close()
    assert len(waits) == 2 and len(freed) == 2 and peer_memory._unreleased == [(["c0", "c1"], [11, 12])]
    assert (busy.bases, busy.regions, busy.contexts) == ([], None, [])


_EXIT_SCRIPT = """
import atexit, os, sys, types
from tp_kernels import _extension
from tp_kernels.backends import peer_memory

class Context:  # stands in for _C.PeerContext, whose destructor waits for the device with no limit
    def __init__(self, rank, *args):
        self.name = "made" if rank == 0 else "other"
    def __del__(self):
        os.write(1, f"destroyed {self.name}\\n".encode())

_extension.require = lambda: types.SimpleNamespace(PeerContext=Context)
made = peer_memory.new_context(0, 2, 0, [1, 2], [0, 0, 0], 1.0, 1)
other = Context(1)  # not made by new_context
peer_memory._unreleased.extend([made, other])  # a module's list: cleared when the interpreter ends
del made, other
if sys.argv[1] == "unhooked":
    atexit.unregister(peer_memory._keep_contexts_at_exit)
print("exiting", flush=True)
"""


@pytest.mark.parametrize("hooked", [True, False])
def test_contexts_alive_at_exit_are_never_destroyed(tmp_path, hooked):
    """A PeerContext new_context made and still alive when the interpreter exits is never
    destroyed (its destructor would wait for the device with no limit): the process's end frees it.
    Without the exit hook, the interpreter's teardown destroys it, as it does a context made elsewhere."""
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), "hooked" if hooked else "unhooked"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "exiting" and "destroyed other" in lines[1:]
    assert ("destroyed made" in lines) is not hooked, done.stdout


@pytest.mark.parametrize("world", [2], indirect=True)
def test_all_gather_bytes(world):
    assert world.run(check_all_gather_bytes) == [[b"r0-x", b"r1-x"]] * 2


def check_all_gather_bytes():
    r, _ = rank_world()
    out = _collectives.all_gather_bytes(f"r{r}-x".encode(), _collectives.resolve_group(None), torch.device("cpu"))
    with pytest.raises(ValueError, match="at least one byte"):
        _collectives.all_gather_bytes(b"", None, torch.device("cpu"))
    return out
