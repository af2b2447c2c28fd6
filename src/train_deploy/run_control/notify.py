"""Alerts: one JSON message per run outcome, to webhooks and/or a command (the ``notify`` parameter block).

Outcomes (the message's ``event``): ``failed`` (stage, one-line reason, log path), ``skipped`` (reason),
``promoted`` and ``rejected`` (both scores), ``validation_stopped`` (the data gate's report). A message is a
flat JSON object: ``event``, ``time`` (UTC, ISO 8601), ``host``, ``project`` and the outcome's own fields.

Delivery never decides a run's fate, and never holds a run: a receiver that is down, slow or answers an error is
logged in one line (the webhook named by scheme and host only: its path often carries a token) and the run goes
on. Each delivery has one deadline, all attempts and waits together (:func:`deadline`): it happens in a child
process (``python -m train_deploy.run_control.notify``, the message on its standard input) that ends by then whatever a
receiver does, even one that trickles its answer a byte at a time. A run hands its alert to such a process in a
session of its own (:func:`hand_off`) and does not wait for it; ``train-deploy schedule`` and a run's watch wait
for theirs (:func:`send`), never past the deadline. Every text field is redacted (``train_deploy.redaction``). With
``secret_env`` set, each POST carries ``X-Train-Deploy-Timestamp`` and ``X-Train-Deploy-Signature:
sha256=<hex>``, the HMAC-SHA256 of ``"<timestamp>.<body>"`` under the secret (:func:`verify`).

Promotions also reach anything subscribed to the registered model through MLflow's own registry webhooks
(``model_version_alias.created``; SQL stores behind ``mlflow server``; HMAC-signed by MLflow): see
docs/operations.md.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import functools
import hashlib
import hmac
import http.client
import json
import logging
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field

from train_deploy.config import block, check, from_mapping, setting
from train_deploy.redaction import one_line, redact_value, treat_as_secret

logger = logging.getLogger(__name__)

Event = Literal["failed", "skipped", "promoted", "rejected", "validation_stopped"]
"""A run outcome a message reports (its ``event``)."""
EVENTS: tuple[str, ...] = get_args(Event)
TIMESTAMP_HEADER, SIGNATURE_HEADER = "X-Train-Deploy-Timestamp", "X-Train-Deploy-Signature"
_FROM_ENV = "env:"
_MAX_FIELD = 2000  # characters of one text field a message carries (a reason is one line; a report is short)
_RETRY_WAIT = 1.0  # seconds between two tries of a webhook
_HARD_MARGIN = 3.0  # seconds the delivery process may live past its deadline (start-up, the last thread's join)
MAX_DELIVERY_SECONDS = 600.0
"""The longest one delivery may take, whatever ``attempts`` × ``timeout_seconds`` say."""


@block
class NotifyConfig:
    """The ``notify`` parameter block: who is told of each run's outcome."""

    webhooks: list[str] = field(default_factory=list)
    """URLs (http or https) that each message is POSTed to as JSON, e.g. a chat's incoming webhook; ``env:NAME``
    takes the URL from the environment variable ``NAME`` when the message is sent. Use that form for a URL that
    carries a token: parameters are logged to MLflow, the environment is not."""
    command: str | None = None
    """A command line run with each message as JSON on its standard input (e.g. ``mail -s … team@…``)."""
    events: list[Event] = field(default_factory=lambda: list(EVENTS))
    """The outcomes that are sent: failed, skipped, promoted, rejected, validation_stopped."""
    timeout_seconds: float = setting(10.0, gt=0, unit="seconds")
    """How long one try (one POST, or the command) may wait; a delivery ends by ``attempts`` × this plus a second
    between tries (at most 600 s), whatever the receiver does, and a failure is logged."""
    attempts: int = Field(2, ge=1)
    """Tries of a webhook that cannot be reached or answers 5xx, a second apart."""
    secret_env: str | None = None
    """The name of an environment variable holding a secret: each POST is then HMAC-signed with it (its value,
    like that of an ``env:`` webhook, is redacted from every log line and message)."""

    def __post_init__(self) -> None:
        for i, url in enumerate(self.webhooks):
            if url.startswith(_FROM_ENV):
                check(bool(url.removeprefix(_FROM_ENV).strip()), f"notify.webhooks[{i}]", "env: names no variable")
                continue
            parts = urllib.parse.urlsplit(url)
            check(parts.scheme in ("http", "https") and bool(parts.netloc), f"notify.webhooks[{i}]",
                  f"expected an http(s) URL, got one with scheme {parts.scheme!r}")
        check(self.command is None or bool(shlex.split(self.command)), "notify.command", "is empty")
        treat_as_secret(*(url.removeprefix(_FROM_ENV) for url in self.webhooks if url.startswith(_FROM_ENV)),
                        self.secret_env or "")

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> NotifyConfig:
        return from_mapping(cls, params, "notify")

    @property
    def enabled(self) -> bool:
        return bool(self.webhooks or self.command)


def message(event: str, project: Path | str | None = None, **fields: Any) -> dict[str, Any]:
    """The JSON object sent for ``event``: its fields redacted (``train_deploy.redaction``), long text cut to a
    bounded length."""
    body: dict[str, Any] = {"event": event, "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                            "host": socket.gethostname()}
    if project is not None:
        body["project"] = Path(project).name
    for key, value in redact_value(fields).items():
        body[key] = value[:_MAX_FIELD] if isinstance(value, str) else value
    return body


def deadline(config: NotifyConfig) -> float:
    """Seconds one delivery may take, all of its attempts and the waits between them together (receivers are
    told in parallel), at most :data:`MAX_DELIVERY_SECONDS`."""
    webhook = config.attempts * config.timeout_seconds + (config.attempts - 1) * _RETRY_WAIT
    return min(max(webhook if config.webhooks else 0.0, config.timeout_seconds if config.command else 0.0),
               MAX_DELIVERY_SECONDS)


def send(config: NotifyConfig, body: dict[str, Any]) -> list[str]:
    """Deliver ``body`` to every receiver of ``config`` (when its event is wanted) from a child process that
    cannot outlive :func:`deadline`; return one line per receiver that failed, each also logged. Never raises
    for a receiver's failure, never waits longer than the deadline."""
    if not _wanted(config, body):
        return []
    process = _start(config, body, report=True)
    if process is None:
        failures = ["notify: the delivery process could not start"]
    else:
        try:
            out, _ = process.communicate(timeout=deadline(config) + _HARD_MARGIN + 2.0)
            failures = json.loads(out or b"null") or []
        except subprocess.TimeoutExpired:
            _kill(process)
            failures = [f"notify: the delivery took more than {deadline(config):g} s and was stopped"]
        except ValueError:
            failures = [f"notify: the delivery process ended with status {process.returncode}"]
    for failure in failures:
        logger.warning("Could not notify the %s outcome: %s", body["event"], failure)
    return failures


def hand_off(config: NotifyConfig, body: dict[str, Any], log: Path | None = None) -> subprocess.Popen | None:
    """Deliver ``body`` from a detached child process (its own session; the message on its standard input, no
    secret on its command line) that ends by :func:`deadline` whatever the receivers do, and logs its failures
    into ``log``. Returns at once, with the child (None when nothing is sent): a run never waits on a receiver,
    and the child holds none of the run's files (the run lock)."""
    if not _wanted(config, body):
        return None
    process = _start(config, body, report=False, log=log)
    if process is None:
        logger.warning("Could not notify the %s outcome: the delivery process could not start", body["event"])
    return process


def notify(config: NotifyConfig, event: str, project: Path | str | None = None, **fields: Any) -> list[str]:
    """:func:`message` then :func:`send`: what a caller that may wait for the delivery makes."""
    return send(config, message(event, project, **fields))


def deliver(config: NotifyConfig, body: dict[str, Any]) -> list[str]:
    """Deliver ``body`` in this process, each receiver in a thread of its own: the failures, one line each, by
    :func:`deadline` (a receiver that has not answered by then is one). Threads still blocked on a receiver are
    left behind: the delivery process (:func:`send`, :func:`hand_off`) exits with them."""
    data = json.dumps(body, ensure_ascii=False, sort_keys=True, default=str).encode()
    end = time.monotonic() + deadline(config)
    jobs = [(receiver_name(url) if not url.startswith(_FROM_ENV) else url, functools.partial(_post, config, url,
                                                                                              data, end))
            for url in config.webhooks]
    if config.command:
        jobs.append((f"notify.command {shlex.split(config.command)[0]!r}", functools.partial(_run, config, data)))
    results: list[list[str | None]] = [[] for _ in jobs]
    threads = [threading.Thread(target=_capture, args=(job, out), daemon=True)
               for out, (_, job) in zip(results, jobs, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()) + 0.5)
    return [(out[0] if out else f"{name} gave no complete answer within {deadline(config):g} s")
            for out, (name, _) in zip(results, jobs, strict=True) if not out or out[0]]


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


def _capture(job: Callable[[], str | None], out: list[str | None]) -> None:
    try:
        out.append(job())
    except Exception as exc:  # a bug must not read as a silent receiver
        out.append(f"notify: {one_line(exc)}")


def _post(config: NotifyConfig, url: str, data: bytes, end: float) -> str | None:
    """POST ``data`` to ``url``, tried ``attempts`` times while the monotonic clock is before ``end`` (each socket
    operation waits at most what is left; a receiver that trickles its answer is cut off by the delivery's
    deadline, :func:`deliver`)."""
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
            left = min(config.timeout_seconds, end - time.monotonic())
            with urllib.request.urlopen(request, timeout=max(left, 0.01)) as response:  # noqa: S310
                response.read(1024)
            return None
        except urllib.error.HTTPError as exc:
            failure = f"{receiver_name(url)} answered HTTP {exc.code}"
            if exc.code < 500:
                break
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, unreachable, timed out, bad answer
            failure = f"{receiver_name(url)} unreachable ({type(getattr(exc, 'reason', exc)).__name__})"
        if attempt + 1 < config.attempts and end - time.monotonic() > _RETRY_WAIT:
            time.sleep(_RETRY_WAIT)
        elif attempt + 1 < config.attempts:
            break
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


# --- the delivery process ----------------------------------------------------------------------------------


def _wanted(config: NotifyConfig, body: dict[str, Any]) -> bool:
    return config.enabled and body.get("event") in config.events


def _start(config: NotifyConfig, body: dict[str, Any], *, report: bool,
           log: Path | None = None) -> subprocess.Popen | None:
    """The delivery process (``python -m train_deploy.run_control.notify``), given the message, the settings and where
    its failures go (``report``: standard output, else ``log``, if any) on its standard input; in its own session, so
    that a signal to the run's process group spares it."""
    job = {"config": dataclasses.asdict(config), "body": body, "report": report,
           "log": str(log) if log is not None else None}
    try:
        process = subprocess.Popen([sys.executable, "-m", "train_deploy.run_control.notify"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE if report else subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        return None
    stdin, process.stdin = process.stdin, None  # written and closed here: communicate() leaves it alone
    try:
        assert stdin is not None
        stdin.write(json.dumps(job, ensure_ascii=False, default=str).encode())
    except OSError:  # it died at once: what it says (or not) is read by the caller
        pass
    finally:
        with contextlib.suppress(OSError):
            stdin.close()
    return process


def _kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _delivery_main() -> int:
    """The delivery process: deliver the message read from standard input; end by the deadline whatever happens
    (SIGALRM's default action ends it if delivering itself hangs); the failures go to standard output as JSON,
    or, for a handed-off alert, into the run's log file."""
    job = json.loads(sys.stdin.buffer.read())
    config = NotifyConfig(**job["config"])
    signal.alarm(math.ceil(deadline(config) + _HARD_MARGIN))
    failures = deliver(config, job["body"])
    if job["report"]:
        sys.stdout.write(json.dumps(failures))
        sys.stdout.flush()
    elif job["log"]:
        if failures:
            handler = logging.FileHandler(job["log"], encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            for failure in failures:
                logger.warning("Could not notify the %s outcome: %s", job["body"].get("event"), failure)
            handler.close()
    os._exit(0)  # threads still blocked on a receiver end here


if __name__ == "__main__":
    sys.exit(_delivery_main())
