"""Registry calls against a tracking server that may be away for a while: bounded tries, then one line.

MLflow's own HTTP client retries a refused connection with exponential back-off for minutes
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default 7, factor 2); inside :class:`Retrying` it tries once per call and
this module waits ``retries.wait_seconds`` between ``retries.attempts`` tries, so the stage gives up after a
time the configuration states, naming the server, before it has touched any alias.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar

from train_deploy.environment import scoped_environment
from train_deploy.redaction import redact_uri
from train_deploy.registry.config import RetryConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

# What MLflow's REST client says when the server did not answer, or answered that it cannot now.
_TRANSIENT = re.compile(r"failed with exception .*(Connection|Max retries|timed out|Read timed out)"
                        r"|failed with error code 5\d\d|status code 5\d\d", re.S)
_ONE_TRY = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


class RegistryUnreachable(RuntimeError):
    """The tracking server did not answer within the configured tries; the message names it."""


class RegistryRefused(PermissionError):
    """The tracking server refused a registry call (HTTP 401 or 403: ``status``); the message names the server, the
    call, the account and what to change."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def refused(exc: BaseException, what: str, uri: str) -> RegistryRefused | None:
    """The one-line :class:`RegistryRefused` for ``exc`` when it is the server's 401 or 403, else None."""
    import os

    from mlflow.exceptions import MlflowException

    status = exc.get_http_status_code() if isinstance(exc, MlflowException) else None
    if status not in (401, 403):
        return None
    account = os.environ.get("MLFLOW_TRACKING_USERNAME") or "no credentials"
    if status == 401:
        advice = "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD of an account of that server"
    else:
        advice = ("the account needs READ on the registered model to read it, EDIT to register versions or move "
                  "aliases, and the right to create registered models for a model's first version and the registry "
                  "lock (docs/team-server.md)")
    return RegistryRefused(f"MLflow tracking server {redact_uri(uri)} refused {what} for {account!r} (HTTP {status}): "
                           f"{advice}", status)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the server did not answer, rather than refused the request."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionError | TimeoutError) or type(seen).__name__ in (
                "ConnectionError", "ConnectTimeout", "ReadTimeout", "NewConnectionError", "MaxRetryError"):
            return True
        if _TRANSIENT.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Retrying:
    """Runs registry calls with ``retries.attempts`` tries ``retries.wait_seconds`` apart against ``uri``."""

    def __init__(self, retries: RetryConfig, uri: str) -> None:
        self.retries, self.uri = retries, redact_uri(uri)

    def __call__(self, what: str, call: Callable[[], T]) -> T:
        """``call()``'s result; a transient failure is retried, then raised as :class:`RegistryUnreachable`."""
        attempts = self.retries.attempts
        for attempt in range(1, attempts + 1):
            try:
                with scoped_environment(_ONE_TRY, keep_set=True):  # MLflow's client, one try
                    return call()
            except Exception as exc:
                if not is_transient(exc):
                    if refusal := refused(exc, what, self.uri):
                        raise refusal from None
                    raise
                if attempt == attempts:
                    reason = redact_uri(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
                    raise RegistryUnreachable(
                        f"MLflow tracking server {self.uri} did not answer ({what}) after {attempts} tries "
                        f"{self.retries.wait_seconds:g} s apart; no alias was changed ({reason[:200]})") from None
                logger.warning("MLflow tracking server %s did not answer (%s); try %d of %d in %g s", self.uri, what,
                               attempt + 1, attempts, self.retries.wait_seconds)
                time.sleep(self.retries.wait_seconds)
        raise AssertionError("unreachable")  # the loop returns or raises

    def once(self, call: Callable[[], T]) -> T:
        """``call()`` tried once, MLflow's own retries off too: for a best-effort call after a failure."""
        with scoped_environment(_ONE_TRY, keep_set=True):
            return call()
