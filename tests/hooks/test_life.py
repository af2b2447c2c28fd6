"""RunLife owns a run's life: the project's hooks do not depend on the order they are registered in, and a run's
alert is sent only once its lock is free (issue 37 item 1, issue 35 item 3)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import mlflow
import pytest
from kedro.framework.hooks.markers import HOOK_NAMESPACE
from kedro.framework.session import KedroSession
from kedro.framework.session import session as kedro_session
from kedro.io.core import DatasetError
from mlflow import MlflowClient

from tests.helpers.project import tiny_runtime_params
from train_deploy import settings
from train_deploy.run_control.lock import RunLock


class LockCheckingReceiver:
    """A webhook receiver on 127.0.0.1 that records each alert with whether the project's run lock was held as it
    arrived."""

    def __init__(self, project: Path) -> None:
        self.received: list[tuple[dict, str | None]] = []
        receiver, lock = self, RunLock(project / "data")

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.received.append((body, lock.held_by()))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/alerts"
        Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_settings_register_at_most_four_hooks_and_only_run_life_wraps_or_orders_itself():
    assert len(settings.HOOKS) <= 4
    for hook in settings.HOOKS:
        for name in dir(hook):
            options = getattr(getattr(hook, name, None), f"{HOOK_NAMESPACE}_impl", None)
            if options is None:
                continue
            assert not (options.get("tryfirst") or options.get("trylast")), f"{type(hook).__name__}.{name}"
            if options.get("wrapper") or options.get("hookwrapper"):
                assert type(hook).__name__ == "RunLife", f"{type(hook).__name__}.{name}"


def _statuses(store: Path) -> list[tuple[str, str | None, str | None]]:
    """The status, ``trigger`` and ``runner`` tags of the project's runs in ``store``, oldest first."""
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("train_deploy")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [(r.info.status, r.data.tags.get("trigger"), r.data.tags.get("runner")) for r in runs]


@pytest.fixture
def receiver(project):
    receiver = LockCheckingReceiver(project)
    yield receiver
    receiver.close()


@pytest.mark.slow
@pytest.mark.parametrize("order", ["listed", "reversed"])
def test_hooks_in_either_order_run_alike_and_alert_after_the_lock_is_given_back(project, tmp_path, monkeypatch,
                                                                                receiver, order):
    register = kedro_session._register_hooks
    monkeypatch.setattr(kedro_session, "_register_hooks", lambda manager, hooks: register(
        manager, tuple(reversed(hooks)) if order == "reversed" else hooks))
    monkeypatch.delenv("TRAIN_DEPLOY_TRIGGER", raising=False)
    params = tiny_runtime_params() | {"notify": {"webhooks": [receiver.url]}}
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["corpus"])  # succeeds: a corpus-only run sends no alert
    bad = tmp_path / "bad.txt"
    bad.write_bytes("一篇文章。\n".encode() * 50 + b"\xff\xfe\xfa not UTF-8\n")
    params["corpus"]["reader"] = {"source": "text", "paths": [str(bad)]}
    with KedroSession.create(project_path=project, runtime_params=params) as session, \
            pytest.raises(DatasetError, match="bad.txt line 51: not valid UTF-8"):
        session.run(pipeline_names=["corpus"])

    assert mlflow.active_run() is None and RunLock(project / "data").held_by() is None
    assert _statuses(tmp_path / "mlruns.db") == [("FINISHED", "manual", "SequentialRunner"),
                                                 ("FAILED", "manual", "SequentialRunner")]
    ((alert, lock_holder),) = receiver.received  # delivered within the run's hand-off wait
    assert (alert["event"], alert["node"], alert["stage"]) == ("failed", "prepare_tokenizer", "corpus")
    assert lock_holder is None
