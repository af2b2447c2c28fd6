"""benchmarks/gpu_train_check.py in its CPU smoke mode: every check of the first GPU hour runs its code here
(tiny model, float32), so the GPU hour is spent on the GPU, not on a broken script."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.project import REPO

pytestmark = pytest.mark.slow


def test_every_check_runs_and_passes_on_cpu(tmp_path, tiny_token_files):
    env = {**os.environ, "GPU_CHECK_WORK": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "benchmarks/gpu_train_check.py", "--smoke", "--peak-tflops", "1",
                           "--tokens", tiny_token_files.path], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    tables = done.stdout
    assert "| auto_parallel |" in tables and "| plain |" in tables
    resumed = [line for line in tables.splitlines() if line.startswith(("| plain | ", "| auto_parallel | "))
               and "worst" in line]
    assert len(resumed) == 2 and all("| ok (worst 0.00%) |" in line for line in resumed), tables
    assert "'use_flash_attention': False" in tables  # the CPU run's config; on GPU it says True
    assert "| device: cpu, 2 processes, on the GPU wheel | ok |" in tables
    assert "FAILED" not in tables
