"""One GPU: every backend and dtype against float64 and the reference, with one rank, several
NCCL ranks sharing the GPU, virtual ranks (the fused path) and processes sharing memory by IPC.

Skipped cleanly without a CUDA device. The checks are the CPU suite's, run on ``cuda``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import test_autotune
import test_communicator
import test_embedding_ce
import test_experts
import test_layers
import test_library
import test_ops
import test_parallelize
import test_rng
import tp_kernels
from conftest import reused_world
from helpers import assert_close, rank_world
from tp_kernels import _collectives, _extension, dispatch, ops, settings
from tp_kernels.backends import fused, parse, peer_memory, pipelined_native
from tp_kernels.schedule import DEFAULT_NUM_CHUNKS
from tp_kernels.testing import ONE_GPU_RANKS_ENV, VirtualRanks, World, forked, rank_order_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

native_built = pytest.mark.skipif(not tp_kernels.extension_status()["built"], reason="the native module is not built")

OPS = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]


@pytest.fixture(scope="module")
def nccl_world():
    with World(1, backend="nccl", timeout_s=120.0) as world:
        yield world


_GPU_WORLDS = {}


@pytest.fixture(scope="module", params=[2, 4])
def gpu_world_size(request):
    """The size of the module's worlds of NCCL ranks sharing the GPU (closed when it is done)."""
    yield request.param
    world = _GPU_WORLDS.pop(request.param, None)
    if world is not None:
        world.close()


#: a test of 4 NCCL ranks sharing the GPU (2 x 2: tensor and data parallelism), not of 2 and 4
four_nccl_ranks = pytest.mark.parametrize("gpu_world_size", [4], indirect=True)


@pytest.fixture
def shared_gpu_world(gpu_world_size):
    """NCCL ranks sharing the GPU, spawned once per size and reused as conftest's gloo worlds are."""
    return reused_world(_GPU_WORLDS, gpu_world_size, lambda: World(gpu_world_size, backend="nccl", timeout_s=120.0,
                                                                   env=ONE_GPU_RANKS_ENV, cuda_device=0))


def test_ops_along_another_dim_with_several_nccl_ranks_on_one_gpu(shared_gpu_world):
    """``gather_dim`` / ``scatter_dim`` 1 and -2 (batch-first sequence parallelism) in float32,
    the pipelined backend on the native path, against float64."""
    shared_gpu_world.run(test_ops.check_gather_and_scatter_dims, device="cuda", dtype=torch.float32)


def test_batch_first_sequence_parallel_with_several_nccl_ranks_on_one_gpu(shared_gpu_world):
    """A batch-first language model under sequence parallelism along dim 1 (float64: the
    portable schedule), against the dense model."""
    shared_gpu_world.run(test_parallelize.check_batch_first_sequence_parallel, "pipelined", device="cuda")


def test_torch_parallel_styles_with_several_nccl_ranks_on_one_gpu(shared_gpu_world):
    """TorchTitan's plan of torch's styles, with sequence parallelism, on CUDA tensors over NCCL:
    against the dense model and torch's own parallelize_module, one reduce-scatter per gather."""
    shared_gpu_world.run(test_parallelize.check_torch_parallel_styles, True, device="cuda")


@pytest.mark.parametrize("read", [None, "first", "after"])
@pytest.mark.parametrize("backend", ["reference", "pipelined"])
def test_deferred_gather_with_several_nccl_ranks_on_one_gpu(shared_gpu_world, backend, read):
    """A PrepareModuleInput's gather left to the module's column layers (a DeferredGather), float32
    on CUDA over NCCL, the pipelined backend on the native path: the block gathered by their one
    all_gather_matmul, or read by the module first or after; against the dense module in float64."""
    shared_gpu_world.run(test_parallelize.check_deferred_gather, read, device="cuda", dtype=torch.float32,
                         backend=backend)


def test_torch_func_with_several_nccl_ranks_on_one_gpu(shared_gpu_world):
    """torch.func's grad, vjp, jacrev and vmap through the layers (the pipelined backend on the
    native path), a mapping, the embedding and the cross-entropy, float32 on CUDA over NCCL:
    autograd's gradients; a second derivative and forward mode raise on every rank."""
    shared_gpu_world.run(test_layers.check_torch_func, "cuda", torch.float32, "pipelined")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["reference", "pipelined"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_layers_with_several_nccl_ranks_on_one_gpu(shared_gpu_world, kind, dtype, backend):
    shared_gpu_world.run(test_layers.check_layer_grid, kind, dtype, backend, device="cuda")


@native_built
@pytest.mark.parametrize("op", OPS)
def test_pipelined_with_several_nccl_ranks_on_one_gpu(shared_gpu_world, op):
    shared_gpu_world.run(check_native_routing_and_result, op)


@native_built
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_native_ops_with_several_nccl_ranks_against_float64(shared_gpu_world, op, dtype):
    shared_gpu_world.run(test_ops.check_against_float64, op, dtype, "pipelined", device="cuda")


@native_built
@pytest.mark.parametrize("blocking", [False, True], ids=["nonblocking", "blocking"])
def test_nccl_progress_with_several_nccl_ranks(shared_gpu_world, blocking):
    shared_gpu_world.run(check_nccl_progress, blocking)


def check_nccl_progress(blocking=False):
    """The host benchmark's count of what the pipelined path's NCCL calls cost the host on the
    group's communicator: a matmul_all_reduce in its default chunks makes an NCCL call a chunk at
    least, at most all of them in progress (none in NCCL's blocking mode), and polling them takes
    no negative time. NCCL here has ncclCommRevoke, so the default mode is the blocking one."""
    assert pipelined_native.blocking_mode() is True
    from tp_kernels.bench import host

    device = torch.device("cuda", torch.cuda.current_device())
    with settings.overriding(nccl_blocking=blocking):
        got = host.nccl_progress(device, calls=host.PEER_CALLS_PER_SAMPLE)
        assert pipelined_native.communicator(_collectives.resolve_group(None), device).blocking is blocking
    assert set(got) == {"calls", "in_progress", "polls", "polling_us"}, got
    assert got["calls"] >= DEFAULT_NUM_CHUNKS["matmul_all_reduce"], got
    assert 0 <= got["in_progress"] <= got["calls"] and got["polls"] >= 0 and got["polling_us"] >= 0, got
    if blocking:
        assert got["in_progress"] == 0 and got["polls"] == 0, got


def check_in_nccl_nonblocking_mode(check, *args, **kwargs):
    """``check(*args, **kwargs)`` with the native path's communicators in NCCL's nonblocking mode; on
    several ranks the group's communicator of that mode was made, and is in it."""
    with settings.overriding(nccl_blocking=False):
        check(*args, **kwargs)
        if dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device())
            assert pipelined_native._key(_collectives.resolve_group(None), device) in pipelined_native._communicators
            assert pipelined_native.communicator(_collectives.resolve_group(None), device).blocking is False


def check_on_two_gemm_streams(check, *args, **kwargs):
    """``check(*args, **kwargs)`` with the native path's GEMMs on two streams; on several ranks the
    second stream's workspace was made (the ops ran there)."""
    with settings.overriding(gemm_streams=2):
        check(*args, **kwargs)
    if dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device())
        comm = pipelined_native.communicator(_collectives.resolve_group(None), device)
        assert _extension.has_workspace((comm.device, comm.gemm_stream))


#: the native path's modes other than its default, each by the function that runs a check in it:
#: its communicator in NCCL's nonblocking mode (set_nccl_blocking(False); the default here, where
#: NCCL has ncclCommRevoke, is the blocking one, which every other native test runs: check_nccl_progress
#: asserts it); its GEMMs alternating between the caller's stream and the communicator's second one
#: (set_gemm_streams(2))
NATIVE_MODES = {"nccl_nonblocking": check_in_nccl_nonblocking_mode,
                "two_gemm_streams": check_on_two_gemm_streams}


@native_built
@pytest.mark.parametrize("mode", NATIVE_MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", OPS)
def test_native_ops_in_each_mode_with_several_nccl_ranks(shared_gpu_world, op, dtype, mode):
    """The native path in each of its modes but the default: every op and its backward against
    float64, and against the reference at every chunk count."""
    shared_gpu_world.run(NATIVE_MODES[mode], test_ops.check_against_float64, op, dtype, "pipelined", device="cuda")
    shared_gpu_world.run(NATIVE_MODES[mode], test_ops.check_pipelined_matches_reference, op, 7, device="cuda")


@native_built
@pytest.mark.parametrize("op", OPS)
def test_layouts_of_x_and_the_weight_with_several_nccl_ranks(shared_gpu_world, op):
    """x and the weight in the layouts callers hand over, on the native path (which takes rows
    apart and either weight layout as they are, and copies the rest): every backend's output and
    gradients are the reference's of their contiguous copies."""
    shared_gpu_world.run(test_ops.check_layouts, op, device="cuda")


@native_built
@pytest.mark.parametrize("op", OPS)
def test_two_gemm_streams_give_one_streams_bits_with_several_nccl_ranks(shared_gpu_world, op):
    """GEMMs long enough for a missing wait to show: on two streams each op gives, bit for bit, what
    it gives on one (the same chunk GEMMs and the same NCCL sums; only where they run differs), in
    4 chunks, eagerly and replayed from a CUDA graph, repeated."""
    shared_gpu_world.run(check_two_gemm_streams_match_one, op)


def check_two_gemm_streams_match_one(op):
    r, p = rank_world()
    g = torch.Generator("cuda").manual_seed(r)
    rows = 2048 if op == "all_gather_matmul" else 2048 * p
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64

    def run():
        return getattr(ops, op)(x, w, backend="pipelined", num_chunks=4)

    with torch.no_grad():
        with settings.overriding(gemm_streams=1):
            want = run()
        with settings.overriding(gemm_streams=2):
            for _ in range(3):
                assert torch.equal(run(), want), f"{op} on two GEMM streams differs from one"
            graph = torch.cuda.CUDAGraph()  # (the calls above made what a capture cannot)
            with torch.cuda.graph(graph):
                static = run()
            for _ in range(3):
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static, want), f"{op} on two GEMM streams, replayed, differs from one"


def check_native_routing_and_result(op):
    """On CUDA with several ranks, "pipelined" (and "auto" where the native path is its candidate)
    run the native extension, which matches the reference for every chunk count and made the
    group's NCCL communicator; with one rank every backend runs the reference (F.linear)."""
    r, p = rank_world()
    x = torch.randn(8, 16, device="cuda")
    group = _collectives.resolve_group(None)
    assert ops.select_backend(op, "pipelined", x, p, group) == (f"native:{DEFAULT_NUM_CHUNKS[op]}" if p > 1
                                                                else "reference")  # (one rank: F.linear)
    impls, _ = dispatch.candidates(x, x, group)
    assert impls == (["native", "reference"] if p > 1 and settings.auto_native() else ["reference"])
    assert parse(ops.select_backend(op, "auto", x, p, group, x)).backend in impls  # measured when there are two
    test_ops.check_pipelined_matches_reference(op, 7, device="cuda")
    if p > 1:
        assert pipelined_native._communicators, "the native path made no communicator"


def check_native_timeout(blocking=False):
    """Rank 1 skips a collective: rank 0's watchdog aborts its communicator within the timeout,
    the GPU is released, and the next call raises an error naming the op and the timeout; with
    the communicator in NCCL's blocking mode too (where an enqueue that blocked would be revoked
    by the watchdog instead, with the same words)."""
    r, p = rank_world()
    x = torch.randn(8, 16, device="cuda")
    w = torch.randn(12, 16, device="cuda")
    with settings.overriding(nccl_blocking=blocking):
        tp_kernels.matmul_all_reduce(x, w, backend="pipelined")  # every rank: communicator made, connected
        torch.cuda.synchronize()
        dist.barrier()
        if r == 0:
            tp_kernels.set_timeout(3.0)
            start = time.monotonic()
            tp_kernels.matmul_all_reduce(x, w, backend="pipelined")  # never completes: rank 1 is not there
            torch.cuda.synchronize()  # returns once the watchdog has aborted the communicator
            elapsed = time.monotonic() - start
            with pytest.raises(RuntimeError,
                               match=r"matmul_all_reduce .* did not complete within 3 s on rank 0 of 2"):
                tp_kernels.matmul_all_reduce(x, w, backend="pipelined")
            assert 3.0 <= elapsed < 60.0, elapsed
            tp_kernels.set_timeout(120.0)
        dist.barrier()


@native_built
@pytest.mark.parametrize("blocking", [False, True], ids=["nonblocking", "blocking"])
def test_native_timeout_is_an_error(blocking):
    with World(2, backend="nccl", timeout_s=120.0, env=ONE_GPU_RANKS_ENV, cuda_device=0) as world:
        world.run(check_native_timeout, blocking, deadline_s=300)


def test_cuda_graph_with_several_nccl_ranks_on_one_gpu(shared_gpu_world):
    shared_gpu_world.run(check_cuda_graph, "pipelined")


@native_built
@pytest.mark.parametrize("mode", NATIVE_MODES)
def test_cuda_graph_in_each_mode_with_several_nccl_ranks(shared_gpu_world, mode):
    """The native path's MLP captured in a CUDA graph in each of the native path's modes but the
    default: replays equal eager."""
    shared_gpu_world.run(NATIVE_MODES[mode], check_cuda_graph, "pipelined")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["reference", "pipelined", "auto"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_layers_on_gpu(nccl_world, kind, dtype, backend):
    nccl_world.run(test_layers.check_layer_grid, kind, dtype, backend, device="cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["reference", "pipelined"])
@pytest.mark.parametrize("op", OPS)
def test_ops_on_gpu_against_float64(nccl_world, op, dtype, backend):
    nccl_world.run(test_ops.check_against_float64, op, dtype, backend, device="cuda")


@native_built
@pytest.mark.parametrize("op", OPS)
def test_pipelined_matches_reference_on_gpu(nccl_world, op):
    nccl_world.run(check_native_routing_and_result, op)


@pytest.mark.parametrize("op", test_library.OPS)
def test_opcheck_on_gpu(nccl_world, op):
    nccl_world.run(test_library.check_opcheck, op, device="cuda")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_compiled_mlp_on_gpu(nccl_world, sequence_parallel):
    nccl_world.run(test_library.check_compiled_mlp, sequence_parallel, "inductor", device="cuda", deadline_s=600)


def check_cuda_graph(backend):
    """Capture a column->row MLP forward in a CUDA graph; replays equal eager on new inputs."""
    torch.manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "backend": backend}
    fc1 = tp_kernels.ColumnParallelLinear(64, 96, sequence_parallel=True, **kw)
    fc2 = tp_kernels.RowParallelLinear(96, 64, sequence_parallel=True, **kw)
    model = torch.nn.Sequential(fc1, torch.nn.GELU(), fc2)
    static_x = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # warm up outside the capture
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = model(static_x)
    for seed in (1, 2):
        x = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            eager = model(x)
        torch.cuda.synchronize()
        assert_close(f"graph replay {seed}", static_y, eager.double(), eager)


@pytest.mark.parametrize("backend", ["reference", "pipelined"])
def test_cuda_graph_replay_equals_eager(nccl_world, backend):
    nccl_world.run(check_cuda_graph, backend)


@pytest.mark.parametrize("backend", ["reference", "pipelined"])
def test_inference_runs_the_local_gemm_with_several_nccl_ranks(shared_gpu_world, backend):
    shared_gpu_world.run(test_layers.check_inference_runs_the_local_gemm, "cuda", backend)



@native_built
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 13, 17), (7, 13, 17), (97, 769, 129), (256, 1024, 1536), (0, 8, 8), (5, 0, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_native_linear_matches_float64(dtype, m, k, n, bias):
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = torch.randn(n, k, generator=g).to("cuda", dtype)
    b = torch.randn(n, generator=g).to("cuda", dtype) if bias else None
    y = _extension.linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    plain = torch.nn.functional.linear(x, w, b)
    assert_close("native linear", y, ref, plain)
    # a row-strided view (ldx > k) is read in place, as rows: as right. Not bitwise the same: another
    # leading dimension is another cuBLASLt problem, which may take another kernel (and summation order).
    if m and k:
        wide = torch.zeros(m, k + 5, device="cuda", dtype=dtype)
        wide[:, :k] = x
        assert_close("native linear of rows k + 5 apart", _extension.linear(wide[:, :k], w, b), ref, plain)


@native_built
def test_native_linear_writes_into_rows_of_a_larger_buffer():
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=g).to("cuda", torch.bfloat16) for s in ((6, 40), (24, 40), (24,)))
    buf = torch.full((10, 24), 7.0, device="cuda", dtype=torch.bfloat16)
    y = _extension.linear(x, w, b, out=buf[2:8])
    assert y.data_ptr() == buf[2:8].data_ptr()
    assert torch.equal(buf[2:8], _extension.linear(x, w, b))
    assert torch.equal(buf[:2], torch.full((2, 24), 7.0, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(buf[8:], torch.full((2, 24), 7.0, device="cuda", dtype=torch.bfloat16))
    strided = torch.zeros(6, 48, device="cuda", dtype=torch.bfloat16)[:, :24]  # rows 48 apart
    assert torch.equal(_extension.linear(x, w, b, out=strided), buf[2:8])
    for bad in (buf[2:7], buf[2:8].float(), buf[2:8].t().contiguous().t(), buf[2:8].cpu()):
        with pytest.raises(ValueError, match=r"^out: expected"):
            _extension.linear(x, w, b, out=bad)


@native_built
def test_native_linear_in_cuda_graph():
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(80, 96, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(80, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _extension.linear(x, w, b)  # warm-up: plan and workspace exist before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _extension.linear(x, w, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, _extension.linear(x, w, b))



@native_built
def test_native_linear_lists_what_cublaslt_chose_for_each_problem():
    """``_C.gemm_plans``: a plan for each problem the GEMM ran (a batched one and a transposed
    weight's apart), with the heuristic's waves count, which grows with the tiles to run, and the
    workspace it needs within the one it was given; the benchmark's filter finds them."""
    from tp_kernels.bench.extension import ALGO_FIELDS, PLAN_FIELDS, cublaslt_plans

    k, n = 512, 1536
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for m in (128, 8192):
        _extension.linear(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w)
    _extension.linear(torch.randn(4, 32, k, device="cuda", dtype=torch.bfloat16), w)
    _extension.linear(torch.randn(16, n, device="cuda", dtype=torch.bfloat16), w.t())  # [16, k]: a dgrad
    torch.cuda.synchronize()
    plans = _extension.require().gemm_plans()
    (small,), (large,) = (cublaslt_plans(m, n, k, plans=plans) for m in (128, 8192))
    assert set(small) == set(PLAN_FIELDS) and (large["m"], large["n"], large["k"], large["batch"]) == (8192, n, k, 1)
    assert 0 < small["waves"] < large["waves"]  # (64 times fewer outputs, in fewer tiles whatever their shape)
    assert small["algo_id"] >= 0  # (set for every algorithm; the other ids -1 where cuBLASLt reports none)
    assert all(isinstance(small[f], int) and small[f] >= -1 for f in ("m", "n", "k", "batch") + ALGO_FIELDS)
    # made untuned (the default): nothing timed
    assert (small["tuning_timed"], small["tuning_first_ms"], small["tuning_chosen_ms"], small["tuning_note"]) == (
        0, -1.0, -1.0, "")
    (batched,) = cublaslt_plans(32, n, k, batch=4, plans=plans)
    assert batched["batch"] == 4 and batched["waves"] > 0
    (dgrad,) = cublaslt_plans(16, k, n, w_col_major=True, plans=plans)
    assert dgrad["waves"] > 0
    full = [q for q in plans if (q["m"], q["n"], q["k"]) == (8192, n, k)]
    assert full and all(0 <= q["workspace_needed"] <= q["workspace_bytes"] and q["dtype"] == "bfloat16"
                        and q["device"] == torch.cuda.current_device() for q in full)


@native_built
def test_tuned_gemm_plans_run_the_fastest_proposal_without_waiting_for_the_callers_stream():
    """With GEMM tuning on (settings.set_gemm_tuning), a problem's first call times cuBLASLt's
    proposals and its plan keeps the fastest (never slower than the heuristic's first as timed);
    the call returns while the caller's stream is still held by a second of spinning (the timing
    waits for its own GEMMs alone, on a stream of its own), and its product is right; a plan made
    while the stream is captured keeps the heuristic's first and says so; with tuning off again,
    plans made after forget_gemm_plans time nothing."""
    from tp_kernels import _timing
    from tp_kernels.bench.extension import ALGO_FIELDS, cublaslt_plans

    C = _extension.require()
    m, k, n = 2048, 3584, 8192
    g = torch.Generator().manual_seed(11)
    x, w = (torch.randn(s, generator=g).to("cuda", torch.bfloat16) for s in ((m, k), (n, k)))
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    C.forget_gemm_plans()
    try:
        with settings.overriding(gemm_tuning=8):
            _timing._sleep(1.0)  # the caller's stream held for a second
            started = time.monotonic()
            _extension.linear(x, w, out=y)
            assert time.monotonic() - started < 0.9  # (the spin is still running: nothing waited for it)
            torch.cuda.synchronize()
            (plan,) = cublaslt_plans(m, n, k)
            assert plan["tuning_note"] == "" and plan["tuning_timed"] >= 2, plan
            assert 0 < plan["tuning_chosen_ms"] <= plan["tuning_first_ms"], plan
            found = C.gemm_candidates(x=x, weight=w, bias=None, out=torch.empty_like(y),
                                      workspace=torch.empty(_extension.WORKSPACE_BYTES, dtype=torch.uint8,
                                                            device="cuda"),
                                      count=8, iters=1, stream=torch.cuda.current_stream().cuda_stream, timeout_s=60.0)
            assert all(found[0][f] == plan[f] for f in ALGO_FIELDS)  # (the first candidate: the plan's algorithm)
            assert_close("a tuned plan's product", y, torch.nn.functional.linear(x.double(), w.double()),
                         torch.nn.functional.linear(x, w))
            # a plan first made inside a capture: the heuristic's first, untimed
            xs = x[:1024]
            ys = torch.empty(1024, n, device="cuda", dtype=torch.bfloat16)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _extension.linear(x[:8], w)  # (the capture stream's workspace made before the capture)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                _extension.linear(xs, w, out=ys)
            graph.replay()
            torch.cuda.synchronize()
            (captured,) = cublaslt_plans(1024, n, k)
            assert captured["tuning_timed"] == 0 and "captured" in captured["tuning_note"], captured
            assert torch.equal(ys, _extension.linear(xs, w))
        C.forget_gemm_plans()
        _extension.linear(x, w, out=y)
        (untuned,) = cublaslt_plans(m, n, k)
        assert (untuned["tuning_timed"], untuned["tuning_note"]) == (0, "")
    finally:
        C.forget_gemm_plans()
        torch.cuda.synchronize()


@native_built
def test_cublaslts_proposals_are_timed_the_first_the_plans_and_each_one_right():
    """``gemm_candidates``: the heuristic's proposals for a problem, timed; the first is the
    algorithm the native GEMM's plan of that problem runs; what they leave in ``out`` is the
    product; on a stream being captured, a clear error and nothing enqueued; behind work that
    outlasts its timeout, a clear error at the timeout."""
    from tp_kernels.bench.extension import ALGO_FIELDS, CANDIDATES, gemm_candidates

    m, k, n = 2048, 512, 1536
    g = torch.Generator().manual_seed(5)
    x, w = (torch.randn(s, generator=g).to("cuda", torch.bfloat16) for s in ((m, k), (n, k)))
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    _extension.linear(x, w, out=y)  # its plan
    got = gemm_candidates(x, w, y, iters=3)
    cands = got["candidates"]
    assert 1 <= len(cands) <= CANDIDATES and cands[0]["ms"] > 0
    assert all(c["ms"] > 0 or c["ms"] == -1.0 for c in cands)
    assert got["first_over_fastest"] >= 1.0
    plans = [q for q in _extension.require().gemm_plans()
             if (q["m"], q["n"], q["k"], q["ldx"], q["ldy"], q["batch"], q["w_col_major"]) == (m, n, k, k, n, 1, False)]
    assert any(all(cands[0][f] == q[f] for f in ALGO_FIELDS) for q in plans), (cands[0], plans)
    assert_close("cuBLASLt's proposals' product", y, torch.nn.functional.linear(x.double(), w.double()),
                 torch.nn.functional.linear(x, w))
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # (made before the capture, as is the rest)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="the stream is being captured"):
        with torch.cuda.graph(graph):
            _extension.require().gemm_candidates(x=x, weight=w, bias=None, out=y, workspace=workspace, count=2,
                                                 iters=1, stream=torch.cuda.current_stream().cuda_stream,
                                                 timeout_s=30.0)
    torch.cuda._sleep(2 * 10 ** 9)  # about a second of spinning (2e9 cycles) ahead of the GEMMs on the stream
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"gemm_candidates: the GEMMs it timed \(m=2048 n=1536 k=512\), and the "
                                           r"work queued on the stream before them, did not complete within 0.2 s"):
        _extension.require().gemm_candidates(x=x, weight=w, bias=None, out=y, workspace=workspace, count=2, iters=1,
                                             stream=torch.cuda.current_stream().cuda_stream, timeout_s=0.2)
    assert time.monotonic() - started < 5.0
    torch.cuda.synchronize()


@native_built
def test_section_1_chunking_records_the_plans_of_each_split():
    """The main job's chunking figures (one sample each) with what cuBLASLt chose for the unsplit
    GEMM and each split's GEMMs (one plan at least for each, of the split's rows), and its
    proposals for the unsplit GEMM and a row chunk, timed."""
    from tp_kernels.bench import extension

    out = extension.chunking(iters=1)
    for name in extension.LLAMA70B_TP8:
        entry, (m, k, n) = out[name], extension.LLAMA70B_TP8[name]
        assert entry["4_row_chunks"]["ms"] > 0 and entry["ring_8_shards_two_streams"]["vs_unsplit"] > 0
        plans = entry["plans"]
        assert [(q["m"], q["batch"]) for q in plans["unsplit"]][:1] == [(m, 1)]
        assert {(q["m"], q["batch"]) for q in plans["4_row_chunks"]} == {(m // 4, 1)}
        assert {(q["m"], q["batch"]) for q in plans["4_rs_chunks_x8"]} == {(m // 32, 8)}
        assert {(q["m"], q["batch"]) for q in plans["ring_8_shards"]} == {(m // 8, 1)}
        assert all(q["waves"] > 0 and (q["n"], q["k"]) == (n, k) for v in plans.values() for q in v)
        for split in ("unsplit", "4_row_chunks"):  # cuBLASLt's proposals for both, timed
            assert entry["candidates"][split]["candidates"][0]["ms"] > 0
            assert entry["candidates"][split]["first_over_fastest"] >= 1.0


@native_built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_transposed", [False, True])
def test_native_batched_linear_shares_one_weight(dtype, w_transposed):
    """The reduce-scatter's chunk GEMM: rows [a, b) of each of p blocks of X, one W, into a
    destination-major [p, b - a, n] buffer; W row-major or a transposed (column-major) view."""
    p, mp, k, n, a, b = 4, 13, 24, 20, 3, 10
    g = torch.Generator().manual_seed(3)
    x = torch.randn(p * mp, k, generator=g).to("cuda", dtype)
    w = (torch.randn(k, n, generator=g).to("cuda", dtype).t() if w_transposed
         else torch.randn(n, k, generator=g).to("cuda", dtype))
    assert _extension.gemm_weight(w) is w  # used as it is, row- or column-major
    y = torch.full((p, b - a, n), float("nan"), device="cuda", dtype=dtype)
    blocks = x.reshape(p, mp, k)[:, a:b]
    _extension.linear(blocks, w, out=y)  # a batch of p products, x and y advanced by mp*k and (b-a)*n
    ref = torch.matmul(blocks.double(), w.double().t())
    plain = torch.matmul(blocks, w.t())
    assert_close("batched native linear", y, ref, plain)


# --- device building blocks of the peer-memory path, with virtual ranks (one buffer per rank) ---


@native_built
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reduce_partials_is_the_fixed_order_fp32_sum(p, dtype):
    count = 100_003
    g = torch.Generator().manual_seed(p)
    parts = [torch.randn(count, generator=g).to("cuda", dtype) for _ in range(p)]
    out = torch.empty(count, device="cuda", dtype=dtype)
    _extension.reduce_partials(parts, out)
    acc = parts[0].float()
    for t in parts[1:]:
        acc = acc + t.float()  # rank order, fp32: the same additions, so the same bits
    assert torch.equal(out, acc.to(dtype))
    plain = parts[0].clone()
    for t in parts[1:]:
        plain += t
    assert_close("reduce_partials", out, sum(t.double() for t in parts), plain, terms=p)
    # in place into rank 0's buffer, and again: the same bits every run
    again = parts[0].clone()
    _extension.reduce_partials([again] + parts[1:], again)
    assert torch.equal(again, out)


@native_built
def test_flags_and_bounded_waits():
    C = _extension._C
    assert C.stream_memory_ops_available()
    flag = torch.zeros(4, device="cuda", dtype=torch.int32)
    error = torch.zeros(1, dtype=torch.int32).pin_memory()  # host-readable from the device (UVA)
    writer, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    ptr = [flag[i:].data_ptr() for i in range(4)]
    # a writer that is late (a sleeping stream) still releases the waiter, which clears the flags
    with torch.cuda.stream(writer):
        torch.cuda._sleep(50_000_000)
    C.write_flag(ptr[1], 1, writer.cuda_stream)
    C.write_flag(ptr[2], 1, writer.cuda_stream)
    C.wait_flags([ptr[1], ptr[2]], [9, 10], 10_000_000_000, error.data_ptr(), waiter.cuda_stream)
    marker = torch.ones(1, device="cuda")
    with torch.cuda.stream(waiter):
        marker.add_(1)
    torch.cuda.synchronize()
    assert error.item() == 0 and flag.tolist() == [0, 0, 0, 0] and marker.item() == 2
    # a flag nobody sets ends the wait with its code, within about the timeout; the set one is consumed
    # several flags set in one launch (what a rank's signal to all its peers runs), after the stream's
    # earlier work, each to its own value
    with torch.cuda.stream(writer):
        torch.cuda._sleep(50_000_000)
    C.write_flags([ptr[0], ptr[2]], [0x51, 0x52], writer.cuda_stream)
    C.wait_flags([ptr[0], ptr[2]], [12, 13], 10_000_000_000, error.data_ptr(), waiter.cuda_stream, [0x51, 0x52])
    waiter.synchronize()
    assert error.item() == 0 and flag.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="values: one value per flag"):
        C.write_flags([ptr[0]], [1, 2], writer.cuda_stream)
    C.write_flag(ptr[3], 1, writer.cuda_stream)
    writer.synchronize()
    start = time.monotonic()
    C.wait_flags([ptr[3], ptr[0]], [7, 8], 2_000_000, error.data_ptr(), waiter.cuda_stream)
    waiter.synchronize()
    assert error.item() == 8 and flag[3].item() == 0 and time.monotonic() - start < 5.0
    # with the error word set, later waits return at once (the stream drains)
    C.wait_flags([ptr[0]], [11], 60_000_000_000, error.data_ptr(), waiter.cuda_stream)
    start = time.monotonic()
    waiter.synchronize()
    assert error.item() == 8 and time.monotonic() - start < 5.0
    # a flag must hold the value expected of it (0: any): another value is a mismatch, at once
    error.zero_()
    C.write_flag(ptr[1], 0x1234, writer.cuda_stream)
    C.write_flag(ptr[2], 5, writer.cuda_stream)
    C.wait_flags([ptr[1], ptr[2]], [3, 4], 60_000_000_000, error.data_ptr(), waiter.cuda_stream, [0x1234, 0])
    waiter.synchronize()
    assert error.item() == 0 and flag.tolist() == [0, 0, 0, 0]
    C.write_flag(ptr[1], 0x1235, writer.cuda_stream)
    C.wait_flags([ptr[1]], [6], 60_000_000_000, error.data_ptr(), waiter.cuda_stream, [0x1234])
    start = time.monotonic()
    waiter.synchronize()
    assert error.item() == 6 | C.MISMATCH_BIT and flag[1].item() == 0 and time.monotonic() - start < 5.0


# --- the fused path: virtual ranks on one GPU, and processes sharing it through CUDA IPC ---

FUSED_CASES = ["all_gather_matmul", "matmul_reduce_scatter", "one_shot", "two_shot", "scatter_gather"]


def _virtual_inputs(case, p, rows, k, n, dtype, seed=0):
    """Per-rank x and weight (drawn on the CPU, then moved): x is the rank's shard [rows, k] for
    all_gather_matmul, its [rows * p, k] input for the reductions."""
    g = torch.Generator().manual_seed(seed)
    m = rows if case == "all_gather_matmul" else rows * p
    xs = [torch.randn(m, k, generator=g).to("cuda", dtype) for _ in range(p)]
    ws = [torch.randn(n, k, generator=g).to("cuda", dtype) for _ in range(p)]
    return xs, ws


def _run_virtual(vr, case, xs, ws, biases=None, num_chunks=1):
    if case == "all_gather_matmul":
        return vr.all_gather_matmul(xs, ws, biases, num_chunks=num_chunks)
    if case == "matmul_reduce_scatter":
        return vr.matmul_reduce_scatter(xs, ws)
    return vr.matmul_all_reduce(xs, ws, algorithm=case)


_EXIT_WITH_CONTEXTS = """
import torch
from tp_kernels.backends import peer_memory
from tp_kernels.testing import VirtualRanks

vr = VirtualRanks(2, timeout_s=10.0)  # never closed: its contexts are alive at exit
xs = [torch.randn(4, 8, device="cuda") for _ in range(2)]
ws = [torch.randn(6, 8, device="cuda") for _ in range(2)]
out = vr.matmul_all_reduce(xs, ws)
torch.cuda.synchronize()
assert set(vr.contexts) <= set(peer_memory._contexts) and len(vr.contexts) == 2
print("sum", float(out[0].sum()), flush=True)
"""


@native_built
def test_exit_with_live_contexts_is_clean(tmp_path):
    """An interpreter that exits with PeerContexts alive (kept, not destroyed: the process's end
    frees them) exits with status 0 and says nothing on stderr."""
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_WITH_CONTEXTS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("sum "), (done.returncode, done.stdout, done.stderr)
    assert "Error" not in done.stderr and "Exception" not in done.stderr, done.stderr


@native_built
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_virtual_ranks_against_float64(case, dtype, p):
    rows, k, n = 5, 37, 19  # odd shapes: nothing a multiple of 8
    xs, ws = _virtual_inputs(case, p, rows, k, n, dtype)
    with VirtualRanks(p, timeout_s=10.0) as vr:
        if case == "all_gather_matmul":
            biases = [torch.randn(n).to("cuda", dtype) for _ in range(p)]
            for chunks in (1, 2, 5):
                results = _run_virtual(vr, case, xs, ws, biases, num_chunks=chunks)
                full = torch.cat(xs)
                for q, (out, gathered) in enumerate(results):
                    assert torch.equal(gathered, full)
                    ref = full.double() @ ws[q].double().t() + biases[q].double()
                    plain = torch.nn.functional.linear(full, ws[q], biases[q])
                    assert_close(f"fused AG rank {q} chunks {chunks}", out, ref, plain)
        else:
            results = _run_virtual(vr, case, xs, ws)
            ref = sum(x.double() @ w.double().t() for x, w in zip(xs, ws))
            plain = sum(torch.nn.functional.linear(x, w) for x, w in zip(xs, ws))
            for q, out in enumerate(results):
                if case == "matmul_reduce_scatter":
                    assert_close(f"fused RS rank {q}", out, ref[q * rows:(q + 1) * rows],
                                 plain[q * rows:(q + 1) * rows], terms=p)
                else:
                    assert_close(f"fused AR {case} rank {q}", out, ref, plain, terms=p)
        vr.check()


@native_built
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("case", FUSED_CASES[1:])
def test_fused_reductions_are_the_fixed_order_sum_of_the_partials(case, p):
    """The result is bitwise the rank-order fp32 sum of the same partial GEMMs, every run."""
    from tp_kernels.schedule import chunk_bounds

    dtype, rows, k, n = torch.bfloat16, 64, 512, 256  # aligned: the GEMMs match the reference's
    xs, ws = _virtual_inputs(case, p, rows, k, n, dtype, seed=p)
    m = rows * p
    if case == "matmul_reduce_scatter":
        blocks = [(d * rows, (d + 1) * rows) for d in range(p)]
    elif case == "scatter_gather":
        blocks = chunk_bounds(m, p)
    else:
        blocks = [(0, m)]
    partial = [torch.cat([_extension.linear(x[a:b], w) for a, b in blocks]) for x, w in zip(xs, ws)]
    acc = partial[0].float()
    for t in partial[1:]:
        acc = acc + t.float()
    expected = acc.to(dtype)
    with VirtualRanks(p, timeout_s=10.0) as vr:
        first = _run_virtual(vr, case, xs, ws)
        for _ in range(3):
            again = _run_virtual(vr, case, xs, ws)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
        for q, out in enumerate(first):
            want = expected[q * rows:(q + 1) * rows] if case == "matmul_reduce_scatter" else expected
            assert torch.equal(out, want), f"rank {q}"


@native_built
@pytest.mark.parametrize("p", [2, 4])
def test_fused_cuda_graph_replay_equals_eager(p):
    dtype, rows, k, n = torch.bfloat16, 16, 256, 128
    with VirtualRanks(p, timeout_s=10.0) as vr:
        inputs = {case: _virtual_inputs(case, p, rows, k, n, dtype, seed=i) for i, case in enumerate(FUSED_CASES)}
        for case, (xs, ws) in inputs.items():
            _run_virtual(vr, case, xs, ws)  # workspace and cuBLAS workspaces made outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = {case: _run_virtual(vr, case, xs, ws) for case, (xs, ws) in inputs.items()}
        g = torch.Generator().manual_seed(7)
        for _ in range(20):
            for xs, _ in inputs.values():
                for x in xs:
                    x.copy_(torch.randn(x.shape, generator=g).to("cuda", dtype))
            graph.replay()
            for case, (xs, ws) in inputs.items():
                eager = _run_virtual(vr, case, xs, ws)
                for a, b in zip(captured[case], eager):
                    a, b = (a, b) if case != "all_gather_matmul" else (a[0], b[0])
                    assert torch.equal(a, b), case
        vr.check()


@native_built
def test_fused_stress_of_consecutive_calls_with_varying_shapes():
    """1,000 calls, shapes and ops changing (the workspace grows as needed), a sample checked."""
    p, dtype = 4, torch.bfloat16
    shapes = [(1, 64, 32), (8, 128, 64), (3, 40, 24), (32, 256, 128), (2, 8, 8)]
    with VirtualRanks(p, timeout_s=10.0) as vr:
        for i in range(1000):
            case = FUSED_CASES[i % len(FUSED_CASES)]
            rows, k, n = shapes[(i // len(FUSED_CASES)) % len(shapes)]
            xs, ws = _virtual_inputs(case, p, rows, k, n, dtype, seed=i)
            results = _run_virtual(vr, case, xs, ws)
            if i % 50 == 0:
                if case == "all_gather_matmul":
                    assert torch.equal(results[1][1], torch.cat(xs))
                else:
                    ref = sum(x.double() @ w.double().t() for x, w in zip(xs, ws))
                    out = results[0] if case != "matmul_reduce_scatter" else torch.cat(results)
                    plain = sum(torch.nn.functional.linear(x, w) for x, w in zip(xs, ws))
                    assert_close(f"stress {i} {case}", out, ref, plain, terms=p)
        torch.cuda.synchronize()
        vr.check()


@native_built
@pytest.mark.parametrize("case", ["all_gather_matmul", "matmul_reduce_scatter", "one_shot", "two_shot"])
def test_fused_dead_peer_is_a_timeout_error(case):
    """Rank 1 never takes part: rank 0's bounded wait gives up after the timeout, the stream
    drains, and the error (op, rank, peer) is raised by check() and by the next call."""
    xs, ws = _virtual_inputs(case, 2, 8, 64, 32, torch.bfloat16)
    with VirtualRanks(2, timeout_s=1.0) as vr:
        _run_virtual(vr, case, xs, ws)  # both ranks: workspace made, flags in their initial state
        torch.cuda.synchronize()
        ctx, stream = vr.contexts[0], vr.streams[0]
        start = time.monotonic()
        with torch.cuda.stream(stream):
            if case == "all_gather_matmul":
                call = fused.rank_all_gather_matmul(ctx, xs[0], ws[0], None, 1, stream)
            elif case == "matmul_reduce_scatter":
                call = fused.rank_matmul_reduce_scatter(ctx, xs[0], ws[0], stream)
            else:
                call = fused.rank_matmul_all_reduce(ctx, xs[0], ws[0], case, stream)
            call.enqueue(None)  # every phase: rank 1 takes no part
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
        assert 1.0 <= elapsed < 30.0, elapsed
        op = "matmul_all_reduce" if case in ("one_shot", "two_shot") else case
        message = rf"fused {op}: rank 0 waited more than 1 s for rank 1 .*destroy and re-create the group"
        with pytest.raises(RuntimeError, match=message):
            vr.check()
        with pytest.raises(RuntimeError, match=message):
            _run_virtual(vr, case, xs, ws)


@native_built
@pytest.mark.parametrize("divergence", ["chunks", "rows", "algorithm", "op"])
def test_fused_ranks_that_make_different_calls_all_fail_at_once(divergence):
    """Two virtual ranks whose fused calls differ, in workspaces that hold either call (nothing
    grows): each rank's first ready flag carries the other's call word, so every rank records the
    mismatch at once (not a timeout), and check() and the next call raise it."""
    dtype, k, n = torch.bfloat16, 64, 32
    g = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", dtype)

    w = rand(n, k)
    shard, rows16, rows8 = rand(8, k), rand(16, k), rand(8, k)

    def ag(chunks):
        return lambda ctx, s: fused.rank_all_gather_matmul(ctx, shard, w, None, chunks, s)

    def rs(x):
        return lambda ctx, s: fused.rank_matmul_reduce_scatter(ctx, x, w, s)

    def ar(algorithm):
        return lambda ctx, s: fused.rank_matmul_all_reduce(ctx, rows16, w, algorithm, s)

    calls = {"chunks": [ag(1), ag(2)], "rows": [rs(rows16), rs(rows8)], "algorithm": [ar("one_shot"), ar("two_shot")],
             "op": [ag(1), ar("one_shot")]}[divergence]
    with VirtualRanks(2, timeout_s=60.0) as vr:
        # both ranks: every region grown for the largest of these calls, and a clean run of each
        vr.matmul_all_reduce([rows16, rows16], [w, w], algorithm="two_shot")
        vr.matmul_reduce_scatter([rows16, rows16], [w, w])
        vr.all_gather_matmul([shard, shard], [w, w], num_chunks=2)
        torch.cuda.synchronize()
        vr.check()
        vr._launch(lambda q, s: calls[q](vr.contexts[q], s), [(shard, rows16, rows8, w)] * 2)
        torch.cuda.synchronize()
        for q, ctx in enumerate(vr.contexts):
            message = (rf"rank {q} waited for rank {1 - q} \(for .*\) and got the signal of another call "
                       r".*TP_KERNELS_FINGERPRINTS=1.*destroy and re-create")
            with pytest.raises(RuntimeError, match=message):
                ctx.check()
        with pytest.raises(RuntimeError, match="got the signal of another call"):
            vr.matmul_reduce_scatter([rows16, rows16], [w, w])


def check_fused_matches_reference(op):
    """backend="fused" across processes sharing the GPU (workspace over CUDA IPC): forward and
    backward match the reference for several chunk counts; growing the workspace and freeing it
    with the group work."""
    r, p = rank_world()
    group = _collectives.resolve_group(None)
    x = torch.randn(8, 16, device="cuda")
    assert parse(ops.select_backend(op, "fused", x, p, group)).backend == "fused"
    for m_per_rank, k, n in ((3, 11, 7), (40, 96, 72)):  # the second grows the workspace
        args, _ = test_ops._case(op, m_per_rank, k, n, torch.float32, device="cuda")
        out_shape = getattr(ops, op)(*args, backend="reference").shape
        dy = torch.randn(out_shape, generator=torch.Generator().manual_seed(1)).to("cuda")
        y_ref, grads_ref = test_ops._run(op, args, dy, backend="reference")
        for c in (1, 3):
            y, grads = test_ops._run(op, args, dy, backend="fused", num_chunks=c)
            assert_close(f"fused {op} num_chunks={c} y", y, y_ref.double())
            for name, g, g_ref in zip(("dx", "dw", "db"), grads, grads_ref):
                assert_close(f"fused {op} num_chunks={c} {name}", g, g_ref.double())
    assert peer_memory._workspaces, "the fused path made no workspace"
    torch.cuda.synchronize()
    peer_memory.destroy_workspaces(group)
    assert not peer_memory._workspaces


@native_built
@pytest.mark.parametrize("op", OPS)
def test_fused_with_several_processes_on_one_gpu(shared_gpu_world, op):
    shared_gpu_world.run(check_fused_matches_reference, op)


@native_built
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_fused_ops_with_several_processes_against_float64(shared_gpu_world, op, dtype):
    shared_gpu_world.run(test_ops.check_against_float64, op, dtype, "fused", device="cuda")


@native_built
def test_auto_measures_fused_native_and_reference_on_one_gpu(shared_gpu_world):
    """backend="auto" with every backend named: each op measured per size class over the fused
    path (each all-reduce algorithm), the native one (in each chunk count, for the ops it splits by
    rows) and the reference, alike on every rank, and right whichever wins."""
    per_rank = shared_gpu_world.run(test_autotune.check_measured_choice, ("fused", "pipelined", "reference"), "cuda")
    assert all(r == per_rank[0] for r in per_rank)
    for op, m_class, _, _, variants, _, _ in per_rank[0]:
        reduces = op in ("matmul_all_reduce", "linear_with_grad_all_reduce")
        chunks = DEFAULT_NUM_CHUNKS["matmul_all_reduce" if reduces else op]
        fused_variants = ({"fused:one_shot", "fused:two_shot", "fused:scatter_gather"} if reduces
                          else {f"fused:{chunks}"})
        native = ([f"native:{chunks}"] if op == "all_gather_matmul"
                  else [f"native:{c}" for c in dispatch.NATIVE_CHUNK_CHOICES])  # (every case has rows for each)
        assert set(variants[:len(fused_variants)]) == fused_variants, (op, m_class, variants)
        assert list(variants[len(fused_variants):]) == native + ["reference"], (op, m_class, variants)


# --- tp_kernels.Communicator: its paths on processes sharing the GPU, and the fused all-reduce alone
# on virtual ranks ----------------------------------------------------------------------------------

COMM_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.complex64)  # complex: moved, not summed


@native_built
@pytest.mark.parametrize("backend", ["reference", "pipelined", "fused"])
def test_communicator_against_torch_distributed_on_one_gpu(shared_gpu_world, backend):
    shared_gpu_world.run(test_communicator.check_against_torch_distributed, backend, "cuda", COMM_DTYPES)


@native_built
def test_communicator_in_nccl_nonblocking_mode_against_torch_distributed_on_one_gpu(shared_gpu_world):
    """tp_kernels.Communicator's native collectives (all-reduce, all-gather, reduce-scatter, gather,
    broadcast, send and recv) with the communicator in NCCL's nonblocking mode (not the default
    here), against torch.distributed."""
    shared_gpu_world.run(NATIVE_MODES["nccl_nonblocking"], test_communicator.check_against_torch_distributed,
                         "pipelined", "cuda", COMM_DTYPES)


def test_variable_sizes_with_several_nccl_ranks(shared_gpu_world):
    """``all_gatherv`` and ``reduce_scatterv`` over NCCL ranks sharing the GPU, exact."""
    shared_gpu_world.run(test_communicator.check_variable_sizes, "cuda")


def test_broadcast_tensor_dict_with_several_nccl_ranks(shared_gpu_world):
    """GPU tensors over NCCL and host tensors beside them (over the default group's host twin)."""
    shared_gpu_world.run(test_communicator.check_broadcast_tensor_dict, "cuda")


#: element counts: one, odd, 16-byte rows, rows not divisible by the ranks, large
ALL_REDUCE_COUNTS = (1, 7, 4096, 65537, 2**20 + 8)


@native_built
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_all_reduce_alone_is_the_rank_order_sum_for_every_algorithm(p, dtype):
    """The all-reduce alone on virtual ranks: every algorithm gives the rank-order fp32 sum, bit for
    bit, for any count, on every rank; and it is within rounding of the float64 sum."""
    with VirtualRanks(p, timeout_s=10.0) as vr:
        for count in ALL_REDUCE_COUNTS:
            g = torch.Generator().manual_seed(count + p)
            xs = [torch.randn(count, generator=g).to("cuda", dtype) for _ in range(p)]
            want = rank_order_sum(xs, dtype)
            for algorithm in fused.algorithms():
                for q, out in enumerate(vr.all_reduce(xs, algorithm)):
                    assert torch.equal(out, want), f"{algorithm} count {count} rank {q}"
            ref = sum(x.double() for x in xs)
            assert_close(f"fused all_reduce count {count}", want, ref, sum(xs), terms=p)
        vr.check()


@native_built
@pytest.mark.parametrize("p", [2, 8])
@pytest.mark.parametrize("algorithm, other", [("one_shot", "two_shot"), ("two_shot", "one_shot")])
def test_fused_all_reduce_in_one_launch_a_rank(p, algorithm, other):
    """The one-shot and two-shot all-reduces as a rank that is a process of its own runs them
    (every phase at once: one kernel), here for p virtual ranks on their streams, in place and not,
    interleaved with calls of the other algorithm by phases, which share the export region's
    flags: the rank-order sum on every rank, call after call."""
    dtype = torch.bfloat16
    with VirtualRanks(p, timeout_s=10.0) as vr:
        for count in (7, 4096, 65537, 2**20 + 8):
            g = torch.Generator().manual_seed(count)
            xs = [torch.randn(count, generator=g).to("cuda", dtype) for _ in range(p)]
            want = rank_order_sum(xs, dtype)
            vr.all_reduce(xs, algorithm)  # the workspace for this count and algorithm
            vr.all_reduce(xs, other)  # the flags' other user
            for in_place in (False, True):
                outs = [x.clone() if in_place else torch.full_like(x, float("nan")) for x in xs]
                ins = outs if in_place else xs
                with forked(vr.streams):
                    for q, s in enumerate(vr.streams):
                        fused.rank_all_reduce(vr.contexts[q], ins[q], outs[q], algorithm, s).enqueue(None)
                for q, out in enumerate(outs):
                    assert torch.equal(out, want), f"count {count} rank {q} in place {in_place}"
            for q, out in enumerate(vr.all_reduce(xs, other)):
                assert torch.equal(out, want), f"{other} after {algorithm}, count {count} rank {q}"
        vr.check()


@native_built
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_fused_all_reduce_chained_calls_each_read_their_own_partials(algorithm):
    """Calls back to back on each of 8 virtual ranks' streams, one launch a call, nothing between
    them but the flags (as the decode benchmark chains them), each call's partials its own: every
    call's result is its own rank-order sum on every rank, so no call read a partial or a slice of
    another (where every call's inputs were alike, one read too early would go unseen)."""
    p, dtype, calls = 8, torch.bfloat16, 12
    with VirtualRanks(p, timeout_s=10.0) as vr:
        for count in (4096, 65536 + 8):
            g = torch.Generator().manual_seed(count)
            xs = [[torch.randn(count, generator=g).to("cuda", dtype) for _ in range(p)] for _ in range(calls)]
            vr.all_reduce(xs[0], algorithm)  # the workspace for this count
            outs = [[torch.empty_like(x) for x in call] for call in xs]
            with forked(vr.streams):
                for c in range(calls):
                    for q, s in enumerate(vr.streams):
                        fused.rank_all_reduce(vr.contexts[q], xs[c][q], outs[c][q], algorithm, s).enqueue(None)
            for c in range(calls):
                want = rank_order_sum(xs[c], dtype)
                for q in range(p):
                    assert torch.equal(outs[c][q], want), f"count {count} call {c} rank {q}"
        vr.check()


@native_built
@pytest.mark.parametrize("p", [2, 4])
def test_fused_all_reduce_alone_graph_replay_equals_eager(p):
    dtype = torch.bfloat16
    with VirtualRanks(p, timeout_s=10.0) as vr:
        xs = {(a, c): [torch.randn(c, device="cuda", dtype=dtype) for _ in range(p)]
              for a in fused.algorithms() for c in (5, 4096)}
        for (a, _), x in xs.items():
            vr.all_reduce(x, a)  # the workspace made outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = {key: vr.all_reduce(x, key[0]) for key, x in xs.items()}
        for _ in range(10):
            for x in xs.values():
                for t in x:
                    t.normal_()
            graph.replay()
            for key, x in xs.items():
                for a, b in zip(captured[key], vr.all_reduce(x, key[0])):
                    assert torch.equal(a, b), key
        vr.check()


def check_communicator_paths(dtype):
    """Across processes: the fused all-reduce by each algorithm is the rank-order sum bit for bit;
    NCCL's within rounding of float64; every collective of the native path moves the bits."""
    from tp_kernels import backends

    r, p = rank_world()
    group = _collectives.resolve_group(None)
    dtype = getattr(torch, dtype)
    for count in (1, 7, 4096, 65537):
        gen = torch.Generator(device="cuda")
        parts = [torch.randn(count, generator=gen.manual_seed(1000 * q + count), device="cuda").to(dtype)
                 for q in range(p)]
        x = parts[r]
        want = rank_order_sum(parts, dtype)
        for a in fused.algorithms():
            out = backends.run_collective("all_reduce", f"fused:{a}", x, torch.empty_like(x), -1, group)
            assert torch.equal(out, want), f"fused:{a} count {count}"
        nccl = backends.run_collective("all_reduce", "native:1", x, torch.empty_like(x), -1, group)
        assert_close(f"NCCL all_reduce count {count}", nccl, sum(t.double() for t in parts), sum(parts), terms=p,
                     summed=sum(t.double().abs() for t in parts))
        gathered = backends.run_collective("all_gather", "native:1", x, x.new_empty(p * count), -1, group)
        assert torch.equal(gathered, torch.cat(parts))


@native_built
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_communicator_paths_across_processes(shared_gpu_world, dtype):
    shared_gpu_world.run(check_communicator_paths, dtype)


def check_communicator_graph_capture(backend):
    """Decode-style capture: all_reduce and all_gather in a CUDA graph after capture(); replays
    equal eager calls on the same path, bit for bit."""
    r, p = rank_world()
    comm = tp_kernels.Communicator(backend=backend)
    static = {c: torch.randn(c, device="cuda", dtype=torch.bfloat16) for c in (8, 4096)}
    for x in static.values():  # eager first: the decision of each size, made outside the capture
        comm.all_reduce(x), comm.all_gather(x)
    torch.cuda.synchronize()
    with comm.capture():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = {c: (comm.all_reduce(x), comm.all_gather(x)) for c, x in static.items()}
    gen = torch.Generator(device="cuda").manual_seed(r)
    for _ in range(10):
        for x in static.values():
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        for c, x in static.items():
            assert torch.equal(captured[c][0], comm.all_reduce(x)), (backend, c)
            assert torch.equal(captured[c][1], comm.all_gather(x)), (backend, c)
    torch.cuda.synchronize()


@native_built
@pytest.mark.parametrize("backend", ["pipelined", "fused"])
def test_communicator_graph_capture_and_replay(shared_gpu_world, backend):
    shared_gpu_world.run(check_communicator_graph_capture, backend)


def check_communicator_mixed_sizes(calls):
    """``calls`` all-reduces of mixed sizes and dtypes with backend="auto" choosing among every
    path: each against the float64 sum of every rank's input (made on every rank from seeds)."""
    r, p = rank_world()
    settings.set_auto_candidates(("fused", "pipelined", "reference"))
    try:
        comm = tp_kernels.Communicator()
        sizes = (1, 3, 100, 1000, 4099, 65536, 300000)
        for i in range(calls):
            count, dtype = sizes[i % len(sizes)], (torch.bfloat16, torch.float32)[(i // len(sizes)) % 2]
            gen = torch.Generator(device="cuda")
            parts = [torch.randn(count, generator=gen.manual_seed(7919 * i + q), device="cuda").to(dtype)
                     for q in range(p)]
            y = comm.all_reduce(parts[r])
            if i % 10 == 0 or i >= calls - len(sizes) * 2:
                assert_close(f"call {i}: {count} {dtype}", y, sum(t.double() for t in parts), sum(parts), terms=p,
                             summed=sum(t.double().abs() for t in parts))
        torch.cuda.synchronize()
        return sorted({(d.m_class, str(d.dtype), d.choice) for d in tp_kernels.autotune.decisions()
                       if d.op == "all_reduce"})
    finally:
        settings.set_auto_candidates(None)
        tp_kernels.autotune.forget()


@native_built
def test_communicator_1000_mixed_size_calls(shared_gpu_world):
    per_rank = shared_gpu_world.run(check_communicator_mixed_sizes, 1000, deadline_s=400)
    assert all(d == per_rank[0] for d in per_rank), per_rank  # every rank chose alike


def check_fingerprints_over_the_host_twin(backend):
    """NCCL ranks with fingerprints on: the tensor-parallel group's fingerprints travel over its
    gloo twin on the host (never a CUDA tensor); ranks that disagree all raise before anything
    moves on ``backend`` (for the fused path: before its workspace or flags are touched), and the
    group works afterwards."""
    from tp_kernels import parallel_state

    r, p = rank_world()
    used = []
    gather = _collectives.all_gather_bytes
    _collectives.all_gather_bytes = lambda payload, group, device: used.append(device) or gather(payload, group, device)
    settings.set_fingerprints(True)
    try:
        assert not parallel_state.carries_host_tensors()
        tp_kernels.initialize_model_parallel(p)
        tp = parallel_state.get_tensor_model_parallel_group()
        twin = parallel_state.host_group(tp)
        assert twin is not None and twin is not tp and parallel_state.carries_host_tensors(twin)
        w, x = torch.ones(5, 6, device="cuda"), torch.ones(4, 6, device="cuda")
        expected = torch.full((4, 5), 6.0 * p, device="cuda")
        assert torch.equal(ops.matmul_all_reduce(x, w, backend=backend), expected)
        with pytest.raises(RuntimeError, match="disagree"):
            ops.matmul_all_reduce(torch.ones(4 if r == 0 else 3, 6, device="cuda"), w, backend=backend)
        assert torch.equal(ops.matmul_all_reduce(x, w, backend=backend), expected)  # the group works on
        assert used and all(d.type == "cpu" for d in used), used
    finally:
        settings.set_fingerprints(None)
        _collectives.all_gather_bytes = gather
        torch.cuda.synchronize()
        if parallel_state.model_parallel_is_initialized():
            tp_kernels.destroy_model_parallel()
    return True


def check_fused_ranks_that_disagree_without_fingerprints():
    """Fingerprints off, the last rank's x has other rows. Growing the workspace for different
    calls: every rank raises at once, and the group goes on. In a workspace that holds either
    call: the flags' call words, raised by every rank's next fused call. Never a hang or an
    abort; a fresh workspace works afterwards."""
    r, p = rank_world()
    group = _collectives.resolve_group(None)
    k, n = 16, 8
    w = torch.ones(n, k, device="cuda")
    mine = torch.ones(8 if r != p - 1 else 4, k, device="cuda")
    x = torch.ones(8, k, device="cuda")
    expected = torch.full((8, n), float(k * p), device="cuda")
    torch.cuda.synchronize()
    peer_memory.destroy_workspaces(group)  # a workspace an earlier test of this world grew
    settings.set_fingerprints(False)
    try:
        with pytest.raises(RuntimeError, match="disagree on this call, so none of it ran and the group keeps"):
            ops.matmul_all_reduce(mine, w, backend="fused")  # the group's first fused call: its workspace grows
        assert torch.equal(ops.matmul_all_reduce(x, w, backend="fused"), expected)
        ops.matmul_all_reduce(mine, w, backend="fused")  # nothing grows: the flags see it
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=r"fused matmul_all_reduce: rank \d waited for rank \d .*got the "
                                               "signal of another call"):
            ops.matmul_all_reduce(x, w, backend="fused")
    finally:
        settings.set_fingerprints(None)
        torch.cuda.synchronize()
        peer_memory.destroy_workspaces(group)
    assert torch.equal(ops.matmul_all_reduce(x, w, backend="fused"), expected)
    torch.cuda.synchronize()
    peer_memory.destroy_workspaces(group)
    return True


@native_built
def test_fused_ranks_that_disagree_without_fingerprints_all_raise(shared_gpu_world):
    results = shared_gpu_world.run(check_fused_ranks_that_disagree_without_fingerprints, deadline_s=300)
    assert results == [True] * shared_gpu_world.world_size


@native_built
@pytest.mark.parametrize("backend", ["reference", "pipelined", "fused"])
def test_fingerprints_of_nccl_ranks_travel_over_the_host_twin(shared_gpu_world, backend):
    results = shared_gpu_world.run(check_fingerprints_over_the_host_twin, backend, deadline_s=300)
    assert results == [True] * shared_gpu_world.world_size


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_clip_grad_norm_with_several_nccl_ranks(shared_gpu_world, sequence_parallel):
    per_rank = shared_gpu_world.run(test_parallelize.check_clip_grad_norm, sequence_parallel, device="cuda")
    assert all(t == per_rank[0] for t in per_rank), per_rank


def test_full_state_dict_with_several_nccl_ranks(shared_gpu_world):
    shared_gpu_world.run(test_parallelize.check_full_state_dict_across_sizes, device="cuda")


def test_full_state_dict_options_with_several_nccl_ranks(shared_gpu_world):
    """The gather to rank 0 on NCCL, and each full tensor moved off the GPU."""
    shared_gpu_world.run(test_parallelize.check_full_state_dict_options, device="cuda")


def test_fused_projections_with_several_nccl_ranks(shared_gpu_world, tmp_path):
    shared_gpu_world.run(test_parallelize.check_fused_projections, str(tmp_path), device="cuda")


@pytest.mark.parametrize("vocab_of_p", ["one_over", "odd"])
def test_padded_vocabulary_with_several_nccl_ranks(shared_gpu_world, tmp_path, vocab_of_p):
    shared_gpu_world.run(test_parallelize.check_padded_vocabulary_model, str(tmp_path), vocab_of_p, device="cuda")


@pytest.mark.parametrize("vocab_of_p", ["one_over", "odd"])
def test_padded_vocabulary_layers_with_several_nccl_ranks(shared_gpu_world, vocab_of_p):
    shared_gpu_world.run(test_embedding_ce.check_padded_vocabulary, vocab_of_p, device="cuda")


def test_unchecked_id_out_of_range_fails_every_nccl_rank():
    """``TP_KERNELS_CHECK_IDS=0`` (no host sync): an id out of range fails the lookup of every one
    of two NCCL ranks sharing the GPU, a device-side assert as ``nn.Embedding``'s, where every rank
    masked it to zeros. A world of its own: the assert ends each rank's CUDA context (NCCL's
    asynchronous error handling off, so that the ranks report it rather than abort)."""
    env = {**ONE_GPU_RANKS_ENV, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    with World(2, backend="nccl", timeout_s=60.0, env=env, cuda_device=0) as world:
        messages = world.run(test_embedding_ce.check_unchecked_id_fails_on_the_gpu, deadline_s=90.0)
    assert all("device-side assert triggered" in m for m in messages), messages


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_entropy_argmax_topk_with_several_nccl_ranks(shared_gpu_world, dtype):
    for check in (test_embedding_ce.check_entropy, test_embedding_ce.check_argmax, test_embedding_ce.check_topk,
                  test_embedding_ce.check_sample):
        shared_gpu_world.run(check, dtype, "padded", device="cuda")


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_vocab_parallel_embedding_with_several_nccl_ranks(shared_gpu_world, padding_idx):
    """VocabParallelEmbedding on CUDA ids over NCCL against nn.Embedding: the lookup, the weight's
    gradient, the padding row, and ids out of range refused on every rank (the check's read of
    their range back from the GPU; test_embedding_ce)."""
    shared_gpu_world.run(test_embedding_ce.check_embedding, padding_idx, device="cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vocab_parallel_cross_entropy_with_several_nccl_ranks(shared_gpu_world, dtype):
    """vocab_parallel_cross_entropy of CUDA logits over NCCL, without and with label smoothing, of
    ordinary and of large logits, every reduction: against float64 within twice plain PyTorch's
    error on the GPU (test_embedding_ce)."""
    for label_smoothing in (0.0, 0.1):
        for scale in (1.0, 1000.0):
            shared_gpu_world.run(test_embedding_ce.check_cross_entropy, dtype, label_smoothing, scale, device="cuda")


def test_layers_under_autocast_with_several_nccl_ranks(shared_gpu_world):
    shared_gpu_world.run(test_layers.check_autocast, "cuda")


def test_random_streams_on_the_gpu_with_several_nccl_ranks(shared_gpu_world):
    """A fork swaps the CUDA generator: each rank's stream on the GPU is its seed's, the default
    stream the same on every rank."""
    shared_gpu_world.run(test_rng.check_streams, "cuda")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_and_checkpoint_with_several_nccl_ranks(shared_gpu_world, sequence_parallel):
    shared_gpu_world.run(test_rng.check_parallel_dropout, sequence_parallel, "cuda")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_replicated_kv_heads_with_several_nccl_ranks(shared_gpu_world, tmp_path, kv_heads):
    shared_gpu_world.run(test_parallelize.check_replicated_kv_heads, str(tmp_path), kv_heads, device="cuda")


def test_distributed_checkpoint_with_several_nccl_ranks(shared_gpu_world, tmp_path):
    lost = shared_gpu_world.run(test_parallelize.check_distributed_checkpoint_across_sizes, str(tmp_path),
                                device="cuda")
    assert any(lost), lost


def test_distributed_checkpoint_with_optimizer_with_several_nccl_ranks(shared_gpu_world, tmp_path):
    shared_gpu_world.run(test_parallelize.check_distributed_checkpoint_with_optimizer, str(tmp_path), device="cuda")


@pytest.mark.parametrize("what", sorted(test_communicator.P2P_DISAGREEMENTS))
def test_send_and_recv_that_disagree_on_nccl_ranks(shared_gpu_world, what):
    """The send/recv agreement of NCCL ranks, whose views travel over the default group's host twin."""
    messages = shared_gpu_world.run(test_communicator.check_p2p_disagreement, what)
    if what != "bad at one end":
        assert messages[0] == messages[1] and all(m is None for m in messages[2:]), messages


@pytest.mark.parametrize("split", list(test_experts.SPLITS))
def test_experts_with_several_nccl_ranks(shared_gpu_world, split):
    """A mixture's experts split over NCCL ranks sharing the GPU, by hidden units or whole experts:
    output and gradients in float64."""
    shared_gpu_world.run(test_experts.check_experts_against_dense, split, "cuda")


def test_experts_rank_without_routes_with_several_nccl_ranks(shared_gpu_world):
    """Whole experts a rank, every token routed to rank 0's, over NCCL ranks sharing the GPU: the
    other ranks' backward still sums the inputs' gradients (where NCCL would wait for it until the
    timeout), and their weights get zero gradients."""
    shared_gpu_world.run(test_experts.check_rank_without_routes, "cuda")


@pytest.mark.parametrize("split", ["packed_colwise", "experts"])
def test_experts_sequence_parallel_with_several_nccl_ranks(shared_gpu_world, split):
    """The experts under sequence parallelism over NCCL ranks sharing the GPU (the tokens gathered,
    the output reduce-scattered; the integer ids gathered too): each rank's block in float64."""
    shared_gpu_world.run(test_experts.check_experts_sequence_parallel, split, "cuda")


@pytest.mark.parametrize("kind, parallelism", [("mixtral", "tp"), ("deepseek_v3", "ep"), ("mixtral", "ep_router")])
def test_moe_sequence_parallel_plan_with_several_nccl_ranks(shared_gpu_world, kind, parallelism):
    """A mixture of experts under sequence_parallel_plan on NCCL ranks: its experts' partial sums
    reduce-scattered once, DeepSeek's shared experts' row layer's term with them, against the dense
    model in float64 (test_parallelize.check_moe_sequence_parallel_plan)."""
    pytest.importorskip("transformers")
    shared_gpu_world.run(test_parallelize.check_moe_sequence_parallel_plan, kind, parallelism, "cuda")


def test_hugging_face_models_by_their_own_plans_with_several_nccl_ranks(shared_gpu_world):
    """transformers' Llama (its embedding tied to the head; on 4 ranks its key/value heads
    replicated), Qwen 3 (per-head norms), OLMo 2 (whole-width norms) and Gemma 1-3 (a scaled
    embedding tied to the head) by their own ``tp_plan`` on NCCL ranks sharing the GPU, against
    the dense model on the GPU in float64: logits, loss, an SGD step or every gradient, and
    Llama's greedy generation (test_parallelize)."""
    pytest.importorskip("transformers")
    shared_gpu_world.run(test_parallelize.check_hugging_face_llama, "cuda")
    for kind in ("qwen3", "olmo2"):
        shared_gpu_world.run(test_parallelize.check_hugging_face_plans, kind, "cuda")
    for kind in ("gemma", "gemma2", "gemma3"):
        shared_gpu_world.run(test_parallelize.check_hugging_face_gemma, kind, "cuda")


@four_nccl_ranks
def test_torchtitan_composition_with_four_nccl_ranks(shared_gpu_world):
    """TorchTitan's composition on a (dp 2, tp 2) CUDA mesh of 4 NCCL ranks sharing the GPU: tensor
    parallelism by its plan with sequence parallelism, then FSDP2 over dp; two clipped SGD steps
    against the dense model in float64 (test_parallelize)."""
    shared_gpu_world.run(test_parallelize.check_torchtitan_composition, device="cuda")


@four_nccl_ranks
def test_data_parallel_over_tensor_parallel_with_four_nccl_ranks(shared_gpu_world):
    """DistributedDataParallel over tensor parallelism 2 on 4 NCCL ranks sharing the GPU: two SGD
    steps, each data-parallel rank on half the batch, against the dense model in float64
    (test_parallelize)."""
    shared_gpu_world.run(test_parallelize.check_data_parallel_over_tensor_parallel, device="cuda")


@four_nccl_ranks
@pytest.mark.parametrize("sequence_parallel,mesh_kind", [(True, "fsdp"), (False, "hsdp")])
def test_fully_sharded_data_parallel_over_tensor_parallel_with_four_nccl_ranks(shared_gpu_world, tmp_path,
                                                                               sequence_parallel, mesh_kind):
    """FSDP2 (or HSDP) over tensor parallelism 2 on 4 NCCL ranks sharing the GPU, in float64:
    two clipped SGD steps against the dense model, the full and the sharded (dcp) state dicts, a
    model made on the meta device and initialized on the GPU against one made without FSDP2
    (test_parallelize)."""
    shared_gpu_world.run(test_parallelize.check_fully_sharded_data_parallel_over_tensor_parallel,
                         str(tmp_path / "checkpoint"), sequence_parallel, mesh_kind, device="cuda")


@four_nccl_ranks
def test_fused_layers_under_fully_sharded_data_parallel_with_four_nccl_ranks(shared_gpu_world, tmp_path):
    """Fused [q, k, v] and [gate, up] layers and a padded vocabulary, which FSDP2's rows cut
    across, on 4 NCCL ranks sharing the GPU: the dense model's steps, the checkpoint, a resume on a
    model made on the meta device, and the load into tensor parallelism 4 (test_parallelize)."""
    shared_gpu_world.run(test_parallelize.check_fused_layers_under_fully_sharded_data_parallel,
                         str(tmp_path / "checkpoint"), "fsdp", device="cuda")


@pytest.mark.parametrize("parallelism", ["tp", "ep"])
def test_hugging_face_moe_grouped_gemm_with_several_nccl_ranks(shared_gpu_world, parallelism):
    """Mixtral by its plan (or whole experts a rank, by its ep_plan over it), its experts through
    transformers' grouped GEMM on the GPU, in bfloat16 (skipped where transformers is not
    installed)."""
    pytest.importorskip("transformers")
    shared_gpu_world.run(test_experts.check_hugging_face_moe_grouped_gemm, "cuda", "bfloat16", parallelism)


def test_the_benchmarks_hold_keeps_the_hosts_time_out_of_a_gpu_sample():
    """A region whose host takes 4 ms to enqueue one short kernel: timed as it is, a sample is the
    host's 4 ms (the GPU reached the start event at once and waited); with the stream held until
    the region is enqueued (tp_kernels._timing.Hold), the kernel's own time, and no sample's host
    outlasted the hold. The spinning kernel lasts about what it is asked, and an event behind a
    second of it is waited for within the timeout (0.2 s: an error naming what was timed), and so
    is the whole device behind a second of it on another stream (tp_kernels._timing.synchronize)."""
    from tp_kernels import _timing

    x = torch.randn(1024, 1024, device="cuda")

    def body(i):
        time.sleep(0.004)
        x.mul_(1.0)

    hold = _timing.Hold()
    held = _timing.Timer(10, 2, True, None, hold=hold)(body)
    unheld = _timing.Timer(10, 2, True, None)(body)
    # (other tests' processes share the GPU: their kernels can delay a start event by a millisecond
    # or more, and so shorten an unheld sample)
    assert unheld > 2e-3, unheld
    assert held < 1e-3, held
    assert hold.summary() == {"samples": 10, "exposed": 0}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _timing._sleep(1e-3)  # (the first, calibrating, out of the way)
    start.record()
    _timing._sleep(2e-3)
    end.record()
    _timing.wait_event(end, "the spin")
    assert 1e-3 < start.elapsed_time(end) * 1e-3 < 4e-3
    _timing._sleep(1.0)  # a second of spinning: a sample's end behind it is waited for within the timeout
    end.record()
    started = time.monotonic()
    with settings.overriding(timeout=0.2), pytest.raises(RuntimeError, match="a sample: the GPU work it timed"):
        _timing.wait_event(end, "a sample")
    assert time.monotonic() - started < 5.0
    # the device-wide wait too: past its limit behind a second of spinning (on another stream), and
    # within it once the spin has ended
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _timing._sleep(1.0)
    started = time.monotonic()
    with settings.overriding(timeout=0.2), pytest.raises(
            RuntimeError, match=r"the spin on a side stream: the work queued on cuda:\d+, on every stream"):
        _timing.synchronize("the spin on a side stream")
    assert time.monotonic() - started < 5.0
    _timing.synchronize("the spin on a side stream")
    assert side.query() and end.query()


def test_a_traced_call_is_held_and_the_hold_is_left_out_of_its_timeline(monkeypatch):
    """The timeline's trace of one call: the stream held until the call is enqueued (its spin
    kernel in the trace, but not among the call's GPU activities), so the span is the one
    kernel's. The call is warm, as the timeline's are (a kernel's first launch loads its module),
    and the hold a longer one than the timeline's 50 ms, as other tests' processes share the GPU
    and the host here."""
    from tp_kernels.bench import timeline

    x = torch.randn(1024, 1024, device="cuda")
    x.mul_(1.0)
    torch.cuda.synchronize()
    monkeypatch.setattr(timeline, "TRACE_HOLD_S", 0.5)
    events, held = timeline.traced(lambda: x.mul_(1.0))
    assert held is True
    assert any(timeline.HOLD_KERNEL in str(e.get("name", "")) for e in events)
    out = timeline.summarize(events)
    assert out["count"] == {"gemms": 0, "copies": 0, "waits": 0, "other": 1}, out
    assert out["span_us"] < 1000.0, out


@native_built
def test_the_timeline_names_the_kernels_of_the_gemms_section_1_compares():
    """``gemm_kernels``: for each case (8192³, the 70B TP8 shapes and their 4-row chunks), at least
    one kernel each for F.linear and for the native GEMM, every one with a name and a duration, the
    native GEMM's among them a GEMM's by its name (the timeline's GEMM_KERNELS), as its summary
    counts it."""
    from tp_kernels.bench import timeline

    out = timeline.gemm_kernels()
    assert set(out) == {"8192^3", "column", "column_chunk_of_4", "row", "row_chunk_of_4"}
    assert out["column_chunk_of_4"]["shape"] == [2048, 8192, 3584]
    for case, entry in out.items():
        for label in ("f_linear", "native"):
            assert entry[label] and all(name and us > 0 for name, us in entry[label]), (case, label, entry)
        assert any(any(g in name.lower() for g in timeline.GEMM_KERNELS) for name, _ in entry["native"]), entry
