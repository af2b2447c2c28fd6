"""Admission control against a real server process: a full lane answers 429 with Retry-After at once, every
request is answered by its deadline counted from arrival, work past its deadline or abandoned by its client is
stopped, and scoring is never queued behind generation."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.helpers.serving import AppServer, downloaded, post, timed

BUDGET_S = 2
QUEUE = 1
# sampled over the whole vocabulary the tiny model writes thousands of tokens before an end of document (about
# 7,000 in 2 s alone): 16 prompts of it, one after the other in a batch of one, run until the deadline
LONGEST = {"inputs": ["中国"] * 16, "params": {"task": "generate", "max_new_tokens": 100_000, "temperature": 1.0,
                                              "top_k": 0}}
SHORT = {"inputs": ["中国"], "params": {"task": "generate", "max_new_tokens": 4, "temperature": 0.0}}
SCORE = {"inputs": ["今天天气很好。"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_store, tiny_model) -> Iterator[AppServer]:
    """The tiny model with a 2 s budget, one generate request in the batch and room for one waiting per lane."""
    model = downloaded(model_store, tiny_model.model_uri, tmp_path_factory.mktemp("admission_model"))
    config = {"time_budget_s": BUDGET_S, "max_new_tokens": 100_000, "max_tokens": 2_000_000}
    served = AppServer(model, model_store, tmp_path_factory.mktemp("admission") / "empty",
                       {"TRAIN_DEPLOY_SERVE_QUEUE": str(QUEUE), "TRAIN_DEPLOY_SERVE_BATCH": "1",
                        "SERVING_MODEL_CONFIG": json.dumps(config)})
    served.start()
    try:
        yield served
    finally:
        served.stop()


def _burst(server: AppServer, count: int, body: dict) -> list[tuple[tuple[int, dict, dict], float]]:
    answers: list = [None] * count

    def one(i: int) -> None:
        answers[i] = timed(post, server, "/invocations", body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # in order: the first runs, the second waits, the rest find the lane full
    for thread in threads:
        thread.join(timeout=30)
    return answers


def test_a_full_lane_answers_429_with_retry_after_at_once_and_every_answer_comes_by_its_deadline(server):
    answers = _burst(server, 6, LONGEST)
    (running, _), (waiting, waited), *refused = answers
    assert running[0] == 503 and re.fullmatch(
        rf"generate: stopped at the time budget of {BUDGET_S} s \(time_budget_s\) after \d+ new tokens; ask for fewer "
        r"max_new_tokens or prompts", running[2]["message"])
    # the second waited for the engine, its budget counted from its arrival, not from when the engine was free
    assert waiting[0] == 503 and re.fullmatch(
        rf"generate: (busy; no generate engine was free within the time budget of {BUDGET_S} s \(time_budget_s\); "
        rf"retry later|stopped at the time budget of {BUDGET_S} s \(time_budget_s\) after \d+ new tokens; .*)",
        waiting[2]["message"])
    assert waited < BUDGET_S + 0.5
    for (status, headers, body), seconds in refused:
        assert status == 429 and body["error_code"] == "RESOURCE_EXHAUSTED"
        assert re.fullmatch(r"generate: the queue is full \(1 requests waiting\); retry after \d+ s", body["message"])
        assert int(headers["retry-after"]) >= 1
        assert seconds < 0.5
    assert all(seconds < BUDGET_S + 0.5 for _, seconds in answers)


def test_work_past_its_deadline_is_stopped_so_the_next_request_is_served_at_once(server):
    _burst(server, 2, LONGEST)
    (status, _, body), seconds = timed(post, server, "/invocations", SHORT)
    assert status == 200 and len(body["predictions"]) == 1
    assert seconds < 0.5


def test_scoring_is_never_queued_behind_generation(server):
    latencies: list[float] = []
    burst = threading.Thread(target=_burst, args=(server, 4, LONGEST))
    burst.start()
    time.sleep(0.3)  # the generate lane is full
    while burst.is_alive():
        (status, _, _), seconds = timed(post, server, "/invocations", SCORE)
        assert status == 200
        latencies.append(seconds)
    assert len(latencies) >= 5 and max(latencies) < 0.5, latencies


def test_a_client_that_goes_away_has_its_generation_stopped(server):
    body = json.dumps(LONGEST).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(f"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)  # generating
    (status, _, _), seconds = timed(post, server, "/invocations", SHORT)
    assert status == 200 and seconds < 0.5  # not BUDGET_S: the abandoned generation was stopped
    time.sleep(0.1)
    assert "POST /invocations: the client went away; its work was stopped" in server.log_text()


LONGEST_COMPLETION = {"model": "train_deploy_lm", "prompt": ["中国"] * 16, "max_tokens": 100_000, "temperature": 1.0}


def test_openais_route_answers_a_full_lane_with_429_in_its_shape(server):
    answers: list = [None] * 4

    def one(i: int) -> None:
        answers[i] = post(server, "/v1/completions", LONGEST_COMPLETION)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=30)
    for status, headers, body in answers[2:]:
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
    status, _, body = answers[0]
    assert status == 503 and re.fullmatch(rf"generate: stopped at the time budget of {BUDGET_S} s \(time_budget_s\) "
                                          r"after \d+ new tokens; .*", body["error"]["message"])


def test_a_stream_that_reaches_the_time_budget_ends_with_an_error_event(server):
    payload = json.dumps({**LONGEST_COMPLETION, "stream": True}).encode()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    events = [line for line in data.decode().replace("\r\n", "\n").split("\n") if line.startswith("data: ")]
    assert data.startswith(b"HTTP/1.1 200") and len(events) > 10
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert re.fullmatch(rf"generate: stopped at the time budget of {BUDGET_S} s \(time_budget_s\) after \d+ new "
                        r"tokens; .*", error["message"])
