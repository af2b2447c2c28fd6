"""The checkpoint folder is named by what determines the weights, so a time-boxed or re-launched run resumes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.helpers.training import training_params
from train_deploy.config import to_dict
from train_deploy.handoffs import WorkFolder
from train_deploy.pipelines.training.nodes import _run_name, configure_training, train_model
from train_deploy.training.config import TrainingConfig

# Changes that leave the weights alone: the run continues in the same folder.
SAME_FOLDER = {
    "stop_after": {"schedule": {"stop_after": 3}},
    "log_every": {"schedule": {"log_every": 2}},
    "eval_every": {"schedule": {"eval_every": 1}},
    "eval_batches": {"schedule": {"eval_batches": 1}},
    "checkpoint_every": {"schedule": {"checkpoint_every": 1}},
    "keep_last": {"schedule": {"keep_last": 0}},
    "resume": {"schedule": {"resume": "never"}},
    "recompute": {"precision": {"recompute": True}},
    "dtype_without_amp": {"precision": {"dtype": "float16", "level": "O2"}},
    "micro_batch": {"batch": {"micro_batch_size": 2}},
    "parallel": {"parallel": {"dp": 2, "mp": 2, "sharding_stage": 1}},
    "launch": {"launch": {"nproc_per_node": 8, "nnodes": 2, "master": "10.0.0.1:8090", "node_rank": 1,
                          "max_restart": 3, "job_id": "nightly"}},
    "device": {"device": {"type": "gpu", "peak_tflops": 989.0}},
}
# Changes that make other weights: a new folder.
NEW_FOLDER = {
    "preset": {"model": {"preset": "small"}},
    "override": {"model": {"overrides": {"num_hidden_layers": 4}}},
    "learning_rate": {"optimizer": {"learning_rate": 1e-3}},
    "lr_scaling": {"optimizer": {"lr_scaling": "none"}},
    "warmup": {"optimizer": {"warmup_steps": 3}},
    "beta2": {"optimizer": {"beta2": 0.99}},
    "global_batch": {"batch": {"global_batch_size": 16}},
    "seq_length": {"batch": {"seq_length": 64}},
    "amp": {"precision": {"amp": True}},
    "seed": {"schedule": {"seed": 7}},
    "max_steps": {"schedule": {"max_steps": 12}},
}


def name(params: dict, token_files) -> str:
    return _run_name(TrainingConfig.from_params(params), token_files)


@pytest.mark.parametrize("change", SAME_FOLDER.values(), ids=SAME_FOLDER)
def test_cadence_housekeeping_layout_and_launch_keep_the_folder(change, tiny_token_files):
    assert name(training_params(1, **change), tiny_token_files) == name(training_params(1), tiny_token_files)


@pytest.mark.parametrize("change", NEW_FOLDER.values(), ids=NEW_FOLDER)
def test_what_determines_the_weights_changes_the_folder(change, tiny_token_files):
    assert name(training_params(1, **change), tiny_token_files) != name(training_params(1), tiny_token_files)


def test_other_token_files_change_the_folder(tiny_token_files):
    other = dataclasses.replace(tiny_token_files, fingerprint="b" * 32)
    assert name(training_params(1), other) != name(training_params(1), tiny_token_files)


def test_stated_defaults_name_the_same_folder_as_omitted_ones(tiny_token_files):
    assert name({}, tiny_token_files) == name(to_dict(TrainingConfig()), tiny_token_files)
    amp_defaults = {"amp": True, "dtype": "bfloat16", "level": "O1"}
    assert name({"precision": {"amp": True}}, tiny_token_files) == name({"precision": amp_defaults}, tiny_token_files)


@pytest.mark.slow
def test_a_time_boxed_run_resumes_in_its_folder_when_rerun_without_stop_after(tmp_path, tiny_token_files):
    folders = WorkFolder(path=str(tmp_path / "checkpoints")), WorkFolder(path=str(tmp_path / "logs"))
    first = train_model(configure_training(training_params(1, schedule={"stop_after": 3}), tiny_token_files),
                        tiny_token_files, *folders)
    assert (first.step, first.finished) == (3, False)

    # The rerun drops stop_after and changes cadences and the device: the same run, continued from step 3.
    rerun = training_params(1, schedule={"log_every": 2, "keep_last": 0}, device={"peak_tflops": 1.0})
    second = train_model(configure_training(rerun, tiny_token_files), tiny_token_files, *folders)
    assert (second.run_name, second.step, second.finished) == (first.run_name, 6, True)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.run_name]
    metrics = (tmp_path / "logs" / first.run_name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4, 6]  # from 0 it would log 2, 4, 6 again
