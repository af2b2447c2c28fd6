"""One alert per run outcome (the ``notify`` block, ``train_deploy.run_control.notify``): failed, skipped, promoted or
rejected, validation stopped. A run that ends without an outcome worth telling (a corpus-only run that succeeded) sends
none.

The alert is handed to a delivery process of its own (``notify.hand_off``) after the run lock is given back
(:class:`train_deploy.hooks.life.RunLife` calls :meth:`RunAlerts.deliver` last as a run ends): the run waits at
most :data:`HANDOFF_SECONDS` for it, and never on a receiver. Its reason is the real cause: the
one-line, redacted form of the exception the run died of, with the node it was in; a signal is named only when
one arrived (``train_deploy.run_control.signals.StopSignals``).

A run killed outright (SIGKILL, a crashing native kernel) cannot say anything itself: its watch process
(``train_deploy.run_control.signals.RunWatch``) sends the ``failed`` alert with the stage and the signal. A run that
``train-deploy schedule`` stopped at its wall-clock limit is reported timed out by the scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from train_deploy.console import project_log_file
from train_deploy.hooks.runs import RunAbandoned, stages_of_nodes
from train_deploy.redaction import one_line
from train_deploy.registry.gate import RegistryDecision
from train_deploy.run_control.notify import NotifyConfig, hand_off, message
from train_deploy.run_control.retrain import NothingToRetrain
from train_deploy.run_control.signals import StopSignals, describe_stop, past_schedule_deadline
from train_deploy.validation.report import ValidationStopped

logger = logging.getLogger(__name__)

HANDOFF_SECONDS = 3.0
"""How long a run waits for its alert's delivery process before leaving it to finish alone (by its deadline)."""


class RunAlerts:
    """The run's outcome for ``notify``'s receivers, sent once: :class:`train_deploy.hooks.life.RunLife` tells it the
    node being run and the registry's decision, and calls :meth:`deliver` as the run ends, after the lock is given
    back. Made contexts that run no pipeline (``train-deploy gc`` reads the project's settings through one) send
    nothing."""

    def __init__(self, config: NotifyConfig | None = None, project: Path | None = None) -> None:
        self._config, self._project = config or NotifyConfig(), project
        self.node: str | None = None
        """The node being run, for a ``failed`` alert."""
        self._decision: RegistryDecision | None = None
        self._sent = False
        self._signals = StopSignals()

    def watch_signals(self) -> None:
        """Record which stop signal arrives, in front of the handlers in place now (the run's SIGTERM handler)."""
        self._signals = StopSignals().watch()

    def restore_signals(self) -> None:
        self._signals.restore()

    def node_finished(self, outputs: dict[str, Any]) -> None:
        for value in outputs.values():
            if isinstance(value, RegistryDecision):
                self._decision = value

    def deliver(self, error_type: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        """Send the outcome of a run that ended with ``error`` (None: it succeeded); an ``ExitStack`` exit callback."""
        if error is None:
            self._send_decision()
        elif isinstance(error, NothingToRetrain):
            self._send("skipped", reason=str(error))
        elif isinstance(error, RunAbandoned):
            self._abandoned()
        else:
            self.failed(error)

    def _send_decision(self) -> None:
        if (decision := self._decision) is None:
            return
        event = "promoted" if decision.champion else "rejected"
        self._send(event, model=decision.model_name, version=decision.version, decision=decision.decision,
                   metric=decision.metric, score=decision.candidate_value, champion_score=decision.champion_value,
                   champion_version=decision.previous_champion, reason=decision.reason, run_id=decision.run_id,
                   improvement=decision.improvement, interval=decision.interval, confidence=decision.confidence,
                   eval_texts=decision.eval_texts, val_loss=decision.val_loss, baseline=decision.baseline,
                   baseline_loss=decision.baseline_loss)

    def failed(self, error: BaseException) -> None:
        """Send ``failed`` (or ``validation_stopped``) for a run refused or stopped by ``error``."""
        if isinstance(error, ValidationStopped):
            self._send("validation_stopped", reason=str(error).splitlines()[0], report=error.report.to_json())
            return
        stopped = self._signals.received if isinstance(error, KeyboardInterrupt | SystemExit) else None
        self._send_failed(describe_stop(stopped) if stopped else _reason(error), stopped)

    def _abandoned(self) -> None:
        """At exit after the pipeline started and before it ended: a stop signal, or an error no hook saw (the one
        Python reported, if any). Not waited for: the process is exiting."""
        stopped, error = self._signals.received, getattr(sys, "last_value", None)
        reason = (describe_stop(stopped) if stopped else _reason(error) if error is not None
                  else "the run ended before its pipeline did, with no error or signal seen")
        self._send_failed(reason, stopped, wait=0.0)

    def _send_failed(self, reason: str, stopped: str | None, wait: float = HANDOFF_SECONDS) -> None:
        if stopped == "SIGTERM" and past_schedule_deadline():
            self._sent = True  # train-deploy schedule stopped the run at its limit: it sends "timed out"
            return
        self._send("failed", **self._where(), reason=reason, wait=wait)

    def _where(self) -> dict[str, Any]:
        log = project_log_file()
        return {"node": self.node, "stage": stages_of_nodes().get(self.node) if self.node else None,
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


def _reason(error: BaseException) -> str:
    """What an alert says a run died of: the error's one line, or for Kedro's dataset errors (whose first line
    names the dataset by its class and absolute path) the error that caused them, the node being in the alert."""
    while type(error).__name__ == "DatasetError" and error.__cause__ is not None:
        error = error.__cause__
    return one_line(error)
