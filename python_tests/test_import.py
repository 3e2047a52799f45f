"""`import tp_kernels` works without a GPU and without the native module; the native module,
when built, loads without a GPU or driver and reports what it found."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import tp_kernels

# Blocks tp_kernels._C as a broken build would: it is found, but fails to load.
_BLOCK_NATIVE = """
import importlib.abc, importlib.machinery, sys
class _Broken(importlib.abc.Loader):
    def create_module(self, spec): return None
    def exec_module(self, module): raise ImportError("simulated: libnccl.so.2 missing")
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "tp_kernels._C":
            return importlib.machinery.ModuleSpec(name, _Broken())
sys.meta_path.insert(0, _Finder())
"""


def _status_in_subprocess(prelude: str = "") -> dict:
    code = prelude + "\nimport json, tp_kernels; print(json.dumps(tp_kernels.extension_status()))"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_without_gpu_or_loadable_extension():
    status = _status_in_subprocess(_BLOCK_NATIVE)
    assert status["built"] is False and status["native"] is None
    assert "simulated: libnccl.so.2 missing" in status["reason"] and "failed to load" in status["reason"]
    assert "with a CPU torch, install them yourself" in status["reason"]
    assert status["cuda_available"] is False and status["cuda_reason"]
    assert set(status["backends"]) == {"auto", "reference", "pipelined"}
    # the pure-PyTorch path still works in such a process
    code = _BLOCK_NATIVE + (
        "\nimport torch, tp_kernels\nl = tp_kernels.ColumnParallelLinear(3, 4)\nprint(l(torch.randn(2, 3)).shape)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "torch.Size([2, 4])" in out.stdout, out.stderr


@pytest.mark.skipif(not tp_kernels.extension_status()["built"], reason="the native module is not built here")
def test_a_torch_of_another_cuda_major_keeps_the_pure_pytorch_backends_and_says_which_build():
    major = tp_kernels.extension_status()["build"]["cuda_major"]
    other = 12 if major == 13 else 13
    fake_torch = f"import torch\ntorch.version.cuda = '{other}.8'\n"
    status = _status_in_subprocess(fake_torch)
    assert status["built"] is False and status["native"] is None and status["torch_cuda"] == f"{other}.8"
    assert f"tp_kernels._C is built for CUDA {major}" in status["reason"], status["reason"]
    assert (f"Install the CUDA {other} build of tp_kernels: TP_KERNELS_CUDA_MAJOR={other} pip install"
            in status["reason"]), status["reason"]
    assert status["build"]["cuda_major"] == major and "fused" not in status["backends"]
    code = fake_torch + "import tp_kernels\nprint(tp_kernels.ColumnParallelLinear(3, 4)(torch.randn(2, 3)).shape)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "torch.Size([2, 4])" in out.stdout, out.stderr


def test_status_of_this_installation():
    status = tp_kernels.extension_status()
    assert status["cuda_available"] == torch.cuda.is_available()
    assert (status["cuda_reason"] is None) == status["cuda_available"]
    if torch.version.cuda is None:  # (a CPU torch)
        assert status["cuda_reason"] == "this torch build has no CUDA support"
    # the fused path needs the native module and a GPU
    assert ("fused" in status["backends"]) == (status["built"] and status["cuda_available"])
    if os.environ.get("TP_KERNELS_EXPECT_NATIVE") == "1":  # set by CI, which builds it
        assert status["built"], status["reason"]
    if not status["built"]:
        assert status["reason"] and status["native"] is None
        return
    build = status["build"]
    assert build["cuda_major"] in (12, 13) and build["cuda"].startswith(f"{build['cuda_major']}.")
    assert build["cuda_archs"] and build["nccl"] and build["cublas"].startswith(f"{build['cuda_major']}.")
    native = status["native"]
    assert native["cuda_runtime_version"] // 1000 == build["cuda_major"]
    assert native["nccl_version"] >= 22809  # NCCL 2.28.9 or newer
    assert native["cublaslt_version"] >= 130000
    if native["device_count"] == 0:
        assert native["device_error"]
    else:
        assert native["device_error"] == ""


native_built = pytest.mark.skipif(not tp_kernels.extension_status()["built"], reason="the native module is not built here")


@native_built
def test_native_errors_are_runtime_and_value_errors():
    from tp_kernels._extension import _C

    assert issubclass(_C.Error, RuntimeError) and issubclass(_C.ArgumentError, ValueError)

    def ref(name, data, shape, strides, dtype="bfloat16"):
        return _C.TensorRef(name, data, shape, strides, dtype, 0)

    # argument checks run before any CUDA call, so they work without a GPU
    args = dict(x=ref("x", 64, [4, 4], [4, 1]), weight=ref("weight", 64, [4, 4], [4, 1]), bias=None,
                out=ref("out", 64, [4, 4], [4, 1]), workspace=ref("workspace", 0, [0], [1], "uint8"), stream=0)
    with pytest.raises(ValueError, match="x: negative size"):
        _C.linear(**{**args, "x": ref("x", 64, [-1, 4], [4, 1])})
    with pytest.raises(ValueError, match="x: expected rows that do not overlap"):
        _C.linear(**{**args, "x": ref("x", 64, [4, 4], [3, 1])})
    with pytest.raises(ValueError, match="out: expected a non-null data pointer"):
        _C.linear(**{**args, "out": ref("out", 0, [4, 4], [4, 1])})


def test_native_linear_rejects_host_tensors():
    from tp_kernels import _extension

    if not tp_kernels.extension_status()["built"]:
        with pytest.raises(RuntimeError, match="unavailable"):
            _extension.linear(torch.randn(2, 3), torch.randn(4, 3))
    else:
        with pytest.raises(ValueError, match="CUDA"):
            _extension.linear(torch.randn(2, 3), torch.randn(4, 3))


def test_public_api_names():
    for name in tp_kernels.__all__:
        assert hasattr(tp_kernels, name), name
    from tp_kernels import mappings

    for name in mappings.__all__:
        assert callable(getattr(mappings, name))


@native_built
def test_the_kernel_images_hold_every_kernel_for_every_architecture_of_the_build():
    from tp_kernels._extension import _C

    build = tp_kernels.extension_status()["build"]
    archs = sorted(int(a.rstrip("a")) for a in build["cuda_archs"].split(";"))
    images = {im["target"]: im for im in _C.kernel_images()}
    assert build["kernel_compiler"] == _C.KERNEL_COMPILER and _C.KERNEL_COMPILER.startswith("NVRTC ")
    assert sorted(t for t in images if t.startswith("sm_")) == sorted(f"sm_{a}" for a in build["cuda_archs"].split(";"))
    assert [t for t in images if t.startswith("compute_")] == [f"compute_{archs[0]}"]  # PTX of the oldest
    for target, im in images.items():
        if im["ptx"]:
            text = im["data"].rstrip(b"\0").decode()
            assert f".target sm_{archs[0]}" in text
            for name in _C.KERNELS:
                assert f".entry {name}(" in text, (target, name)
            # the parameter structs as the host lays them out (kernel_params.h: 64-bit pointers)
            p = _C.MAX_RANKS
            assert f".b8 tpk_wait_flags_param_0[{8 * p + 4 * p + 4 * p}]" in text  # FlagList
            assert f".b8 tpk_set_flags_param_0[{8 * p + 4 * p}]" in text  # FlagWrites
            assert f".b8 tpk_reduce_partials_float32_param_0[{8 * p}]" in text  # PartialPtrs
            # AllReduceParams: 4 FlagLists, 4 FlagWrites, 2 PartialPtrs, src, out, count, slice, 4 ints,
            # the timeout, the error word and the counters
            size = 4 * 16 * p + 4 * 12 * p + 2 * 8 * p + 4 * 8 + 4 * 4 + 3 * 8
            assert f".b8 tpk_all_reduce_float32_param_0[{size}]" in text
        else:
            data = im["data"]
            assert data[:4] == b"\x7fELF" and int.from_bytes(data[18:20], "little") == 190, target  # EM_CUDA
            for name in _C.KERNELS:
                assert name.encode() + b"\0" in data, (target, name)


@native_built
def test_a_device_loads_the_cubin_of_its_family_else_the_ptx_else_none():
    from tp_kernels._extension import _C

    images = _C.kernel_images()
    cubins = sorted(im["arch"] for im in images if not im["ptx"] and not im["arch_specific"])
    ptx = min(im["arch"] for im in images if im["ptx"])
    for arch in cubins:
        major, minor = divmod(arch, 10)
        assert _C.kernel_image_for(major, minor) == f"sm_{arch}"
        assert _C.kernel_image_for(major, minor + 1) == f"sm_{arch}"  # a newer GPU of the same family
    newest = max(cubins) // 10 + 1
    assert _C.kernel_image_for(newest, 0) == f"compute_{ptx}"  # a family with no cubin: the driver compiles the PTX
    assert _C.kernel_image_for(ptx // 10 - 1, 5) is None  # older than every image


def test_the_oldest_torch_is_pyprojects_and_an_older_one_is_refused_at_import():
    """The floor is pyproject.toml's ``torch>=`` alone, read from the installed package's
    metadata; a torch older by its major and minor release is refused when tp_kernels is
    imported, naming both versions; a pre-release of the floor (NVIDIA's containers' builds) and
    anything newer are taken."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        declared = [d for d in tomllib.load(f)["project"]["dependencies"] if d.startswith("torch")]
    floor = tp_kernels._torch_version.required_torch()
    assert declared == [f"torch>={floor}"], (declared, floor)
    major, minor = (int(v) for v in floor.split(".")[:2])
    assert tp_kernels._torch_version.oldest_release() == f"{major}.{minor}.0"  # what CI installs to test it
    older = f"{major}.{minor - 1}.1" if minor else f"{major - 1}.99.0"
    with pytest.raises(ImportError, match=rf"^tp_kernels needs torch >= {major}\.{minor}, and this torch is "
                                          rf"{re.escape(older)}: install a newer torch first"):
        tp_kernels._torch_version.require_torch(older)
    for taken in (f"{major}.{minor}.0a0+5228986c39.nv25.05", f"{major}.{minor}.0", f"{major}.{minor + 5}.0+cpu",
                  f"{major + 1}.0.0", torch.__version__):
        tp_kernels._torch_version.require_torch(taken)
    code = f"import torch; torch.__version__ = {older!r}; import tp_kernels"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 1 and f"ImportError: tp_kernels needs torch >= {major}.{minor}, and this torch is " \
        f"{older}" in out.stderr, out.stderr[-2000:]
