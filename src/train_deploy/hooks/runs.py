"""Hooks around one run: one run at a time per project, settings checked before the first node, nothing retrained
when nothing changed, and its MLflow run ended whatever way the Kedro run ends."""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from pathlib import Path

import mlflow
from kedro.framework.hooks import hook_impl

from train_deploy.atomic import clean_leftovers, remove_leftovers
from train_deploy.console import project_log_file
from train_deploy.datasets import ArtifactFolderDataset, WorkFolderDataset
from train_deploy.preflight import check_run, check_tracking, check_writable
from train_deploy.redaction import redact_mlflow, redact_streams
from train_deploy.retrain import CHECKED_NODES, OUTCOME_TAG, REASON_TAG, NothingToRetrain, check_for_changes
from train_deploy.run_lock import RunConfig, RunLock
from train_deploy.signals import RunWatch, end_run_failed, install_termination_handler, log_fatal_signals

logger = logging.getLogger(__name__)


class ProjectRunLock:
    """One run at a time per project (``run.lock: fail | wait``, see ``train_deploy.run_lock``), and what a killed
    run leaves said (``train_deploy.signals``).

    A wrapper around the other ``before_pipeline_run`` hooks: the lock is taken before kedro-mlflow opens a
    run (a refused run leaves no MLflow run behind) and given back if any of them fails. Once the run has its
    MLflow run, the lock's holder record names it, and the node being run as each starts; a
    :class:`~train_deploy.signals.RunWatch` reports this process's death by a signal from that record, and
    ``faulthandler`` writes the fatal signal's traceback into the log file. Paddle's signal handlers never
    replace this process's (:func:`~train_deploy.signals.install_termination_handler`). A record left by a run
    that died holding the lock is reported by the next run, which ends that MLflow run ``FAILED`` if nobody did.
    """

    def __init__(self) -> None:
        self._lock: RunLock | None = None
        self._config = RunConfig()
        self._watch: RunWatch | None = None
        self._stages: dict[str, str] = {}
        self._notify: dict | None = None

    @hook_impl
    def after_context_created(self, context) -> None:
        redact_streams()  # again: something may have replaced a stream or the exception hook since the import
        redact_mlflow()
        install_termination_handler()
        if (log := project_log_file()) is not None:  # ConsoleLogging (tryfirst) opened it
            log_fatal_signals(log)
        self._lock = RunLock(Path(context.project_path) / "data")
        self._config = RunConfig.from_params(context.params.get("run"))
        self._notify = context.params.get("notify")

    @hook_impl(wrapper=True)
    def before_pipeline_run(self, run_params, catalog):
        if self._lock is not None:
            self._lock.acquire(self._config, ", ".join(run_params.get("pipeline_names") or ["__default__"]))
            atexit.register(self._release)  # SystemExit (SIGTERM) skips after_pipeline_run and on_pipeline_error
        try:
            if self._lock is not None and self._lock.previous:
                _report_dead_holder(self._lock.previous)
            _report_leftovers(self._lock.folder if self._lock else None, catalog)
            result = yield
            if self._lock is not None:
                self._watch_run(self._lock)
            return result
        except BaseException:
            self._release()
            raise

    def _watch_run(self, lock: RunLock) -> None:
        run = mlflow.active_run()
        lock.record(mlflow_run_id=run.info.run_id if run else None)
        self._stages = stages_of_nodes()
        self._watch = RunWatch(lock.holder_path, project_log_file(), mlflow.get_tracking_uri() if run else None,
                               self._notify)

    @hook_impl
    def before_node_run(self, node) -> None:
        if self._lock is not None and self._watch is not None:
            if (log := project_log_file()) is not None:
                log_fatal_signals(log)  # the log may have been rotated
            self._lock.record(node=node.name, stage=self._stages.get(node.name))

    @hook_impl(wrapper=True)
    def after_pipeline_run(self):
        try:
            return (yield)
        finally:  # after the other hooks, even one that failed (kedro-mlflow's, when the server is gone)
            self._release()

    @hook_impl(wrapper=True)
    def on_pipeline_error(self):
        try:
            return (yield)
        finally:
            self._release()

    def _release(self) -> None:
        atexit.unregister(self._release)
        if self._watch is not None:
            self._watch.ended()
            self._watch = None
        if self._lock is not None:
            self._lock.release()


def stages_of_nodes() -> dict[str, str]:
    """The stage (pipeline of ``pipeline_registry.STAGES``) of each node."""
    from kedro.framework.project import pipelines

    from train_deploy.pipeline_registry import STAGES

    try:
        return {node.name: stage for stage in STAGES if stage in pipelines for node in pipelines[stage].nodes}
    except Exception as exc:  # a stage that cannot be built now failed the run already; never fail it here
        logger.debug("No stages of nodes: %s", exc)
        return {}


def _report_dead_holder(previous: dict) -> None:
    """The previous run died holding the lock (a signal, or its machine stopped): say where, and end its MLflow
    run ``FAILED`` if it is still ``RUNNING``."""
    where = f", in node {previous['node']}" if previous.get("node") else ""
    ended = (end_run_failed(previous["mlflow_run_id"], f"died in {previous.get('node') or 'the run'}")
             if previous.get("mlflow_run_id") else "it had no MLflow run")
    logger.warning("The previous run (pid %s, pipeline %s, started %s%s) ended without giving the lock back: %s",
                   previous.get("pid"), previous.get("pipeline"), previous.get("started_at"), where, ended)


def _report_leftovers(data: Path | None, catalog) -> None:
    """Remove what interrupted runs left where this project writes (under the lock: nobody writes now)."""
    removed = clean_leftovers(data) if data is not None else []
    for name in catalog:
        dataset = catalog.get(name)
        if isinstance(dataset, ArtifactFolderDataset | WorkFolderDataset):
            folder, store = dataset.folder, getattr(dataset, "store", None)
            if data is None or not folder.is_relative_to(data):  # data/ was walked already
                removed += clean_leftovers(store or folder)
                removed += remove_leftovers(folder.parent, prefix=f".{folder.name}.")
    if removed:
        logger.warning("Removed %d leftover(s) of interrupted runs: %s%s", len(removed),
                       ", ".join(str(p) for p in removed[:5]), " …" if len(removed) > 5 else "")


class CheckConfiguration:
    """Refuse a run whose parameters are invalid before any node runs, with one line naming the key.

    Every stage block is validated, and what the pipeline's stages need of each other is checked
    (``train_deploy.preflight``). ``tryfirst``: before kedro-mlflow opens its run, so a refused run leaves none.
    A tracking server that does not answer or refuses the credentials stops the session as it starts, with one
    line naming its URI and what to set, before kedro-mlflow asks it with minutes of retries.
    """

    @hook_impl(tryfirst=True)
    def after_context_created(self, context) -> None:
        if mlflow.active_run() is None:  # an outer run: kedro-mlflow logs into it and reads no mlflow.yml
            check_tracking(context.config_loader)

    @hook_impl(tryfirst=True)
    def before_pipeline_run(self, pipeline, catalog) -> None:
        stages = {name.removeprefix("params:") for name in pipeline.inputs() if name.startswith("params:")}
        check_run(catalog.load("parameters"), stages)
        check_writable(catalog, pipeline)


class OuterRunAware:
    """Remembers the MLflow run that was active before the Kedro session started (a notebook's, a caller's): hooks
    that end runs leave that one open, as kedro-mlflow logs into it."""

    def __init__(self) -> None:
        self._outer_run_id: str | None = None

    @hook_impl
    def after_context_created(self) -> None:
        run = mlflow.active_run()
        self._outer_run_id = run.info.run_id if run else None


class CloseMlflowRun(OuterRunAware):
    """End the MLflow run of a Kedro run completely when the pipeline finishes or fails.

    kedro-mlflow re-opens its run before every node; with MLflow 3 that leaves the run on the
    active-run stack after kedro-mlflow ends it, so a second KedroSession in the same process (a
    scheduler, a notebook, the tests) would log into the first run. A run that was already active
    before the session started is left open, as kedro-mlflow documents.
    """

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._close()

    @hook_impl
    def on_pipeline_error(self) -> None:
        self._close()

    def _close(self) -> None:
        end_mlflow_runs(self._outer_run_id)


def end_mlflow_runs(outer_run_id: str | None, status: str = "FINISHED") -> None:
    """End the active MLflow runs down to the run ``outer_run_id`` (open before the session; None: all)."""
    while (run := mlflow.active_run()) is not None and run.info.run_id != outer_run_id:
        mlflow.end_run(status)


class SkipUnchanged(OuterRunAware):
    """A run that trains and registers first compares its corpus and training configuration with the champion's
    (``train_deploy.retrain``) and ends before its first node when nothing changed.

    ``trylast``: after kedro-mlflow has opened the run, which records the fingerprints and the reason, and, for
    a skipped run, ``outcome=skipped``; it is then closed as finished and :class:`NothingToRetrain` stops the
    session (``kedro run`` exits 0 saying why, see ``train_deploy.cli``).
    """

    @hook_impl(trylast=True)
    def before_pipeline_run(self, pipeline, catalog) -> None:
        if not CHECKED_NODES <= {node.name for node in pipeline.nodes}:
            return
        active = mlflow.active_run() is not None
        check = check_for_changes(catalog.load("parameters"))  # if it fails, EndStoppedRun ends the run FAILED
        if active:
            mlflow.set_tags({**check.fingerprints, REASON_TAG: check.reason})
        if check.retrain:
            logger.info("Retraining: %s", check.reason)
            return
        if active:
            mlflow.set_tag(OUTCOME_TAG, "skipped")
        end_mlflow_runs(self._outer_run_id)
        raise NothingToRetrain(check.reason)


class EndStoppedRun(OuterRunAware):
    """A Kedro run that fails in a ``before_pipeline_run`` hook after kedro-mlflow opened its MLflow run ends it
    ``FAILED``; one stopped by SIGTERM or Ctrl-C ends it ``KILLED``. Neither stays ``RUNNING``, nor ends
    ``FINISHED`` by MLflow's exit handler. (A process killed outright, by SIGKILL or a fatal signal, can do
    nothing: :class:`ProjectRunLock`'s watch ends that run ``FAILED``.)

    From the first ``before_pipeline_run`` hook to the end of the pipeline, SIGTERM (when nobody else handles it)
    exits with status 143 through ``SystemExit``, so ``finally`` blocks and exit handlers run, as Ctrl-C's
    ``KeyboardInterrupt`` does.
    """

    def __init__(self) -> None:
        super().__init__()
        self._previous_sigterm = None

    @hook_impl(wrapper=True)
    def before_pipeline_run(self):
        # before the other hooks: a SIGTERM while kedro-mlflow opens the run or the checks run ends it KILLED too
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            result = yield
        except BaseException as error:  # Kedro calls no on_pipeline_error before the first node
            self._restore()
            end_mlflow_runs(self._outer_run_id, _stopped_status(error))
            raise
        atexit.register(self._end_abandoned)
        return result

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._restore()

    @hook_impl
    def on_pipeline_error(self) -> None:
        self._restore()

    def _restore(self) -> None:
        atexit.unregister(self._end_abandoned)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _end_abandoned(self) -> None:
        """At exit, a run still open was stopped between its hooks (Ctrl-C, SIGTERM, ``SystemExit``)."""
        try:
            end_mlflow_runs(self._outer_run_id, "KILLED")
        except Exception as exc:  # an exit handler must not raise; the tracking server may be gone
            logger.warning("Could not end the MLflow run as KILLED: %s", exc)


def _stopped_status(error: BaseException) -> str:
    return "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED"


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
