"""The plan over the project's folders: superseded runs, old bundle versions, stores past keep_last, old warm-start
downloads; never what :class:`Kept` names. Fabricated folders, no MLflow (tests/retention/test_collect.py has it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.helpers.retention import bundle_meta
from train_deploy.retention import Kept, Layout, RetentionConfig, last_run_bytes
from train_deploy.retention.disk import tree_bytes
from train_deploy.retention.plan import Registered, plan_files


def _folder(path: Path, size: int = 1000, age: float = 0.0) -> Path:
    path.mkdir(parents=True)
    (path / "payload").write_bytes(b"x" * size)
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def _layout(root: Path) -> Layout:
    """Ten runs (run9 newest), five bundle versions, five token folders, three warm-start downloads."""
    for i in range(10):
        _folder(root / "checkpoints" / f"run{i}", age=100 - i)
        _folder(root / "logs" / f"run{i}", age=100 - i)
    for i in range(5):
        version = _folder(root / "bundle" / f"2026-12-0{i + 1}T00.00.00.000Z" / "bundle")
        (version / "bundle.json").write_text(json.dumps(bundle_meta(f"bundle{i}")))
        _folder(root / "tokens.by_fingerprint" / f"corpus{i}", age=100 - i)
    (root / "tokens").symlink_to("tokens.by_fingerprint/corpus0")  # the current one, though oldest
    for version in (1, 2, 3):
        _folder(root / "init_from" / "champion" / f"lm-v{version}")
    return Layout(project=root, checkpoints=root / "checkpoints", training_logs=root / "logs", bundles=root / "bundle",
                  stores=[("token_files", root / "tokens.by_fingerprint", 2)], init_cache=root / "init_from")


def _targets(removals, kind: str) -> list[str]:
    return sorted(Path(r.target).name for r in removals if r.kind == kind)


def test_the_plan_keeps_the_newest_and_whatever_an_alias_needs(tmp_path):
    layout = _layout(tmp_path)
    kept = Kept(versions={"lm": {"3": ["champion"], "2": ["previous"]}}, run_names={"run1", "run2"},
                bundle_fingerprints={"bundle0"}, corpus_fingerprints={"corpus1"}, init_folders={"lm-v3", "lm-v2"})
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 2}, "training_logs": {"keep_runs": 3},
                                          "bundles": {"keep_last": 1}})
    removals = plan_files(layout, config, ["lm"], kept)
    assert _targets(removals, "checkpoints") == [f"run{i}" for i in (0, 3, 4, 5, 6, 7)]  # 8, 9 newest; 1, 2 aliases
    assert _targets(removals, "training_logs") == [f"run{i}" for i in (0, 3, 4, 5, 6)]
    assert _targets(removals, "bundle") == ["2026-12-02T00.00.00.000Z", "2026-12-03T00.00.00.000Z",
                                            "2026-12-04T00.00.00.000Z"]  # 05 newest, 01 is bundle0 (champion)
    # keep_last 2 as the dataset counts it: the current (corpus0) and the one used last (corpus4); corpus1: alias
    assert _targets(removals, "token_files") == ["corpus2", "corpus3"]
    assert _targets(removals, "init_cache") == ["lm-v1"]
    assert all(r.bytes >= 1000 and r.reason for r in removals)
    assert not any(Path(r.target).exists() is False for r in removals)  # a plan removes nothing


def test_zero_keeps_all(tmp_path):
    layout = _layout(tmp_path)
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 0}, "training_logs": {"keep_runs": 0},
                                          "bundles": {"keep_last": 0}})
    layout.stores = [("token_files", tmp_path / "tokens.by_fingerprint", 0)]
    assert [r.kind for r in plan_files(layout, config, ["lm"], Kept())] == ["init_cache"] * 3


def test_the_last_run_is_its_newest_checkpoint_log_and_bundle_and_the_bundles_mlflow_copies(tmp_path):
    layout = _layout(tmp_path)
    alone = last_run_bytes(layout)
    layout.mlflow_local = [tmp_path / "mlartifacts"]
    assert last_run_bytes(layout) > alone >= 3000


def test_failed_runs_take_no_place_from_runs_that_registered_a_version(tmp_path):
    """run9 (newest) to run0: only run1, run3 and run5 registered a version; keep 2 places, bundles 1, stores 3."""
    layout = _layout(tmp_path)
    registered = Registered(run_names={"run1", "run3", "run5"}, bundle_fingerprints={"bundle1"},
                            corpus_fingerprints={"corpus1", "corpus2"})
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 2}, "training_logs": {"keep_runs": 1},
                                          "bundles": {"keep_last": 1}})
    layout.stores = [("token_files", tmp_path / "tokens.by_fingerprint", 3)]
    removals = plan_files(layout, config, ["lm"], Kept(registered=registered))
    # the newest (a retry resumes it), then the 2 newest that registered a version: run5 and run3
    assert _targets(removals, "checkpoints") == [f"run{i}" for i in (0, 1, 2, 4, 6, 7, 8)]
    assert _targets(removals, "training_logs") == [f"run{i}" for i in (0, 1, 2, 3, 4, 6, 7, 8)]
    assert _targets(removals, "bundle") == ["2026-12-01T00.00.00.000Z", "2026-12-03T00.00.00.000Z",
                                            "2026-12-04T00.00.00.000Z"]  # 05 newest, 02 is bundle1
    # the current (corpus0), then 2 places: corpus2 and corpus1 registered, before the newer corpus3 and corpus4
    assert _targets(removals, "token_files") == ["corpus3", "corpus4"]
    assert sum(r.bytes for r in removals if r.kind == "checkpoints") == sum(
        tree_bytes(tmp_path / "checkpoints" / f"run{i}") for i in (0, 1, 2, 4, 6, 7, 8))


def test_what_an_alias_needs_is_spared_and_said_why(tmp_path):
    layout = _layout(tmp_path)
    kept = Kept()
    for field_name, value in (("run_names", "run0"), ("corpus_fingerprints", "corpus1"), ("init_folders", "lm-v2"),
                              ("bundle_fingerprints", "bundle0")):
        kept.need(field_name, value, "edu_lm version 2 (previous)")
    kept.need("run_names", "run0", "lm version 1 (champion)")
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 9}, "training_logs": {"keep_runs": 0},
                                          "bundles": {"keep_last": 4}})
    removals = plan_files(layout, config, ["lm", "edu_lm"], kept)
    assert [(r.kind, Path(r.target).name) for r in removals] == [
        ("token_files", "corpus3"), ("token_files", "corpus2"), ("init_cache", "lm-v3"), ("init_cache", "lm-v1")]
    assert [(kind, Path(target).name, why) for kind, target, why in kept.spared] == [
        ("checkpoints", "run0", "needed by edu_lm version 2 (previous); lm version 1 (champion)"),
        ("bundle", "2026-12-01T00.00.00.000Z", "needed by edu_lm version 2 (previous)"),
        ("token_files", "corpus1", "needed by edu_lm version 2 (previous)"),
        ("init_cache", "lm-v2", "needed by edu_lm version 2 (previous)")]
