"""``train-deploy serve --follow``: a real server process follows ``champion`` while 8 clients score without pause;
a damaged version is refused (logged once, counted for an alert) and the old one answers on; a good one is switched
to with no failed request, every answer naming the version that produced it."""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from click.testing import CliRunner

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from tests.http_receiver import Receiver

pytest_plugins = ["tests.mlflow_server"]

CLIENTS = 8
POLL_S = 0.5
SCORE = json.dumps({"dataframe_split": {"columns": ["text"], "data": [["今天天气很好。"]]},
                    "params": {"task": "score"}}).encode()


def _request(server: ModelServer, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    """One request on its own connection: the status, the ``x-model-version`` header and the body."""
    host, port = server.url.split("//")[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        response = connection.getresponse()
        return response.status, response.getheader("x-model-version") or "", response.read()
    finally:
        connection.close()


class Clients:
    """``CLIENTS`` threads scoring one text after another until stopped; each keeps (status, version) answers."""

    def __init__(self, server: ModelServer) -> None:
        self.server, self.stopping = server, threading.Event()
        self.answers: list[list[tuple[int, str]]] = [[] for _ in range(CLIENTS)]
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _loop(self, i: int) -> None:
        while not self.stopping.is_set():
            try:
                status, version, _ = _request(self.server, "POST", "/invocations", SCORE)
            except OSError as error:  # a refused or dropped connection is a failed request too
                status, version = 0, type(error).__name__
            self.answers[i].append((status, version))

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=180)


@pytest.fixture(scope="module")
def versions(tmp_path_factory, tiny_bundle) -> tuple[ModelStore, list[str]]:
    """A store holding the tiny bundle as versions 1, 2 and 3 of the model, ``champion`` on 1, version 3's stored
    weights damaged after it was registered (same size, one byte changed)."""
    store = ModelStore(tmp_path_factory.mktemp("follow_store"))
    infos = [store.log(tiny_bundle, registered_model_name=REGISTERED_MODEL) for _ in range(3)]
    registered = [info.registered_model_version for info in infos]
    with store.active():
        mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", registered[0])
        stored = Path(mlflow.get_logged_model(infos[2].model_id).artifact_location.removeprefix("file://"))
    bundle = next(stored.rglob("bundle.json")).parent
    largest = max((path for path in bundle.rglob("*") if path.is_file() and path.name != "bundle.json"),
                  key=lambda path: path.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    return store, [str(version) for version in registered]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """The webhook the following server's project alerts (its ``notify`` block in conf/local)."""
    receiver = Receiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, versions, receiver) -> Iterator[ModelServer]:
    """``train-deploy serve --follow --poll-interval 0.5`` of ``champion``, started as users start it, from a project
    whose ``notify`` block names ``receiver``."""
    store, _ = versions
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("follow") / "empty")
    project = copy_project(tmp_path_factory.mktemp("follow_project") / "project")
    (project / "conf" / "local" / "parameters_notify.yml").write_text(
        f"notify:\n  webhooks: [{receiver.url}]\n  attempts: 1\n  timeout_seconds: 5\n")
    served.command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project),
                      "--model", REGISTERED_MODEL, "--follow", "--poll-interval", str(POLL_S), "--port",
                      served.url.rsplit(":", 1)[1]]
    served.start()
    try:
        yield served
    finally:
        served.stop()


def _served_version(server: ModelServer) -> str:
    status, header, body = _request(server, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["version"] == header
    return header


def _metrics(server: ModelServer) -> str:
    status, _, body = _request(server, "GET", "/metrics")
    assert status == 200
    return body.decode()


def _wait_for(condition, what: str, server: ModelServer, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen:\n{server.log.read_text(errors='replace')[-4000:]}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_damaged_version_is_refused_alerted_and_a_good_one_taken_with_no_failed_request(server, versions, receiver):
    store, (first, second, damaged) = versions
    assert _served_version(server) == first
    refused = (f'train_deploy_follow_refused_total{{model="{REGISTERED_MODEL}",version="{damaged}"}} 1.0')
    with Clients(server) as clients, store.active():
        client = mlflow.MlflowClient()
        client.set_registered_model_alias(REGISTERED_MODEL, "champion", damaged)
        _wait_for(lambda: refused in _metrics(server), "refusing the damaged version", server)
        assert _served_version(server) == first
        client.set_registered_model_alias(REGISTERED_MODEL, "champion", second)
        _wait_for(lambda: _served_version(server) == second, "the switch to the good version", server)
        answered_before = sum(map(len, clients.answers))
        _wait_for(lambda: sum(map(len, clients.answers)) >= answered_before + 2 * CLIENTS, "answers after it", server)

    answers = [answer for client_answers in clients.answers for answer in client_answers]
    assert [answer for answer in answers if answer[0] != 200] == []
    assert {version for _, version in answers} == {first, second}
    for client_answers in clients.answers:  # each client's answers came from version 1, then from version 2
        named = [version for _, version in client_answers]
        assert named == sorted(named, key=int)
    log = server.log.read_text(errors="replace")
    refusals = re.findall(rf"Refused version {damaged} of {REGISTERED_MODEL} \(\S+\): BundleError: .*; version "
                          rf"{first} keeps serving", log)
    assert len(refusals) == 1, log[-4000:]
    metrics = _metrics(server)
    assert f'train_deploy_served_version_info{{model="{REGISTERED_MODEL}",version="{second}"}} 1.0' in metrics
    assert f'train_deploy_served_version_info{{model="{REGISTERED_MODEL}",version="{first}"}}' not in metrics
    assert f'train_deploy_follow_switches_total{{model="{REGISTERED_MODEL}",version="{second}"}} 1.0' in metrics
    assert refused in metrics
    [(_, alert)] = receiver.wait_for(1, 30)
    alert = json.loads(alert)
    assert {key: alert[key] for key in ("event", "stage", "model", "alias", "version", "serving")} == {
        "event": "failed", "stage": "serve --follow", "model": REGISTERED_MODEL, "alias": "champion",
        "version": damaged, "serving": first}
    assert alert["reason"].startswith("BundleError: ")
    assert len(receiver.received) == 1


def test_following_a_version_number_is_refused_in_one_line():
    from train_deploy.commands import main

    result = CliRunner().invoke(main, ["serve", "--alias", "3", "--follow"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: --follow: version 3 never moves; follow an alias (--alias champion)"]


@dataclass(frozen=True)
class _TrackingServer(ModelStore):
    """A tracking server as the store child processes use (clients that give up at once when it is down)."""

    uri: str = ""

    @property
    def tracking_uri(self) -> str:
        return self.uri

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
                "COLUMNS": "400"}  # the command's log lines whole


def _following(store: ModelStore, project: Path, folder: Path) -> ModelServer:
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, folder)
    served.command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project),
                      "--model", REGISTERED_MODEL, "--follow", "--poll-interval", str(POLL_S), "--port",
                      served.url.rsplit(":", 1)[1]]
    return served


@pytest.mark.slow
def test_a_restart_while_the_tracking_server_is_down_serves_the_last_copy_and_the_watch_polls_on(
        mlflow_server, tiny_bundle, tmp_path):
    from train_deploy.registry.model import log_bundle_model

    mlflow.set_tracking_uri(mlflow_server.uri)
    mlflow.set_registry_uri(mlflow_server.uri)
    with mlflow.start_run(experiment_id=mlflow.set_experiment("outage").experiment_id):
        version = log_bundle_model(tiny_bundle, registered_model_name=REGISTERED_MODEL).registered_model_version
    mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", version)
    store, project = _TrackingServer(tmp_path, mlflow_server.uri), copy_project(tmp_path / "project")
    first = _following(store, project, tmp_path / "first")
    first.start()
    try:
        assert _served_version(first) == str(version)
    finally:
        first.stop()

    mlflow_server.stop()
    second = _following(store, project, tmp_path / "second")
    second.start()
    try:
        assert _served_version(second) == str(version)
        assert _request(second, "POST", "/invocations", SCORE)[0] == 200
        _wait_for(lambda: "The registry did not answer" in second.log.read_text(errors="replace"), "a failed poll",
                  second)
        mlflow_server.start()
        _wait_for(lambda: "The registry answers again" in second.log.read_text(errors="replace"), "a poll", second)
    finally:
        second.stop()
    log = second.log.read_text(errors="replace")
    assert f"does not answer: serving the copy of {REGISTERED_MODEL} version {version} downloaded before" in log
    assert log.count("The registry did not answer") == 1  # once per outage
