"""The local MLflow server fixture: proxied artifacts land on the server's disk, and a restart keeps the runs."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.exceptions import MlflowException

from tests.mlflow_server import MlflowServer, free_port

# Registers the `mlflow_server` fixture; `from tests.mlflow_server import mlflow_server` would do too.
pytest_plugins = ["tests.mlflow_server"]
pytestmark = pytest.mark.slow

BUNDLE_FILES = {
    "model.onnx": bytes(range(256)) * 64,
    "config.json": b'{"hidden_size": 64, "num_layers": 2}\n',
    "tokenizer/vocab.txt": "\u4f60\n\u597d\n".encode(),
}


@pytest.fixture(autouse=True)
def _no_mlflow_state_left() -> Iterator[None]:
    """Every test here leaves the process's tracking URI and active run as it found them."""
    tracking_uri, env_uri = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    yield
    assert mlflow.active_run() is None
    assert os.environ.get("MLFLOW_TRACKING_URI") == env_uri
    assert mlflow.get_tracking_uri() == tracking_uri


def _write_bundle(folder: Path) -> Path:
    for name, content in BUNDLE_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_artifact_folder_is_stored_by_the_server_and_downloads_identically(
    mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = _write_bundle(tmp_path / "bundle")
    workdir = tmp_path / "client"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)

    run = client.create_run(experiment_id="0")
    client.log_metric(run.info.run_id, "loss", 1.25, step=3)
    client.log_artifacts(run.info.run_id, str(bundle), "export/bundle")
    client.set_terminated(run.info.run_id)

    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert list(workdir.iterdir()) == [], "the client wrote artifacts to its own disk instead of the server"
    stored = [folder for folder in mlflow_server.artifacts.rglob("bundle") if folder.parent.name == "export"]
    assert len(stored) == 1 and run.info.run_id in stored[0].parts
    assert _files(stored[0]) == BUNDLE_FILES
    assert client.get_run(run.info.run_id).data.metrics == {"loss": 1.25}

    downloaded = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="export/bundle", dst_path=str(tmp_path / "download"),
        tracking_uri=mlflow_server.uri,
    )
    assert _files(Path(downloaded)) == BUNDLE_FILES
    assert list(workdir.iterdir()) == []


def test_stopped_server_fails_fast_and_a_restart_keeps_its_runs(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = client.create_run(experiment_id="0").info.run_id
    client.log_metric(run_id, "loss", 2.5, step=1)
    assert len(mlflow_server.processes()) >= 2, "expected the mlflow CLI and its uvicorn worker"

    mlflow_server.stop()
    assert mlflow_server.processes() == []
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    started = time.monotonic()
    with pytest.raises(MlflowException, match="API request to .* failed"):
        client.get_run(run_id)
    assert time.monotonic() - started < 5

    mlflow_server.start()
    client.log_metric(run_id, "loss", 2.0, step=2)
    history = client.get_metric_history(run_id, "loss")
    assert [(metric.step, metric.value) for metric in history] == [(1, 2.5), (2, 2.0)]


def test_server_that_does_not_answer_in_time_fails_with_its_log(tmp_path: Path) -> None:
    server = MlflowServer(tmp_path, free_port())

    log_tail = r"\n--- .*mlflow server --host 127\.0\.0\.1"
    with pytest.raises(RuntimeError, match=r"did not answer /health within 1 s:" + log_tail):
        server.start(timeout=1)
    assert server.processes() == []
