"""The performance model, the benchmark cases and the report's metrics (no distributed runs,
except the main job's end-to-end check)."""

import contextlib
import csv
import io
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings as hypothesis_settings, strategies as st

from helpers import matrix_products
from tp_kernels import perf_model as pm
from tp_kernels.bench import cases, communicator, report
from tp_kernels.schedule import DEFAULT_NUM_CHUNKS


def _const_gemm(seconds_per_row):
    return lambda m, n, k, dtype: seconds_per_row * m


def test_simulate_two_stage_pipeline_by_hand():
    # gemm0 [0,1], comm0 [1,3], gemm1 [1,2], comm1 [3,5]
    tasks = [pm.Task("g0", "compute", 1.0), pm.Task("c0", "link", 2.0, (0,)),
             pm.Task("g1", "compute", 1.0), pm.Task("c1", "link", 2.0, (2,))]
    assert pm.simulate(tasks) == pytest.approx(5.0)
    # g1 overlaps c0, so it takes 2: [1,3]; c1 still starts at 3
    assert pm.simulate(tasks, gemm_slowdown=2.0) == pytest.approx(5.0)
    # with a slow first GEMM only the compute chain matters up to the last comm
    tasks[0].duration = 4.0
    assert pm.simulate(tasks) == pytest.approx(4 + 2 + 2)
    assert pm.simulate(pm._serial(tasks)) == pytest.approx(4 + 2 + 1 + 2)
    for deps in ((1,), (0,)):  # on a later task, or on itself
        with pytest.raises(ValueError, match="task 0 \\(a\\) depends on a later task"):
            pm.simulate([pm.Task("a", "compute", 1.0, deps), pm.Task("b", "link", 1.0)])


def test_virtual_overlap_model_by_hand():
    """The fused ops of virtual ranks on one GPU as task graphs (perf_model.virtual_overlap_tasks),
    worked by hand at p = 2."""
    # all-gather, t_gemm 4 (1 a GEMM), t_comm 1 (a shard copy 0.5; publishing is two): the link runs
    # publish 0 [0,1], publish 1 [1,2], the pulls [2,2.5] and [2.5,3]; the GEMMs of the own shards
    # [1,2] and [2,3], of the pulled ones [3,4] and [4,5]
    tasks = pm.virtual_overlap_tasks("all_gather_matmul", 2, 4.0, 1.0)
    assert [t.resource for t in tasks] == ["link"] * 4 + ["compute"] * 4
    assert pm.simulate(tasks) == pytest.approx(5.0)
    # two GEMMs run beside a copy ([1,2] beside publish 1, [2,3] beside the pulls): a 25 % loss of the
    # GEMMs' 4 is 1 on those 2, each 1.5 times as long: [1,2.5], [2.5,4], then [4,5], [5,6]
    assert pm.slowdown_factor(tasks, 0.25, 4.0) == pytest.approx(1.5)
    assert pm.predict_virtual_overlap("all_gather_matmul", 2, 4.0, 1.0, 0.25) == pytest.approx(6.0)
    # at p = 3, GEMMs short beside the copies (0.1 each, a shard copy 1): publishing [0,6], the first
    # pulls [6,9], the second [9,12]; each rank's GEMM of a shard waits for that shard: the last [12,12.1]
    assert pm.simulate(pm.virtual_overlap_tasks("all_gather_matmul", 3, 0.9, 6.0)) == pytest.approx(12.1)
    # reduce-scatter, t_comm 10 over 2 pushes of 2 blocks' bytes and 2 sums of 3: a push 2, a sum 3;
    # rank 0's GEMM of block 1 [0,1] pushed [1,3]; rank 1's of block 0 [1,2] pushed [3,5]; the own
    # blocks [2,3] and [3,4]; rank 0's sum waits for its push [5,8], rank 1's [8,11]
    tasks = pm.virtual_overlap_tasks("matmul_reduce_scatter", 2, 4.0, 10.0)
    assert sorted(t.duration for t in tasks if t.resource == "link") == [2.0, 2.0]
    assert pm.simulate(tasks) == pytest.approx(11.0)
    # the three GEMMs beside the pushes lose 75 % of 4: each twice as long, the sums from 7: 13
    assert pm.slowdown_factor(tasks, 0.75, 4.0) == pytest.approx(2.0)
    assert pm.predict_virtual_overlap("matmul_reduce_scatter", 2, 4.0, 10.0, 0.75) == pytest.approx(13.0)
    # nothing to copy: the GEMMs alone, whatever the slowdown
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        assert pm.predict_virtual_overlap(op, 8, 5.0, 0.0, 0.5) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="op: 'matmul_all_reduce'"):
        pm.virtual_overlap_tasks("matmul_all_reduce", 2, 1.0, 1.0)


def test_link_ring_formulas():
    link = pm.Link("l", bandwidth_gbps=100.0, efficiency=0.5, step_us=2.0, launch_us=10.0)
    bw = 50e9
    s = 8e6
    assert link.time("all_gather", s, 8) == pytest.approx(10e-6 + 7 * (2e-6 + s / 8 / bw))
    assert link.time("reduce_scatter", s, 8) == pytest.approx(link.time("all_gather", s, 8))
    assert link.time("all_reduce", s, 8) == pytest.approx(10e-6 + 14 * (2e-6 + s / 8 / bw))
    assert link.time("ring_step", s, 8) == pytest.approx(10e-6 + 2e-6 + s / bw)
    assert link.time("all_reduce", s, 1) == 0.0


def test_link_calibration_recovers_a_line():
    pts = {"all_reduce": [(b, 3e-5 + 2e-10 * b) for b in (1e3, 1e5, 1e7)],
           "all_gather": [(1e4, 1e-4), (2e4, 2e-4)]}
    link = pm.Link.calibrated("fit", pts)
    assert link.fits["all_reduce"] == pytest.approx((3e-5, 2e-10))
    assert link.time("all_reduce", 5e6, 2) == pytest.approx(3e-5 + 1e-3)
    # a ring step of s bytes is one of the p-1 steps of an all-gather of p*s bytes: a (p-1)th of its
    # launch and of its bytes' time
    assert link.time("ring_step", 1e4, 2) == pytest.approx(1e-4 * 2)
    ag = pm.Link.calibrated("fit", {"all_gather": [(1e4, 3e-5 + 1e-4), (2e4, 3e-5 + 2e-4)]})
    assert ag.time("ring_step", 1e4, 4) == pytest.approx(3e-5 / 3 + 1e-8 * 1e4 * 4 / 3)
    # the line's launch and slope are never negative: times that grow faster than the bytes start at 0,
    # times that fall are their mean
    assert pm.Link.calibrated("fit", {"all_reduce": [(1e3, 0.5e-6), (2e3, 2e-6)]}).fits["all_reduce"] == \
        pytest.approx((0.0, 1.5e-9))
    assert pm.Link.calibrated("fit", {"all_reduce": [(1e3, 3e-6), (2e3, 1e-6)]}).fits["all_reduce"] == \
        pytest.approx((2e-6, 0.0))
    with pytest.raises(ValueError, match="two"):
        pm.Link.calibrated("fit", {"all_reduce": [(1.0, 1.0)]})


def test_measured_gemm_lookup_and_scaling():
    gemm = pm.MeasuredGemm({(1024, 64, 32, "float32"): 2e-3, (256, 64, 32, "float32"): 0.6e-3})
    assert gemm(1024, 64, 32, "float32") == 2e-3
    assert gemm(512, 64, 32, "float32") == pytest.approx(1e-3)  # from the nearest m, proportional
    assert gemm(16, 64, 32, "float32") == pytest.approx(0.6e-3)  # never below the smallest measured
    assert gemm(0, 64, 32, "float32") == 0.0
    with pytest.raises(KeyError):
        gemm(8, 7, 7, "float32")
    # a (n, k, dtype) never measured: the fallback's time; one measured: never the fallback's
    fallback = pm.MeasuredGemm(gemm.times, fallback=lambda m, n, k, dtype: 1.0 + m)
    assert fallback(8, 7, 7, "float32") == 9.0 and fallback(8, 64, 32, "bfloat16") == 9.0
    assert fallback(512, 64, 32, "float32") == pytest.approx(1e-3)


def test_roofline_gemm_by_hand():
    """The roofline: the slower of the FLOPs at its share of the GPU's peak and the bytes at its
    share of HBM, plus one launch; nothing where there is no product (m, n or k zero)."""
    h100 = pm.GPUS["h100"]
    gemm = pm.RooflineGemm(h100, efficiency=0.5, hbm_efficiency=0.8, launch_us=3.0)
    big = 2.0 * 8192 ** 3 / (0.5 * 989.4e12)  # compute-bound
    assert gemm(8192, 8192, 8192, "bfloat16") == pytest.approx(big + 3e-6, rel=1e-12)
    thin = 2 * (16 * 8192 + 8192 * 8192 + 16 * 8192) / (0.8 * 3.35e12)  # a decode GEMM: memory-bound
    assert gemm(16, 8192, 8192, "bfloat16") == pytest.approx(thin + 3e-6, rel=1e-12)
    assert gemm(16, 8192, 8192, "float32") == pytest.approx(2 * thin + 3e-6, rel=1e-12)  # 4 bytes an element
    assert gemm(0, 8192, 8192, "bfloat16") == gemm(16, 0, 8192, "bfloat16") == gemm(16, 8192, 0, "bfloat16") == 0.0


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
@pytest.mark.parametrize("p,chunks", [(2, None), (4, 3), (8, 4)])
def test_pipelined_ops_follow_the_schedule_and_beat_naive(op, p, chunks):
    m, k, n = 64 * p, 32 * p, 48 * p
    gemm = _const_gemm(1e-6)
    link = pm.Link("l", 10.0, 1.0, 1.0, 1.0)
    tasks = pm.op_tasks(op, m, k, n, p, "bfloat16", gemm, link, chunks)
    c = chunks or DEFAULT_NUM_CHUNKS[op]
    gemms = [t for t in tasks if t.resource == "compute"]
    comms = [t for t in tasks if t.resource == "link"]
    if op == "all_gather_matmul":
        assert (len(gemms), len(comms)) == (p * c, (p - 1) * c)
    else:
        assert len(gemms) == len(comms) == c
    # every row is multiplied once
    assert sum(t.duration for t in gemms) == pytest.approx(1e-6 * m)
    naive = pm.naive_op_tasks(op, m, k, n, p, "bfloat16", gemm, link)
    t_pipe, t_naive = pm.simulate(tasks), pm.simulate(naive)
    busy_gemm = sum(t.duration for t in gemms)
    assert max(busy_gemm, max(t.duration for t in comms)) <= t_pipe
    assert t_naive == pytest.approx(sum(t.duration for t in naive))
    if op != "all_gather_matmul":  # same bytes in fewer collectives: pipelining must win here
        assert t_pipe < t_naive


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_tasks_count_three_gemms_of_flops(kind, sp):
    m, k, n, p = 256, 128, 384, 4
    flops_per_s = 1e12
    gemm = lambda mm, nn, kk, dtype: 2.0 * mm * nn * kk / flops_per_s  # noqa: E731
    link = pm.LINKS["nvlink4"]
    for schedule in ("naive", "pipelined"):
        tasks = pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, link, schedule)
        busy = sum(t.duration for t in tasks if t.resource == "compute")
        assert busy == pytest.approx(3 * 2.0 * m * k * n / p / flops_per_s)
        kinds = sorted(t.name.split()[0] for t in tasks if t.resource == "link")
        assert kinds, "a layer on 4 ranks communicates"
    # the collectives of forward and backward, naive or in chunks, move what the layer's do: on a link
    # of no latency, whose times add up by the bytes, the naive and the pipelined schedules' equal
    # those of the layer's collectives whole (column: x gathered, and again for wgrad, the input's
    # gradient reduce-scattered; or that gradient all-reduced; row: its output reduce-scattered and
    # the output's gradient gathered; or the output all-reduced)
    by_bytes = pm.Link("bytes", 100.0, 1.0, 0.0, 0.0)
    x, y = m * k * 2, m * n * 2  # bf16 bytes of the input and of the output
    whole = {("column", True): [("all_gather", x), ("all_gather", x), ("reduce_scatter", x)],
             ("column", False): [("all_reduce", x)],
             ("row", True): [("reduce_scatter", y), ("all_gather", y)],
             ("row", False): [("all_reduce", y)]}[kind, sp]
    want = sum(by_bytes.time(c, nbytes, p) for c, nbytes in whole)
    for schedule in ("naive", "pipelined"):
        tasks = pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, by_bytes, schedule)
        assert sum(t.duration for t in tasks if t.resource == "link") == pytest.approx(want), schedule
    # the pipelined forward is the op's own schedule, and nothing of the backward starts before the
    # forward's output is whole (the column's x re-gathered, the row's dgrad on the summed output's gradient)
    op = {("column", True): "all_gather_matmul", ("row", True): "matmul_reduce_scatter",
          ("row", False): "matmul_all_reduce"}.get((kind, sp))
    tasks = pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, link)
    forward = pm.op_tasks(op, m, k, n, p, "bfloat16", gemm, link) if op else [tasks[0]]
    assert [(t.resource, t.duration, t.deps) for t in tasks[:len(forward)]] == \
        [(t.resource, t.duration, t.deps) for t in forward]
    start, end = pm._schedule(tasks, [t.duration for t in tasks])
    done = max(end[:len(forward)])
    assert all(s >= done * (1 - 1e-12) for s in start[len(forward):]), [t.name for t in tasks[len(forward):]]
    if kind == "column" and sp:  # wgrad multiplies x re-gathered: after it, on a link slower than the dgrad GEMMs too
        tasks = pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, pm.Link("slow", 1e-3, 1.0, 0.0, 0.0))
        start, end = pm._schedule(tasks, [t.duration for t in tasks])
        names = [t.name for t in tasks]
        assert start[names.index("wgrad")] >= end[names.index("all-gather x")]
    # bandwidth-bound sizes: overlap wins; tiny sizes: four chunks pay four latencies and lose
    m, k, n = 8192, 4096, 8192
    naive = pm.simulate(pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, link, "naive"))
    assert pm.simulate(pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, link)) < naive
    if kind == "column" and not sp:
        m, k, n = 16, 128, 384
        naive = pm.simulate(pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, link, "naive"))
        assert pm.simulate(pm.layer_tasks(kind, sp, m, k, n, p, "bfloat16", gemm, link)) > naive


def test_transformer_projection_is_labelled_and_lists_inputs():
    proj = pm.project_transformer_layer(pm.MODELS["llama3-70b"], 8, 8192, 8192, pm.GPUS["h100"], pm.LINKS["nvlink4"])
    assert "PROJECTION" in proj["label"]
    for key in ("gpu", "link", "gemm_times", "gemm_slowdown_under_overlap", "tp", "tokens_m"):
        assert key in proj["inputs"]
    assert [r["linear"] for r in proj["linears"]] == ["qkv", "out", "up", "down"]
    assert proj["naive_ms"] == pytest.approx(sum(r["naive_ms"] for r in proj["linears"]) + proj["attention_ms"])
    # the attention core: forward and backward 3.5 times the forward's causal 2 m s h d FLOPs, at 50 %
    # of the bf16 peak, each rank its heads: 64 heads of 128 over 8 ranks
    gpu = pm.GPUS["h100"]
    assert proj["attention_ms"] == pytest.approx(3.5 * 2 * 8192 * 8192 * 8 * 128 / (0.5 * gpu.tflops["bfloat16"] * 1e12)
                                                 * 1e3)
    # the GEMMs beside communication slowed as asked: the overlapped schedule's, not the naive one's
    slower = pm.project_transformer_layer(pm.MODELS["llama3-70b"], 8, 8192, 8192, gpu, pm.LINKS["nvlink4"],
                                          gemm_slowdown=1.5)
    assert slower["overlapped_ms"] > proj["overlapped_ms"] and slower["naive_ms"] == proj["naive_ms"]
    assert proj["overlapped_ms"] < proj["naive_ms"]
    text = pm.format_projection(proj)
    assert "PROJECTION" in text and "projected" in text


def test_perf_model_cli(capsys):
    assert pm.main(["--link", "ib400", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# PROJECTION") and "InfiniBand" in out
    for argv, message in ((["--tp", "3"], "--tp: llama3-70b has heads = 64, not divisible by 3"),
                          (["--tp", "4", "--tokens", "4098"], "--tokens: 4098 is not divisible by --tp 4")):
        with pytest.raises(SystemExit):
            pm.main(argv)
        assert message in capsys.readouterr().err


def test_cases_shapes_and_filters():
    cs = cases.model_cases(["llama3-70b"], [1, 16], cases.TARGETS, p=8)
    by = {(c.target, c.m) for c in cs}
    # m = 1 cannot be split 8 ways: only the non-SP targets run there
    assert {t for t, m in by if m == 1} == {"matmul_all_reduce", "column", "row"}
    assert len({t for t, m in by if m == 16}) == len(cases.TARGETS)
    ag = next(c for c in cs if c.target == "all_gather_matmul" and c.m == 16)
    assert (ag.k, ag.n) == (8192, 28672) and ag.local(8) == ((2, 8192), (3584, 8192))
    rs = next(c for c in cs if c.target == "matmul_reduce_scatter" and c.m == 16)
    assert (rs.k, rs.n) == (28672, 8192) and rs.local(8) == ((16, 3584), (8192, 3584))
    assert rs.gemm_flops(8) == 2.0 * 16 * 8192 * 28672 / 8
    col = next(c for c in cs if c.target == "column" and c.m == 16)
    assert col.gemm_flops(8) == 3 * 2.0 * 16 * 28672 * 8192 / 8
    scaled = cases.model_cases(["llama3-8b"], [64], ["row_sp"], p=2, scale=64)
    assert [(c.model, c.k, c.n) for c in scaled] == [("llama3-8b/64", 224, 64)]
    assert cases.custom_cases([(10, 6, 4)], ["matmul_all_reduce", "row_sp"], p=4) == []


def _fake_result():
    case = cases.Case("matmul_all_reduce", "custom", 64, 32, 16)
    return {
        "peak_tflops": {"float32": 1.0},
        "cases": [{
            "case": case.__dict__, "dtype": "float32",
            "gemm": [[[64, 16, 16], 2e-3], [[16, 16, 16], 0.5e-3]], "gemm_total": 2e-3,
            "comm_total": 1e-3, "gemm_under_comm": 2.5e-3,
            "comm_samples": [["all_reduce", 4096, 1e-3], ["all_reduce", 1024, 0.4e-3]],
            "resolved": {"reference": "reference", "pipelined": "pipelined:4"},
            "backend": {"reference": 3e-3, "pipelined": 2.4e-3},
        }],
    }


def test_report_metrics():
    rows = report.compute_rows(_fake_result(), p=2, baseline="reference")
    ref, pipe = rows
    assert ref["speedup"] == 1.0 and pipe["speedup"] == pytest.approx(3 / 2.4)
    assert pipe["E"] == pytest.approx((2e-3 + 1e-3 - 2.4e-3) / 1e-3)
    assert ref["E"] == pytest.approx(0.0)
    assert pipe["gemm_slowdown"] == pytest.approx(1.25)
    assert pipe["exposed_comm_ms"] == pytest.approx(0.4)
    assert pipe["tflops"] == pytest.approx(2.0 * 64 * 16 * 16 / 2.4e-3 / 1e12)
    assert pipe["pct_peak"] == pytest.approx(100 * pipe["tflops"])
    # reference = GEMM then all-reduce, from the measured GEMM and the fitted link
    assert ref["model_ms"] == pytest.approx(3.0)
    assert pipe["model_ms"] is not None and pipe["model_err"] == pytest.approx(pipe["model_ms"] / 2.4 - 1)
    table = report.format_table(rows)
    assert "matmul_all_reduce" in table and "1.25x" in table
    assert table.splitlines()[-1].endswith(f"{pipe['model_ms']:>9.3f} {100 * pipe['model_err']:>+5.0f}%")
    parsed = list(csv.DictReader(io.StringIO(report.to_csv(rows))))
    assert [r["backend"] for r in parsed] == ["reference", "pipelined"]
    summary = report.model_error_summary(rows)
    assert summary["reference"]["max_abs_err"] == pytest.approx(0.0, abs=1e-9)
    assert summary["pipelined"]["cases"] == 1


def test_the_model_predicts_what_ran_by_its_implementation_name():
    assert report.schedule_of("reference") == ("naive", None)
    assert report.schedule_of("reference (measured)") == ("naive", None)
    assert report.schedule_of("pipelined:4") == ("pipelined", 4)
    assert report.schedule_of("native:2") == ("pipelined", 2)  # the native path runs the pipelined schedule
    for unmodelled in ("fused:one_shot", "native:4+reference (measured)", "measured before", "pipelined"):
        assert report.schedule_of(unmodelled) == (None, None), unmodelled
    result = _fake_result()
    result["cases"][0]["resolved"]["pipelined"] = "native:2"
    two = {r["backend"]: r for r in report.compute_rows(result, p=2, baseline="reference")}
    four = {r["backend"]: r for r in report.compute_rows(_fake_result(), p=2, baseline="reference")}
    assert two["pipelined"]["model_ms"] is not None and two["pipelined"]["model_ms"] != four["pipelined"]["model_ms"]
    assert report.model_error_summary(list(two.values()))["pipelined"]["cases"] == 1
    result["cases"][0]["resolved"]["pipelined"] = "fused:one_shot"
    fused_row = report.compute_rows(result, p=2, baseline="reference")[1]
    assert fused_row["model_ms"] is None and "pipelined" not in report.model_error_summary([fused_row])


def test_the_model_predicts_one_rank_from_the_gemms_alone():
    """At p = 1 nothing is communicated and nothing split: the reference and the pipelined schedule
    (named with 4 chunks or not) are the whole GEMM as measured, as every backend runs one rank."""
    result = _fake_result()
    c = result["cases"][0]
    c.update(gemm=[[[64, 16, 32], 2e-3]], comm_total=0.0, gemm_under_comm=2e-3,
             comm_samples=[], backend={"reference": 2.2e-3, "pipelined": 2.5e-3})  # (k = 32 whole on one rank)
    c["resolved"]["pipelined"] = "native:4"
    ref, pipe = report.compute_rows(result, p=1, baseline="reference")
    assert ref["model_ms"] == pytest.approx(2.0) and ref["model_err"] == pytest.approx(2.0 / 2.2 - 1)
    assert pipe["model_ms"] == pytest.approx(2.0) and pipe["model_err"] == pytest.approx(2.0 / 2.5 - 1)
    assert ref["E"] is None and pipe["E"] is None  # (nothing communicated: nothing to hide)
    # the schedules themselves: one GEMM of the whole shape a call at p = 1, whatever the chunks
    gemm = lambda m, n, k, dtype: 1e-6 * m  # noqa: E731
    for op in pm.OP_COLLECTIVE:
        tasks = pm.op_tasks(op, 64, 32, 16, 1, "bfloat16", gemm, pm.LINKS["nvlink4"], num_chunks=4)
        assert [(t.resource, t.duration) for t in tasks if t.resource == "compute"] == [("compute", 64e-6)], op
    for kind in ("column", "row"):
        for sp in (False, True):
            tasks = pm.layer_tasks(kind, sp, 64, 32, 16, 1, "bfloat16", gemm, pm.LINKS["nvlink4"],
                                           num_chunks=4)
            assert len([t for t in tasks if t.resource == "compute"]) == 3, (kind, sp)  # fwd, dgrad, wgrad
    # with several ranks the chunks stay
    tasks = pm.op_tasks("matmul_all_reduce", 64, 32, 16, 2, "bfloat16", gemm, pm.LINKS["nvlink4"],
                                num_chunks=4)
    assert len([t for t in tasks if t.resource == "compute"]) == 4


def _measured_case(case, p, dtype, s_per_flop, s_per_byte, backend):
    """A case's entry as ``measure_case`` records it: each GEMM of the case timed at one rate, each
    of its collectives at its size and at a quarter of it (10 µs plus a time per byte), and
    ``backend``'s times, each backend run as itself."""
    from tp_kernels.bench import measure

    gemm = [[list(shape), 2.0 * math.prod(shape) * s_per_flop] for shape, _ in measure._gemms(case, p)]
    esize = getattr(torch, dtype).itemsize
    samples, comm_total = [], 0.0
    for kind, shape, _ in measure._collectives(case, p):
        nbytes = math.prod(shape) * esize * (p if kind == "all_gather" else 1)
        comm_total += 10e-6 + nbytes * s_per_byte
        samples += [[kind, nbytes, 10e-6 + nbytes * s_per_byte], [kind, nbytes // 4, 10e-6 + nbytes // 4 * s_per_byte]]
    gemm_total = sum(t for _, t in gemm)
    return {"case": case.__dict__, "dtype": dtype, "gemm": gemm, "gemm_total": gemm_total, "comm_total": comm_total,
            "gemm_under_comm": 1.1 * gemm_total, "comm_samples": samples,
            "resolved": {b: "pipelined:4" if b == "pipelined" else b for b in backend}, "backend": dict(backend)}


def test_each_dtype_is_modelled_and_rated_from_its_own_measurements():
    """With cases in two dtypes, each row comes from its dtype's measurements alone (its GEMM
    times, the link fitted to its collectives, its peak), as if the other dtype had not run."""
    case = cases.Case("matmul_all_reduce", "custom", 64, 32, 16)
    entries = {
        "float32": _measured_case(case, 2, "float32", 1e-12, 1e-9, {"reference": 5e-6, "pipelined": 4e-6}),
        "bfloat16": _measured_case(case, 2, "bfloat16", 0.25e-12, 0.3e-9, {"reference": 2e-6, "pipelined": 1e-6})}
    peaks = {"float32": 1e-6, "bfloat16": 3e-6}

    def rows(*dtypes):
        result = {"peak_tflops": {d: peaks[d] for d in dtypes}, "cases": [entries[d] for d in dtypes]}
        return report.compute_rows(result, p=2, baseline="reference")

    both = rows("float32", "bfloat16")
    assert both == rows("float32") + rows("bfloat16")
    assert all(r["model_ms"] is not None for r in both)
    assert len({round(r["model_ms"], 12) for r in both}) == 4  # (each dtype's prediction its own)


def test_the_model_needs_each_collective_the_case_runs_at_two_sizes():
    """A layer with sequence parallelism is predicted from the all-gather and the reduce-scatter
    its run measured (no all-reduce); a kind measured at one size only fits no line, and then
    nothing is predicted for the case (rather than an error, or a line through one point)."""
    case = cases.Case("row_sp", "custom", 64, 32, 16)
    entry = _measured_case(case, 2, "float32", 1e-12, 1e-9, {"reference": 9e-6, "pipelined": 8e-6})
    assert {kind for kind, _, _ in entry["comm_samples"]} == {"all_gather", "reduce_scatter"}
    rows = report.compute_rows({"peak_tflops": {}, "cases": [entry]}, p=2, baseline="reference")
    assert all(r["model_ms"] is not None for r in rows)
    for kind in ("all_gather", "reduce_scatter"):
        first = next(s for s in entry["comm_samples"] if s[0] == kind)
        for again in (False, True):  # (once, or twice at that one size: still one size)
            one_size = dict(entry, comm_samples=[s for s in entry["comm_samples"] if s[0] != kind or s is first]
                            + [first] * again)
            rows = report.compute_rows({"peak_tflops": {}, "cases": [one_size]}, p=2, baseline="reference")
            assert [(r["model_ms"], r["model_err"]) for r in rows] == [(None, None)] * 2, (kind, again)
            assert "-" in report.format_table(rows).splitlines()[-1]


def test_the_link_is_fitted_to_every_collective_time_of_the_run():
    """One line per collective kind, least squares through every time the run measured of that
    kind, whichever case measured it: the reference's prediction of each case is its GEMMs' time
    and that line's time for its all-reduce."""
    entries = []
    for m, noise in ((64, 1.3), (128, 0.8)):
        case = cases.Case("matmul_all_reduce", "custom", m, 32, 16)
        entry = _measured_case(case, 2, "float32", 1e-12, 1e-9, {"reference": 1e-4})
        entry["comm_samples"][1][2] *= noise  # (the times off any one line)
        entries.append(entry)
    rows = report.compute_rows({"peak_tflops": {}, "cases": entries}, p=2, baseline="reference")
    points = [(nbytes, t) for e in entries for _, nbytes, t in e["comm_samples"]]
    link = pm.Link.calibrated("all four", {"all_reduce": points})
    for row, entry in zip(rows, entries):
        nbytes = entry["comm_samples"][0][1]
        assert row["model_ms"] == pytest.approx((entry["gemm_total"] + link.time("all_reduce", nbytes, 2)) * 1e3)


@pytest.mark.parametrize("num_chunks", [None, 3])
def test_every_gemm_the_model_reads_is_measured(world2, monkeypatch, num_chunks):
    """For every target, in the default chunks and in 3, the run measures each GEMM the model reads
    to predict the reference's and the pipelined schedule (the chunk GEMMs of rows that do not
    divide evenly too): none is scaled from another shape, and each of those rows is predicted."""
    read, scaled = [], []
    real = pm.MeasuredGemm.__call__

    def reading(self, m, n, k, dtype):
        read.append((m, n, k))
        if (m, n, k, dtype) not in self.times:
            scaled.append((m, n, k))
        return real(self, m, n, k, dtype)

    monkeypatch.setattr(pm.MeasuredGemm, "__call__", reading)
    for target in cases.TARGETS:
        _, entry = world2.run(_measure_recorded, target, 10, 12, 8, num_chunks)[0]
        rows = report.compute_rows({"peak_tflops": {}, "cases": [entry]}, p=2, baseline="reference")
        assert [r["resolved"] for r in rows] == ["reference", f"pipelined:{num_chunks}" if num_chunks else
                                                 rows[1]["resolved"]], target
        assert all(r["model_ms"] is not None for r in rows), target
    assert read and scaled == []


def _products_run_and_timed(target):
    """On this rank, the matrix products of the reference's timed call of a ``target`` case, and those
    ``measure`` times alone for it (``_gemms``), as :func:`helpers.matrix_products` records them."""
    import torch.distributed as dist

    from tp_kernels.bench import measure

    ran, timed = [], []

    def timer(body, pre=None, post=None):
        with matrix_products(ran):
            body(0)
        return 1e-3

    case = cases.Case(target, "custom", 8, 12, 8)
    measure._time_backend(case, "reference", torch.float32, torch.device("cpu"), dist.group.WORLD, timer, None, 1)
    with matrix_products(timed):
        for shape, layout in measure._gemms(case, dist.get_world_size()):
            a, b, call = measure._gemm_call(shape, layout, 1, torch.device("cpu"), torch.float32)
            call(a[0], b[0])
    return sorted(ran), sorted(timed)


def _measure_recorded(target, m, k, n, num_chunks=None):
    """``measure_case`` of a small ``target`` case on this rank, the reference and the pipelined
    backend in ``num_chunks`` (None: the defaults), float32, with a timer that runs each body once
    (``pre`` and ``post`` around it) and records, for each of its calls in order: the time it
    returned (each call's its own, in ms), whether it was given ``pre`` and ``post``, the
    collectives (kind, shape) ``pre`` and the body started, and the products the body ran
    (:func:`_products`). Returns the calls and the case's entry as a run's record holds it."""
    import torch.distributed as dist

    from tp_kernels.bench import measure

    calls, started, ran, real_start = [], [], [], measure._start

    def start(kind, buf, group):
        started.append((kind, tuple(buf.shape)))
        return real_start(kind, buf, group)

    def timer(body, pre=None, post=None):
        started.clear()
        state = pre(0) if pre else None
        ran.clear()
        body(0)
        if post:
            post(state)
        calls.append({"t": 1e-3 * (len(calls) + 1), "pre": pre is not None, "post": post is not None,
                      "started": list(started), "products": sorted(set(ran))})
        return calls[-1]["t"]

    case = cases.Case(target, "custom", m, k, n)
    with mock.patch.object(measure, "_start", start), matrix_products(ran):
        out = measure.measure_case(case, ["reference", "pipelined"], torch.float32, torch.device("cpu"),
                                   dist.group.WORLD, timer, num_chunks)
    return calls, {"case": case.__dict__, "dtype": "float32", **out,
                   "gemm": [[list(s), t] for s, t in out["gemm"].items()]}


def _started_collectives():
    """What ``measure._start`` of each kind returns on this rank, for rank r's [8, 3] of (r + 1)
    times 0..23."""
    import torch.distributed as dist

    from tp_kernels.bench import measure

    x = torch.arange(24, dtype=torch.float64).reshape(8, 3) * (dist.get_rank() + 1)
    return {kind: measure._start(kind, x.clone(), dist.group.WORLD).wait()
            for kind in ("all_gather", "reduce_scatter", "all_reduce")}


def test_the_collectives_timed_are_each_kinds(world2):
    """The collective timed for each kind is that kind: the all-gather along dim 0, the
    reduce-scatter's sum of this rank's block of rows, the all-reduce's sum."""
    base = torch.arange(24, dtype=torch.float64).reshape(8, 3)
    for r, out in enumerate(world2.run(_started_collectives)):
        assert torch.equal(out["all_gather"], torch.cat([base, 2 * base]))
        assert torch.equal(out["reduce_scatter"], (3 * base).chunk(2)[r])
        assert torch.equal(out["all_reduce"], 3 * base)


def _measured_with_the_model_reading(shape):
    """``measure_case`` of a row case (m 12, k 12, n 8) on this rank, no backend, where the model
    reads the GEMM ``shape`` alone: the error it raises, or None."""
    import torch.distributed as dist

    from tp_kernels.bench import measure

    def timer(body, pre=None, post=None):
        body(0)
        return 1e-3

    with mock.patch.object(measure, "model_gemms", lambda *args: {tuple(shape)}):
        try:
            measure.measure_case(cases.Case("row", "custom", 12, 12, 8), [], torch.float32, torch.device("cpu"),
                                 dist.group.WORLD, timer, None)
        except RuntimeError as exc:
            return str(exc)
    return None


def test_a_gemm_the_model_reads_is_timed_on_rows_of_the_forward_or_input_gradient(world2):
    """A chunk GEMM the model reads is timed on rows of the case's forward GEMM or its input
    gradient's (a row layer of 2 ranks: [12, 8] over 6, [12, 6] over 8); rows of the weight
    gradient's ([8, 6] over 12), which no schedule splits, or more rows than the case has, are an
    error naming the GEMM."""
    assert world2.run(_measured_with_the_model_reading, (4, 8, 6))[0] is None
    assert world2.run(_measured_with_the_model_reading, (4, 6, 8))[0] is None
    for shape in ((13, 8, 6), (4, 6, 12)):
        error = world2.run(_measured_with_the_model_reading, shape)[0]
        assert error is not None and f"the model reads a GEMM {shape} that is no rows of the case's" in error


def test_the_gemms_timed_alone_are_those_the_reference_runs(world2):
    """The GEMMs a case's run times alone (its ``gemm_total``, E's GEMM time) are the products the
    reference's call runs, shape and operand layout: an op's forward, a layer's forward, input
    gradient and weight gradient."""
    for target in cases.TARGETS:
        ran, timed = world2.run(_products_run_and_timed, target)[0]
        assert ran == timed and len(ran) == (3 if target in cases.LAYERS else 1), target


#: cases of 2 ranks whose GEMMs share a shape: a row layer's input and weight gradients where m = n,
#: a column layer's where m = n/p
_SHARED_SHAPES = [("row_sp", 8, 12, 8), ("column", 4, 12, 8)]


@pytest.mark.parametrize("target,m,k,n", [(t, 12, 12, 8) for t in cases.TARGETS] + _SHARED_SHAPES)
def test_each_gemm_timed_alone_is_one_the_schedules_run(world2, target, m, k, n):
    """Every GEMM a case's run times alone, a whole one or a chunk the model reads, is a product the
    reference's or the pipelined call of the case runs, in shape and operand layout (a chunk of the
    input gradient as that GEMM runs, also where the weight gradient has its shape), and the time
    recorded under a shape is that GEMM's (the mean of the two where two of the case's GEMMs share
    it, so that the model, which reads it for each, adds up their times)."""
    calls, out = world2.run(_measure_recorded, target, m, k, n)[0]
    *timings, reference, pipelined = calls
    ran = set(reference["products"]) | set(pipelined["products"])
    alone = [c for c in timings if c["products"] and not c["pre"]]
    assert alone and all(len(c["products"]) == 1 and c["products"][0] in ran for c in alone), target
    times = {}
    for c in alone:
        times.setdefault(c["products"][0][0], []).append(c["t"])
    assert sorted(tuple(shape) for shape, _ in out["gemm"]) == sorted(times), target
    assert all(t == pytest.approx(sum(times[tuple(shape)]) / len(times[tuple(shape)])) for shape, t in out["gemm"])
    # the whole GEMMs, read by shape, add up to their total
    whole = [shape for shape, *_ in reference["products"]]
    gemm = {tuple(shape): t for shape, t in out["gemm"]}
    assert out["gemm_total"] == pytest.approx(sum(gemm[shape] for shape in whole)), target
    if (target, m, k, n) in _SHARED_SHAPES:  # (two of its GEMMs share a shape)
        assert len(set(whole)) < len(whole) == 3


@pytest.mark.parametrize("target", cases.TARGETS)
def test_the_gemms_under_communication_run_beside_every_collective_of_the_case(world2, target):
    """E's GEMM time under communication (``gemm_under_comm``) is one timing of the case's whole
    GEMMs, those the reference runs, while each collective the case runs, as timed alone at the
    bytes the model reads, is in flight: started before them, waited for after."""
    calls, out = world2.run(_measure_recorded, target, 12, 12, 8)[0]
    under = [c for c in calls if c["pre"]]
    assert len(under) == 1 and under[0]["post"] and out["gemm_under_comm"] == under[0]["t"]
    assert under[0]["products"] == calls[-2]["products"]
    alone = [c["started"] for c in calls if c["started"] and not c["pre"]]
    assert all(len(started) == 1 for started in alone)
    assert under[0]["started"] == [started[0] for started in alone[:len(under[0]["started"])]]
    assert {kind for kind, _ in under[0]["started"]} == {kind for (kind, _), in alone}


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_a_collective_too_small_for_a_quarter_is_timed_whole_and_one_rank_times_none(world):
    """An all-reduce of 2 rows has no quarter to time (no collective of no bytes is): its one
    sample is the whole one; on one rank nothing is communicated and the GEMMs under communication
    are the GEMMs alone."""
    calls, out = world.run(_measure_recorded, "matmul_all_reduce", 2, 12, 8)[0]
    if world.world_size == 1:
        assert out["comm_samples"] == [] and out["comm_total"] == 0.0 and not any(c["pre"] for c in calls)
        assert out["gemm_under_comm"] == out["gemm_total"] > 0
    else:
        assert [(kind, nbytes) for kind, nbytes, _ in out["comm_samples"]] == [("all_reduce", 2 * 8 * 4)]


def test_the_collectives_timed_are_those_the_model_reads(world2):
    """For every target, each collective the case's call runs is timed at the size the model reads
    it in the reference's schedule (kind and bytes: an all-gather's gathered bytes) and at a
    quarter of it (a reduce-scatter's rows still a multiple of p, here 12 // 4 = 3 rows made 2),
    to fit the link's line; the gathers' ring steps too."""
    class Recording(pm.Link):
        def time(self, kind, nbytes, p):
            read.append((kind, nbytes))
            return 0.0

    for target in cases.TARGETS:
        _, entry = world2.run(_measure_recorded, target, 12, 12, 8)[0]
        case, read = cases.Case(**entry["case"]), []
        case.tasks(2, "float32", _const_gemm(0), Recording("recording", 1.0, 1.0, 0.0, 0.0), "naive")
        samples = [(kind, nbytes) for kind, nbytes, _ in entry["comm_samples"] if kind != "ring_step"]
        full = samples[:len(read)]
        assert sorted(full) == sorted(read), target
        quarters = samples[len(read):]
        assert sorted({kind for kind, _ in quarters}) == sorted({kind for kind, _ in read}), target
        for kind, nbytes in quarters:
            whole = next(b for k, b in full if k == kind)
            assert 0 < nbytes <= whole // 4, (target, kind)
            if kind == "reduce_scatter":  # (of all 12 rows)
                assert nbytes * 12 // whole == 2, target
        rings = [nbytes for kind, nbytes, _ in entry["comm_samples"] if kind == "ring_step"]
        assert len(rings) == (2 if "all_gather" in {kind for kind, _ in read} else 0), target
        # a ring step moves one shard (in one piece): the bytes the pipelined schedule reads it in
        read = []
        case.tasks(2, "float32", _const_gemm(0), Recording("recording", 1.0, 1.0, 0.0, 0.0), "pipelined", 1)
        steps = {nbytes for kind, nbytes in read if kind == "ring_step"}
        assert steps <= set(rings) and bool(steps) == bool(rings), target


def test_the_gemm_peak_is_the_flops_of_the_gemm_timed_over_its_time():
    """The run's GEMM peak is one square GEMM's FLOPs (2 m n k) over the time its timer returned."""
    from tp_kernels.bench import measure

    ran = []

    def timer(body):
        with matrix_products(ran):
            body(0)
            body(1)
        return 2e-3

    tflops = measure.measure_peak(torch.float32, torch.device("cpu"), timer)
    ((m, n, k), *_), = set(ran)
    assert m == n == k > 1 and tflops == pytest.approx(2 * m * n * k / 2e-3 / 1e12)


@pytest.mark.parametrize("cache", [None, 50 << 20, 3 << 30])
def test_the_buffer_sets_rotated_exceed_twice_the_cache_within_their_bounds(monkeypatch, cache):
    """Between two uses of one buffer set, the others touch at least twice the last-level cache (the
    host's, or the GPU's L2 as torch reports it; a cache of 3 GiB lets the bound of 4 GiB of sets
    decide), with no set more than that needs, and no more than 16 sets and 4 GiB in all (but 2)."""
    import types

    from tp_kernels.bench import measure

    cuda = cache is not None
    if cuda:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=cache))
    else:
        cache = measure._CPU_CACHE_BYTES
    bounded = 0
    for nbytes in (1, 1000, 1 << 20, 3 << 20, 7 << 20, 20 << 20, 64 << 20, 500 << 20, 1 << 30, 3 << 30, 5 << 30):
        n = measure.buffer_sets(nbytes, cuda)
        assert 2 <= n <= 16 and (n == 2 or n * nbytes <= 4 << 30), nbytes
        if n < 16 and (n + 1) * nbytes <= 4 << 30:
            assert (n - 1) * nbytes >= 2 * cache and (n == 2 or (n - 2) * nbytes < 2 * cache), nbytes
        else:
            bounded += 1
    assert bounded


def test_the_peak_is_the_fastest_rate_the_run_saw():
    """%peak is against the fastest TFLOP/s of the run in that dtype: the square GEMM's, a case's
    GEMMs alone or a backend's whole case; never above 100, and 100 for the fastest."""
    result = _fake_result()  # the GEMMs alone at 2 * 64 * 16 * 16 FLOPs in 2 ms; the backends in 3 and 2.4 ms
    gemm_rate = 2.0 * 64 * 16 * 16 / 2e-3 / 1e12
    result["peak_tflops"] = {"float32": gemm_rate / 10}
    ref, pipe = report.compute_rows(result, p=2, baseline="reference")
    assert pipe["pct_peak"] == pytest.approx(100 * 2 / 2.4) and ref["pct_peak"] == pytest.approx(100 * 2 / 3)
    result["cases"][0]["backend"]["pipelined"] = 1e-3  # faster than its GEMMs alone
    ref, pipe = report.compute_rows(result, p=2, baseline="reference")
    assert pipe["pct_peak"] == pytest.approx(100) and ref["pct_peak"] == pytest.approx(100 / 3)
    result["peak_tflops"] = {"float32": 4 * pipe["tflops"]}  # a square GEMM faster still
    ref, pipe = report.compute_rows(result, p=2, baseline="reference")
    assert pipe["pct_peak"] == pytest.approx(25)


def test_the_model_error_summary_is_of_each_schedule_where_it_ran():
    """The median and worst |model / measured - 1| of the reference's rows and of the pipelined
    backend's where it ran the pipelined schedule (not where it ran the reference, as every
    backend does on one rank); rows without a prediction are left out."""
    def row(backend, resolved, err):
        return {"backend": backend, "resolved": resolved, "model_err": err}

    rows = ([row("reference", "reference", e) for e in (0.1, -0.3, 0.05, None)]
            + [row("pipelined", "pipelined:4", -0.02), row("pipelined", "native:2", 0.2),
               row("pipelined", "reference", 0.5), row("pipelined", "fused:one_shot", None),
               row("auto", "pipelined:4 (measured)", 0.9)])
    assert report.model_error_summary(rows) == {
        "reference": {"cases": 3, "median_abs_err": 0.1, "max_abs_err": 0.3},
        "pipelined": {"cases": 2, "median_abs_err": 0.2, "max_abs_err": 0.2}}


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = report.compute_rows(_fake_result(), p=2, baseline="reference")
    path = report.plot(rows, str(tmp_path / "p.png"), "title")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_what_the_plot_draws(tmp_path, monkeypatch):
    """One column per target, in the order of the targets; in each, a line per backend other than
    the baseline: its speedup above and its E below, on one scale per row. An E beyond the axis's
    floor is drawn at the floor as a triangle with its value beside it."""
    plt = pytest.importorskip("matplotlib.pyplot")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # (keeps the figure to look at)
    layer = cases.Case("column_sp", "custom", 64, 32, 16)
    entry = _measured_case(layer, 2, "float32", 1e-12, 1e-9, {"reference": 1e-3, "pipelined": 1e-3})
    e_floor = -2.0
    entry["backend"]["pipelined"] = entry["gemm_total"] + 6 * entry["comm_total"]  # E = (c - 6 c) / c = -5
    result = _fake_result()
    result["cases"].insert(0, entry)  # (the later target in the order first, and first by name)
    rows = report.compute_rows(result, p=2, baseline="reference")
    assert report.plot(rows, str(tmp_path / "p.png"), "title") == str(tmp_path / "p.png")
    (fig,) = figures
    top, bottom = fig.axes[:2], fig.axes[2:4]
    assert [ax.get_title() for ax in top] == ["matmul_all_reduce", "column_sp"]

    def series(ax):
        return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
                if not line.get_label().startswith("_")}

    want = {r["target"]: r for r in rows if r["backend"] == "pipelined"}
    for ax, target in zip(top, ("matmul_all_reduce", "column_sp")):
        assert series(ax) == {"pipelined, custom float32": [pytest.approx(want[target]["speedup"])]}
    assert want["column_sp"]["E"] == pytest.approx(-5.0)
    drawn = [line for line in bottom[1].get_lines() if line.get_marker() in ("o", "v")]
    assert [(line.get_marker(), list(line.get_ydata())) for line in drawn] == [("o", [e_floor]), ("v", [e_floor])]
    assert [t.get_text() for t in bottom[1].texts] == ["-5.0"]
    assert len(bottom[0].texts) == 0 and bottom[0].get_ylim() == bottom[1].get_ylim()


@pytest.mark.slow
def test_main_job_writes_json_csv_png(tmp_path):
    env = dict(os.environ, TP_KERNELS_COMMIT="abc1234")
    cmd = [sys.executable, "-m", "tp_kernels.bench", "--quick", "--m", "16", "--iters", "2", "--warmup", "0",
           "--targets", "matmul_all_reduce,row_sp", "--num-chunks", "2", "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[2/2]" in run.stderr  # progress display
    record = json.load(open(tmp_path / "cpu-gloo-p2-quick.json"))
    assert record["commit"] == "abc1234" and record["device"].startswith("CPU") and record["date"]
    assert record["hold"] is None and "hold" not in record["measurements"]  # (the host clock holds nothing)
    assert "GPU samples" not in run.stdout
    assert {(r["target"], r["backend"]) for r in record["results"]} == {
        (t, b) for t in ("matmul_all_reduce", "row_sp") for b in ("reference", "pipelined")}
    for r in record["results"]:
        assert r["median_ms"] > 0 and r["comm_ms"] > 0 and r["E"] is not None
        assert r["resolved"] == ("pipelined:2" if r["backend"] == "pipelined" else "reference")  # (as asked)
    # the record says how it was run, and its rows and model errors are those of its raw timings
    assert (record["backend"], record["p"], record["torch"]) == ("gloo", 2, torch.__version__)
    assert record["config"] == {"backends": ["reference", "pipelined"], "dtypes": ["float32"], "iters": 2,
                                "warmup": 0, "num_chunks": 2, "communicator": False, "quick": True, "one_gpu": False,
                                "scale": 64, "ops": ["matmul_all_reduce"]}
    assert record["results"] == report.compute_rows(record["measurements"], 2, "reference")
    assert record["model_error"] == report.model_error_summary(record["results"])
    assert set(record["peak_tflops"]) == {"float32"} and record["peak_tflops"] == record["measurements"]["peak_tflops"]
    assert {(c["case"]["target"], c["case"]["k"], c["case"]["n"]) for c in record["measurements"]["cases"]} == {
        ("matmul_all_reduce", 28672 // 64, 8192 // 64), ("row_sp", 28672 // 64, 8192 // 64)}
    assert record["elapsed_s"] > 0 and record["communicator"] is None and record["one_gpu"] is None
    assert (tmp_path / "cpu-gloo-p2-quick.csv").read_text().startswith("target,model,m,")
    if record["results"] and _has_matplotlib():
        assert (tmp_path / "cpu-gloo-p2-quick.png").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "tp_kernels.bench", "--targets", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown target nope" in bad.stderr


@pytest.mark.parametrize("argv,message", [
    (["--shape", "16,64"], "--shape: expected three positive ints M,IN,OUT"),
    (["--shape", "16,0,64"], "--shape: expected three positive ints M,IN,OUT"),
    (["--shape", "a,b,c"], "--shape: expected three positive ints M,IN,OUT"),
    (["--m", "16,0"], "--m: expected positive ints"),
    (["--m", "16,x"], "expected comma-separated ints, got '16,x'"),
    (["--m", ","], "--m: expected positive ints"),
    (["--iters", "0"], "--iters: expected a positive int, got 0"),
    (["--num-chunks", "-1"], "--num-chunks: expected a positive int, got -1"),
    (["-p", "0"], "--world-size: expected a positive int, got 0"),
    (["--scale", "0"], "--scale: expected a positive int, got 0"),
    (["--backends", "reference,nope"], "unknown backend nope"),
    (["--dtypes", "float64"], "unknown dtype float64"),
    (["--models", "gpt5"], "unknown model gpt5"),
    (["--shape", "3,4,4", "-p", "2", "--targets", "all_gather_matmul"], "no case runs on p=2"),
])
def test_the_main_job_names_the_argument_it_cannot_take(capsys, argv, message):
    """A bad argument is the usage error (exit status 2) naming it, before any rank starts."""
    from tp_kernels.bench import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(argv + ["--no-save"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_main_job_takes_20_samples_a_measurement_5_quick_by_default():
    from tp_kernels.bench import cli

    assert [cli._parse(argv)[0].iters for argv in ([], ["--quick"], ["--quick", "--iters", "3"])] == [20, 5, 3]


def test_the_main_job_runs_every_model_at_the_decode_and_training_m_by_default():
    """Without --quick, every model at the decode m and the device's training m; with it, Llama-3
    70B at two m; --m and --models in their place; a list may end in a comma."""
    from tp_kernels.bench import cli
    from tp_kernels.bench.cases import DECODE_M, TARGETS, TRAIN_M

    def run(argv, where):
        args, ap = cli._parse(argv)
        cases = cli._cases(args, ap, 2, where, 64)
        return {c.model for c in cases}, sorted({c.m for c in cases}), {c.target for c in cases}

    for where in ("cpu", "cuda"):
        models, ms, targets = run([], where)
        assert models == {f"{m}/64" for m in pm.MODELS} and ms == sorted(DECODE_M + TRAIN_M[where])
        assert targets == set(TARGETS)
        assert run(["--quick"], where)[:2] == ({"llama3-70b/64"}, list(cli.QUICK_M[where]))
    assert run(["--m", "16,", "--models", "llama3-8b,", "--targets", "row,"], "cpu") == ({"llama3-8b/64"}, [16], {"row"})
    assert cli._parse(["--backends", "reference,pipelined,"])[0].backends == ["reference", "pipelined"]


@pytest.mark.slow
def test_the_communicator_sweep_alone(tmp_path):
    cmd = [sys.executable, "-m", "tp_kernels.bench", "--quick", "--iters", "2", "--warmup", "0",
           "--targets", "communicator", "--out-dir", str(tmp_path), "--tag", "sweep"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.load(open(tmp_path / "cpu-gloo-p2-quick-sweep.json"))
    sweep = record["communicator"]
    assert record["peak_tflops"] == {} and record["results"] == []  # (no case: no GEMM peak measured either)
    assert (sweep["p"], sweep["dtype"], sweep["paths"]) == (2, "float32", ["reference"])  # the CPU: one path
    assert [r["bytes"] for r in sweep["rows"]] == list(communicator.QUICK_SIZES)
    assert all(r["times_s"]["reference"] > 0 and r["auto"] == "reference" for r in sweep["rows"])
    assert sweep["crossovers"] == [] and "64 MiB" in run.stdout and "auto's choice: reference" in run.stdout
    assert not (tmp_path / "cpu-gloo-p2-quick-sweep.csv").exists()  # no case, no case table


def test_the_communicator_sweep_moves_each_size_in_the_dtype_asked():
    """Each row's all-reduce moves its size in bytes of the dtype asked (bfloat16: as many elements
    as bytes / 2), on every path, with every path a candidate of ``auto`` meanwhile; the candidates
    named before are named again after, also where a call fails."""
    from tp_kernels import settings

    moved = []

    def run_collective(kind, path, x, out, dim, group):
        moved.append((kind, path, x.dtype, x.numel() * x.element_size(), out.shape == x.shape))
        assert settings.get_auto_candidates() == settings.AUTO_CHOICES

    def timer(body):
        body(0)
        return 1e-6

    settings.set_auto_candidates(["reference"])
    try:
        with mock.patch.object(communicator.backends, "run_collective", run_collective):
            result = communicator.sweep(torch.bfloat16, torch.device("cpu"), None, timer, quick=True)
        assert settings.get_auto_candidates() == ("reference",)
        assert [(r["bytes"], r["numel"] * 2) for r in result["rows"]] == [(b, b) for b in communicator.QUICK_SIZES]
        assert moved == [("all_reduce", "reference", torch.bfloat16, b, True) for b in communicator.QUICK_SIZES]
        with mock.patch.object(communicator.backends, "run_collective", side_effect=RuntimeError("failed")):
            with pytest.raises(RuntimeError, match="failed"):
                communicator.sweep(torch.bfloat16, torch.device("cpu"), None, timer, quick=True)
        assert settings.get_auto_candidates() == ("reference",)
    finally:
        settings.set_auto_candidates(None)


def test_communicator_table_and_crossovers():
    paths = ["fused:one_shot", "native:1", "reference"]
    times = [(1e-6, 5e-6, 9e-6), (8e-6, 6e-6, 9e-6), (9e-5, 2e-5, 3e-5)]
    rows = [{"bytes": b, "numel": b // 2, "times_s": dict(zip(paths, t)), "auto": paths[t.index(min(t))]}
            for b, t in zip((512, 2**20, 64 * 2**20), times)]
    assert communicator.crossovers(rows) == [{"bytes": 2**20, "from": "fused:one_shot", "to": "native:1"}]
    table = communicator.format_table({"dtype": "bfloat16", "p": 8, "paths": paths, "rows": rows,
                                       "crossovers": communicator.crossovers(rows)})
    lines = table.splitlines()
    assert "p=8" in lines[0] and lines[1].split() == ["bytes"] + paths + ["auto"]
    assert lines[3].split()[:4] == ["512", "B", "1.0*", "5.0"] and lines[4].split()[3] == "6.0*"
    assert lines[5].startswith("   64 MiB") and lines[-1] == "# auto's crossovers: fused:one_shot -> native:1 at 1 MiB"
    assert communicator.SIZES[0] == 512 and communicator.SIZES[-1] == communicator.QUICK_SIZES[-1] == 64 * 2**20
    # a path's name wider than the columns widens them all, each row's figures under its name
    wide = ["fused:scatter_gather", "reference"]
    rows = [{"bytes": 512, "numel": 256, "times_s": {"fused:scatter_gather": 7e-6, "reference": 9e-6},
             "auto": "reference"}]
    lines = communicator.format_table({"dtype": "bfloat16", "p": 2, "paths": wide, "rows": rows,
                                       "crossovers": []}).splitlines()
    assert len(lines[1]) == len(lines[2]) == len(lines[3]) - len("reference") + len("auto")
    assert lines[3].index("7.0*") + len("7.0*") == lines[1].index("fused:scatter_gather") + len("fused:scatter_gather")
    assert lines[-1] == "# auto's choice: reference at every size"
    # a sweep of no size (nothing ran) says so
    empty = communicator.format_table({"dtype": "bfloat16", "p": 2, "paths": wide, "rows": [], "crossovers": []})
    assert empty.splitlines()[-1] == "# auto's choice: - at every size"


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_extension_bench_without_a_gpu_says_so(capsys):
    from tp_kernels.bench import extension

    assert extension.main(["--out-dir", "unused"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_extension_bench_flop_count():
    from tp_kernels.bench.extension import tflops

    assert tflops(8192, 8192, 8192, 1.0) == pytest.approx(2 * 8192**3 / 1e-3 / 1e12)


def test_the_figures_a_ratio_compares_are_sampled_in_turns_so_a_drift_falls_on_each_alike(monkeypatch):
    """extension.in_turns: one sample of each sampler a round, the order rotated each round, the
    warm-up rounds untimed and left out. Under a card that slows 1 % a sample, two calls of one cost
    measure within 2 % of each other, where sampled one after the other (20 samples each) they
    would differ by the 20 % the clock drifted meanwhile. event_sampler: CUDA events around one
    call under the benchmarks' hold, waited for under the name given."""
    from tp_kernels import _timing
    from tp_kernels.bench import extension

    order, clock = [], [0]

    def sampler(name, cost):
        def sample(timed):
            order.append((name, timed))
            clock[0] += 1
            return cost * (1 + 0.01 * clock[0])
        return sample

    times = extension.in_turns({"a": sampler("a", 1.0), "b": sampler("b", 1.0), "c": sampler("c", 2.0)}, 20, 2)
    assert order[:9] == [("a", False), ("b", False), ("c", False), ("b", False), ("c", False), ("a", False),
                         ("c", True), ("a", True), ("b", True)]
    assert len(order) == 3 * 22 and sorted(set(order)) == sorted({(n, t) for n in "abc" for t in (False, True)})
    assert times["a"] / times["b"] == pytest.approx(1.0, abs=0.02)
    assert times["c"] / times["a"] == pytest.approx(2.0, abs=0.04)
    clock[0] = 0
    blocks = [extension.in_turns({"a": sampler("a", 1.0)}, 20, 2)["a"],
              extension.in_turns({"b": sampler("b", 1.0)}, 20, 2)["b"]]
    assert blocks[1] / blocks[0] > 1.15  # what in turns avoids

    calls = []

    class Event:
        def elapsed_time(self, end):
            return 4.5

    def gpu_events(fn, hold, timed):
        fn()
        calls.append((hold, timed))
        return Event(), Event(), None

    waited = []
    monkeypatch.setattr(extension, "gpu_events", gpu_events)
    monkeypatch.setattr(extension, "wait_event", lambda end, what: waited.append(what))
    ran = []
    assert extension.event_sampler(lambda: ran.append(1), "the thing")(False) == 4.5
    assert calls == [(_timing.HOLD, False)] and waited == ["the thing"] and ran == [1]
    assert extension.gpu_times_ms({"x": lambda: ran.append(2)}, 3, 1) == {"x": 4.5}
    assert [t for _, t in calls[1:]] == [False, True, True, True] and ran[1:] == [2] * 4
    assert waited[1:] == ["gpu_times_ms: a sample of x"] * 4


#: what python -m tp_kernels.bench.host times on the CPU, and which of those are plain PyTorch
HOST_PLAIN = {"plain", "plain_layer", "plain_column", "plain_head", "plain_embedding", "plain_all_reduce",
              "plain_all_reduce_inplace", "plain_all_gather"}
HOST_CALLS = HOST_PLAIN | {"RowParallelLinear/auto", "ColumnParallelLinear/auto", "ColumnParallelLinear/gather_output",
                           "VocabParallelEmbedding", "VocabParallelEmbedding/unchecked", "Communicator.all_reduce",
                           "Communicator.all_reduce/in_place", "Communicator.all_gather"} | {
                               f"matmul_all_reduce/{b}" for b in ("reference", "pipelined", "auto", "auto:measured")}


def _host_outputs():
    """On this rank, each call the host benchmark times (:func:`tp_kernels.bench.host._calls`, float32
    on the CPU) once, in its context: name -> (its plain counterpart's name, the output's shape, dtype
    and whether it is the same tensor each call)."""
    import torch.distributed as dist

    from tp_kernels.bench import host

    calls, skipped = host._calls(dist.get_world_size(), torch.device("cpu"), torch.float32)
    out = {}
    for name, (fn, plain, *context) in calls.items():
        with (context[0]() if context else contextlib.nullcontext()):
            first, second = fn(), fn()
        out[name] = (plain, tuple(first.shape), first.dtype, first is second)
    return out, skipped


def test_each_host_call_does_the_work_of_its_plain_counterpart(world2):
    """Each call the host benchmark times against a plain counterpart returns what that counterpart
    returns, in shape and dtype (an all-reduce's output a new tensor where the counterpart's is, the
    input itself where it is done in place), on 2 ranks: the host times compare like with like."""
    out, skipped = world2.run(_host_outputs)[0]
    assert set(out) == HOST_CALLS and skipped == {}
    for name, (plain, shape, dtype, same) in out.items():
        if plain is not None:
            assert (shape, dtype, same) == out[plain][1:], name
    assert out["plain_all_reduce_inplace"][3] and not out["plain_all_reduce"][3]
    assert out["ColumnParallelLinear/gather_output"][1] == (16, 128)  # (m, p n): the gathered logits


def test_host_time_bench_at_one_and_two_ranks(tmp_path):
    """python -m tp_kernels.bench.host on the CPU (its own process: it makes a fake world): every
    call is timed at each group size, against its plain counterpart, and nothing is skipped
    there."""
    out = subprocess.run([sys.executable, "-m", "tp_kernels.bench.host", "--ranks", "1,2", "--samples", "2",
                          "--device", "cpu", "--out-dir", str(tmp_path), "--tag", "t"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.load(open(tmp_path / "host-cpu-t.json"))
    assert [run["p"] for run in record["runs"]] == [1, 2] and record["target_us"] == 5.0
    assert (record["shape"], record["dtype"], record["samples"], record["calls_per_sample"]) == (
        [16, 64, 64], "float32", 2, 200)
    assert record["world"] == "one process of a fake group" and record["torch"] == torch.__version__
    for run in record["runs"]:
        assert set(run["times"]) == HOST_CALLS and run["skipped"] == {}
        assert all(0 < t["min_us"] <= t["median_us"] for t in run["times"].values())
        assert set(run["added_us"]) == HOST_CALLS - HOST_PLAIN
        assert run["added_us"]["RowParallelLinear/auto"] == pytest.approx(
            run["times"]["RowParallelLinear/auto"]["min_us"] - run["times"]["plain_layer"]["min_us"])
        assert run["added_us"]["Communicator.all_reduce/in_place"] == pytest.approx(
            run["times"]["Communicator.all_reduce/in_place"]["min_us"]
            - run["times"]["plain_all_reduce_inplace"]["min_us"])
        # the functions each call goes through, counted, and how many more than its counterpart's
        assert set(run["function_calls"]) == HOST_CALLS and all(n >= 1 for n in run["function_calls"].values())
        assert set(run["added_function_calls"]) == HOST_CALLS - HOST_PLAIN
        assert run["added_function_calls"]["RowParallelLinear/auto"] == (
            run["function_calls"]["RowParallelLinear/auto"] - run["function_calls"]["plain_layer"])
    # "auto:measured" chose between the two backends that run on a fake group, once, at p = 2 (at
    # p = 1 there is nothing to overlap: the reference, unmeasured)
    assert record["runs"][0]["auto_decisions"] == []
    (decision,) = record["runs"][1]["auto_decisions"]
    assert decision["variants"] == ["pipelined:4", "reference"] and decision["choice"] in decision["variants"]
    assert all(t > 0 for t in decision["times_s"])
    with pytest.raises(SystemExit):
        from tp_kernels.bench import host
        host.main(["--ranks", "0"])


def test_host_time_bench_on_a_fake_group_lets_auto_choose_only_what_runs_without_peers(monkeypatch):
    """On a fake group (collectives that move nothing) "auto" has the reference as its one
    candidate whatever the settings name: with the fused path named (TP_KERNELS_AUTO_FUSED=1 on a
    GPU) its first call exchanged memory handles through the fake group and failed in
    cudaIpcOpenMemHandle."""
    from tp_kernels import settings
    from tp_kernels.bench import host

    seen = []
    monkeypatch.setattr(host, "fake_world", lambda p: seen.append(p))
    monkeypatch.setattr(host, "_timed", lambda *args: settings.get_auto_candidates())
    with settings.overriding(auto_candidates=("fused", "pipelined", "reference")):
        assert host.measure(2, torch.device("cpu"), 1) == host.FAKE_GROUP_AUTO == ("reference",)
        assert settings.get_auto_candidates() == ("fused", "pipelined", "reference")
    assert seen == [2]


def test_host_time_bench_with_peers(tmp_path):
    """--peers: the same calls on the processes of a real group (gloo ranks here; NCCL ranks
    sharing the GPU on one), rank 0's figures and every rank's added time in the record; p = 1
    has no peers and is left out."""
    out = subprocess.run([sys.executable, "-m", "tp_kernels.bench.host", "--peers", "--ranks", "1,2", "--samples", "2",
                          "--device", "cpu", "--profile", "5", "--out-dir", str(tmp_path), "--tag", "t"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.load(open(tmp_path / "host-peers-cpu-t.json"))
    assert [run["p"] for run in record["runs"]] == [2] and "gloo" in record["world"]
    assert (record["samples"], record["calls_per_sample"]) == (2, 20)
    run = record["runs"][0]
    assert set(run["times"]) == HOST_CALLS and run["skipped"] == {}
    assert all(0 < t["min_us"] <= t["median_us"] for t in run["times"].values())
    assert len(run["per_rank_added_us"]) == 2 and run["per_rank_added_us"][0] == run["added_us"]
    assert all(set(added) == HOST_CALLS - HOST_PLAIN for added in run["per_rank_added_us"])
    # --profile: each call's functions by own time (cProfile), tp_kernels' own among the op's
    assert set(run["profile"]) == HOST_CALLS
    assert any("tp_kernels/ops.py" in where for where, *_ in run["profile"]["matmul_all_reduce/reference"])
    from tp_kernels.bench import host
    with pytest.raises(SystemExit):
        host.main(["--peers", "--ranks", "1"])
    with pytest.raises(SystemExit):
        host.main(["--profile", "-1"])


def test_host_times_are_samples_taken_in_turns_each_call_in_its_context(monkeypatch):
    """host.host_times_us on a made-up clock: three warm-up calls of each function first, untimed;
    then one sample of each function a round, the order rotated each round (a function is not always
    timed after the same one), a sample the mean of its calls; each function's
    calls, warm-up and timed, inside its ``around`` context and no other's; per function the
    median and the fastest sample."""
    from tp_kernels.bench import host

    clock, log, inside, entered = [0.0], [], [], []
    # µs a call: the warm-up's three (untimed), then two calls a sample over three samples
    costs = {"a": [100.0] * 3 + [5.0, 5.0, 3.0, 3.0, 3.0, 5.0], "b": [100.0] * 3 + [2.0, 2.0, 2.0, 2.0, 8.0, 8.0]}

    def fn(name):
        def call():
            log.append(name)
            inside.append((name, bool(entered)))
            clock[0] += costs[name].pop(0) * 1e-6
        return call

    @contextlib.contextmanager
    def around_b():
        entered.append(1)
        try:
            yield
        finally:
            entered.pop()

    monkeypatch.setattr(host, "time", SimpleNamespace(perf_counter=lambda: clock[0]))  # (host's clock only)
    out = host.host_times_us({"a": fn("a"), "b": fn("b")}, samples=3, cuda=False, calls=2, around={"b": around_b})
    assert log == ["a"] * 3 + ["b"] * 3 + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert all(within == (name == "b") for name, within in inside)
    assert out == {"a": {"median_us": pytest.approx(4.0), "min_us": pytest.approx(3.0)},
                   "b": {"median_us": pytest.approx(2.0), "min_us": pytest.approx(2.0)}}


def test_host_nonblocking_group_takes_our_timeout(monkeypatch):
    """The host bench's NCCL group in nonblocking mode is made with tp_kernels' timeout as its own
    (new_group alone would give it torch's 10 minutes) and blocking = 0; a torch that cannot make
    one is named (NCCL stood in for: this torch has none)."""
    import datetime

    import torch.distributed as dist

    from tp_kernels import settings
    from tp_kernels.bench import host

    class Options:
        def __init__(self):
            self.config = type("Config", (), {"blocking": 1})()

    made = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("PG", (), {"Options": Options}), raising=False)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or "group")
    with settings.overriding(timeout=47.5):
        assert host._nonblocking_nccl_group(4) == "group"
    ((ranks, kw),) = made
    assert ranks == [0, 1, 2, 3] and kw["backend"] == "nccl" and kw["pg_options"].config.blocking == 0
    assert kw["timeout"] == datetime.timedelta(seconds=47.5)

    def refuse(ranks, **kw):
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(dist, "new_group", refuse)
    assert "made no group in NCCL's nonblocking mode: no NCCL here" in host._nonblocking_nccl_group(2)


def test_function_calls_counts_what_a_call_goes_through():
    """host.function_calls: every function a call runs, Python's and builtins, each time it runs,
    the call itself included, and nothing of the profiler's."""
    from tp_kernels.bench import host

    def inner():
        return len([])

    def call():
        inner()
        inner()
        return sum(range(3))

    assert host.function_calls(call) == 6  # call; inner and len, twice each; sum (range is a type, not counted)
    assert host.function_calls(lambda: None, calls=3) == 1


def test_host_profile_ranks_a_calls_functions_by_their_own_time():
    import time

    from tp_kernels.bench import host

    def slow():
        time.sleep(0.002)

    def call():
        slow()
        sum(range(10))

    rows = host.profiled(call, 5, cuda=False, top=3)
    assert len(rows) == 3 and all(len(row) == 4 for row in rows)
    where, per_call, own_us, cumulative_us = rows[0]  # time.sleep's own time: about 2 ms a call
    assert "sleep" in where and per_call == 1.0 and own_us > 1000 and cumulative_us >= own_us
    assert any("test_bench_tools.py" in w and "(slow)" in w for w, *_ in host.profiled(call, 5, cuda=False))
    # no collection pauses a profiled call (it would land on whichever function ran), and collections go on after
    import gc
    seen = []
    host.profiled(lambda: seen.append(gc.isenabled()), 3, cuda=False)
    assert seen == [True, False, False, False] and gc.isenabled()  # (the first call, unprofiled; then the 3)
    # the report's line: the first five rows, each function's own time a call
    text = host.profile_text([[f"f{i}", 1.0, 10.0 - i, 20.0] for i in range(7)])
    assert text == ("the functions by own time a call (us, under cProfile): f0 10.00; f1 9.00; f2 8.00; f3 7.00; "
                    "f4 6.00")


def _fingerprint_bench_rank():
    """fingerprints.run_rank and round_trips on this rank, each timing recorded: whether
    fingerprints were on, how many fingerprint exchanges the call made, and a made-up time handed
    back (the i-th timing's), so which of the times each row keeps is known."""
    from tp_kernels import _collectives, settings
    from tp_kernels.bench import fingerprints

    made_up = [3.0, 5.0, 2.0, 7.0, 4.0, 6.0, 8.0, 1.0]  # per backend: off, on, off, on
    exchanges, timings = [0], []
    time_backend, gather = fingerprints._time_backend, _collectives.all_gather_bytes

    def counted_gather(*args, **kwargs):
        exchanges[0] += 1
        return gather(*args, **kwargs)

    def recorded(*args):
        before = exchanges[0]
        time_backend(*args)
        timings.append((settings.fingerprints_enabled(), exchanges[0] - before, args[-1]))
        return made_up[len(timings) - 1]

    default = settings.fingerprints_enabled()
    # (large enough that the buffer sets rotated are fewer than their bound)
    config = {"cases": [cases.Case("column", "t", 1024, 1024, 1024).__dict__], "backends": ["reference", "pipelined"],
              "iters": 1, "warmup": 0, "modes": ["off", "on"]}
    with mock.patch.object(fingerprints, "_time_backend", recorded), \
            mock.patch.object(_collectives, "all_gather_bytes", counted_gather):
        rows = fingerprints.run_rank(config)
        after_rows = settings.fingerprints_enabled()
        before = exchanges[0]
        fixed = fingerprints.round_trips(config)
        fixed_exchanges = exchanges[0] - before
    return rows, timings, default, after_rows, settings.fingerprints_enabled(), fixed, fixed_exchanges


def test_fingerprint_bench_times_each_setting_as_named(world2):
    """``python -m tp_kernels.bench.fingerprints`` on 2 ranks: each backend of a case timed off, on,
    off, on, with fingerprints exchanged exactly in the timings named "on"; each setting keeps its
    faster time; the setting returns to what it was; the fixed costs' fingerprint exchange does
    exchange; the operands rotate through as many buffer sets as the main job's would for their
    bytes (a rank's input and weight): past twice the cache."""
    from tp_kernels.bench import measure

    rows, timings, default, after_rows, after_fixed, fixed, fixed_exchanges = world2.run(_fingerprint_bench_rank)[0]
    assert [on for on, _, _ in timings] == [False, True, False, True] * 2
    assert all((n > 0) == on for on, n, _ in timings), timings
    per_set = (1024 * 1024 + 512 * 1024) * 4  # x [m, k] and this rank's w [n / 2, k], float32
    assert {nsets for _, _, nsets in timings} == {measure.buffer_sets(per_set, False)}
    assert 2 < measure.buffer_sets(per_set, False) < measure._MAX_SETS
    assert [(r["target"], r["backend"], r["off_ms"], r["on_ms"]) for r in rows] == [
        ("column", "reference", 2e3, 5e3), ("column", "pipelined", 4e3, 1e3)]
    assert after_rows == default and after_fixed == default
    assert fixed_exchanges > 0 and fixed["fingerprint_us"] > 0 and fixed["all_reduce_us"] > 0


def test_fingerprint_bench_overheads_and_verdict():
    """The fingerprint benchmark's overheads (on / off - 1, DETAIL's over the same off time), their
    median and worst, and the verdict against the 3 % bar for turning fingerprints on by default."""
    from tp_kernels.bench import fingerprints

    rows = [{"target": "column", "m": 16, "in": 128, "out": 448, "backend": b, "off_ms": off, "on_ms": on}
            for b, off, on in (("reference", 2.0, 2.02), ("pipelined", 4.0, 5.0), ("reference", 1.0, 1.01))]
    detail = [{"off_ms": 3.0}, {"off_ms": 4.0}, {"off_ms": 0.5}]
    merged = fingerprints.merge(rows, detail)
    assert [r["overhead"] for r in merged] == pytest.approx([0.01, 0.25, 0.01])
    assert [r["detail_ms"] for r in merged] == [3.0, 4.0, 0.5]
    assert [r["detail_overhead"] for r in merged] == pytest.approx([0.5, 0.0, -0.5])
    summary = fingerprints.summarize(merged)
    assert summary == pytest.approx({"median_overhead": 0.01, "worst_overhead": 0.25, "cases": 3, "limit": 0.03,
                                     "below_limit": True, "median_detail_overhead": 0.0,
                                     "worst_detail_overhead": 0.5})
    assert fingerprints.summarize(fingerprints.merge(rows[1:2], []))["below_limit"] is False
    # at the bar itself: not below it
    assert fingerprints.summarize([{"overhead": fingerprints.DEFAULT_LIMIT}])["below_limit"] is False
    assert "detail_overhead" not in fingerprints.merge(rows, [])[0]
    table = fingerprints.format_table(merged).splitlines()
    assert len(table) == 4 and "DETAIL ms" in table[0]
    assert table[2].split()[-4:] == ["5.000", "25.0%", "4.000", "0.0%"]
    assert "DETAIL" not in fingerprints.format_table(fingerprints.merge(rows, []))


def test_fingerprint_bench_main_job_on_two_gloo_ranks(tmp_path):
    """python -m tp_kernels.bench.fingerprints on the CPU: every target of the main job at the
    Llama-3-70B shapes divided by 64, both backends, timed on and off, and again in a
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` world; the summary is that of its rows."""
    from tp_kernels.bench import fingerprints

    out = subprocess.run([sys.executable, "-m", "tp_kernels.bench.fingerprints", "--iters", "1", "--m", "16",
                          "--out-dir", str(tmp_path), "--tag", "t"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.load(open(tmp_path / "fingerprints-cpu-gloo-p2-t.json"))
    assert (record["backend"], record["p"]) == ("gloo", 2)
    rows = record["results"]
    assert sorted((r["target"], r["backend"]) for r in rows) == sorted(
        (t, b) for t in cases.TARGETS for b in ("reference", "pipelined"))
    assert {(r["m"], r["in"], r["out"]) for r in rows} == {(16, 8192 // 64, 28672 // 64), (16, 28672 // 64, 8192 // 64)}
    for r in rows:
        assert r["off_ms"] > 0 and r["on_ms"] > 0 and r["detail_ms"] > 0
        assert r["overhead"] == pytest.approx(r["on_ms"] / r["off_ms"] - 1)
    assert record["summary"] == pytest.approx(
        {**fingerprints.summarize(rows), **{k: record["summary"][k] for k in
                                            ("all_reduce_us", "fingerprint_us", "all_reduce_detail_us")}})
    assert all(record["summary"][k] > 0 for k in ("all_reduce_us", "fingerprint_us", "all_reduce_detail_us"))
    assert "fixed costs: a fingerprint exchange" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("bench, bad_p", [("fused", "9"), ("timeline", "1")])
def test_virtual_rank_bench_without_a_gpu_says_so(capsys, bench, bad_p):
    """The fused benchmark and the timeline without a GPU: exit status 2 and why; a rank count
    out of range is an argument error."""
    import importlib

    module = importlib.import_module(f"tp_kernels.bench.{bench}")
    assert module.main(["--out-dir", "unused"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--p", bad_p])


def test_timeline_summary_of_a_trace():
    """Where a traced call's GPU time went, from chrome-trace events: busy time per kind (the union
    over streams), summed durations, the copies' time beside a GEMM, the top names; host events,
    other phases and the stream's hold before the call (torch.cuda._sleep's kernel) passed over."""
    from tp_kernels.bench import timeline

    def event(name, cat, ts, dur, tid=7, ph="X"):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "ph": ph}

    events = [
        event("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", "kernel", 0.0, 10.0, tid=7),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 5.0, 10.0, tid=8),  # 5 us beside the first
        event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 12.0, 6.0, tid=9),  # 3 of its 6 us beside a GEMM
        event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 30.0, 2.0, tid=9),  # none
        event("tpk_wait_flags", "kernel", 20.0, 4.0, tid=9),
        event("tpk_set_flags", "kernel", 25.0, 1.0, tid=9),  # the flag writes: with the waits
        event("tpk_reduce_partials_bfloat16", "kernel", 40.0, 5.0, tid=7),
        event("Memset (Device)", "gpu_memset", 46.0, 1.0, tid=7),
        event("aten::linear", "cpu_op", 0.0, 100.0, tid=1),  # the host's: not a GPU activity
        event("at::cuda::(anonymous namespace)::spin_kernel(long)", "kernel", -500.0, 499.0, tid=7),  # the hold
        event("nvjet_hsh", "kernel", 0.0, 1.0, ph="i"),  # an instant, not a span
    ]
    out = timeline.summarize(events, top=2)
    assert out["activities"] == 8 and out["streams"] == 3 and out["span_us"] == 47.0
    assert out["busy_us"] == {"gemms": 15.0, "copies": 8.0, "waits": 5.0, "other": 6.0}
    assert out["kernel_us"] == {"gemms": 20.0, "copies": 8.0, "waits": 5.0, "other": 6.0}
    assert out["count"] == {"gemms": 2, "copies": 2, "waits": 2, "other": 2}
    assert out["copies_beside_gemms_us"] == 3.0 and out["copies_beside_gemms"] == pytest.approx(3.0 / 8.0)
    assert [name for name, _, _ in out["top"]] == ["nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT",
                                                   "sm90_xmma_gemm_bf16bf16_bf16f32"]
    assert timeline.summarize([event("aten::mm", "cpu_op", 0.0, 1.0)]) == {"activities": 0}
    # a real trace of host work (torch.profiler's export): no GPU activity in it
    x = torch.randn(64, 64)
    trace, held = timeline.traced(lambda: x @ x)
    assert any(e.get("cat") == "cpu_op" for e in trace) or torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert held is None and timeline.summarize(trace) == {"activities": 0}


@hypothesis_settings(max_examples=300, deadline=None)
@given(gemms=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 10)), max_size=6),
       copies=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 10)), max_size=6))
def test_timeline_busy_times_are_the_time_covered(gemms, copies):
    """The busy times and the copies' time beside a GEMM, for spans in any order, overlapping,
    nested, touching or apart, are the time they cover (counted microsecond by microsecond); the
    span runs from the first start to the last end; without copies their share beside a GEMM is
    none."""
    from tp_kernels.bench import timeline

    events = [{"name": name, "cat": cat, "ts": float(ts), "dur": float(dur), "tid": 1, "ph": "X"}
              for spans, name, cat in ((gemms, "nvjet", "kernel"), (copies, "Memcpy DtoD", "gpu_memcpy"))
              for ts, dur in spans]
    out = timeline.summarize(events)
    if not events:
        assert out == {"activities": 0}
        return

    def covered(spans):
        return {t for ts, dur in spans for t in range(ts, ts + dur)}

    assert out["busy_us"]["gemms"] == len(covered(gemms)) and out["busy_us"]["copies"] == len(covered(copies))
    assert out["copies_beside_gemms_us"] == len(covered(gemms) & covered(copies))
    assert out["span_us"] == max(ts + dur for ts, dur in gemms + copies) - min(ts for ts, _ in gemms + copies)
    if not covered(copies):
        assert out["copies_beside_gemms"] is None


def test_timeline_names_the_kernels_of_a_traced_call_in_the_order_they_ran():
    """:func:`tp_kernels.bench.timeline.kernels_of`: every kernel of a trace by its start, with its
    duration; the stream's hold, copies, memsets, host events and instants left out."""
    from tp_kernels.bench import timeline

    def event(name, cat, ts, dur, ph="X"):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "tid": 7, "ph": ph}

    events = [event("cublasLt::splitKreduce_kernel", "kernel", 30.0, 2.0),
              event("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopB_NNT", "Kernel", 10.0, 19.5),
              event("at::cuda::(anonymous namespace)::spin_kernel(long)", "kernel", -500.0, 499.0),
              event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 12.0, 6.0),
              event("Memset (Device)", "gpu_memset", 5.0, 1.0),
              event("aten::linear", "cpu_op", 0.0, 100.0), event("nvjet_x", "kernel", 0.0, 1.0, ph="i")]
    assert timeline.kernels_of(events) == [["nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopB_NNT", 19.5],
                                           ["cublasLt::splitKreduce_kernel", 2.0]]
    assert timeline.kernels_of([]) == []


def test_timeline_all_reduce_launches_by_stage():
    """The all-reduce kernel's launches by their place on their stream (stage k: the k-th launch of
    each stream, whatever order the trace lists them in); other kernels and host events passed over."""
    from tp_kernels.bench import timeline

    def event(name, ts, dur, tid, ph="X"):
        return {"name": name, "cat": "kernel", "ts": ts, "dur": dur, "tid": tid, "ph": ph}

    events = [event("tpk_all_reduce_bfloat16", 10.0, 7.0, tid=2),  # stream 2's second: summing
              event("tpk_all_reduce_bfloat16", 0.0, 2.0, tid=1),
              event("tpk_all_reduce_bfloat16", 1.0, 3.0, tid=2),
              event("tpk_all_reduce_bfloat16", 4.0, 5.0, tid=1),
              event("tpk_all_reduce_bfloat16", 3.0, 4.0, tid=3),  # stream 3 has one launch only
              event("tpk_set_flags", 0.0, 50.0, tid=1), event("tpk_all_reduce_bfloat16", 0.0, 99.0, tid=1, ph="i")]
    assert timeline.launches_by_stage(events) == [
        {"count": 3, "min_us": 2.0, "median_us": 3.0, "max_us": 4.0},
        {"count": 2, "min_us": 5.0, "median_us": 7.0, "max_us": 7.0}]
    assert timeline.launches_by_stage([]) == []


def test_fused_bench_chains_calls_by_phases_or_in_one_launch_a_rank(monkeypatch):
    """The decode figures' chained calls: each call's phases in rounds over the ranks (phase k of
    every rank before phase k + 1 of any), or each rank's call as one launch of all its phases
    (``enqueue(None)``), as a rank that is a process of its own runs it; calls one after another."""
    import contextlib
    import types

    from tp_kernels.backends import fused
    from tp_kernels.bench import fused as bench_fused

    log = []

    def rank_all_reduce(ctx, x, out, algorithm, stream):
        return fused.RankCall(out, 3, lambda phase=None: log.append((ctx, phase)))

    monkeypatch.setattr(bench_fused.fused, "rank_all_reduce", rank_all_reduce)
    monkeypatch.setattr(bench_fused, "forked", lambda streams: contextlib.nullcontext())
    vr = types.SimpleNamespace(p=2, contexts=["r0", "r1"], streams=[None, None])
    bench_fused._chained(vr, [None, None], [None, None], "two_shot", calls=2)
    assert log == [("r0", 0), ("r1", 0), ("r0", 1), ("r1", 1), ("r0", 2), ("r1", 2)] * 2
    log.clear()
    bench_fused._chained(vr, [None, None], [None, None], "two_shot", calls=2, one_launch=True)
    assert log == [("r0", None), ("r1", None)] * 2


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_fused_bench_case_moves_and_multiplies_what_the_op_does(monkeypatch, op):
    """The overlap benchmark's and the timeline's inputs (``fused_case``), on the CPU with the
    native calls' plain equivalents: each rank's GEMMs make its rows times its weight, its data
    movement the gathered rows (from rows holding only its own block) or the sum of every rank's
    partials of its block, and the fused call is the op's on the same inputs."""
    import types

    from tp_kernels.bench import fused as bench_fused

    def linear(x, w, out):
        return out.copy_(x.double() @ w.double().T)

    def reduce_partials(inputs, out):
        return out.copy_(sum(t.double() for t in inputs))

    monkeypatch.setattr(bench_fused._extension, "linear", linear)
    monkeypatch.setattr(bench_fused._extension, "reduce_partials", reduce_partials)
    calls = []
    p, (m, k, n) = 4, (8, 6, 5)
    vr = types.SimpleNamespace(p=p, device=torch.device("cpu"),
                               all_gather_matmul=lambda xs, ws: calls.append(("all_gather_matmul", xs, ws)),
                               matmul_reduce_scatter=lambda xs, ws: calls.append(("matmul_reduce_scatter", xs, ws)))
    case = bench_fused.fused_case(vr, op, (m, k, n))
    mp = m // p
    assert [tuple(x.shape) for x in case.xs] == [(mp if op == "all_gather_matmul" else m, k)] * p
    assert [tuple(w.shape) for w in case.ws] == [(n, k)] * p
    if op == "all_gather_matmul":
        for q in range(p):  # only the rank's own block before the copies
            case.rows[q].zero_()[q * mp:(q + 1) * mp] = case.xs[q]
    for q in range(p):
        case.comms(q, None) if op == "all_gather_matmul" else case.gemms(q, None)
    for _ in range(2):  # (a rank's reduction reads its inbox as the others' copies left it: full the second time)
        for q in range(p):
            case.gemms(q, None) if op == "all_gather_matmul" else case.comms(q, None)
    whole = torch.cat(case.xs) if op == "all_gather_matmul" else None
    for q in range(p):
        rows = whole if op == "all_gather_matmul" else case.xs[q]
        assert torch.equal(case.rows[q], rows)
        torch.testing.assert_close(case.outs[q], (rows.double() @ case.ws[q].double().T).to(torch.bfloat16))
        if op == "matmul_reduce_scatter":
            block = sum(case.outs[r][q * mp:(q + 1) * mp].double() for r in range(p))
            torch.testing.assert_close(case.moved[q], block.to(torch.bfloat16))
        else:
            assert case.moved[q] is case.rows[q]
    case.fused_op()
    assert calls == [(op, case.xs, case.ws)]


def test_fused_bench_overlap_efficiency():
    from tp_kernels.bench.fused import overlap_efficiency

    assert overlap_efficiency(10.0, 4.0, 10.0) == 1.0  # the communication fully hidden
    assert overlap_efficiency(10.0, 4.0, 14.0) == 0.0  # not at all
    assert overlap_efficiency(10.0, 4.0, 11.0) == pytest.approx(0.75)


def test_fused_bench_thresholds_from_a_sweep():
    from tp_kernels.bench.fused import thresholds

    sweep = {"one_shot": {1: 1.0, 2: 2.0, 4: 9.0, 8: 20.0},
             "two_shot": {1: 3.0, 2: 2.5, 4: 4.0, 8: 12.0},
             "scatter_gather": {1: 9.0, 2: 9.0, 4: 5.0, 8: 7.0}}
    out = thresholds(sweep)
    assert out["fastest"] == {"1": "one_shot", "2": "one_shot", "4": "two_shot", "8": "scatter_gather"}
    assert out["one_shot_max_bytes"] == 2 and out["two_shot_max_bytes"] == 4
    assert thresholds({"one_shot": {1: 2.0}, "two_shot": {1: 1.0}})["one_shot_max_bytes"] is None


def test_gpu_bench_records_are_saved_by_device_and_tag(tmp_path):
    import json

    from tp_kernels.bench.records import save_record

    path = save_record({"device": "NVIDIA H100 80GB HBM3", "figure": 1.5}, str(tmp_path), "fused", "abc1234")
    assert os.path.basename(path) == "fused-nvidia-h100-80gb-hbm3-abc1234.json"
    assert json.load(open(path)) == {"device": "NVIDIA H100 80GB HBM3", "figure": 1.5}
    assert os.path.basename(save_record({"device": "x"}, str(tmp_path), "extension", "")) == "extension-x.json"


def test_what_a_record_says_of_its_run(tmp_path, monkeypatch, capsys):
    """A record's commit is ``TP_KERNELS_COMMIT`` when set, else this source tree's (git), else
    "unknown"; records go to the user's cache (``$XDG_CACHE_HOME``, else ``~/.cache``), never the
    source tree, unless told; a CPU run is named "cpu" in file names; the GPU benchmarks' record
    is not started without a CUDA device, and says why."""
    from tp_kernels.bench import records

    monkeypatch.setenv("TP_KERNELS_COMMIT", "abc1234")
    assert records.commit() == "abc1234"
    monkeypatch.delenv("TP_KERNELS_COMMIT")
    here = os.path.dirname(records.__file__)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
    assert records.commit() == (git.stdout.strip() if git.returncode == 0 else "unknown")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
    assert records.commit() == "unknown"
    monkeypatch.undo()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert records.default_out_dir() == str(tmp_path / "cache" / "tp_kernels" / "bench")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert records.default_out_dir() == str(tmp_path / "home" / ".cache" / "tp_kernels" / "bench")

    cpu = records.device_name("gloo")
    assert cpu.startswith("CPU (") and f"{os.cpu_count()} cores" in cpu and records.slug(cpu) == "cpu"
    assert records.slug("NVIDIA H200") == "nvidia-h200"
    if not torch.cuda.is_available():
        assert records.gpu_record("tp_kernels.bench.fused") is None
        assert "tp_kernels.bench.fused: needs a CUDA device" in capsys.readouterr().err


# --- the GPU suite's records (bench/gpu_summary.py), from fake logs ------------------------------


def _gpu_summary():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "gpu_summary.py")
    spec = importlib.util.spec_from_file_location("gpu_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: a test module of five tests: one passing, one failing, then a class's and two parametrized ones
SOME_TESTS = ("import pytest\n"
              "def test_passes():\n    pass\n"
              "def test_fails():\n    assert False\n"
              "class TestLater:\n    def test_never(self):\n        pass\n"
              "@pytest.mark.parametrize('v', [1, 2])\ndef test_param(v):\n    pass\n")


def _suite_env(logs) -> dict:
    """The environment of a pytest run as the GPU suite starts it, its list of selected tests in
    ``logs``: this one's, less pytest-xdist's worker name (a run under a worker that is not the
    first would leave the list unwritten, as such a worker does)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    return {**env, "TP_KERNELS_COLLECTED_FILE": str(logs / "gpu-tests-collected.txt")}


def _with_suite_hooks(folder) -> None:
    """A conftest.py in ``folder`` that takes python_tests/conftest.py's hooks for the GPU suite:
    ``--shard``, ``--select-from`` and the list of the tests selected."""
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    (folder / "conftest.py").write_text(
        f"import runpy\nhooks = runpy.run_path({conftest!r})\n"
        "pytest_addoption = hooks['pytest_addoption']\n"
        "pytest_collection_modifyitems = hooks['pytest_collection_modifyitems']\n"
        "pytest_collection_finish = hooks['pytest_collection_finish']\n")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="python_tests.test_gpu" name="test_a" time="1.5"/>
<testcase classname="python_tests.test_gpu" name="test_b[x]" time="12.25">{b}</testcase>
<testcase classname="python_tests.test_gpu" name="test_c" time="0.5">{c}</testcase>
<testcase classname="python_tests.test_gpu" name="test_d" time="0.1"/>
</testsuite></testsuites>"""


def test_the_gpu_tests_record_counts_failures_skips_and_durations(tmp_path):
    import json

    summary = _gpu_summary()
    logs, results = tmp_path / "logs", tmp_path / "results"
    logs.mkdir()
    (logs / "gpu-tests.xml").write_text(JUNIT.format(
        b='<failure message="AssertionError: max error 3e-2 &gt; 1e-2&#10;more">tb</failure>',
        c='<skipped message="needs a CUDA device"/>'))
    assert summary.main(["tests", str(logs), str(results), "abc1234"]) == 1  # a failure: not green
    record = json.load(open(results / "gpu-tests-abc1234.json"))
    assert record["counts"] == {"tests": 4, "failed": 1, "errors": 0, "skipped": 1, "passed": 2, "not_reached": None}
    assert record["failed"] == [{"test": "python_tests.test_gpu::test_b[x]",
                                 "message": "AssertionError: max error 3e-2 > 1e-2"}]
    assert record["skipped"][0]["message"] == "needs a CUDA device"
    assert record["durations"]["python_tests.test_gpu::test_b[x]"] == 12.25
    assert list(record["slowest"])[0] == "python_tests.test_gpu::test_b[x]" and record["seconds"] == pytest.approx(14.35, abs=0.06)
    assert {"device", "commit", "date", "part"} <= set(record) and record["commit"] == "abc1234"
    (logs / "gpu-tests.xml").write_text(JUNIT.format(b="", c=""))
    assert summary.main(["tests", str(logs), str(results), "abc1234"]) == 0  # all passed: green
    (logs / "gpu-tests.xml").write_text(JUNIT.format(b="", c='<skipped message="the native module is not built"/>'))
    assert summary.main(["tests", str(logs), str(results), "abc1234"]) == 1  # a skip on a GPU machine: not green


def test_the_gpu_tests_in_parts(tmp_path):
    """``--shard I/N`` selects every N-th test from the I-th (the parts together select each test
    once; a bad part is refused), and each part's record has its own name."""
    import json

    from conftest import shard

    parts = [list(shard(10, f"{i}/3")) for i in (1, 2, 3)]
    assert parts == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    for bad in ("0/2", "3/2", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="--shard: expected I/N"):
            shard(10, bad)
    summary = _gpu_summary()
    logs, results = tmp_path / "logs", tmp_path / "results"
    logs.mkdir()
    (logs / "gpu-tests.xml").write_text(JUNIT.format(b="", c=""))
    for selection, name in ((["-k", "x", "--shard", "1/2"], "gpu-tests-abc1234-1of2.json"),
                            (["--shard=2/2"], "gpu-tests-abc1234-2of2.json"), (["-k", "x"], "gpu-tests-abc1234.json"),
                            (["--select-from", "list.txt"], "gpu-tests-abc1234-rerun.json"),
                            (["--select-from=list.txt", "--shard", "1/2"], "gpu-tests-abc1234-rerun-1of2.json")):
        (logs / "gpu-tests-selection.txt").write_text("\n".join(selection) + "\n")
        assert summary.main(["tests", str(logs), str(results), "abc1234"]) == 0
        assert json.load(open(results / name))["selection"] == selection


def test_the_gpu_tests_record_names_the_tests_a_stopped_run_never_reached(tmp_path):
    """A real pytest run stopped early (-x here, as --session-timeout or SIGINT stop it) with the
    suite's conftest hook: the record lists the selected tests that never ran, in junit's names
    (a class, a parametrized test), and is not green; without the junit XML nothing counts as run."""
    import json
    import subprocess
    import sys

    summary = _gpu_summary()
    tests, logs, results = tmp_path / "tests", tmp_path / "logs", tmp_path / "results"
    tests.mkdir()
    logs.mkdir()
    _with_suite_hooks(tests)
    (tests / "test_x.py").write_text(SOME_TESTS)
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", str(tests / "test_x.py"),
                          f"--junitxml={logs / 'gpu-tests.xml'}", f"--rootdir={tests}"], cwd=tests, capture_output=True,
                         text=True, timeout=120, env=_suite_env(logs))
    assert out.returncode == 1, out.stdout + out.stderr
    (logs / "status.txt").write_text("gpu-tests 1\n")
    assert summary.main(["tests", str(logs), str(results), "abc1234"]) == 1
    record = json.load(open(results / "gpu-tests-abc1234.json"))
    assert record["counts"] == {"tests": 2, "failed": 1, "errors": 0, "skipped": 0, "passed": 1, "not_reached": 3}
    assert record["not_reached"] == ["test_x.TestLater::test_never", "test_x::test_param[1]", "test_x::test_param[2]"]
    assert record["exit_status"] == 1 and record["junit_xml"] and record["selection"] is None
    (logs / "gpu-tests-selection.txt").write_text("-k\nnative_linear\n")
    summary.main(["tests", str(logs), str(results), "abc1234"])
    assert json.load(open(results / "gpu-tests-abc1234.json"))["selection"] == ["-k", "native_linear"]
    os.remove(logs / "gpu-tests.xml")  # pytest killed: no XML
    assert summary.main(["tests", str(logs), str(results), "abc1234"]) == 1
    record = json.load(open(results / "gpu-tests-abc1234.json"))
    assert record["counts"]["tests"] == 0 and record["counts"]["not_reached"] == 5 and not record["junit_xml"]


def test_the_gpu_tests_run_again_from_a_record(tmp_path, monkeypatch, capsys):
    """``gpu_summary.py rerun RECORD`` lists the node ids of the tests a run failed or never
    reached (a class's test too), and ``--select-from`` that list runs exactly those, recorded as
    the rerun; a list naming a test not collected is a usage error naming it."""
    import json
    import subprocess
    import sys

    summary = _gpu_summary()
    tests = tmp_path / "tests"
    tests.mkdir()
    _with_suite_hooks(tests)
    (tests / "test_x.py").write_text(SOME_TESTS)

    def run(logs, *args):
        logs.mkdir()
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py",
                               f"--junitxml={logs / 'gpu-tests.xml'}", f"--rootdir={tests}", *args], cwd=tests,
                              capture_output=True, text=True, timeout=120,
                              env=_suite_env(logs))

    first, again, results = tmp_path / "first", tmp_path / "again", tmp_path / "results"
    assert run(first, "-x").returncode == 1  # (stopped at the failure: three never reached)
    summary.main(["tests", str(first), str(results), "abc1234"])
    monkeypatch.chdir(tests)  # (where the node ids' files are)
    ids = summary.rerun([str(results / "gpu-tests-abc1234.json")])
    assert ids == ["test_x.py::test_fails", "test_x.py::TestLater::test_never", "test_x.py::test_param[1]",
                   "test_x.py::test_param[2]"]
    capsys.readouterr()
    assert summary.main(["rerun", str(results / "gpu-tests-abc1234.json")]) == 0  # (the command line's)
    (tmp_path / "list.txt").write_text(capsys.readouterr().out)
    assert (tmp_path / "list.txt").read_text().split() == ids
    out = run(again, "--select-from", str(tmp_path / "list.txt"))
    assert out.returncode == 1, out.stdout + out.stderr  # (test_fails fails again)
    (again / "gpu-tests-selection.txt").write_text(f"--select-from\n{tmp_path / 'list.txt'}\n")
    summary.main(["tests", str(again), str(results), "abc1234"])
    record = json.load(open(results / "gpu-tests-abc1234-rerun.json"))
    assert sorted(record["durations"]) == sorted(["test_x::test_fails", "test_x.TestLater::test_never",
                                                  "test_x::test_param[1]", "test_x::test_param[2]"])
    assert record["counts"]["failed"] == 1 and record["counts"]["not_reached"] == 0
    (tmp_path / "list.txt").write_text("test_x.py::test_gone\n")
    out = run(tmp_path / "bad", "--select-from", str(tmp_path / "list.txt"))
    assert out.returncode == 4 and "--select-from: 1 of the tests" in out.stderr and "test_x.py::test_gone" in out.stderr


def test_the_gpu_tests_on_several_workers(tmp_path):
    """The suite's tests on pytest-xdist workers (bench/gpu_suite.sh), with the suite's conftest
    hooks: the list of the tests selected is written once, whole, though every worker collects
    them; the record of the run counts each test once and is green; ``--shard`` selects alike on
    every worker."""
    import json
    import subprocess
    import sys

    summary = _gpu_summary()
    tests = tmp_path / "tests"
    tests.mkdir()
    _with_suite_hooks(tests)
    (tests / "test_x.py").write_text(  # each test writes down the worker that ran it
        "import os, pytest\n@pytest.mark.parametrize('v', range(7))\ndef test_param(v):\n"
        "    open(f'ran-{v}', 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n")
    for args, expected in (([], [f"test_x::test_param[{v}]" for v in range(7)]),
                           (["--shard", "2/3"], ["test_x::test_param[1]", "test_x::test_param[4]"])):
        logs, results = tmp_path / f"logs{len(args)}", tmp_path / f"results{len(args)}"
        logs.mkdir()
        out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                              str(tests / "test_x.py"), f"--junitxml={logs / 'gpu-tests.xml'}", f"--rootdir={tests}",
                              *args], cwd=tests, capture_output=True, text=True, timeout=300,
                             env=_suite_env(logs))
        assert out.returncode == 0, out.stdout + out.stderr
        ran = {path.name: path.read_text() for path in tests.glob("ran-*")}
        assert len(ran) == len(expected) and set(ran.values()) <= {"gw0", "gw1"}, ran
        for path in tests.glob("ran-*"):
            path.unlink()
        collected = (logs / "gpu-tests-collected.txt").read_text().splitlines()
        assert [summary._junit_name(line) for line in collected] == expected
        assert summary.main(["tests", str(logs), str(results), "abc1234"]) == 0
        record = json.load(open(results / "gpu-tests-abc1234.json"))
        assert sorted(record["durations"]) == sorted(expected) and record["counts"]["not_reached"] == 0


def test_the_gpu_suite_steps_keep_to_the_parts_budget(tmp_path):
    """bench/gpu_steps.sh: a step is cut to what the part's budget leaves (and stopped there with
    SIGINT, status 124), a step with no time left is not started (125), and the logs so far are in
    OUT after every step."""
    import subprocess
    import tarfile
    import time

    steps = os.path.join(os.path.dirname(__file__), "..", "bench", "gpu_steps.sh")
    logs, out = tmp_path / "logs", tmp_path / "out"
    logs.mkdir()
    out.mkdir()
    script = (f"budget_s=8; reserve_s=0; logs={logs}; OUT={out}; LOGS_TARBALL=logs.tar.gz\n. {steps}\n"
              "step slow 60 sleep 30\nstep late 60 true\n")
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 25, "the step ran past the part's budget"
    lines = [line.split() for line in (logs / "status.txt").read_text().splitlines()]
    assert [line[:2] for line in lines] == [["slow", "124"], ["late", "125"]], done.stdout + done.stderr
    assert 7 <= int(lines[0][2]) <= 9 and lines[1][2] == "0"  # the seconds each took
    assert "late: not started, the call's budget of 8 s is spent" in done.stderr
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"./status.txt", "./slow.log"} <= set(tar.getnames())


FAKE_PYTHON = """#!/usr/bin/env bash
# python3 as bench/gpu_suite.sh calls it, without a GPU: each call noted in CALLS; the build, the
# GPU tests (one passing test in the junit XML) and the benchmarks faked; the rest the real python
echo "$*" >>"$CALLS"
case "$*" in
  "-c import torch; print(torch.version.cuda.split('.')[0])") echo 13 ;;
  "-m pip install"*) echo fake build ;;
  "-m pytest python_tests -m gpu"*)
    for arg in "$@"; do
      case "$arg" in --junitxml=*) echo '<testsuites><testsuite><testcase classname="python_tests.test_gpu" name="test_a" time="0.5"/></testsuite></testsuites>' >"${arg#--junitxml=}" ;; esac
    done
    echo python_tests/test_gpu.py::test_a >"$TP_KERNELS_COLLECTED_FILE" ;;
  "-m tp_kernels.bench"*) echo fake benchmark ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


def test_the_gpu_suite_runs_all_its_parts_in_one_call(tmp_path):
    """bench/gpu_suite.sh all (a copy, with a fake python and compute-sanitizer): one build, then the
    tests (on workers, a per-test and a session timeout inside their share of the budget), the
    sanitizers, the benchmarks (the main job --quick with 20 samples a figure) in that order; a
    record per part in bench/results and in OUT, with one tarball of every part's logs; green."""
    import json
    import shutil
    import subprocess
    import sys
    import tarfile

    here = os.path.join(os.path.dirname(__file__), "..", "bench")
    repo, out, fakes = tmp_path / "repo", tmp_path / "out", tmp_path / "bin"
    for folder in (repo / "bench", out, fakes):
        folder.mkdir(parents=True)
    for name in ("gpu_suite.sh", "gpu_steps.sh", "gpu_summary.py"):
        shutil.copy(os.path.join(here, name), repo / "bench" / name)
    (fakes / "python").write_text(FAKE_PYTHON)
    (fakes / "compute-sanitizer").write_text('#!/usr/bin/env bash\necho "$*" >>"$CALLS"\n'
                                             'echo "========= ERROR SUMMARY: 0 errors"\n')
    for fake in fakes.iterdir():
        fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PYTHON": str(fakes / "python"), "REAL_PYTHON": sys.executable, "CALLS": str(calls),
           "PATH": f"{fakes}:{os.environ['PATH']}", "OUT": str(out), "TP_KERNELS_COMMIT": "abc1234",
           "TP_KERNELS_SUITE_BUDGET_S": "400"}
    done = subprocess.run(["bash", str(repo / "bench" / "gpu_suite.sh"), "all"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = calls.read_text().splitlines()
    builds = [i for i, line in enumerate(lines) if line.startswith("-m pip install")]
    tests = [i for i, line in enumerate(lines) if line.startswith("-m pytest python_tests -m gpu")]
    sanitizers = [i for i, line in enumerate(lines) if line.startswith("--tool")]
    benches = [i for i, line in enumerate(lines) if line.startswith("-m tp_kernels.bench")]
    assert len(builds) == 1 and len(tests) == 1 and len(sanitizers) == 2 and len(benches) == 5, lines
    assert builds[0] < tests[0] < sanitizers[0] < sanitizers[1] < benches[0], lines  # correctness first
    pytest_args = lines[tests[0]].split()
    assert "--timeout" in pytest_args and pytest_args[pytest_args.index("-n") + 1] == "4"
    session = int(pytest_args[pytest_args.index("--session-timeout") + 1])
    assert 150 <= session <= 290  # inside the tests' 320 s
    assert [lines[i].split()[1] for i in sanitizers] == ["memcheck", "racecheck"]
    assert "--quick --iters 20" in lines[benches[0]] and not any("-m pytest bench" in line for line in lines)
    (peers,) = [line for line in lines if "--peers" in line]  # (fewer samples than alone: what `all` leaves it)
    assert "--samples 10 --profile 10" in peers, peers
    records = {name: json.load(open(out / f"gpu-{name}-abc1234.json")) for name in ("tests", "sanitize", "bench")}
    assert all(r["green"] and r["commit"] == "abc1234" for r in records.values())
    assert records["tests"]["counts"]["passed"] == 1 and records["tests"]["counts"]["not_reached"] == 0
    assert set(records["sanitize"]["tools"]) == {"memcheck", "racecheck"}
    assert list(records["bench"]["steps"]) == ["bench", "fused", "timeline", "host", "host-peers"]
    assert sorted(os.listdir(repo / "bench" / "results")) == sorted(f"gpu-{n}-abc1234.json" for n in records)
    with tarfile.open(out / "gpu-all-abc1234-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./build.log", "./tests/status.txt", "./sanitize/sanitize-memcheck.log", "./bench/bench.log"} <= names


def test_the_gpu_sanitize_and_bench_records(tmp_path, capsys):
    import json

    summary = _gpu_summary()
    logs, results = tmp_path / "logs", tmp_path / "results"
    logs.mkdir()
    (logs / "status.txt").write_text("memcheck 0 31\nracecheck 9 40\n")
    (logs / "sanitize-memcheck.log").write_text("wrong: none\n========= ERROR SUMMARY: 0 errors\n")
    (logs / "sanitize-racecheck.log").write_text("========= ERROR SUMMARY: 2 errors\n")
    out = tmp_path / "out"  # the suite's $OUT: a copy of the record there too
    out.mkdir()
    assert summary.main(["sanitize", str(logs), str(results), "c0ffee", str(out)]) == 1
    tools = json.load(open(results / "gpu-sanitize-c0ffee.json"))["tools"]
    assert tools == {"memcheck": {"exit_status": 0, "errors": 0, "seconds": 31},
                     "racecheck": {"exit_status": 9, "errors": 2, "seconds": 40}}
    assert json.load(open(out / "gpu-sanitize-c0ffee.json"))["tools"] == tools
    (logs / "status.txt").write_text("memcheck 0 6\nracecheck 0 6\n")  # racecheck's own summary line
    (logs / "sanitize-racecheck.log").write_text("wrong: none\n========= RACECHECK SUMMARY: 0 hazards displayed "
                                                 "(0 errors, 0 warnings)\n")
    assert summary.main(["sanitize", str(logs), str(results), "c0ffee"]) == 0
    assert json.load(open(results / "gpu-sanitize-c0ffee.json"))["tools"]["racecheck"] == {
        "exit_status": 0, "errors": 0, "seconds": 6}
    (logs / "status.txt").write_text("bench 0 120\nextension 124 60\n")
    (logs / "bench").mkdir()
    (logs / "bench" / "h100.json").write_text(json.dumps({"device": "H100", "measurements": [1, 2], "rows": [3]}))
    (logs / "extension").mkdir()
    (logs / "extension" / "extension-h100.json").write_text(json.dumps({"device": "H100",
                                                                        "hold": {"samples": 40, "exposed": 2}}))
    capsys.readouterr()
    assert summary.main(["bench", str(logs), str(results), "c0ffee"]) == 1  # a step out of time
    record = json.load(open(results / "gpu-bench-c0ffee.json"))
    assert record["steps"] == {"bench": 0, "extension": 124} and record["step_seconds"] == {"bench": 120, "extension": 60}
    assert record["records"]["bench/h100.json"] == {"device": "H100", "rows": [3]}
    assert record["holds"] == {"extension/extension-h100.json": {"samples": 40, "exposed": 2}}
    assert "extension/extension-h100.json: 2 of 40 samples past the hold" in capsys.readouterr().out
    assert summary.main(["nonsense", str(logs), str(results), "c0ffee"]) == 2


def test_the_gpu_suite_script_names_its_parts():
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "bench", "gpu_suite.sh")
    out = subprocess.run(["bash", script, "everything"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage: bash bench/gpu_suite.sh {all|tests [PYTEST_ARGS...]|bench|sanitize}" in out.stderr
    for part in ("bench", "all"):
        out = subprocess.run(["bash", script, part, "-k", "x"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and f"bench/gpu_suite.sh {part} takes no arguments" in out.stderr


def test_the_kernel_profile_without_ncu_or_a_gpu(tmp_path):
    """bench/gpu_profile.sh says that ncu is missing (exit 2); its program counts the launches ncu
    skips and profiles (the all-reduce kernel's: one a phase a rank) and, without a GPU, says so."""
    from tp_kernels import _extension

    bench = os.path.join(os.path.dirname(__file__), "..", "bench")
    if any(os.path.exists(p) for p in ("/opt/nvidia/nsight-compute", "/usr/local/cuda/bin/ncu")):
        pytest.skip("ncu is installed here")
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not os.path.exists(os.path.join(d, "ncu")))
    out = subprocess.run(["bash", os.path.join(bench, "gpu_profile.sh")], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PATH=path, OUT=str(tmp_path)))
    assert out.returncode == 2 and "ncu (Nsight Compute) is not installed here" in out.stderr
    program = [sys.executable, os.path.join(bench, "all_reduce_kernel.py")]
    if _extension.unavailable() is None:
        C = _extension.require()
        for algorithm, calls in (("one_shot", 3), ("two_shot", 2)):
            per_call = 8 * C.fused_phases("matmul_all_reduce", algorithm)
            run = subprocess.run(program + ["--p", "8", "--algorithm", algorithm, "--calls", str(calls), "--launches"],
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, run.stderr
            assert run.stdout.split() == [str(per_call * (calls - 1)), str(per_call)]
        bad = subprocess.run(program + ["--algorithm", "scatter_gather", "--launches"], capture_output=True,
                             text=True, timeout=120)
        assert bad.returncode == 2 and "--algorithm: one of the all-reduce kernel's algorithms" in bad.stderr
    if not torch.cuda.is_available():
        run = subprocess.run(program, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "needs a CUDA device and the native extension" in run.stderr


def test_the_kernel_profile_keeps_to_its_budget_and_returns_what_ran(tmp_path):
    """bench/gpu_profile.sh under its budget, with stand-ins for ncu (a report made at once for the
    first case, the second one hanging) and for its program (the launches counted at once): the
    first case's report, CSV pages and log, the second stopped at what the budget left it (124),
    the others not started (125), each in status.txt, all in the tarball in $OUT, and exit status
    1."""
    import tarfile

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ncu = bin_dir / "ncu"
    ncu.write_text("""#!/usr/bin/env bash
if [ "$1" = --import ]; then printf '"ID","Metric Name","Metric Value"\\n"0","x","1"\\n'; exit 0; fi
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
case "$out" in *65536*) exec sleep 120 ;; esac
echo "==PROF== Report: $out.ncu-rep"
touch "$out.ncu-rep"
""")
    python = bin_dir / "python"  # (the extension "imports"; the launches: 2 calls' worth to skip, 1 to profile)
    python.write_text("""#!/usr/bin/env bash
case "$*" in *--launches*) echo "32 16" ;; esac
""")
    for f in (ncu, python):
        f.chmod(0o755)
    out_dir = tmp_path / "out"
    bench = os.path.join(os.path.dirname(__file__), "..", "bench")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OUT=str(out_dir),
               PYTHON=str(python), TP_KERNELS_PROFILE_BUDGET_S="12")
    run = subprocess.run(["bash", os.path.join(bench, "gpu_profile.sh")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    with tarfile.open(out_dir / "gpu-profile.tar.gz") as tar:
        names = {os.path.normpath(n) for n in tar.getnames()}
        status = tar.extractfile("./gpu-profile/status.txt").read().decode().split("\n")
    ran = "ncu-one_shot-16384"
    assert {f"gpu-profile/{ran}{end}" for end in (".ncu-rep", ".csv", "-raw.csv", ".log")} <= names
    codes = [line.split()[:2] for line in status if line]
    assert codes == [[ran, "0"], ["ncu-one_shot-65536", "124"], ["ncu-two_shot-65536", "125"],
                     ["ncu-one_shot-4194304", "125"], ["ncu-two_shot-4194304", "125"]], run.stdout + run.stderr
    assert "gpu-profile/ncu-one_shot-65536.log" in names and "gpu-profile/ncu-two_shot-65536.log" not in names
    assert "ncu-two_shot-4194304: not started, the call's budget of 12 s is spent" in run.stderr


# --- the main job on one GPU: its report's layout, from made-up measurements -------------------------


def _fake_one_gpu_measurements(scale=1.0):
    from tp_kernels.bench import one_gpu

    gpu = pm.GPUS[one_gpu.PROJECTED["gpu"]]
    roofline = pm.RooflineGemm(gpu)
    latency = [{"p": 8, "m": m, "k": 3584, "n": 8192, "bytes": m * 8192 * 2, "gemms_ms": 0.010,
                "nccl_one_rank_all_reduce_ms": 0.02, "reference_one_rank_ms": 0.03,
                "algorithms_ms": {"one_shot": 0.010 + m * 0.0016, "two_shot": 0.018, "scatter_gather": 0.030}}
               for m in (1, 4, 16)]
    return {
        "projection_gemm_s": [[m, n, k, d, scale * roofline(m, n, k, d)] for m, n, k, d in one_gpu.projection_shapes()],
        "extension": {
            "gemm_throughput": {"ratio": 0.995},
            "host_overhead": {"added_eager_us": {"native_linear": 2.0, "matmul_all_reduce_pipelined": 4.0,
                                                 "matmul_all_reduce_fused": 7.5, "matmul_all_reduce_auto": 3.0},
                              "added_graph_us": {"matmul_all_reduce_pipelined": 0.1, "matmul_all_reduce_fused": 0.2,
                                                 "matmul_all_reduce_auto": 0.0},
                              "profile": {"matmul_all_reduce_fused": [["tp_kernels/ops.py:67(run)", 1.0, 3.5, 20.0],
                                                                      ["backends/fused.py:247(_reduction)", 1.0, 2.25,
                                                                       9.0]]}},
            "chunking": {"column": {"native_vs_f_linear": 1.0, "4_row_chunks": {"vs_unsplit": 0.98}},
                         "row": {"native_vs_f_linear": 0.985, "4_row_chunks": {"vs_unsplit": 0.96},
                                 "4_row_chunks_two_streams": {"vs_unsplit": 0.975},
                                 "native_matmul_all_reduce_4_chunks_two_streams": {"vs_unsplit": 0.965},
                                 "tuned": {"candidates": 8, "4_row_chunks": {"vs_unsplit": 0.99},
                                           "native_matmul_all_reduce_4_chunks": {"vs_unsplit": 0.96}}},
                         "target": 0.97},
            "decode_gemms": {"column": {"m": 16, "forward": {"ratio": 1.01}, "dgrad": {"ratio": 0.8}},
                             "row": {"m": 16, "forward": {"ratio": 0.995}, "dgrad": {"ratio": 1.2}}, "target": 0.99},
        },
        # the model's times for these: 5.129 and 5.787 ms (perf_model.predict_virtual_overlap)
        "fused": {"overlap": {"all_gather_matmul": {"p": 8, "overlap_efficiency": 0.97, "gemm_slowdown": 0.02,
                                                    "t_gemm_ms": 5.0, "t_comm_ms": 0.8, "t_overlap_ms": 5.4},
                              "matmul_reduce_scatter": {"p": 8, "overlap_efficiency": 0.90, "gemm_slowdown": 0.04,
                                                        "t_gemm_ms": 5.0, "t_comm_ms": 1.5, "t_overlap_ms": 5.1}},
                  "all_reduce_latency": latency},
    }


def test_a_figure_at_its_bound_meets_its_target():
    """A target is a bound a figure may reach: at the bound it meets it, a little past it (on the
    wrong side of its sense) it misses, and a figure not measured misses."""
    from tp_kernels.bench.targets import TARGETS, meets
    for name, (bound, sense, _) in TARGETS.items():
        past = bound * (1 - 1e-9) if sense == ">=" else bound * (1 + 1e-9)
        assert meets(name, bound) and not meets(name, past) and not meets(name, None), name


def test_one_gpu_report_reads_every_figure_against_its_target():
    from tp_kernels.bench import one_gpu

    assert one_gpu.applies("cuda", 1) and not one_gpu.applies("cuda", 2) and not one_gpu.applies("cpu", 1)
    rows = [{"target": "matmul_all_reduce", "m": 16, "in": 3584, "out": 8192, "dtype": "bfloat16", "p": 1,
             "backend": b, "resolved": b, "gemm_ms": 0.010, "median_ms": t} for b, t in (("reference", 0.0125),
                                                                                       ("pipelined", 0.0110))]
    rows.append(dict(rows[0], target="row", backend="reference"))  # a layer: not an op's per-rank cost
    rows.append(dict(rows[0], p=2, backend="auto"))  # a case of 2 ranks: no per-rank cost either
    rep = one_gpu.report(_fake_one_gpu_measurements(), rows, "FakeGPU")
    verdicts = {c["what"]: c["meets"] for c in rep["checks"]}
    assert verdicts["native GEMM / F.linear, 8192^3"] and verdicts["native GEMM / F.linear, 70B TP8 column"]
    assert not verdicts["native GEMM / F.linear, 70B TP8 row"]  # 0.985 < 0.99
    assert verdicts["native GEMM / F.linear, m = 16, 70B TP8 column forward"]
    assert not verdicts["native GEMM / F.linear, m = 16, 70B TP8 column dgrad"]  # 0.8 < 0.99
    assert verdicts["native GEMM / F.linear, m = 16, 70B TP8 row forward"]
    assert verdicts["native GEMM / F.linear, m = 16, 70B TP8 row dgrad"]
    assert verdicts["4 row chunks / unsplit, 70B TP8 column"] and not verdicts["4 row chunks / unsplit, 70B TP8 row"]
    # the two-stream forms where the record has them (the row shape's here: 0.975 meets 0.97, 0.965 not)
    assert verdicts["4 row chunks on two streams / unsplit, 70B TP8 row"]
    assert not verdicts["native matmul_all_reduce, 1 rank, 4 chunks on two streams / unsplit, 70B TP8 row"]
    assert not any("two streams" in what and "column" in what for what in verdicts)
    # the tuned plans' figures where the record has them (the row shape's: 0.99 meets 0.97, 0.96 not)
    assert verdicts["4 row chunks / unsplit, both tuned (the fastest of cuBLASLt's 8 proposals each), 70B TP8 row"]
    assert not verdicts["native matmul_all_reduce, 1 rank, 4 chunks / unsplit, both tuned (the fastest of "
                        "cuBLASLt's 8 proposals each), 70B TP8 row"]
    assert not any("tuned" in what and "column" in what for what in verdicts)
    assert verdicts["pipelined: host time added per call, m = 16"]
    assert not verdicts["fused: host time added per call, m = 16"]  # 7.5 us > 5
    assert all(verdicts[f"{b}: GPU time added per replayed call"] for b in ("pipelined", "fused", "auto"))
    assert verdicts["fused all_gather_matmul, 8 virtual ranks"]
    assert not verdicts["fused matmul_reduce_scatter, 8 virtual ranks"]  # E 0.90 < 0.95
    assert not verdicts["fused matmul_reduce_scatter, GEMMs beside the copies"]  # 4 % > 3 %
    model = {c["what"]: c["value"] for c in rep["checks"] if c["target"] == "model_error"}
    assert model == pytest.approx({  # 5.129 / 5.4 and 5.787 / 5.1: within 10 %, not
        "|performance model / measured - 1|, fused all_gather_matmul, 8 virtual ranks": 1 - 5.1286 / 5.4,
        "|performance model / measured - 1|, fused matmul_reduce_scatter, 8 virtual ranks": 5.7870 / 5.1 - 1}, abs=1e-4)
    assert verdicts["|performance model / measured - 1|, fused all_gather_matmul, 8 virtual ranks"]
    assert not verdicts["|performance model / measured - 1|, fused matmul_reduce_scatter, 8 virtual ranks"]
    (decode,) = [c for c in rep["checks"] if c["target"] == "decode_all_reduce_us"]
    # the worst row of at most 64 KiB (m = 4), its best algorithm (one_shot 0.0164 ms, two_shot 0.018): 6.4 us
    assert decode["value"] == pytest.approx(6.4) and decode["meets"]
    assert "(one_shot, m = 4, op minus GEMMs, eager)" in decode["what"]
    # with the all-reduce alone replayed from a graph, that figure: the worst row's best (m = 4: two_shot 9.0 us;
    # a capture that failed names its error and is passed over)
    measured = _fake_one_gpu_measurements()
    for row, replayed in zip(measured["fused"]["all_reduce_latency"], (
            {"one_shot": 5.0, "two_shot": 7.0, "scatter_gather": "error: capture failed"},
            {"one_shot": 11.0, "two_shot": 9.0}, {"one_shot": 50.0})):  # (m = 16: 256 KiB, over 64 KiB)
        row["all_reduce_graph_us"] = replayed
    (decode,) = [c for c in one_gpu.report(measured, rows, "FakeGPU")["checks"] if c["target"] == "decode_all_reduce_us"]
    assert decode["value"] == 9.0 and not decode["meets"]
    assert "(two_shot, m = 4, alone, graph-replayed)" in decode["what"]
    assert "scatter_gather (error: capture failed)" in one_gpu.format_report(one_gpu.report(measured, rows, "FakeGPU"))
    # with each rank's calls chained on its stream too, that figure is read first, row by row (m = 1 has
    # only errors there: its forked-and-joined figure stands), and the fork and join alone is shown
    for row, chained in zip(measured["fused"]["all_reduce_latency"], (
            {"one_shot": "error: timed out"}, {"one_shot": 4.5, "two_shot": 8.0}, {"one_shot": 30.0})):
        row["all_reduce_chained_us"] = chained
        row["harness_graph_us"] = 3.25
    chained_rep = one_gpu.report(measured, rows, "FakeGPU")
    (decode,) = [c for c in chained_rep["checks"] if c["target"] == "decode_all_reduce_us"]
    assert decode["value"] == 5.0 and decode["meets"]  # m = 1's one_shot 5.0 (graph), over m = 4's chained 4.5
    assert "(one_shot, m = 1, alone, graph-replayed)" in decode["what"]
    shown = one_gpu.format_report(chained_rep)
    assert ("; the all-reduce alone, chained, graph-replayed: one_shot 4.5, two_shot 8.0 us; the all-reduce alone, "
            "graph-replayed: one_shot 11.0, two_shot 9.0 us (the fork and join alone: 3.2 us)") in shown
    assert "chained, graph-replayed: one_shot (error: timed out) us" in shown
    # each rank's call as one launch, where measured, is read before the calls chained by phases, even
    # when slower (m = 4: 6.5 us over its chained 4.5, now the worst row)
    measured["fused"]["all_reduce_latency"][1]["all_reduce_one_launch_us"] = {"one_shot": 6.5,
                                                                             "two_shot": "error: timed out"}
    one_launch_rep = one_gpu.report(measured, rows, "FakeGPU")
    (decode,) = [c for c in one_launch_rep["checks"] if c["target"] == "decode_all_reduce_us"]
    assert decode["value"] == 6.5 and decode["meets"]
    assert "(one_shot, m = 4, alone, chained, one launch a rank, graph-replayed)" in decode["what"]
    assert ("decode m =    4 (64 KiB): GEMMs 10.0 us; with the all-reduce: one_shot 16.4, two_shot 18.0, scatter_gather "
            "30.0 us; the all-reduce alone, chained, one launch a rank, graph-replayed: one_shot 6.5, two_shot (error: "
            "timed out) us; the all-reduce alone, chained, graph-replayed: one_shot 4.5") in one_gpu.format_report(
                one_launch_rep)
    costs = rep["per_rank_costs"]
    assert [(c["backend"], round(c["added_us"], 3)) for c in costs] == [("reference", 2.5), ("pipelined", 1.0)]
    assert [c["vs_gemm"] for c in costs] == pytest.approx([0.010 / 0.0125, 0.010 / 0.0110])  # (GEMMs / the call)
    # the host time of matmul_all_reduce's backends read against the target; the native GEMM's own is not
    assert sorted(c["what"] for c in rep["checks"] if c["target"] == "host_overhead_us") == [
        f"{b}: host time added per call, m = 16" for b in ("auto", "fused", "pipelined")]
    text = one_gpu.format_report(rep)
    lines = text.splitlines()
    # every per-rank figure in section 1, the fused path's in section 2
    section2 = next(i for i, line in enumerate(lines) if line.startswith("# 2."))
    section3 = next(i for i, line in enumerate(lines) if line.startswith("# 3."))
    for c in rep["checks"]:
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"  {c['what']}: ")]
        assert (at < section2) == (c["target"] in ("native_gemm_vs_f_linear", "host_overhead_us", "graph_overhead_us",
                                                   "chunk4_vs_unsplit")) and at < section3, c["what"]
    assert lines[0] == ("# 1. Per-rank costs, MEASURED on FakeGPU, p = 1 (nothing to communicate: each backend runs "
                        "its GEMM alone)")
    assert any(line.startswith("# 2. The fused path on 8 virtual ranks, MEASURED on FakeGPU") for line in lines)
    assert any(line.startswith("# 3. PROJECTION for 8 GPUs (model output, not a measurement): GEMM times measured "
                               "on FakeGPU") for line in lines)
    assert "  fused: host time added per call, m = 16: 7.500 (target <= 5) MISSES" in lines
    assert ("  matmul_all_reduce_fused, the functions by own time a call (us, under cProfile): "
            "tp_kernels/ops.py:67(run) 3.50; backends/fused.py:247(_reduction) 2.25") in lines
    assert "  fused matmul_reduce_scatter, 8 virtual ranks: 0.900 (target >= 0.95) MISSES" in lines
    assert text.count("(projected)") == 1
    assert "  decode m =   16 (256 KiB): GEMMs 10.0 us; with the all-reduce: one_shot 35.6, two_shot 18.0, " \
           "scatter_gather 30.0 us" in lines


def test_one_gpu_report_says_what_cublaslt_ran_and_whether_another_algorithm_wins():
    """Where the records have cuBLASLt's plans, the 4-chunk line ends with their waves counts, each
    chunk size's and the unsplit GEMM's; where they have its proposals timed, how much faster the
    fastest ran a chunk and the unsplit GEMM than the first (the 8192^3 line too); where they have
    neither (older records), nothing."""
    from tp_kernels.bench import one_gpu

    measured = _fake_one_gpu_measurements()
    ext = measured["extension"]
    chunking = ext["chunking"]
    chunking["column"]["plans"] = {"unsplit": [{"waves": 6.787}], "4_row_chunks": [{"waves": 1.697}]}
    chunking["row"]["plans"] = {"unsplit": [{"waves": 3.5}], "4_row_chunks": []}
    text = one_gpu.format_report(one_gpu.report(measured, [], "FakeGPU"))
    assert "4 row chunks / unsplit, 70B TP8 column (cuBLASLt's waves: 1.70 a chunk, 6.79 unsplit)" in text
    assert "4 row chunks / unsplit, 70B TP8 row: 0.960" in text  # (no plan of its chunks: no waves)
    assert text.count("cuBLASLt's waves") == 1
    chunking["row"]["plans"] = {"4_row_chunks": [{"waves": 0.9}]}  # (nor of the unsplit GEMM)
    assert "4 row chunks / unsplit, 70B TP8 row: 0.960" in one_gpu.format_report(one_gpu.report(measured, [], "x"))
    chunking["row"]["plans"] = {"unsplit": [{"waves": 3.5}]}
    chunking["row"]["plans"]["4_row_chunks"] = [{"waves": 0.9}, {"waves": 0.85}]  # two chunk sizes
    chunking["row"]["candidates"] = {"4_row_chunks": {"first_over_fastest": 1.081},
                                     "unsplit": {"first_over_fastest": 1.0}}
    chunking["column"]["candidates"] = {"4_row_chunks": {"first_over_fastest": None},  # none ran but the first
                                        "unsplit": {"first_over_fastest": 1.0}}
    ext["gemm_throughput"]["native_candidates"] = {"first_over_fastest": 1.0149}
    text = one_gpu.format_report(one_gpu.report(measured, [], "FakeGPU"))
    assert ("70B TP8 row (cuBLASLt's waves: 0.90/0.85 a chunk, 3.50 unsplit; its fastest proposal 1.08x its "
            "first a chunk, 1.00x unsplit): 0.960") in text
    assert "70B TP8 column (cuBLASLt's waves: 1.70 a chunk, 6.79 unsplit): 0.980" in text
    assert "native GEMM / F.linear, 8192^3 (cuBLASLt's fastest proposal 1.01x its first): 0.995" in text


def test_one_gpu_projection_uses_the_gemm_times_measured():
    from tp_kernels.bench import one_gpu

    shapes = one_gpu.projection_shapes()
    assert len(shapes) == len(set(shapes)) > 4 and all(d == "bfloat16" for *_, d in shapes)
    fast = one_gpu.project({(m, n, k, d): t for m, n, k, d, t in _fake_one_gpu_measurements(1.0)["projection_gemm_s"]},
                           "FakeGPU")
    slow = one_gpu.project({(m, n, k, d): t for m, n, k, d, t in _fake_one_gpu_measurements(2.0)["projection_gemm_s"]},
                           "FakeGPU")
    assert fast["inputs"]["gemm_times"] == f"measured on FakeGPU ({len(shapes)} shapes)"
    assert slow["label"].startswith("PROJECTION for 8 GPUs")
    gemm = lambda proj: sum(r["gemm_ms"] for r in proj["linears"])  # noqa: E731
    assert gemm(slow) == pytest.approx(2 * gemm(fast))  # every GEMM of the projection is a measured one
    # a record without the shapes of one (n, k) (an older one): those GEMMs from the projected GPU's roofline,
    # which the made-up times are at scale 1
    n0, k0 = shapes[0][1:3]
    partial = {(m, n, k, d): t for m, n, k, d, t in _fake_one_gpu_measurements(1.0)["projection_gemm_s"]
               if (n, k) != (n0, k0)}
    assert len(partial) < len(shapes)
    assert gemm(one_gpu.project(partial, "FakeGPU")) == pytest.approx(gemm(fast))


def test_one_gpu_report_says_which_figures_are_missing():
    """A figure the record lacks (a shape whose native GEMM was not timed) is NOT MEASURED, neither
    meeting nor missing its target."""
    from tp_kernels.bench import one_gpu

    measured = _fake_one_gpu_measurements()
    del measured["extension"]["chunking"]["column"]["native_vs_f_linear"]
    rep = one_gpu.report(measured, [], "FakeGPU")
    (missing,) = [c for c in rep["checks"] if c["value"] is None]
    assert missing["what"] == "native GEMM / F.linear, 70B TP8 column" and not missing["meets"]
    lines = one_gpu.format_report(rep).splitlines()
    assert "  native GEMM / F.linear, 70B TP8 column: - (target >= 0.99) NOT MEASURED" in lines
    assert sum(line.endswith("NOT MEASURED") for line in lines) == 1
    # no decode row of at most 64 KiB: that figure NOT MEASURED, not met; a figure of two digits shows one
    # decimal, a negative one too
    measured = _fake_one_gpu_measurements()
    for row in measured["fused"]["all_reduce_latency"]:
        row["bytes"] = 128 * 1024
    measured["extension"]["host_overhead"]["added_eager_us"]["matmul_all_reduce_auto"] = -18.7
    rep = one_gpu.report(measured, [], "FakeGPU")
    (missing,) = [c for c in rep["checks"] if c["value"] is None]
    assert missing["target"] == "decode_all_reduce_us" and not missing["meets"]
    lines = one_gpu.format_report(rep).splitlines()
    assert "  decode all-reduce part, <= 64 KiB, best algorithm: - (target <= 8) NOT MEASURED" in lines
    assert "  auto: host time added per call, m = 16: -18.7 (target <= 5) meets" in lines


def test_one_gpu_report_without_the_extension_says_so():
    from tp_kernels.bench import one_gpu

    measured = {"projection_gemm_s": [], "extension": {"skipped": "no module"}, "fused": {"skipped": "no module"}}
    text = one_gpu.format_report(one_gpu.report(measured, [], "FakeGPU"))
    assert "(the native extension's figures: not measured, no module)" in text
    assert "  (not measured: no module)" in text
    assert "# 3. PROJECTION: not computed (no GEMM time was measured)" in text
