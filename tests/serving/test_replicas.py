"""``train-deploy serve --replicas 2 --follow``: the server's app as two Ray Serve replicas on a private local Ray
instance, behind Ray Serve's proxy on 127.0.0.1: both replicas answer MLflow's and OpenAI's routes, with the same
limits; a replica SIGKILLed under load is replaced while the other answers, and a new champion is rolled over to by
every replica with no failed request. One Ray instance serves every test of the module (it takes minutes to start)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from tests.serving.test_follow import CLIENTS, POLL_S, SCORE, _request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_bundle) -> tuple[ModelStore, list[str]]:
    """A store holding the tiny bundle as versions 1 and 2 of the model, ``champion`` on 1."""
    store = ModelStore(tmp_path_factory.mktemp("replicas_store"))
    infos = [store.log(tiny_bundle, registered_model_name=REGISTERED_MODEL) for _ in range(2)]
    with store.active():
        mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion",
                                                         infos[0].registered_model_version)
    return store, [str(info.registered_model_version) for info in infos]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, store) -> Iterator[ModelServer]:
    """``train-deploy serve --replicas 2 --follow`` of the tiny model's champion, started as users start it."""
    store, _ = store
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("replicas") / "empty")
    project = copy_project(tmp_path_factory.mktemp("replicas_project") / "project")
    served.command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project),
                      "--model", REGISTERED_MODEL, "--replicas", "2", "--follow", "--poll-interval", str(POLL_S),
                      "--port", served.url.rsplit(":", 1)[1]]
    before = set(Path(tempfile.gettempdir()).glob("train_deploy-serve-ray-*"))
    served.start(timeout=300)
    try:
        yield served
    finally:
        served.stop()
    log = served.log.read_text(errors="replace")
    assert "Stopped the private Ray instance" in log, log[-4000:]
    assert set(Path(tempfile.gettempdir()).glob("train_deploy-serve-ray-*")) == before  # the private instance's


def test_two_replicas_answer_scoring_and_openai_completions_through_ray_serves_proxy(replicas):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _request(replicas, "POST", "/invocations", SCORE), range(40)))
    assert {status for status, _, _ in answers} == {200}
    assert {json.loads(body)["predictions"][0]["text"] for _, _, body in answers} == {"今天天气很好。"}

    from openai import OpenAI

    client = OpenAI(base_url=f"{replicas.url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=REGISTERED_MODEL, prompt="今天", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length") and isinstance(completion.choices[0].text, str)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=REGISTERED_MODEL, prompt="今天", max_tokens=4, temperature=0, stream=True) if chunk.choices)
    assert streamed == completion.choices[0].text

    too_many = _request(replicas, "POST", "/invocations", json.dumps(
        {"dataframe_split": {"columns": ["text"], "data": [["今天"]] * 65}}).encode())
    assert too_many[0] == 400  # each replica enforces the logged limits (max_batch 64)


def test_requests_are_spread_over_both_replicas(replicas):
    import urllib.request

    seen = set()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for _ in range(60):
        with opener.open(f"{replicas.url}/ping", timeout=30) as response:
            seen.add(response.headers["x-replica"])
        if len(seen) == 2:
            break
    assert len(seen) == 2


class _Answer:
    """One request of a client: when it was sent and answered, its status, version and replica (0 and the error's
    name when the connection failed)."""

    def __init__(self, sent: float, answered: float, status: int, version: str, replica: str) -> None:
        self.sent, self.answered, self.status, self.version, self.replica = sent, answered, status, version, replica


class _Load:
    """``CLIENTS`` threads scoring one text after another through the proxy until stopped."""

    def __init__(self, server: ModelServer) -> None:
        self.host, port = server.url.split("//")[1].rsplit(":", 1)
        self.port, self.stopping, self.answers = int(port), threading.Event(), []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(CLIENTS)]

    def _loop(self) -> None:
        while not self.stopping.is_set():
            sent = time.monotonic()
            connection = http.client.HTTPConnection(self.host, self.port, timeout=120)
            try:
                connection.request("POST", "/invocations", body=SCORE, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                answer = _Answer(sent, time.monotonic(), response.status, response.getheader("x-model-version") or "",
                                 response.getheader("x-replica") or "")
            except OSError as error:  # a refused or dropped connection is a failed request too
                answer = _Answer(sent, time.monotonic(), 0, type(error).__name__, "")
            finally:
                connection.close()
            with self.lock:
                self.answers.append(answer)

    def since(self, moment: float) -> list[_Answer]:
        with self.lock:
            return [answer for answer in self.answers if answer.sent >= moment]

    def wait_for(self, condition: Callable[[], bool], what: str, server: ModelServer, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            tail = server.log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, f"{what} did not happen:\n{tail}"
            time.sleep(0.1)

    def __enter__(self) -> _Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=180)


def test_a_killed_replica_is_replaced_and_a_new_champion_rolled_over_under_load_with_no_failed_request(
        replicas, store):
    store, (first, second) = store
    with _Load(replicas) as load:
        load.wait_for(lambda: len({a.replica for a in load.since(0) if a.status == 200}) == 2, "both replicas",
                      replicas)
        victim, survivor = sorted({answer.replica for answer in load.since(0) if answer.status == 200})
        killed = time.monotonic()
        os.kill(int(victim), signal.SIGKILL)
        load.wait_for(lambda: {a.replica for a in load.since(killed) if a.status == 200} - {victim, survivor},
                      "a replacement replica answering", replicas)
        replaced = time.monotonic()
        meanwhile = [answer for answer in load.since(killed) if answer.sent < replaced]
        failed = [answer for answer in load.since(0) if answer.status != 200]

        promoted = time.monotonic()
        with store.active():
            mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", second)

        def rolled_over() -> bool:
            latest = {answer.replica: answer.version for answer in load.since(promoted) if answer.status == 200}
            return len(latest) == 2 and set(latest.values()) == {second}

        load.wait_for(rolled_over, "the rollover of both replicas", replicas)
        rolled = time.monotonic()
        load.wait_for(lambda: len(load.since(rolled)) >= 2 * CLIENTS, "answers after the rollover", replicas)

    # the kill: only requests in flight when it happened failed (each client has one at a time); the ones sent
    # meanwhile were answered by the survivor, then by the replacement too
    assert all(answer.sent < killed < answer.answered for answer in failed), [vars(a) for a in failed]
    assert len(failed) <= CLIENTS
    assert {answer.replica for answer in meanwhile if answer.status == 200} >= {survivor}
    logging.getLogger(__name__).warning(
        "SIGKILL of replica %s: %d failed requests (%s); %d sent until its replacement answered %.1f s later",
        victim, len(failed), sorted({answer.status for answer in failed}), len(meanwhile), replaced - killed)
    # the rollover: no failed request, every answer named the version that produced it, then the new one only
    after = load.since(promoted)
    assert [vars(answer) for answer in after if answer.status != 200] == []
    assert {answer.version for answer in after} == {first, second}
    assert {answer.version for answer in load.since(rolled)} == {second}


def test_max_replicas_makes_ray_serve_autoscale_by_the_requests_at_each_replica():
    from train_deploy.serving.replicas import MAX_REPLICAS, REPLICAS, deployment_options

    scaled = deployment_options({REPLICAS: "1", MAX_REPLICAS: "3", "TRAIN_DEPLOY_SERVE_BATCH": "8",
                                 "TRAIN_DEPLOY_SERVE_QUEUE": "3", "MLFLOW_TRACKING_URI": "sqlite:///x.db"})
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}
    assert "num_replicas" not in scaled and scaled["max_ongoing_requests"] == 1 + 8 + 2 * 3
    assert scaled["ray_actor_options"]["runtime_env"]["env_vars"] == {
        "TRAIN_DEPLOY_SERVE_BATCH": "8", "TRAIN_DEPLOY_SERVE_QUEUE": "3", "MLFLOW_TRACKING_URI": "sqlite:///x.db",
        REPLICAS: "1", MAX_REPLICAS: "3"}
    fixed = deployment_options({REPLICAS: "2", MAX_REPLICAS: "2", "TRAIN_DEPLOY_SERVE_BATCH": "1"})
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_cpus"] == 1
