"""Corpus statistics in MLflow: the champion's, read from a tag of its registered version (one registry call,
from any machine that reaches the tracking server), and tonight's, with the data gate's report, on the run; the
champion's bundle, downloaded for the night to score tonight's sample with."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.history import CHAMPION, alias_version
from train_deploy.registry.retry import Retrying
from train_deploy.validation.report import ValidationReport
from train_deploy.validation.statistics import CorpusStatistics

logger = logging.getLogger(__name__)

STATISTICS_TAG = "validation.corpus_statistics"
"""Tag of a registered version: the statistics of the corpus it was trained on (compact JSON)."""
OUTCOME_TAG, CHAMPION_TAG, FAILED_TAG = "validation.outcome", "validation.champion_version", "validation.failed"
ARTIFACTS = "validation"
"""The run's artifact folder: ``corpus_statistics.json`` and ``report.json``."""


def champion_statistics(config: RegistryConfig) -> tuple[str, CorpusStatistics | None] | None:
    """The champion's version and the statistics it records (None: registered before the data gate), or None
    when ``config.model_name`` has no champion."""
    client = MlflowClient()
    retry = Retrying(config.retries, client.tracking_uri)
    version = retry("find the champion", lambda: alias_version(client, config.model_name, CHAMPION))
    if version is None:
        return None
    tags = retry("read the champion's tags", lambda: client.get_model_version(config.model_name, version).tags)
    recorded = tags.get(STATISTICS_TAG)
    return version, CorpusStatistics.from_json(json.loads(recorded)) if recorded else None


@contextlib.contextmanager
def champion_bundle(config: RegistryConfig, champion: tuple[str, CorpusStatistics | None] | None
                    ) -> Iterator[Path | None]:
    """The champion's bundle downloaded into a temporary folder for the ``with`` block (removed after); None when
    there is no champion, it records no loss of its own to compare with (registered before issue 39), or its bundle
    cannot be downloaded (said in the log: the gate after training fails on a champion it cannot score)."""
    if champion is None or champion[1] is None or champion[1].nats_per_char is None:
        if champion is not None and champion[1] is not None:
            logger.info("%s version %s (champion) records no loss on its own corpus (registered before the content "
                        "checks): nats_per_char is not compared tonight", config.model_name, champion[0])
        yield None
        return
    version, client = champion[0], MlflowClient()
    uri = f"models:/{config.model_name}/{version}/artifacts/bundle"
    retry = Retrying(config.retries, client.tracking_uri)
    with tempfile.TemporaryDirectory(prefix="train_deploy-data-gate-") as folder:
        try:
            found = retry("download the champion's bundle",
                          lambda: mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=folder))
        except MlflowException as exc:
            logger.warning("%s version %s (champion): its bundle could not be downloaded (%s); tonight's text is not "
                           "scored", config.model_name, version, exc.message.splitlines()[0][:300])
            found = None
        yield Path(found) if found else None


def statistics_tags(statistics: CorpusStatistics) -> dict[str, str]:
    """The registered version's tag holding ``statistics``."""
    return {STATISTICS_TAG: statistics.compact()}


def record_on_run(report: ValidationReport) -> None:
    """Tonight's statistics and the report as artifacts of the active MLflow run, the outcome as its tags, and what
    ``validation.screening: drop`` dropped as its ``validation.screening.*`` metrics (no active run: nothing)."""
    if mlflow.active_run() is None:
        return
    mlflow.set_tags({OUTCOME_TAG: report.outcome, CHAMPION_TAG: report.champion_version or "none",
                     FAILED_TAG: ",".join(finding.statistic for finding in report.failures)[:5000] or "none"})
    mlflow.log_dict(report.tonight, f"{ARTIFACTS}/corpus_statistics.json")
    mlflow.log_dict(report.to_json(), f"{ARTIFACTS}/report.json")
    if report.dropped is not None:
        mlflow.log_metrics({"validation.screening.scored": report.dropped.scored,
                            "validation.screening.dropped": report.dropped.dropped,
                            "validation.screening.dropped_share": report.dropped.share})
