"""`train-deploy-registry` run from the project, as the end of a run prints it: the project's store and model name,
without `--tracking-uri` or `MLFLOW_TRACKING_URI` (issue 36)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.helpers.project import copy_project
from train_deploy.registry.cli import registry_command
from train_deploy.registry.history import record_event

COMMAND = Path(sys.executable).parent / "train-deploy-registry"
EVENT = {"time": "2026-12-01T03:00:00.000001+00:00", "event": "gate", "decision": "first", "version": "1",
         "champion": "1", "reason": "no champion yet: the first version becomes champion"}


def _typed(command: list[str] | str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command as a user types it in ``cwd``: no tracking URI in the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "PYTHONPATH"}
    argv = shlex.split(command) if isinstance(command, str) else [str(COMMAND), *command]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False)


def _project_with_model(root: Path, model: str) -> Path:
    """A project whose own store (conf/base: sqlite:///mlruns.db in the project) holds ``model`` and one event."""
    project = copy_project(root)
    client = MlflowClient(f"sqlite:///{project / 'mlruns.db'}", f"sqlite:///{project / 'mlruns.db'}")
    client.create_registered_model(model)
    record_event(client, model, EVENT)
    return project


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_history_from_the_project_reads_its_store_and_its_model_name(tmp_path):
    project = _project_with_model(tmp_path / "project", "edu_lm")
    (project / "conf" / "local" / "parameters_registry.yml").write_text(
        yaml.safe_dump({"registry": {"model_name": "edu_lm"}}), encoding="utf-8")
    done = _typed(["history"], project)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()
    assert header.split()[:4] == ["time", "(UTC)", "event", "decision"]
    assert row.split()[3:6] == ["first", "1", "1"] and row.endswith(EVENT["reason"])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _typed(registry_command("history", "edu_lm", project), elsewhere)  # as the end of a run prints it
    assert done.returncode == 0 and done.stdout.splitlines()[1] == row, done.stderr


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_history_before_the_model_exists_says_there_are_no_versions_yet(tmp_path):
    project = _project_with_model(tmp_path / "project", "other_lm")
    done = _typed(["history", "--model", "edu_lm"], project)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"train-deploy-registry history: sqlite:///{project / 'mlruns.db'}: no versions of edu_lm " \
                          "yet\n"


def test_history_in_a_project_that_never_ran_creates_no_store(tmp_path):
    project = copy_project(tmp_path / "project")
    done = _typed(["history", "--model", "edu_lm"], project)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == ("train-deploy-registry history: no versions of edu_lm yet: the project's MLflow store "
                           "mlruns.db does not exist until a run registers one\n")
    assert not (project / "mlruns.db").exists()


def test_the_printed_command_names_this_environment_the_project_and_a_kedro_environment(tmp_path):
    project = tmp_path / "project"
    assert registry_command("rollback", "edu_lm", project, "team") == shlex.join(
        [str(COMMAND), "rollback", "--model", "edu_lm", "--project", str(project.resolve()), "--env", "team"])
    checkout = Path(__file__).resolve().parents[2]
    assert registry_command("history", "edu_lm", checkout, "local") == f"{COMMAND} history --model edu_lm"
