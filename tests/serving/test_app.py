"""The server's routes against a real server process: MLflow's /invocations answers and refusals as today, the
health and identity routes, and what a request over the time budget gets."""

from __future__ import annotations

import re

import pytest

from tests.helpers.serving import post, raw_request
from train_deploy.export.runtime import LanguageModel, read_bundle
from train_deploy.registry.model import Limits

TEXTS = ["今天天气很好。", "人民日报社论"]
PROMPTS = ["中国", "今天"]
LIMITS = Limits()



def test_score_answers_each_texts_log_probability_as_mlflow_does(server, tiny_bundle):
    status, _, body = post(server, "/invocations", {"dataframe_split": {"columns": ["text"],
                                                                        "data": [[t] for t in TEXTS]}})
    assert status == 200, body
    expected = LanguageModel.load(tiny_bundle).score(TEXTS)
    assert [row["text"] for row in body["predictions"]] == TEXTS
    for row, want in zip(body["predictions"], expected, strict=True):
        assert row["tokens"] == len(want.tokens) and row["chars"] == len(want.text)
        assert row["log_prob"] == pytest.approx(sum(want.log_probs), rel=1e-5)
        assert row["perplexity"] == pytest.approx(want.perplexity, rel=1e-5)


@pytest.mark.parametrize("form", ["inputs", "instances", "dataframe_records", "dataframe_split"])
def test_generate_answers_the_greedy_continuation_in_every_input_form(server, tiny_bundle, form):
    inputs = {"inputs": PROMPTS, "instances": PROMPTS, "dataframe_records": [{"text": p} for p in PROMPTS],
              "dataframe_split": {"columns": ["text"], "data": [[p] for p in PROMPTS]}}[form]
    status, _, body = post(server, "/invocations", {form: inputs, "params": {"task": "generate", "temperature": 0.0,
                                                                             "max_new_tokens": 6}})
    assert status == 200, body
    model = LanguageModel.load(tiny_bundle)
    assert body["predictions"] == [{"prompt": p, "generated": model.generate(p, max_new_tokens=6, temperature=0)}
                                   for p in PROMPTS]


BAD_REQUESTS = {
    "empty list": ({"inputs": []}, r"^input: no texts$"),
    "non-string": ({"dataframe_split": {"columns": ["text"], "data": [["今天"], [5]]}},
                   r"^text 1: 5 is a int, not a string$"),
    "null": ({"dataframe_records": [{"text": None}]}, r"^text 0: missing; every row needs a string$"),
    "more than max_batch": ({"inputs": ["今天"] * (LIMITS.max_batch + 1)},
                            rf"^input: {LIMITS.max_batch + 1} texts exceed max_batch {LIMITS.max_batch}; "),
    "misspelled parameter": ({"inputs": ["今天"], "params": {"task": "generate", "temprature": 0}},
                             r"^params: unknown temprature; expected some of task, max_new_tokens, temperature, "),
    "mistyped parameter": ({"inputs": ["今天"], "params": {"max_new_tokens": "many"}},
                           r"^params.max_new_tokens: 'many' is not a long$"),
    "max_new_tokens 1e9": ({"inputs": ["今天"], "params": {"task": "generate", "max_new_tokens": 10**9}},
                           r"^params.max_new_tokens: 1000000000 is outside 0 to 256, the limit per prompt "),
    "text over max_chars": ({"inputs": ["今" * (LIMITS.serving.max_chars + 1)]},
                            rf"^text 0: {LIMITS.serving.max_chars + 1} characters exceed the limit of "),
    "no input": ({"params": {"task": "score"}}, r"^request: expected exactly one of dataframe_split, "),
    "two inputs": ({"inputs": ["a"], "instances": ["b"]}, r"^request: expected exactly one of dataframe_split, "),
    "not an object": (["今天"], r"^request: expected a JSON object with one of dataframe_split, "),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_400_in_mlflows_shape_with_one_line(server, case):
    sent, message = BAD_REQUESTS[case]
    status, _, answer = post(server, "/invocations", sent)
    assert status == 400, answer
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE"
    assert re.search(message, answer["message"]), answer["message"]
    assert set(answer) == {"error_code", "message"} and "\n" not in answer["message"]


def test_a_text_longer_than_the_context_is_refused_naming_the_context(server, tiny_bundle):
    context = read_bundle(tiny_bundle).model.context
    status, _, answer = post(server, "/invocations", {"inputs": ["中华人民共和国" * context]})
    assert status == 400
    assert re.fullmatch(rf"text 0: \d+ tokens exceed the model's context of {context - 1}; send a shorter text",
                        answer["message"])


def test_health_version_and_unknown_routes(server):
    assert raw_request(server, "GET /ping HTTP/1.1\nHost: x\nConnection: close")[0] == 200
    assert raw_request(server, "GET /health HTTP/1.1\nHost: x\nConnection: close")[0] == 200
    status, _, body = raw_request(server, "GET /version HTTP/1.1\nHost: x\nConnection: close")
    assert status == 200 and b'"model": "train_deploy_lm", "version": "1"' in body
    status, _, body = raw_request(server, "GET /nothing HTTP/1.1\nHost: x\nConnection: close")
    assert status == 404 and b"GET /nothing: no such route" in body
    status, _, _ = raw_request(server, "GET /invocations HTTP/1.1\nHost: x\nConnection: close")
    assert status == 405


def test_the_playground_names_the_model_and_a_line_of_its_card(server, tiny_bundle):
    status, headers, body = raw_request(server, "GET / HTTP/1.1\nHost: x\nConnection: close")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    html = body.decode()
    assert "train_deploy_lm" in html and 'fetch("v1/completions"' in html
    assert "Warning: this model does not yet beat the Kneser-Ney trigram baseline" in html  # the tiny card's first


def test_metrics_count_requests_by_route_and_status_with_the_model_as_labels(server):
    post(server, "/invocations", {"inputs": TEXTS[:1]})
    post(server, "/invocations", {"inputs": []})
    status, headers, body = raw_request(server, "GET /metrics HTTP/1.1\nHost: x\nConnection: close")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    for code in ("200", "400"):
        assert re.search(r'^train_deploy_requests_total\{model="train_deploy_lm",route="/invocations",status="'
                         + code + r'",version="1"\} [1-9]', text, re.MULTILINE), text[:3000]
    assert re.search(r'^train_deploy_queue_depth\{lane="score",model="train_deploy_lm",version="1"\} 0\.0$', text,
                     re.MULTILINE), text[:3000]
