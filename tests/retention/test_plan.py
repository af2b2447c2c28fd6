"""The plan over the project's folders: superseded runs, old bundle versions, stores past keep_last, old warm-start
downloads; never what :class:`Kept` names. Fabricated folders, no MLflow (tests/retention/test_collect.py has it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.helpers.retention import bundle_meta
from train_deploy.handoffs import TOKENIZER_FILE
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
    _folder(root / "checkpoints" / ".staging", age=200)  # the lock holder's, never a run
    (root / "checkpoints" / "notes.txt").write_text("not a run")
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
    assert all(r.bytes >= 1000 for r in removals)
    assert {r.kind: r.reason for r in removals} == {
        "checkpoints": "superseded training run (not the newest, nor among the 2 newest that registered a version; "
                       "no alias needs it)",
        "training_logs": "superseded training run (not the newest, nor among the 3 newest that registered a version; "
                         "no alias needs it)",
        "bundle": "bundle version not the newest, nor among the 1 newest registered; no alias needs it",
        "token_files": "not among the 2 corpora used last that a version was registered from (keep_last in the "
                       "catalog); no alias needs it",
        "init_cache": "downloaded for a warm start from a version that is no longer champion or previous"}
    assert not any(Path(r.target).exists() is False for r in removals)  # a plan removes nothing


def test_zero_keeps_all(tmp_path):
    layout = _layout(tmp_path)
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 0}, "training_logs": {"keep_runs": 0},
                                          "bundles": {"keep_last": 0}})
    layout.stores = [("token_files", tmp_path / "tokens.by_fingerprint", 0)]
    assert [r.kind for r in plan_files(layout, config, ["lm"], Kept())] == ["init_cache"] * 3


def test_the_last_run_is_its_newest_checkpoint_log_and_bundle_and_the_bundles_mlflow_copies(tmp_path):
    layout = _layout(tmp_path)
    newest = tmp_path / "bundle" / "2026-12-05T00.00.00.000Z"
    (newest / "bundle" / "weights").write_bytes(b"w" * 10000)  # the newest by name outweighs the others
    alone = last_run_bytes(layout)
    bundle = tree_bytes(newest)
    run9 = tree_bytes(tmp_path / "checkpoints" / "run9") + tree_bytes(tmp_path / "logs" / "run9")
    assert alone == run9 + bundle  # run9's checkpoint and log only, not the other nine runs'; the newest bundle only
    layout.mlflow_local = [tmp_path / "mlartifacts"]
    assert last_run_bytes(layout) == run9 + 3 * bundle  # plus the run's export/bundle and the logged model


def test_the_last_run_of_an_empty_project_wrote_nothing(tmp_path):
    layout = Layout(project=tmp_path, checkpoints=tmp_path / "checkpoints", training_logs=tmp_path / "logs",
                    bundles=tmp_path / "bundle", stores=[], init_cache=tmp_path / "init_from")
    assert last_run_bytes(layout) == 0


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
    kept.need("run_names", "run0", "lm version 1 (champion)")  # said once however often it is needed
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


def test_what_an_alias_needs_without_a_named_holder_is_said_so(tmp_path):
    layout = _layout(tmp_path)
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 1}, "training_logs": {"keep_runs": 0},
                                          "bundles": {"keep_last": 0}})
    layout.stores = []
    kept = Kept(run_names={"run1"}, bundle_fingerprints={"gone"})  # gone: its bundle version was removed before
    plan_files(layout, config, ["lm"], kept)
    assert [(kind, Path(target).name, why) for kind, target, why in kept.spared] == [
        ("checkpoints", "run1", "needed by an alias")]


def test_tokenizer_store_is_matched_by_the_hash_its_tokenizer_file_records(tmp_path):
    """Two stores in one plan, neither with a current link; the tokenizer's folders are named by anything, matched
    by ``hash`` in their tokenizer file; warm-start folders of a model whose name holds ``-v``."""
    layout = _layout(tmp_path)
    store = tmp_path / "tokenizer.by_fingerprint"
    for i in range(4):
        (_folder(store / f"t{i}", age=100 - i) / TOKENIZER_FILE).write_text(json.dumps({"hash": f"h{i}"}))
    (tmp_path / "tokens").unlink()
    layout.stores = [("token_files", tmp_path / "tokens.by_fingerprint", 1), ("tokenizer", store, 1)]
    for version in (1, 2):
        _folder(tmp_path / "init_from" / "champion" / f"edu-vlm-v{version}")
    kept = Kept()
    kept.need("tokenizer_hashes", "h1", "lm version 1 (champion)")
    kept.need("init_folders", "edu-vlm-v2", "edu-vlm version 2 (champion)")
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 0}, "training_logs": {"keep_runs": 0},
                                          "bundles": {"keep_last": 0}})
    removals = plan_files(layout, config, ["edu-vlm"], kept)
    # without a current link, keep_last 1 is the place of the folder used last (corpus4, t3): never all removed
    assert _targets(removals, "token_files") == ["corpus0", "corpus1", "corpus2", "corpus3"]
    assert _targets(removals, "tokenizer") == ["t0", "t2"]  # t1: the champion's
    assert _targets(removals, "init_cache") == ["edu-vlm-v1"]  # lm-v*: not this project's models
    assert ("tokenizer", str(store / "t1"), "needed by lm version 1 (champion)") in kept.spared


def test_no_warm_start_cache_plans_nothing_there(tmp_path):
    layout = _layout(tmp_path)
    layout.init_cache = None
    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 0}, "training_logs": {"keep_runs": 0},
                                          "bundles": {"keep_last": 0}})
    layout.stores = []
    assert plan_files(layout, config, ["lm"], Kept()) == []
