"""Typed hand-offs: one JSON form, local fields left out, every key and type checked on read."""

from __future__ import annotations

import json

import pytest

from train_deploy.handoffs import (
    CheckpointRef,
    CheckpointState,
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
    del data["format"]
    data["splits"]["valid"]["tokens"] = 5
    with pytest.raises(DescriptionError, match=r"^m.json: format: required$"):
        from_json(TokenManifest, data, "m.json")
    data["tokenizer"]["surprise"] = 1
    with pytest.raises(DescriptionError, match=r"^m.json: tokenizer.surprise: unknown key$"):
        from_json(TokenManifest, data, "m.json")
    with pytest.raises(DescriptionError, match=r"^m.json: expected a mapping, got list$"):
        from_json(TokenManifest, [data], "m.json")


def test_a_checkpoint_reference_comes_from_its_state(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"step": 7, "val_loss": 2.5, "averaged": {
        "method": "ema", "sources": [{"path": "a/step_00000005"}, {"path": "a/step_00000007"}]}}))
    assert CheckpointRef.read_folder(tmp_path) == CheckpointRef(
        path=str(tmp_path), step=7, val_loss=2.5, averaged_from=["a/step_00000005", "a/step_00000007"], method="ema")
    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(DescriptionError, match=r"state.json: unreadable checkpoint state \(not a JSON object with a "
                                               r"step\)$"):
        CheckpointRef.read_folder(tmp_path)
    (tmp_path / "state.json").write_text('{"step": "seven"}')
    with pytest.raises(DescriptionError, match=r"state.json: step: expected an integer, got 'seven'$"):
        CheckpointRef.read_folder(tmp_path)


def test_a_checkpoint_state_is_written_back_byte_for_byte_in_its_writers_key_order(tmp_path):
    """Training's and averaging's state.json keep their key order and format (checkpoints stay byte-identical);
    keys a checkpoint lacks stay out, a null validation loss stays in."""
    trained = {"step": 3, "consumed_samples": 24, "val_loss": None, "lr": 0.001, "layout": {"dp": 1, "mp": 1},
               "model_config": {"vocab_size": 64, "rope_scaling_type": None}, "training": {"init_from": "scratch"},
               "data": {"corpus_fingerprint": "c"}, "parameters": 1000,
               "files": {"model.safetensors": {"bytes": 8, "xxh3_128": "ab"}}}
    averaged = {"step": 3, "model_config": {"vocab_size": 64}, "val_loss": None,
                "averaged": {"fingerprint": "f", "method": "ema", "decay": 0.5, "weights": [0.25, 0.75],
                             "sources": [{"path": "a", "step": 2, "xxh3_128": "cd"}], "copied_from_newest": ["n"],
                             "note": "x"},
                "files": {"model.safetensors": {"bytes": 8, "xxh3_128": "ef"}}}
    again = tmp_path / "again"
    again.mkdir()
    for record in (trained, averaged):
        text = json.dumps(record, indent=2)
        (tmp_path / "state.json").write_text(text, encoding="utf-8")
        CheckpointState.read(tmp_path).write(again)
        assert (again / "state.json").read_text(encoding="utf-8") == text


BUNDLE_DESCRIPTION = {"version": "v", "fingerprint": "f", "created_at": "", "source": {"checkpoint": "c", "step": 1},
                      "model": {"architecture": "llama", "context": 8, "vocab_size": 8, "eos_id": 0, "hidden_size": 8,
                                "layers": 1, "heads": 1},
                      "tokenizer": {}, "too_long": "raise", "server": {}, "edge": {}, "software": {}}


def test_bundle_json_is_read_typed_with_sizes_of_both_formats_and_an_old_format_refused_in_one_line(tmp_path):
    from train_deploy.handoffs import BundleMeta, FileRecord

    (tmp_path / "bundle.json").write_text(json.dumps(BUNDLE_DESCRIPTION | {"format": 8, "files": {"a": 3}}))
    assert BundleMeta.read(tmp_path).sizes() == {"a": 3}  # format 8: sizes alone
    record = {"bytes": 5, "xxh3_128": "00"}
    (tmp_path / "bundle.json").write_text(json.dumps(BUNDLE_DESCRIPTION | {"format": 9, "files": {"a": record}}))
    meta = BundleMeta.read(tmp_path)
    assert meta.files == {"a": FileRecord(**record)} and meta.sizes() == {"a": 5} and meta.model.context == 8
    (tmp_path / "bundle.json").write_text(json.dumps({"format": 6, "model": {}}))
    with pytest.raises(DescriptionError, match=rf"^{tmp_path}/bundle.json: bundle format 6 is older than the graphs "
                                               r"this runtime runs \(format 7\); re-export it \(kedro run "
                                               r"--pipelines export\)$"):
        BundleMeta.read(tmp_path)
