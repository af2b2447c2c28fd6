"""Node of the registry stage: register the bundle, gate it against the champion, move the aliases last."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

from train_deploy.handoffs import Bundle, TokenizerInfo, TokenManifest, TrainingResult
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalset import jsonl_texts, validation_texts
from train_deploy.registry.gate import RegistryDecision, git_commit, promotion_event, register_and_gate, version_tags
from train_deploy.registry.lineage import warm_start_run_tags
from train_deploy.run_control.retrain import run_fingerprints
from train_deploy.validation.records import statistics_tags
from train_deploy.validation.statistics import corpus_statistics

logger = logging.getLogger(__name__)


def register_bundle(registry: dict[str, Any], export_bundle: Bundle, export_metrics: dict[str, Any],
                    token_files: TokenManifest, tokenizer: TokenizerInfo,
                    training_result: TrainingResult) -> tuple[RegistryDecision, str]:
    """Return the gate's decision on the new version and its history line (JSONL) for the run.

    ``export_metrics`` are the export figures as the MLflow run holds them (latency, sizes, parity): they become
    tags of the version, and taking them makes this node the run's last, after every other node has succeeded.
    """
    config = RegistryConfig.from_params(registry)
    texts = config.eval_set
    build_texts = (partial(jsonl_texts, texts.path, texts.documents, texts.max_chars) if texts.path else
                   partial(validation_texts, token_files, tokenizer, texts.documents, texts.max_chars))
    tags = version_tags(export_bundle, token_files, training_result, git_commit(Path.cwd()))  # the project
    tags |= export_figures(export_metrics)
    # what the next scheduled run compares itself with (train_deploy.run_control.retrain)
    tags |= _checked_fingerprints()
    tags |= warm_start_run_tags()  # the run's init_from.* tags, init_from.champion_version among them
    tags |= statistics_tags(corpus_statistics(token_files, tokenizer, export_bundle.path))  # the data gate's reference
    decision = register_and_gate(export_bundle, config, tags, build_texts)
    return decision, json.dumps(promotion_event(decision), ensure_ascii=False) + "\n"


def _checked_fingerprints() -> dict[str, str]:
    import mlflow

    run = mlflow.active_run()
    return run_fingerprints(run.info.run_id) if run else {}


def export_figures(metrics: dict[str, Any]) -> dict[str, str]:
    """Version tags of the export metrics read back from the run (``export.<name>`` → its last value)."""
    tags = {}
    for name, history in metrics.items():
        last = history[-1] if isinstance(history, list) else history
        tags[name if name.startswith("export.") else f"export.{name}"] = f"{float(last['value']):.6g}"
    return tags
