"""A ``device: cpu`` job is a CPU job whatever Paddle wheel is installed: gloo, and no rank asks for a GPU."""

from __future__ import annotations

import pytest

from train_deploy.training.config import TrainingConfig
from train_deploy.training.launch import cpu_job_devices, launcher_command, visible_gpus, worker_environment
from train_deploy.training.worker import select_backend


@pytest.mark.parametrize("inherited", [None, "nccl", "auto"])
def test_cpu_workers_use_gloo_whatever_the_environment_or_wheel_says(monkeypatch, inherited):
    if inherited is None:
        monkeypatch.delenv("PADDLE_DISTRI_BACKEND", raising=False)
    else:
        monkeypatch.setenv("PADDLE_DISTRI_BACKEND", inherited)
    cpu = TrainingConfig.from_params({"device": {"type": "cpu"}})
    assert worker_environment(cpu)["PADDLE_DISTRI_BACKEND"] == "gloo"  # what the launcher hands the workers
    assert select_backend("cpu") == "gloo"  # what init_parallel_env then reads, set again in the worker
    import os

    assert os.environ["PADDLE_DISTRI_BACKEND"] == "gloo"


def test_gpu_workers_keep_paddles_choice(monkeypatch):
    monkeypatch.delenv("PADDLE_DISTRI_BACKEND", raising=False)
    gpu = TrainingConfig.from_params({"device": {"type": "gpu"}})
    assert "PADDLE_DISTRI_BACKEND" not in worker_environment(gpu)
    assert select_backend("gpu") == "auto"  # NCCL with the GPU wheel


def test_on_the_cpu_wheel_a_cpu_job_passes_no_devices(tmp_path):
    config = TrainingConfig.from_params({"launch": {"nproc_per_node": 2}})
    assert cpu_job_devices(2) == []
    assert "--devices" not in launcher_command(config, tmp_path / "run.json", tmp_path)


def test_where_the_launcher_sees_gpus_every_cpu_rank_gets_the_first_one(monkeypatch):
    """With the GPU wheel the launcher gives each rank its own GPU and fails with more ranks than GPUs; a CPU job
    names the first visible GPU once per rank (never used: the worker sets the CPU device)."""
    from importlib import metadata

    from paddle.distributed.launch.context.device import Device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]  # the launcher's own reading, in a child process
    real = metadata.distribution

    def gpu_wheel(name: str):  # this machine has the CPU wheel; answer as a GPU machine's would
        return real("paddlepaddle") if name == "paddlepaddle-gpu" else real(name)

    monkeypatch.setattr(metadata, "distribution", gpu_wheel)
    assert cpu_job_devices(4) == ["--devices", "3,3,3,3"]
    assert Device.parse_device().get_selected_devices("3,3,3,3") == ["0", "0", "0", "0"]  # what each rank gets


def test_the_training_node_never_imports_paddle(tmp_path):
    """Paddle's import installs signal handlers that would replace the node's own (a stop must stop the job)."""
    import subprocess
    import sys

    code = ("import sys\nfrom pathlib import Path\nfrom train_deploy.training.config import TrainingConfig\n"
            "from train_deploy.training.launch import launcher_command, worker_environment\n"
            "config = TrainingConfig.from_params({'launch': {'nproc_per_node': 2}})\n"
            "launcher_command(config, Path('run.json'), Path('logs'))\nworker_environment(config)\n"
            "print('paddle' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=tmp_path).stdout.split()[-1] == "False"


@pytest.mark.parametrize(("cpu", "expected"), [({"vendor_id": "AuthenticAMD", "flags": "fpu avx avx2 fma"}, "5"),
                                             ({"vendor_id": "AuthenticAMD", "flags": "fpu avx"}, None),
                                             ({"vendor_id": "GenuineIntel", "flags": "fpu avx2"}, None), ({}, None)])
def test_cpu_workers_on_amd_get_mkls_avx2_kernels(monkeypatch, cpu, expected):
    """MKL takes its SSE path on CPUs not made by Intel unless MKL_DEBUG_CPU_TYPE=5 (only where AVX2 exists);
    a user's own value stays."""
    from train_deploy.training import launch

    monkeypatch.delenv("MKL_DEBUG_CPU_TYPE", raising=False)
    monkeypatch.setattr(launch, "first_cpu", lambda: cpu)
    config = TrainingConfig.from_params({"device": {"type": "cpu"}})
    assert worker_environment(config).get("MKL_DEBUG_CPU_TYPE") == expected
    assert "MKL_DEBUG_CPU_TYPE" not in worker_environment(TrainingConfig.from_params({"device": {"type": "gpu"}}))
    monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", "4")
    assert worker_environment(config)["MKL_DEBUG_CPU_TYPE"] == "4"


def test_first_cpu_reads_this_machines_cpuinfo():
    from pathlib import Path

    from train_deploy.training.launch import first_cpu

    info = Path("/proc/cpuinfo")
    block = info.read_text(encoding="ascii", errors="replace").split("\n\n")[0] if info.exists() else ""
    vendor = next((line.partition(":")[2].strip() for line in block.splitlines() if line.startswith("vendor_id")), None)
    assert first_cpu().get("vendor_id") == vendor


@pytest.mark.parametrize(("threads", "nproc", "expected"), [(1, 1, "1"), (3, 2, "3"), (0, 1, None)])
def test_cpu_workers_get_launch_cpu_threads_or_their_share_of_the_cores(monkeypatch, threads, nproc, expected):
    import os

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    config = TrainingConfig.from_params({"launch": {"cpu_threads": threads, "nproc_per_node": nproc}})
    env = worker_environment(config)
    share = expected or str(max(1, (os.cpu_count() or 1) // nproc))
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == share
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert worker_environment(config)["OMP_NUM_THREADS"] == "7"  # the user's choice
