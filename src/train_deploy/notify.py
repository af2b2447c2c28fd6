"""Alerts: one JSON message per run outcome, to webhooks and/or a command (the ``notify`` parameter block).

Outcomes (the message's ``event``): ``failed`` (stage, one-line reason, log path), ``skipped`` (reason),
``promoted`` and ``rejected`` (both scores), ``validation_stopped`` (the data gate's report). A message is a
flat JSON object: ``event``, ``time`` (UTC, ISO 8601), ``host``, ``project`` and the outcome's own fields.

Delivery never decides a run's fate: a receiver that is down, slow or answers an error is logged in one line
(the webhook named by scheme and host only: its path often carries a token) and the run goes on. With
``secret_env`` set, each POST carries ``X-Train-Deploy-Timestamp`` and ``X-Train-Deploy-Signature:
sha256=<hex>``, the HMAC-SHA256 of ``"<timestamp>.<body>"`` under the secret (:func:`verify`).

Promotions also reach anything subscribed to the registered model through MLflow's own registry webhooks
(``model_version_alias.created``; SQL stores behind ``mlflow server``; HMAC-signed by MLflow): see
docs/operations.md.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train_deploy.config import check, check_range, from_mapping

logger = logging.getLogger(__name__)

EVENTS = ("failed", "skipped", "promoted", "rejected", "validation_stopped")
TIMESTAMP_HEADER, SIGNATURE_HEADER = "X-Train-Deploy-Timestamp", "X-Train-Deploy-Signature"
_FROM_ENV = "env:"
_MAX_FIELD = 2000  # characters of one text field a message carries (a reason is one line; a report is short)


@dataclass(kw_only=True, slots=True)
class NotifyConfig:
    """The ``notify`` parameter block: who is told of each run's outcome."""

    webhooks: list[str] = field(default_factory=list)
    """URLs (http or https) that each message is POSTed to as JSON, e.g. a chat's incoming webhook; ``env:NAME``
    takes the URL from the environment variable ``NAME`` when the message is sent. Use that form for a URL that
    carries a token: parameters are logged to MLflow, the environment is not."""
    command: str | None = None
    """A command line run with each message as JSON on its standard input (e.g. ``mail -s … team@…``)."""
    events: list[str] = field(default_factory=lambda: list(EVENTS))
    """The outcomes that are sent: failed, skipped, promoted, rejected, validation_stopped."""
    timeout_seconds: float = 10.0
    """How long one delivery (one POST or the command) may take before it is given up and logged."""
    attempts: int = 2
    """Tries of a webhook that cannot be reached or answers 5xx, a second apart."""
    secret_env: str | None = None
    """The name of an environment variable holding a secret: each POST is then HMAC-signed with it."""

    def __post_init__(self) -> None:
        for i, url in enumerate(self.webhooks):
            if url.startswith(_FROM_ENV):
                check(bool(url.removeprefix(_FROM_ENV).strip()), f"notify.webhooks[{i}]", "env: names no variable")
                continue
            parts = urllib.parse.urlsplit(url)
            check(parts.scheme in ("http", "https") and bool(parts.netloc), f"notify.webhooks[{i}]",
                  f"expected an http(s) URL, got one with scheme {parts.scheme!r}")
        unknown = sorted(set(self.events) - set(EVENTS))
        check(not unknown, "notify.events", f"unknown event {unknown[:1]} (known: {', '.join(EVENTS)})")
        check_range("notify.timeout_seconds", self.timeout_seconds, 0, open_low=True)
        check_range("notify.attempts", self.attempts, 1)
        check(self.command is None or bool(shlex.split(self.command)), "notify.command", "is empty")

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> NotifyConfig:
        return from_mapping(cls, params, "notify")

    @property
    def enabled(self) -> bool:
        return bool(self.webhooks or self.command)


def message(event: str, project: Path | str | None = None, **fields: Any) -> dict[str, Any]:
    """The JSON object sent for ``event``: its fields, long text cut to a bounded length."""
    body: dict[str, Any] = {"event": event, "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                            "host": socket.gethostname()}
    if project is not None:
        body["project"] = Path(project).name
    for key, value in fields.items():
        body[key] = value[:_MAX_FIELD] if isinstance(value, str) else value
    return body


def send(config: NotifyConfig, body: dict[str, Any]) -> list[str]:
    """Deliver ``body`` to every receiver of ``config`` (when its event is wanted); return one line per receiver
    that failed, each also logged. Never raises for a receiver's failure."""
    if not config.enabled or body.get("event") not in config.events:
        return []
    data = json.dumps(body, ensure_ascii=False, sort_keys=True, default=str).encode()
    failures = [f for url in config.webhooks if (f := _post(config, url, data))]
    if config.command and (failure := _run(config, data)):
        failures.append(failure)
    for failure in failures:
        logger.warning("Could not notify the %s outcome: %s", body["event"], failure)
    return failures


def notify(config: NotifyConfig, event: str, project: Path | str | None = None, **fields: Any) -> list[str]:
    """:func:`message` then :func:`send`: the one call a run's ending makes."""
    return send(config, message(event, project, **fields))


def signature(secret: str, timestamp: str, data: bytes) -> str:
    """The ``X-Train-Deploy-Signature`` value of ``data`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + data, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def verify(secret: str, headers: dict[str, str], data: bytes, max_age: float = 300.0) -> bool:
    """A receiver's check: the signature matches and the timestamp is at most ``max_age`` seconds old."""
    timestamp, sent = headers.get(TIMESTAMP_HEADER, ""), headers.get(SIGNATURE_HEADER, "")
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > max_age:
        return False
    return hmac.compare_digest(sent, signature(secret, timestamp, data))


def verify_mlflow(secret: str, headers: dict[str, str], data: bytes, max_age: float = 300.0) -> bool:
    """A receiver's check of a delivery from MLflow's registry webhooks: ``X-MLflow-Signature`` is ``v1,`` and the
    base64 HMAC-SHA256 of ``"<X-MLflow-Delivery-Id>.<X-MLflow-Timestamp>.<body>"`` under the webhook's secret."""
    delivery, timestamp = headers.get("X-MLflow-Delivery-Id", ""), headers.get("X-MLflow-Timestamp", "")
    if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > max_age:
        return False
    mac = hmac.new(secret.encode(), f"{delivery}.{timestamp}.".encode() + data, hashlib.sha256).digest()
    return hmac.compare_digest(headers.get("X-MLflow-Signature", ""), "v1," + base64.b64encode(mac).decode())


def receiver_name(url: str) -> str:
    """What a log line may say of a webhook: its scheme and host (its path and query may hold a token)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}{f':{parts.port}' if parts.port else ''}"


def _post(config: NotifyConfig, url: str, data: bytes) -> str | None:
    if url.startswith(_FROM_ENV):
        name = url.removeprefix(_FROM_ENV)
        url = os.environ.get(name, "")
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            return f"notify.webhooks: env:{name} holds no http(s) URL"
    headers = {"Content-Type": "application/json", "User-Agent": "train-deploy-notify"}
    secret = os.environ.get(config.secret_env, "") if config.secret_env else ""
    if config.secret_env and not secret:
        return f"{receiver_name(url)}: notify.secret_env names {config.secret_env}, which is not set"
    failure = None
    for attempt in range(config.attempts):
        if secret:
            headers[TIMESTAMP_HEADER] = str(int(time.time()))
            headers[SIGNATURE_HEADER] = signature(secret, headers[TIMESTAMP_HEADER], data)
        try:
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=config.timeout_seconds) as response:  # noqa: S310
                response.read(1024)
            return None
        except urllib.error.HTTPError as exc:
            failure = f"{receiver_name(url)} answered HTTP {exc.code}"
            if exc.code < 500:
                break
        except (OSError, ValueError) as exc:  # refused, unreachable, timed out, bad answer
            failure = f"{receiver_name(url)} unreachable ({type(getattr(exc, 'reason', exc)).__name__})"
        if attempt + 1 < config.attempts:
            time.sleep(1.0)
    return failure


def _run(config: NotifyConfig, data: bytes) -> str | None:
    argv = shlex.split(config.command or "")
    try:
        done = subprocess.run(argv, input=data, capture_output=True, timeout=config.timeout_seconds, check=False)
    except subprocess.TimeoutExpired:
        return f"notify.command {argv[0]!r} took more than {config.timeout_seconds:g} s"
    except OSError as exc:
        return f"notify.command {argv[0]!r} could not start ({exc.strerror})"
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
        return f"notify.command {argv[0]!r} exited {done.returncode}{': ' + last if last else ''}"
    return None
