"""The steps of a run's life that :class:`train_deploy.hooks.life.RunLife` takes in order: the previous holder of the
lock reported, leftovers removed, settings checked before the first node, nothing retrained when nothing changed,
and the MLflow run ended ``FINISHED``, ``FAILED`` or ``KILLED`` whatever way the Kedro run ends."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow

from train_deploy.atomic import clean_leftovers, remove_leftovers
from train_deploy.datasets import ArtifactFolderDataset, WorkFolderDataset
from train_deploy.run_control.preflight import check_run, check_writable
from train_deploy.run_control.retrain import CHECKED_NODES, OUTCOME_TAG, REASON_TAG, NothingToRetrain, check_for_changes
from train_deploy.run_control.signals import end_run_failed

logger = logging.getLogger(__name__)


def stages_of_nodes() -> dict[str, str]:
    """The stage (pipeline of ``pipeline_registry.STAGES``) of each node."""
    from kedro.framework.project import pipelines

    from train_deploy.pipeline_registry import STAGES

    try:
        return {node.name: stage for stage in STAGES if stage in pipelines for node in pipelines[stage].nodes}
    except Exception as exc:  # a stage that cannot be built now failed the run already; never fail it here
        logger.debug("No stages of nodes: %s", exc)
        return {}


def report_dead_holder(previous: dict) -> None:
    """The previous run died holding the lock (a signal, or its machine stopped): say where, and end its MLflow
    run ``FAILED`` if it is still ``RUNNING``."""
    where = f", in node {previous['node']}" if previous.get("node") else ""
    ended = (end_run_failed(previous["mlflow_run_id"], f"died in {previous.get('node') or 'the run'}")
             if previous.get("mlflow_run_id") else "it had no MLflow run")
    logger.warning("The previous run (pid %s, pipeline %s, started %s%s) ended without giving the lock back: %s",
                   previous.get("pid"), previous.get("pipeline"), previous.get("started_at"), where, ended)


def report_leftovers(data: Path, catalog) -> None:
    """Remove what interrupted runs left where this project writes (under the lock: nobody writes now)."""
    removed = clean_leftovers(data)
    for name in catalog:
        dataset = catalog.get(name)
        if isinstance(dataset, ArtifactFolderDataset | WorkFolderDataset):
            folder, store = dataset.folder, getattr(dataset, "store", None)
            if not folder.is_relative_to(data):  # data/ was walked already
                removed += clean_leftovers(store or folder)
                removed += remove_leftovers(folder.parent, prefix=f".{folder.name}.")
    if removed:
        logger.warning("Removed %d leftover(s) of interrupted runs: %s%s", len(removed),
                       ", ".join(str(p) for p in removed[:5]), " …" if len(removed) > 5 else "")


class RunAbandoned(BaseException):
    """The process exits with the run still open: stopped between its hooks (Ctrl-C, SIGTERM, ``SystemExit``), or an
    error no hook saw."""


def check_configuration(pipeline, catalog) -> dict[str, Any]:
    """Refuse a run whose parameters are invalid, or whose outputs cannot be written, with one line naming the key
    (``train_deploy.run_control.preflight``): every stage block, and what the pipeline's stages need of each other.
    Return the typed blocks by name."""
    stages = {name.removeprefix("params:") for name in pipeline.inputs() if name.startswith("params:")}
    configs = check_run(catalog.load("parameters"), stages)
    check_writable(catalog, pipeline)
    return configs


def skip_if_unchanged(pipeline, catalog, configs: dict[str, Any] | None = None) -> None:
    """A run that trains and registers compares its corpus and training configuration with the champion's
    (``train_deploy.run_control.retrain``) and tags its MLflow run with the fingerprints and the reason; when nothing
    changed it is tagged ``outcome=skipped`` and :class:`NothingToRetrain` stops the session (``kedro run`` exits 0
    saying why, see ``train_deploy.cli``). ``configs``: the run's blocks, built once (else read from the catalog)."""
    if not CHECKED_NODES <= {node.name for node in pipeline.nodes}:
        return
    active = mlflow.active_run() is not None
    check = check_for_changes(configs or catalog.load("parameters"))
    if active:
        mlflow.set_tags({**check.fingerprints, REASON_TAG: check.reason})
    if check.retrain:
        logger.info("Retraining: %s", check.reason)
        return
    if active:
        mlflow.set_tag(OUTCOME_TAG, "skipped")
    raise NothingToRetrain(check.reason)


def end_mlflow_runs(outer_run_id: str | None, status: str = "FINISHED") -> None:
    """End the active MLflow runs down to the run ``outer_run_id`` (open before the session; None: all).

    kedro-mlflow re-opens its run before every node; with MLflow 3 that leaves the run on the active-run stack after
    kedro-mlflow ends it, so a second KedroSession in the same process (a scheduler, a notebook, the tests) would log
    into the first run. A run active before the session started is left open, as kedro-mlflow documents."""
    while (run := mlflow.active_run()) is not None and run.info.run_id != outer_run_id:
        mlflow.end_run(status)


def run_status(error: BaseException | None) -> str:
    """How a run that ended with ``error`` (None: none) is recorded in MLflow."""
    if error is None or isinstance(error, NothingToRetrain):
        return "FINISHED"
    return "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit | RunAbandoned) else "FAILED"


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While the run is open, SIGTERM (when nobody else handles it) exits with status 143 through ``SystemExit``, so
    ``finally`` blocks and exit handlers run, as Ctrl-C's ``KeyboardInterrupt`` does."""
    previous = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
