"""The training node validates before it launches anything, and names the run by what determines it."""

from __future__ import annotations

import dataclasses

import pytest

from train_deploy.config import ConfigError
from train_deploy.handoffs import WorkFolder
from train_deploy.pipelines.training.nodes import _run_name, train_model


def test_an_invalid_layout_fails_before_any_worker_starts(tmp_path, tiny_token_files):
    params = {"model": {"preset": "tiny"}, "parallel": {"mp": 2, "dp": 1}, "launch": {"nproc_per_node": 2}}
    tokens = dataclasses.replace(tiny_token_files,
                                 tokenizer=dataclasses.replace(tiny_token_files.tokenizer, vocab_size=2001))
    with pytest.raises(ConfigError, match="vocabulary \\(2001\\) is not divisible by mp = 2"):
        train_model(params, tokens, WorkFolder(path=str(tmp_path / "checkpoints")),
                    WorkFolder(path=str(tmp_path / "logs")))
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_folder_follows_corpus_and_configuration_not_the_layout(tiny_token_files):
    manifest = dataclasses.replace(tiny_token_files, fingerprint="a" * 32)
    base = {"model": {"preset": "tiny"}, "launch": {"nproc_per_node": 1}, "parallel": {"dp": 1}}
    relaid = {**base, "launch": {"nproc_per_node": 4}, "parallel": {"dp": 2, "mp": 2}}
    assert _run_name(base, manifest) == _run_name(relaid, manifest)
    assert _run_name(base, manifest) != _run_name({**base, "model": {"preset": "small"}}, manifest)
    assert _run_name(base, manifest) != _run_name(base, dataclasses.replace(manifest, fingerprint="b" * 32))
