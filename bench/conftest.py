"""pytest-benchmark suite: ``pytest bench/`` (``--benchmark-disable`` runs each case once).

One process: a one-rank group (gloo on the CPU, NCCL on a GPU) runs each rank's share of a
``tp``-way split (``--tp-sizes``), without communication: the per-rank GEMM cost of every
backend at real models' shapes. Under ``torchrun --nproc-per-node P -m pytest bench/`` the
cases with ``tp = P`` run on the real P-rank group, with communication; the others skip.

GPU work is timed by synchronising after each call (``torch.cuda.synchronize``); CPU work is
synchronous. Every rank makes the same calls (fixed rounds, ``benchmark.pedantic``).
"""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tp_kernels.testing import launched_by_torchrun


def pytest_addoption(parser):
    cuda = torch.cuda.is_available()
    group = parser.getgroup("tp_kernels benchmarks")
    group.addoption("--tp-models", default="llama3-8b,llama3-70b,gpt3-175b", help="model shapes")
    group.addoption("--tp-m", default="1,16,64,256,4096,8192,16384" if cuda else "16,1024", help="token counts m")
    group.addoption("--tp-sizes", default="2,4,8", help="tensor-parallel splits")
    group.addoption("--tp-dtypes", default="bfloat16,float16", help="dtypes")
    group.addoption("--tp-backends", default="reference,pipelined,fused,auto" if cuda else "reference,pipelined,auto",
                    help="backends (fused: CUDA only, skipped elsewhere)")
    group.addoption("--tp-scale", type=int, default=1 if cuda else 64, help="divide the models' feature sizes by this")
    group.addoption("--tp-rounds", type=int, default=10, help="timed rounds per case")


def _world_size() -> int:
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def pytest_generate_tests(metafunc):
    from tp_kernels.bench.cases import LAYERS, OPS, model_cases

    opt = metafunc.config.getoption
    if "case" not in metafunc.fixturenames:
        return
    targets = OPS if metafunc.function.__name__ == "test_op" else tuple(LAYERS)
    world = _world_size()
    params, ids = [], []
    for tp in (int(v) for v in opt("--tp-sizes").split(",")):
        p = tp if world == 1 else world
        for case in model_cases(opt("--tp-models").split(","), [int(v) for v in opt("--tp-m").split(",")],
                                targets, p, opt("--tp-scale")):
            for dtype in opt("--tp-dtypes").split(","):
                for backend in opt("--tp-backends").split(","):
                    params.append(pytest.param(case, tp, dtype, backend, marks=[pytest.mark.skipif(
                        world not in (1, tp), reason=f"tp={tp} needs 1 or {tp} ranks, not {world}"),
                        pytest.mark.skipif(backend == "fused" and not torch.cuda.is_available(), reason="the fused backend needs CUDA")]))
                    ids.append(f"{case.target}-{case.model}-m{case.m}-tp{tp}-{dtype}-{backend}")
    metafunc.parametrize(("case", "tp", "dtype", "backend"), params, ids=ids)


@pytest.fixture(scope="session")
def world():
    """``(group, device)``: torchrun's ranks, or a one-rank group of this process."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if launched_by_torchrun():
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
        else:
            path = os.path.join(tempfile.mkdtemp(prefix="tp_kernels_bench_"), "store")
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(path, 1), rank=0,
                                    world_size=1, timeout=datetime.timedelta(seconds=300))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    yield dist.group.WORLD, device
    dist.destroy_process_group()


@pytest.fixture
def rounds(request):
    return request.config.getoption("--tp-rounds")
