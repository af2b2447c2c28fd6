"""Nodes of the export stage: build (or keep) the bundle with its pictures, then report its numbers to MLflow."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from pathlib import Path
from typing import Any

from train_deploy.baselines import Baselines, baselines_for
from train_deploy.datasets import FolderWork
from train_deploy.export.bundle import bundle_fingerprint, export_bundle
from train_deploy.export.config import ExportConfig
from train_deploy.export.engines import FORM_FILES
from train_deploy.export.plots import TrainingCurves, read_training_curves, training_figure
from train_deploy.handoffs import (
    METRICS_FILE,
    Bundle,
    SelectedCheckpoint,
    TokenizerInfo,
    TokenManifest,
    TrainingResult,
    WorkFolder,
)
from train_deploy.training.evaluation import validation_windows

logger = logging.getLogger(__name__)


def export_model(export: dict[str, Any], selected_checkpoint: SelectedCheckpoint,
                 tokenizer: TokenizerInfo, token_files: TokenManifest, training_result: TrainingResult,
                 training_logs: WorkFolder) -> tuple[FolderWork[Bundle], Any]:
    """Return how to fill a new bundle version (kept when checkpoint, tokenizer, configuration and training
    curves are unchanged) and the training curves' figure for the MLflow run."""
    config = ExportConfig.from_params(export)
    curves = _training_curves(selected_checkpoint, training_result, training_logs)
    checkpoint = selected_checkpoint.checkpoint.path
    splits = token_files.splits
    provenance = {
        "selection": selected_checkpoint.reason,
        "val_loss": selected_checkpoint.validation_loss,  # what evaluation measured on these weights
        "val_baselines": _val_baselines(selected_checkpoint, training_result, token_files),
        "diagnosis": dataclasses.asdict(training_result.diagnosis) if training_result.diagnosis else None,
        "corpus": {"fingerprint": token_files.fingerprint, "reader": token_files.input["source"],
                   **{f"{name}_{kind}": getattr(splits[name], kind) for name in ("train", "valid")
                      for kind in ("documents", "tokens")}},
    }
    fingerprint = bundle_fingerprint(checkpoint, tokenizer, config, curves)
    keep = (lambda bundle: bundle.fingerprint == fingerprint) if config.reuse else None
    work = FolderWork(build=partial(export_bundle, checkpoint, tokenizer, token_files, config, provenance, curves),
                      keep=keep, what="bundle")
    return work, training_figure(curves, title=f"training run {training_result.run_name}")


def _val_baselines(selected: SelectedCheckpoint, training_result: TrainingResult,
                   token_files: TokenManifest) -> dict[str, Any] | None:
    """The n-gram baselines of the windows ``val_loss`` was measured on (the training run's evaluation windows)."""
    if not selected.evaluated_on_windows:
        return None
    windows = validation_windows(token_files.prefix("valid"), token_files.dtype, training_result.seq_length,
                                 selected.evaluated_on_windows)
    return dataclasses.asdict(baselines_for(token_files, windows))


def _training_curves(selected: SelectedCheckpoint, training_result: TrainingResult,
                     training_logs: WorkFolder) -> TrainingCurves:
    """The metrics the training run logged up to the selected step, when the selected weights come from it."""
    ref = selected.checkpoint
    sources = ref.averaged_from or [ref.path]
    run_checkpoints = Path(training_result.checkpoints).resolve()
    if any(Path(source).resolve().parent != run_checkpoints for source in sources):
        curves = TrainingCurves(missing=f"the checkpoint {ref.path} is not from training run "
                                        f"{training_result.run_name}")
    else:  # RunSpec.logs of that run holds its metrics.jsonl (RunSpec.metrics_path)
        curves = read_training_curves(training_logs.run(training_result.run_name) / METRICS_FILE, ref.step)
    if curves.missing:
        logger.warning("No training curves in the bundle: %s", curves.missing)
    return curves


def report_export(export_bundle: Bundle) -> dict[str, Any]:
    """Return the parity, latency and size metrics for MLflow (logged with the prefix `export.`), with the
    n-gram baselines of the parity windows and the trained model's loss on them."""
    parity, latency, files = export_bundle.parity, export_bundle.latency, export_bundle.meta.sizes()
    metrics = {f"max_logit_diff_{name}": value for name, value in parity.max_abs_logit_diff.items()}
    metrics |= {f"perplexity_{name}": value for name, value in parity.perplexity.items()}
    if parity.baselines:  # bundles before format 4 have none
        metrics |= Baselines.from_report(parity.baselines).metrics()  # Kneser–Ney from bundles of this code on
        metrics["model_loss"] = parity.baselines["model_loss"]
    metrics |= {f"latency_p50_ms_{name}_{batch}": row["p50"] for name, rows in latency.forms.items()
                for batch, row in rows.items()}
    metrics |= {f"size_mb_{form}": files[path] / 2**20 for form, path in FORM_FILES.items() if path in files}
    logger.info("Bundle %s: %s", "kept" if export_bundle.reused else "ready", export_bundle.path)
    return {name: {"value": float(value), "step": 0} for name, value in metrics.items()}
