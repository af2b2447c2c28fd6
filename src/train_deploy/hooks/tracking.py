"""What MLflow records: the local store's mode and artifact location, the tags of a run (:class:`LineageTags`, the one
hook here), and the corpus a registered model is gated on."""

from __future__ import annotations

import logging
import os
import re
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import mlflow
from kedro.framework.hooks import hook_impl

from train_deploy.project import is_local_store
from train_deploy.registry.relocate import check_locations
from train_deploy.run_control.schedule import TRIGGER_VARIABLE


def use_wal_mode() -> None:
    """The local SQLite tracking store in write-ahead-log mode: the MLflow UI or a scheduler reading it while a
    run writes does not make the run fail with "database is locked" (readers no longer block the writer). Once
    kedro-mlflow has set the tracking URI (and created the store)."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("sqlite:///"):
        return
    with sqlite3.connect(uri.removeprefix("sqlite:///"), timeout=30) as connection:
        connection.execute("PRAGMA journal_mode=WAL")  # stored in the database file: once is enough


def tag_trigger() -> None:
    """Tag the MLflow run with what started it: ``trigger`` = ``schedule`` for ``train-deploy schedule`` (which
    sets ``TRAIN_DEPLOY_TRIGGER``), ``manual`` otherwise."""
    if mlflow.active_run() is not None:
        mlflow.set_tag("trigger", os.environ.get(TRIGGER_VARIABLE) or "manual")


def tag_runner(run_params: dict) -> None:
    """``runner``: the runner's class name, not its object repr (kedro-mlflow tags the repr)."""
    if mlflow.active_run() is not None:
        mlflow.set_tag("runner", _runner_name(str(run_params.get("runner"))))


def check_store_locations(context) -> None:
    """Once kedro-mlflow has set the tracking URI and created the experiment: a local store whose artifact
    locations name the old folder of a moved project stops the run in one line saying what to run (MLflow would
    write the run's artifacts into that folder again); locations recorded relative by earlier releases are a
    warning. kedro-mlflow and MLflow record them absolute, so MLflow's own tools load from any folder
    (``train_deploy.registry.relocate``)."""
    config = getattr(context, "mlflow", None)
    if config is None:
        return
    location = config.tracking.experiment.create_experiment_kwargs.artifact_location or ""
    if location.startswith("file:") and mlflow.get_tracking_uri().startswith("sqlite:"):
        # the folder exists from the first run on, so a copy of the project has it and a move is recognised
        Path(urlsplit(location).path).mkdir(parents=True, exist_ok=True)
    warning = check_locations(mlflow.get_tracking_uri(), Path(context.project_path))
    if warning is not None:
        logging.getLogger(__name__).warning(warning)


def settle_artifact_location(context) -> None:
    """A relative local ``artifact_location`` in the run's mlflow.yml, before kedro-mlflow reads it: none for a
    tracking server, absolute in the project for a local store (``train_deploy.project.is_local_store``).

    conf/base's ``mlartifacts`` is resolved against conf/base's own tracking URI, before conf/<env> names a server
    (``--env team``, a conf/local ``mlflow.yml``): a server then chooses the location (with --serve-artifacts it
    proxies them), or the experiment a first run creates there would keep every artifact on that one machine's disk;
    a local store gets the project's ``mlartifacts/`` as an absolute location (kedro-mlflow logs a line about every
    relative one)."""
    config = context.config_loader["mlflow"]
    kwargs = ((config.get("tracking") or {}).get("experiment") or {}).get("create_experiment_kwargs") or {}
    location, uri = kwargs.get("artifact_location"), (config.get("server") or {}).get("mlflow_tracking_uri")
    if not location or not uri or "://" in str(location) or Path(str(location)).is_absolute():
        return
    kwargs["artifact_location"] = (Path(context.project_path) / str(location)).as_uri() if is_local_store(str(uri)) \
        else None
    context.config_loader["mlflow"] = config


class LineageTags:
    """Tags that link the runs of single stages (``--pipelines corpus``, then ``training``, …): every run that
    reads the token files carries ``corpus.fingerprint``, every run that reads or writes a training result its
    ``training.run_name``. Independent of every other hook: it tags whatever MLflow run is active."""

    TAGS = {"token_files": ("corpus.fingerprint", "fingerprint"),
            "training_result": ("training.run_name", "run_name")}

    @hook_impl
    def after_dataset_loaded(self, dataset_name: str, data) -> None:
        self._tag(dataset_name, data)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, data) -> None:
        self._tag(dataset_name, data)

    def _tag(self, dataset_name: str, data) -> None:
        tag, field = self.TAGS.get(dataset_name, (None, ""))
        value = getattr(data, field, None)
        if tag and isinstance(value, str) and mlflow.active_run() is not None:
            mlflow.set_tag(tag, value)


def _runner_name(recorded: str) -> str:
    """The runner's class name from what Kedro records: an instance's repr, a class's name, or ``None`` for its
    default runner."""
    if recorded == "None":
        return "SequentialRunner"
    instance = re.fullmatch(r"<([\w.]+) object at 0x[0-9a-fA-F]+>", recorded)
    return instance.group(1).rsplit(".", 1)[-1] if instance else recorded


def check_own_corpus(pipeline, catalog, configs: dict[str, Any] | None = None) -> None:
    """A run that registers a model is refused before its first node when the model's evaluation set comes from
    another corpus (``train_deploy.registry.lineage``; ``registry.other_corpus``). A set of fewer than
    ``registry.eval_set.min_texts`` texts is the gate's own verdict (``undecided``), not a warning here.
    ``configs``: the run's blocks, built once (else the registry block is read from the catalog)."""
    if "registry_decision" not in pipeline.all_outputs():
        return
    from train_deploy.registry.config import RegistryConfig
    from train_deploy.registry.lineage import check_same_corpus
    from train_deploy.registry.retry import Retrying

    params = catalog.load("parameters")
    config = RegistryConfig.from_params((configs or params).get("registry"))
    retry = Retrying(config.retries, mlflow.get_tracking_uri())
    retry("read the evaluation set's corpus",
          lambda: check_same_corpus(mlflow.MlflowClient(), config, params.get("corpus")))
