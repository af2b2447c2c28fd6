"""Disk use counted once per file, and the budget's one-line refusal naming the biggest folders."""

from __future__ import annotations

import os

import pytest

from train_deploy.retention import OverBudget, check_budget, usage
from train_deploy.retention.disk import tree_bytes


def _fill(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))


def test_hard_links_count_once_and_the_biggest_folder_comes_first(tmp_path):
    _fill(tmp_path / "data" / "06_models" / "checkpoints" / "run" / "w", 256 * 1024)
    os.link(tmp_path / "data/06_models/checkpoints/run/w", tmp_path / "data/06_models/copy")
    _fill(tmp_path / "data" / "07_model_output" / "bundle" / "b", 64 * 1024)
    measured = usage([tmp_path / "data", tmp_path / "data" / "06_models"])  # nested roots count once
    assert 320 * 1024 <= measured.total < 400 * 1024
    assert measured.folders[0][0] == tmp_path / "data" / "06_models" / "checkpoints"
    assert tree_bytes(tmp_path / "missing") == 0


def test_a_run_past_the_budget_stops_naming_what_uses_the_space(tmp_path):
    _fill(tmp_path / "data" / "06_models" / "checkpoints" / "run" / "w", 512 * 1024)
    _fill(tmp_path / "mlartifacts" / "1" / "a", 128 * 1024)
    with pytest.raises(OverBudget) as error:
        check_budget([tmp_path / "data", (tmp_path / "mlartifacts", 1)], 600 * 1024, 100 * 1024,
                     "the last run's outputs", tmp_path)
    line = str(error.value)
    assert "\n" not in line and line.startswith("retention.disk.budget: the project uses ")
    biggest = line.split("biggest: ")[1].split(";")[0].split(", ")
    assert [part.rsplit(" ", 2)[0] for part in biggest[:2]] == ["data/06_models/checkpoints", "mlartifacts/1"]
    assert "train-deploy gc" in line and "100.0 KiB (the last run's outputs)" in line
    assert check_budget([tmp_path / "data"], 2**30, 100 * 1024, "estimate", tmp_path) is not None  # fits


def test_a_run_larger_than_the_free_space_stops_without_a_budget(tmp_path):
    _fill(tmp_path / "data" / "x", 4096)
    with pytest.raises(OverBudget, match=r"^disk full: .* free where .* this run needs about 1024.0 TiB"):
        check_budget([tmp_path / "data"], None, 2**50, "retention.disk.run_estimate", tmp_path)
    assert check_budget([tmp_path / "data"], None, 1, "estimate", tmp_path) is None  # nothing to say
