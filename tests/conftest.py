"""Shared fixtures: tiny corpus slices and a tokenizer trained once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from train_deploy.handoffs import DataSpec

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parents[1]

# The smallest tokenizer SentencePiece accepts on a 200 KB People's Daily slice at 98% character coverage.
TINY_TOKENIZER = {"vocab_size": 2000, "character_coverage": 0.98}
TINY_SLICE = 200_000


def corpus_params(tmp_path: Path, **blocks: dict) -> dict:
    """A `corpus` parameter block writing under ``tmp_path``, with ``blocks`` merged over each sub-block."""
    params = {
        "reader": {"max_bytes": TINY_SLICE, "chunk_bytes": 32 * 1024},
        "cleaning": {},
        "tokenizer": {**TINY_TOKENIZER, "output_dir": str(tmp_path / "tokenizer")},
        "encoding": {"output_dir": str(tmp_path / "tokens"), "workers": 1, "progress": False},
    }
    for name, values in blocks.items():
        params[name] = {**params[name], **values}
    return params


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory) -> None:
    """Derived data the project caches per machine (the corpus stage's Unicode tables) goes under the
    session's temporary folder, for this process and every one it starts, not the user's cache."""
    os.environ["TRAIN_DEPLOY_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> dict:
    """A SentencePiece tokenizer trained on the People's Daily slice, as the corpus node returns it."""
    from train_deploy.pipelines.corpus.nodes import plan_inputs, prepare_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    return prepare_tokenizer(plan_inputs(corpus_params(folder)))


@pytest.fixture(scope="session")
def tiny_tokens(tiny_token_files) -> DataSpec:
    """A run's ``data``: the tiny token files (:func:`tiny_token_files`) and their tokenizer.

    A tiny run evaluates its first ``eval_batches × global_batch_size`` validation windows
    (``TrainingResult.eval_windows``; ``tests.training.conftest.TINY_EVAL_WINDOWS``).
    """
    return DataSpec.of(tiny_token_files)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokens) -> Path:
    """The last checkpoint of a 6-step tiny run through Paddle's launcher (one process)."""
    from tests.training.conftest import launch, training_params

    return Path(launch(tmp_path_factory.mktemp("tiny_run"), tiny_tokens, training_params(1)).checkpoint)
