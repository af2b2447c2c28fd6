"""The training node validates before it launches anything."""

from __future__ import annotations

import pytest

from train_deploy.config import ConfigError
from train_deploy.pipelines.training.nodes import _run_name, train_model


def test_an_invalid_layout_fails_before_any_worker_starts(tmp_path):
    params = {"model": {"preset": "tiny"}, "parallel": {"mp": 2, "dp": 1},
              "launch": {"nproc_per_node": 2, "log_dir": str(tmp_path / "logs")}}
    manifest = {"directory": str(tmp_path), "fingerprint": "f" * 32, "tokenizer": {"dtype": "uint16"}}
    tokenizer = {"vocab_size": 2001, "eos_id": 2, "path": str(tmp_path)}
    with pytest.raises(ConfigError, match="vocabulary \\(2001\\) is not divisible by mp = 2"):
        train_model(params, manifest, tokenizer)
    assert not (tmp_path / "logs").exists()


def test_checkpoint_folder_follows_corpus_and_configuration_not_the_layout():
    manifest = {"fingerprint": "a" * 32}
    base = {"model": {"preset": "tiny"}, "launch": {"nproc_per_node": 1}, "parallel": {"dp": 1}}
    relaid = {**base, "launch": {"nproc_per_node": 4}, "parallel": {"dp": 2, "mp": 2}}
    assert _run_name(base, manifest) == _run_name(relaid, manifest)
    assert _run_name(base, manifest) != _run_name({**base, "model": {"preset": "small"}}, manifest)
    assert _run_name(base, manifest) != _run_name(base, {"fingerprint": "b" * 32})
