"""One redaction for every path out of the process: no credential reaches a console, a log, an alert, an MLflow
tag or parameter, or a model card.

:func:`redact` takes out of a text

- a URI's ``user:password@`` (``http://alice:S3cret@host`` becomes ``http://host``),
- the value of a ``password=…``/``token=…`` pair (a PostgreSQL DSN, a query string) and of an HTTP
  ``Authorization`` header,
- the value of every secret environment variable the project reads (:data:`SECRET_VARIABLES`, any variable whose
  name says it holds a password, token, secret or key, and those named by :func:`treat_as_secret`: the alerts'
  ``secret_env`` and ``env:`` webhooks), and the password of any URL held by an environment variable
  (``MLFLOW_TRACKING_URI=http://alice:S3cret@…``), also percent-decoded.

The process's exits go through it once installed: :func:`redact_logging` (every log record, its traceback
included, before any handler sees it: the console's rich handler, the plain one, the log file),
:func:`redact_streams` (``sys.stdout``/``sys.stderr`` writes, such as MLflow's "View run … at: <uri>", and the
traceback of an uncaught exception, which Kedro has rich print) and :func:`redact_mlflow` (the tags and parameters
the MLflow client sends). Alerts redact their message (``train_deploy.run_control.notify``) and the model card its text.

Ground floor (imports nothing of the project): training's metrics forwarder and launcher, the registry's retries
and command line, the preflight checks and the server all show tracking URIs through :func:`redact_uri`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import traceback
import urllib.parse
from collections.abc import Callable
from typing import Any

HIDDEN = "***"
"""What a secret value is replaced with."""
SECRET_VARIABLES = frozenset({
    "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_CLIENT_CERT_PASSWORD", "PGPASSWORD",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_CONNECTION_STRING",
    "DATABRICKS_TOKEN", "HF_TOKEN", "MLFLOW_WEBHOOK_SECRET",
})
"""Environment variables the project (MLflow's client, its artifact stores, PostgreSQL) reads a secret from."""
MIN_SECRET = 6
"""Shorter environment values are not hunted for in texts (a ``1`` or ``true`` would blank every digit)."""

_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_URL_PASSWORD = re.compile(r"://[^/:@\s]*:([^/@\s]+)@")
_SECRET_NAME = re.compile(r"PASSWORD|PASSWD|TOKEN|SECRET|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.I)
_PAIRS = re.compile(r"(?i)\b(password|passwd|pwd|token|access_token|secret|api_?key)(['\"]?\s*[=:]\s*['\"]?)"
                    r"(?!\*\*\*)([^\s'\"&;,)]+)")
_AUTHORIZATION = re.compile(r"(?i)\b(authorization['\"]?\s*[=:]\s*['\"]?(?:basic|bearer|token)?\s*)([^\s'\"]+)")
_named: set[str] = set()


def redact_uri(text: str) -> str:
    """``text`` (a URI, or a message holding URIs) without the ``user:password@`` of its URIs."""
    return _USERINFO.sub("", text)


def treat_as_secret(*names: str) -> None:
    """The environment variables ``names`` hold secrets: their values are redacted from now on in this process."""
    _named.update(name for name in names if name)


def secret_values() -> list[str]:
    """The secret values of this process's environment now, longest first (so a value inside another goes too)."""
    found: set[str] = set()
    for name, value in os.environ.items():
        if name in SECRET_VARIABLES or name in _named or _SECRET_NAME.search(name):
            found.add(value)
        for password in _URL_PASSWORD.findall(value):
            found.update((password, urllib.parse.unquote(password)))
    return sorted((v for v in found if len(v) >= MIN_SECRET), key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` without credentials: URIs' ``user:password@``, ``password=…`` pairs, ``Authorization`` values and
    the values of the secret environment variables (each replaced by :data:`HIDDEN`)."""
    if not text:
        return text
    text = _AUTHORIZATION.sub(rf"\1{HIDDEN}", _PAIRS.sub(rf"\1\2{HIDDEN}", redact_uri(text)))
    for value in secret_values():
        text = text.replace(value, HIDDEN)
    return text


def redact_value(value: Any) -> Any:
    """``value`` with every string in it redacted (dicts, lists and tuples walked; other values as they are)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_value(item) for item in value)
    return value


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type when it has none), redacted, at most 300 characters: what an
    alert, a gate's reason and a warning say of an error."""
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__)[:300]


def redacted_traceback(kind: type[BaseException] | None, value: BaseException | None, tb: Any) -> str:
    """The traceback Python would print for the exception, redacted."""
    return redact("".join(traceback.format_exception(kind, value, tb)))


# --- the process's exits -----------------------------------------------------------------------------------


def redact_logging() -> None:
    """Every log record is redacted as it is made, before any handler or filter sees it (idempotent): its message,
    and its traceback when that holds a secret (then kept as text, which every handler prints as it is)."""
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "redacts", False):
        logging.setLogRecordFactory(_redacting_factory(factory))


def _redacting_factory(previous: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    @functools.wraps(previous)
    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format: logging reports it itself when the record is handled
            return record
        if (clean := redact(message)) != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[0] is not None:
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            if (clean := redact(text)) != text:
                record.exc_info, record.exc_text = None, clean
                record.markup = False  # rich would read brackets in a traceback as its markup
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return record

    factory.redacts = True  # type: ignore[attr-defined]
    return factory


class RedactingStream:
    """A text stream whose writes are redacted (everything else is the wrapped stream's)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text) if isinstance(text, str) else text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def redact_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` redact what is written to them, and an uncaught exception's traceback
    (in any thread) is printed redacted: plain, as Python prints it, when it holds a secret, else by the hook that
    was there (Kedro's rich one). Idempotent; call it again after something replaced a stream or the hook."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
    if not getattr(sys.excepthook, "redacts", False):
        sys.excepthook = _redacting_excepthook(sys.excepthook)
    if not getattr(threading.excepthook, "redacts", False):
        threading.excepthook = _redacting_thread_hook(threading.excepthook)


def _redacting_excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        if (clean := redact(text)) == text:
            previous(kind, value, tb)
        else:
            sys.stderr.write(clean)

    excepthook.redacts = True  # type: ignore[attr-defined]
    return excepthook


def _redacting_thread_hook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(args: Any) -> None:
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        if (clean := redact(text)) == text:
            previous(args)
        else:
            name = args.thread.name if args.thread is not None else "?"
            sys.stderr.write(f"Exception in thread {name}:\n{clean}")

    excepthook.redacts = True  # type: ignore[attr-defined]
    return excepthook


def redact_mlflow() -> None:
    """The MLflow client sends the tags and parameters of runs, registered models and versions redacted (its
    tracking service and registry clients, under every fluent and client call; idempotent)."""
    from mlflow.entities import Param, RunTag
    from mlflow.tracking._model_registry.client import ModelRegistryClient
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    def wrap(cls: type, name: str, clean: Callable[[tuple, dict], tuple[tuple, dict]]) -> None:
        method = getattr(cls, name)
        if getattr(method, "redacts", False):
            return

        @functools.wraps(method)
        def redacted(self: Any, *args: Any, **kwargs: Any) -> Any:
            args, kwargs = clean(args, kwargs)
            return method(self, *args, **kwargs)

        redacted.redacts = True  # type: ignore[attr-defined]
        setattr(cls, name, redacted)

    def value_at(index: int, key: str) -> Callable[[tuple, dict], tuple[tuple, dict]]:
        def clean(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if key in kwargs:
                return args, {**kwargs, key: _redact_text(kwargs[key])}
            if len(args) > index:
                return (*args[:index], _redact_text(args[index]), *args[index + 1:]), kwargs
            return args, kwargs
        return clean

    def batch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        names = ("run_id", "metrics", "params", "tags", "synchronous")
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        given["params"] = [Param(p.key, redact(str(p.value))) for p in given.get("params") or []]
        given["tags"] = [RunTag(t.key, redact(str(t.value))) for t in given.get("tags") or []]
        return (), given

    def run_tags(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        names = ("experiment_id", "start_time", "tags", "run_name")  # MlflowClient passes them all by position
        args, kwargs = (), {**dict(zip(names, args, strict=False)), **kwargs}
        if kwargs.get("tags"):
            kwargs = {**kwargs, "tags": {key: _redact_text(value) for key, value in kwargs["tags"].items()}}
        return args, kwargs

    wrap(TrackingServiceClient, "log_param", value_at(2, "value"))
    wrap(TrackingServiceClient, "set_tag", value_at(2, "value"))
    wrap(TrackingServiceClient, "log_batch", batch)
    wrap(TrackingServiceClient, "create_run", run_tags)
    wrap(ModelRegistryClient, "set_model_version_tag", value_at(3, "value"))
    wrap(ModelRegistryClient, "set_registered_model_tag", value_at(2, "value"))


def _redact_text(value: Any) -> Any:
    return redact(value) if isinstance(value, str) else value
