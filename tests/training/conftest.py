"""Tiny token files and run descriptions for real multi-process training tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tests.conftest import corpus_params
from train_deploy.training.config import TrainingConfig
from train_deploy.training.launch import run_launcher, write_run_file

TINY_TRAINING = {
    "model": {"preset": "tiny"},
    "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 32},
    "optimizer": {"learning_rate": 2e-3, "warmup_steps": 2, "reference_batch_size": 8},
    "schedule": {"max_steps": 6, "log_every": 1, "eval_every": 3, "checkpoint_every": 3, "keep_last": 3},
}


@pytest.fixture(scope="session")
def tiny_tokens(tmp_path_factory, tiny_tokenizer) -> dict:
    """The `data` block of a run: the People's Daily slice encoded with the tiny tokenizer."""
    from train_deploy.corpus.build import encode_corpus
    from train_deploy.corpus.config import CorpusConfig
    from train_deploy.corpus.readers import plan_corpus
    from train_deploy.corpus.tokenizer import TokenizerInfo

    folder = tmp_path_factory.mktemp("tokens")
    config = CorpusConfig.from_params(corpus_params(folder, encoding={"validation_fraction": 0.05}))
    manifest = encode_corpus(config, plan_corpus(config.reader), TokenizerInfo(**tiny_tokenizer))
    tokens = Path(manifest["directory"])
    return {"train_prefix": str(tokens / "train"), "valid_prefix": str(tokens / "valid"),
            "dtype": manifest["tokenizer"]["dtype"], "vocab_size": tiny_tokenizer["vocab_size"],
            "eos_id": tiny_tokenizer["eos_id"], "eval_samples": 16}


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
