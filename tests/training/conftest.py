"""Tiny token files and run descriptions for real multi-process training tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from safetensors.numpy import load_file

from train_deploy.training.config import TrainingConfig
from train_deploy.training.launch import run_launcher, write_run_file

TINY_TRAINING = {
    "model": {"preset": "tiny"},
    "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 32},
    "optimizer": {"learning_rate": 2e-3, "warmup_steps": 2, "reference_batch_size": 8},
    "schedule": {"max_steps": 6, "log_every": 1, "eval_every": 3, "checkpoint_every": 3, "keep_last": 3},
}


def training_params(nproc: int = 1, **blocks) -> dict:
    params = copy.deepcopy(TINY_TRAINING)
    params["launch"] = {"nproc_per_node": nproc}
    for name, values in blocks.items():
        params[name] = {**params.get(name, {}), **values}
    return params


def launch(folder: Path, data: dict, params: dict) -> dict:
    """Run the workers with Paddle's launcher as the training node does; return result.json."""
    params = copy.deepcopy(params)
    params.setdefault("launch", {})["log_dir"] = str(folder / "logs")
    run = {"training": params, "data": data, "output_dir": str(folder / "checkpoints"),
           "metrics_path": str(folder / "metrics.jsonl"), "result_path": str(folder / "result.json"), "mlflow": None}
    run_launcher(TrainingConfig.from_params(params), write_run_file(folder / "run.json", run))
    return json.loads((folder / "result.json").read_text(encoding="utf-8"))


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def weights(folder: Path, step: int) -> dict:
    return load_file(str(folder / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))
