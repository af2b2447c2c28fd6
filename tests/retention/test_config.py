"""The ``retention`` block: sizes as bytes or text, and one-line errors naming the key."""

from __future__ import annotations

import pytest

from train_deploy.config import ConfigError
from train_deploy.retention import RetentionConfig, parse_size


@pytest.mark.parametrize(("value", "size"), [(1024, 1024), ("20GiB", 20 * 2**30), ("1.5 GB", 1_500_000_000),
                                             ("300mib", 300 * 2**20), ("7", 7), (None, None)])
def test_sizes_are_bytes_or_a_number_with_a_unit(value, size):
    assert parse_size(value, "retention.disk.budget") == size


@pytest.mark.parametrize(("block", "message"), [
    ({"disk": {"budget": "lots"}}, "retention.disk.budget: 'lots' is not a size"),
    ({"disk": {"run_estimate": -1}}, "retention.disk.run_estimate: must not be negative"),
    ({"bundles": {"keep_last": -1}}, "retention.bundles.keep_last: must not be negative"),
    ({"mlflow": {"grace_days": -2}}, "retention.mlflow.grace_days: must not be negative"),
    ({"checkpoints": {"keep": 2}}, "retention.checkpoints.keep: unknown key"),
])
def test_a_bad_value_is_one_line_naming_the_key(block, message):
    with pytest.raises(ConfigError) as error:
        RetentionConfig.from_params(block)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_budget_reads_as_bytes():
    config = RetentionConfig.from_params({"disk": {"budget": "2KiB", "run_estimate": 512}})
    assert (config.disk.budget_bytes, config.disk.estimate_bytes) == (2048, 512)


def test_every_gate_decision_can_be_listed_and_an_unknown_one_is_named():
    from typing import get_args

    from train_deploy.registry.rules import Decision

    every = [*get_args(Decision), "failed"]  # what gate.decision holds: the gate's verdicts, or its failure
    assert RetentionConfig.from_params({"mlflow": {"decisions": every}}).mlflow.decisions == every
    with pytest.raises(ConfigError, match=r"^retention.mlflow.decisions\[0\]: 'kept' is not one of 'rejected', "
                                          r"'failed', 'undecided', 'promoted', 'first', 'forced'$"):
        RetentionConfig.from_params({"mlflow": {"decisions": ["kept"]}})
