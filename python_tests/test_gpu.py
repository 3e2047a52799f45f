"""One GPU, one rank, real NCCL: every backend and dtype against float64 and the reference.

Skipped cleanly without a CUDA device. The checks are the CPU suite's, run on ``cuda``.
"""

from __future__ import annotations

import pytest
import torch

import test_layers
import test_ops
from tp_kernels.launch import World

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OPS = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]


@pytest.fixture(scope="module")
def nccl_world():
    with World(1, backend="nccl", timeout_s=120.0) as world:
        yield world


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


@pytest.mark.parametrize("op", OPS)
def test_pipelined_matches_reference_on_gpu(nccl_world, op):
    nccl_world.run(test_ops.check_pipelined_matches_reference, op, 7, device="cuda")
