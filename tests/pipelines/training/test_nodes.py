"""The training node validates before it launches anything (its run name: test_run_name.py)."""

from __future__ import annotations

import dataclasses

import pytest

from train_deploy.config import ConfigError
from train_deploy.handoffs import WorkFolder
from train_deploy.pipelines.training.nodes import configure_training, train_model


def test_an_invalid_layout_fails_before_any_worker_starts(tmp_path, tiny_token_files):
    params = {"model": {"preset": "tiny"}, "parallel": {"mp": 2, "dp": 1}, "launch": {"nproc_per_node": 2}}
    tokens = dataclasses.replace(tiny_token_files,
                                 tokenizer=dataclasses.replace(tiny_token_files.tokenizer, vocab_size=2001))
    with pytest.raises(ConfigError, match="vocabulary \\(2001\\) is not divisible by mp = 2"):
        configure_training(params, tokens)
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_run_that_had_already_finished_logs_its_baselines_without_a_false_alarm(
        tmp_path, tiny_token_files, tiny_run, caplog):
    import shutil

    from tests.helpers.training import training_params
    from train_deploy.pipelines.training.nodes import _run_name
    from train_deploy.training.config import TrainingConfig

    params = training_params(1)  # tiny_run's: its finished checkpoints are this run's
    checkpoints = WorkFolder(path=str(tmp_path / "checkpoints"))
    shutil.copytree(tiny_run.checkpoints, checkpoints.run(_run_name(TrainingConfig.from_params(params),
                                                                     tiny_token_files)))
    with caplog.at_level("INFO", logger="train_deploy.pipelines.training.nodes"):
        result = train_model(configure_training(params, tiny_token_files), tiny_token_files, checkpoints,
                             WorkFolder(path=str(tmp_path / "logs")))
    assert result.step == tiny_run.step and result.val_loss is None  # nothing trained, nothing evaluated
    records = [r for r in caplog.records if r.name == "train_deploy.pipelines.training.nodes"]
    assert [r for r in records if r.levelname == "WARNING"] == []
    assert any(r.getMessage().startswith("Training: no validation loss measured in this run; n-gram baselines")
               for r in records)
