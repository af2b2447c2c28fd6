"""Shared fixtures: tiny corpus slices and a tokenizer trained once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokens) -> Path:
    """The last checkpoint of a 6-step tiny run through Paddle's launcher (one process)."""
    from tests.training.conftest import launch, training_params

    folder = tmp_path_factory.mktemp("tiny_run")
    result = launch(folder, tiny_tokens, training_params(1))
    return Path(result["checkpoint"])
