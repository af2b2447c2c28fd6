"""Typed hand-offs: one JSON form, local fields left out, every key and type checked on read."""

from __future__ import annotations

import json

import pytest

from train_deploy.handoffs import (
    CheckpointRef,
    DescriptionError,
    SplitInfo,
    TokenManifest,
    from_json,
    read_json,
    to_json,
    write_json,
)


def test_a_token_manifest_round_trips_without_its_local_fields(tiny_token_files, tmp_path):
    data = to_json(tiny_token_files)
    assert "path" not in data and "reused" not in data and "path" not in data["tokenizer"]
    write_json(tmp_path / "manifest.json", tiny_token_files)
    again = read_json(TokenManifest, tmp_path / "manifest.json", path=tiny_token_files.path)
    assert again == tiny_token_files and isinstance(again.splits["train"], SplitInfo)
    assert again.prefix("valid") == tiny_token_files.prefix("valid")


def test_nested_records_and_unknown_keys_are_checked_with_the_file_named(tiny_token_files):
    data = to_json(tiny_token_files)
    data["splits"]["valid"]["tokens"] = "many"
    with pytest.raises(DescriptionError, match=r"^m.json: splits.valid.tokens: expected an integer, got 'many'$"):
        from_json(TokenManifest, data, "m.json")
    with pytest.raises(DescriptionError, match=r"^m.json: surprise: unknown key"):
        from_json(TokenManifest, {"surprise": 1}, "m.json")


def test_a_checkpoint_reference_comes_from_its_state(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"step": 7, "val_loss": 2.5, "averaged": {
        "method": "ema", "sources": [{"path": "a/step_00000005"}, {"path": "a/step_00000007"}]}}))
    assert CheckpointRef.read_folder(tmp_path) == CheckpointRef(
        path=str(tmp_path), step=7, val_loss=2.5, averaged_from=["a/step_00000005", "a/step_00000007"], method="ema")
    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(DescriptionError, match=r"state.json: unreadable checkpoint state \(KeyError\('step'\)\)"):
        CheckpointRef.read_folder(tmp_path)
