"""MLflow's own tools on the project's store from any folder (absolute artifact locations, as MLflow records them),
and a moved project: the one-line hint, ``train-deploy relocate`` (dry run, one transaction), then loading again."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from mlflow import MlflowClient

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from train_deploy.registry.relocate import StoreMoved, check_locations, relocate

TRAIN_DEPLOY = Path(sys.executable).parent / "train-deploy"

LOAD_SCRIPT = """
import json, mlflow, pandas as pd
model = mlflow.pyfunc.load_model("models:/train_deploy_lm@champion")
frame = model.predict(pd.DataFrame({"text": ["今天天气很好。"]}), params={"task": "score"})
print(json.dumps({"rows": len(frame), "columns": sorted(frame.columns)}))
"""


@dataclass(frozen=True)
class ProjectStore(ModelStore):
    """The project's own store, ``<project>/mlruns.db``, as a user's notebook names it."""

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{(self.root / 'mlruns.db').as_posix()}"


def _load_from_empty_folder(store: ProjectStore, folder: Path) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True)
    return subprocess.run([sys.executable, "-c", LOAD_SCRIPT], cwd=folder, env=store.environment(),
                          capture_output=True, text=True, timeout=300, check=False)


def _command(*args: str, cwd: Path, store: ProjectStore) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TRAIN_DEPLOY), *args], cwd=cwd, env=store.environment(), capture_output=True,
                          text=True, timeout=300, check=False)


def _stored(database: Path) -> dict[str, list[str]]:
    with sqlite3.connect(database) as connection:
        return {"experiments": [r[0] for r in connection.execute("SELECT artifact_location FROM experiments "
                                                                 "ORDER BY experiment_id")],
                "runs": [r[0] for r in connection.execute("SELECT artifact_uri FROM runs")],
                "versions": [r[0] for r in connection.execute("SELECT storage_location FROM model_versions")],
                "logged_models": [r[0] for r in connection.execute("SELECT artifact_location FROM logged_models")]}


@pytest.fixture
def registered_project(tmp_path, monkeypatch, tiny_bundle) -> Path:
    """A project whose runs use its own store ``mlruns.db``: the experiment created by a Kedro session (the
    project's hooks), the tiny bundle logged into it as a run does and aliased ``champion``."""
    from train_deploy.registry.model import log_bundle_model

    project = copy_project(tmp_path / "project")
    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlruns.db'}")
    bootstrap_project(project)
    with KedroSession.create(project_path=project) as session:
        session.load_context()  # kedro-mlflow creates the experiment
    experiment = MlflowClient().get_experiment_by_name("train_deploy")
    with mlflow.start_run(experiment_id=experiment.experiment_id):
        info = log_bundle_model(tiny_bundle, registered_model_name=REGISTERED_MODEL)
    MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", info.registered_model_version)
    monkeypatch.chdir(tmp_path)
    return project


@pytest.mark.slow
def test_mlflow_loads_and_serves_the_champion_from_any_folder_and_a_moved_project_is_relocated(
        registered_project, tmp_path):
    project, store = registered_project, ProjectStore(registered_project)
    database = project / "mlruns.db"
    recorded = _stored(database)
    assert recorded["experiments"][1] == (project / "mlartifacts").as_uri()  # absolute, as MLflow records it
    assert all(uri.startswith(f"{(project / 'mlartifacts').as_uri()}/") for uri in recorded["runs"])
    assert all(uri.startswith(f"{(project / 'mlartifacts').as_uri()}/") for uri in recorded["versions"])

    loaded = _load_from_empty_folder(store, tmp_path / "notebook")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert json.loads(loaded.stdout.strip().splitlines()[-1]) == {
        "rows": 1, "columns": ["chars", "log_prob", "mean_log_prob", "perplexity", "text", "tokens"]}
    server = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path / "served")
    server.start()
    try:
        status, body = server.post({"dataframe_split": {"columns": ["text"], "data": [["今天"]]},
                                    "params": {"task": "score"}})
    finally:
        server.stop()
    assert status == 200 and [row["text"] for row in body["predictions"]] == ["今天"]

    moved = tmp_path / "moved"
    shutil.copytree(project, moved)
    shutil.rmtree(project)
    store = ProjectStore(moved)
    failed = _load_from_empty_folder(store, tmp_path / "notebook2")
    assert failed.returncode != 0
    hint = (f"MLflow store {moved / 'mlruns.db'}: its artifact locations name {project}, which no longer exists "
            f"(the project moved to {moved}): run `train-deploy relocate --project {moved}` (--dry-run shows the "
            "changes)")
    refused = _command("serve", "--project", str(moved), "--model", REGISTERED_MODEL, cwd=tmp_path, store=store)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [f"Error: {hint}"]

    before = _stored(moved / "mlruns.db")
    dry = _command("relocate", "--project", str(moved), "--dry-run", cwd=tmp_path, store=store)
    assert dry.returncode == 0, dry.stderr
    changed = sum(value.startswith((str(project), project.as_uri())) for values in before.values() for value in values)
    assert changed == 2 + 3  # MLflow's default experiment and the project's, the run, its model, the version
    assert dry.stdout.splitlines()[-1] == f"Dry run: would change {changed} location(s) in {moved / 'mlruns.db'}"
    assert _stored(moved / "mlruns.db") == before
    done = _command("relocate", "--project", str(moved), cwd=tmp_path, store=store)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == \
        f"Changed {changed} location(s) in {moved / 'mlruns.db'}"
    assert _stored(moved / "mlruns.db") == {key: [value.replace(str(project), str(moved)) for value in values]
                                             for key, values in before.items()}
    again = _load_from_empty_folder(store, tmp_path / "notebook3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert check_locations(store.tracking_uri, moved) is None


def _store_with_locations(root: Path) -> Path:
    """A store in ``root`` with one experiment in ``root/mlartifacts``, one recorded relative (as earlier releases
    did), and a run with an artifact in each."""
    uri = f"sqlite:///{root / 'mlruns.db'}"
    client = MlflowClient(uri)
    absolute = client.create_experiment("absolute", artifact_location=(root / "mlartifacts").as_uri())
    relative = client.create_experiment("relative", artifact_location=(root / "old_style").as_uri())
    for experiment in (absolute, relative):
        run = client.create_run(experiment)
        client.log_text(run.info.run_id, "written", "note.txt")
    with sqlite3.connect(root / "mlruns.db") as connection:  # as hooks.tracking recorded it before
        connection.execute("UPDATE experiments SET artifact_location = 'old_style' WHERE name = 'relative'")
    return root / "mlruns.db"


def _copied_store(original: Path, copy: Path) -> tuple[Path, Path]:
    """A folder holding :func:`_store_with_locations`' store at ``original``, copied whole to ``copy``."""
    original.mkdir()
    _store_with_locations(original)
    shutil.copytree(original, copy)
    return original, copy


def test_relocate_rewrites_every_location_in_one_transaction_and_a_dry_run_writes_nothing(tmp_path):
    old, new = _copied_store(tmp_path / "old", tmp_path / "new")
    shutil.rmtree(old)
    database = new / "mlruns.db"
    before = _stored(database)
    with pytest.raises(StoreMoved, match=r"^MLflow store .*: its artifact locations name .*/old, which no longer"):
        check_locations(f"sqlite:///{database}", new)

    planned = relocate(database, new, dry_run=True)
    assert _stored(database) == before
    assert sorted((c.table, c.before, c.after) for c in planned) == sorted(
        [("experiments", (old / "mlartifacts").as_uri(), (new / "mlartifacts").as_uri()),
         ("experiments", "old_style", (new / "old_style").as_uri())]
        + [("runs", uri, uri.replace(old.as_uri(), new.as_uri())) for uri in before["runs"]])

    with sqlite3.connect(database) as connection:  # the last update fails: the earlier ones are undone
        connection.execute("CREATE TRIGGER refuse BEFORE UPDATE ON runs WHEN NEW.artifact_uri LIKE '%old_style%' "
                           "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    with pytest.raises(sqlite3.IntegrityError, match="refused"):
        relocate(database, new)
    assert _stored(database) == before
    with sqlite3.connect(database) as connection:
        connection.execute("DROP TRIGGER refuse")

    assert len(relocate(database, new)) == len(planned)
    assert _stored(database) == {"experiments": [before["experiments"][0], (new / "mlartifacts").as_uri(),
                                                 (new / "old_style").as_uri()],
                                 "runs": [uri.replace(old.as_uri(), new.as_uri()) for uri in before["runs"]],
                                 "versions": [], "logged_models": []}
    assert relocate(database, new) == []
    assert check_locations(f"sqlite:///{database}", new) is None


def test_a_copy_whose_store_still_names_the_original_is_warned_and_relocated_with_from(tmp_path):
    original, copy = _copied_store(tmp_path / "original", tmp_path / "copy")
    database = copy / "mlruns.db"
    assert check_locations(f"sqlite:///{database}", copy) == (
        f"MLflow store {database}: its artifact locations name {original}, another folder holding this project's "
        f"files (a copy?); its runs write there: run `train-deploy relocate --project {copy} --from {original}` to "
        "give this copy its own")
    relocate(database, copy, original)
    assert check_locations(f"sqlite:///{database}", copy) is None
    assert _stored(original / "mlruns.db")["runs"] != _stored(database)["runs"]  # the original's store untouched
