"""Nodes of the averaging stage: average the last checkpoints (those around the lowest validation loss when the
run overfits), evaluate against the last, choose."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from train_deploy.averaging.average import average_checkpoints, averaging_fingerprint, select_checkpoints
from train_deploy.averaging.config import AveragingConfig
from train_deploy.baselines import Baselines, baselines_for
from train_deploy.datasets import FolderWork
from train_deploy.handoffs import CheckpointRef, SelectedCheckpoint, TokenManifest, TrainingResult
from train_deploy.training.checkpoint import MODEL_FILE, check_trained_on, verify_checkpoint
from train_deploy.training.diagnosis import beat_advice
from train_deploy.training.evaluation import load_model, perplexity, validation_loss, validation_windows

logger = logging.getLogger(__name__)

UNVALIDATED_RUN_WINDOWS = 64
"""Windows the comparison uses when the training run evaluated none (its validation split held fewer than one
evaluation batch of ``micro_batch_size × dp``): the first ones of the split, as many as it holds up to this."""


def average(averaging: dict[str, Any], training_result: TrainingResult) -> FolderWork[CheckpointRef]:
    """Return how to fill the averaged checkpoint's folder (kept when its sources and method are unchanged)."""
    config = AveragingConfig.from_params(averaging)
    selection = select_checkpoints(training_result.checkpoints, config, training_result.diagnosis)
    logger.info("Averaging the checkpoints of %s", selection.reason)
    fingerprint = averaging_fingerprint(selection.paths, config)
    return FolderWork(build=partial(average_checkpoints, selection.paths, config),
                      keep=lambda current: current.fingerprint == fingerprint, what="averaged checkpoint")


def evaluate(averaging: dict[str, Any], averaged_checkpoint: CheckpointRef,
             training_result: TrainingResult,
             token_files: TokenManifest) -> tuple[SelectedCheckpoint, dict[str, Any], Any]:
    """Return the selected checkpoint, the comparison metrics (with the n-gram baselines of the same windows)
    and a bar plot of both perplexities against the add-k bigram's and the strongest baseline's.

    Both checkpoints must be intact and trained on the corpus of ``token_files``, else it stops naming them.
    """
    config = AveragingConfig.from_params(averaging)
    candidates = {"last": CheckpointRef(path=training_result.checkpoint, step=training_result.step,
                                        val_loss=training_result.val_loss),
                  "averaged": averaged_checkpoint}
    for ref in candidates.values():
        check_trained_on(verify_checkpoint(ref.path, [MODEL_FILE]), token_files.fingerprint, ref.path)
    windows = validation_windows(token_files.prefix("valid"), token_files.dtype, training_result.seq_length,
                                 training_result.eval_windows or UNVALIDATED_RUN_WINDOWS)
    losses = {name: validation_loss(load_model(ref.path), windows) for name, ref in candidates.items()}
    better = "averaged" if losses["averaged"] <= losses["last"] else "last"
    chosen = better if config.choose == "better" else config.choose
    other = "last" if chosen == "averaged" else "averaged"
    averaged_of = select_checkpoints(training_result.checkpoints, config, training_result.diagnosis).reason
    reason = (f"{chosen}: validation loss {losses[chosen]:.4f} vs {losses[other]:.4f}"
              + ("" if config.choose == "better" else f" (averaging.choose: {config.choose})")
              + f"; the average is of {averaged_of}")
    logger.info("Selected the %s checkpoint: %s", chosen, reason)
    baselines = baselines_for(token_files, windows)
    logger.log(baselines.level(losses[chosen]), "Averaging, %s checkpoint: %s", chosen,
               baselines.describe(losses[chosen], beat_advice(training_result.diagnosis)))
    selected = SelectedCheckpoint(checkpoint=candidates[chosen], which=chosen, reason=reason,
                                  validation_loss=losses[chosen], evaluated_on_windows=len(windows))
    metrics = {f"{name}_{kind}": {"value": value, "step": 0}
               for name, loss in losses.items()
               for kind, value in (("val_loss", loss), ("perplexity", perplexity(loss)))}
    metrics |= {name: {"value": value, "step": 0} for name, value in baselines.metrics().items()}
    return selected, metrics, _plot(losses, baselines)


def _plot(losses: dict[str, float], baselines: Baselines):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(4, 3))
    names = list(losses)
    axis.bar(names, [perplexity(losses[n]) for n in names], color=["#888888", "#3b7dd8"])
    axis.axhline(perplexity(baselines.bigram_loss), color="#c0392b", linestyle="--", label="add-k bigram")
    strongest, loss = baselines.strongest()
    if strongest != "add-k bigram":
        axis.axhline(perplexity(loss), color="#8e44ad", linestyle=":", label=strongest)
    axis.legend(loc="lower right", fontsize="small")
    axis.set_ylabel("validation perplexity")
    axis.set_title("last vs averaged checkpoint")
    figure.tight_layout()
    return figure
