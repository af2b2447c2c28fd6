"""``train-deploy serve --follow`` against a real ``mlflow server`` that keeps webhooks: the serving process registers
a signed webhook for alias events, switches at once when ``champion`` moves (the poll interval is 60 s, so only the
webhook explains a switch within seconds), answers a forged delivery 401 and deletes its webhook at shutdown."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
import uuid
from collections.abc import Iterator

import mlflow
import pytest

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer
from tests.mlflow_server import MlflowServer, running_mlflow_server
from tests.serving.conftest import TrackingServerStore, follow_command, request, served_version, wait_for

POLL_S = 60.0
SWITCH_WITHIN_S = 20.0
"""Download, load and check of the tiny model and the webhook's delivery take a few seconds; a poll takes 60."""


class WebhookServer(MlflowServer):
    """An ``mlflow server`` that delivers webhooks to a loopback ``http`` URL, looking its webhooks up afresh each
    second (MLflow's defaults: ``https`` only, public addresses only, a 60 s cache)."""

    def environment(self) -> dict[str, str]:
        return {"MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
                "MLFLOW_WEBHOOK_CACHE_TTL": "1"}


@pytest.fixture
def webhook_server(tmp_path_factory) -> Iterator[WebhookServer]:
    with running_mlflow_server(tmp_path_factory, WebhookServer, "mlflow_webhooks") as server:
        yield server


def _hooks(uri: str) -> list[str]:
    return [hook.url for hook in mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri).list_webhooks()]


def _delivery(version: str, secret: str | None) -> tuple[bytes, dict[str, str]]:
    """An alias event as MLflow sends it, signed under ``secret`` (None: unsigned)."""
    body = json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": "2026-01-01T00:00:00",
                       "data": {"name": REGISTERED_MODEL, "alias": "champion", "version": version}})
    delivery, stamp = str(uuid.uuid4()), str(int(time.time()))
    headers = {"Content-Type": "application/json", "X-MLflow-Delivery-Id": delivery, "X-MLflow-Timestamp": stamp}
    if secret is not None:
        digest = hmac.new(secret.encode(), f"{delivery}.{stamp}.{body}".encode(), hashlib.sha256).digest()
        headers["X-MLflow-Signature"] = "v1," + base64.b64encode(digest).decode()
    return body.encode(), headers


@pytest.mark.slow
def test_the_webhook_switches_at_once_refuses_forged_deliveries_and_is_deleted_at_shutdown(
        webhook_server, tiny_bundle, tmp_path):
    from train_deploy.registry.model import log_bundle_model

    uri = webhook_server.uri
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    with mlflow.start_run(experiment_id=mlflow.set_experiment("webhooks").experiment_id):
        first = log_bundle_model(tiny_bundle, registered_model_name=REGISTERED_MODEL).registered_model_version
    with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name("webhooks").experiment_id):
        second = log_bundle_model(tiny_bundle, registered_model_name=REGISTERED_MODEL).registered_model_version
    client = mlflow.MlflowClient()
    client.set_registered_model_alias(REGISTERED_MODEL, "champion", first)
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", TrackingServerStore(tmp_path, uri),
                         tmp_path / "serve")
    served.command = follow_command(served, copy_project(tmp_path / "project"), poll_s=POLL_S)
    hook_url = f"{served.url}/hooks/mlflow"
    served.start()
    try:
        wait_for(lambda: _hooks(uri) == [hook_url], "the webhook's registration", served, 30)
        assert served_version(served) == str(first)

        body, unsigned = _delivery(str(second), None)
        assert request(served, "POST", "/hooks/mlflow", body, unsigned)[0] == 401
        body, forged = _delivery(str(second), "not-the-secret")
        status, _, answer = request(served, "POST", "/hooks/mlflow", body, forged)
        assert (status, json.loads(answer)["error_code"]) == (401, "BAD_REQUEST")
        assert request(served, "POST", "/hooks/mlflow", body, {**forged, "Content-Type": "text/plain"})[0] == 415
        assert request(served, "POST", "/hooks/mlflow", b"{" * 20000, forged)[0] == 400
        assert served_version(served) == str(first)

        started = time.monotonic()
        client.set_registered_model_alias(REGISTERED_MODEL, "champion", second)
        wait_for(lambda: served_version(served) == str(second), "the switch", served, SWITCH_WITHIN_S)
        assert time.monotonic() - started < SWITCH_WITHIN_S
    finally:
        served.stop()
    log = served.log.read_text(errors="replace")
    assert re.findall(r"Webhook: \S+ moved to version (\d+); looking at the registry now", log) == [str(second)]
    assert f"Serving version {second} of {REGISTERED_MODEL}" in log
    assert "Webhook " in log and " deleted" in log
    assert _hooks(uri) == []


SERVED = {"MLFLOW_TRACKING_URI": "http://tracking:5000", "TRAIN_DEPLOY_SERVE_HOST": "127.0.0.1",
          "TRAIN_DEPLOY_SERVE_PORT": "5001", "TRAIN_DEPLOY_SERVE_WORKERS": "1"}


@pytest.mark.parametrize(("changed", "expected"), [
    ({}, "http://127.0.0.1:5001/hooks/mlflow"),
    ({"TRAIN_DEPLOY_FOLLOW_HOOK_URL": "https://serving.example/hooks/mlflow"}, "https://serving.example/hooks/mlflow"),
    ({"TRAIN_DEPLOY_FOLLOW_HOOK_URL": "off"}, None),
    ({"MLFLOW_TRACKING_URI": "sqlite:///mlruns.db"}, None),  # a local store delivers no webhooks
    ({"TRAIN_DEPLOY_SERVE_WORKERS": "2"}, None),  # a delivery would wake one worker of two
    ({"TRAIN_DEPLOY_SERVE_REPLICAS": "2"}, None),
])
def test_the_webhook_is_used_only_where_one_process_serves_a_tracking_server(changed, expected):
    from train_deploy.serving.webhook import callback_url

    assert callback_url({**SERVED, **changed}) == expected


def test_a_signature_under_another_secret_or_too_old_is_refused():
    from train_deploy.serving.webhook import MAX_AGE_S, signed

    body, headers = _delivery("2", "secret")
    raw = {name.lower().encode(): value.encode() for name, value in headers.items()}
    now = int(headers["X-MLflow-Timestamp"])
    assert signed("secret", raw, body, now)
    assert not signed("other", raw, body, now)
    assert not signed("secret", raw, body + b" ", now)
    assert not signed("secret", raw, body, now + MAX_AGE_S + 1)
    assert not signed("secret", {**raw, b"x-mlflow-delivery-id": b"another"}, body, now)
