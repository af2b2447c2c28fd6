"""Nodes of the averaging stage: average the last checkpoints, evaluate against the last, choose."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from train_deploy.averaging.average import average_checkpoints, select_checkpoints
from train_deploy.averaging.config import AveragingConfig
from train_deploy.averaging.evaluate import evaluation_windows, load_model, perplexity, validation_loss
from train_deploy.training.checkpoint import read_state

logger = logging.getLogger(__name__)


def average(averaging: dict[str, Any], training_result: dict[str, Any]) -> dict[str, Any]:
    """Return the averaged checkpoint's description (its folder, sources and method)."""
    config = AveragingConfig.from_params(averaging)
    chosen = select_checkpoints(Path(training_result["checkpoints"]), config)
    folder = average_checkpoints(chosen, config, Path(config.output_dir) / training_result["run_name"])
    return {"path": str(folder), "last": str(chosen[-1]), "sources": [str(p) for p in chosen],
            "method": config.method}


def evaluate(averaging: dict[str, Any], averaged_checkpoint: dict[str, Any],
             training_result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Return the selected checkpoint, the comparison metrics and a bar plot of both perplexities."""
    config = AveragingConfig.from_params(averaging)
    last = Path(training_result["checkpoint"])
    averaged = Path(averaged_checkpoint["path"])
    state = read_state(last)
    seq_length = state["training"]["batch"]["seq_length"]
    windows = evaluation_windows(state["data"], seq_length, state["data"].get("eval_samples", 64))
    losses = {name: validation_loss(load_model(path), windows) for name, path in
              (("last", last), ("averaged", averaged))}
    better = "averaged" if losses["averaged"] <= losses["last"] else "last"
    chosen = better if config.choose == "better" else config.choose
    other = "last" if chosen == "averaged" else "averaged"
    reason = (f"{chosen}: validation loss {losses[chosen]:.4f} vs {losses[other]:.4f}"
              + ("" if config.choose == "better" else f" (averaging.choose: {config.choose})"))
    logger.info("Selected the %s checkpoint: %s", chosen, reason)
    selected = {"path": str(averaged if chosen == "averaged" else last), "which": chosen, "reason": reason,
                "validation_loss": losses[chosen], "evaluated_on_windows": len(windows)}
    metrics = {f"{name}_{kind}": {"value": value, "step": 0}
               for name, loss in losses.items()
               for kind, value in (("val_loss", loss), ("perplexity", perplexity(loss)))}
    return selected, metrics, _plot(losses)


def _plot(losses: dict[str, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(4, 3))
    names = list(losses)
    axis.bar(names, [perplexity(losses[n]) for n in names], color=["#888888", "#3b7dd8"])
    axis.set_ylabel("validation perplexity")
    axis.set_title("last vs averaged checkpoint")
    figure.tight_layout()
    return figure
