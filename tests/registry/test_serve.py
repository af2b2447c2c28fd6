"""``train-deploy serve`` of the registered champion: both tasks over HTTP, HTTP 400 for each bad request, the
request limits, and scoring that goes on while the longest generation runs."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import numpy as np
import pytest

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from train_deploy.export.runtime import LanguageModel, read_bundle
from train_deploy.registry.config import ServingConfig

pytestmark = pytest.mark.slow

MAX_BATCH = 2
# The longest generation allowed runs into the time budget, which the load test below runs against.
SERVING = ServingConfig(max_new_tokens=100_000, max_tokens=200_000, time_budget_s=3)
TEXTS = ["今天天气很好。", "人民日报社论"]
PROMPTS = ["中国", "今天"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_bundle) -> Iterator[ModelServer]:
    """One server for the module, started as users start it (``train-deploy serve`` of the project's store, here a
    copy of the project's configuration with the store as ``MLFLOW_TRACKING_URI``): the tiny bundle registered with
    ``max_batch`` 2 and :data:`SERVING`, aliased ``champion``."""
    store = ModelStore(tmp_path_factory.mktemp("serve_store"))
    info = store.log(tiny_bundle, max_batch=MAX_BATCH, serving=SERVING, registered_model_name=REGISTERED_MODEL)
    with store.active():
        mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", info.registered_model_version)
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("serve") / "empty")
    project = copy_project(tmp_path_factory.mktemp("serve_project") / "project")
    served.command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project),
                      "--model", REGISTERED_MODEL, "--port", served.url.rsplit(":", 1)[1]]
    served.start()
    try:
        yield served
    finally:
        served.stop()


def test_score_answers_each_texts_log_probability_and_perplexity(server, tiny_bundle):
    status, body = server.post({"dataframe_split": {"columns": ["text"], "data": [[text] for text in TEXTS]},
                                "params": {"task": "score"}})
    assert status == 200, body
    expected = LanguageModel.load(tiny_bundle).score(TEXTS)
    rows = body["predictions"]
    assert [row["text"] for row in rows] == TEXTS
    for row, want in zip(rows, expected, strict=True):
        assert row["tokens"] == len(want.tokens) and row["chars"] == len(want.text)
        assert row["log_prob"] == pytest.approx(sum(want.log_probs), rel=1e-5)
        assert row["perplexity"] == pytest.approx(want.perplexity, rel=1e-5)


def test_generate_answers_the_greedy_continuation_of_each_prompt(server, tiny_bundle):
    status, body = server.post({"inputs": PROMPTS, "params": {"task": "generate", "temperature": 0.0,
                                                              "max_new_tokens": 6}})
    assert status == 200, body
    model = LanguageModel.load(tiny_bundle)
    assert body["predictions"] == [{"prompt": p, "generated": model.generate(p, max_new_tokens=6, temperature=0)}
                                   for p in PROMPTS]


def test_the_int8_onnx_model_is_chosen_by_parameters(server, tiny_bundle):
    status, body = server.post({"inputs": TEXTS[:1], "params": {"backend": "onnx", "int8": True}})
    assert status == 200, body
    expected = LanguageModel.load(tiny_bundle, "onnx", int8=True).score(TEXTS[:1])[0].perplexity
    assert body["predictions"][0]["perplexity"] == pytest.approx(expected, rel=1e-5)


def _too_long(bundle) -> str:
    return "中华人民共和国" * read_bundle(bundle).model.context


BAD_REQUESTS = {
    "empty table": (lambda b: {"dataframe_split": {"columns": ["text"], "data": []}}, r"input: no texts"),
    "empty list": (lambda b: {"inputs": []}, r"input: no texts"),
    "non-string": (lambda b: {"dataframe_split": {"columns": ["text"], "data": [["今天"], [5]]}},
                   r"text 1: 5 is a int, not a string"),
    "null": (lambda b: {"dataframe_records": [{"text": None}]}, r"text 0: missing; every row needs a string"),
    "more than max_batch": (lambda b: {"inputs": ["今天"] * (MAX_BATCH + 1)},
                            rf"input: {MAX_BATCH + 1} texts exceed max_batch {MAX_BATCH}"),
    "too long": (lambda b: {"inputs": [_too_long(b)]},
                 r"text 0: \d+ tokens exceed the model's context of \d+; send a shorter text"),
    "unknown task": (lambda b: {"inputs": ["今天"], "params": {"task": "translate"}},
                     r"params.task: 'translate' is not one of score, generate"),
    "unknown backend": (lambda b: {"inputs": ["今天"], "params": {"backend": "tensorrt"}},
                        r"params.backend: 'tensorrt' is not one of (auto, )?paddle, onnx"),
    "int8 on paddle": (lambda b: {"inputs": ["今天"], "params": {"int8": True}}, r"params.int8: the int8 model is "
                                                                                  r"ONNX"),
    "mistyped parameter": (lambda b: {"inputs": ["今天"], "params": {"max_new_tokens": "many"}},
                           r"^params.max_new_tokens: 'many' is not a long$"),
    "misspelled parameter": (lambda b: {"inputs": ["今天"], "params": {"task": "generate", "temprature": 0}},
                             r"^params: unknown temprature; expected some of task, max_new_tokens, temperature, "),
    "NaN temperature": (lambda b: {"inputs": ["今天"], "params": {"task": "generate", "temperature": float("nan")}},
                        r"^params.temperature: nan is not a finite number$"),
    "max_new_tokens 1e9": (lambda b: {"inputs": ["今天"], "params": {"task": "generate", "max_new_tokens": 10**9}},
                           r"^params.max_new_tokens: 1000000000 is outside 0 to 100000, the limit per prompt "
                           r"\(max_new_tokens\)$"),
    "10 MB text": (lambda b: {"inputs": ["今" * 10_000_000]},
                   rf"^request: over {MAX_BATCH * (SERVING.max_chars * 12 + 64) + 65536} bytes, the most a request "
                   rf"within the limits needs \({MAX_BATCH} texts, max_batch, of {SERVING.max_chars} characters, "
                   r"max_chars\); send fewer or shorter texts$"),
    "text over max_chars": (lambda b: {"inputs": ["今" * (SERVING.max_chars + 1)]},
                            rf"^text 0: {SERVING.max_chars + 1} characters exceed the limit of {SERVING.max_chars} "
                            r"\(max_chars\)"),
    "not JSON": (lambda b: '{"inputs": ["今天"'.encode(),
                 r"^request: not JSON \(Expecting ',' delimiter at line 1 column "),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_400_with_the_message_and_no_traceback(server, tiny_bundle, case):
    body, message = BAD_REQUESTS[case]
    sent = body(tiny_bundle)
    status, answer = _post(server, sent)
    assert status == 400, answer
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE"
    assert re.search(message, answer["message"]), answer["message"][:500]
    assert "Failed to predict" not in answer["message"] and "too_long" not in answer["message"]
    shown = sent.decode() if isinstance(sent, bytes) else json.dumps(sent, ensure_ascii=False)
    assert all(text not in answer["message"] for text in shown.split('"') if len(text) > 20)  # no text sent comes back
    assert len(json.dumps(answer)) < 1000
    assert "Traceback" not in json.dumps(answer) and "stack_trace" not in answer
    assert not re.search(r"(^|[\s'(])/\w+/", answer["message"]), answer["message"]  # no path


def test_the_server_still_answers_after_the_bad_requests(server):
    status, body = server.post({"inputs": TEXTS[:1]})
    assert status == 200 and body["predictions"][0]["tokens"] > 0


def test_scoring_goes_on_while_a_client_asks_for_the_longest_generation(server):
    """8 clients score back to back while another asks for the most new tokens the model allows, again and again
    (each generation ends at an end of document or at the time budget); over-limit requests sent meanwhile are
    refused at once."""
    longest = {"inputs": ["今天"], "params": {"task": "generate", "max_new_tokens": SERVING.max_new_tokens}}
    until = time.monotonic() + SERVING.time_budget_s + 1
    generations: list = []
    latencies: list[float] = []

    def generate() -> None:
        while time.monotonic() < until:
            generations.append(_timed(server, longest))

    def score() -> None:
        while time.monotonic() < until:
            (status, _), seconds = _timed(server, {"inputs": TEXTS[:1]})
            assert status == 200
            latencies.append(seconds)

    threads = [threading.Thread(target=generate)] + [threading.Thread(target=score) for _ in range(8)]
    threads[0].start()
    time.sleep(0.3)  # the generation holds its engine
    for thread in threads[1:]:
        thread.start()
    over = [_timed(server, {**longest, "params": {**longest["params"], "max_new_tokens": 100_001}})
            for _ in range(5)]
    for thread in threads:
        thread.join(timeout=60)
    for (status, answer), seconds in generations:
        assert status == 200 or (status == 503 and re.fullmatch(
            r"generate: stopped at the time budget of 3 s \(time_budget_s\) after \d+ new tokens; ask for fewer "
            r"max_new_tokens or prompts", answer["message"])), answer
        assert seconds < SERVING.time_budget_s + 5
    assert len(latencies) >= 16 and np.percentile(latencies, 99) < 2.0, sorted(latencies)[-5:]
    assert all(status == 400 for (status, _), _ in over)
    assert np.median([seconds for _, seconds in over]) < 0.1, [seconds for _, seconds in over]


def _post(server: ModelServer, body: dict | bytes) -> tuple[int, dict]:
    """``server.post(body)``, or ``body`` sent as it is when it is bytes."""
    if not isinstance(body, bytes):
        return server.post(body)
    request = urllib.request.Request(f"{server.url}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _timed(server: ModelServer, body: dict) -> tuple[tuple[int, dict], float]:
    started = time.perf_counter()
    answer = server.post(body)
    return answer, time.perf_counter() - started
