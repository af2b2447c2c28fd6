"""One alert per run outcome (the ``notify`` block, ``train_deploy.notify``): failed, skipped, promoted or rejected,
validation stopped. A run that ends without an outcome worth telling (a corpus-only run that succeeded) sends none.

A run killed outright (SIGKILL, a crashing native kernel) cannot say anything itself: its watch process
(``train_deploy.signals.RunWatch``) sends the ``failed`` alert with the stage and the signal.
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from train_deploy.console import project_log_file
from train_deploy.hooks.runs import stages_of_nodes
from train_deploy.notify import NotifyConfig, notify
from train_deploy.registry.gate import RegistryDecision, one_line
from train_deploy.retrain import NothingToRetrain
from train_deploy.validation.report import ValidationStopped

logger = logging.getLogger(__name__)


class RunAlerts:
    """Send the run's outcome to ``notify``'s receivers, once.

    Registered last, so its wrappers are the outermost: a run refused while its context is made (the tracking
    server does not answer) or refused or skipped before its first node is seen too. Made contexts that run no
    pipeline (``train-deploy gc`` reads the project's settings through one) send nothing. A SIGTERM skips
    Kedro's ``on_pipeline_error``: an exit handler reports it."""

    def __init__(self) -> None:
        self._config, self._project = NotifyConfig(), None
        self._node: str | None = None
        self._decision: RegistryDecision | None = None
        self._sent = False

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
        atexit.register(self._stopped)
        return result

    @hook_impl
    def before_node_run(self, node) -> None:
        self._node = node.name

    @hook_impl
    def after_node_run(self, outputs: dict[str, Any]) -> None:
        for value in outputs.values():
            if isinstance(value, RegistryDecision):
                self._decision = value

    @hook_impl
    def after_pipeline_run(self) -> None:
        atexit.unregister(self._stopped)
        if (decision := self._decision) is not None:
            event = "promoted" if decision.champion else "rejected"
            self._send(event, model=decision.model_name, version=decision.version, decision=decision.decision,
                       metric=decision.metric, score=decision.candidate_value, champion_score=decision.champion_value,
                       champion_version=decision.previous_champion, reason=decision.reason, run_id=decision.run_id,
                       improvement=decision.improvement, interval=decision.interval, confidence=decision.confidence,
                       eval_texts=decision.eval_texts, val_loss=decision.val_loss, baseline=decision.baseline,
                       baseline_loss=decision.baseline_loss)

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        atexit.unregister(self._stopped)
        self._failed(error)

    def _failed(self, error: BaseException) -> None:
        if isinstance(error, ValidationStopped):
            self._send("validation_stopped", reason=str(error).splitlines()[0], report=error.report.to_json())
            return
        stopped = isinstance(error, KeyboardInterrupt | SystemExit)
        self._send("failed", **self._where(), reason="stopped by a signal or Ctrl-C" if stopped else one_line(error))

    def _stopped(self) -> None:
        """At exit after the pipeline started and before it ended: stopped (SIGTERM, Ctrl-C) between hooks."""
        self._send("failed", **self._where(), reason="stopped by a signal or Ctrl-C")

    def _where(self) -> dict[str, Any]:
        log = project_log_file()
        return {"node": self._node, "stage": stages_of_nodes().get(self._node) if self._node else None,
                "log": str(log) if log else None}

    def _send(self, event: str, **fields: Any) -> None:
        if self._sent or not self._config.enabled:
            return
        self._sent = True
        try:
            notify(self._config, event, self._project, **fields)
        except Exception as exc:  # never decide a run's fate
            logger.warning("Could not notify the %s outcome: %s", event, one_line(exc))
