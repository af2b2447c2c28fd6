"""The server's ASGI app: MLflow's ``POST /invocations`` and OpenAI's ``POST /v1/completions`` and ``GET /v1/models``
for the logged model in ``$TRAIN_DEPLOY_SERVED_MODEL``, run by uvicorn (``uvicorn --factory
train_deploy.serving.app:create_app``, as ``train-deploy serve`` and the serving check start it).

Every request is timed from its arrival. Its headers are read once (``requests.py``: duplicates are a 400, a body
that is not JSON a 415), its body within the byte limit and a read deadline, its JSON within a nesting depth; then
it is admitted to its task's lane (``admission.py``: a full queue is a 429 with ``Retry-After`` at once) and runs
on that lane's own thread, or, generating on the engine the host runs best, in the batcher's running batch
(``batched.py``). At its deadline (``time_budget_s`` after arrival) it is answered 503 and its work is
stopped; a client that goes away stops its work too. ``/invocations`` answers as MLflow's scoring server does
(``{"predictions": [...]}``, errors as ``{"error_code", "message"}``); the OpenAI routes answer in OpenAI's shapes,
streamed as server-sent events when asked, with the time to the first token logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from train_deploy.export.errors import TooLongError
from train_deploy.handoffs import CARD_FILE
from train_deploy.registry.model import (
    TASKS,
    BundleModel,
    bad_request,
    busy,
    check_tokens,
    input_texts,
    out_of_time,
    request_params,
    unavailable,
)
from train_deploy.serving import batched
from train_deploy.serving import completions as openai
from train_deploy.serving.admission import Cancelled, Expired, Lane, QueueFull, Ticket
from train_deploy.serving.batching import Batcher, Sampling
from train_deploy.serving.metrics import ServerMetrics
from train_deploy.serving.playground import page
from train_deploy.serving.requests import (
    BODY_BUDGET_BYTES,
    BodyBudget,
    ClientGone,
    HttpRefusal,
    RequestHead,
    parse_json,
    read_body,
)

logger = logging.getLogger(__name__)

MODEL_PATH = "TRAIN_DEPLOY_SERVED_MODEL"
"""The environment variable naming the downloaded model's folder (``train_deploy.serve`` sets it)."""
MODEL_NAME, MODEL_VERSION = "TRAIN_DEPLOY_SERVED_NAME", "TRAIN_DEPLOY_SERVED_VERSION"
"""The registered model's name and version, for ``/v1/models``, ``/version`` and the metrics' labels."""
INPUT_KEYS = ("dataframe_split", "dataframe_records", "inputs", "instances")
GRACE_S = 0.5
"""How long past a deadline the server waits for running work to notice it and say how far it got."""
MLFLOW_CODES = {400: "INVALID_PARAMETER_VALUE", 404: "ENDPOINT_NOT_FOUND", 405: "ENDPOINT_NOT_FOUND",
                408: "BAD_REQUEST", 415: "BAD_REQUEST", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL_ERROR",
                503: "TEMPORARILY_UNAVAILABLE"}
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class ServerSettings:
    """How the server admits requests (from the environment ``train-deploy serve`` passes on)."""

    queue: int = 16
    """Requests that may wait in each lane beyond those running (``TRAIN_DEPLOY_SERVE_QUEUE``, 0 to 10000); one
    more is answered 429 at once."""
    body_timeout_s: float = 10.0
    """Seconds a request's body may take to arrive (``TRAIN_DEPLOY_SERVE_BODY_TIMEOUT_S``, over 0 to 600); then
    408 and the connection is closed. A request's time budget bounds it too."""
    batch: int = 16
    """Generate requests decoded together in the running batch (``TRAIN_DEPLOY_SERVE_BATCH``, 1 to 256); more
    wait in the lane's queue."""

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> ServerSettings:
        environ = dict(os.environ if environ is None else environ)
        queue = _setting(environ, "TRAIN_DEPLOY_SERVE_QUEUE", cls.queue, int, 0, 10_000)
        body = _setting(environ, "TRAIN_DEPLOY_SERVE_BODY_TIMEOUT_S", cls.body_timeout_s, float, 0.001, 600)
        batch = _setting(environ, "TRAIN_DEPLOY_SERVE_BATCH", cls.batch, int, 1, 256)
        return cls(queue=int(queue), body_timeout_s=float(body), batch=int(batch))


def _setting(environ: dict[str, str], name: str, default: float, kind: type, low: float, high: float) -> float:
    if name not in environ:
        return default
    try:
        value = kind(environ[name])
    except ValueError:
        raise ValueError(f"{name}: {environ[name][:20]!r} is not a {kind.__name__}") from None
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is outside {low} to {high}")
    return value


@dataclass(frozen=True, slots=True)
class Served:
    """What the server says it serves."""

    name: str
    version: str
    card_line: str = ""
    """One line of the model's card (the first that is not a heading), for the playground."""


def create_app() -> ServingApp:
    """The app for the model in ``$TRAIN_DEPLOY_SERVED_MODEL`` (uvicorn's ``--factory``); MLflow's
    ``SERVING_MODEL_CONFIG`` overrides its logged limits, as under MLflow's server."""
    from mlflow.pyfunc.scoring_server import load_model_with_mlflow_config

    if not logging.getLogger("train_deploy").handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = load_model_with_mlflow_config(os.environ[MODEL_PATH]).unwrap_python_model()
    served = Served(os.environ.get(MODEL_NAME, "train_deploy_lm"), os.environ.get(MODEL_VERSION, "unregistered"),
                    card_line(model.bundle / CARD_FILE))
    return ServingApp(model, served, ServerSettings.from_environment(), ServerMetrics(served.name, served.version))


def card_line(card: Path) -> str:
    """The first line of the model card that is not a heading, without Markdown's quote and emphasis marks."""
    try:
        lines = card.read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    text = next((line for line in lines if line.strip() and not line.startswith("#")), "")
    return text.lstrip("> ").replace("**", "").strip()[:300]


class Exchange:
    """One HTTP request: its scope, arrival time, and ``send`` that records the status answered."""

    def __init__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.scope, self.receive, self._send = scope, receive, send
        self.arrival, self.status, self.started = time.monotonic(), 499, False

    @property
    def openai(self) -> bool:
        return self.scope["path"].startswith("/v1/")

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status, self.started = message["status"], True
        await self._send(message)

    async def answer(self, status: int, body: bytes, content_type: bytes = b"application/json",
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or [])]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def json(self, status: int, value: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.answer(status, json.dumps(value, ensure_ascii=False, default=_plain).encode(), headers=headers)

    async def refuse(self, status: int, message: str, *, param: str | None = None, close: bool = False,
                     retry_after: int | None = None, code: str | None = None) -> None:
        """The error answer in the route's shape (OpenAI's under ``/v1/``, else MLflow's), logged in one line."""
        logger.info("%s %s %d: %s", self.scope["method"], self.scope["path"], status, message)
        headers = [(b"connection", b"close")] if close else []
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        body = (openai.error_body(status, message, param, code) if self.openai else
                {"error_code": MLFLOW_CODES.get(status, "BAD_REQUEST"), "message": message})
        await self.json(status, body, headers)


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers for ``json.dumps``."""
    return value.item() if hasattr(value, "item") else str(value)


class ServingApp:
    """The ASGI app over a loaded :class:`BundleModel` (module docstring), counting into ``metrics``."""

    def __init__(self, model: BundleModel, served: Served, settings: ServerSettings,
                 metrics: ServerMetrics | None = None) -> None:
        self.model, self.served, self.settings, self.metrics = model, served, settings, metrics
        self.limits = model.limits
        self.bodies = BodyBudget(max(BODY_BUDGET_BYTES, self.limits.max_request_bytes))
        on_depth = metrics.queue_depth if metrics is not None else None
        self.lanes = {task: Lane(task, settings.batch if task == "generate" else 1, settings.queue, on_depth)
                      for task in TASKS}
        # the engine the host runs best generates for every request in one batch; a pinned backend runs alone
        self.generator, _ = model.engine("generate")
        self.batcher = Batcher(self.generator, settings.batch, metrics.batch_size if metrics is not None else None)
        self.routes: dict[tuple[str, str], Callable[[Exchange], Awaitable[None]]] = {
            ("GET", "/"): self._playground, ("GET", "/metrics"): self._metrics,
            ("GET", "/ping"): self._ping, ("GET", "/health"): self._ping, ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models, ("POST", "/invocations"): self._invocations,
            ("POST", "/v1/completions"): self._completions}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        exchange = Exchange(scope, receive, send)
        handler = self.routes.get((scope["method"], scope["path"]))
        route = scope["path"] if handler is not None else "other"
        try:
            if handler is None:
                known = any(path == scope["path"] for _, path in self.routes)
                await exchange.refuse(405 if known else 404, f"{scope['method']} {scope['path'][:100]}: "
                                      f"{'method not allowed' if known else 'no such route'}")
            else:
                await self._guarded(exchange, handler)
        finally:
            if self.metrics is not None:
                self.metrics.request(route, exchange.status, time.monotonic() - exchange.arrival)

    async def _guarded(self, exchange: Exchange, handler: Callable[[Exchange], Awaitable[None]]) -> None:
        """``handler``, its refusals answered in one line each (no traceback, path or quoted input)."""
        try:
            await handler(exchange)
        except HttpRefusal as refusal:
            await exchange.refuse(refusal.status, refusal.message, param=refusal.param, close=refusal.close,
                                  retry_after=refusal.retry_after)
        except QueueFull as full:
            await exchange.refuse(429, str(full), retry_after=full.retry_after, code="queue_full")
        except MlflowException as error:
            await exchange.refuse(error.get_http_status_code(), error.message)
        except ClientGone:
            logger.info("%s %s: the client went away; its work was stopped", exchange.scope["method"],
                        exchange.scope["path"])
        except Exception:
            logger.exception("%s %s failed", exchange.scope["method"], exchange.scope["path"])
            if not exchange.started:
                await exchange.refuse(500, "the server failed on this request (its log says why)")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for lane in self.lanes.values():
                    lane.close()
                self.batcher.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _ping(self, exchange: Exchange) -> None:
        await exchange.answer(200, b"\n")

    async def _playground(self, exchange: Exchange) -> None:
        html = page(self.served.name, self.served.version, self.served.card_line)
        await exchange.answer(200, html.encode(), b"text/html; charset=utf-8")

    async def _metrics(self, exchange: Exchange) -> None:
        if self.metrics is None:
            raise HttpRefusal(404, "GET /metrics: this server keeps no metrics")
        body, content_type = self.metrics.render()
        await exchange.answer(200, body, content_type.encode())

    async def _version(self, exchange: Exchange) -> None:
        import train_deploy

        await exchange.json(200, {"model": self.served.name, "version": self.served.version,
                                  "train_deploy": train_deploy.__version__})

    async def _models(self, exchange: Exchange) -> None:
        await exchange.json(200, {"object": "list", "data": [
            {"id": self.served.name, "object": "model", "created": 0, "owned_by": "train_deploy",
             "version": self.served.version}]})

    async def _json_body(self, exchange: Exchange, ticket: Ticket) -> Any:
        """The request's JSON, read within the limits (``requests.py``)."""
        head = RequestHead.of(exchange.scope)
        head.require_json()
        most = self.limits.max_request_bytes
        too_large = (f"request: over {most} bytes, the most a request within the limits needs ({self.limits.max_batch} "
                     f"texts, max_batch, of {self.limits.serving.max_chars} characters, max_chars); send fewer or "
                     "shorter texts")
        deadline = min(ticket.deadline, exchange.arrival + self.settings.body_timeout_s)
        share = self.bodies.take(head.content_length, most)
        try:
            body = await read_body(exchange.receive, most, deadline, too_large, hold=share is not None)
            if share is None:
                raise HttpRefusal(429, f"request: the server is reading as many large bodies as it holds at once "
                                       f"({self.bodies.most} bytes); retry", close=True,
                                  retry_after=math.ceil(self.settings.body_timeout_s))
            return parse_json(body)
        finally:
            if share:
                self.bodies.give(share)

    async def _invocations(self, exchange: Exchange) -> None:
        ticket = Ticket(exchange.arrival, self.limits.serving.time_budget_s)
        texts, settings = self._invocation(await self._json_body(exchange, ticket))
        if settings["task"] == "generate" and settings["backend"] == "auto" and not settings["int8"]:
            await self._generate_batched(exchange, ticket, texts, settings)
            return
        future = self.lanes[settings["task"]].submit(
            ticket, lambda ticket: self.model.answer(texts, settings, ticket.deadline, ticket.stopped))
        frame = await self._outcome(exchange, ticket, future, settings["task"])
        await exchange.json(200, {"predictions": frame.to_dict(orient="records")})

    def _invocation(self, request: Any) -> tuple[list[str], dict[str, Any]]:
        """The texts and checked parameters of an MLflow request body."""
        if not isinstance(request, dict):
            raise bad_request(f"request: expected a JSON object with one of {', '.join(INPUT_KEYS)}")
        unknown = sorted(str(key)[:40] for key in request if key not in (*INPUT_KEYS, "params"))
        found = [key for key in INPUT_KEYS if key in request]
        if unknown or len(found) != 1:
            raise bad_request(f"request: expected exactly one of {', '.join(INPUT_KEYS)}, and params"
                              f"{'; unknown ' + ', '.join(unknown[:3]) if unknown else ''}")
        settings = request_params(request.get("params"), self.limits.serving)
        texts = input_texts(input_values(found[0], request[found[0]]), self.limits.max_batch,
                            allow_empty=settings["task"] == "generate", max_chars=self.limits.serving.max_chars)
        return texts, settings

    async def _outcome(self, exchange: Exchange, ticket: Ticket, future: asyncio.Future, task: str) -> Any:
        """The work's result, or the answer for a request past its deadline (503) or whose client left."""
        watcher = asyncio.ensure_future(_disconnect(exchange.receive))
        try:
            done, _ = await asyncio.wait({future, watcher}, timeout=ticket.left() + GRACE_S,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if future in done:
            try:
                return future.result()
            except Expired:
                raise busy(task, self.limits.serving.time_budget_s) from None
            except Cancelled:
                raise ClientGone from None
        if watcher in done:
            ticket.cancel("cancelled")
            raise ClientGone
        ticket.cancel("deadline")
        raise unavailable(f"{task}: stopped at the time budget of {self.limits.serving.time_budget_s} s "
                          "(time_budget_s); ask for less")

    async def _completions(self, exchange: Exchange) -> None:
        ticket = Ticket(exchange.arrival, self.limits.serving.time_budget_s)
        limits = self.limits
        request = openai.parse_completion(await self._json_body(exchange, ticket), self.served.name,
                                          limits.max_batch, limits.serving.max_chars, limits.serving.max_new_tokens)
        prompt_ids = self._prompt_ids(request)
        prompt_tokens = sum(map(len, prompt_ids))
        sampling = Sampling(request.temperature, 0, request.top_p, request.seed)
        queue, future, _ = batched.start(self.batcher, self.lanes["generate"], ticket, prompt_ids,
                                         request.max_tokens, sampling, self.generator.tokenizer, request.logprobs)
        stream = CompletionStream(exchange, ticket, request, self.served.name, prompt_tokens, self.metrics,
                                  self.generator.tokenizer.decode)
        try:
            await stream.run(queue, future)
        except MlflowException as error:
            if not exchange.started:
                raise
            await stream.error(error.get_http_status_code(), error.message)

    def _prompt_ids(self, request: openai.CompletionRequest) -> list[list[int]]:
        """The prompts as the batcher takes them (``[eos_id, *ids]`` fitted to the context); a 400 for a prompt
        longer than the context or a request over ``max_tokens``."""
        model = self.generator
        encoded = model.tokenizer.encode([model.normalize(text) for text in request.prompts])
        for i, ids in enumerate(encoded):
            if len(ids) + 1 > model.context and model.too_long == "raise":
                raise HttpRefusal(400, f"prompt {i}: {len(ids)} tokens exceed the model's context of "
                                       f"{model.context - 1}; send a shorter prompt", param="prompt")
        tokens = sum(len(ids) + 1 for ids in encoded)
        most = self.limits.serving.max_tokens
        if tokens + len(encoded) * request.max_tokens > most:
            raise HttpRefusal(400, f"prompt: {tokens} tokens, with {request.max_tokens} new per prompt, exceed the "
                                   f"limit of {most} per request (max_tokens); send less", param="prompt")
        return [_fitted(model, ids) for ids in encoded]

    async def _generate_batched(self, exchange: Exchange, ticket: Ticket, texts: list[str],
                                settings: dict[str, Any]) -> None:
        """An /invocations generation through the batcher: the same rows as ``generate_frame`` alone."""
        model, budget = self.generator, self.limits.serving.time_budget_s
        try:
            check_tokens(model, texts, settings, self.limits)
            prompt_ids = [model._fit([model.eos_id, *ids], what=f"text {i}") for i, ids in
                          enumerate(model.tokenizer.encode([model.normalize(text) for text in texts]))]
        except TooLongError as exc:
            raise bad_request(f"{exc.what}: {exc.tokens} tokens exceed the model's context of {exc.context}; "
                              "send a shorter text") from None
        sampling = Sampling(settings["temperature"], settings["top_k"], settings["top_p"], settings["seed"])
        _, future, jobs = batched.start(self.batcher, self.lanes["generate"], ticket, prompt_ids,
                                        settings["max_new_tokens"], sampling, None)
        await self._outcome(exchange, ticket, future, "generate")
        reasons = {job.finish_reason for job in jobs}
        firsts = [job.first_token_s for job in jobs if job.first_token_s is not None]
        if self.metrics is not None:
            self.metrics.tokens(sum(len(job.tokens) for job in jobs))
            if firsts:
                self.metrics.first_token(min(firsts))
        if "deadline" in reasons:
            tokens = sum(len(job.tokens) for job in jobs)
            raise busy("generate", budget) if not tokens else out_of_time(budget, tokens)
        if "error" in reasons:
            raise unavailable("generate: the model failed on this request (the server's log says why)")
        await exchange.json(200, {"predictions": [{"prompt": text, "generated": model.tokenizer.decode(job.tokens)}
                                                  for text, job in zip(texts, jobs, strict=True)]})


def input_values(key: str, value: Any) -> list[Any]:
    """The texts of one of MLflow's request forms (before they are checked): ``dataframe_split``'s and
    ``dataframe_records``' ``text`` column (or only column), ``inputs``/``instances`` as a list (scalars turned
    into strings, as MLflow's parser does for a string column)."""
    if key == "dataframe_split":
        if not isinstance(value, dict) or not isinstance(value.get("data"), list):
            raise bad_request("dataframe_split: expected an object with columns and data")
        columns = value.get("columns") or ["text"]
        if not isinstance(columns, list) or ("text" not in columns and len(columns) != 1):
            shown = ", ".join(map(str, columns))[:80] if isinstance(columns, list) else "none"
            raise bad_request(f"input: no 'text' column among {shown}")
        at = columns.index("text") if "text" in columns else 0
        return [(row[at] if at < len(row) else None) if isinstance(row, list) else row for row in value["data"]]
    if key == "dataframe_records":
        if not isinstance(value, list) or not all(isinstance(row, dict) for row in value):
            raise bad_request("dataframe_records: expected a list of objects")
        return [row.get("text", next(iter(row.values())) if len(row) == 1 else None) for row in value]
    if isinstance(value, dict) and list(value) == ["text"]:
        value = value["text"]
    values = value if isinstance(value, list) else [value]
    return [str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for v in values]


async def _disconnect(receive: Receive) -> None:
    """Return once the client has gone (the body was read already, so the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _fitted(model: Any, ids: list[int]) -> list[int]:
    """``[eos_id, *ids]`` within the context (a prompt longer than it keeps its end, when the bundle truncates)."""
    return model._fit([model.eos_id, *ids], what="prompt")


class CompletionStream:
    """One completion's tokens from the lane to the client: cut at stop sequences, sent as server-sent events
    as they come (``stream``) or as one answer at the end; the time to the first token logged."""

    def __init__(self, exchange: Exchange, ticket: Ticket, request: openai.CompletionRequest, model: str,
                 prompt_tokens: int, metrics: Any, decode: Callable[[list[int]], str]) -> None:
        self.exchange, self.ticket, self.request, self.model = exchange, ticket, request, model
        self.prompt_tokens, self.metrics = prompt_tokens, metrics
        self.ident = openai.completion_id()
        self.texts = [openai.StopText(request.stop) for _ in request.prompts]
        self.logprobs = [openai.Logprobs(decode) for _ in request.prompts] if request.logprobs is not None else None
        self.first_token_s: float | None = None

    async def run(self, queue: asyncio.Queue, future: asyncio.Future) -> None:
        watcher = asyncio.ensure_future(_disconnect(self.exchange.receive))
        try:
            while (event := await self._next(queue, watcher)) is not None:
                await self._token(event)
        finally:
            watcher.cancel()
        try:
            counts = future.result()
        except Expired:
            raise busy("generate", self.ticket_budget) from None
        except Cancelled:
            raise ClientGone from None
        if self.ticket.reason == "deadline" or (self.ticket.expired() and self.ticket.reason is None):
            raise out_of_time(self.ticket_budget, sum(counts))
        await self._finish(counts)

    @property
    def ticket_budget(self) -> int:
        return round(self.ticket.deadline - self.ticket.arrival)

    async def _next(self, queue: asyncio.Queue, watcher: asyncio.Future) -> Any:
        if not queue.empty() and not watcher.done():  # tokens that came together: no wait (a task, a timer) each
            return queue.get_nowait()
        getter = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({getter, watcher}, timeout=self.ticket.left() + GRACE_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        if watcher in done:
            self.ticket.cancel("cancelled")
            raise ClientGone
        self.ticket.cancel("deadline")
        raise out_of_time(self.ticket_budget, 0)

    async def _token(self, event: Any) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.exchange.arrival
            logger.info("completion %s: first token after %.3f s (%d prompts, stream %s)", self.ident,
                        self.first_token_s, len(self.request.prompts), self.request.stream)
            if self.metrics is not None:
                self.metrics.first_token(self.first_token_s)
        text = self.texts[event.sequence]
        piece = text.add(event.text)
        if self.logprobs is not None and event.logprob is not None:
            self.logprobs[event.sequence].add(event.token, event.text, event.logprob)
        if all(t.stopped for t in self.texts):
            self.ticket.cancel("stop")
        if piece and self.request.stream:
            logprobs = None if self.logprobs is None else self.logprobs[event.sequence].release(text.sent)
            await self._send(openai.chunk(self.ident, self.model, event.sequence, piece, None, logprobs))

    async def _finish(self, counts: list[int]) -> None:
        reasons = ["stop" if text.stopped or count < self.request.max_tokens else "length"
                   for text, count in zip(self.texts, counts, strict=True)]
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": sum(counts),
                 "total_tokens": self.prompt_tokens + sum(counts)}
        if self.metrics is not None:
            self.metrics.tokens(sum(counts))
        if not self.request.stream:
            texts = [text.text for text in self.texts]
            await self.exchange.json(200, openai.completion(self.ident, self.model, texts, reasons, usage,
                                                            self._logprobs_rest()))
            return
        rests = self._logprobs_rest()
        for i, (text, reason) in enumerate(zip(self.texts, reasons, strict=True)):
            await self._send(openai.chunk(self.ident, self.model, i, text.flush(), reason,
                                          None if rests is None else rests[i]))
        if self.request.include_usage:
            await self._send(openai.usage_chunk(self.ident, self.model, usage))
        await self._send(openai.DONE, last=True)

    def _logprobs_rest(self) -> list[dict[str, list[Any]]] | None:
        """Each sequence's logprobs not yet sent: those of the tokens that begin within its text (a stop sequence
        cuts the text; the token it begins in is the last)."""
        if self.logprobs is None:
            return None
        return [logprobs.rest(len(text.text) if text.stopped else None)
                for logprobs, text in zip(self.logprobs, self.texts, strict=True)]

    async def error(self, status: int, message: str) -> None:
        """An error after the stream began: one event in OpenAI's error shape, then the end of the stream."""
        logger.info("completion %s: %s", self.ident, message)
        await self._send(openai.event(openai.error_body(status, message)))
        await self._send(openai.DONE, last=True)

    async def _send(self, data: bytes, last: bool = False) -> None:
        if not self.exchange.started:
            await self.exchange.send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
        await self.exchange.send({"type": "http.response.body", "body": data, "more_body": not last})
