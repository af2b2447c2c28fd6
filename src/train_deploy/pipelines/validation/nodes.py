"""Node of the validation stage: the thin seam between the catalog and ``train_deploy.validation``."""

from __future__ import annotations

import logging
from typing import Any

import mlflow

from train_deploy.export.errors import BundleError
from train_deploy.handoffs import TokenizerInfo, TokenManifest
from train_deploy.registry.config import RegistryConfig
from train_deploy.retrain import OUTCOME_TAG, RetrainConfig
from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.content import SampleScores
from train_deploy.validation.records import champion_bundle, champion_statistics, record_on_run
from train_deploy.validation.report import ValidationStopped, decide
from train_deploy.validation.statistics import CorpusStatistics, measure_corpus

logger = logging.getLogger(__name__)
STOPPED = "validation_stopped"
"""The run's ``outcome`` tag when the data gate stopped it."""


def validate_corpus(validation: dict[str, Any], retrain: dict[str, Any], registry: dict[str, Any],
                    token_files: TokenManifest, tokenizer: TokenizerInfo) -> TokenManifest:
    """Return ``token_files`` once their statistics are within ``validation``'s bounds of the champion's (or let
    through by ``validation.mode: warn`` or ``retrain.force``); else record the report and raise
    :class:`~train_deploy.validation.report.ValidationStopped`."""
    config, registry_config = ValidationConfig.from_params(validation), RegistryConfig.from_params(registry)
    champion = champion_statistics(registry_config)
    tonight, scores = _measured(token_files, tokenizer, registry_config, champion)
    report = decide(tonight, champion, config, registry_config.model_name,
                    force=RetrainConfig.from_params(retrain).force, scores=scores)
    record_on_run(report)
    if report.outcome == "stopped":
        logger.error("%s", report.block())
        if mlflow.active_run() is not None:
            mlflow.set_tag(OUTCOME_TAG, STOPPED)
        raise ValidationStopped(report)
    (logger.warning if report.outcome == "warned" else logger.info)("%s", report.block())
    return token_files


def _measured(token_files: TokenManifest, tokenizer: TokenizerInfo, registry: RegistryConfig,
              champion: tuple[str, CorpusStatistics | None] | None
              ) -> tuple[CorpusStatistics, SampleScores | None]:
    """Tonight's statistics, with the champion's score of tonight's sample when it can be scored."""
    recorded = champion[1] if champion else None
    with champion_bundle(registry, champion) as bundle:
        try:
            return measure_corpus(token_files, tokenizer, bundle, recorded)
        except BundleError as exc:  # damaged: the gate after training fails on it, or registry.force replaces it
            logger.warning("%s version %s (champion) cannot score tonight's text: %s", registry.model_name,
                           champion[0] if champion else "?", str(exc).splitlines()[0][:300])
    return measure_corpus(token_files, tokenizer, None, recorded)
