"""The export pipeline as Kedro runs it: catalog in, bundle description, metrics and model card out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from tests.export.conftest import export_params
from train_deploy.pipelines.export import create_pipeline

pytestmark = pytest.mark.slow


def test_export_pipeline_turns_the_selected_checkpoint_into_a_reported_bundle(tmp_path, tiny_checkpoint,
                                                                               tiny_tokenizer, tiny_tokens):
    manifest = json.loads((Path(tiny_tokens["train_prefix"]).parent / "manifest.json").read_text(encoding="utf-8"))
    inputs = {
        "params:export": export_params(tmp_path / "bundles"),
        "selected_checkpoint": {"path": str(tiny_checkpoint), "which": "last", "reason": "last: test"},
        "tokenizer": tiny_tokenizer,
        "token_manifest": manifest,
        "training_result": {"run_name": "tiny-run"},
    }
    catalog = DataCatalog({name: MemoryDataset(value) for name, value in inputs.items()})
    outputs = SequentialRunner().run(create_pipeline(), catalog)

    (folder,) = (tmp_path / "bundles" / "tiny-run").iterdir()
    assert json.loads((folder / "parity.json").read_text(encoding="utf-8"))["passed"]
    metrics = outputs["export_metrics"].load()
    assert metrics["max_logit_diff_onnx_fp32"]["value"] <= 1e-4
    assert metrics["latency_p50_ms_onnx_int8_batch_1"]["value"] > 0
    sizes = {form: metrics[f"size_mb_{form}"]["value"] for form in ("paddle_inference", "onnx_fp32", "onnx_int8")}
    assert sizes["onnx_int8"] < 0.5 * sizes["onnx_fp32"] and sizes["paddle_inference"] > 0.5 * sizes["onnx_fp32"]
    card = outputs["model_card"].load()
    assert card == (folder / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert f"{manifest['splits']['train']['documents']} training documents" in card
