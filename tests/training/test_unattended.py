"""Safe to leave unattended: a stopped or hung job leaves no process behind, no credential reaches the disk,
and rank 0's metrics reach MLflow from the training node's process."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import psutil
import pytest
from safetensors.numpy import load_file

from tests.helpers.project import REPO
from tests.helpers.training import launch, run_spec, training_params
from train_deploy.config import ConfigError
from train_deploy.handoffs import to_json
from train_deploy.redaction import redact_uri
from train_deploy.training.checkpoint import latest_checkpoint
from train_deploy.training.config import TrainingConfig
from train_deploy.training.launch import TrainingFailed, _LogFollower, run_training, worker_environment
from train_deploy.training.metrics import MetricsForwarder

STOP_WITHIN_S = 30.0


# --- fast: the pieces -------------------------------------------------------------------------------------


def test_redact_uri_strips_user_and_password_from_every_uri_in_a_text():
    assert redact_uri("http://user:pa55@mlflow.example.org:5000/api") == "http://mlflow.example.org:5000/api"
    assert redact_uri("https://token@host/x and s3://k:s@bucket/key") == "https://host/x and s3://bucket/key"
    for clean in ("sqlite:///tmp/mlruns.db", "http://127.0.0.1:5000", "file:///a@b/c", "user@example.org"):
        assert redact_uri(clean) == clean


def test_the_launcher_environment_leaves_out_credentials(monkeypatch):
    secret = {
        "MLFLOW_TRACKING_PASSWORD": "p", "MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_TOKEN": "t",
        "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t",
        "AZURE_CLIENT_SECRET": "s", "AZURE_STORAGE_CONNECTION_STRING": "c", "AZURE_STORAGE_KEY": "k",
        "GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json", "github_token": "t", "Db_Password": "p",
        "MLFLOW_TRACKING_URI": "http://user:pw@mlflow:5000", "HTTPS_PROXY": "http://me:pw@proxy:3128",
    }
    kept = {"PADDLE_X": "1", "FLAGS_use_mkldnn": "0", "OMP_PROC_BIND": "close", "LC_ALL": "C.UTF-8",
            "MY_DATA_ROOT": "/srv/data"}
    # credentials under names no deny-list knows, and what the workers' software never reads
    unknown = {"SHOP_DB_PASS": "hunter2", "API_AUTH": "Bearer x", "DEPLOY_PK": "-----BEGIN", "KEYBOARD": "us",
               "MLFLOW_TRACKING_URI_PLAIN": "http://mlflow:5000", "AWS_DEFAULT_REGION": "eu-west-1"}
    for name, value in {**secret, **kept, **unknown}.items():
        monkeypatch.setenv(name, value)
    env = worker_environment(TrainingConfig.from_params({"launch": {"environment": ["MY_DATA_*", "*TOKEN*"]}}))
    assert not (set(secret) | set(unknown)) & set(env)  # listing a credential's pattern does not pass it
    assert {name: env[name] for name in kept} == kept
    assert env["PATH"] == os.environ["PATH"]


def test_launch_environment_takes_names_or_patterns_only():
    with pytest.raises(ConfigError, match=r"^training\.launch\.environment\[1\]: must be a variable name or a shell "
                                          r"pattern such as MY_DATA_\* \(got 'A=B'\)$"):
        TrainingConfig.from_params({"launch": {"environment": ["OK_*", "A=B"]}})


def test_stall_timeout_must_be_positive():
    with pytest.raises(ConfigError, match=r"^training\.launch\.stall_timeout: must be a positive number of seconds"):
        TrainingConfig.from_params({"launch": {"stall_timeout": 0}})


def test_the_workers_progress_line_reaches_the_training_nodes_console(tmp_path, caplog):
    log = tmp_path / "workerlog.0"
    log.write_text("2026-12-04 07:00:00 INFO worker.py:405 - step 3/6 (50%), 0:01 elapsed, ~0:01 left\n"
                   "2026-12-04 07:00:00 INFO worker.py:99 - a line nobody needs\n", encoding="utf-8")
    follower = _LogFollower(log, total=6, stall_timeout=60)
    with caplog.at_level(logging.INFO, logger="train_deploy.training.launch"):
        follower.echo()
    follower.close()
    assert [r.getMessage() for r in caplog.records] == ["step 3/6 (50%), 0:01 elapsed, ~0:01 left"]


class _Client:
    """An MLflow client that records what it is sent, or fails while ``down``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, float]] = []
        self.down = False

    def log_batch(self, run_id: str, metrics) -> None:
        if self.down:
            raise ConnectionError("cannot reach http://user:canary@127.0.0.1:1/api/2.0/mlflow/runs/log-batch")
        self.sent += [(m.key, m.step, m.value) for m in metrics]


def test_forwarder_sends_each_complete_line_once_and_keeps_lines_while_mlflow_is_down(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n')  # an earlier run's line, sent by that run
    client = _Client()
    forwarder = MetricsForwarder(path, "run", client=client)
    with open(path, "a") as f:
        f.write('{"step": 2, "loss": 8.0, "lr": 0.1}\n{"step": 3, "lo')
    forwarder.send()
    assert client.sent == [("train.loss", 2, 8.0), ("train.lr", 2, 0.1)]

    client.down = True
    with open(path, "a") as f:
        f.write('ss": 7.0}\n{"step": 4, "loss": 6.0}\n')
    with caplog.at_level(logging.WARNING):
        forwarder.send()
        forwarder.send()
    warnings = [r.getMessage() for r in caplog.records if "could not be sent to MLflow" in r.getMessage()]
    assert len(warnings) == 1 and "canary" not in warnings[0] and "127.0.0.1:1" in warnings[0]

    client.down = False
    forwarder.send()
    forwarder.send()
    assert [step for _, step, _ in client.sent] == [2, 2, 3, 4]


def test_forwarder_sends_what_is_left_when_closed(tmp_path):
    path, client = tmp_path / "metrics.jsonl", _Client()
    with MetricsForwarder(path, "run", client=client, interval=60):
        path.write_text('{"step": 1, "loss": 9.0}\n')
    assert client.sent == [("train.loss", 1, 9.0)]


# --- slow: real jobs --------------------------------------------------------------------------------------


@pytest.fixture
def tracking_uri(monkeypatch):
    """Set this process's MLflow tracking URI for one test (MLflow keeps it in a global and the environment)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # restored after the test, after the global is reset
    yield mlflow.set_tracking_uri
    mlflow.set_tracking_uri(None)


def _job_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose command line holds ``marker`` (a run's own path): its launcher and workers."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


def _metric_steps(folder: Path) -> list[int]:
    path = folder / "logs" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


# The training node's process, as `kedro run` is: run_training on the tiny data, its own session.
_TRAINING_PROCESS = """
import json, logging, sys
from pathlib import Path
from tests.helpers.training import launch
from train_deploy.handoffs import DataSpec, from_json
logging.basicConfig(level=logging.INFO)
job = json.loads(sys.argv[1])
launch(Path(job["folder"]), from_json(DataSpec, job["data"], "data"), job["params"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_to_the_training_process_stops_launcher_and_workers_and_a_rerun_resumes(tmp_path, tiny_tokens,
                                                                                        signum):
    params = training_params(2, parallel={"dp": 2}, schedule={"max_steps": 400, "checkpoint_every": 2})
    job = {"folder": str(tmp_path), "data": to_json(tiny_tokens), "params": params}
    with open(tmp_path / "node.log", "w") as out:
        node = subprocess.Popen([sys.executable, "-c", _TRAINING_PROCESS, json.dumps(job)], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: latest_checkpoint(tmp_path / "checkpoints") is not None or node.poll() is not None,
                  120, "no checkpoint")
        assert node.poll() is None, (tmp_path / "node.log").read_text()
        marker = str(tmp_path / "logs" / "run.json")
        assert len(_job_processes(marker)) >= 3  # the launcher and two workers
        node.send_signal(signum)
        stopped_at = time.monotonic()
        _wait_for(lambda: node.poll() is not None and not _job_processes(marker), STOP_WITHIN_S,
                  f"the job outlived {signum.name}")
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert time.monotonic() - stopped_at < STOP_WITHIN_S
    assert not [p for p in psutil.process_iter() if _in_session(p, node.pid)]
    if signum == signal.SIGKILL:
        return  # the kernel stopped the launcher (PR_SET_PDEATHSIG), which stopped its workers
    last_line = (tmp_path / "node.log").read_text().strip().splitlines()[-1]
    assert f"TrainingStopped: training stopped by {signum.name}" in last_line
    if signum != signal.SIGTERM:
        return

    # The last complete checkpoint is whole, and a rerun continues from it.
    checkpoint = latest_checkpoint(tmp_path / "checkpoints")
    step = json.loads((checkpoint / "state.json").read_text())["step"]
    assert load_file(str(checkpoint / "model.safetensors"))
    before = len(_metric_steps(tmp_path))
    params["schedule"]["max_steps"] = step + 2
    result = launch(tmp_path, tiny_tokens, params)
    assert result.finished and result.step == step + 2
    assert f"Resumed from {checkpoint}" in (tmp_path / "logs" / "node0" / "workerlog.0").read_text()
    assert _metric_steps(tmp_path)[before:] == [step + 1, step + 2]


def _in_session(process: psutil.Process, session: int) -> bool:
    try:
        return os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


@pytest.mark.slow
def test_a_stalled_rank_0_fails_the_job_naming_it_with_its_log_and_leaves_no_process(tmp_path, tiny_tokens):
    params = training_params(1, schedule={"max_steps": 400}, launch={"stall_timeout": 5})
    frozen: dict = {}

    def freeze_rank_0_after_its_first_step() -> None:
        _wait_for(lambda: _metric_steps(tmp_path), 120, "no first step")
        (worker,) = [p for p in _job_processes(str(tmp_path / "logs" / "run.json"))
                     if p.environ().get("PADDLE_TRAINER_ID") == "0"]
        worker.suspend()  # SIGSTOP: alive, silent, as a hung collective leaves it
        frozen["at"] = time.monotonic()

    helper = threading.Thread(target=freeze_rank_0_after_its_first_step)
    helper.start()
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingFailed) as failure:
        launch(tmp_path, tiny_tokens, params)
    helper.join()
    message = str(failure.value)
    assert message.startswith("training worker rank 0 reported no step for ")
    assert "training.launch.stall_timeout = 5 s" in message
    assert re.search(r"workerlog\.0: .*\bstep \d+\b", message)  # the tail of its log: its step and progress lines
    assert time.monotonic() - frozen["at"] < 5 + STOP_WITHIN_S
    assert not _job_processes(str(tmp_path / "logs" / "run.json"))
    assert signal.getsignal(signal.SIGTERM) is previous  # the node's handlers were only there while it ran


@pytest.mark.slow
def test_no_credential_reaches_the_run_folders_and_log_folders_are_private(tmp_path, tiny_tokens, monkeypatch,
                                                                         caplog, tracking_uri):
    canary = "canary-5d1c0ffee"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", canary)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)
    tracking_uri(f"http://user:{canary}@127.0.0.1:1")  # unreachable
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once rather than back off for minutes
    monkeypatch.setenv("TRAIN_DEPLOY_TEST_VISIBLE", "plain")
    # the server never comes back; the test's own variable is passed as a user's would be (launch.environment)
    params = training_params(1, launch={"metrics_timeout": 1, "environment": ["TRAIN_DEPLOY_TEST_*"]})
    with caplog.at_level(logging.INFO):
        result = run_training(run_spec(tmp_path, tiny_tokens, params), mlflow_run_id="0" * 32)
    assert result.finished  # MLflow being unreachable does not fail training

    files = [p for p in (tmp_path / "logs").rglob("*") if p.is_file()]
    files += [p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()]
    assert any(b"TRAIN_DEPLOY_TEST_VISIBLE" in p.read_bytes() for p in files)  # the launcher did write the env
    assert [str(p) for p in files if canary.encode() in p.read_bytes()] == []
    assert canary not in caplog.text and "could not be sent to MLflow" in caplog.text
    for folder in (tmp_path / "logs", tmp_path / "logs" / "node0"):
        assert folder.stat().st_mode & 0o777 == 0o700


@pytest.mark.slow
def test_metrics_reach_the_mlflow_run_from_the_node_each_step_once(tmp_path, tiny_tokens, tracking_uri):
    params = training_params(1)
    tracking_uri(f"sqlite:///{tmp_path / 'mlruns.db'}")
    with mlflow.start_run(experiment_id=mlflow.create_experiment("unattended")) as run:  # not a global one
        run_training(run_spec(tmp_path, tiny_tokens, params), mlflow_run_id=run.info.run_id)
    client = mlflow.MlflowClient()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train.loss")] == [1, 2, 3, 4, 5, 6]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train.val_loss")] == [3, 6]
    assert {"train.lr", "train.mfu", "train.tokens_per_second"} <= set(client.get_run(run.info.run_id).data.metrics)
