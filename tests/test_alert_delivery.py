"""A run's alert, end to end with real ``kedro run`` processes and real receivers and servers: a receiver that
never finishes its answer neither keeps the run alive nor holds the project's lock (issue 35 item 3); the alert says
the real cause (the exception and its node, a signal only when one came) and no secret reaches the console, the
log file or the alert (issue 35 item 6)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.project import cli_params, tiny_runtime_params
from tests.http_receiver import Receiver, StallingReceiver
from tests.mlflow_server import mlflow_server  # noqa: F401
from train_deploy.run_control.lock import HOLDER_FILE, LOCK_FILE

KEDRO = Path(sys.executable).parent / "kedro"
SECRET = "S3cretPW"
# The corpus stage's second node refuses a path that does not exist: a run that fails at once, in a node.
MISSING_INPUT = "corpus:\n  reader:\n    source: text\n    paths: [data/01_raw/missing.txt]\n"
MISSING_REASON = "CorpusError: data/01_raw/missing.txt: no such file or folder (corpus.reader.paths)"


def _configure(project: Path, url: str, corpus: str = "") -> None:
    """Alerts to ``url`` (2 tries of 2 s: a delivery ends by 5 s) and ``corpus`` in the project's local settings."""
    notify = f"notify:\n  webhooks: [{url}]\n  timeout_seconds: 2\n  attempts: 2\n"
    (project / "conf" / "local" / "parameters_alert_test.yml").write_text(corpus + notify)


def _kedro_run(project: Path, output: Path, tracking_uri: str, *args: str) -> subprocess.Popen:
    with output.open("w") as console:
        return subprocess.Popen([str(KEDRO), "run", "--pipelines", "corpus", *args], cwd=project,
                                env={**os.environ, "MLFLOW_TRACKING_URI": tracking_uri,
                                     "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"},
                                stdout=console, stderr=subprocess.STDOUT)


def _lock_is_free(project: Path) -> bool:
    """Whether another run could take the project's lock now (the flock a run takes)."""
    with (project / "data" / LOCK_FILE).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
        return True


def _delivery_processes(project: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        if process.info["cmdline"] and process.info["cmdline"][-2:] == ["-m", "train_deploy.run_control.notify"] \
                and process.info["cwd"] == str(project):
            found.append(process)
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "failure"), [("trickle", "gave no complete answer within 5 s"),
                                               ("silent", "unreachable (TimeoutError)")])
def test_a_run_whose_receiver_stalls_exits_promptly_and_leaves_the_lock_free(project, tmp_path, mode, failure):
    receiver, output = StallingReceiver(mode), tmp_path / "console.txt"
    _configure(project, receiver.url, MISSING_INPUT)
    run = _kedro_run(project, output, f"sqlite:///{tmp_path / 'mlruns.db'}")
    try:
        code = run.wait(90)  # the run waits at most 3 s for its alert (hooks.alerts.HANDOFF_SECONDS)
        ended = time.monotonic()
        assert code == 1 and MISSING_REASON in output.read_text(), output.read_text()[-3000:]
        assert _lock_is_free(project)  # right after exit: the next run is not refused
        (delivery,) = _delivery_processes(project)  # still telling the receiver, in a session of its own
        lock = str(project / "data" / LOCK_FILE)
        assert lock not in {os.readlink(f"/proc/{delivery.pid}/fd/{fd}")
                            for fd in os.listdir(f"/proc/{delivery.pid}/fd")}
        assert delivery.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
        started = delivery.create_time()
        delivery.wait(15)  # its deadline is 5 s (+3 s margin for start-up and exit)
        assert time.time() - started < 5 + 3 + 1 and time.monotonic() - ended < 9
    finally:
        run.kill()
        run.wait()
        receiver.close()
    assert receiver.connections == (1 if mode == "trickle" else 2)  # a trickled answer holds its one try
    host = receiver.url.removesuffix("/hooks/T0KEN-secret-path")
    log = (project / "logs" / "train_deploy.log").read_text()
    assert f"Could not notify the failed outcome: {host} {failure}" in log
    assert "T0KEN" not in log and "secret-path" not in log


def _wait_in_node(project: Path, run: subprocess.Popen, output: Path, node: str) -> None:
    """Return once the run's holder record says it is in ``node``."""
    deadline = time.monotonic() + 300
    while True:
        try:
            about = json.loads((project / "data" / HOLDER_FILE).read_text())
        except (OSError, ValueError):
            about = {}
        if about.get("pid") == run.pid and about.get("node") == node:
            return
        assert run.poll() is None, output.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not in node {node} after 300 s"
        time.sleep(0.02)


def _tiny_corpus_args() -> list[str]:
    return ["--params", ",".join(cli_params(tiny_runtime_params()))]


@pytest.mark.slow
def test_a_run_whose_tracking_server_dies_shows_no_password_and_alerts_the_real_error(project, tmp_path,
                                                                                      mlflow_server):  # noqa: F811
    receiver, output = Receiver(), tmp_path / "console.txt"
    _configure(project, receiver.url)
    uri = mlflow_server.uri.replace("http://", f"http://alice:{SECRET}@")
    run = _kedro_run(project, output, uri, *_tiny_corpus_args())
    try:
        _wait_in_node(project, run, output, "prepare_tokenizer")
        mlflow_server.stop()  # the tracking server is gone mid-run
        assert run.wait(120) == 1
    finally:
        run.kill()
        run.wait()
    alert, body = _the_alert(receiver)
    console, log = output.read_text(), (project / "logs" / "train_deploy.log").read_text()
    for where, text in (("console", console), ("log", log), ("alert", body)):
        assert SECRET not in text and "alice" not in text, where
    assert (alert["event"], alert["node"], alert["stage"]) == ("failed", "prepare_tokenizer", "corpus")
    # the error the node died of (kedro-mlflow's dataset could not reach the server), not a signal
    assert alert["reason"].startswith(f"MlflowException: API request to {mlflow_server.uri}/api/2.0/mlflow/")
    assert str(project) not in alert["reason"] and "Dataset" not in alert["reason"]  # no path, no dataset class
    assert "signal" not in alert["reason"] and "stopped by" not in alert["reason"]
    assert f"MlflowException: API request to {mlflow_server.uri}/api/2.0/mlflow/runs/get failed" in console


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_alerts_the_signal_and_its_node(project, tmp_path):
    receiver, output = Receiver(), tmp_path / "console.txt"
    _configure(project, receiver.url)
    run = _kedro_run(project, output, f"sqlite:///{tmp_path / 'mlruns.db'}", *_tiny_corpus_args())
    try:
        _wait_in_node(project, run, output, "prepare_tokenizer")
        run.send_signal(signal.SIGTERM)
        run.wait(120)
    finally:
        run.kill()
        run.wait()
    alert, _ = _the_alert(receiver)
    assert (alert["event"], alert["node"], alert["stage"], alert["reason"]) == (
        "failed", "prepare_tokenizer", "corpus", "stopped by SIGTERM")


def _the_alert(receiver: Receiver) -> tuple[dict, str]:
    """The one alert the run sent (parsed, and as it came), the receiver closed."""
    (_, body), = receiver.wait_for(1, 15)
    receiver.close()
    return json.loads(body), body.decode()
