"""run.json: the training node's validated configuration and resolved layout, which workers only deserialise."""

from __future__ import annotations

import json

import pytest

from tests.helpers.training import run_spec, training_params
from train_deploy.config import ConfigError
from train_deploy.handoffs import DataSpec, DescriptionError, read_json, to_json, write_json
from train_deploy.training.config import Layout, TrainingConfig
from train_deploy.training.spec import RunSpec

DATA = DataSpec(train_prefix="t/train", valid_prefix="t/valid", dtype="uint16", vocab_size=2000, eos_id=2,
                corpus_fingerprint="c", tokenizer_hash="h")


def test_run_json_reads_back_as_the_node_wrote_it(tmp_path):
    spec = run_spec(tmp_path, DATA, training_params(2, parallel={"dp": -1}))
    write_json(tmp_path / "run.json", spec)
    again = read_json(RunSpec, tmp_path / "run.json")
    assert again == spec and isinstance(again.training, TrainingConfig)
    assert again.layout == Layout(dp=2, mp=1, pp=1, sharding_stage=0, accumulation_steps=1)  # resolved by the node


def test_a_worker_deserialises_the_configuration_without_validating_it_again(tmp_path):
    """The ranges and invariants are the configure node's; reading run.json checks keys and types only."""
    data = to_json(run_spec(tmp_path, DATA, training_params(1)))
    data["training"]["parallel"]["pp"] = 2
    with pytest.raises(ConfigError, match=r"^training\.parallel\.pp: pipeline parallelism is not supported"):
        TrainingConfig.from_params(data["training"])
    (tmp_path / "run.json").write_text(json.dumps(data), encoding="utf-8")
    assert read_json(RunSpec, tmp_path / "run.json").training.parallel.pp == 2
    data["training"]["batch"]["seq_length"] = "long"
    (tmp_path / "run.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(DescriptionError, match=r"run.json: training.batch.seq_length: expected an integer, got"):
        read_json(RunSpec, tmp_path / "run.json")
