"""The averaging pipeline as Kedro runs it: a run's checkpoints in, a published average and a choice out."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from train_deploy.baselines import ngram_baselines
from train_deploy.corpus.readers import CorpusError
from train_deploy.datasets import ArtifactFolderDataset
from train_deploy.handoffs import CheckpointRef, SelectedCheckpoint
from train_deploy.pipelines.averaging import create_pipeline
from train_deploy.pipelines.averaging.nodes import UNVALIDATED_RUN_WINDOWS, average, evaluate
from train_deploy.training.checkpoint import CheckpointError
from train_deploy.training.evaluation import load_model, validation_loss, validation_windows

pytestmark = pytest.mark.slow


def test_averaging_pipeline_publishes_the_average_and_chooses_on_the_manifest_s_validation_split(
        tmp_path, tiny_run, tiny_token_files):
    inputs = {"params:averaging": {"k": 2, "choose": "better"}, "training_result": tiny_run,
              "token_files": tiny_token_files}
    catalog = DataCatalog({name: MemoryDataset(value) for name, value in inputs.items()})
    catalog["averaged_checkpoint"] = ArtifactFolderDataset(path=str(tmp_path / "averaged"),
                                                           description="train_deploy.handoffs.CheckpointRef")
    outputs = SequentialRunner().run(create_pipeline(), catalog)

    averaged = catalog["averaged_checkpoint"].load()
    assert isinstance(averaged, CheckpointRef) and Path(averaged.path) == tmp_path / "averaged"
    assert [Path(p).name for p in averaged.averaged_from] == ["step_00000003", "step_00000006"]
    assert averaged.step == 6 and averaged.method == "uniform"
    selected = outputs["selected_checkpoint"].load()
    assert isinstance(selected, SelectedCheckpoint) and selected.evaluated_on_windows == tiny_run.eval_windows
    metrics = outputs["averaging_metrics"].load()
    windows = validation_windows(tiny_token_files.prefix("valid"), tiny_token_files.dtype, tiny_run.seq_length,
                                 tiny_run.eval_windows)
    last = validation_loss(load_model(tiny_run.checkpoint), windows)
    assert metrics["last_val_loss"]["value"] == pytest.approx(last, rel=1e-6)
    assert metrics["last_val_loss"]["value"] == pytest.approx(tiny_run.val_loss, rel=1e-5)  # as training saw it
    better = min(("last", "averaged"), key=lambda name: metrics[f"{name}_val_loss"]["value"])
    assert selected.which == better and selected.checkpoint.path == (
        tiny_run.checkpoint if better == "last" else str(tmp_path / "averaged"))
    train = np.memmap(f"{tiny_token_files.prefix('train')}.bin", dtype=tiny_token_files.dtype, mode="r")
    baselines = ngram_baselines(train, windows, tiny_token_files.tokenizer.vocab_size)  # the same windows
    assert metrics["baseline_unigram_loss"]["value"] == pytest.approx(baselines.unigram_loss, rel=1e-12)
    assert metrics["baseline_bigram_loss"]["value"] == pytest.approx(baselines.bigram_loss, rel=1e-12)


def test_an_unchanged_average_is_kept_and_a_new_method_rebuilds_it(tmp_path, tiny_run, tiny_token_files):
    def run(params: dict) -> float:
        catalog = DataCatalog({"params:averaging": MemoryDataset(params), "training_result": MemoryDataset(tiny_run),
                               "token_files": MemoryDataset(tiny_token_files)})
        catalog["averaged_checkpoint"] = ArtifactFolderDataset(path=str(tmp_path / "averaged"),
                                                               description="train_deploy.handoffs.CheckpointRef")
        SequentialRunner().run(create_pipeline(), catalog)
        return (tmp_path / "averaged" / "model.safetensors").stat().st_mtime_ns

    first = run({"k": 2})
    assert run({"k": 2}) == first  # same sources, same method: the folder (and so the export) is kept
    assert run({"k": 2, "method": "ema"}) != first


def test_a_run_that_validated_nothing_is_compared_on_the_windows_its_small_split_holds(tiny_run, tiny_token_files):
    unvalidated = dataclasses.replace(tiny_run, val_loss=None, eval_windows=0)  # split < one evaluation batch
    selected, metrics, _ = evaluate({"k": 2}, CheckpointRef.read_folder(Path(tiny_run.checkpoint)), unvalidated,
                                    tiny_token_files)
    held = len(validation_windows(tiny_token_files.prefix("valid"), tiny_token_files.dtype, tiny_run.seq_length,
                                  UNVALIDATED_RUN_WINDOWS))
    assert selected.evaluated_on_windows == held > 0
    assert metrics["last_val_loss"]["value"] > 0 and "baseline_bigram_loss" in metrics


def test_a_validation_split_shorter_than_one_window_is_a_one_line_corpus_error(tmp_path, tiny_token_files):
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "valid.bin")
    with pytest.raises(CorpusError, match=r"valid.bin: 5 tokens cannot fill one sample of seq_length 32 \+ 1; "
                                          r"use more text or a shorter training.batch.seq_length$"):
        validation_windows(tmp_path / "valid", "uint16", 32, 8)


def test_evaluation_on_token_files_of_another_corpus_stops_naming_both_fingerprints(tiny_run, tiny_token_files):
    other = dataclasses.replace(tiny_token_files, fingerprint="f" * 32)
    with pytest.raises(CheckpointError, match=rf"^{tiny_run.checkpoint} was trained on corpus "
                                              rf"{tiny_token_files.fingerprint} but the token files are corpus "
                                              rf"{'f' * 32}; use the token files it was trained on$"):
        evaluate({"k": 2}, CheckpointRef.read_folder(Path(tiny_run.checkpoint)), tiny_run, other)


def test_a_damaged_checkpoint_stops_averaging_and_evaluation_naming_the_file(tmp_path, tiny_run, tiny_token_files):
    run = dataclasses.replace(tiny_run, checkpoints=str(tmp_path / "checkpoints"),
                              checkpoint=str(tmp_path / "checkpoints" / "step_00000006"))
    shutil.copytree(tiny_run.checkpoints, run.checkpoints)
    model = Path(run.checkpoint) / "model.safetensors"
    model.write_bytes(bytes(model.stat().st_size))
    with pytest.raises(CheckpointError, match=rf"^{model}: content changed since it was written"):
        evaluate({"k": 2}, CheckpointRef.read_folder(Path(tiny_run.checkpoint)), run, tiny_token_files)
    with open(model, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=rf"^{model}: 100 bytes, state.json records \d+"):
        average({"k": 2}, run)
