"""The promotion history of a registered model, kept on the model itself.

Every gate decision and every rollback is an event: a small JSON object (time, event, decision, version, which
versions hold ``champion`` and ``previous`` after it, both numbers, the improvement with its interval and the
evaluation set's size, the baseline rule's figures, the reason). Each is a tag of the registered
model named ``history.<UTC time>``, so the whole history lives with the model on whatever tracking server
holds it and reads back in time order by its key. MLflow's SQL stores keep a registered-model tag value in
5000 characters (``registered_model_tags.value``), so an event's reason is shortened to fit. A gate decision's
event is also in its run, as ``registry/history.jsonl``.

``previous`` always names the version that held ``champion`` just before the current one; how both move (a
promotion, a rollback) is ``train_deploy.registry.aliases``.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

CHAMPION, PREVIOUS = "champion", "previous"
HISTORY_PREFIX = "history."
MAX_EVENT_CHARS = 5000
COLUMNS = (("time", "time (UTC)"), ("event", "event"), ("decision", "decision"), ("version", "version"),
           ("champion", "champion"), ("previous", "previous"), ("candidate", "nats/char"),
           ("champion_value", "champion nats/char"), ("improvement", "improvement"), ("interval", "interval"),
           ("eval_texts", "texts"), ("reason", "reason"))


def alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    """The version ``alias`` points at, or None when the model or the alias does not exist.

    MLflow's basic-auth answers a read of an alias of a registered model that does not exist with HTTP 403 (its
    check finds no model to grant READ on), but a read of the model itself with 404: a 403 here means "no model
    yet" only when the model's own read says it is missing; otherwise the refusal stands."""
    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in exc.message:
            return None
        if exc.get_http_status_code() == 403 and _missing(client, name):
            return None
        raise


def _missing(client: MlflowClient, name: str) -> bool:
    """Whether registered model ``name`` does not exist (a refusal to read it is raised)."""
    try:
        client.get_registered_model(name)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return True
        raise
    return False


def event_key(time: str) -> str:
    """The tag of an event at ISO time ``time``: ``history.20261201T101112.123456Z`` (sorts in time order)."""
    moment = dt.datetime.fromisoformat(time).astimezone(dt.UTC)
    return HISTORY_PREFIX + moment.strftime("%Y%m%dT%H%M%S.%fZ")


def record_event(client: MlflowClient, name: str, event: dict[str, Any]) -> str:
    """Append ``event`` (with an ISO ``time``) to the model's history; returns its tag. The same event recorded
    twice (a retried call) is one entry."""
    value = _fitting(event)
    key = event_key(event["time"])
    client.set_registered_model_tag(name, key, value)
    return key


def read_history(client: MlflowClient, name: str) -> list[dict[str, Any]]:
    """Every event of the model's history, oldest first."""
    tags = client.get_registered_model(name).tags
    events = []
    for key in sorted(k for k in tags if k.startswith(HISTORY_PREFIX)):
        try:
            events.append(json.loads(tags[key]))
        except ValueError:
            events.append({"time": key.removeprefix(HISTORY_PREFIX), "event": "unreadable", "reason": tags[key][:80]})
    return events


def format_table(events: Sequence[dict[str, Any]]) -> str:
    """The events as a plain-text table, one line each, the reason last."""
    header = [title for _, title in COLUMNS]
    rows = [[_cell(event.get(key)) for key, _ in COLUMNS] for event in events]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(COLUMNS) - 1)]
    lines = []
    for row in [header, *rows]:
        lines.append("  ".join([cell.ljust(width) for cell, width in zip(row, widths, strict=False)] + [row[-1]]))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list):  # an interval
        return "[" + ",".join(_cell(bound) for bound in value) + "]"
    text = str(value)
    return text[:19].replace("T", " ") if _is_time(text) else text


def _is_time(text: str) -> bool:
    try:
        dt.datetime.fromisoformat(text)
    except ValueError:
        return False
    return "T" in text


def _fitting(event: dict[str, Any]) -> str:
    """``event`` as JSON within :data:`MAX_EVENT_CHARS`, its reason shortened when needed."""
    value = json.dumps(event, ensure_ascii=False)
    excess = len(value) - MAX_EVENT_CHARS
    if excess > 0:
        reason = str(event.get("reason", ""))
        value = json.dumps({**event, "reason": reason[: max(0, len(reason) - excess - 1)] + "…"}, ensure_ascii=False)
    return value


def who() -> str:
    """Who runs this process: the MLflow account it acts as (``MLFLOW_TRACKING_USERNAME``, where kedro-mlflow puts
    ``server.credentials``' entry too) with the process's ``user@host``, e.g. ``MLflow account 'admin'
    (ops@box)``; ``user@host`` alone without an account (a local store, a token)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    local = f"{user}@{socket.gethostname()}"
    account = os.environ.get("MLFLOW_TRACKING_USERNAME")
    return f"MLflow account {account!r} ({local})" if account else local
