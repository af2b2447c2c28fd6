"""Tiny run descriptions for real multi-process training tests, launched as the training node does."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from safetensors.numpy import load_file

from train_deploy.handoffs import DataSpec, TrainingResult, read_json
from train_deploy.training.launch import run_training
from train_deploy.training.spec import RunSpec
from train_deploy.training.spec import run_spec as spec_of

TINY_TRAINING = {
    "model": {"preset": "tiny"},
    "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 32},
    "optimizer": {"learning_rate": 2e-3, "warmup_steps": 2, "reference_batch_size": 8},
    "schedule": {"max_steps": 6, "log_every": 1, "eval_every": 3, "eval_batches": 2, "checkpoint_every": 3,
                 "keep_last": 3},
}


TINY_EVAL_WINDOWS = 2 * 8  # eval_batches × global_batch_size: every evaluation's validation windows


def training_params(nproc: int = 1, **blocks) -> dict:
    params = copy.deepcopy(TINY_TRAINING)
    params["launch"] = {"nproc_per_node": nproc}
    for name, values in blocks.items():
        params[name] = {**params.get(name, {}), **values}
    return params


def run_spec(folder: Path, data: DataSpec, params: dict) -> RunSpec:
    """The run's description, validated and resolved as the training node's: checkpoints in ``folder/checkpoints``,
    logs, metrics and result in ``folder/logs``."""
    return spec_of(folder, data, params)


def launch(folder: Path, data: DataSpec, params: dict) -> TrainingResult:
    """Run the workers with Paddle's launcher as the training node does; return their result."""
    return run_training(run_spec(folder, data, params))


def result(folder: Path) -> TrainingResult:
    """The result of the last run launched in ``folder``."""
    return read_json(TrainingResult, Path(folder) / "logs" / "result.json")


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]


def weights(folder: Path, step: int) -> dict:
    return load_file(str(folder / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))
