"""Nodes of the export stage: build (or keep) the bundle, then report its numbers to MLflow."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from train_deploy.datasets import FolderWork
from train_deploy.export.bundle import bundle_fingerprint, export_bundle
from train_deploy.export.config import ExportConfig
from train_deploy.export.runtime import FORM_FILES
from train_deploy.handoffs import Bundle, SelectedCheckpoint, TokenizerInfo, TokenManifest

logger = logging.getLogger(__name__)


def export_model(export: dict[str, Any], selected_checkpoint: SelectedCheckpoint, tokenizer: TokenizerInfo,
                 token_files: TokenManifest) -> FolderWork[Bundle]:
    """Return how to fill a new bundle version (kept when checkpoint, tokenizer and configuration are unchanged)."""
    config = ExportConfig.from_params(export)
    checkpoint = selected_checkpoint.checkpoint.path
    splits = token_files.splits
    provenance = {
        "selection": selected_checkpoint.reason,
        "val_loss": selected_checkpoint.validation_loss,  # what evaluation measured on these weights
        "corpus": {"fingerprint": token_files.fingerprint, "reader": token_files.input["source"],
                   **{f"{name}_{kind}": getattr(splits[name], kind) for name in ("train", "valid")
                      for kind in ("documents", "tokens")}},
    }
    fingerprint = bundle_fingerprint(checkpoint, tokenizer, config)
    keep = (lambda bundle: bundle.fingerprint == fingerprint) if config.reuse else None
    return FolderWork(build=partial(export_bundle, checkpoint, tokenizer, token_files, config, provenance),
                      keep=keep, what="bundle")


def report_export(export_bundle: Bundle) -> dict[str, Any]:
    """Return the parity, latency and size metrics for MLflow (logged with the prefix `export.`)."""
    parity, latency, files = export_bundle.parity, export_bundle.latency, export_bundle.meta["files"]
    metrics = {f"max_logit_diff_{name}": value for name, value in parity["max_abs_logit_diff"].items()}
    metrics |= {f"perplexity_{name}": value for name, value in parity["perplexity"].items()}
    metrics |= {f"latency_p50_ms_{name}_{batch}": row["p50"] for name, rows in latency["forms"].items()
                for batch, row in rows.items()}
    metrics |= {f"size_mb_{form}": files[path] / 2**20 for form, path in FORM_FILES.items() if path in files}
    logger.info("Bundle %s: %s", "kept" if export_bundle.reused else "ready", export_bundle.path)
    return {name: {"value": float(value), "step": 0} for name, value in metrics.items()}
