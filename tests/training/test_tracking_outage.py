"""Tracking-server outages: down at start, the run stops as it starts naming the server; down during training,
training goes on and every metric line reaches the run once when the server is back."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession

from tests.helpers.polling import wait_for
from tests.helpers.project import tiny_runtime_params
from tests.helpers.training import run_spec, training_params
from tests.mlflow_server import MlflowServer, free_port
from train_deploy.run_control.preflight import TrackingServerError
from train_deploy.training.launch import run_training

pytest_plugins = ["tests.mlflow_server"]
pytestmark = pytest.mark.slow

OUTAGE_S = 3.0  # between the server's stop and its restart (which takes some seconds more)
STEPS = 240  # tiny steps, ~10 s on 2 quiet cores with MKL's AVX2 kernels (60 could end before the server stopped):
# the server stops (~1 s after the first metrics) mid-training


@pytest.fixture
def tracking_uri(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Set this process's MLflow tracking URI for one test (MLflow keeps it in a global and the environment)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    yield mlflow.set_tracking_uri
    mlflow.set_tracking_uri(None)


def _metric_lines(folder: Path) -> list[dict]:
    path = folder / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_training_goes_on_while_the_tracking_server_is_down_and_every_step_reaches_the_run_once(
        tmp_path: Path, tiny_tokens, mlflow_server: MlflowServer, tracking_uri, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    params = training_params(1, schedule={"max_steps": STEPS, "log_every": 1, "eval_every": STEPS // 2,
                                          "checkpoint_every": STEPS})
    tracking_uri(mlflow_server.uri)
    # MLflow's client retries a refused connection inside one call for about two minutes; without those retries
    # the forwarder's own keep-and-resend carries the lines over the outage, as for any outage longer than that.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    client = mlflow.MlflowClient()
    run_id = client.create_run(experiment_id="0").info.run_id
    outage: dict = {}

    def stop_after_the_first_metrics_then_restart() -> None:
        try:
            wait_for(lambda: client.get_metric_history(run_id, "train.loss"), 120, "no metric reached the run",
                     interval=0.1)
            mlflow_server.stop()
            outage["steps_at_stop"] = len(_metric_lines(tmp_path))
            time.sleep(OUTAGE_S)
            outage["steps_at_restart"] = len(_metric_lines(tmp_path))
            mlflow_server.start()
        except BaseException as exc:
            outage["error"] = exc

    helper = threading.Thread(target=stop_after_the_first_metrics_then_restart)
    helper.start()
    with caplog.at_level(logging.WARNING):
        result = run_training(run_spec(tmp_path, tiny_tokens, params), mlflow_run_id=run_id)
    helper.join()
    assert "error" not in outage, outage.get("error")

    assert result.finished and result.step == STEPS
    assert outage["steps_at_stop"] < outage["steps_at_restart"], outage  # training went on while the server was down
    assert "Training metrics could not be sent to MLflow" in caplog.text and "not sent" not in caplog.text
    lines = _metric_lines(tmp_path)
    history = client.get_metric_history(run_id, "train.loss")
    assert sorted(metric.step for metric in history) == list(range(1, STEPS + 1))  # every step, each once
    logged = {line["step"]: line["loss"] for line in lines if "loss" in line}
    assert {metric.step: metric.value for metric in history} == pytest.approx(logged)
    assert [m.step for m in client.get_metric_history(run_id, "train.val_loss")] == [STEPS // 2, STEPS]


def test_a_run_against_a_server_that_is_down_stops_as_it_starts_naming_it(project: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", down.replace("http://", "http://alice:s3cret-canary@"))
    started = time.monotonic()
    with pytest.raises(TrackingServerError) as stopped:
        with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
            session.run(pipeline_names=["corpus"])
    assert time.monotonic() - started < 10
    message = str(stopped.value)
    assert message.startswith(f"MLflow tracking server {down} is unreachable (") and "\n" not in message
    assert message.endswith("): start it, or set MLFLOW_TRACKING_URI (or server.mlflow_tracking_uri in "
                            "conf/local/mlflow.yml) to one that runs")
    assert "s3cret-canary" not in message
    assert [path for path in (project / "data").rglob("*") if path.is_file()] == []  # no stage started
