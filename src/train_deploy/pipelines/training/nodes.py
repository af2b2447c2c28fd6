"""Nodes of the training stage: validate, launch the workers, report."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from train_deploy.training.config import TrainingConfig, resolve_layout
from train_deploy.training.launch import run_launcher, write_run_file

logger = logging.getLogger(__name__)


def train_model(training: dict[str, Any], token_manifest: dict[str, Any], tokenizer: dict[str, Any]) -> dict[str, Any]:
    """Return the training result after running (or resuming) the job with Paddle's launcher."""
    config = TrainingConfig.from_params(training)
    layout = resolve_layout(config, config.world_size, tokenizer["vocab_size"])  # fail before launching
    run_name = _run_name(training, token_manifest)
    job_dir = Path(config.launch.log_dir).parent / run_name
    tokens = Path(token_manifest["directory"])
    run = {
        "training": training,
        "data": {"train_prefix": str(tokens / "train"), "valid_prefix": str(tokens / "valid"),
                 "dtype": token_manifest["tokenizer"]["dtype"], "vocab_size": tokenizer["vocab_size"],
                 "eos_id": tokenizer["eos_id"], "corpus_fingerprint": token_manifest["fingerprint"],
                 "tokenizer_path": tokenizer["path"], "tokenizer_hash": tokenizer["hash"],
                 "eval_samples": 8 * config.batch.global_batch_size},
        "output_dir": str(Path(config.output_dir) / run_name),
        "metrics_path": str(job_dir / "metrics.jsonl"),
        "result_path": str(job_dir / "result.json"),
        "mlflow": _mlflow_run(),
    }
    _log_resolved(layout, config)
    run_launcher(config, write_run_file(job_dir / "run.json", run))
    result = json.loads(Path(run["result_path"]).read_text(encoding="utf-8"))
    logger.info("Training reached step %d; last checkpoint %s (validation loss %s)", result["step"],
                result["checkpoint"], result["val_loss"])
    return {**result, "checkpoints": run["output_dir"], "run_name": run_name}


def _run_name(training: dict[str, Any], token_manifest: dict[str, Any]) -> str:
    """Checkpoints of one corpus and one model/optimiser/schedule configuration share a folder, so a
    rerun resumes there; the parallel layout and the launch are left out: a job may resume on another."""
    relevant = {k: v for k, v in training.items() if k not in ("launch", "device", "parallel")}
    digest = hashlib.blake2b(json.dumps(relevant, sort_keys=True).encode(), digest_size=4).hexdigest()
    return f"{token_manifest['fingerprint'][:12]}-{digest}"


def _mlflow_run() -> dict[str, str] | None:
    import mlflow

    run = mlflow.active_run()
    return {"tracking_uri": mlflow.get_tracking_uri(), "run_id": run.info.run_id} if run else None


def _log_resolved(layout, config: TrainingConfig) -> None:
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.log_params({
        "training.resolved.dp": layout.dp, "training.resolved.mp": layout.mp, "training.resolved.pp": layout.pp,
        "training.resolved.accumulation_steps": layout.accumulation_steps,
        "training.resolved.peak_learning_rate": config.optimizer.scaled_learning_rate(config.batch.global_batch_size),
        "training.resolved.world_size": layout.world_size,
    })
