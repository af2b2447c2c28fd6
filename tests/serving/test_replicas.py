"""``train-deploy serve --replicas 2 --follow``: the server's app as two Ray Serve replicas on a private local Ray
instance, behind Ray Serve's proxy on 127.0.0.1: both replicas answer MLflow's and OpenAI's routes, with the same
limits; a replica SIGKILLed under load is replaced while the other answers, and a new champion is rolled over to by
every replica with no failed request. One Ray instance serves every test of the module (it takes minutes to start),
but the autoscaling test's: ``--replicas 1 --max-replicas 2`` gets one of its own, started before the module's."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from tests.serving.conftest import CLIENTS, SCORE, Load, follow_command, request, wait_for

pytestmark = pytest.mark.slow

STAYS_S = 10.0
"""How long the autoscaled deployment must stay at one replica after one was removed."""


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_bundle) -> tuple[ModelStore, list[str]]:
    """A store holding the tiny bundle as versions 1 and 2 of the model, ``champion`` on 1."""
    store = ModelStore(tmp_path_factory.mktemp("replicas_store"))
    infos = [store.log(tiny_bundle, registered_model_name=REGISTERED_MODEL) for _ in range(2)]
    with store.active():
        mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion",
                                                         infos[0].registered_model_version)
    return store, [str(info.registered_model_version) for info in infos]


def test_between_one_and_two_replicas_a_second_is_added_under_load_and_removed_after_it_with_no_failed_request(
        tmp_path_factory, store):
    """``train-deploy serve --replicas 1 --max-replicas 2`` with short scale delays: Ray Serve adds a replica once 8
    clients keep more requests at the replica than its target (1, half of ``--batch 2``), removes one once a single
    client's requests stayed at or below it for ``--scale-down-after``, and stays at 1; no request fails. First in
    the module: its Ray instance is stopped before the module's starts."""
    store, _ = store
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("scaled") / "empty")
    project = copy_project(tmp_path_factory.mktemp("scaled_project") / "project")
    # --scale-down-after of Ray Serve's look-back window (30 s): a shorter one removes the replica while the window
    # still holds the load, and Ray Serve adds it back --scale-up-after later (docs/serving.md)
    served.command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project),
                      "--model", REGISTERED_MODEL, "--replicas", "1", "--max-replicas", "2", "--batch", "2",
                      "--scale-up-after", "1", "--scale-down-after", "30", "--port", served.url.rsplit(":", 1)[1]]
    served.start(timeout=300)
    try:
        started = time.monotonic()
        assert len({_ping(served)[1] for _ in range(20)}) == 1  # --replicas 1: one replica at the start
        with Load(served) as load:
            wait_for(lambda: len({a.replica for a in load.since(0) if a.status == 200}) == 2, "a second replica",
                     served, timeout=180)
            added = time.monotonic()
        stopped = time.monotonic()
        pair = {answer.replica for answer in load.since(0)}

        pings: list[tuple[int, str]] = []  # one client at a time: at the target, not above it

        def one_removed() -> bool:
            pings.append(_ping(served))
            return not all(map(_alive, pair))

        wait_for(one_removed, "the removal of a replica", served, timeout=180)
        removed, before_removal = time.monotonic(), len(pings)
        while time.monotonic() < removed + STAYS_S:  # a replica added back would be decided within this
            pings.append(_ping(served))
            time.sleep(0.1)
        survivor = {replica for replica in pair if _alive(replica)}
    finally:
        served.stop()
    assert [vars(answer) for answer in load.since(0) if answer.status != 200] == []
    assert {status for status, _ in pings} == {200}
    assert len(survivor) == 1 and {replica for _, replica in pings[before_removal:]} == survivor
    log = served.log.read_text(errors="replace")
    assert re.findall(r"(Up|Down)scaling Deployment\(name='server'.*? from (\d+) to (\d+) replicas", log) == [
        ("Up", "1", "2"), ("Down", "2", "1")], log[-4000:]
    assert "Stopped the private Ray instance" in log
    logging.getLogger(__name__).warning(
        "Autoscaling 1-2: a second replica answered %.1f s after 8 clients started (%d requests, none failed), one "
        "was removed %.1f s after they stopped (%d requests meanwhile, none failed)", added - started,
        len(load.since(0)), removed - stopped, len(pings))


def _ping(server: ModelServer) -> tuple[int, str]:
    """``GET /ping``: its status and the replica named in ``x-replica`` (0 and the error's name when the connection
    failed)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{server.url}/ping", timeout=30) as response:
            return response.status, response.headers["x-replica"]
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("x-replica") or ""
    except OSError as error:
        return 0, type(error).__name__


def _alive(replica: str) -> bool:
    """Whether the replica's process (its ``x-replica``) still runs."""
    try:
        os.kill(int(replica), 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, store) -> Iterator[ModelServer]:
    """``train-deploy serve --replicas 2 --follow`` of the tiny model's champion, started as users start it."""
    store, _ = store
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("replicas") / "empty")
    project = copy_project(tmp_path_factory.mktemp("replicas_project") / "project")
    served.command = follow_command(served, project, "--replicas", "2")
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
        answers = list(pool.map(lambda _: request(replicas, "POST", "/invocations", SCORE), range(40)))
    assert {status for status, _, _ in answers} == {200}
    assert {json.loads(body)["predictions"][0]["text"] for _, _, body in answers} == {"今天天气很好。"}

    from openai import OpenAI

    client = OpenAI(base_url=f"{replicas.url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=REGISTERED_MODEL, prompt="今天", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length") and isinstance(completion.choices[0].text, str)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=REGISTERED_MODEL, prompt="今天", max_tokens=4, temperature=0, stream=True) if chunk.choices)
    assert streamed == completion.choices[0].text

    too_many = request(replicas, "POST", "/invocations", json.dumps(
        {"dataframe_split": {"columns": ["text"], "data": [["今天"]] * 65}}).encode())
    assert too_many[0] == 400  # each replica enforces the logged limits (max_batch 64)


def test_requests_are_spread_over_both_replicas(replicas):
    seen = set()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for _ in range(60):
        with opener.open(f"{replicas.url}/ping", timeout=30) as response:
            seen.add(response.headers["x-replica"])
        if len(seen) == 2:
            break
    assert len(seen) == 2


def test_a_killed_replica_is_replaced_and_a_new_champion_rolled_over_under_load_with_no_failed_request(
        replicas, store):
    store, (first, second) = store
    with Load(replicas) as load:
        wait_for(lambda: len({a.replica for a in load.since(0) if a.status == 200}) == 2, "both replicas",
                      replicas)
        victim, survivor = sorted({answer.replica for answer in load.since(0) if answer.status == 200})
        killed = time.monotonic()
        os.kill(int(victim), signal.SIGKILL)
        wait_for(lambda: {a.replica for a in load.since(killed) if a.status == 200} - {victim, survivor},
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

        wait_for(rolled_over, "the rollover of both replicas", replicas)
        rolled = time.monotonic()
        wait_for(lambda: len(load.since(rolled)) >= 2 * CLIENTS, "answers after the rollover", replicas)

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
    from train_deploy.serve import SCALE_SETTINGS
    from train_deploy.serving.replicas import MAX_REPLICAS, REPLICAS, SCALE_DOWN_S, SCALE_UP_S, deployment_options

    assert SCALE_SETTINGS == (SCALE_UP_S, SCALE_DOWN_S)  # what serve passes is what the replicas read

    scaled = deployment_options({REPLICAS: "1", MAX_REPLICAS: "3", "TRAIN_DEPLOY_SERVE_BATCH": "8",
                                 "TRAIN_DEPLOY_SERVE_QUEUE": "3", "MLFLOW_TRACKING_URI": "sqlite:///x.db"})
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}
    assert "num_replicas" not in scaled and scaled["max_ongoing_requests"] == 1 + 8 + 2 * 3
    assert scaled["ray_actor_options"]["runtime_env"]["env_vars"] == {
        "TRAIN_DEPLOY_SERVE_BATCH": "8", "TRAIN_DEPLOY_SERVE_QUEUE": "3", "MLFLOW_TRACKING_URI": "sqlite:///x.db",
        REPLICAS: "1", MAX_REPLICAS: "3"}
    delayed = deployment_options({REPLICAS: "1", MAX_REPLICAS: "2", SCALE_UP_S: "1.5", SCALE_DOWN_S: "0"})
    assert delayed["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8,
                                             "upscale_delay_s": 1.5, "downscale_delay_s": 0.0}
    with pytest.raises(ValueError, match=r"^TRAIN_DEPLOY_SERVE_SCALE_DOWN_S='soon': expected a number of seconds, "
                                         r"0 or more$"):
        deployment_options({REPLICAS: "1", MAX_REPLICAS: "2", SCALE_DOWN_S: "soon"})
    fixed = deployment_options({REPLICAS: "2", MAX_REPLICAS: "2", "TRAIN_DEPLOY_SERVE_BATCH": "1",
                                SCALE_UP_S: "1"})
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_cpus"] == 1
