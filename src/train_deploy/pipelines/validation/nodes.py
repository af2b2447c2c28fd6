"""Node of the validation stage: the thin seam between the catalog and ``train_deploy.validation``."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import mlflow

from train_deploy.export.errors import BundleError
from train_deploy.handoffs import TokenizerInfo, TokenManifest, WorkFolder
from train_deploy.registry.config import RegistryConfig
from train_deploy.run_control.retrain import OUTCOME_TAG, RetrainConfig
from train_deploy.training.config import TrainingConfig
from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.content import SampleScores
from train_deploy.validation.records import champion_bundle, champion_statistics, record_on_run
from train_deploy.validation.report import ValidationReport, ValidationStopped, decide
from train_deploy.validation.screening import Dropped, document_scores, drop_documents
from train_deploy.validation.statistics import CorpusStatistics, measure_corpus

logger = logging.getLogger(__name__)
STOPPED = "validation_stopped"
"""The run's ``outcome`` tag when the data gate stopped it."""


def validate_corpus(validation: dict[str, Any], retrain: dict[str, Any],
                    registry: dict[str, Any], token_files: TokenManifest, tokenizer: TokenizerInfo,
                    training: dict[str, Any] | None = None,
                    screened_token_files: WorkFolder | None = None) -> TokenManifest:
    """Return ``token_files`` once their statistics are within ``validation``'s bounds of the champion's (or let
    through by ``validation.mode: warn`` or ``retrain.force``), with ``validation.screening: drop`` the copy in
    ``screened_token_files`` without the training documents the champion finds far outside the corpus; else record
    the report and raise :class:`~train_deploy.validation.report.ValidationStopped`."""
    config, registry_config = ValidationConfig.from_params(validation), RegistryConfig.from_params(registry)
    champion = champion_statistics(registry_config)
    with champion_bundle(registry_config, champion) as bundle:
        tonight, scores = _measured(token_files, tokenizer, bundle, registry_config, champion)
        report = decide(tonight, champion, config, registry_config.model_name,
                        force=RetrainConfig.from_params(retrain).force, scores=scores)
        try:
            if report.outcome != "stopped" and config.screening == "drop":
                token_files, report.dropped = _screened(report, token_files, tokenizer, bundle if scores else None,
                                                        training, screened_token_files)
        finally:
            record_on_run(report)
    if report.outcome == "stopped":
        logger.error("%s", report.block())
        if mlflow.active_run() is not None:
            mlflow.set_tag(OUTCOME_TAG, STOPPED)
        raise ValidationStopped(report)
    (logger.warning if report.outcome == "warned" else logger.info)("%s", report.block())
    return token_files


def _measured(token_files: TokenManifest, tokenizer: TokenizerInfo, bundle: Path | None, registry: RegistryConfig,
              champion: tuple[str, CorpusStatistics | None] | None
              ) -> tuple[CorpusStatistics, SampleScores | None]:
    """Tonight's statistics, with the champion's score of tonight's sample when it can be scored."""
    recorded = champion[1] if champion else None
    try:
        return measure_corpus(token_files, tokenizer, bundle, recorded)
    except BundleError as exc:  # damaged: the gate after training fails on it, or registry.force replaces it
        logger.warning("%s version %s (champion) cannot score tonight's text: %s", registry.model_name,
                       champion[0] if champion else "?", str(exc).splitlines()[0][:300])
    return measure_corpus(token_files, tokenizer, None, recorded)


def _screened(report: ValidationReport, token_files: TokenManifest, tokenizer: TokenizerInfo, bundle: Path | None,
              training: dict[str, Any] | None, folder: WorkFolder | None) -> tuple[TokenManifest, Dropped | None]:
    """``validation.screening: drop``: the token files without the training documents past the screening's limit,
    and what was dropped; ``token_files`` themselves when nothing can be screened (said in the log)."""
    limit = report.screening.limit if report.screening is not None else None
    if bundle is None or limit is None:
        logger.info("validation.screening: drop: nothing dropped: %s", _unscreened(report))
        return token_files, None
    if folder is None:
        raise ValueError("validation.screening: drop needs the catalog's screened_token_files entry")
    from train_deploy.export.runtime import LanguageModel

    started = time.perf_counter()
    scores = document_scores(LanguageModel.load(bundle), token_files, tokenizer)
    logger.info("validation.screening: scored %d training documents with the champion in %.1f s", len(scores),
                time.perf_counter() - started)
    window = TrainingConfig.from_params(training).batch.seq_length + 1
    return drop_documents(token_files, scores, limit, Path(folder.path), window, time.perf_counter() - started)


def _unscreened(report: ValidationReport) -> str:
    """Why no training document could be screened tonight."""
    if report.champion_version is None:
        return f"{report.model_name} has no champion yet"
    if report.screening is None:
        return f"{report.model_name} version {report.champion_version} (champion) could not score tonight's text"
    return "validation.max_document_nats_factor is null, or the champion records no loss on its own corpus"
