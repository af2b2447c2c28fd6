"""MLflow's registry webhook for ``serve --follow``: the tracking server tells the serving process at once when an
alias moves, and the follow loop looks at the registry then instead of at its next poll.

MLflow 3 (``mlflow/server/handlers.py``, ``_set_registered_model_alias``) sends ``model_version_alias.created`` to
every active webhook after a ``SetRegisteredModelAlias`` REST call, moving an alias included; a SQL store behind an
``mlflow server`` has webhooks, a local store (``sqlite:///`` or a folder, no server) has none. The server refuses a
webhook URL whose scheme is not in ``MLFLOW_WEBHOOK_ALLOWED_SCHEMES`` (default ``https``) or that resolves to a
private or loopback address unless ``MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true`` (``mlflow/utils/validation.py``,
``_validate_webhook_url``); it looks its webhooks up through a cache of ``MLFLOW_WEBHOOK_CACHE_TTL`` seconds (default
60), so a new webhook may miss the events of its first minute. Delivery is best effort: polling goes on beside it.

Each delivery is signed (``X-MLflow-Signature``: ``v1,`` and the base64 HMAC-SHA256, under the webhook's secret, of
``<delivery id>.<timestamp>.<body>``); :func:`signed` checks it and the timestamp's age. The secret is made here,
once per serving process, and never logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

HOOK_PATH = "/hooks/mlflow"
"""The serving process's route that MLflow's deliveries reach."""
HOOK_URL = "TRAIN_DEPLOY_FOLLOW_HOOK_URL"
"""The URL the tracking server reaches this server's :data:`HOOK_PATH` at, when it is not ``http://<host>:<port>``
of ``train-deploy serve`` (a TLS proxy in front, another name); ``off`` registers no webhook."""
EVENT = "model_version_alias.created"
MAX_HOOK_BYTES = 16384
"""The largest delivery read: an alias event is about 200 bytes."""
DELETE_TIMEOUT_S = 10
"""The longest the webhook's deletion at shutdown waits for the tracking server."""
MAX_AGE_S = 300
"""A delivery signed longer ago than this (or that far in the future) is refused: a replayed one."""


def callback_url(environ: dict[str, str]) -> str | None:
    """Where the tracking server sends deliveries, from ``train-deploy serve``'s settings; None when no webhook can
    be used: a local store, several uvicorn workers or Ray replicas (a delivery would reach one of them only),
    or :data:`HOOK_URL` ``off``."""
    tracking = environ.get("MLFLOW_REGISTRY_URI") or environ.get("MLFLOW_TRACKING_URI", "")
    given = environ.get(HOOK_URL, "").strip()
    if given == "off" or not tracking.startswith(("http://", "https://")):
        return None
    if environ.get("TRAIN_DEPLOY_SERVE_WORKERS", "1") != "1" or "TRAIN_DEPLOY_SERVE_REPLICAS" in environ:
        return None
    if given:
        return given
    host, port = environ.get("TRAIN_DEPLOY_SERVE_HOST"), environ.get("TRAIN_DEPLOY_SERVE_PORT")
    if not host or not port:
        return None
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: the name others reach this host by
        host = socket.getfqdn()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{HOOK_PATH}"


def signed(secret: str, headers: dict[bytes, bytes], body: bytes, now: float | None = None) -> bool:
    """Whether ``body`` carries a valid, recent MLflow signature under ``secret``."""
    delivery = headers.get(b"x-mlflow-delivery-id", b"").decode("latin-1")
    stamp = headers.get(b"x-mlflow-timestamp", b"").decode("latin-1")
    signature = headers.get(b"x-mlflow-signature", b"").decode("latin-1")
    if not delivery or not stamp.isdigit() or not signature.startswith("v1,"):
        return False
    if abs((time.time() if now is None else now) - int(stamp)) > MAX_AGE_S:
        return False
    content = delivery.encode() + b"." + stamp.encode() + b"." + body
    expected = base64.b64encode(hmac.new(secret.encode(), content, hashlib.sha256).digest()).decode()
    return hmac.compare_digest(expected, signature[3:])


def alias_moved(event: Any, name: str, alias: str) -> str | None:
    """The version ``alias`` of ``name`` moved to, if ``event`` (a delivery's JSON) says so."""
    if not isinstance(event, dict) or (event.get("entity"), event.get("action")) != ("model_version_alias",
                                                                                      "created"):
        return None
    data = event.get("data")
    if isinstance(data, dict) and data.get("name") == name and data.get("alias") == alias:
        return str(data.get("version"))
    return None


@dataclass
class AliasHook:
    """This process's webhook on the tracking server: registered at start-up, deleted at shutdown."""

    tracking_uri: str
    url: str
    name: str
    alias: str
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    webhook_id: str | None = None

    @property
    def title(self) -> str:
        # MLflow's webhook names: letters, digits, '.', '_' and '-', under 63 characters, a letter or digit at the ends
        return re.sub(r"[^A-Za-z0-9._-]", "-", f"train-deploy-follow-{os.getpid()}-{self.name}@{self.alias}")[:60] \
            .rstrip("._-")

    def register(self) -> bool:
        """Create the webhook (deleting one a killed server left at the same URL); False, logged, if refused."""
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        try:
            for stale in client.list_webhooks(max_results=100):
                if stale.url == self.url:
                    client.delete_webhook(stale.webhook_id)
            self.webhook_id = client.create_webhook(self.title, self.url, [EVENT], secret=self.secret,
                                                    description=f"train-deploy serve --follow {self.name}@"
                                                                f"{self.alias}").webhook_id
        except Exception as error:  # no webhooks there, or the URL refused: polling alone
            message = getattr(error, "message", str(error)).splitlines()[0][:200] if str(error) else ""
            logger.warning("The tracking server keeps no webhook for this server (%s: %s); polling only",
                           type(error).__name__, message)
            return False
        logger.info("Webhook %s registered: the tracking server posts %s events to %s", self.webhook_id, EVENT,
                    self.url)
        return True

    def delete(self) -> None:
        """Delete the webhook registered (logged if the tracking server does not answer): MLflow's request, sent
        once with a bounded wait, since its client retries a server that is down for minutes and a shutdown
        must not wait that long."""
        if self.webhook_id is None:
            return
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        endpoint = f"/api/2.0/mlflow/webhooks/{self.webhook_id}"
        try:
            verify_rest_response(http_request(get_default_host_creds(self.tracking_uri), endpoint, "DELETE",
                                              max_retries=0, timeout=DELETE_TIMEOUT_S), endpoint)
        except Exception as error:  # the next start at this URL deletes it
            logger.warning("Webhook %s could not be deleted (%s); the next server at %s deletes it",
                           self.webhook_id, type(error).__name__, self.url)
            return
        logger.info("Webhook %s deleted", self.webhook_id)
        self.webhook_id = None

