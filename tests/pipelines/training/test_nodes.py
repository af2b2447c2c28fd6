"""The training node validates before it launches anything (its run name: test_run_name.py)."""

from __future__ import annotations

import dataclasses

import pytest

from train_deploy.config import ConfigError
from train_deploy.handoffs import WorkFolder
from train_deploy.pipelines.training.nodes import train_model


def test_an_invalid_layout_fails_before_any_worker_starts(tmp_path, tiny_token_files):
    params = {"model": {"preset": "tiny"}, "parallel": {"mp": 2, "dp": 1}, "launch": {"nproc_per_node": 2}}
    tokens = dataclasses.replace(tiny_token_files,
                                 tokenizer=dataclasses.replace(tiny_token_files.tokenizer, vocab_size=2001))
    with pytest.raises(ConfigError, match="vocabulary \\(2001\\) is not divisible by mp = 2"):
        train_model(params, tokens, WorkFolder(path=str(tmp_path / "checkpoints")),
                    WorkFolder(path=str(tmp_path / "logs")))
    assert list(tmp_path.iterdir()) == []
