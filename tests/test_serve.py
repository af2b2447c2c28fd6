"""`train-deploy serve` (train_deploy.serve): the project's store from any folder, and one line when there is
nothing to serve. The served model answering the printed line is tests/registry/test_lineage.py's end-to-end run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow import MlflowClient

from tests.helpers.registry import ModelStore
from train_deploy.project import NoProject, absolute_uri, find_project, store_uris
from train_deploy.serve import ServeError, cached_model, check_servable

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
    with pytest.raises(NoProject, match=f"^--project {tmp_path}: no conf/base/mlflow.yml and pyproject.toml there$"):
        find_project(tmp_path)


def test_a_missing_store_is_named_with_what_to_do(tmp_path):
    with pytest.raises(ServeError, match=f"^no MLflow store at {tmp_path}/mlruns.db: run the pipeline first"):
        check_servable(f"sqlite:///{tmp_path}/mlruns.db", f"sqlite:///{tmp_path}/mlruns.db", "train_deploy_lm",
                       "champion")


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
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


MODEL = "serve_cache_lm"


def _registered(store: ModelStore, source: Path) -> Any:
    """``source`` logged as the artifacts of a run and registered as version 1 of :data:`MODEL` (its ModelVersion)."""
    with store.active(), mlflow.start_run() as run:
        mlflow.log_artifacts(str(source), "model")
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    client.create_registered_model(MODEL)
    return client.create_model_version(MODEL, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)


def _model_files(tmp_path: Path) -> Path:
    """A model's folder as MLflow stores it: its description, the package, the bundle's weights."""
    source = tmp_path / "source"
    (source / "artifacts" / "bundle").mkdir(parents=True)
    (source / "code").mkdir()
    (source / "MLmodel").write_text("flavors: {}\n", encoding="utf-8")
    (source / "code" / "module.py").write_text("VALUE = 1\n", encoding="utf-8")
    (source / "artifacts" / "bundle" / "weights.bin").write_bytes(os.urandom(1 << 20))
    return source


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the one MLflow adds to a registered model it downloads."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*")
            if path.is_file() and path.name != "registered_model_meta"}


def test_starts_of_one_version_share_one_verified_copy_and_a_damaged_copy_is_downloaded_again(
        tmp_path, monkeypatch, caplog):
    store, source = ModelStore(tmp_path / "store"), _model_files(tmp_path)
    version = _registered(store, source)
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    temporary = tmp_path / "tmp"  # where a download to a new temporary folder would land
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))

    first = cached_model(version, store.tracking_uri, store.tracking_uri)
    assert _tree(first) == _tree(source)
    weights = first / "artifacts" / "bundle" / "weights.bin"
    downloaded = weights.stat().st_ino
    assert cached_model(version, store.tracking_uri, store.tracking_uri) == first
    assert weights.stat().st_ino == downloaded  # reused, not downloaded again
    folder = next(parent for parent in first.parents if parent.parent == tmp_path / "cache" / "serve")
    assert sorted(path.name for path in folder.parent.iterdir()) == sorted([folder.name, f".{folder.name}.lock"])
    assert list(temporary.iterdir()) == []

    # One byte changed (same size), then a file gone: each time the copy is downloaded again, in the same folder.
    damaged = bytearray(weights.read_bytes())
    damaged[12345] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    with caplog.at_level("WARNING"):
        assert cached_model(version, store.tracking_uri, store.tracking_uri) == first
    assert f"The cached copy in {folder} is damaged (" in caplog.text
    assert _tree(first) == _tree(source) and weights.stat().st_ino != downloaded
    (first / "code" / "module.py").unlink()
    assert cached_model(version, store.tracking_uri, store.tracking_uri) == first
    assert _tree(first) == _tree(source)
    assert sorted(path.name for path in folder.parent.iterdir()) == sorted([folder.name, f".{folder.name}.lock"])
    assert list(temporary.iterdir()) == []


@pytest.mark.slow
def test_train_deploy_serve_started_twice_downloads_once_and_leaves_no_temporary_folder(project, tmp_path):
    store = ModelStore(tmp_path / "store")
    _registered(store, _model_files(tmp_path))  # no model a server can load: each start ends after the download
    temporary, cache = tmp_path / "tmp", tmp_path / "cache"
    temporary.mkdir()
    env = {**store.environment(), "TRAIN_DEPLOY_CACHE_DIR": str(cache), "TMPDIR": str(temporary)}
    inodes = []
    for _ in range(2):
        done = subprocess.run([str(TRAIN_DEPLOY), "serve", "--project", str(project), "--model", MODEL, "--alias",
                               "1", "--port", "0"], env=env, capture_output=True, text=True, timeout=180)
        assert f"Serving models:/{MODEL}/1 (version 1) of " in done.stderr, done.stderr[-2000:]
        (folder,) = [path for path in (cache / "serve").iterdir() if path.is_dir()]  # beside: locks, last-served record
        inodes.append((folder / "model" / "artifacts" / "bundle" / "weights.bin").stat().st_ino)
    assert inodes[0] == inodes[1]  # the second start reused the first one's copy
    last_served = f"{MODEL}_1-"  # serve.served_copy's record of the alias's last served copy (outage fallback)
    assert sorted(path.name for path in (cache / "serve").iterdir() if not path.name.startswith(last_served)) \
        == [f".{folder.name}.lock", folder.name]
    assert len([path for path in (cache / "serve").iterdir() if path.name.startswith(last_served)]) == 1
    assert list(temporary.iterdir()) == []


def test_the_admission_options_reach_the_server_and_out_of_range_ones_are_refused_in_one_line(
        project, tmp_path, monkeypatch):
    """`--queue`, `--batch` and `--body-timeout` become the server's TRAIN_DEPLOY_SERVE_* settings
    (serving.app.ServerSettings); a value outside its range is click's one-line refusal before anything starts."""
    import train_deploy.serve as serve_module
    from train_deploy.commands import main

    store = ModelStore(tmp_path / "store")
    _registered(store, _model_files(tmp_path))
    for name, value in {**store.environment(), "TRAIN_DEPLOY_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    started: dict[str, str] = {}

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        started.update(env)
        raise SystemExit(0)

    monkeypatch.setattr(serve_module.os, "execve", execve)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["serve", "--project", str(project), "--model", MODEL, "--alias", "1", "--queue", "3", "--batch", "2",
              "--body-timeout", "2.5"])
    assert {name: started.get(name) for name in ("TRAIN_DEPLOY_SERVE_QUEUE", "TRAIN_DEPLOY_SERVE_BATCH",
                                                  "TRAIN_DEPLOY_SERVE_BODY_TIMEOUT_S")} == {
        "TRAIN_DEPLOY_SERVE_QUEUE": "3", "TRAIN_DEPLOY_SERVE_BATCH": "2", "TRAIN_DEPLOY_SERVE_BODY_TIMEOUT_S": "2.5"}
    done = subprocess.run([str(TRAIN_DEPLOY), "serve", "--project", str(project), "--batch", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.endswith(
        "Error: Invalid value for '--batch' (env var: 'TRAIN_DEPLOY_SERVE_BATCH'): 0 is not in the range 1<=x<=256.\n")


def test_the_scale_delays_reach_ray_serve_only_between_replicas_and_a_larger_max_replicas(
        project, tmp_path, monkeypatch):
    """`--scale-up-after` and `--scale-down-after` become the replicas' TRAIN_DEPLOY_SERVE_SCALE_*_S settings
    (serving.replicas.deployment_options) when Ray Serve scales; given where it cannot, a one-line refusal."""
    import train_deploy.serve as serve_module
    from train_deploy.commands import main

    store = ModelStore(tmp_path / "store")
    _registered(store, _model_files(tmp_path))
    for name, value in {**store.environment(), "TRAIN_DEPLOY_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    started: dict[str, Any] = {}

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        started.update(argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(serve_module.os, "execve", execve)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["serve", "--project", str(project), "--model", MODEL, "--alias", "1", "--replicas", "1",
              "--max-replicas", "3", "--scale-up-after", "5", "--scale-down-after", "120"])
    assert started["argv"][1:] == ["-m", "train_deploy.serving.replicas"]
    assert {name: started["env"].get(name) for name in ("TRAIN_DEPLOY_SERVE_REPLICAS",
            "TRAIN_DEPLOY_SERVE_MAX_REPLICAS", "TRAIN_DEPLOY_SERVE_SCALE_UP_S", "TRAIN_DEPLOY_SERVE_SCALE_DOWN_S")} == {
        "TRAIN_DEPLOY_SERVE_REPLICAS": "1", "TRAIN_DEPLOY_SERVE_MAX_REPLICAS": "3",
        "TRAIN_DEPLOY_SERVE_SCALE_UP_S": "5.0", "TRAIN_DEPLOY_SERVE_SCALE_DOWN_S": "120.0"}
    for fixed in (["--replicas", "2"], ["--replicas", "2", "--max-replicas", "2"], []):
        done = subprocess.run([str(TRAIN_DEPLOY), "serve", "--project", str(project), *fixed, "--scale-down-after",
                               "60"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.endswith("Error: --scale-down-after: Ray Serve scales only "
                                                             "between --replicas and a larger --max-replicas\n")
