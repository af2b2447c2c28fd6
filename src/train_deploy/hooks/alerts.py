"""One alert per run outcome (the ``notify`` block, ``train_deploy.notify``): failed, skipped, promoted or rejected,
validation stopped. A run that ends without an outcome worth telling (a corpus-only run that succeeded) sends none.

The alert is handed to a delivery process of its own (``notify.hand_off``) after the run lock is given back: the
run waits at most :data:`HANDOFF_SECONDS` for it, and never on a receiver. Its reason is the real cause: the
one-line, redacted form of the exception the run died of, with the node it was in; a signal is named only when
one arrived (``train_deploy.signals.StopSignals``).

A run killed outright (SIGKILL, a crashing native kernel) cannot say anything itself: its watch process
(``train_deploy.signals.RunWatch``) sends the ``failed`` alert with the stage and the signal. A run that
``train-deploy schedule`` stopped at its wall-clock limit is reported timed out by the scheduler.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from train_deploy.console import project_log_file
from train_deploy.hooks.runs import stages_of_nodes
from train_deploy.notify import NotifyConfig, hand_off, message
from train_deploy.redaction import one_line
from train_deploy.registry.gate import RegistryDecision
from train_deploy.retrain import NothingToRetrain
from train_deploy.signals import StopSignals, describe_stop, past_schedule_deadline
from train_deploy.validation.report import ValidationStopped

logger = logging.getLogger(__name__)

HANDOFF_SECONDS = 3.0
"""How long a run waits for its alert's delivery process before leaving it to finish alone (by its deadline)."""


class RunAlerts:
    """Send the run's outcome to ``notify``'s receivers, once.

    Registered last, so its wrappers are the outermost: a run refused while its context is made (the tracking
    server does not answer) or refused or skipped before its first node is seen too, and the outcome of a
    pipeline is sent after every other hook ran (the run lock given back), even when one of them failed (as
    kedro-mlflow's do when the tracking server is gone). Made contexts that run no pipeline (``train-deploy gc``
    reads the project's settings through one) send nothing. A SIGTERM or Ctrl-C skips Kedro's
    ``on_pipeline_error``: an exit handler reports it."""

    def __init__(self) -> None:
        self._config, self._project = NotifyConfig(), None
        self._node: str | None = None
        self._decision: RegistryDecision | None = None
        self._sent = False
        self._signals = StopSignals()

    @hook_impl(wrapper=True)
    def after_context_created(self, context):
        self._config = NotifyConfig.from_params(context.params.get("notify"))
        self._project, self._node, self._decision, self._sent = Path(context.project_path), None, None, False
        try:
            return (yield)
        except BaseException as error:
            self._failed(error)
            raise

    @hook_impl(wrapper=True)
    def before_pipeline_run(self):
        try:
            result = yield
        except NothingToRetrain as skipped:
            self._send("skipped", reason=str(skipped))
            raise
        except BaseException as error:
            self._failed(error)
            raise
        self._signals = StopSignals().watch()  # in front of the SIGTERM handler EndStoppedRun has just set
        atexit.register(self._stopped)
        return result

    @hook_impl(wrapper=True)
    def before_node_run(self, node):
        self._node = node.name  # before the other hooks: kedro-mlflow's fails first when the server is gone
        return (yield)

    @hook_impl
    def after_node_run(self, outputs: dict[str, Any]) -> None:
        for value in outputs.values():
            if isinstance(value, RegistryDecision):
                self._decision = value

    @hook_impl(wrapper=True)
    def after_pipeline_run(self):
        try:
            result = yield
        except BaseException as error:  # another hook failed: that is the run's outcome
            self._ended()
            self._failed(error)
            raise
        self._ended()
        if (decision := self._decision) is not None:
            event = "promoted" if decision.champion else "rejected"
            self._send(event, model=decision.model_name, version=decision.version, decision=decision.decision,
                       metric=decision.metric, score=decision.candidate_value, champion_score=decision.champion_value,
                       champion_version=decision.previous_champion, reason=decision.reason, run_id=decision.run_id,
                       improvement=decision.improvement, interval=decision.interval, confidence=decision.confidence,
                       eval_texts=decision.eval_texts, val_loss=decision.val_loss, baseline=decision.baseline,
                       baseline_loss=decision.baseline_loss)
        return result

    @hook_impl(wrapper=True)
    def on_pipeline_error(self, error: Exception):
        try:
            return (yield)
        finally:  # after the other hooks, even one that failed ending its run: the error is the pipeline's
            self._ended()
            self._failed(error)

    def _ended(self) -> None:
        atexit.unregister(self._stopped)
        self._signals.restore()

    def _failed(self, error: BaseException) -> None:
        if isinstance(error, ValidationStopped):
            self._send("validation_stopped", reason=str(error).splitlines()[0], report=error.report.to_json())
            return
        stopped = self._signals.received if isinstance(error, KeyboardInterrupt | SystemExit) else None
        self._send_failed(describe_stop(stopped) if stopped else one_line(error), stopped)

    def _stopped(self) -> None:
        """At exit after the pipeline started and before it ended: a stop signal, or an error no hook saw (the one
        Python reported, if any)."""
        stopped, error = self._signals.received, getattr(sys, "last_value", None)
        reason = (describe_stop(stopped) if stopped else one_line(error) if error is not None
                  else "the run ended before its pipeline did, with no error or signal seen")
        self._send_failed(reason, stopped, wait=0.0)

    def _send_failed(self, reason: str, stopped: str | None, wait: float = HANDOFF_SECONDS) -> None:
        if stopped == "SIGTERM" and past_schedule_deadline():
            self._sent = True  # train-deploy schedule stopped the run at its limit: it sends "timed out"
            return
        self._send("failed", **self._where(), reason=reason, wait=wait)

    def _where(self) -> dict[str, Any]:
        log = project_log_file()
        return {"node": self._node, "stage": stages_of_nodes().get(self._node) if self._node else None,
                "log": str(log) if log else None}

    def _send(self, event: str, wait: float = HANDOFF_SECONDS, **fields: Any) -> None:
        if self._sent or not self._config.enabled:
            return
        self._sent = True
        try:
            process = hand_off(self._config, message(event, self._project, **fields), project_log_file())
        except Exception as exc:  # never decide a run's fate
            logger.warning("Could not notify the %s outcome: %s", event, one_line(exc))
            return
        if process is not None and wait > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(wait)  # a receiver that answers is told before the run ends; others are left
