"""The examples run as their docstrings say: two processes on the CPU, under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
EXAMPLE = os.path.join(EXAMPLES, "mlp.py")


@pytest.mark.skipif(not os.path.exists(EXAMPLE), reason="examples/ is not in this checkout")
def test_the_readme_example_runs_on_two_cpu_processes():
    out = _torchrun_on_two_cpu_processes(EXAMPLE)
    assert out.returncode == 0, _said(out)
    for r in range(2):
        assert f"rank {r}/2 (cpu, torch.float32): y (256, 4, 1024), relative error" in out.stdout, out.stdout


def _said(out) -> str:
    """What a failed run printed: its exit status, the ends of its stdout (how far each rank got) and
    its stderr."""
    return f"exit status {out.returncode}\nstdout:\n{out.stdout[-2000:]}\nstderr:\n{out.stderr[-3000:]}"


def _torchrun_on_two_cpu_processes(path, *args):
    # the CPU path, whatever this machine has; a rank killed by a signal prints its Python stacks (faulthandler)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           path, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(not os.path.exists(EXAMPLES), reason="examples/ is not in this checkout")
def test_the_decode_example_runs_on_two_cpu_processes():
    out = _torchrun_on_two_cpu_processes(os.path.join(EXAMPLES, "decode.py"))
    assert out.returncode == 0, _said(out)
    for r in range(2):
        for b in (1, 8, 32):
            assert f"rank {r}/2 (cpu, torch.float32, eager): batch {b}, relative error" in out.stdout, out.stdout


@pytest.mark.skipif(not os.path.exists(EXAMPLES), reason="examples/ is not in this checkout")
def test_the_training_example_resumes_from_its_checkpoint():
    out = _torchrun_on_two_cpu_processes(os.path.join(EXAMPLES, "train.py"))
    assert out.returncode == 0, _said(out)
    for r in range(2):
        assert f"rank {r}/2 (cpu): losses after the checkpoint" in out.stdout, out.stdout


@pytest.mark.skipif(not os.path.exists(EXAMPLES), reason="examples/ is not in this checkout")
@pytest.mark.parametrize("experts, plans", [("split", "tp_plan"), ("whole", "tp_plan and ep_plan")])
def test_the_hugging_face_example_generates_the_dense_models_tokens(experts, plans):
    pytest.importorskip("transformers")
    out = _torchrun_on_two_cpu_processes(os.path.join(EXAMPLES, "hugging_face.py"), "--experts", experts)
    assert out.returncode == 0, _said(out)
    for r in range(2):
        assert (f"rank {r}/2 (cpu, torch.float32): MixtralForCausalLM by its {plans} generated 8 tokens per "
                "sequence, the dense model's") in out.stdout, out.stdout


@pytest.mark.skipif(not os.path.exists(EXAMPLES), reason="examples/ is not in this checkout")
def test_the_hugging_face_example_under_sequence_parallelism():
    pytest.importorskip("transformers")
    out = _torchrun_on_two_cpu_processes(os.path.join(EXAMPLES, "hugging_face.py"), "--sequence-parallel")
    assert out.returncode == 0, _said(out)
    for r in range(2):
        assert (f"rank {r}/2 (cpu, torch.float32): MixtralForCausalLM by its tp_plan under sequence parallelism: "
                "loss ") in out.stdout and ", the dense model's (" in out.stdout, out.stdout


@pytest.mark.skipif(not os.path.exists(EXAMPLES), reason="examples/ is not in this checkout")
def test_the_torch_plan_example_trains_as_the_dense_model():
    out = _torchrun_on_two_cpu_processes(os.path.join(EXAMPLES, "torch_plan.py"))
    assert out.returncode == 0, _said(out)
    for r in range(2):
        assert f"rank {r}/2 (cpu): losses" in out.stdout and "against the dense model's; ColumnParallelLinear" \
            in out.stdout, out.stdout
