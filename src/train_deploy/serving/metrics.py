"""The server's Prometheus metrics (``GET /metrics``): requests by route and status, latency and time to first
token, queue depth per lane, batch size and tokens generated, every series labelled with the served model's name
and version.

The metrics live in their own :class:`prometheus_client.CollectorRegistry`, never the process-wide one, so two
servers (or two tests) in one process never share or collide on a series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds from a request's arrival to its answer: scoring takes milliseconds, a long generation tens of seconds."""
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Sequences in one decode step (the batcher's running batch is at most 16 by default)."""
MODEL_LABELS = ("model", "version")


class ServerMetrics:
    """The metrics of one server for one served model (``model_name``, ``version`` label every series)."""

    def __init__(self, model_name: str, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model = (model_name, version)
        self._requests = Counter("train_deploy_requests", "Requests answered, by route and HTTP status.",
                                 (*MODEL_LABELS, "route", "status"), registry=self.registry)
        self._latency = Histogram("train_deploy_request_seconds", "Seconds from a request's arrival to its answer.",
                                  (*MODEL_LABELS, "route"), buckets=LATENCY_BUCKETS, registry=self.registry)
        self._first_token = Histogram("train_deploy_time_to_first_token_seconds",
                                      "Seconds from a completion's arrival to its first generated token.",
                                      MODEL_LABELS, buckets=FIRST_TOKEN_BUCKETS, registry=self.registry)
        self._queue = Gauge("train_deploy_queue_depth", "Requests waiting in a lane's queue.",
                            (*MODEL_LABELS, "lane"), registry=self.registry)
        self._batch = Histogram("train_deploy_batch_size", "Sequences in each decode step.", MODEL_LABELS,
                                buckets=BATCH_BUCKETS, registry=self.registry)
        self._tokens = Counter("train_deploy_generated_tokens", "Tokens generated.", MODEL_LABELS,
                               registry=self.registry)

    def request(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request and observe its latency (from arrival)."""
        self._requests.labels(*self._model, route, str(status)).inc()
        self._latency.labels(*self._model, route).observe(seconds)

    def first_token(self, seconds: float) -> None:
        """Observe one completion's time to its first token."""
        self._first_token.labels(*self._model).observe(seconds)

    def queue_depth(self, lane: str, depth: int) -> None:
        """Set the number of requests waiting in ``lane``."""
        self._queue.labels(*self._model, lane).set(depth)

    def batch_size(self, size: int) -> None:
        """Observe the sequences in one decode step (the batcher's ``on_step``)."""
        self._batch.labels(*self._model).observe(size)

    def tokens(self, count: int) -> None:
        """Count ``count`` generated tokens."""
        self._tokens.labels(*self._model).inc(count)

    def render(self) -> tuple[bytes, str]:
        """The body and content type of ``GET /metrics`` (Prometheus' text format)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
