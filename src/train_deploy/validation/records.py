"""Corpus statistics in MLflow: the champion's, read from a tag of its registered version (one registry call,
from any machine that reaches the tracking server), and tonight's, with the data gate's report, on the run."""

from __future__ import annotations

import json
import logging

import mlflow
from mlflow import MlflowClient

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


def statistics_tags(statistics: CorpusStatistics) -> dict[str, str]:
    """The registered version's tag holding ``statistics``."""
    return {STATISTICS_TAG: statistics.compact()}


def record_on_run(report: ValidationReport) -> None:
    """Tonight's statistics and the report as artifacts of the active MLflow run, the outcome as its tags (no
    active run: nothing)."""
    if mlflow.active_run() is None:
        return
    mlflow.set_tags({OUTCOME_TAG: report.outcome, CHAMPION_TAG: report.champion_version or "none",
                     FAILED_TAG: ",".join(finding.statistic for finding in report.failures)[:5000] or "none"})
    mlflow.log_dict(report.tonight, f"{ARTIFACTS}/corpus_statistics.json")
    mlflow.log_dict(report.to_json(), f"{ARTIFACTS}/report.json")
