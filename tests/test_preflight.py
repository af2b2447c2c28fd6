"""Catalog locations the run will write are checked before the first node (``preflight.check_writable``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _kedro_run(project: Path, tmp_path: Path, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    return subprocess.run([*(prefix or []), sys.executable, "-m", "kedro", "run", "--pipelines", "train_deploy"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)


def _refused_before_any_node(done: subprocess.CompletedProcess, project: Path, entry: str, why: str) -> None:
    assert done.returncode == 1, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if "UnwritableLocation" in line)
    assert f"catalog entry {entry!r}: " in line and why in line and "conf/local/catalog.yml" in line, line
    assert "Running node" not in done.stdout + done.stderr  # not even the corpus stage ran
    assert not (project / "data" / "04_feature").exists()


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_an_output_folder_that_cannot_be_made_stops_the_run_before_the_first_node(project, tmp_path):
    (project / "data").mkdir()
    (project / "data" / "07_model_output").write_text("a file where the bundles' folder should be")
    done = _kedro_run(project, tmp_path)
    _refused_before_any_node(done, project, "export_bundle", "07_model_output is not a folder")


def _can_mount_read_only() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_read_only_output_folder_stops_the_run_before_the_first_node(project, tmp_path):
    bundles = project / "data" / "07_model_output"
    bundles.mkdir(parents=True)
    if os.geteuid() != 0:
        bundles.chmod(0o555)
        prefix, why = [], "Permission denied"
    elif _can_mount_read_only():  # root writes through file modes: a read-only bind mount in a mount namespace
        prefix = ["unshare", "--mount", "sh", "-c", f'mount --bind -o ro "{bundles}" "{bundles}" && exec "$@"', "sh"]
        why = "Read-only file system"
    else:
        pytest.skip("root without a mount namespace: nothing here is unwritable to it")
    try:
        done = _kedro_run(project, tmp_path, prefix)
    finally:
        bundles.chmod(0o755)
    _refused_before_any_node(done, project, "export_bundle", f"07_model_output is not writable ({why}")
    assert not list(bundles.iterdir())


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_run_past_the_disk_budget_stops_before_the_first_node_naming_what_uses_the_space(project, tmp_path):
    checkpoints = project / "data" / "06_models" / "checkpoints" / "an-old-run"
    checkpoints.mkdir(parents=True)
    (checkpoints / "model.safetensors").write_bytes(os.urandom(256 * 1024))
    (project / "conf" / "local" / "parameters_retention.yml").write_text(
        "retention:\n  disk:\n    budget: 64KiB\n    run_estimate: 1KiB\n", encoding="utf-8")
    done = _kedro_run(project, tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if "OverBudget" in line)
    assert "retention.disk.budget: the project uses " in line and "of its budget 64.0 KiB" in line, line
    assert "data/06_models/checkpoints 26" in line.split("biggest: ")[1] and "train-deploy gc" in line, line
    assert "Running node" not in done.stdout + done.stderr
    assert not (project / "data" / "04_feature").exists()
