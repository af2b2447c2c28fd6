"""Nodes of the export stage: build (or reuse) the bundle, then report it to MLflow and the user."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from train_deploy.corpus.tokenizer import TokenizerInfo
from train_deploy.export.bundle import export_bundle
from train_deploy.export.config import ExportConfig
from train_deploy.export.runtime import FORM_FILES

logger = logging.getLogger(__name__)


def export_model(export: dict[str, Any], selected_checkpoint: dict[str, Any], tokenizer: dict[str, Any],
                 token_manifest: dict[str, Any], training_result: dict[str, Any]) -> dict[str, Any]:
    """Return the bundle's description: its folder, parity and latency, whether it was reused."""
    config = ExportConfig.from_params(export)
    splits = token_manifest["splits"]
    provenance = {
        "selection": selected_checkpoint.get("reason"),
        "corpus": {"fingerprint": token_manifest["fingerprint"], "reader": token_manifest["config"]["reader"]["source"],
                   **{f"{name}_{kind}": splits[name][kind] for name in ("train", "valid")
                      for kind in ("documents", "tokens")}},
    }
    if selected_checkpoint.get("validation_loss") is not None:  # what evaluation measured on these weights
        provenance["val_loss"] = selected_checkpoint["validation_loss"]
    folder, reused = export_bundle(Path(selected_checkpoint["path"]), TokenizerInfo(**tokenizer), config,
                                   training_result["run_name"], provenance)
    return {"path": str(folder), "reused": reused,
            "parity": json.loads((folder / "parity.json").read_text(encoding="utf-8")),
            "latency": json.loads((folder / "latency.json").read_text(encoding="utf-8")),
            "files": json.loads((folder / "bundle.json").read_text(encoding="utf-8"))["files"]}


def report_export(export_bundle: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Return the parity, latency and size metrics for MLflow, and the model card (the run prints how to load it)."""
    parity, latency, files = export_bundle["parity"], export_bundle["latency"], export_bundle["files"]
    metrics = {f"max_logit_diff_{name}": value for name, value in parity["max_abs_logit_diff"].items()}
    metrics |= {f"perplexity_{name}": value for name, value in parity["perplexity"].items()}
    metrics |= {f"latency_p50_ms_{name}_{batch}": row["p50"] for name, rows in latency["forms"].items()
                for batch, row in rows.items()}
    metrics |= {f"size_mb_{form}": files[path] / 2**20 for form, path in FORM_FILES.items() if path in files}
    folder = export_bundle["path"]
    logger.info("Bundle %s: %s", "reused" if export_bundle["reused"] else "ready", folder)
    card = (Path(folder) / "MODEL_CARD.md").read_text(encoding="utf-8")
    return {name: {"value": float(value), "step": 0} for name, value in metrics.items()}, card
