"""Moved to :mod:`train_deploy.evaluation`; these names stay only until nothing imports them from here."""

from __future__ import annotations

from train_deploy.evaluation import load_model, perplexity, validation_loss, validation_windows

__all__ = ["load_model", "perplexity", "validation_loss", "validation_windows"]
