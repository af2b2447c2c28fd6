"""The kernel probe: a child process that really dies of a signal becomes a one-line reason to use the portable
graph; the verdict is kept per machine and read back without a child. (The real kernel under an emulated CPU
without AVX-512: tests/export/test_emulated.py.)"""

from __future__ import annotations

import json
import logging
import time

import pytest

from train_deploy.cache import cache_dir
from train_deploy.environment import cpu_identity, this_cpu
from train_deploy.export import probe
from train_deploy.export.probe import CACHE_FILE, KERNELS, fused_kernels, probe_kernels

DIES = "import os, signal\nos.kill(os.getpid(), signal.SIGILL)"
"""A kernel whose process dies of SIGILL, as fused_rms_norm's does on a CPU without AVX-512."""


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty probe cache, no forced setting, and no verdict kept in this process."""
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path))
    for name in ("TRAIN_DEPLOY_FUSED_KERNELS", "TRAIN_DEPLOY_PROBE_LAUNCHER"):
        monkeypatch.delenv(name, raising=False)
    probe._verdict.cache_clear()
    yield tmp_path
    probe._verdict.cache_clear()


def test_a_child_killed_by_sigill_names_the_kernel_it_was_running(own_cache):
    outcomes = probe_kernels({"swiglu": KERNELS["swiglu"], "fused_rms_norm": DIES, "after": "pass"})
    assert outcomes == {"swiglu": "ok", "fused_rms_norm": "SIGILL", "after": "not run"}
    assert probe_kernels({"a": "raise SystemExit(3)"})["a"].startswith("exit 3")


def test_sigill_in_the_probe_is_one_logged_line_and_the_portable_choice_kept_on_disk(own_cache, caplog):
    kernels = {"swiglu": KERNELS["swiglu"], "fused_rms_norm": DIES}
    model = cpu_identity(this_cpu())[0]
    with caplog.at_level(logging.WARNING, logger="train_deploy.export.probe"):
        verdict = fused_kernels(kernels=kernels)
        assert fused_kernels(kernels=kernels) is verdict  # once per process
    assert not verdict.runs and verdict.source == "probe"
    assert verdict.reason == f"fused_rms_norm crashed with SIGILL in a probe on this CPU ({model})"
    assert [r.getMessage() for r in caplog.records] == [f"{verdict.reason}: using the portable graph"]
    cache = own_cache / CACHE_FILE
    (entry,) = json.loads(cache.read_text(encoding="utf-8")).values()
    assert entry["kernels"] == {"swiglu": "ok", "fused_rms_norm": "SIGILL"} and entry["cpu"] == model
    written = cache.stat().st_mtime_ns

    probe._verdict.cache_clear()  # a new process: the disk answers, no child is started
    start = time.perf_counter()
    again = fused_kernels(kernels=kernels)
    assert again.source == "cache" and not again.runs and again.reason == verdict.reason
    assert time.perf_counter() - start < 0.5 and cache.stat().st_mtime_ns == written


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_the_real_kernels_verdict_is_kept_and_a_timeout_is_not(own_cache, monkeypatch):
    verdict = fused_kernels()  # Paddle 3.3.1's CPU fused_rms_norm runs where the CPU has AVX-512
    avx512 = "avx512f" in this_cpu().get("flags", "").split()
    assert verdict.runs == avx512
    assert verdict.kernels == {"swiglu": "ok", "fused_rms_norm": "ok" if avx512 else "SIGILL"}
    probe._verdict.cache_clear()
    assert fused_kernels().source == "cache"
    monkeypatch.setattr(probe, "TIMEOUT_S", 3)
    probe._verdict.cache_clear()
    slow = fused_kernels(kernels={"fused_rms_norm": "import time\ntime.sleep(60)"})
    assert not slow.runs and slow.reason.startswith("fused_rms_norm timed out after 3 s in a probe")
    assert len(json.loads((cache_dir() / CACHE_FILE).read_text(encoding="utf-8"))) == 1  # only the real kernels'


def test_the_gpu_and_the_setting_decide_without_a_probe(own_cache, monkeypatch):
    assert fused_kernels("gpu").runs and fused_kernels("gpu").source == "device"
    monkeypatch.setenv("TRAIN_DEPLOY_FUSED_KERNELS", "off")
    off = fused_kernels()
    assert not off.runs and off.reason == "TRAIN_DEPLOY_FUSED_KERNELS=off" and off.source == "setting"
    monkeypatch.setenv("TRAIN_DEPLOY_FUSED_KERNELS", "maybe")
    with pytest.raises(ValueError, match="TRAIN_DEPLOY_FUSED_KERNELS: 'maybe' is not one of probe, on, off"):
        fused_kernels()
    assert not (own_cache / CACHE_FILE).exists()
