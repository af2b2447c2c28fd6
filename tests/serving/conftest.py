"""What the server's test modules share: the served tiny model (one server process per module), and for the
following and replicated servers' tests (``test_follow*.py``, ``test_replicas.py``) the command that starts a
following server, a tracking server as its store, one-request helpers and :class:`Load`, ``CLIENTS`` threads scoring
without pause."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from tests.helpers.serving import AppServer, downloaded

CLIENTS = 8
POLL_S = 0.5
SCORE = json.dumps({"dataframe_split": {"columns": ["text"], "data": [["今天天气很好。"]]},
                    "params": {"task": "score"}}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_store, tiny_model) -> Iterator[AppServer]:
    """The tiny model (logged with the default limits) served by the real server (``train_deploy.serving.app``) in
    its own process, from an empty folder."""
    model = downloaded(model_store, tiny_model.model_uri, tmp_path_factory.mktemp("served_model"))
    served = AppServer(model, model_store, tmp_path_factory.mktemp("served") / "empty")
    served.start()
    try:
        yield served
    finally:
        served.stop()


def follow_command(served: ModelServer, project: Path, *more: str, poll_s: float = POLL_S) -> list[str]:
    """``train-deploy serve --follow`` of ``champion`` of the project's model on ``served``'s port, as users type
    it, with ``more`` options (``--replicas 2``)."""
    return [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project), "--model",
            REGISTERED_MODEL, *more, "--follow", "--poll-interval", str(poll_s), "--port", served.url.rsplit(":", 1)[1]]


@dataclass(frozen=True)
class TrackingServerStore(ModelStore):
    """A tracking server as the store of the child processes (MLflow's client settings as users have them)."""

    uri: str = ""

    @property
    def tracking_uri(self) -> str:
        return self.uri

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "COLUMNS": "400"}  # the command's log lines whole


def request(server: ModelServer, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """One request on its own connection: the status, the ``x-model-version`` header and the body."""
    host, port = server.url.split("//")[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        if headers is None:
            headers = {"Content-Type": "application/json"} if body else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.getheader("x-model-version") or "", response.read()
    finally:
        connection.close()


def served_version(server: ModelServer) -> str:
    """The version ``/v1/models`` names, which its answer's header names too."""
    status, header, body = request(server, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["version"] == header
    return header


def wait_for(condition: Callable[[], object], what: str, server: ModelServer, timeout: float = 240.0) -> None:
    """Return once ``condition()`` holds; fail with the server's log tail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen:\n{server.log.read_text(errors='replace')[-4000:]}"
        time.sleep(0.1)


@dataclass(frozen=True)
class Answer:
    """One request of client ``client``: when it was sent and answered, its status, version and replica (0 and the
    error's name when the connection failed)."""

    client: int
    sent: float
    answered: float
    status: int
    version: str
    replica: str


class Load:
    """``CLIENTS`` threads scoring one text after another until the block ends, each on a new connection."""

    def __init__(self, server: ModelServer) -> None:
        self.host, port = server.url.split("//")[1].rsplit(":", 1)
        self.port, self.stopping, self.answers = int(port), threading.Event(), []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _loop(self, client: int) -> None:
        while not self.stopping.is_set():
            sent = time.monotonic()
            connection = http.client.HTTPConnection(self.host, self.port, timeout=120)
            try:
                connection.request("POST", "/invocations", body=SCORE, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                answer = Answer(client, sent, time.monotonic(), response.status,
                                response.getheader("x-model-version") or "", response.getheader("x-replica") or "")
            except OSError as error:  # a refused or dropped connection is a failed request too
                answer = Answer(client, sent, time.monotonic(), 0, type(error).__name__, "")
            finally:
                connection.close()
            with self.lock:
                self.answers.append(answer)

    def since(self, moment: float) -> list[Answer]:
        """The answers to requests sent at ``moment`` (``time.monotonic()``) or later, in the order answered."""
        with self.lock:
            return [answer for answer in self.answers if answer.sent >= moment]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=180)
