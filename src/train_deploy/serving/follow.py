"""``train-deploy serve --follow``: the server keeps answering while it watches the alias it serves, and takes the
version the alias moves to once that version has proved itself, without a failed request.

``uvicorn --factory train_deploy.serving.follow:create_app`` (as :func:`train_deploy.serve.serve` starts it) serves
the downloaded version in ``$TRAIN_DEPLOY_SERVED_MODEL`` with the app of ``serving/app.py``, wrapped in a
:class:`FollowingApp`. Every ``TRAIN_DEPLOY_FOLLOW_POLL_S`` seconds it asks the registry (``MLFLOW_REGISTRY_URI``)
which version ``TRAIN_DEPLOY_FOLLOW_ALIAS`` names. When the registry is an ``mlflow server`` that keeps webhooks and
one uvicorn worker serves, the server also registers an MLflow webhook for alias events (``serving/webhook.py``), at
the first look the registry answers, whose deliveries reach ``POST /hooks/mlflow`` here: a signed one for the alias
followed makes it look at the registry at once; an unsigned or wrongly signed one is a 401. Delivery is best effort,
so polling goes on beside it; the webhook is deleted at shutdown.

When the alias names another version, that version is downloaded into the per-version cache (``serve.cached_model``:
hashes recorded at download, a damaged copy downloaded again, a restart downloads nothing), its bundle checked against
the hashes ``bundle.json`` records, loaded into a second app, and asked one score and one generate request in this
process, while the old app keeps answering. Only then is the served app swapped, in one assignment on the event
loop: a request runs to its end on the app it arrived at, new ones go to the new app, and the old app's lanes and
batcher are closed once its last request has finished. A version that fails any step is refused: one ERROR line
naming it and why, ``train_deploy_follow_refused_total{version=…}`` counted (alert on any increase), the old version
keeps serving and the refused one is not tried again; the project's ``notify`` receivers (the block ``train-deploy
serve`` read, in ``TRAIN_DEPLOY_FOLLOW_NOTIFY``) are sent one ``failed`` message (``stage``: ``serve --follow``, the
model, version and reason) through ``run_control.notify``'s sender, whose deadline bounds it. A registry that does
not answer is logged once per outage and polled again (each look one request, not MLflow's minutes of retries), so
a tracking server's outage costs the watch nothing: the served version goes on answering, and the first look after
the server is back sees where the alias points.

Every answer carries the version that produced it in the ``x-model-version`` header; ``/v1/models``, ``/version``
and ``/metrics`` (``train_deploy_served_version_info``) name the version being served now.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from train_deploy.handoffs import CARD_FILE
from train_deploy.run_control.notify import NotifyConfig, message, send
from train_deploy.serving.app import (
    GRACE_S,
    MODEL_NAME,
    MODEL_PATH,
    MODEL_VERSION,
    Exchange,
    Receive,
    Send,
    Served,
    ServerSettings,
    ServingApp,
    card_line,
)
from train_deploy.serving.metrics import ServerMetrics
from train_deploy.serving.requests import HttpRefusal, RequestHead, parse_json, read_body
from train_deploy.serving.webhook import HOOK_PATH, MAX_HOOK_BYTES, AliasHook, alias_moved, callback_url, signed

logger = logging.getLogger(__name__)

FOLLOW_ALIAS, POLL_INTERVAL = "TRAIN_DEPLOY_FOLLOW_ALIAS", "TRAIN_DEPLOY_FOLLOW_POLL_S"
"""The alias to follow and the seconds between two looks at the registry (``train-deploy serve`` sets both)."""
FOLLOW_NOTIFY = "TRAIN_DEPLOY_FOLLOW_NOTIFY"
"""The project's ``notify`` block as JSON: who is alerted of a refused version."""
DEFAULT_POLL_S = 30.0
VERSION_HEADER = b"x-model-version"
LOOK_TIMEOUT_S = 10
"""The longest one look at a tracking server may wait for its answer."""
CHECK_TEXT, CHECK_PROMPT = "今天天气很好。", "今天"
"""What a new version is asked before it serves: one text scored, one prompt continued by a few tokens."""


def load_app(model: Path, name: str, version: str) -> ServingApp:
    """The server's app (``serving/app.py``) for the downloaded ``model``, its bundle verified against the hashes
    ``bundle.json`` records (a damaged file raises ``BundleError`` naming it)."""
    from mlflow.pyfunc.scoring_server import load_model_with_mlflow_config

    from train_deploy.export.integrity import verify_bundle
    from train_deploy.export.runtime import read_bundle

    loaded = load_model_with_mlflow_config(str(model)).unwrap_python_model()
    verify_bundle(loaded.bundle, read_bundle(loaded.bundle))
    served = Served(name, version, card_line(loaded.bundle / CARD_FILE))
    return ServingApp(loaded, served, ServerSettings.from_environment(), ServerMetrics(name, version))


def close_app(app: ServingApp) -> None:
    """Stop ``app``'s lane threads and its batcher (what its lifespan shutdown does)."""
    for lane in app.lanes.values():
        lane.close()
    app.batcher.close()


class FollowMetrics:
    """The watch's own series: the version served, switches, refused versions (alert on any) and failed polls."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model = model_name
        self._served = Gauge("train_deploy_served_version_info", "1 for the model version answering new requests.",
                             ("model", "version"), registry=self.registry)
        self._switches = Counter("train_deploy_follow_switches", "Switches to the version the alias moved to.",
                                 ("model", "version"), registry=self.registry)
        self._refused = Counter("train_deploy_follow_refused", "Versions the alias moved to that failed their "
                                "checks and were not served (alert on any).", ("model", "version"),
                                registry=self.registry)
        self._poll_errors = Counter("train_deploy_follow_poll_errors", "Looks at the registry that failed.",
                                    ("model",), registry=self.registry)

    def serving(self, version: str, previous: str | None = None) -> None:
        if previous is not None:
            self._served.remove(self.model, previous)
            self._switches.labels(self.model, version).inc()
        self._served.labels(self.model, version).set(1)

    def refused(self, version: str) -> None:
        self._refused.labels(self.model, version).inc()

    def poll_failed(self) -> None:
        self._poll_errors.labels(self.model).inc()


class _Merged:
    """Registries collected as one: a metric family that several hold (one per version served) appears once."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterable[Any]:
        families: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return families.values()


@dataclass
class _Version:
    """One loaded version and the requests it is answering now."""

    app: ServingApp
    version: str
    in_flight: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Watch:
    """Which registered model and alias to follow, in which registry, how often."""

    name: str
    alias: str
    tracking_uri: str
    registry_uri: str
    interval_s: float = DEFAULT_POLL_S
    alerts: NotifyConfig = field(default_factory=NotifyConfig)
    """Who is told of a refused version (none by default)."""

    def current(self) -> Any:
        """The ``ModelVersion`` the alias names now (MLflow's error when the registry does not answer). On a
        tracking server it is one request of at most :data:`LOOK_TIMEOUT_S`, never retried: MLflow's client retries
        a refused connection 7 times with a doubling back-off (about 4 minutes), which would hold the watch that
        long into an outage and that long after its end; the watch itself asks again every interval."""
        if self.registry_uri.startswith(("http://", "https://")):
            return _alias_read(self.registry_uri, self.name, self.alias)
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
        return client.get_model_version_by_alias(self.name, self.alias)

    def download(self, found: Any) -> Path:
        """``found`` in the per-version cache (``serve.cached_model``), the model's folder."""
        from train_deploy.serve import cached_model

        return cached_model(found, self.tracking_uri, self.registry_uri)

    def remember(self, version: str, model: Path) -> None:
        """Record ``model`` as the alias's served copy, which a restart while the registry does not answer serves
        (``serve.record_served``): a host restarted in an outage serves the version it followed to, not the first."""
        from train_deploy.serve import record_served

        record_served(self.registry_uri, self.name, self.alias, version, model)


def _alias_read(uri: str, name: str, alias: str) -> Any:
    """The ``ModelVersion`` ``name@alias`` names on the tracking server ``uri``: MLflow's own request (its
    credentials from the environment, its errors), sent once."""
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.protos.model_registry_pb2 import GetModelVersionByAlias
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.proto_json_utils import parse_dict
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    endpoint = "/api/2.0/mlflow/registered-models/alias"
    response = http_request(get_default_host_creds(uri), endpoint, "GET", max_retries=0, timeout=LOOK_TIMEOUT_S,
                            params={"name": name, "alias": alias})
    answer = GetModelVersionByAlias.Response()
    parse_dict(verify_rest_response(response, endpoint).json(), answer)
    return ModelVersion.from_proto(answer.model_version)


class FollowingApp:
    """The ASGI app answering with the version served now, and the task that moves it along the alias (module)."""

    def __init__(self, first: ServingApp, watch: Watch, hook: AliasHook | None = None) -> None:
        self.watch, self.hook = watch, hook
        self._wake = asyncio.Event()  # set by a signed alias event: look at the registry now
        self._hook_again = False  # the webhook is still to be registered, at the next look the registry answers
        self._routed(first)
        self.current = _Version(first, first.served.version)
        self.retired_metrics: list[CollectorRegistry] = []
        """The request series of the versions served before (their models are let go once closed)."""
        self.refused: set[str] = set()
        self._undelivered: set[str] = set()  # versions whose download failed once (logged once)
        self.metrics = FollowMetrics(first.served.name)
        self.metrics.serving(self.current.version)
        self._task: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()  # held: the event loop keeps only weak references to tasks
        self._registry_down = False

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        serving = self.current  # the app this request arrived at answers it to the end
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            await self._metrics(send, serving.version)
            return
        header = (VERSION_HEADER, serving.version.encode())

        async def send_named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        serving.in_flight += 1
        try:
            await serving.app(scope, receive, send_named)
        finally:
            serving.in_flight -= 1
            if serving.in_flight == 0:
                serving.done.set()

    async def _metrics(self, send: Send, version: str) -> None:
        current = [self.current.app.metrics.registry] if self.current.app.metrics is not None else []
        registries = [*self.retired_metrics, *current, self.metrics.registry]
        body = generate_latest(_Merged(registries))
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode()),
            (VERSION_HEADER, version.encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._task = asyncio.create_task(self.follow())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._task is not None:
                    self._task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task
                if self.hook is not None:
                    await asyncio.to_thread(self.hook.delete)
                close_app(self.current.app)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def follow(self) -> None:
        """Look at the alias every interval, for as long as the server runs."""
        logger.info("Following %s@%s (version %s served), polling the registry every %g s", self.watch.name,
                    self.watch.alias, self.current.version, self.watch.interval_s)
        # The webhook is registered after the first look the registry answers: MLflow's client, which registers
        # it, retries a server that is down for minutes, and the watch must not wait on it.
        self._hook_again = self.hook is not None
        found = await self._look()
        while True:
            if found is not None and self._hook_again and self.hook is not None:
                self._hook_again = False
                await asyncio.to_thread(self.hook.register)
            if found is not None and str(found.version) not in (self.current.version, *self.refused):
                await self.take(found)
            with contextlib.suppress(TimeoutError):  # a webhook delivery ends the wait early
                await asyncio.wait_for(self._wake.wait(), self.watch.interval_s)
            self._wake.clear()
            found = await self._look()

    async def _look(self) -> Any:
        """The version the alias names, or None when the registry did not answer (logged once per outage)."""
        try:
            found = await asyncio.to_thread(self.watch.current)
        except Exception as error:  # a tracking server down or a store locked: keep serving, look again later
            self.metrics.poll_failed()
            if not self._registry_down:
                logger.warning("The registry did not answer for %s@%s (%s); version %s keeps serving, polling "
                               "again every %g s", self.watch.name, self.watch.alias, type(error).__name__,
                               self.current.version, self.watch.interval_s)
            self._registry_down = True
            return None
        if self._registry_down:
            logger.info("The registry answers again for %s@%s", self.watch.name, self.watch.alias)
        self._registry_down = False
        return found

    async def take(self, found: Any) -> bool:
        """Download, load and check the version ``found``, then serve it; False (logged, counted) if it fails. A
        download that fails (a tracking server going down midway) is tried again at the next look, not refused."""
        version, started = str(found.version), time.monotonic()
        candidate: ServingApp | None = None
        try:
            model = await asyncio.to_thread(self.watch.download, found)
        except Exception as error:  # the store did not deliver it: no verdict on the version
            self.metrics.poll_failed()
            if version not in self._undelivered:
                self._undelivered.add(version)
                logger.warning("Version %s of %s could not be downloaded (%s); version %s keeps serving, downloading "
                               "again at the next look", version, self.watch.name, type(error).__name__,
                               self.current.version)
            return False
        try:
            candidate = await asyncio.to_thread(load_app, model, self.watch.name, version)
            await check_app(candidate)
        except Exception as error:  # any failure of the new version leaves the old one serving
            self.refused.add(version)
            self.metrics.refused(version)
            logger.error("Refused version %s of %s (%s@%s): %s: %s; version %s keeps serving", version,
                         self.watch.name, self.watch.name, self.watch.alias, type(error).__name__,
                         str(error).splitlines()[0][:300] if str(error) else "", self.current.version)
            if candidate is not None:
                await asyncio.to_thread(close_app, candidate)
            await self._alert(version, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            return False
        self._routed(candidate)
        old, self.current = self.current, _Version(candidate, version)
        self.metrics.serving(version, old.version)
        logger.info("Serving version %s of %s (%s@%s moved from %s; checked in %.1f s)", version, self.watch.name,
                    self.watch.name, self.watch.alias, old.version, time.monotonic() - started)
        try:
            await asyncio.to_thread(self.watch.remember, version, model)
        except OSError as error:  # a restart in an outage would serve the version recorded before
            logger.warning("Version %s could not be recorded as the served copy (%s)", version, type(error).__name__)
        if old.app.metrics is not None:
            self.retired_metrics.append(old.app.metrics.registry)
        retiring = asyncio.create_task(self._retire(old))
        self._retiring.add(retiring)
        retiring.add_done_callback(self._retiring.discard)
        return True

    def _routed(self, app: ServingApp) -> None:
        """Give ``app`` the webhook's route, so its deliveries are read like any request (``requests.py``)."""
        if self.hook is not None:
            app.routes[("POST", HOOK_PATH)] = self._delivery

    async def _delivery(self, exchange: Exchange) -> None:
        """``POST /hooks/mlflow``: a signed alias event for the alias followed wakes the watch; 401 if unsigned."""
        head = RequestHead.of(exchange.scope)
        head.require_json()
        deadline = exchange.arrival + self.current.app.settings.body_timeout_s
        body = await read_body(exchange.receive, MAX_HOOK_BYTES, deadline,
                               f"webhook: over {MAX_HOOK_BYTES} bytes, more than an MLflow delivery holds")
        headers = {name.lower(): value for name, value in exchange.scope.get("headers") or []}
        if self.hook is None or not signed(self.hook.secret, headers, body):
            raise HttpRefusal(401, "webhook: no valid X-MLflow-Signature; only the tracking server that holds this "
                                   "server's webhook may post here")
        version = alias_moved(parse_json(body), self.watch.name, self.watch.alias)
        if version is not None:
            logger.info("Webhook: %s@%s moved to version %s; looking at the registry now", self.watch.name,
                        self.watch.alias, version[:40])
            self._wake.set()
        await exchange.json(200, {})

    async def _alert(self, version: str, reason: str) -> None:
        """One ``failed`` message about the refused ``version`` to the ``notify`` receivers, if any (never raises)."""
        if self.watch.alerts.enabled:
            body = message("failed", stage="serve --follow", model=self.watch.name, alias=self.watch.alias,
                           version=version, serving=self.current.version, reason=reason)
            await asyncio.to_thread(send, self.watch.alerts, body)

    async def _retire(self, old: _Version) -> None:
        """Close ``old``'s threads once its last request has been answered (at most its time budget on)."""
        if old.in_flight:
            old.done.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(old.done.wait(), old.app.limits.serving.time_budget_s + GRACE_S + 5)
        await asyncio.to_thread(close_app, old.app)
        logger.info("Version %s of %s closed (its last request answered)", old.version, self.watch.name)


async def check_app(app: ServingApp) -> None:
    """One score and one generate request on ``app``, in this process; raises ``RuntimeError`` on a wrong answer."""
    status, body = await ask(app, "/invocations", {"dataframe_split": {"columns": ["text"], "data": [[CHECK_TEXT]]},
                                                   "params": {"task": "score"}})
    rows = body.get("predictions") if status == 200 and isinstance(body, dict) else None
    if not rows or not isinstance(rows[0].get("perplexity"), float) or not rows[0]["perplexity"] > 0:
        raise RuntimeError(f"the score check answered {status} {_short(body)}")
    status, body = await ask(app, "/v1/completions", {"model": app.served.name, "prompt": CHECK_PROMPT,
                                                      "max_tokens": 4, "temperature": 0})
    choices = body.get("choices") if status == 200 and isinstance(body, dict) else None
    if not choices or not isinstance(choices[0].get("text"), str):
        raise RuntimeError(f"the generate check answered {status} {_short(body)}")


def _short(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False)[:200]


async def ask(app: Any, path: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` as JSON to the ASGI ``app`` in this process; its status and decoded answer."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "scheme": "http", "http_version": "1.1", "server": ("127.0.0.1", 0),
             "client": ("127.0.0.1", 0), "headers": [(b"host", b"follow"), (b"content-type", b"application/json"),
                                                     (b"content-length", str(len(payload)).encode())]}
    pending = [{"type": "http.request", "body": payload, "more_body": False}]
    answer: dict[str, Any] = {"status": 0, "body": b""}

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await asyncio.get_running_loop().create_future()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    try:
        return answer["status"], json.loads(answer["body"])
    except ValueError:
        return answer["status"], None


def create_app() -> FollowingApp:
    """The following server for the model in ``$TRAIN_DEPLOY_SERVED_MODEL`` (uvicorn's ``--factory``)."""
    if not logging.getLogger("train_deploy").handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name, version = os.environ.get(MODEL_NAME, "train_deploy_lm"), os.environ.get(MODEL_VERSION, "unregistered")
    tracking = os.environ["MLFLOW_TRACKING_URI"]
    watch = Watch(name, os.environ[FOLLOW_ALIAS], tracking, os.environ.get("MLFLOW_REGISTRY_URI", tracking),
                  float(os.environ.get(POLL_INTERVAL, DEFAULT_POLL_S)),
                  NotifyConfig.from_params(json.loads(os.environ.get(FOLLOW_NOTIFY) or "{}") or None))
    url = callback_url(dict(os.environ))
    hook = AliasHook(watch.registry_uri, url, name, watch.alias) if url is not None else None
    return FollowingApp(load_app(Path(os.environ[MODEL_PATH]), name, version), watch, hook)
