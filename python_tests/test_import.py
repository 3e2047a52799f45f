"""`import tp_kernels` works without a GPU and without the native module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import tp_kernels


def test_import_without_gpu_or_extension():
    code = (
        "import tp_kernels, json; s = tp_kernels.extension_status(); "
        "print(json.dumps(s))"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status["cuda_available"] is False and status["cuda_reason"]
    assert status["built"] is False and "not built" in status["reason"]
    assert set(status["backends"]) == {"auto", "reference", "pipelined"}


def test_status_matches_this_process():
    status = tp_kernels.extension_status()
    assert status["cuda_available"] == torch.cuda.is_available()
    assert status["built"] == (tp_kernels._native._C is not None)


def test_public_api_names():
    for name in tp_kernels.__all__:
        assert hasattr(tp_kernels, name), name
    from tp_kernels import mappings

    for name in mappings.__all__:
        assert callable(getattr(mappings, name))
