"""The export pipeline as Kedro runs it: catalog in, a published bundle version and its metrics out."""

from __future__ import annotations

from pathlib import Path

import pytest
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from tests.helpers.export import export_params, selected, training_logs
from train_deploy.datasets import ArtifactFolderDataset
from train_deploy.handoffs import Bundle
from train_deploy.pipelines.export import create_pipeline

pytestmark = pytest.mark.slow


def test_export_pipeline_turns_the_selected_checkpoint_into_a_reported_bundle(tmp_path, tiny_checkpoint,
                                                                               tiny_tokenizer, tiny_token_files,
                                                                               tiny_run):
    inputs = {"params:export": export_params(), "selected_checkpoint": selected(tiny_checkpoint),
              "tokenizer": tiny_tokenizer, "token_files": tiny_token_files, "training_result": tiny_run,
              "training_logs": training_logs(tmp_path / "training_logs", tiny_run)}
    catalog = DataCatalog({name: MemoryDataset(value) for name, value in inputs.items()})
    catalog["export_bundle"] = ArtifactFolderDataset(path=str(tmp_path / "bundle"),
                                                     description="train_deploy.handoffs.Bundle", versions=True)
    outputs = SequentialRunner().run(create_pipeline(), catalog)

    (version,) = (tmp_path / "bundle").iterdir()
    folder = version / "bundle"
    bundle = catalog["export_bundle"].load()
    assert isinstance(bundle, Bundle) and Path(bundle.path) == folder and bundle.parity.passed
    assert bundle.card == (folder / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert f"{tiny_token_files.splits['train'].documents} training documents" in bundle.card
    assert Bundle.read_folder(folder) == bundle  # what a later run loads from disk is what this one returned
    metrics = outputs["export_metrics"].load()
    assert metrics["max_logit_diff_onnx_fp32"]["value"] <= 1e-4
    assert metrics["latency_p50_ms_onnx_int8_batch_1"]["value"] > 0
    sizes = {form: metrics[f"size_mb_{form}"]["value"] for form in ("paddle_portable", "onnx_fp32", "onnx_int8")}
    assert sizes["onnx_int8"] < 0.5 * sizes["onnx_fp32"] and sizes["paddle_portable"] > 0.5 * sizes["onnx_fp32"]
    # The training curves go to the run as a figure too, drawn from the same rows as the bundle's picture.
    figure = outputs["training_curves"].load()
    assert [axis.get_title() for axis in figure.axes] == ["loss", "learning rate", "throughput", "gradient norm"]
    assert len(figure.axes[0].get_lines()[0].get_xdata()) == bundle.meta.training_curves["rows"] == tiny_run.step
    assert (folder / "plots" / "training.png").is_file()
