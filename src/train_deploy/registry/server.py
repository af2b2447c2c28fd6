"""``train-deploy serve``'s HTTP server: MLflow's scoring server for the logged model, behind a guard that refuses
what MLflow would drop, echo or parse at length.

MLflow 3's scoring server (``mlflow/pyfunc/scoring_server/__init__.py``, ``init``) is a FastAPI app that uvicorn
runs (``mlflow models serve --workers N``: N processes, each loading the model). ``/invocations`` reads the whole
body, then runs ``invocations()`` in asyncio's default thread pool (``asyncio.to_thread``): it parses the JSON and
calls ``PyFuncModel.predict`` from that thread, so requests reach the model concurrently; a middleware answers 504
after ``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT`` (60 s) while the thread runs on. Before the model sees a request,
``PyFuncModel._predict`` → ``_validate_prediction_input`` → ``mlflow.models.utils._enforce_params_schema`` keeps
only the parameters the signature's ``ParamSchema`` names (with no schema, none), so under plain ``mlflow models
serve`` no model can refuse a misspelled parameter: it never sees it. MLflow's own refusals (invalid JSON, a
mistyped parameter, a schema mismatch) quote the request: ``Failed to predict data '<the input>'``.

:func:`create_app` builds that same app for the same model and puts :class:`RequestGuard` in front of it. The
guard reads ``POST /invocations`` bodies up to the most a request within the model's limits can need
(:attr:`~train_deploy.registry.model.Limits.max_request_bytes`) and refuses a larger one unparsed; checks the
JSON's ``params`` with the model's own :func:`~train_deploy.registry.model.request_params` (unknown names, types,
ranges, ``max_new_tokens``) before MLflow drops or converts any; and strips MLflow's error answers of stack traces
and quoted input. ``train-deploy serve`` runs it with the package logged with the model first on ``sys.path``
(uvicorn's ``--app-dir``), so the server, the model and its limits are the logged version's code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from mlflow.exceptions import MlflowException

from train_deploy.registry.model import Limits, bad_request, request_params

MODEL_PATH = "TRAIN_DEPLOY_SERVED_MODEL"
"""The environment variable naming the downloaded model's folder (``train_deploy.serve`` sets it)."""
DRAIN_BYTES = 2**30
"""A body over the limit is read on (and dropped, never held) up to this much more, so that a client that sends its
whole body before reading the answer gets the refusal, not a reset connection; past that the connection closes."""
LONGEST_MESSAGE = 1000
"""An error message from MLflow longer than this quotes the request: it is replaced."""

QUOTING = ("Failed to predict data '", "Failed to enforce schema of data '")
"""How MLflow's messages that quote the request start (``scoring_server.invocations``, ``pyfunc``'s schema check)."""

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def create_app() -> RequestGuard:
    """MLflow's scoring app for the model in ``$TRAIN_DEPLOY_SERVED_MODEL``, behind :class:`RequestGuard` (uvicorn's
    ``--factory``). MLflow's request timeout defaults to the model's time budget plus 30 s."""
    from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT
    from mlflow.pyfunc import scoring_server

    model = scoring_server.load_model_with_mlflow_config(os.environ[MODEL_PATH])
    limits: Limits = model.unwrap_python_model().limits
    os.environ.setdefault(MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.name, str(limits.serving.time_budget_s + 30))
    return RequestGuard(scoring_server.init(model), limits)


class RequestGuard:
    """An ASGI app in front of MLflow's: ``POST /invocations`` is read within :attr:`Limits.max_request_bytes` and
    its parameters checked before MLflow sees it; MLflow's error answers lose stack traces and quoted input."""

    def __init__(self, app: Callable[..., Awaitable[None]], limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/invocations":
            await self.app(scope, receive, send)
            return
        most = self.limits.max_request_bytes
        body = await _read_body(receive, most)
        if body is None:
            await _send_error(send, bad_request(
                f"request: over {most} bytes, the most a request within the limits needs ({self.limits.max_batch} "
                f"texts, max_batch, of {self.limits.serving.max_chars} characters, max_chars); send fewer or "
                "shorter texts"))
            return
        headers = dict(scope.get("headers") or [])
        if headers.get(b"content-type", b"").split(b";")[0].strip() == b"application/json":
            try:
                _check_json(body, self.limits)
            except MlflowException as refusal:
                await _send_error(send, refusal)
                return
        await self.app(scope, _replay(body, receive), _scrubbed(send))


def _check_json(body: bytes, limits: Limits) -> None:
    """Raise :func:`bad_request` for a body that is not JSON or whose ``params`` the model would refuse."""
    try:
        request = json.loads(body)
    except UnicodeDecodeError as exc:
        raise bad_request(f"request: not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"request: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if isinstance(request, dict) and "params" in request:
        request_params(request["params"], limits.serving)


async def _read_body(receive: Receive, most: int) -> bytes | None:
    """The request's body, or None when it is longer than ``most`` bytes (read on up to :data:`DRAIN_BYTES` more
    and dropped, so the client, still sending, reads the refusal)."""
    chunks: list[bytes] | None = []
    size, more = 0, True
    while more and size <= most + DRAIN_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if chunks is not None and size <= most:
            chunks.append(chunk)
        else:
            chunks = None
    return None if chunks is None else b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app behind: the body read already, then the client's own messages (a disconnect)."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _send_error(send: Send, error: MlflowException) -> None:
    """MLflow's error answer for ``error``: its JSON and HTTP status."""
    await _send_json(send, error.get_http_status_code(), error.serialize_as_json().encode())


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _scrubbed(send: Send) -> Send:
    """``send`` that passes a success through and holds an error answer (status 400 or more) until it is whole,
    then sends it without a stack trace and without quoted input (:func:`scrub`)."""
    held: dict[str, Any] = {}

    async def scrubbing(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held.update(status=message["status"], headers=message.get("headers", []), chunks=[])
            return
        if not held or message["type"] != "http.response.body":
            await send(message)
            return
        held["chunks"].append(message.get("body", b""))
        if not message.get("more_body", False):
            body = scrub(b"".join(held["chunks"]))
            headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
            await send({"type": "http.response.start", "status": held["status"],
                        "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})

    return scrubbing


def scrub(body: bytes) -> bytes:
    """An error answer of MLflow's without ``stack_trace``, its message without the quoted request (after a
    :data:`QUOTING` start, only the part after the last ``Error:``), and a message still over
    :data:`LONGEST_MESSAGE` characters replaced by its length."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body if len(body) <= LONGEST_MESSAGE else b"the answer quoted the request; not repeated here"
    if not isinstance(answer, dict):
        return body
    answer.pop("stack_trace", None)
    message = str(answer.get("message", ""))
    if message.startswith(QUOTING):
        message = message.rpartition("Error: ")[2]
    if len(message) > LONGEST_MESSAGE:
        message = f"refused; the reason quoted the request ({len(message)} characters), not repeated here"
    answer["message"] = message
    return json.dumps(answer).encode()
