"""``backend="auto"``'s measured choice (tp_kernels.autotune): its candidates, the measurement
on the first call of a shape class and its reuse, the ranks' agreement, and when it does not
measure. On the CPU the candidates that can be measured are the reference and the portable
pipelined schedule (named through set_auto_candidates); the fused and native ones need a GPU.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import test_ops
from helpers import assert_close, rank_world
from tp_kernels import _comm, autotune, ops
from tp_kernels.backends import fused

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
    impls, why = autotune.candidates(x, x, None, 2)
    assert impls == ["reference"]
    assert any(w.startswith("fused: ") and "not on a CUDA device" in w for w in why)
    assert any(w.startswith("pipelined: ") and "not on a CUDA device" in w for w in why)
    assert autotune.candidates(x, x, None, 1) == (["reference"], ["one rank, nothing to overlap"])
    autotune.set_auto_candidates(["reference", "pipelined"])  # the order named does not matter
    assert autotune.candidates(x, x, None, 2)[0] == ["pipelined", "reference"]
    autotune.set_auto_candidates(["pipelined"])
    assert autotune.candidates(x, x, None, 2)[0] == ["pipelined"]
    autotune.set_auto_candidates(["fused"])  # cannot run here: the reference does
    impls, why = autotune.candidates(x, x, None, 2)
    assert impls == ["reference"] and any("fused: " in w and "CUDA" in w for w in why)
    autotune.set_auto_candidates(None)
    monkeypatch.setenv("TP_KERNELS_AUTO_CANDIDATES", "reference, pipelined")
    assert autotune.get_auto_candidates() == ("reference", "pipelined")
    assert autotune.candidates(x, x, None, 2)[0] == ["pipelined", "reference"]


def test_candidates_when_the_fast_paths_are_supported(monkeypatch):
    """Named fast paths are candidates without their TP_KERNELS_AUTO_* switch; by default they
    need it; "pipelined" is the native path when it is supported."""
    x = torch.randn(4, 8)
    monkeypatch.setattr(fused, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.setattr(autotune.native, "unsupported_reason", lambda x, w, g: None)
    monkeypatch.setattr(fused, "AUTO_DEFAULT", False)
    monkeypatch.setattr(autotune.native, "AUTO_DEFAULT", False)
    impls, why = autotune.candidates(x, x, None, 2)
    assert impls == ["reference"] and why[0].startswith("fused: not switched on for 'auto' (TP_KERNELS_AUTO_FUSED=1")
    assert why[1] == f"pipelined: {autotune.native.AUTO_DISABLED_REASON}"
    monkeypatch.setenv("TP_KERNELS_AUTO_NATIVE", "1")
    assert autotune.candidates(x, x, None, 2)[0] == ["native", "reference"]
    monkeypatch.setenv("TP_KERNELS_AUTO_FUSED", "1")
    assert autotune.candidates(x, x, None, 2)[0] == ["fused", "native", "reference"]
    monkeypatch.delenv("TP_KERNELS_AUTO_NATIVE")
    monkeypatch.delenv("TP_KERNELS_AUTO_FUSED")
    autotune.set_auto_candidates(["fused", "pipelined"])
    assert autotune.candidates(x, x, None, 2)[0] == ["fused", "native"]


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


def test_each_fused_all_reduce_algorithm_is_a_variant(monkeypatch):
    impls = ["fused", "native", "reference"]
    assert autotune._variants("matmul_all_reduce", impls, 1, 2) == [
        "fused:one_shot", "fused:two_shot", "native", "reference"]  # scatter_gather needs m >= p
    assert autotune._variants("matmul_all_reduce", impls, 8, 2) == [
        "fused:one_shot", "fused:two_shot", "fused:scatter_gather", "native", "reference"]
    assert autotune._variants("matmul_reduce_scatter", impls, 8, 2) == impls
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "two_shot")  # forced: not measured
    assert autotune._variants("matmul_all_reduce", impls, 8, 2) == impls


def test_a_measured_algorithm_is_what_the_fused_all_reduce_runs(monkeypatch):
    big = fused.TWO_SHOT_MAX_BYTES  # elements of bf16: twice the threshold in bytes
    assert fused.all_reduce_algorithm(big, 1, 2, torch.bfloat16) == "scatter_gather"
    fused.measured_algorithms[fused.measured_key(big, 1, 2, torch.bfloat16)] = "one_shot"
    assert fused.all_reduce_algorithm(big, 1, 2, torch.bfloat16) == "one_shot"
    assert fused.all_reduce_algorithm(big - 1, 1, 2, torch.bfloat16) == "one_shot"  # same size class
    assert fused.all_reduce_algorithm(big, 1, 4, torch.bfloat16) == "scatter_gather"  # another p
    monkeypatch.setenv("TP_KERNELS_FUSED_ALL_REDUCE", "two_shot")  # the environment wins
    assert fused.all_reduce_algorithm(big, 1, 2, torch.bfloat16) == "two_shot"
    autotune.forget()
    assert not fused.measured_algorithms
    assert [fused.size_class(m) for m in (1, 2, 3, 4, 5, 4096, 4097)] == [1, 2, 4, 4, 8, 4096, 8192]
    with pytest.raises(ValueError, match="algorithm: scatter_gather needs at least p = 4 rows, got 3"):
        fused.check_algorithm("scatter_gather", 3, 4)
    with pytest.raises(ValueError, match="algorithm: expected one of"):
        fused.check_algorithm("ring", 8, 2)


def test_forget_drops_one_groups_decisions():
    g1, g2 = SimpleNamespace(group_name="a"), SimpleNamespace(group_name="b")

    def decision(name, algorithm):
        return autotune.Decision("matmul_all_reduce", name, "cpu", torch.float32, 1, 8, 4, 4, False,
                                 ("fused:one_shot", "reference"), (1.0, 2.0), "fused", algorithm)

    autotune._decisions.update({("k1",): (g1, decision("a", "one_shot")), ("k2",): (g2, decision("b", None))})
    fused.measured_algorithms[fused.measured_key(8, 4, 1, torch.float32)] = "one_shot"
    autotune.forget(g1)
    assert [d.group_name for d in autotune.decisions()] == ["b"] and not fused.measured_algorithms
    autotune.forget()
    assert autotune.decisions() == []


def test_no_measurement_while_compiling(monkeypatch):
    """While torch.compile traces (or a graph is captured) the first candidate runs, unless the
    class was measured before; nothing is remembered."""
    group = SimpleNamespace(group_name="g")
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert autotune.choose("matmul_all_reduce", ["pipelined", "reference"], x, w, None, group, 2) == "pipelined"
    assert autotune.decisions() == []
    key = ("matmul_all_reduce", _comm.group_key(group, x.device), x.dtype, 4, 3, 8, False, ("pipelined", "reference"))
    autotune._decisions[key] = (group, autotune.Decision("matmul_all_reduce", "g", "cpu", x.dtype, 2, 4, 3, 8, False,
                                                         ("pipelined", "reference"), (2.0, 1.0), "reference", None))
    assert autotune.choose("matmul_all_reduce", ["pipelined", "reference"], x, w, None, group, 2) == "reference"
    autotune.set_autotune(False)
    assert autotune.choose("matmul_all_reduce", ["pipelined", "reference"], x, w, None, group, 2) == "pipelined"


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
            assert all(t > 0 for t in d.times_s) and (d.choice, d.algorithm) == (best.partition(":")[0],
                                                                                 best.partition(":")[2] or None)
        lw = [d for d in seen if d.op == "linear_with_grad_all_reduce"]
        assert [(d.n, d.k) for d in lw] == [(12, 6)] * 2  # its backward's all-reduce: (m, 6) x (6, 12)
        return [(d.op, d.m_class, d.n, d.k, d.variants, d.times_s, d.choice) for d in seen]
    finally:
        autotune.set_auto_candidates(None)
        autotune.forget()


def test_measured_choice(world2):
    per_rank = world2.run(check_measured_choice)
    assert per_rank[0] == per_rank[1]  # the same figures and choices on both ranks
    assert {variants for _, _, _, _, variants, *_ in per_rank[0]} == {("pipelined", "reference")}
    # rows: 3 m_per_rank gathered by all_gather_matmul, 3 m_per_rank p for the others
    assert [(op, m) for op, m, *_ in per_rank[0]] == [(op, m) for op in OPS
                                                       for m in ((16, 64) if op == "all_gather_matmul" else (32, 128))]


def check_the_slowest_rank_decides():
    """Rank 0 finds the pipelined schedule slow, rank 1 the reference, slower still: each alone
    would choose differently; both choose the pipelined schedule, whose slowest rank is faster."""
    r, _ = rank_world()
    slow = {0: ("pipelined", 0.15), 1: ("reference", 0.3)}[r]
    run_variant = autotune._run_variant

    def delayed(primitive, variant, *args):
        out = run_variant(primitive, variant, *args)
        if variant == slow[0]:
            time.sleep(slow[1])  # after the collectives: the other rank does not wait for it
        return out

    autotune._run_variant = delayed
    autotune.set_auto_candidates(["reference", "pipelined"])
    try:
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        assert ops.matmul_all_reduce(x, w, backend="auto").shape == (4, 6)
        (d,) = autotune.decisions()
        assert d.times_s[d.variants.index("reference")] >= 0.3
        assert 0.15 <= d.times_s[d.variants.index("pipelined")] < 0.3
        return d.choice
    finally:
        autotune._run_variant = run_variant
        autotune.set_auto_candidates(None)
        autotune.forget()


def test_the_slowest_rank_decides(world2):
    assert world2.run(check_the_slowest_rank_decides) == ["pipelined", "pipelined"]


def check_ranks_that_disagree_get_an_error():
    r, _ = rank_world()
    autotune.set_auto_candidates(["reference", "pipelined"])
    try:
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        bias = torch.randn(6) if r == 1 else None
        with pytest.raises(RuntimeError, match=r"backend='auto': the ranks of group .* disagree on the call to "
                                               r"measure.*rank 0: matmul_all_reduce m=4 n=6 k=8 torch.float32 "
                                               r"bias=False p=2 candidates=pipelined,reference; rank 1: .*bias=True"):
            ops.matmul_all_reduce(x, w, bias, backend="auto")
        assert autotune.decisions() == []
        # nothing was left in flight: the group still works
        return ops.matmul_all_reduce(x, w, backend="reference").shape
    finally:
        autotune.set_auto_candidates(None)


def test_ranks_that_disagree_get_an_error(world2):
    assert world2.run(check_ranks_that_disagree_get_an_error) == [(4, 6), (4, 6)]


def check_without_measuring():
    autotune.set_auto_candidates(["reference", "pipelined"])
    autotune.set_autotune(False)
    try:
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        y = ops.matmul_all_reduce(x, w, backend="auto")
        assert_close("auto unmeasured y", y, ops.matmul_all_reduce(x, w, backend="reference").double())
        return ops.select_backend("matmul_all_reduce", "auto", x, 2, _comm.resolve_group(None), w), autotune.decisions()
    finally:
        autotune.set_auto_candidates(None)
        autotune.set_autotune(None)


def test_without_measuring_the_first_candidate_runs(world2):
    assert world2.run(check_without_measuring) == [("pipelined", [])] * 2


def test_the_benchmark_reports_what_auto_measured():
    from tp_kernels.bench import measure

    probe = torch.empty(4, 8)
    assert measure._resolved("matmul_all_reduce", "auto", probe, 2, None, []) == "reference"
    autotune.set_auto_candidates(["reference", "pipelined"])
    made = [autotune.Decision("matmul_all_reduce", "0", "cpu", torch.float32, 2, 4, 8, 8, False,
                              ("pipelined", "reference"), (2.0, 1.0), "reference", None)]
    assert measure._resolved("matmul_all_reduce", "auto", probe, 2, None, made) == "reference (measured)"
    assert measure._resolved("matmul_all_reduce", "auto", probe, 2, None, []) == "measured before"
    assert measure._resolved("matmul_all_reduce", "pipelined", probe, 2, None, []) == "pipelined"
