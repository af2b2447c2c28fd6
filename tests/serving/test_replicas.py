"""``train-deploy serve --replicas 2``: the server's app as two Ray Serve replicas on a private local Ray instance,
behind Ray Serve's proxy on 127.0.0.1: both replicas answer MLflow's and OpenAI's routes, with the same limits."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from tests.serving.test_follow import SCORE, _request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_bundle) -> Iterator[ModelServer]:
    """``train-deploy serve --replicas 2`` of the tiny model's champion, started as users start it."""
    store = ModelStore(tmp_path_factory.mktemp("replicas_store"))
    info = store.log(tiny_bundle, registered_model_name=REGISTERED_MODEL)
    with store.active():
        mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", info.registered_model_version)
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("replicas") / "empty")
    project = copy_project(tmp_path_factory.mktemp("replicas_project") / "project")
    served.command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project),
                      "--model", REGISTERED_MODEL, "--replicas", "2", "--port", served.url.rsplit(":", 1)[1]]
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
