"""MFU is against a peak measured the way the workers train (their MKL kernels, their threads, in CPU time), so it
stays below 1, and every report carries both figures it divides."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_deploy.environment import first_cpu, mkl_cpu_type
from train_deploy.training.metrics import Throughput

PEAK = "from train_deploy.training.metrics import calibrated_peak_flops; print(calibrated_peak_flops('cpu', 1))"


def _peak_in_a_worker_like_process(**env: str) -> float:
    """The calibration in a fresh one-thread process (MKL reads MKL_DEBUG_CPU_TYPE once, at its first product)."""
    base = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True, timeout=300,
                         env={**base, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOG_minloglevel": "2", **env})
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(mkl_cpu_type(first_cpu()) is None, reason="MKL_DEBUG_CPU_TYPE is set for AMD CPUs with AVX2 only")
@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_the_peak_calibrated_with_the_workers_mkl_kernels_is_not_below_the_generic_ones():
    generic = _peak_in_a_worker_like_process()
    workers = _peak_in_a_worker_like_process(MKL_DEBUG_CPU_TYPE=mkl_cpu_type(first_cpu()))
    assert workers >= generic, (workers, generic)


def test_a_tiny_training_run_reports_an_mfu_below_one_beside_the_rates_it_divides(tiny_run):
    logs = Path(tiny_run.checkpoints).parent / "logs"
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows and all("mfu" in row for row in rows)
    for row in rows:
        assert 0 < row["achieved_gflops"] < row["peak_gflops"] and 0 < row["mfu"] < 1, row
        assert row["mfu"] == pytest.approx(row["achieved_gflops"] / row["peak_gflops"], rel=1e-9)
        # a 0.34 M-parameter model on 32-token windows spends most of a step outside matrix products
        assert row["mfu"] < 0.5, row
    log = (logs / "node0" / "workerlog.0").read_text(encoding="utf-8", errors="replace")
    assert "MFU against a peak of" in log and "calibrated in the worker, 1 thread(s)" in log
    if mkl_cpu_type(first_cpu()):  # the launcher's MKL setting reached the calibration
        assert f"MKL_DEBUG_CPU_TYPE={mkl_cpu_type(first_cpu())}" in log


def test_an_mfu_above_one_warns_once_that_the_peak_is_too_low(caplog):
    throughput = Throughput(flops_per_token=1e9, peak_flops=1e9)  # 1 GFLOP/s: any token rate exceeds it
    with caplog.at_level(logging.WARNING, logger="train_deploy.training.worker"):
        for _ in range(2):
            throughput.add(1000)
            time.sleep(0.01)
            report = throughput.report()
    assert report["mfu"] > 1 and report["peak_gflops"] == 1.0
    (record,) = caplog.records
    message = record.getMessage()
    assert "above the peak of 1.0 GFLOP/s" in message and "training.device.peak_tflops" in message
