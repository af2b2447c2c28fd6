"""``mlflow models serve`` of the registered champion: both tasks over HTTP, and HTTP 400 for each bad request."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import mlflow
import pytest

from tests.registry.conftest import REGISTERED_MODEL, ModelServer, ModelStore
from train_deploy.export.runtime import LanguageModel, read_bundle

pytestmark = pytest.mark.slow

MAX_BATCH = 2
TEXTS = ["今天天气很好。", "人民日报社论"]
PROMPTS = ["中国", "今天"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_bundle) -> Iterator[ModelServer]:
    """One server for the module: the tiny bundle registered with ``max_batch`` 2 and aliased ``champion``."""
    store = ModelStore(tmp_path_factory.mktemp("serve_store"))
    info = store.log(tiny_bundle, max_batch=MAX_BATCH, registered_model_name=REGISTERED_MODEL)
    with store.active():
        mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", info.registered_model_version)
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("serve") / "empty")
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
    "mistyped parameter": (lambda b: {"inputs": ["今天"], "params": {"max_new_tokens": "many"}}, r"max_new_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_400_with_the_message_and_no_traceback(server, tiny_bundle, case):
    body, message = BAD_REQUESTS[case]
    status, answer = server.post(body(tiny_bundle))
    assert status == 400, answer
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE"
    assert re.search(message, answer["message"]), answer["message"][:500]
    if case != "mistyped parameter":  # MLflow checks parameter types itself, and its message quotes the input
        assert "Failed to predict" not in answer["message"] and "too_long" not in answer["message"]
        assert all(text not in answer["message"] for text in json.dumps(body(tiny_bundle), ensure_ascii=False)
                   .split('"') if len(text) > 20)  # no text sent comes back
    assert "Traceback" not in json.dumps(answer) and "stack_trace" not in answer


def test_the_server_still_answers_after_the_bad_requests(server):
    status, body = server.post({"inputs": TEXTS[:1]})
    assert status == 200 and body["predictions"][0]["tokens"] > 0
