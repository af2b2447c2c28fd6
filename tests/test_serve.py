"""`train-deploy serve` (train_deploy.serve): the project's store from any folder, and one line when there is
nothing to serve. The served model answering the printed line is tests/registry/test_lineage.py's end-to-end run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from train_deploy.serve import ServeError, absolute_uri, check_servable, find_project, store_uris

TRAIN_DEPLOY = Path(sys.executable).parent / "train-deploy"


def test_a_file_of_conf_local_changes_only_the_mlflow_keys_it_names(project, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert store_uris(project) == (f"sqlite:///{project}/mlruns.db",) * 2  # conf/base's, absolute
    (project / "conf" / "local" / "mlflow.yml").write_text("server:\n  credentials: mlflow_team\n", encoding="utf-8")
    assert store_uris(project) == (f"sqlite:///{project}/mlruns.db",) * 2  # the rest of the block stays
    (project / "conf" / "local" / "mlflow.yml").write_text(
        "server:\n  mlflow_tracking_uri: https://mlflow.example.org\n", encoding="utf-8")
    # conf/base's ${server.mlflow_tracking_uri} was resolved within conf/base: the registry stays there ...
    assert store_uris(project) == ("https://mlflow.example.org", f"sqlite:///{project}/mlruns.db")
    (project / "conf" / "local" / "mlflow.yml").write_text(
        "server:\n  mlflow_tracking_uri: https://mlflow.example.org\n  mlflow_registry_uri: null\n", encoding="utf-8")
    assert store_uris(project) == ("https://mlflow.example.org",) * 2  # ... unless named too (null: the tracking URI)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere/mlflow.db")
    assert store_uris(project)[0] == "https://mlflow.example.org"  # conf/local names the key: it wins
    (project / "conf" / "local" / "mlflow.yml").unlink()
    assert store_uris(project) == (f"sqlite:///{project}/elsewhere/mlflow.db",) * 2  # as a run resolves it


@pytest.mark.parametrize(("uri", "expected"), [
    ("sqlite:///mlruns.db", "sqlite:////p/mlruns.db"), ("sqlite:////abs/m.db", "sqlite:////abs/m.db"),
    ("mlruns", "file:///p/mlruns"), ("file:mlruns", "file:///p/mlruns"), ("https://h:5000", "https://h:5000")])
def test_relative_local_stores_are_made_absolute_against_the_project(uri, expected):
    assert absolute_uri(uri, Path("/p")) == expected


def test_a_folder_that_is_no_project_is_named(tmp_path):
    with pytest.raises(ServeError, match=f"^--project {tmp_path}: no conf/base/mlflow.yml and pyproject.toml there$"):
        find_project(tmp_path)


def test_a_missing_store_is_named_with_what_to_do(tmp_path):
    with pytest.raises(ServeError, match=f"^no MLflow store at {tmp_path}/mlruns.db: run the pipeline first"):
        check_servable(f"sqlite:///{tmp_path}/mlruns.db", f"sqlite:///{tmp_path}/mlruns.db", "train_deploy_lm",
                       "champion")


def test_serving_a_model_the_store_lacks_says_so_in_one_line_from_any_folder(project, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    MlflowClient(uri).search_experiments()  # a store with its tables and no model
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "MLFLOW_TRACKING_URI": uri}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([str(TRAIN_DEPLOY), "serve", "--project", str(project), "--model", "nope"], cwd=elsewhere,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"Error: {uri}: registered model nope has no alias champion ("), done.stderr
    assert not list(elsewhere.iterdir()) and not (project / "mlflow.db").exists()
