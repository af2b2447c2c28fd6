"""One owner for a run's life: :class:`RunLife`, the hook that takes a run from its session's start to its end.

Read top to bottom, it is the run's life. As the session starts (``after_context_created``): the log file and the
console, secrets kept out of streams, the signal handlers, the tracking server checked. As the pipeline starts
(``before_pipeline_run``), one ``contextlib.ExitStack`` takes, in order, what must be given back in the opposite
order: the alert (delivered last, after the lock is free: a slow receiver never holds the project), the run lock,
the MLflow run (ended ``FINISHED``, ``FAILED`` or ``KILLED``), SIGTERM as ``SystemExit``; then the preflight
checks. kedro-mlflow opens its run; then the run is tagged, the skip decision is made and the run's watch started.
Whichever way the run ends (``after_pipeline_run``, ``on_pipeline_error``, an error in a hook, or the process
exiting with the run open), the stack is closed once, with the error the run ended with.

Every hook here that must come before or after another is a pluggy wrapper, so it runs around every plain hook,
kedro-mlflow's included, whatever order ``settings.HOOKS`` lists them in; the project registers no other wrapper and no
``tryfirst``/``trylast``, so nothing depends on the order of registration (``tests/hooks/test_life.py`` runs a pipeline
with the hooks reversed).

Why kedro-mlflow's hook stays, and only its run's end is taken over (measured): its hook (545 lines, with its
configuration model another 301) parses and validates ``mlflow.yml`` (``context.mlflow``, which ``kedro mlflow ui``
and ``tracking.check_store_locations`` read), sets the tracking URI and creates the experiment, tags the run with
the run parameters and ``kedro_command``, logs every node's parameters (flattened, with the long-parameter strategy),
names the metric datasets after their catalog entries, and turns dataset logging off for pipelines ``mlflow.yml``
excludes: all of it would be ours to copy and keep in step with its releases. What it gets wrong for this project is
only the run's end: it re-opens the run before each node, which MLflow 3 leaves on the active-run stack after it ends
the run, and it cannot see a run stopped before its first node or by a signal. Ending the runs down to the outer one,
with the status the run's end decides, after its own end is one function (``runs.end_mlflow_runs``), where three
hooks (``CloseMlflowRun``, ``EndStoppedRun``, ``OuterRunAware``) undid its reopening before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import mlflow
from kedro.framework.context import KedroContext
from kedro.framework.hooks import hook_impl
from kedro.io import CatalogProtocol
from kedro.pipeline import Node, Pipeline

from train_deploy.config import unset_values
from train_deploy.console import project_log_file
from train_deploy.hooks.alerts import RunAlerts
from train_deploy.hooks.display import open_console
from train_deploy.hooks.runs import (
    RunAbandoned,
    check_configuration,
    end_mlflow_runs,
    report_dead_holder,
    report_leftovers,
    run_status,
    sigterm_exits,
    skip_if_unchanged,
    stages_of_nodes,
)
from train_deploy.hooks.tracking import (
    check_own_corpus,
    check_store_locations,
    settle_artifact_location,
    tag_runner,
    tag_trigger,
    use_wal_mode,
)
from train_deploy.redaction import redact_mlflow, redact_streams
from train_deploy.run_control.lock import RunConfig, RunLock
from train_deploy.run_control.notify import NotifyConfig
from train_deploy.run_control.preflight import check_tracking
from train_deploy.run_control.signals import RunWatch, install_termination_handler, log_fatal_signals

logger = logging.getLogger(__name__)

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
Wrapper = Generator[None, Any, Any]
"""A pluggy wrapper: runs to its ``yield``, the other hooks run, then it gets their result or error."""


class RunLife:
    """A run from its session's start to its end: lock, MLflow run, signals, preflight, skip decision, alerts.

    A refused run (the lock held, a bad setting, another corpus's evaluation set) is refused before kedro-mlflow
    opens its MLflow run, so it leaves none. Once the run has its MLflow run, the lock's holder record names it, and
    the node being run as each starts; a :class:`~train_deploy.run_control.signals.RunWatch` reports this process's
    death by a signal from that record, and ``faulthandler`` writes the fatal signal's traceback into the log file. A
    record left by a run that died holding the lock is reported by the next run, which ends that MLflow run ``FAILED``
    if nobody did."""

    def __init__(self) -> None:
        self._lock: RunLock | None = None
        self._config = RunConfig()
        self._notify: dict | None = None
        self._alerts = RunAlerts()
        self._outer_run_id: str | None = None
        self._stack: contextlib.ExitStack | None = None
        self._watch: RunWatch | None = None
        self._stages: dict[str, str] = {}
        self._configs: dict[str, Any] = {}

    @hook_impl(wrapper=True)
    def after_context_created(self, context: KedroContext) -> Wrapper:
        open_console(context.project_path)
        redact_streams()  # again: something may have replaced a stream or the exception hook since the import
        redact_mlflow()
        install_termination_handler()  # Paddle's signal handlers never replace this process's
        if (log := project_log_file()) is not None:
            log_fatal_signals(log)
        self._alerts = RunAlerts()
        try:
            self._start_session(context)
            result = yield  # kedro-mlflow: the tracking URI, the experiment
            use_wal_mode()
            check_store_locations(context)
        except BaseException as error:  # a run refused as its session starts (the tracking server is gone)
            self._alerts.failed(error)
            raise
        return result

    def _start_session(self, context: KedroContext) -> None:
        """What the session's runs share: the lock, the settings of ``run`` and ``notify``, the outer MLflow run (a
        notebook's, a caller's: kedro-mlflow logs into it and it stays open), the tracking server checked."""
        project = Path(context.project_path)
        self._notify = context.params.get("notify")
        self._alerts = RunAlerts(NotifyConfig.from_params(self._notify), project)
        self._lock = RunLock(project / "data")
        self._config = RunConfig.from_params(context.params.get("run"))
        run = mlflow.active_run()
        self._outer_run_id = run.info.run_id if run else None
        settle_artifact_location(context)
        if self._outer_run_id is None:  # with an outer run kedro-mlflow reads no mlflow.yml
            check_tracking(context.config_loader)

    @hook_impl(wrapper=True)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Pipeline, catalog: CatalogProtocol) -> Wrapper:
        self._stack = contextlib.ExitStack()
        atexit.register(self._abandoned)  # SystemExit (SIGTERM) skips after_pipeline_run and on_pipeline_error
        try:
            self._begin(self._stack, run_params, pipeline, catalog)
            result = yield  # kedro-mlflow opens the MLflow run
            self._opened(self._stack, run_params, pipeline, catalog)
        except BaseException:  # Kedro calls no on_pipeline_error before the first node
            self._end(sys.exc_info())
            raise
        return result

    def _begin(self, stack: contextlib.ExitStack, run_params: dict[str, Any], pipeline: Pipeline,
               catalog: CatalogProtocol) -> None:
        """Before the MLflow run opens; what is pushed here is undone in the opposite order."""
        stack.push(self._alerts.deliver)  # last: after the lock is given back
        stack.enter_context(self._held(run_params, catalog))
        stack.callback(self._end_watch)
        stack.push(self._end_mlflow_runs)
        stack.enter_context(sigterm_exits())
        self._configs = check_configuration(pipeline, catalog)  # the run's configuration, parsed once
        check_own_corpus(pipeline, catalog, self._configs)

    def _opened(self, stack: contextlib.ExitStack, run_params: dict[str, Any], pipeline: Pipeline,
                catalog: CatalogProtocol) -> None:
        """Once kedro-mlflow has opened the MLflow run: tag it, skip it if nothing changed, watch it."""
        tag_trigger()
        self._log_defaults(pipeline, catalog)
        skip_if_unchanged(pipeline, catalog, self._configs)
        tag_runner(run_params)
        self._watch_run()
        self._alerts.watch_signals()  # in front of the SIGTERM handler set above
        stack.callback(self._alerts.restore_signals)

    def _log_defaults(self, pipeline: Pipeline, catalog: CatalogProtocol) -> None:
        """Put every setting the run leaves to its type's default on the MLflow run, so that the run records its
        whole configuration: kedro-mlflow logs only what the parameter files and ``--params`` give each node, and
        ``conf/base`` holds only what differs from the defaults."""
        if mlflow.active_run() is None:
            return
        given, used = catalog.load("parameters"), {name.removeprefix("params:") for name in pipeline.inputs()}
        values = {}
        for name, config in self._configs.items():
            # a block no node takes is not logged by kedro-mlflow: its given values are logged here too
            values |= unset_values(config, given.get(name) if name in used else None, name)
        mlflow.log_params({key: _param(value) for key, value in values.items()})

    @contextlib.contextmanager
    def _held(self, run_params: dict[str, Any], catalog: CatalogProtocol) -> Iterator[RunLock]:
        """One run at a time per project (``run.lock: fail | wait``, see ``train_deploy.run_control.lock``)."""
        lock = self._lock
        if lock is None:
            raise RuntimeError("The run lock is taken after the Kedro context is created")
        lock.acquire(self._config, ", ".join(run_params.get("pipeline_names") or ["__default__"]))
        try:
            if lock.previous:
                report_dead_holder(lock.previous)
            report_leftovers(lock.folder, catalog)
            yield lock
        finally:
            lock.release()

    def _watch_run(self) -> None:
        lock, run = self._lock, mlflow.active_run()
        if lock is None:
            return
        lock.record(mlflow_run_id=run.info.run_id if run else None)
        self._stages = stages_of_nodes()
        self._watch = RunWatch(lock.holder_path, project_log_file(), mlflow.get_tracking_uri() if run else None,
                               self._notify)

    def _end_watch(self) -> None:
        if self._watch is not None:
            self._watch.ended()
            self._watch = None

    def _end_mlflow_runs(self, error_type: type[BaseException] | None, error: BaseException | None,
                         traceback: TracebackType | None) -> None:
        end_mlflow_runs(self._outer_run_id, run_status(error))

    @hook_impl(wrapper=True)
    def before_node_run(self, node: Node) -> Wrapper:
        self._alerts.node = node.name  # before kedro-mlflow's, which fails first when the server is gone
        if self._lock is not None and self._watch is not None:
            if (log := project_log_file()) is not None:
                log_fatal_signals(log)  # the log may have been rotated
            self._lock.record(node=node.name, stage=self._stages.get(node.name))
        results = yield
        # The node gets the blocks parsed once for the run in place of their parameter mappings (kedro-mlflow, which
        # ran above, logged the mappings); each stage's from_params passes a built block on as it is.
        typed = {name: self._configs[name.removeprefix("params:")] for name in node.inputs
                 if name.startswith("params:") and name.removeprefix("params:") in self._configs}
        return [*(results or []), typed] if typed else results

    @hook_impl
    def after_node_run(self, outputs: dict[str, Any]) -> None:
        self._alerts.node_finished(outputs)

    @hook_impl(wrapper=True)
    def after_pipeline_run(self) -> Wrapper:
        try:
            result = yield  # kedro-mlflow ends its run; ShowResults prints what the run made
        except BaseException:  # a hook failed (kedro-mlflow's, when the server is gone): that is the outcome
            self._end(sys.exc_info())
            raise
        self._end((None, None, None))
        return result

    @hook_impl(wrapper=True)
    def on_pipeline_error(self, error: Exception) -> Wrapper:
        try:
            return (yield)
        finally:  # even when another hook failed ending its run: the error is the pipeline's
            self._end((type(error), error, error.__traceback__))

    def _end(self, exc_info: ExcInfo) -> None:
        """Close the run's stack once: the MLflow run ended, the lock given back, then the alert sent."""
        atexit.unregister(self._abandoned)
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc_info)

    def _abandoned(self) -> None:
        """At exit with the run still open: its MLflow run ends ``KILLED``, the lock is given back, the alert sent."""
        try:
            self._end((RunAbandoned, RunAbandoned(), None))
        except Exception as exc:  # an exit handler must not raise; the tracking server may be gone
            logger.warning("Could not end the abandoned run: %s", exc)


def _param(value: Any) -> Any:
    """A value as kedro-mlflow's ``truncate`` strategy logs it: MLflow refuses longer parameter values."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    return value if len(str(value)) <= MAX_PARAM_VAL_LENGTH else str(value)[:MAX_PARAM_VAL_LENGTH]
