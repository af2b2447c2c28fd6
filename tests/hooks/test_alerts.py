"""RunAlerts sends one message per outcome to a real receiver on 127.0.0.1, called as ``hooks.life.RunLife`` calls it:
``deliver`` as the run's ``ExitStack`` closes, with the error the run ended with.

The runs that really end in each outcome (a kill in a stage, a skipped night, a gate, the data gate) check their
alert where they run: tests/test_signals.py, tests/test_retrain.py, tests/pipelines/registry, tests/validation;
tests/test_settings.py checks that it is sent after the run lock is given back.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.http_receiver import Receiver
from tests.mlflow_server import free_port
from train_deploy.hooks.alerts import RunAlerts
from train_deploy.hooks.runs import RunAbandoned
from train_deploy.registry.gate import RegistryDecision
from train_deploy.run_control.notify import NotifyConfig
from train_deploy.run_control.retrain import NothingToRetrain


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def started(receiver: Receiver, tmp_path) -> RunAlerts:
    """The alerts of a run once its session started."""
    return RunAlerts(NotifyConfig.from_params({"webhooks": [receiver.url]}), tmp_path / "news_project")


def messages(receiver: Receiver) -> list[dict]:
    return [json.loads(body) for _, body in receiver.received]


def ended(alerts: RunAlerts, error: BaseException | None = None) -> None:
    """The run's stack closing, with the error the run ended with (None: none)."""
    alerts.deliver(type(error) if error is not None else None, error, None)


def decision(champion: bool) -> RegistryDecision:
    return RegistryDecision(model_name="news_lm", version="7", run_id="r", decision="promoted" if champion else
                            "rejected", reason="…", champion=champion, previous_champion="6", metric="nats_per_char",
                            candidate_value=1.5, champion_value=1.6, eval_set_sha256="x", eval_texts=16, decided_at="t")


@pytest.mark.parametrize("champion", [True, False])
def test_a_gated_run_sends_promoted_or_rejected_with_both_scores(receiver, tmp_path, champion):
    alerts = started(receiver, tmp_path)
    alerts.node_finished({"registry_decision": decision(champion), "registry_history": "…"})
    ended(alerts)
    (message,) = messages(receiver)
    assert message["event"] == ("promoted" if champion else "rejected") and message["project"] == "news_project"
    assert (message["score"], message["champion_score"], message["version"]) == (1.5, 1.6, "7")


def test_a_skipped_night_sends_skipped_with_its_reason(receiver, tmp_path):
    ended(started(receiver, tmp_path), NothingToRetrain("nothing changed since version 6"))
    assert [(m["event"], m["reason"]) for m in messages(receiver)] == [("skipped", "nothing changed since version 6")]


def test_a_failed_node_sends_failed_once_naming_the_node(receiver, tmp_path):
    alerts = started(receiver, tmp_path)
    alerts.node = "export_bundle"
    ended(alerts, RuntimeError("disk full\nwith a second line"))
    ended(alerts, RunAbandoned())  # the exit handler after an error sends nothing more
    (message,) = messages(receiver)
    assert (message["event"], message["node"], message["reason"]) == ("failed", "export_bundle",
                                                                      "RuntimeError: disk full")


def test_a_run_abandoned_at_exit_sends_failed_saying_so(receiver, tmp_path):
    ended(started(receiver, tmp_path), RunAbandoned())  # handed off, not waited for: the process is exiting
    ((_, body),) = receiver.wait_for(1, 30)
    message = json.loads(body)
    assert (message["event"], message["reason"]) == ("failed", "the run ended before its pipeline did, with no "
                                                               "error or signal seen")


def test_a_run_refused_before_its_first_node_sends_failed(receiver, tmp_path):
    ended(started(receiver, tmp_path), RuntimeError("another run holds the project"))
    assert [m["event"] for m in messages(receiver)] == ["failed"]


def test_no_receivers_no_messages_and_a_corpus_only_success_sends_nothing(receiver, tmp_path):
    ended(started(receiver, tmp_path))
    ended(RunAlerts(NotifyConfig.from_params({}), tmp_path), NothingToRetrain("unchanged"))
    assert receiver.received == []


def test_a_run_refused_while_its_context_is_made_sends_failed_with_the_reason(receiver, tmp_path):
    """As when the tracking server does not answer: no pipeline hook ever runs."""
    started(receiver, tmp_path).failed(RuntimeError("MLflow tracking server http://mlflow:5000 does not answer"))
    (message,) = messages(receiver)
    assert message["event"] == "failed" and message["reason"].startswith("RuntimeError: MLflow tracking server")


def test_a_context_that_runs_no_pipeline_sends_nothing(receiver, tmp_path):
    """train-deploy gc reads the project's settings through a Kedro context and runs no pipeline."""
    started(receiver, tmp_path)
    assert receiver.received == []


def test_a_run_that_died_of_an_error_holding_a_password_alerts_the_error_redacted_not_a_signal(receiver, tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    port = free_port()
    with pytest.raises(MlflowException) as died:  # the tracking server is gone
        MlflowClient(f"http://alice:S3cretPW@127.0.0.1:{port}").get_run("0" * 32)
    alerts = started(receiver, tmp_path)
    alerts.node = "prepare_tokenizer"
    ended(alerts, died.value)
    ended(alerts, RunAbandoned())  # the exit handler after an error sends nothing more
    ((_, body),) = receiver.received
    message = json.loads(body)
    assert message["node"] == "prepare_tokenizer"
    assert message["reason"].startswith(f"MlflowException: API request to http://127.0.0.1:{port}/api/2.0/mlflow/")
    assert b"S3cretPW" not in body and b"alice" not in body


def test_an_interrupt_names_a_signal_only_when_one_arrived(receiver, tmp_path):
    raised = started(receiver, tmp_path)
    raised.watch_signals()
    raised.restore_signals()  # as the run's stack closes: the handlers put back, then the alert
    ended(raised, KeyboardInterrupt())  # raised by code, no signal sent
    signalled = started(receiver, tmp_path)
    # Python's own Ctrl-C handler, as a run started from a terminal has (a process started in the background by a
    # shell without job control, as CI may start the suite, inherits SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    signalled.watch_signals()
    try:
        with pytest.raises(KeyboardInterrupt):  # a real Ctrl-C, through the handler in place
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    finally:
        signalled.restore_signals()
        signal.signal(signal.SIGINT, inherited)
    ended(signalled, RunAbandoned())  # what its exit handler says: Kedro's on_pipeline_error never saw the interrupt
    receiver.wait_for(2, 15)  # the exit handler does not wait for its delivery process
    assert [m["reason"] for m in messages(receiver)] == ["KeyboardInterrupt", "stopped by SIGINT (Ctrl-C)"]
