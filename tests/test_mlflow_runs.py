"""MLflow as users open it: the experiment's artifacts beside the project, runs of single stages linked by tags,
tags without object reprs, and no run left RUNNING after a failure or a stop."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from kedro.io.core import DatasetError
from mlflow import MlflowClient

from tests.helpers.project import cli_params, tiny_runtime_params
from train_deploy.registry.relocate import StoreMoved, relocate

KEDRO = Path(sys.executable).parent / "kedro"


def _runs(store: Path) -> list:
    """The project experiment's runs in ``store``, oldest first."""
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("train_deploy")
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


@pytest.mark.slow
def test_the_artifact_location_of_a_fresh_project_is_absolute_and_a_moved_copy_is_stopped_until_relocated(
        project, tmp_path, monkeypatch):
    with KedroSession.create(project_path=project) as session:
        session.load_context()  # kedro-mlflow creates the experiment
    experiment = MlflowClient().get_experiment_by_name("train_deploy")
    assert experiment.artifact_location == (project / "mlartifacts").as_uri()  # as MLflow records it

    moved = tmp_path / "moved"
    shutil.copytree(project, moved)
    shutil.rmtree(project)
    monkeypatch.chdir(moved)
    bootstrap_project(moved)
    with pytest.raises(StoreMoved) as stopped, KedroSession.create(project_path=moved) as session:
        session.load_context()
    assert str(stopped.value) == (
        f"MLflow store {tmp_path / 'mlruns.db'}: its artifact locations name {project}, which no longer exists (the "
        f"project moved to {moved}): run `train-deploy relocate --project {moved}` (--dry-run shows the changes)")
    assert not project.exists()

    relocate(tmp_path / "mlruns.db", moved)
    with KedroSession.create(project_path=moved) as session:
        session.load_context()
    with mlflow.start_run(experiment_id=experiment.experiment_id) as run:
        mlflow.log_text("written", "note.txt")
    assert (moved / "mlartifacts" / run.info.run_id / "artifacts" / "note.txt").read_text() == "written"
    assert MlflowClient().get_experiment(experiment.experiment_id).artifact_location == \
        (moved / "mlartifacts").as_uri()


@pytest.mark.slow
def test_runs_of_single_stages_share_the_corpus_fingerprint_and_tags_hold_no_object_reprs(project, tmp_path,
                                                                                         tiny_token_files):
    # a real folder, as corpus runs left them before by_fingerprint's links: read as it is
    shutil.copytree(tiny_token_files.path, project / "data" / "04_feature" / "tokens")
    for node in ("report_corpus", "report_corpus_quality"):  # two runs that read the token files
        with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
            session.run(pipeline_names=["corpus"], node_names=[node])

    first, second = _runs(tmp_path / "mlruns.db")
    assert first.data.tags["corpus.fingerprint"] == second.data.tags["corpus.fingerprint"]
    assert first.data.tags["corpus.fingerprint"] == tiny_token_files.fingerprint
    for run in (first, second):
        assert run.data.tags["runner"] == "SequentialRunner"
        assert not [value for value in run.data.tags.values() if " object at 0x" in value]


class _FailingHook:
    """A project hook that fails after kedro-mlflow has opened its run (as the skip decision could)."""

    from kedro.framework.hooks import hook_impl

    @hook_impl(trylast=True)
    def before_pipeline_run(self) -> None:
        raise RuntimeError("a hook failed")


@pytest.mark.slow
def test_a_failed_node_and_a_failed_hook_end_their_runs_failed(project, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("一篇文章。\n".encode() * 50 + b"\xff\xfe\xfa not UTF-8\n")
    params = tiny_runtime_params()
    params["corpus"]["reader"] = {"source": "text", "paths": [str(bad)]}
    with KedroSession.create(project_path=project, runtime_params=params) as session, \
            pytest.raises(DatasetError, match="bad.txt line 51: not valid UTF-8"):
        session.run(pipeline_names=["corpus"])
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session._hook_manager.register(_FailingHook())
        with pytest.raises(RuntimeError, match="a hook failed"):
            session.run(pipeline_names=["corpus"])
    assert mlflow.active_run() is None
    assert [run.info.status for run in _runs(tmp_path / "mlruns.db")] == ["FAILED", "FAILED"]


@pytest.mark.slow
def test_a_kedro_run_stopped_by_sigterm_ends_its_run_killed(project, tmp_path):
    params = tiny_runtime_params()
    params["corpus"]["reader"]["max_bytes"] = 10**9  # the whole embedded corpus: far longer than the test waits
    store = tmp_path / "mlruns.db"
    run = subprocess.Popen([str(KEDRO), "run", "--pipelines", "corpus", "--params", ",".join(cli_params(params))],
                           cwd=project, env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _running(store):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read() if run.poll() else "slow"
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) == 128 + signal.SIGTERM
    finally:
        run.kill()
        run.wait()
    assert [r.info.status for r in _runs(store)] == ["KILLED"]


def _running(store: Path) -> bool:
    if not store.exists():
        return False
    with sqlite3.connect(store, timeout=5) as connection:
        try:
            return connection.execute("SELECT count(*) FROM runs WHERE status = 'RUNNING'").fetchone()[0] > 0
        except sqlite3.OperationalError:  # the tables are not there yet
            return False
