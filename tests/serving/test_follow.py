"""``train-deploy serve --follow``: a real server process follows ``champion`` while 8 clients score without pause;
a damaged version is refused (logged once, counted for an alert) and the old one answers on; a good one is switched
to with no failed request, every answer naming the version that produced it."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from click.testing import CliRunner

from tests.helpers.project import copy_project
from tests.helpers.registry import REGISTERED_MODEL, ModelServer, ModelStore
from tests.http_receiver import Receiver
from tests.serving.conftest import (
    CLIENTS,
    SCORE,
    Load,
    TrackingServerStore,
    follow_command,
    request,
    served_version,
    wait_for,
)

pytest_plugins = ["tests.mlflow_server"]


@pytest.fixture(scope="module")
def versions(tmp_path_factory, tiny_bundle) -> tuple[ModelStore, list[str]]:
    """A store holding the tiny bundle as versions 1, 2 and 3 of the model, ``champion`` on 1, version 3's stored
    weights damaged after it was registered (same size, one byte changed)."""
    store = ModelStore(tmp_path_factory.mktemp("follow_store"))
    infos = [store.log(tiny_bundle, registered_model_name=REGISTERED_MODEL) for _ in range(3)]
    registered = [info.registered_model_version for info in infos]
    with store.active():
        mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", registered[0])
        stored = Path(mlflow.get_logged_model(infos[2].model_id).artifact_location.removeprefix("file://"))
    bundle = next(stored.rglob("bundle.json")).parent
    largest = max((path for path in bundle.rglob("*") if path.is_file() and path.name != "bundle.json"),
                  key=lambda path: path.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    return store, [str(version) for version in registered]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """The webhook the following server's project alerts (its ``notify`` block in conf/local)."""
    receiver = Receiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, versions, receiver) -> Iterator[ModelServer]:
    """``train-deploy serve --follow --poll-interval 0.5`` of ``champion``, started as users start it, from a project
    whose ``notify`` block names ``receiver``."""
    store, _ = versions
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, tmp_path_factory.mktemp("follow") / "empty")
    project = copy_project(tmp_path_factory.mktemp("follow_project") / "project")
    (project / "conf" / "local" / "parameters_notify.yml").write_text(
        f"notify:\n  webhooks: [{receiver.url}]\n  attempts: 1\n  timeout_seconds: 5\n")
    served.command = follow_command(served, project)
    served.start()
    try:
        yield served
    finally:
        served.stop()


def _metrics(server: ModelServer) -> str:
    status, _, body = request(server, "GET", "/metrics")
    assert status == 200
    return body.decode()


@pytest.mark.slow
def test_a_damaged_version_is_refused_alerted_and_a_good_one_taken_with_no_failed_request(server, versions, receiver):
    store, (first, second, damaged) = versions
    assert served_version(server) == first
    refused = (f'train_deploy_follow_refused_total{{model="{REGISTERED_MODEL}",version="{damaged}"}} 1.0')
    with Load(server) as load, store.active():
        client = mlflow.MlflowClient()
        client.set_registered_model_alias(REGISTERED_MODEL, "champion", damaged)
        wait_for(lambda: refused in _metrics(server), "refusing the damaged version", server)
        assert served_version(server) == first
        client.set_registered_model_alias(REGISTERED_MODEL, "champion", second)
        wait_for(lambda: served_version(server) == second, "the switch to the good version", server)
        switched = time.monotonic()
        wait_for(lambda: len(load.since(switched)) >= 2 * CLIENTS, "answers after it", server)

    answers = load.since(0)
    assert [answer for answer in answers if answer.status != 200] == []
    assert {answer.version for answer in answers} == {first, second}
    for i in range(CLIENTS):  # each client's answers came from version 1, then from version 2
        named = [answer.version for answer in answers if answer.client == i]
        assert named == sorted(named, key=int)
    log = server.log.read_text(errors="replace")
    refusals = re.findall(rf"Refused version {damaged} of {REGISTERED_MODEL} \(\S+\): BundleError: .*; version "
                          rf"{first} keeps serving", log)
    assert len(refusals) == 1, log[-4000:]
    metrics = _metrics(server)
    assert f'train_deploy_served_version_info{{model="{REGISTERED_MODEL}",version="{second}"}} 1.0' in metrics
    assert f'train_deploy_served_version_info{{model="{REGISTERED_MODEL}",version="{first}"}}' not in metrics
    assert f'train_deploy_follow_switches_total{{model="{REGISTERED_MODEL}",version="{second}"}} 1.0' in metrics
    assert refused in metrics
    [(_, alert)] = receiver.wait_for(1, 30)
    alert = json.loads(alert)
    assert {key: alert[key] for key in ("event", "stage", "model", "alias", "version", "serving")} == {
        "event": "failed", "stage": "serve --follow", "model": REGISTERED_MODEL, "alias": "champion",
        "version": damaged, "serving": first}
    assert alert["reason"].startswith("BundleError: ")
    assert len(receiver.received) == 1


def test_a_version_whose_download_failed_is_downloaded_again_at_the_next_look_not_refused(monkeypatch, caplog):
    """A tracking server that goes down while a new version downloads says nothing about the version: it is not
    refused (nor alerted) but downloaded again at the next look, and served once it arrives and passes its checks."""
    import asyncio
    from types import SimpleNamespace

    from train_deploy.run_control.notify import NotifyConfig
    from train_deploy.serving import follow

    def app_of(version: str) -> SimpleNamespace:  # what FollowingApp reads of a loaded version
        return SimpleNamespace(served=SimpleNamespace(name=REGISTERED_MODEL, version=version), metrics=None)

    downloads: list[str] = []
    remembered: list[tuple[str, Path]] = []

    class _Watch:
        name, alias, interval_s, alerts = REGISTERED_MODEL, "champion", 1.0, NotifyConfig()

        def download(self, found: SimpleNamespace) -> Path:
            downloads.append(found.version)
            if len(downloads) == 1:
                raise ConnectionError("the tracking server went away")
            return Path("model")

        def remember(self, version: str, model: Path) -> None:
            remembered.append((version, model))

    async def checked(app: object) -> None:
        return None

    monkeypatch.setattr(follow, "load_app", lambda model, name, version: app_of(version))
    monkeypatch.setattr(follow, "check_app", checked)
    monkeypatch.setattr(follow, "close_app", lambda app: None)

    async def two_looks() -> tuple[follow.FollowingApp, list[bool]]:
        following = follow.FollowingApp(app_of("1"), _Watch())
        taken = [await following.take(SimpleNamespace(version="2")) for _ in range(2)]
        await asyncio.gather(*following._retiring)
        return following, taken

    with caplog.at_level("WARNING", logger=follow.__name__):
        following, taken = asyncio.run(two_looks())
    assert (taken, downloads, following.current.version, following.refused) == ([False, True], ["2", "2"], "2", set())
    assert remembered == [("2", Path("model"))]  # the version switched to is what a restart in an outage serves
    assert [record.getMessage() for record in caplog.records] == [
        f"Version 2 of {REGISTERED_MODEL} could not be downloaded (ConnectionError); version 1 keeps serving, "
        "downloading again at the next look"]


def test_the_version_followed_to_is_what_a_start_in_an_outage_serves(tmp_path, monkeypatch):
    """``Watch.remember`` (called on every switch) rewrites the alias's served-copy record, which ``train-deploy
    serve`` started while the tracking server does not answer serves: the last version followed, not the first."""
    import json as json_module

    from tests.mlflow_server import HOST, free_port
    from train_deploy.hashing import file_record
    from train_deploy.serve import DOWNLOAD_RECORD, served_copy
    from train_deploy.serving.follow import Watch

    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    down = f"http://{HOST}:{free_port()}"  # nothing listens there
    models = {}
    for version in ("1", "2"):  # two cached copies as serve.cached_model leaves them
        folder = tmp_path / "cache" / "serve" / f"{REGISTERED_MODEL}-{version}"
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "MLmodel").write_text(f"version {version}\n")
        (folder / DOWNLOAD_RECORD).write_text(json_module.dumps(
            {"model": "model", "files": {"model/MLmodel": file_record(folder / "model" / "MLmodel")}}))
        models[version] = folder / "model"
    watch = Watch(REGISTERED_MODEL, "champion", down, down)
    watch.remember("1", models["1"])
    assert served_copy(tmp_path, down, down, REGISTERED_MODEL, "champion") == ("1", models["1"])
    watch.remember("2", models["2"])
    assert served_copy(tmp_path, down, down, REGISTERED_MODEL, "champion") == ("2", models["2"])


def test_following_a_version_number_is_refused_in_one_line():
    from train_deploy.commands import main

    result = CliRunner().invoke(main, ["serve", "--alias", "3", "--follow"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: --follow: version 3 never moves; follow an alias (--alias champion)"]


def test_a_look_at_a_tracking_server_that_is_down_fails_at_once():
    """One look is one request: MLflow's client would retry a refused connection for about 4 minutes (its
    default 7 retries, doubling from 2 s), holding the watch that long past the end of an outage."""
    from mlflow.exceptions import MlflowException

    from tests.mlflow_server import HOST, free_port
    from train_deploy.serving.follow import Watch

    down = f"http://{HOST}:{free_port()}"  # nothing listens there
    outcome: list[BaseException] = []

    def look() -> None:
        try:
            Watch(REGISTERED_MODEL, "champion", down, down).current()
        except BaseException as error:  # noqa: BLE001 - the test names it below
            outcome.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), f"the look still waits after {time.monotonic() - started:.0f} s"
    assert [type(error) for error in outcome] == [MlflowException]
    assert "Connection refused" in str(outcome[0]), outcome


def _following(store: ModelStore, project: Path, folder: Path) -> ModelServer:
    served = ModelServer(f"models:/{REGISTERED_MODEL}@champion", store, folder)
    served.command = follow_command(served, project)
    return served


@pytest.mark.slow
def test_a_restart_while_the_tracking_server_is_down_serves_the_last_copy_and_the_watch_polls_on(
        mlflow_server, tiny_bundle, tmp_path):
    from train_deploy.registry.model import log_bundle_model

    mlflow.set_tracking_uri(mlflow_server.uri)
    mlflow.set_registry_uri(mlflow_server.uri)
    with mlflow.start_run(experiment_id=mlflow.set_experiment("outage").experiment_id):
        version = log_bundle_model(tiny_bundle, registered_model_name=REGISTERED_MODEL).registered_model_version
    mlflow.MlflowClient().set_registered_model_alias(REGISTERED_MODEL, "champion", version)
    store, project = TrackingServerStore(tmp_path, mlflow_server.uri), copy_project(tmp_path / "project")
    first = _following(store, project, tmp_path / "first")
    first.start()
    try:
        assert served_version(first) == str(version)
    finally:
        first.stop()

    mlflow_server.stop()
    second = _following(store, project, tmp_path / "second")
    second.start()
    try:
        assert served_version(second) == str(version)
        assert request(second, "POST", "/invocations", SCORE)[0] == 200
        wait_for(lambda: "The registry did not answer" in second.log.read_text(errors="replace"), "a failed poll",
                  second)
        mlflow_server.start()
        wait_for(lambda: "The registry answers again" in second.log.read_text(errors="replace"), "a poll", second)
    finally:
        second.stop()
    log = second.log.read_text(errors="replace")
    assert f"does not answer: serving the copy of {REGISTERED_MODEL} version {version} downloaded before" in log
    assert log.count("The registry did not answer") == 1  # once per outage
