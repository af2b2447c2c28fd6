"""Nodes of the training stage: configure (validate once), launch the workers, report."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from train_deploy.baselines import baselines_for
from train_deploy.handoffs import CurveDiagnosis, DataSpec, InitSource, TokenManifest, TrainingResult, WorkFolder
from train_deploy.hashing import digest
from train_deploy.registry.champion import record_init_source
from train_deploy.training.config import Layout, TrainingConfig, resolve_layout
from train_deploy.training.diagnosis import beat_advice, diagnose, read_curves
from train_deploy.training.evaluation import validation_windows
from train_deploy.training.launch import plan_layout, run_training
from train_deploy.training.monitoring import monitored_training
from train_deploy.training.pretrained import check_layout, check_source_current, init_identity, warm_start
from train_deploy.training.spec import RunSpec

logger = logging.getLogger(__name__)


def _scratch() -> InitSource:
    """The start of a run without the corpus stage's ``init_source`` (a node run on its own, tests)."""
    return InitSource(requested="scratch", tokenizer_config_fingerprint="")


def configure_training(training: dict[str, Any], token_files: TokenManifest,
                       init_source: InitSource | None = None) -> TrainingConfig:
    """Return the training stage's configuration, validated once: the ``training`` block, with a model folder's
    shape over the preset (``init_source``: the corpus stage's resolution of ``training.init_from``; None:
    scratch), checked against that source and against the tokenizer and world size (the parallel layout), so an
    invalid run fails before any worker starts."""
    config = TrainingConfig.from_params(training)
    source = init_source or _scratch()
    check_source_current(config.init_from, source)
    config = warm_start(config, source)
    check_layout(config, source, token_files.tokenizer.vocab_size)
    return config


def train_model(config: TrainingConfig, token_files: TokenManifest, checkpoints: WorkFolder,
                training_logs: WorkFolder, init_source: InitSource | None = None) -> TrainingResult:
    """Return the training result after running (or resuming) the job with Paddle's launcher, from the weights
    ``init_source`` names (None: scratch); ``config`` is :func:`configure_training`'s."""
    init_source = init_source or _scratch()
    data = DataSpec.of(token_files)
    layout = resolve_layout(config, config.world_size, config.model.shape().get("vocab_size", data.vocab_size))
    run_name = _run_name(config, token_files, init_source)
    spec = RunSpec(run_name=run_name, training=config, layout=layout, data=data,
                   checkpoints=str(checkpoints.run(run_name)), logs=str(training_logs.run(run_name)),
                   init=init_source)
    if config.layout == "auto":  # planned here, so that the resolved parameters logged below are the run's
        spec = plan_layout(spec)
    _log_resolved(spec.layout, spec.training)
    record_init_source(init_source)
    with monitored_training(config.monitoring, _mlflow_run_id(), Path(spec.logs)):  # system metrics, VisualDL
        result = run_training(spec, mlflow_run_id=_mlflow_run_id())
    result = dataclasses.replace(result, **init_source.result_fields(),  # also when the run had finished before
                                 diagnosis=diagnose(read_curves(spec.metrics_path, result.step)))
    logger.info("Training reached step %d; last checkpoint %s (validation loss %s)", result.step,
                result.checkpoint, result.val_loss)
    _report_diagnosis(result.diagnosis)
    _report_baselines(result, token_files)
    return result


def _report_diagnosis(diagnosis: CurveDiagnosis) -> None:
    """Log what the curves say, with the advice, and tag the MLflow run with the case (``training.diagnosis``)."""
    logger.log(logging.WARNING if diagnosis.kind == "overfitting" else logging.INFO, "Training curves: %s%s",
               diagnosis.summary, f"; what could do better: {diagnosis.advice}" if diagnosis.advice else "")
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.set_tags({"training.diagnosis": diagnosis.kind, "training.diagnosis.summary": diagnosis.summary})


def _report_baselines(result: TrainingResult, token_files: TokenManifest) -> None:
    """Log the n-gram baselines of the windows the run evaluated beside its validation loss (a warning only when
    a loss measured in this run does not beat the strongest), and send them to MLflow once
    (``train.baseline_<name>_loss`` at the last step)."""
    if not result.eval_windows:
        return
    windows = validation_windows(token_files.prefix("valid"), token_files.dtype, result.seq_length,
                                 result.eval_windows)
    baselines = baselines_for(token_files, windows)
    logger.log(baselines.level(result.val_loss), "Training: %s",
               baselines.describe(result.val_loss, beat_advice(result.diagnosis)))
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_metrics({f"train.{name}": value for name, value in baselines.metrics().items()}, step=result.step)


def _run_name(config: TrainingConfig, token_files: TokenManifest, init_source: InitSource | None = None) -> str:
    """The checkpoint folder's name: the token files' fingerprint and what determines the weights
    (:meth:`TrainingConfig.identity`, with the champion's weights by their hash), so a rerun that changes only
    cadences, layout or launch resumes in it."""
    identity = config.identity(init_identity(config.init_from))
    identity |= {"init_from.hash": init_source.hash} if init_source and init_source.hash else {}
    return f"{token_files.fingerprint[:12]}-{digest(identity, size=4)}"


def _mlflow_run_id() -> str | None:
    """The Kedro run's MLflow run (kedro-mlflow's), which this process sends rank 0's metrics to."""
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run else None


def _log_resolved(layout: Layout, config: TrainingConfig) -> None:
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.log_params({
        "training.resolved.dp": layout.dp, "training.resolved.mp": layout.mp, "training.resolved.pp": layout.pp,
        "training.resolved.accumulation_steps": layout.accumulation_steps,
        "training.resolved.peak_learning_rate": config.optimizer.scaled_learning_rate(config.batch.global_batch_size),
        "training.resolved.world_size": layout.world_size,
    })
