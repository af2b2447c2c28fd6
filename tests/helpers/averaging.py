"""Small checkpoints to average, written as training writes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from train_deploy.atomic import atomic_folder
from train_deploy.averaging.average import average_checkpoints
from train_deploy.averaging.config import AveragingConfig
from train_deploy.training.checkpoint import read_state

MODEL_CONFIG = {"hidden_size": 8, "vocab_size": 16}


def average_into(paths: list[Path], config: AveragingConfig, folder: Path) -> Path:
    """Average ``paths`` into ``folder``, staged and published as the catalog's folder dataset does."""
    with atomic_folder(folder) as staging:
        reference = average_checkpoints(paths, config, staging)
    assert reference.step == read_state(paths[-1])["step"] and len(reference.averaged_from) == len(paths)
    return folder


def make_checkpoint(folder: Path, step: int, seed: int, val_loss: float | None = None, **changes) -> Path:
    rng = np.random.RandomState(seed)
    tensors = {"a.weight": rng.randn(4, 8).astype(np.float32), "b.bias": rng.randn(8).astype(np.float32),
               "counter": np.array([step, step * 2], dtype=np.int64)}
    tensors.update(changes.pop("tensors", {}))
    for key in changes.pop("drop", []):
        tensors.pop(key)
    path = folder / f"step_{step:08d}"
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    state = {"step": step, "val_loss": val_loss, "model_config": changes.pop("model_config", MODEL_CONFIG)}
    (path / "state.json").write_text(json.dumps(state))
    return path
