"""The bundle's pictures: training curves from the run's metrics, latency by form and batch, embedded in the card."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers.export import export_params, selected
from tests.helpers.project import publish
from train_deploy.export.bundle import bundle_fingerprint
from train_deploy.export.config import ExportConfig
from train_deploy.export.plots import TrainingCurves, latency_figure, read_training_curves, save_png, write_plots
from train_deploy.handoffs import Bundle, CheckpointRef, SelectedCheckpoint, WorkFolder

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG that decodes completely (a truncated or non-PNG file raises)."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.load()
        return image.size


def _write_metrics(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path


def test_curves_keep_steps_up_to_the_checkpoint_and_the_later_line_of_a_repeated_step(tmp_path, caplog):
    metrics = _write_metrics(tmp_path / "metrics.jsonl", [
        {"step": 1, "loss": 9.0, "lr": 1e-4, "tokens_per_second": 100.0},
        {"step": 2, "loss": 8.0, "lr": 2e-4, "tokens_per_second": 110.0, "val_loss": 8.5},
        {"step": 3, "loss": 7.9, "lr": 3e-4, "tokens_per_second": 120.0},  # lost to a kill, then re-run:
        "{\"step\": 3, \"loss\": 7.",                                        # a line cut by the kill
        {"step": 3, "loss": 7.5, "lr": 3e-4, "tokens_per_second": 125.0, "grad_norm": float("nan")},
        {"step": 4, "loss": 7.0, "lr": 4e-4, "tokens_per_second": 130.0},  # after the exported step
    ])
    with caplog.at_level(logging.WARNING, logger="train_deploy.export.plots"):
        curves = read_training_curves(metrics, up_to_step=3)
    assert [row["step"] for row in curves.rows] == [1, 2, 3]
    assert curves.rows[2] == {"step": 3, "loss": 7.5, "lr": 3e-4, "tokens_per_second": 125.0}  # NaN left out
    assert not curves.missing and curves.summary() == {"source": str(metrics), "rows": 3, "first_step": 1,
                                                       "last_step": 3}
    assert f"{metrics}: skipped 1 line(s) that are not metrics rows" in caplog.text
    # The digest follows the rows the picture shows, not the file: a later step changes nothing.
    _write_metrics(tmp_path / "more.jsonl", [json.loads(line) for line in metrics.read_text().splitlines()
                                             if line.endswith("}")] + [{"step": 5, "loss": 6.0}])
    assert read_training_curves(tmp_path / "more.jsonl", up_to_step=3).digest == curves.digest
    assert read_training_curves(metrics, up_to_step=2).digest != curves.digest


def test_a_missing_or_empty_metrics_file_gives_curves_that_say_why(tmp_path):
    missing = read_training_curves(tmp_path / "nowhere" / "metrics.jsonl", up_to_step=6)
    assert missing.rows == [] and missing.digest is None
    assert missing.summary() == {"missing": f"no training metrics file at {tmp_path / 'nowhere' / 'metrics.jsonl'}"}
    late = read_training_curves(_write_metrics(tmp_path / "metrics.jsonl", [{"step": 9, "loss": 1.0}]), 6)
    assert late.digest is None and late.missing == f"{tmp_path / 'metrics.jsonl'} has no metrics up to step 6"


def test_pictures_are_pngs_of_fixed_size_and_the_same_bytes_for_the_same_numbers(tmp_path):
    curves = read_training_curves(_write_metrics(tmp_path / "metrics.jsonl", [
        {"step": s, "loss": 9.0 - s, "lr": 1e-3 * min(s, 3) / 3, "tokens_per_second": 1000.0 + s,
         "grad_norm": 1.0 / s, **({"val_loss": 9.5 - s} if s % 2 == 0 else {})} for s in range(1, 9)]), 8)
    latency = {"seq_length": 16, "forms": {form: {f"batch_{b}": {"p50": b * k, "p95": b * k * 1.2}
                                                  for b in (1, 2, 8)}
                                           for k, form in enumerate(("paddle_eager", "onnx_fp32", "onnx_int8"), 1)}}
    first = write_plots(tmp_path / "a", curves, latency, title="training")
    assert first == {"latency": "plots/latency.png", "training": "plots/training.png"}
    assert _png_size(tmp_path / "a" / first["training"]) == (1000, 700)
    width, height = _png_size(tmp_path / "a" / first["latency"])
    assert width >= 600 and height == 400
    write_plots(tmp_path / "b", curves, latency, title="training")
    for name in first.values():  # deterministic: a reused bundle's pictures are what a rebuild would draw
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert write_plots(tmp_path / "c", TrainingCurves(missing="none"), latency) == {"latency": "plots/latency.png"}
    assert not (tmp_path / "c" / "plots" / "training.png").exists()


def test_latency_bars_are_grouped_by_batch_with_one_bar_per_form(tmp_path):
    latency = {"seq_length": 16, "forms": {"paddle_inference": {"batch_1": {"p50": 2.0, "p95": 3.0},
                                                                "batch_8": {"p50": 9.0, "p95": 9.5}},
                                           "onnx_int8": {"batch_1": {"p50": 1.0, "p95": 1.1},
                                                         "batch_8": {"p50": 4.0, "p95": 4.0}}}}
    figure = latency_figure(latency)
    (axis,) = figure.axes
    heights = {container.get_label(): [bar.get_height() for bar in container] for container in axis.containers
               if hasattr(container, "patches")}
    assert heights == {"paddle_inference": [2.0, 9.0], "onnx_int8": [1.0, 4.0]}
    assert [t.get_text() for t in axis.get_xticklabels()] == ["batch 1", "batch 8"]
    save_png(figure, tmp_path / "latency.png")
    assert _png_size(tmp_path / "latency.png")[1] == 400


@pytest.mark.slow
def test_a_checkpoint_from_elsewhere_gets_no_training_curves_and_the_node_says_so(tmp_path, caplog, tiny_checkpoint,
                                                                                  tiny_tokenizer, tiny_token_files,
                                                                                  tiny_run, tiny_training_logs):
    from train_deploy.pipelines.export.nodes import export_model

    copy = shutil.copytree(tiny_checkpoint, tmp_path / "elsewhere" / tiny_checkpoint.name)  # same step, other run
    foreign = SelectedCheckpoint(checkpoint=CheckpointRef.read_folder(copy), which="last", reason="test",
                                 validation_loss=3.0, evaluated_on_windows=4)
    with caplog.at_level(logging.WARNING, logger="train_deploy.pipelines.export.nodes"):
        _, figure = export_model(export_params(), foreign, tiny_tokenizer, tiny_token_files, tiny_run,
                                 tiny_training_logs)
    assert (f"No training curves in the bundle: the checkpoint {copy} is not from training run "
            f"{tiny_run.run_name}") in caplog.text
    assert any("No training curves" in text.get_text() for text in figure.texts)
    _, figure = export_model(export_params(), selected(tiny_checkpoint), tiny_tokenizer, tiny_token_files,
                             tiny_run, tiny_training_logs)
    loss_axis = figure.axes[0]
    assert [line.get_label() for line in loss_axis.get_lines()] == ["training loss", "validation loss"]
    assert list(loss_axis.get_lines()[0].get_xdata()) == list(range(1, tiny_run.step + 1))


@pytest.mark.slow
def test_bundle_holds_both_pictures_and_the_card_embeds_them(tiny_bundle, tiny_run):
    meta = json.loads((tiny_bundle / "bundle.json").read_text(encoding="utf-8"))
    assert meta["plots"] == {"latency": "plots/latency.png", "training": "plots/training.png"}
    assert meta["training_curves"]["rows"] == tiny_run.step and meta["training_curves"]["last_step"] == tiny_run.step
    assert _png_size(tiny_bundle / "plots" / "training.png") == (1000, 700)
    assert _png_size(tiny_bundle / "plots" / "latency.png")[1] == 400
    for name in meta["plots"].values():
        assert meta["files"][name]["bytes"] == (tiny_bundle / name).stat().st_size > 10_000
    card = (tiny_bundle / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert f"by step, steps 1-{tiny_run.step}](plots/training.png)" in card
    assert "![Latency by form and batch](plots/latency.png)" in card
    assert "No training curves" not in card


@pytest.mark.slow
def test_export_without_training_metrics_has_a_card_that_says_so_and_is_reused_unchanged(
        tmp_path, tiny_checkpoint, tiny_tokenizer, tiny_token_files, tiny_run):
    from train_deploy.pipelines.export.nodes import export_model

    empty_logs = WorkFolder(path=str(tmp_path / "training_logs"))  # a run whose logs were removed
    bundles = []
    for _ in range(2):
        work, _ = export_model(export_params(), selected(tiny_checkpoint), tiny_tokenizer, tiny_token_files,
                               tiny_run, empty_logs)
        bundles.append(publish(work, tmp_path / "bundle", Bundle, versions=True))
    built, kept = bundles
    assert not built.reused and kept.reused and kept.fingerprint == built.fingerprint
    folder = Path(built.path)
    metrics_file = tmp_path / "training_logs" / tiny_run.run_name / "metrics.jsonl"
    assert f"No training curves: no training metrics file at {metrics_file}." in built.card
    assert "plots/training.png" not in built.card and not (folder / "plots" / "training.png").exists()
    assert "![Latency by form and batch](plots/latency.png)" in built.card
    assert _png_size(Path(kept.path) / "plots" / "latency.png")[1] == 400
    assert Bundle.read_folder(Path(kept.path)).card == built.card
    # The same checkpoint with its run's metrics is another bundle: the training picture is in the fingerprint.
    curves = read_training_curves(Path(tiny_run.checkpoints).parent / "logs" / "metrics.jsonl", tiny_run.step)
    config = ExportConfig.from_params(export_params())
    assert bundle_fingerprint(tiny_checkpoint, tiny_tokenizer, config, curves) != built.fingerprint
