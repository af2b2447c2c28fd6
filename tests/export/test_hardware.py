"""Hardware tuning of the engines: float32 (not TF32) on GPU, TensorRT's refusal on a wheel without it, MKL's
AVX2 code path on AMD CPUs."""

from __future__ import annotations

import os

import pytest

from train_deploy.export.errors import BundleError


def test_disable_tf32_turns_off_paddles_cublas_and_cudnn_tf32_switches():
    from paddle.base import core

    from train_deploy.export.hardware import disable_tf32

    before = core.get_cublas_switch(), core.get_cudnn_switch()
    core.set_cublas_switch(True)
    core.set_cudnn_switch(True)
    try:
        assert core.get_cublas_switch() and core.get_cudnn_switch()
        disable_tf32()
        assert not core.get_cublas_switch() and not core.get_cudnn_switch()
    finally:
        core.set_cublas_switch(before[0])
        core.set_cudnn_switch(before[1])


def test_tensorrt_on_a_wheel_without_it_is_refused_in_one_line(tmp_path):
    from train_deploy.export.config import ServerConfig
    from train_deploy.export.hardware import tensorrt_program

    server = ServerConfig(device="gpu", tensorrt=True)
    with pytest.raises(BundleError, match=r"^export.server.tensorrt: this Paddle wheel cannot convert for TensorRT "
                                          r"\(No module named 'paddle.tensorrt'\); use a paddlepaddle-gpu wheel "
                                          r"built with TensorRT, with the tensorrt package installed$"):
        tensorrt_program(tmp_path / "model", tmp_path / "trt" / "model", server, 128)


@pytest.mark.parametrize(("vendor", "flags", "preset", "expected"), [
    ("AuthenticAMD", "fpu sse2 avx avx2 fma", None, "5"),  # AMD with AVX2: MKL asked for its AVX2 kernels
    ("GenuineIntel", "fpu sse2 avx avx2 avx512f", None, None),  # Intel: MKL picks its own best kernels
    ("AuthenticAMD", "fpu sse2 avx", None, None),  # no AVX2: forcing it would crash
    ("AuthenticAMD", "fpu sse2 avx avx2", "0", "0"),  # the user's setting wins
], ids=["amd-avx2", "intel", "amd-no-avx2", "user-set"])
def test_mkl_is_asked_for_avx2_only_on_amd_cpus_that_have_it(tmp_path, monkeypatch, vendor, flags, preset, expected):
    from train_deploy.export.hardware import prefer_mkl_avx2

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
                       "vendor_id\t: AuthenticAMD\nflags\t\t: avx2\n")
    monkeypatch.delenv("MKL_DEBUG_CPU_TYPE", raising=False)
    if preset is not None:
        monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", preset)
    assert prefer_mkl_avx2(cpuinfo) == (preset is None and expected is not None)
    assert os.environ.get("MKL_DEBUG_CPU_TYPE") == expected
    monkeypatch.delenv("MKL_DEBUG_CPU_TYPE", raising=False)
    assert prefer_mkl_avx2(tmp_path / "missing") is False
