"""The bundle: every form written and proven against the trained model; bad inputs leave nothing behind."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.export import export_into, export_params, fused_here, selected
from tests.helpers.project import publish
from train_deploy.baselines import Baselines, ngram_baselines
from train_deploy.export.card import model_card
from train_deploy.export.checks import ParityError
from train_deploy.handoffs import (
    Bundle,
    BundleMeta,
    CheckpointState,
    LatencyReport,
    ParityReport,
    ServerGraph,
    from_json,
    to_json,
)
from train_deploy.hashing import file_record
from train_deploy.pipelines.export.nodes import report_export
from train_deploy.training.checkpoint import CheckpointError
from train_deploy.training.evaluation import validation_windows

pytestmark = pytest.mark.slow


def test_bundle_holds_server_edge_tokenizer_proofs_and_card(tiny_bundle):
    meta = json.loads((tiny_bundle / "bundle.json").read_text(encoding="utf-8"))
    fused = fused_here()  # where the fused kernels run (AVX-512), both graphs; else the portable one alone
    for name in ("server_portable/model.json", "server_portable/model.pdiparams", "server_portable/decode.pdiparams",
                 "edge/model.onnx", "edge/model.int8.onnx", "edge/decode_inplace.onnx", "edge/decode_inplace.int8.onnx",
                 "tokenizer/sentencepiece.bpe.model", "parity.json",
                 "latency.json", *(("server/model.json", "server/model.pdiparams", "server/decode.json") if fused
                                   else ())):
        assert meta["files"][name] == file_record(tiny_bundle / name) and meta["files"][name]["bytes"] > 0
    assert set(meta["files"]) == {p.relative_to(tiny_bundle).as_posix() for p in tiny_bundle.rglob("*")
                                  if p.is_file()} - {"bundle.json"}  # every other file, the card too
    assert meta["model"]["context"] == 128 and meta["source"]["step"] == 6 and meta["format"] == 11
    assert meta["graphs"] == {"server_portable": {"kernels": [], "needs": []}} | (
        {"server": {"kernels": ["swiglu", "fused_rms_norm"], "needs": ["probe:swiglu", "probe:fused_rms_norm"]}}
        if fused else {})
    assert meta["kernel_probe"]["runs"] == fused
    parity = json.loads((tiny_bundle / "parity.json").read_text(encoding="utf-8"))
    assert parity["passed"] and parity["samples"] == 4 and parity["seq_length"] == 32
    assert ("not_shipped" in parity) != fused
    paddle = ("paddle_inference", "paddle_portable") if fused else ("paddle_portable",)
    for form in (*paddle, "onnx_fp32"):  # every graph shipped is proven
        assert parity["max_abs_logit_diff"][form] <= 1e-4 and parity["kv_cache"]["max_abs_logit_diff"][form] <= 1e-4
    assert parity["int8_perplexity_increase"] <= 0.03
    assert abs(parity["perplexity"]["onnx_fp32"] / parity["perplexity"]["trained"] - 1) < 1e-5
    latency = json.loads((tiny_bundle / "latency.json").read_text(encoding="utf-8"))
    assert set(latency["forms"]) == {"paddle_eager", *paddle, "onnx_fp32", "onnx_int8"}
    assert all(row["batch_2"]["p50"] > 0 for row in latency["forms"].values())
    generation = latency["generation"]
    assert generation["new_tokens"] == 32 and generation["prompt_tokens"] == 16
    assert set(generation["forms"]) == {*paddle, "onnx_fp32", "onnx_int8"}
    assert all(row["ms_per_token"] > 0 for row in generation["forms"].values())
    card = (tiny_bundle / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert "| onnx_int8 | `edge/model.int8.onnx` |" in card and "Selected because: last: test." in card
    assert "| paddle_portable | `server_portable/model.pdiparams` |" in card
    assert ("- `server/`: Paddle's fused kernels (swiglu, fused_rms_norm)" in card) == fused
    assert "- `server_portable/`: portable operators only" in card
    assert "## Intended use and limits" in card


def test_parity_and_card_carry_the_ngram_baselines_and_warn_when_the_model_loses_to_the_bigram(
        tiny_bundle, tiny_token_files, tiny_checkpoint, tiny_run):
    parity = json.loads((tiny_bundle / "parity.json").read_text(encoding="utf-8"))
    windows = validation_windows(tiny_token_files.prefix("valid"), tiny_token_files.dtype, 32, 4)  # parity's
    train = np.memmap(f"{tiny_token_files.prefix('train')}.bin", dtype=tiny_token_files.dtype, mode="r")
    expected = ngram_baselines(train, windows, tiny_token_files.tokenizer.vocab_size)
    baselines = parity["baselines"]
    assert baselines["unigram_loss"] == pytest.approx(expected.unigram_loss, rel=1e-12)
    assert baselines["bigram_loss"] == pytest.approx(expected.bigram_loss, rel=1e-12)
    assert baselines["model_loss"] == pytest.approx(math.log(parity["perplexity"]["trained"]), rel=1e-9)
    # 6 tiny steps learn less than a bigram table: the card says so at its top, with both numbers, on the
    # evaluation windows the validation loss was measured on, and gives the parity windows' comparison too
    assert baselines["model_loss"] > baselines["bigram_loss"] and not baselines["model_beats_bigram"]
    meta = json.loads((tiny_bundle / "bundle.json").read_text(encoding="utf-8"))
    source = meta["source"]
    evaluation = validation_windows(tiny_token_files.prefix("valid"), tiny_token_files.dtype, tiny_run.seq_length,
                                    tiny_run.eval_windows)
    assert source["val_baselines"] == dataclasses.asdict(ngram_baselines(
        train, evaluation, tiny_token_files.tokenizer.vocab_size))
    assert source["val_loss"] == pytest.approx(tiny_run.val_loss) and source["val_loss"] > source[
        "val_baselines"]["bigram_loss"]
    card = (tiny_bundle / "MODEL_CARD.md").read_text(encoding="utf-8")
    head = card.split("## Model", 1)[0]
    strongest, best = Baselines.from_report(source["val_baselines"]).strongest()  # the verdict is against it
    assert f"Warning: this model does not yet beat the {strongest} baseline ({source['val_loss']:.4f} vs " \
           f"{best:.4f} nats/token" in head
    assert f"unigram {baselines['unigram_loss']:.4f}" in card and f"the model's {baselines['model_loss']:.4f}" in card
    assert f"Kneser-Ney trigram {baselines['kn_trigram_loss']:.4f}" in card
    assert card.count("is **not below** the strongest (") == 2  # evaluation and parity windows
    metrics = report_export(Bundle.read_folder(tiny_bundle))  # what MLflow gets, as export.<name>
    assert metrics["baseline_bigram_loss"]["value"] == baselines["bigram_loss"]
    assert metrics["baseline_unigram_loss"]["value"] == baselines["unigram_loss"]
    assert metrics["model_loss"]["value"] == baselines["model_loss"]

    # the same card for a model below the bigram baseline carries no warning
    latency = json.loads((tiny_bundle / "latency.json").read_text(encoding="utf-8"))
    state = json.loads((tiny_checkpoint / "state.json").read_text(encoding="utf-8"))
    better = {**parity, "baselines": {**baselines, "model_loss": Baselines.from_report(baselines).strongest()[1] - 0.5,
                                      "model_beats_bigram": True, "model_beats_strongest": True}}
    meta["source"]["val_loss"] = best - 0.5
    winning = model_card(from_json(BundleMeta, meta, "bundle.json"), from_json(CheckpointState, state, "state.json"),
                         from_json(ParityReport, better, "parity.json"), from_json(LatencyReport, latency, "latency"))
    assert "Warning" not in winning and winning.count("is below the strongest (") == 2


def test_same_checkpoint_and_configuration_keep_the_bundle_as_a_new_linked_version(tiny_bundle, tiny_checkpoint,
                                                                                  tiny_tokenizer, tiny_token_files,
                                                                                  tiny_run, tiny_training_logs):
    from train_deploy.pipelines.export.nodes import export_model

    work, _ = export_model(export_params(), selected(tiny_checkpoint), tiny_tokenizer, tiny_token_files, tiny_run,
                           tiny_training_logs)
    kept = publish(work, tiny_bundle.parent.parent, Bundle, versions=True)
    assert kept.reused and Path(kept.path) != tiny_bundle and kept.fingerprint == json.loads(
        (tiny_bundle / "bundle.json").read_text(encoding="utf-8"))["fingerprint"]
    for name in ("server_portable/model.pdiparams", "edge/model.onnx", "MODEL_CARD.md", "plots/training.png"):  # links
        assert (Path(kept.path) / name).stat().st_ino == (tiny_bundle / name).stat().st_ino


def _nothing_written(output_dir: Path) -> bool:
    """No bundle and no temporary folder (a failed parity report is kept on purpose)."""
    left = [p for p in output_dir.rglob("*") if p.name.startswith(".") or p.name == "bundle.json"]
    return not left


def test_missing_or_corrupt_checkpoint_is_named(tmp_path, tiny_checkpoint, tiny_tokenizer, tiny_token_files):
    out = tmp_path / "out" / "bundle"
    with pytest.raises(CheckpointError, match=r"step_00000099/state.json: unreadable checkpoint state"):
        export_into(out, tiny_checkpoint.parent / "step_00000099", tiny_tokenizer, tiny_token_files)
    broken = tmp_path / "step_00000006"
    shutil.copytree(tiny_checkpoint, broken)
    model = broken / "model.safetensors"
    size = model.stat().st_size
    with open(model, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"^{model}: {size // 2} bytes, state.json records {size} "
                                              r"\(truncated or overwritten\)$"):
        export_into(out, broken, tiny_tokenizer, tiny_token_files)
    model.write_bytes(bytes(size))  # zeroed: the recorded size, not the recorded content
    with pytest.raises(CheckpointError, match=rf"^{model}: content changed since it was written"):
        export_into(out, broken, tiny_tokenizer, tiny_token_files)
    assert _nothing_written(tmp_path / "out")


def test_token_files_of_another_corpus_are_refused_naming_both_fingerprints(tmp_path, tiny_checkpoint,
                                                                             tiny_tokenizer, tiny_token_files):
    other = dataclasses.replace(tiny_token_files, fingerprint="0" * 32)
    with pytest.raises(CheckpointError, match=rf"^{tiny_checkpoint} was trained on corpus "
                                              rf"{tiny_token_files.fingerprint} but the token files are corpus "
                                              rf"{'0' * 32}; use the token files it was trained on$"):
        export_into(tmp_path / "out" / "bundle", tiny_checkpoint, tiny_tokenizer, other)
    assert _nothing_written(tmp_path / "out")


def test_tokenizer_with_another_vocabulary_is_refused(tmp_path, tiny_checkpoint, tiny_tokenizer, tiny_token_files):
    other = dataclasses.replace(tiny_tokenizer, vocab_size=tiny_tokenizer.vocab_size + 100)
    with pytest.raises(CheckpointError, match=rf"the tokenizer has {other.vocab_size} ids but .*step_00000006 was "
                                              rf"trained with {tiny_tokenizer.vocab_size}"):
        export_into(tmp_path / "out" / "bundle", tiny_checkpoint, other, tiny_token_files)
    assert _nothing_written(tmp_path / "out")


def test_failed_parity_fails_with_the_numbers_and_keeps_no_bundle(tmp_path, tiny_checkpoint, tiny_tokenizer,
                                                                   tiny_token_files):
    fused = r"paddle_inference max \|logit diff\| \S+ > 1e-12; " if fused_here() else ""  # every graph shipped
    with pytest.raises(ParityError, match=rf"parity failed: {fused}paddle_portable max \|logit diff\| \S+ > 1e-12; "
                                          r"onnx_fp32 max \|logit diff\|"):
        export_into(tmp_path / "out" / "bundle", tiny_checkpoint, tiny_tokenizer, tiny_token_files,
                    parity={"max_logit_diff": 1e-12})
    assert _nothing_written(tmp_path / "out")
    (report,) = (tmp_path / "out").glob("parity-failed-*.json")
    assert not json.loads(report.read_text(encoding="utf-8"))["passed"]


def test_a_checkpoint_trained_with_flash_attention_exports_with_portable_kernels(tmp_path, tiny_checkpoint,
                                                                                tiny_tokenizer, tiny_token_files):
    """A GPU run's state.json says use_flash_attention and use_fused_rope: the export graph and the parity
    reference are built portable (float32, on CPU here), and parity holds against the same weights."""
    checkpoint = tmp_path / "gpu_run" / tiny_checkpoint.name
    shutil.copytree(tiny_checkpoint, checkpoint)
    state = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))
    state["model_config"] |= {"use_flash_attention": True, "use_fused_rope": True, "use_fused_rms_norm": True}
    (checkpoint / "state.json").write_text(json.dumps(state), encoding="utf-8")
    bundle = export_into(tmp_path / "out" / "bundle", checkpoint, tiny_tokenizer, tiny_token_files,
                         edge={"int8": False}, latency={"batch_sizes": [1]})
    assert bundle.parity.passed and bundle.parity.max_abs_logit_diff["paddle_portable"] <= 1e-4
    assert bundle.parity.max_abs_logit_diff.get("paddle_inference", 0) <= 1e-4
    assert "flash" not in json.dumps(to_json(bundle.meta)) and "flash" not in bundle.card


def test_where_the_fused_kernels_cannot_run_the_export_ships_the_portable_graph_alone_and_says_why(
        tmp_path, tiny_checkpoint, tiny_tokenizer, tiny_token_files, monkeypatch):
    """As on a CPU without AVX-512 (the probe's verdict forced): the export does not die, the fused graph it could
    not prove is not shipped, parity.json and the card say why, and the bundle loads on its portable graph."""
    from tests.helpers.export import NO_CURVES
    from train_deploy.export import LanguageModel, probe
    from train_deploy.export.bundle import bundle_fingerprint
    from train_deploy.export.config import ExportConfig

    config = ExportConfig.from_params(export_params())
    fingerprints = {}
    try:
        for setting in ("on", "off"):
            monkeypatch.setenv("TRAIN_DEPLOY_FUSED_KERNELS", setting)
            probe._verdict.cache_clear()
            fingerprints[setting] = bundle_fingerprint(tiny_checkpoint, tiny_tokenizer, config, NO_CURVES)
        folder = tmp_path / "out" / "bundle"
        bundle = export_into(folder, tiny_checkpoint, tiny_tokenizer, tiny_token_files, edge={"int8": False},
                             latency={"batch_sizes": [1], "generate_tokens": 4})
        model = LanguageModel.load(folder, "paddle")
    finally:
        probe._verdict.cache_clear()
    # a bundle without the fused graph is another bundle: never reused where the fused kernels run
    assert fingerprints["on"] != fingerprints["off"]
    assert not (folder / "server").exists() and (folder / "server_portable" / "decode.pdiparams").is_file()
    assert bundle.meta.graphs == {"server_portable": ServerGraph()}
    assert bundle.meta.kernel_probe == {"runs": False, "reason": "TRAIN_DEPLOY_FUSED_KERNELS=off"}
    assert bundle.parity.passed and set(bundle.parity.max_abs_logit_diff) == {"paddle_portable", "onnx_fp32"}
    why = "the fused graph could not be checked on the exporting machine: TRAIN_DEPLOY_FUSED_KERNELS=off"
    assert bundle.parity.not_shipped == {"server": why}
    assert f"- `server/` not shipped: {why}." in bundle.card
    assert set(bundle.latency.generation["forms"]) == {"paddle_portable", "onnx_fp32"}
    assert model.engine == "paddle_portable"
