"""The bundle: every form written and proven against the trained model; bad inputs leave nothing behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.export.conftest import export_params
from train_deploy.corpus.tokenizer import TokenizerInfo
from train_deploy.export.bundle import export_bundle
from train_deploy.export.checks import ParityError
from train_deploy.export.config import ExportConfig
from train_deploy.training.checkpoint import CheckpointError

pytestmark = pytest.mark.slow


def test_bundle_holds_server_edge_tokenizer_proofs_and_card(tiny_bundle):
    meta = json.loads((tiny_bundle / "bundle.json").read_text(encoding="utf-8"))
    for name in ("server/model.json", "server/model.pdiparams", "edge/model.onnx", "edge/model.int8.onnx",
                 "tokenizer/sentencepiece.bpe.model", "parity.json", "latency.json"):
        assert meta["files"][name] == (tiny_bundle / name).stat().st_size > 0
    assert meta["model"]["context"] == 128 and meta["source"]["step"] == 6
    parity = json.loads((tiny_bundle / "parity.json").read_text(encoding="utf-8"))
    assert parity["passed"] and parity["samples"] == 4 and parity["seq_length"] == 32
    assert parity["max_abs_logit_diff"]["paddle_inference"] <= 1e-4
    assert parity["max_abs_logit_diff"]["onnx_fp32"] <= 1e-4
    assert parity["int8_perplexity_increase"] <= 0.03
    assert abs(parity["perplexity"]["onnx_fp32"] / parity["perplexity"]["trained"] - 1) < 1e-5
    latency = json.loads((tiny_bundle / "latency.json").read_text(encoding="utf-8"))
    assert set(latency["forms"]) == {"paddle_eager", "paddle_inference", "onnx_fp32", "onnx_int8"}
    assert all(row["batch_2"]["p50"] > 0 for row in latency["forms"].values())
    card = (tiny_bundle / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert "| onnx_int8 | `edge/model.int8.onnx` |" in card and "Selected because: last: test." in card
    assert "## Intended use and limits" in card


def test_same_checkpoint_and_configuration_reuse_the_bundle(tiny_bundle, tiny_checkpoint, tiny_tokenizer):
    config = ExportConfig.from_params(export_params(tiny_bundle.parent.parent))
    folder, reused = export_bundle(tiny_checkpoint, TokenizerInfo(**tiny_tokenizer), config, "tiny", {})
    assert reused and folder == tiny_bundle


def _nothing_written(output_dir: Path) -> bool:
    """No bundle and no temporary folder (a failed parity report is kept on purpose)."""
    left = [p for p in output_dir.rglob("*") if p.name.startswith(".") or p.name == "bundle.json"]
    return not left


def test_missing_or_corrupt_checkpoint_is_named(tmp_path, tiny_checkpoint, tiny_tokenizer):
    config = ExportConfig.from_params(export_params(tmp_path / "out"))
    tokenizer = TokenizerInfo(**tiny_tokenizer)
    with pytest.raises(CheckpointError, match=r"step_00000099/state.json: unreadable checkpoint state"):
        export_bundle(tiny_checkpoint.parent / "step_00000099", tokenizer, config, "tiny", {})
    broken = tmp_path / "step_00000006"
    shutil.copytree(tiny_checkpoint, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(CheckpointError, match=r"step_00000006/model.safetensors: corrupt or truncated"):
        export_bundle(broken, tokenizer, config, "tiny", {})
    assert _nothing_written(tmp_path / "out")


def test_tokenizer_with_another_vocabulary_is_refused(tmp_path, tiny_checkpoint, tiny_tokenizer):
    config = ExportConfig.from_params(export_params(tmp_path / "out"))
    other = TokenizerInfo(**{**tiny_tokenizer, "vocab_size": tiny_tokenizer["vocab_size"] + 100})
    with pytest.raises(CheckpointError, match=rf"the tokenizer has {other.vocab_size} ids but .*step_00000006 was "
                                              rf"trained with {tiny_tokenizer['vocab_size']}"):
        export_bundle(tiny_checkpoint, other, config, "tiny", {})
    assert _nothing_written(tmp_path / "out")


def test_failed_parity_fails_with_the_numbers_and_keeps_no_bundle(tmp_path, tiny_checkpoint, tiny_tokenizer):
    config = ExportConfig.from_params(export_params(tmp_path / "out", parity={"max_logit_diff": 1e-12}))
    with pytest.raises(ParityError, match=r"parity failed: paddle_inference max \|logit diff\| \S+ > 1e-12; "
                                          r"onnx_fp32 max \|logit diff\|"):
        export_bundle(tiny_checkpoint, TokenizerInfo(**tiny_tokenizer), config, "tiny", {})
    assert _nothing_written(tmp_path / "out")
    (report,) = (tmp_path / "out" / "tiny").glob("*.parity-failed.json")
    assert not json.loads(report.read_text(encoding="utf-8"))["passed"]
