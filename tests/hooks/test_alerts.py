"""RunAlerts sends one message per outcome to a real receiver on 127.0.0.1, called as Kedro calls a hook.

The runs that really end in each outcome (a kill in a stage, a skipped night, a gate, the data gate) check their
alert where they run: tests/test_signals.py, tests/test_retrain.py, tests/pipelines/registry, tests/validation.
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.http_receiver import Receiver
from tests.mlflow_server import free_port
from train_deploy.hooks.alerts import RunAlerts
from train_deploy.registry.gate import RegistryDecision
from train_deploy.retrain import NothingToRetrain


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def started(receiver: Receiver, tmp_path, error: BaseException | None = None) -> RunAlerts:
    """The hook once Kedro made the context (``error``: another hook refused the run there)."""
    hook = RunAlerts()
    wrapper = hook.after_context_created(SimpleNamespace(params={"notify": {"webhooks": [receiver.url]}},
                                                         project_path=tmp_path / "news_project"))
    next(wrapper)
    with pytest.raises(StopIteration if error is None else type(error)):
        wrapper.throw(error) if error is not None else wrapper.send(None)
    return hook


def messages(receiver: Receiver) -> list[dict]:
    return [json.loads(body) for _, body in receiver.received]


def wrapped(wrapper, error: BaseException | None = None) -> None:
    """A wrapper hook as pluggy drives it: to its yield, then the other hooks' result or error."""
    next(wrapper)
    with pytest.raises(StopIteration if error is None else type(error)):
        wrapper.throw(error) if error is not None else wrapper.send(None)


def run_hook(hook: RunAlerts, error: BaseException | None = None) -> None:
    """``before_pipeline_run``, around the other hooks' result or error."""
    wrapped(hook.before_pipeline_run(), error)


def decision(champion: bool) -> RegistryDecision:
    return RegistryDecision(model_name="news_lm", version="7", run_id="r", decision="promoted" if champion else
                            "rejected", reason="…", champion=champion, previous_champion="6", metric="nats_per_char",
                            candidate_value=1.5, champion_value=1.6, eval_set_sha256="x", eval_texts=16, decided_at="t")


@pytest.mark.parametrize("champion", [True, False])
def test_a_gated_run_sends_promoted_or_rejected_with_both_scores(receiver, tmp_path, champion):
    hook = started(receiver, tmp_path)
    run_hook(hook)
    hook.after_node_run({"registry_decision": decision(champion), "registry_history": "…"})
    wrapped(hook.after_pipeline_run())
    (message,) = messages(receiver)
    assert message["event"] == ("promoted" if champion else "rejected") and message["project"] == "news_project"
    assert (message["score"], message["champion_score"], message["version"]) == (1.5, 1.6, "7")


def test_a_skipped_night_sends_skipped_with_its_reason(receiver, tmp_path):
    run_hook(started(receiver, tmp_path), NothingToRetrain("nothing changed since version 6"))
    assert [(m["event"], m["reason"]) for m in messages(receiver)] == [("skipped", "nothing changed since version 6")]


def test_a_failed_node_sends_failed_once_naming_the_node(receiver, tmp_path):
    hook = started(receiver, tmp_path)
    run_hook(hook)
    wrapped(hook.before_node_run(SimpleNamespace(name="export_bundle")))
    wrapped(hook.on_pipeline_error(RuntimeError("disk full\nwith a second line")))
    hook._stopped()  # the exit handler after an error sends nothing more
    (message,) = messages(receiver)
    assert (message["event"], message["node"], message["reason"]) == ("failed", "export_bundle",
                                                                      "RuntimeError: disk full")


def test_a_run_refused_before_its_first_node_sends_failed(receiver, tmp_path):
    run_hook(started(receiver, tmp_path), RuntimeError("another run holds the project"))
    assert [m["event"] for m in messages(receiver)] == ["failed"]


def test_no_receivers_no_messages_and_a_corpus_only_success_sends_nothing(receiver, tmp_path):
    hook = started(receiver, tmp_path)
    run_hook(hook)
    wrapped(hook.after_pipeline_run())
    silent = RunAlerts()
    silent.after_context_created(SimpleNamespace(params={}, project_path=tmp_path))
    run_hook(silent, NothingToRetrain("unchanged"))
    assert receiver.received == []


def test_a_run_refused_while_its_context_is_made_sends_failed_with_the_reason(receiver, tmp_path):
    """As when the tracking server does not answer: no pipeline hook ever runs."""
    started(receiver, tmp_path, RuntimeError("MLflow tracking server http://mlflow:5000 does not answer"))
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
    hook = started(receiver, tmp_path)
    run_hook(hook)
    wrapped(hook.before_node_run(SimpleNamespace(name="prepare_tokenizer")))
    wrapped(hook.on_pipeline_error(died.value))
    hook._stopped()
    ((_, body),) = receiver.received
    message = json.loads(body)
    assert message["node"] == "prepare_tokenizer"
    assert message["reason"].startswith(f"MlflowException: API request to http://127.0.0.1:{port}/api/2.0/mlflow/")
    assert b"S3cretPW" not in body and b"alice" not in body


def test_an_interrupt_names_a_signal_only_when_one_arrived(receiver, tmp_path):
    raised = started(receiver, tmp_path)
    run_hook(raised)
    raised._failed(KeyboardInterrupt())  # raised by code, no signal sent
    signalled = started(receiver, tmp_path)
    run_hook(signalled)
    try:
        with pytest.raises(KeyboardInterrupt):  # a real Ctrl-C, through the handler in place
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    finally:
        signalled._ended()
    signalled._stopped()  # what its exit handler says: Kedro's on_pipeline_error never saw the interrupt
    receiver.wait_for(2, 15)  # the exit handler does not wait for its delivery process
    assert [m["reason"] for m in messages(receiver)] == ["KeyboardInterrupt", "stopped by SIGINT (Ctrl-C)"]
