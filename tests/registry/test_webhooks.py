"""A promotion by the gate reaches MLflow's own registry webhooks (OSS, SQL store behind ``mlflow server``), signed
with the webhook's secret, at a receiver on 127.0.0.1 (docs/alerts.md)."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from tests.http_receiver import Receiver
from tests.mlflow_server import MlflowServer, free_port
from train_deploy.run_control.notify import verify_mlflow

# MLflow delivers only to public https addresses unless the server is told otherwise: a receiver on the loopback
# interface, over http, needs both (a team's receiver behind https on its network needs neither or the first).
LOOPBACK_DELIVERY = {"MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true", "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https"}


class WebhookServer(MlflowServer):
    def environment(self) -> dict[str, str]:
        return dict(LOOPBACK_DELIVERY)


@pytest.mark.slow
def test_a_promotion_reaches_a_registry_webhook_signed(tmp_path_factory, seed_champion, monkeypatch):
    for key, value in LOOPBACK_DELIVERY.items():  # the client checks the URL as the server does
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    server, receiver = WebhookServer(tmp_path_factory.mktemp("webhook_server"), free_port()), Receiver()
    server.start()
    try:
        client = MlflowClient(server.uri, server.uri)
        client.create_webhook("promotions", receiver.url, ["model_version_alias.created"], secret="w3bh00k")
        seed_champion(server.uri)  # the gate, through the server: the first version becomes champion
        ((headers, body),) = receiver.wait_for(1, timeout=60)
    finally:
        server.stop()
        receiver.close()
    delivery = json.loads(body)
    assert (delivery["entity"], delivery["action"]) == ("model_version_alias", "created")
    assert delivery["data"] == {"name": "train_deploy_lm", "alias": "champion", "version": "1"}
    assert verify_mlflow("w3bh00k", headers, body)
    assert not verify_mlflow("another secret", headers, body)
    assert not verify_mlflow("w3bh00k", headers, body.replace(b'"1"', b'"2"'))
