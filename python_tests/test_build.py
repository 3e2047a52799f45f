"""The build's own logic, which needs no GPU: the CUDA major chosen (``_build/tp_kernels_build.py``)
and the architectures the device code is compiled for (``_build/compile_kernels.py``). The images
compiled by a real build are checked in test_import.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_build"))
import compile_kernels  # noqa: E402
import tp_kernels_build  # noqa: E402


def test_the_chosen_major_wins_over_the_machines_nvcc(monkeypatch):
    monkeypatch.delenv("TP_KERNELS_SKIP_CUDA_BUILD", raising=False)
    monkeypatch.setattr(tp_kernels_build, "find_nvcc", lambda: Path("/usr/local/cuda/bin/nvcc"))
    monkeypatch.setattr(tp_kernels_build, "nvcc_version", lambda nvcc: (13, "13.0.88"))
    monkeypatch.setenv("TP_KERNELS_CUDA_MAJOR", "12")
    assert tp_kernels_build.cuda_major() == 12
    monkeypatch.delenv("TP_KERNELS_CUDA_MAJOR")
    assert tp_kernels_build.cuda_major() == 13  # the toolkit's major by default
    monkeypatch.setattr(tp_kernels_build, "find_nvcc", lambda: None)
    assert tp_kernels_build.cuda_major() is None  # neither: the pure-Python package
    monkeypatch.setenv("TP_KERNELS_CUDA_MAJOR", "13")
    monkeypatch.setenv("TP_KERNELS_SKIP_CUDA_BUILD", "1")
    assert tp_kernels_build.cuda_major() is None


@pytest.mark.parametrize("value", ["11", "cu12", "12.8"])
def test_an_unknown_major_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.delenv("TP_KERNELS_SKIP_CUDA_BUILD", raising=False)
    monkeypatch.setenv("TP_KERNELS_CUDA_MAJOR", value)
    with pytest.raises(RuntimeError, match=f"TP_KERNELS_CUDA_MAJOR must be one of 12, 13, got '{value}'"):
        tp_kernels_build.cuda_major()


def test_each_major_builds_against_wheels_of_its_own_and_asks_for_them_all(monkeypatch):
    wheels = tp_kernels_build.CUDA_WHEELS
    assert set(wheels[12]) == set(wheels[13]) == {"cudart", "crt", "cccl", "nvrtc", "nccl", "cublas"}
    assert set(tp_kernels_build.RUNTIME_WHEELS) | set(tp_kernels_build.HEADER_WHEELS) | {"nvrtc"} == set(wheels[12])
    for major in (12, 13):
        names = [requirement.split("==")[0] for requirement, _, _ in wheels[major].values()]
        assert len(set(names)) == len(names)
        assert all(("cu12" in n) == (major == 12) for n in names if n != "nvidia-cublas"), names
        monkeypatch.setenv("TP_KERNELS_CUDA_MAJOR", str(major))
        monkeypatch.delenv("TP_KERNELS_SKIP_CUDA_BUILD", raising=False)
        extra = tp_kernels_build._extra()
        assert set(extra) == set(tp_kernels_build.CUDA_BUILD_TOOLS) | {r for r, _, _ in wheels[major].values()}


def test_architectures_parse_and_bad_ones_name_the_variable():
    assert compile_kernels.parse_archs("90;80") == [(80, False), (90, False)]
    assert compile_kernels.parse_archs("80, sm_90a 90") == [(80, False), (90, False), (90, True)]
    assert compile_kernels.parse_archs("100;120") == [(100, False), (120, False)]
    for bad in ("", "sm90", "9.0", "compute_90"):
        with pytest.raises(ValueError, match="TP_KERNELS_CUDA_ARCHS"):
            compile_kernels.parse_archs(bad)


def test_the_generated_source_lists_every_image_with_its_bytes():
    built = [("sm_80", 80, False, False, b"\x7fELF\x01"), ("compute_80", 80, True, False, b"//ptx\0")]
    text = compile_kernels.cpp_source(built, "NVRTC 12.1", "csrc/kernels/kernels.cu")
    assert "image_0[] = {\n  127,69,76,70,1,\n};" in text and "image_1[] = {\n  47,47,112,116,120,0,\n};" in text
    assert '{"sm_80", 80, false, false, image_0, sizeof(image_0)},' in text
    assert '{"compute_80", 80, true, false, image_1, sizeof(image_1)},' in text
    assert "const int kKernelImageCount = 2;" in text and 'kKernelCompiler = "NVRTC 12.1";' in text


def _fake_nvcc(tmp_path, major, headers):
    """A toolkit at tmp_path/cuda-<major> whose include/ has `headers`; find_nvcc/nvcc_version see it."""
    root = tmp_path / f"cuda-{major}"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").touch()
    for h in headers:
        (root / "include" / h).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / h).touch()
    return root


def test_headers_come_from_their_wheel_else_a_toolkit_of_the_same_major_and_libraries_only_from_wheels(
        monkeypatch, tmp_path):
    wheel = tmp_path / "site" / "nvidia" / "cu13"
    (wheel / "include" / "nv").mkdir(parents=True)
    (wheel / "include" / "nv" / "target").touch()
    dirs = {"nvidia.cu13": [wheel]}
    monkeypatch.setattr(tp_kernels_build, "package_dirs", lambda package: dirs.get(package, []))
    toolkit = _fake_nvcc(tmp_path, 13, ["crt/host_defines.h", "nv/target"])
    monkeypatch.setattr(tp_kernels_build, "find_nvcc", lambda: toolkit / "bin" / "nvcc")
    monkeypatch.setattr(tp_kernels_build, "nvcc_version", lambda nvcc: (13, "13.0.88"))
    assert tp_kernels_build.wheel_root(13, "cccl") == wheel  # the wheel first
    assert tp_kernels_build.wheel_root(13, "crt") == toolkit  # no wheel: the toolkit's headers
    with pytest.raises(RuntimeError, match=r"needs nvidia-cuda-runtime \(its include/cuda_runtime_api.h\)"):
        tp_kernels_build.wheel_root(13, "cudart")  # never a library or the runtime headers from a toolkit
    with pytest.raises(RuntimeError, match=r"CUDA 12 build needs nvidia-cuda-nvcc-cu12 .*CUDA 12 toolkit"):
        tp_kernels_build.wheel_root(12, "crt")  # a toolkit of another major does not serve
