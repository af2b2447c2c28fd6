"""The server's metrics: what ServerMetrics renders, read back with prometheus_client's own parser, and (with
Debian's prometheus installed) one counter scraped by a real Prometheus and queried back through its HTTP API."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tests.helpers import prometheus
from tests.helpers.asgi import served
from tests.helpers.serving import post
from train_deploy.serving.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.render()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


def _labels(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model": "lm", "version": "7", **labels}.items()))


def test_requests_are_counted_by_route_and_status_with_the_model_as_labels():
    metrics = ServerMetrics("lm", "7")
    metrics.request("/v1/completions", 200, 0.3)
    metrics.request("/v1/completions", 200, 0.02)
    metrics.request("/v1/completions", 429, 0.001)
    samples = _samples(metrics)
    assert samples[("train_deploy_requests_total", _labels(route="/v1/completions", status="200"))] == 2
    assert samples[("train_deploy_requests_total", _labels(route="/v1/completions", status="429"))] == 1
    latency = _labels(route="/v1/completions")
    assert samples[("train_deploy_request_seconds_count", latency)] == 3
    assert samples[("train_deploy_request_seconds_sum", latency)] == 0.321
    assert samples[("train_deploy_request_seconds_bucket", _labels(route="/v1/completions", le="0.025"))] == 2
    assert samples[("train_deploy_request_seconds_bucket", _labels(route="/v1/completions", le="0.25"))] == 2
    assert samples[("train_deploy_request_seconds_bucket", _labels(route="/v1/completions", le="0.5"))] == 3


def test_first_token_batch_size_queue_depth_and_tokens_are_rendered():
    metrics = ServerMetrics("lm", "7")
    metrics.first_token(0.04)
    metrics.batch_size(3)
    metrics.batch_size(16)
    metrics.queue_depth("generate", 5)
    metrics.queue_depth("score", 2)
    metrics.queue_depth("generate", 4)
    metrics.tokens(32)
    metrics.tokens(10)
    samples = _samples(metrics)
    assert samples[("train_deploy_time_to_first_token_seconds_count", _labels())] == 1
    assert samples[("train_deploy_time_to_first_token_seconds_bucket", _labels(le="0.05"))] == 1
    assert samples[("train_deploy_time_to_first_token_seconds_bucket", _labels(le="0.025"))] == 0
    assert samples[("train_deploy_batch_size_bucket", _labels(le="2.0"))] == 0
    assert samples[("train_deploy_batch_size_bucket", _labels(le="4.0"))] == 1
    assert samples[("train_deploy_batch_size_bucket", _labels(le="16.0"))] == 2
    assert samples[("train_deploy_batch_size_sum", _labels())] == 19
    assert samples[("train_deploy_queue_depth", _labels(lane="generate"))] == 4
    assert samples[("train_deploy_queue_depth", _labels(lane="score"))] == 2
    assert samples[("train_deploy_generated_tokens_total", _labels())] == 42


def test_two_servers_in_one_process_keep_their_own_series():
    first, second = ServerMetrics("lm", "1"), ServerMetrics("lm", "2")
    first.tokens(5)
    body, content_type = second.render()
    assert content_type.startswith("text/plain; version=")
    assert b'train_deploy_generated_tokens_total{model="lm",version="2"}' not in body
    assert b'version="1"' not in body
    assert _samples(first)[("train_deploy_generated_tokens_total", (("model", "lm"), ("version", "1")))] == 5


def _metrics_app(metrics: ServerMetrics) -> Starlette:
    """A server that counts its ``/work`` answers in ``metrics`` and serves them at ``/metrics``."""

    async def work(request: Request) -> Response:
        started = time.monotonic()
        answer = PlainTextResponse("done")
        metrics.request("/work", answer.status_code, time.monotonic() - started)
        return answer

    async def scrape(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return Starlette(routes=[Route("/work", work), Route("/metrics", scrape)])


@pytest.mark.skipif(not prometheus.installed(), reason=prometheus.MISSING)
@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_real_prometheus_scrapes_the_request_counter_with_the_models_labels(tmp_path):
    metrics = ServerMetrics("train_deploy_lm", "4")
    with served(_metrics_app(metrics)) as url:
        for _ in range(3):
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}/work", timeout=5) as answer:
                assert answer.read() == b"done"
        with prometheus.scraping(url.split("//")[1], tmp_path / "prometheus") as server:
            result = server.wait_for('train_deploy_requests_total{route="/work"}')
    assert [(item["metric"], item["value"][1]) for item in result] == [(
        {"__name__": "train_deploy_requests_total", "instance": url.split("//")[1], "job": "train_deploy",
         "model": "train_deploy_lm", "version": "4", "route": "/work", "status": "200"}, "3")]



@pytest.mark.slow
@pytest.mark.skipif(not prometheus.installed(), reason=prometheus.MISSING)
def test_a_real_prometheus_scrapes_the_servers_completions_and_tokens(server, tmp_path):
    status, _, answer = post(server, "/v1/completions", {"model": "train_deploy_lm", "prompt": "中国",
                                                         "max_tokens": 5, "temperature": 0})
    assert status == 200, answer
    target = f"{server.host}:{server.port}"
    with prometheus.scraping(target, tmp_path / "prometheus") as scraper:
        requests = scraper.wait_for('train_deploy_requests_total{route="/v1/completions"}')
        tokens = scraper.wait_for("train_deploy_generated_tokens_total")
    labels = {"instance": target, "job": "train_deploy", "model": "train_deploy_lm", "version": "1"}
    assert [(item["metric"], item["value"][1]) for item in requests] == [(
        {"__name__": "train_deploy_requests_total", **labels, "route": "/v1/completions", "status": "200"}, "1")]
    assert [(item["metric"], item["value"][1]) for item in tokens] == [(
        {"__name__": "train_deploy_generated_tokens_total", **labels}, str(answer["usage"]["completion_tokens"]))]
