"""The four findings of issue 38's review, against a real server process: a body that is not JSON (parquet, CSV,
compressed) is refused before it is read, a stalled body is cut off at the read deadline, a header sent twice is a
400, and 200,000 ``[`` or a 10 MB text is a 400 in one line with no traceback in the server's log."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.helpers.serving import AppServer, downloaded, parse_answer, post, raw_request
from train_deploy.registry.model import Limits
from train_deploy.serving.requests import BODY_BUDGET_BYTES

BODY_TIMEOUT_S = 1.0
MOST = Limits().max_request_bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_store, tiny_model) -> Iterator[AppServer]:
    model = downloaded(model_store, tiny_model.model_uri, tmp_path_factory.mktemp("attack_model"))
    served = AppServer(model, model_store, tmp_path_factory.mktemp("attack") / "empty",
                       {"TRAIN_DEPLOY_SERVE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)})
    served.start()
    try:
        yield served
    finally:
        served.stop()


def _head(path: str, length: int, *headers: str) -> str:
    return "\n".join([f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {length}", *headers])


@pytest.mark.parametrize(("content_type", "shown"), [
    ("application/vnd.apache.parquet", "'application/vnd.apache.parquet'"), ("text/csv", "'text/csv'"),
    ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'"), (None, "none")])
def test_a_body_that_is_not_json_is_refused_with_415_before_it_is_read(server, content_type, shown):
    # a parquet file's magic and 543 bytes: the review's body unfolded into 5 GB inside MLflow's parser
    body = b"PAR1" + bytes(535) + b"PAR1"
    headers = [f"Content-Type: {content_type}"] if content_type else []
    for path in ("/invocations", "/v1/completions"):
        status, answer_headers, answer = raw_request(server, _head(path, len(body), *headers), body)
        assert status == 415
        assert answer_headers["connection"] == "close"
        message = f"request: content-type {shown} is not accepted; send application/json"
        assert json.loads(answer) == ({"error_code": "BAD_REQUEST", "message": message} if path == "/invocations"
                                      else {"error": {"message": message, "type": "invalid_request_error",
                                                      "param": None, "code": None}})


def test_a_compressed_body_is_refused_so_the_limits_apply_to_what_is_decoded(server):
    body = b"\x1f\x8b" + bytes(100)
    status, _, answer = raw_request(server, _head("/invocations", len(body), "Content-Type: application/json",
                                                  "Content-Encoding: gzip"), body)
    assert status == 415
    assert json.loads(answer)["message"] == ("request: content-encoding 'gzip' is not accepted; send the body "
                                             "uncompressed")


@pytest.mark.parametrize("header", ["Content-Type", "Content-Length"])
def test_a_header_sent_twice_is_a_400_not_read_two_ways(server, header):
    body = json.dumps({"inputs": ["今天"], "params": {"task": "generate", "temprature": 0}}).encode()
    second = "Content-Type: text/plain" if header == "Content-Type" else f"Content-Length: {len(body)}"
    status, _, answer = raw_request(server, _head("/invocations", len(body), "Content-Type: application/json",
                                                  second), body)
    assert status == 400
    if header == "Content-Type":  # two lengths: the HTTP parser refuses the request before the app sees it
        assert json.loads(answer)["message"] == "request: content-type sent more than once; send it once"


def test_deep_nesting_is_a_400_in_one_line_without_a_traceback_in_the_log(server):
    body = b"[" * 200_000
    before = server.log_text()
    for path in ("/invocations", "/v1/completions"):
        status, _, answer = raw_request(server, _head(path, len(body), "Content-Type: application/json"), body)
        assert status == 400
        message = json.loads(answer)["message"] if path == "/invocations" else json.loads(answer)["error"]["message"]
        assert message == ("request: JSON nested 200000 levels deep, deeper than 32; send the request formats as "
                           "documented")
    time.sleep(0.2)
    logged = server.log_text()[len(before):]
    assert "Traceback" not in logged and "RecursionError" not in logged
    assert logged.count("JSON nested 200000 levels deep") == 2


@pytest.mark.parametrize(("body", "message"), [
    (b'{"inputs": ["\xff"]}', "request: not UTF-8 (byte 13)"),
    (b'{"inputs": ["x"', "request: not JSON (Expecting ',' delimiter at line 1 column 16)")])
def test_a_body_that_does_not_parse_is_a_400_naming_where(server, body, message):
    status, _, answer = raw_request(server, _head("/invocations", len(body), "Content-Type: application/json"), body)
    assert status == 400 and json.loads(answer)["message"] == message


def test_an_oversize_body_is_refused_unparsed_and_the_client_reads_the_answer(server):
    status, _, answer = post(server, "/invocations", {"inputs": ["今" * 10_000_000]})
    assert status == 400
    assert answer["message"] == (f"request: over {MOST} bytes, the most a request within the limits needs (64 texts, "
                                 "max_batch, of 2000 characters, max_chars); send fewer or shorter texts")


def test_stalled_bodies_are_cut_off_at_the_read_deadline(server):
    """20 connections declare 1.6 MB, send 1 MB and stall: each gets a 408 and a closed connection at the read
    deadline, and the server answers others meanwhile."""
    sockets = []
    started = time.monotonic()
    for _ in range(20):
        sock = socket.create_connection((server.host, server.port), timeout=10)
        sock.sendall((_head("/invocations", MOST, "Content-Type: application/json").replace("\n", "\r\n")
                      + "\r\n\r\n").encode() + b'{"inputs": ["' + b"x" * 1_000_000)
        sockets.append(sock)
    status, _, _ = post(server, "/invocations", {"inputs": ["今天"]})
    assert status == 200
    for sock in sockets:
        data = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            data += chunk
        sock.close()
        status, headers, answer = parse_answer(data)
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(answer)["message"].startswith("request: the body did not arrive within the read deadline")
    assert time.monotonic() - started < BODY_TIMEOUT_S + 3


def _stalled(server, count: int) -> list[socket.socket]:
    """``count`` connections that declare the largest body the limits allow, send 1 MB of it and stall."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((server.host, server.port), timeout=10)
        sock.sendall((_head("/invocations", MOST, "Content-Type: application/json").replace("\n", "\r\n")
                      + "\r\n\r\n").encode() + b'{"inputs": ["' + b"x" * 1_000_000)
        sockets.append(sock)
    return sockets


def test_large_bodies_beyond_what_the_server_holds_at_once_are_read_dropped_and_answered_429(server):
    """Stalled large bodies hold at most BODY_BUDGET_BYTES (16 MiB: 10 of 1.6 MB); a further large body is read
    and dropped, then answered 429 with Retry-After, while small requests are answered as usual."""
    assert BODY_BUDGET_BYTES - 10 * MOST < 800_000
    held = BODY_BUDGET_BYTES // MOST
    assert held == 10
    sockets = _stalled(server, held)
    time.sleep(0.3)  # their bodies are being read
    body = b'{"inputs": ["\xe4\xbb\x8a\xe5\xa4\xa9"]' + b" " * 800_000 + b"}"  # beyond what the 10 leave
    head = _head("/invocations", len(body), "Content-Type: application/json")
    status, headers, answer = raw_request(server, head, body)
    assert (status, headers.get("retry-after"), headers.get("connection")) == (429, "1", "close"), answer
    assert json.loads(answer)["message"] == (f"request: the server is reading as many large bodies as it holds at "
                                             f"once ({BODY_BUDGET_BYTES} bytes); retry")
    assert post(server, "/invocations", {"inputs": ["今天"]})[0] == 200
    for sock in sockets:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        sock.close()
        assert parse_answer(data)[0] == 408
    assert raw_request(server, head, body)[0] == 200  # the budget is given back
