"""The README's example runs as the README says: two processes on the CPU, under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "mlp.py")


@pytest.mark.skipif(not os.path.exists(EXAMPLE), reason="examples/ is not in this checkout")
def test_the_readme_example_runs_on_two_cpu_processes():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path, whatever this machine has
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          EXAMPLE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(2):
        assert f"rank {r}/2 (cpu, torch.float32): y (256, 4, 1024), relative error" in out.stdout, out.stdout
