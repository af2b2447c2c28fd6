"""The training curves' diagnosis: the rule on crafted curves with exact outcomes, then each case on a tiny real run
made to show it, through the training node, and the averaging it leads to."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.helpers.corpus import encode
from tests.helpers.project import publish
from tests.helpers.training import training_params
from train_deploy.averaging.average import select_checkpoints
from train_deploy.averaging.config import AveragingConfig
from train_deploy.baselines import MEASURED, Baselines
from train_deploy.handoffs import CheckpointRef, CurveDiagnosis, WorkFolder
from train_deploy.pipelines.averaging.nodes import average, evaluate
from train_deploy.pipelines.training.nodes import configure_training, train_model
from train_deploy.training.checkpoint import checkpoint_state
from train_deploy.training.diagnosis import Curves, beat_advice, diagnose, read_curves


def curves(valid: dict[int, float], train: dict[int, float]) -> Curves:
    return Curves(train=sorted(train.items()), valid=sorted(valid.items()))


def falling(first: int, last: int, start: float, per_step: float) -> dict[int, float]:
    """Training losses logged every step from ``first`` to ``last``, falling by ``per_step``."""
    return {s: start - per_step * (s - first) for s in range(first, last + 1)}


# --- the rule on crafted curves --------------------------------------------------------------------------


def test_validation_rising_while_training_falls_is_overfitting_at_the_lowest_step():
    found = diagnose(curves({10: 5.0, 20: 4.5, 30: 4.6, 40: 4.9}, falling(1, 40, 6.0, 0.1)))
    # T_b: mean of steps 11-20 (4.55); T_n: mean of steps 31-40 (2.55)
    assert found == CurveDiagnosis(
        kind="overfitting", best_step=20, best_val_loss=4.5, last_val_loss=4.9,
        summary="overfitting: validation loss was lowest at step 20 (4.5000) and rose to 4.9000 by step 40 while "
                "training loss fell from 4.5500 to 2.5500",
        advice="fewer steps (training.schedule.max_steps near 20), more text, or stronger regularisation "
               "(training.optimizer.weight_decay; this model has no dropout)")


def test_both_still_falling_at_the_end_is_underfitting():
    found = diagnose(curves({10: 6.0, 20: 5.5, 30: 5.45}, falling(1, 30, 7.0, 0.05)))
    assert found == CurveDiagnosis(
        kind="underfitting", best_step=30, best_val_loss=5.45, last_val_loss=5.45,
        summary="underfitting: validation loss fell from 5.5000 at step 20 to 5.4500 at step 30 and training loss "
                "from 6.2750 to 5.7750: both still falling at the end",
        advice="more steps (training.schedule.max_steps) or a larger preset (training.model.preset; 350m and 1.3b "
               "on a GPU, conf/gpu)")


def test_a_flat_end_within_the_tolerance_is_converged():
    found = diagnose(curves({10: 6.0, 20: 5.0, 30: 4.99, 40: 5.005}, falling(1, 40, 7.0, 0.01)))
    assert found == CurveDiagnosis(
        kind="converged", best_step=30, best_val_loss=4.99, last_val_loss=5.005,
        summary="converged: validation loss 5.0050 at step 40, within 0.02 of 4.9900 at step 30 and of its lowest "
                "(4.9900, step 30)",
        advice="more text or a larger preset (training.model.preset), not more steps")


@pytest.mark.parametrize(("last", "kind"), [(4.519, "converged"), (4.521, "overfitting")])
def test_validation_must_rise_by_more_than_the_tolerance_to_count(last, kind):
    assert diagnose(curves({10: 5.0, 20: 4.5, 30: last}, falling(1, 30, 6.0, 0.1))).kind == kind


@pytest.mark.parametrize(("last", "kind"), [(4.981, "converged"), (4.979, "underfitting")])
def test_validation_must_fall_by_more_than_the_tolerance_to_count(last, kind):
    assert diagnose(curves({10: 6.0, 20: 5.0, 30: last}, falling(1, 30, 7.0, 0.1))).kind == kind


def test_one_noisy_training_batch_does_not_decide_the_training_trend():
    train = falling(1, 40, 6.0, 0.1) | {40: 9.0}  # a bad batch at the last step: its interval's mean is 3.35
    assert diagnose(curves({10: 5.0, 20: 4.5, 30: 4.6, 40: 4.9}, train)).kind == "overfitting"


def test_training_losses_logged_less_often_than_evaluations_use_the_last_one_logged():
    train = {5: 6.0, 15: 5.0, 35: 3.0}  # nothing logged in (20, 30] nor (40, 50]: the last one before counts
    found = diagnose(curves({10: 5.0, 20: 4.5, 30: 4.6, 40: 4.9, 50: 5.0}, train))
    assert found.kind == "overfitting" and found.summary.endswith("training loss fell from 5.0000 to 3.0000")


def test_too_few_evaluations_or_curves_that_fit_no_case_are_unknown():
    assert diagnose(curves({}, {1: 7.0})) == CurveDiagnosis(
        kind="unknown", summary="0 evaluation(s) of validation loss: too few to read a trend (two or more are needed)")
    assert diagnose(curves({10: 5.0}, falling(1, 10, 7.0, 0.1))).kind == "unknown"
    rising = diagnose(curves({10: 5.0, 20: 5.5}, {10: 6.0, 20: 6.5}))
    assert rising.kind == "unknown" and rising.advice == "" and rising.summary == (
        "validation loss was lowest at step 10 (5.0000) and rose to 5.5000 by step 20, and training loss did not "
        "fall (6.0000 to 6.5000): an unstable run, not overfitting")
    assert diagnose(curves({10: 5.5, 20: 5.0}, {10: 6.0, 20: 6.5})).kind == "unknown"


def test_the_curves_are_read_up_to_the_step_with_a_resumed_runs_later_lines(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 7.0}, {"step": 2, "loss": 6.5, "val_loss": 6.9}, {"step": 3, "loss": 6.0},
             {"step": 4, "loss": 5.9, "val_loss": 6.4}, {"step": 3, "loss": 6.1}, {"step": 4, "loss": 5.8},
             {"step": 6, "loss": 1.0, "val_loss": 1.0}]
    metrics.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n{\"step\": 5, \"loss\": 5\n")
    assert read_curves(metrics, up_to_step=5) == Curves(train=[(1, 7.0), (2, 6.5), (3, 6.1), (4, 5.8)],
                                                        valid=[(2, 6.9)])
    assert read_curves(tmp_path / "none.jsonl", 5) == Curves(train=[], valid=[])


def test_the_baseline_advice_follows_the_curves():
    baselines = Baselines(windows=8, seq_length=32, unigram_loss=7.0, unigram_k=0.1, bigram_loss=6.0, bigram_k=0.03,
                          train_tokens=1000)
    overfit = diagnose(curves({10: 5.0, 20: 4.5, 30: 4.6, 40: 4.9}, falling(1, 40, 6.0, 0.1)))
    assert baselines.describe(6.5, beat_advice(overfit)).endswith(
        "the model predicts worse than counting token pairs; the training curves show the run overfitting, so what "
        "could beat it is fewer steps (training.schedule.max_steps near 20), more text, or stronger regularisation "
        "(training.optimizer.weight_decay; this model has no dropout) " + MEASURED)
    unknown = diagnose(curves({10: 5.0}, {}))
    assert beat_advice(unknown) is None and beat_advice(None) is None
    assert baselines.describe(6.5, beat_advice(unknown)).endswith(
        "a larger model trained longer (more steps, a GPU) is what could beat it " + MEASURED)


# --- tiny real runs made to show each case -----------------------------------------------------------------


def train(tmp_path, token_files, caplog, **blocks):
    """The training node's run of the tiny preset with ``blocks`` over :data:`TINY_TRAINING`, and its log lines."""
    params = training_params(1, **blocks)
    with caplog.at_level(logging.INFO, logger="train_deploy.pipelines.training.nodes"):
        result = train_model(configure_training(params, token_files), token_files,
                             WorkFolder(path=str(tmp_path / "checkpoints")), WorkFolder(path=str(tmp_path / "logs")))
    lines = [r.getMessage() for r in caplog.records if r.name == "train_deploy.pipelines.training.nodes"]
    return result, lines


@pytest.mark.slow
def test_a_run_on_a_dozen_documents_for_many_steps_overfits_and_averages_around_its_lowest_point(
        tmp_path, tiny_tokenizer, caplog):
    # 12 training documents (1,337 tokens): 60 steps of 256 tokens see each more than 11 times
    _, token_files = encode(tmp_path, tiny_tokenizer, reader={"max_bytes": 12_000},
                            encoding={"validation_fraction": 0.25})
    assert (token_files.splits["train"].documents, token_files.splits["valid"].documents) == (12, 8)
    result, lines = train(tmp_path, token_files, caplog,
                          schedule={"max_steps": 60, "eval_every": 10, "checkpoint_every": 10, "keep_last": 10},
                          optimizer={"learning_rate": 1e-2})
    diagnosis = result.diagnosis
    assert diagnosis.kind == "overfitting" and diagnosis.best_step == 20
    assert diagnosis.last_val_loss == result.val_loss and diagnosis.last_val_loss > diagnosis.best_val_loss + 0.02
    assert f"Training curves: {diagnosis.summary}; what could do better: {diagnosis.advice}" in lines
    assert diagnosis.summary.startswith("overfitting: validation loss was lowest at step 20 (")
    assert "the training curves show the run overfitting, so what could beat it is fewer steps " \
           "(training.schedule.max_steps near 20)" in lines[-1]
    newest = select_checkpoints(result.checkpoints, AveragingConfig(k=3))
    assert [checkpoint_state(p).step for p in newest.paths] == [40, 50, 60]  # without the diagnosis
    # the averaging stage's nodes: the average of the checkpoints around step 20, logged and recorded
    with caplog.at_level(logging.INFO, logger="train_deploy.pipelines.averaging.nodes"):
        averaged = publish(average({"k": 3}, result), tmp_path / "averaged", CheckpointRef)
        selected, _, _ = evaluate({"k": 3}, averaged, result, token_files)
    assert [Path(p).name for p in averaged.averaged_from] == ["step_00000010", "step_00000020", "step_00000030"]
    why = (f"steps 10, 20, 30: the 3 around step 20, where validation loss was lowest ({diagnosis.best_val_loss:.4f}; "
           f"{diagnosis.last_val_loss:.4f} at the end), not the 3 newest: the training curves show overfitting "
           "(averaging.select: last_k)")
    assert f"Averaging the checkpoints of {why}" in caplog.messages
    assert selected.which == "averaged" and selected.reason.endswith(f"; the average is of {why}")


@pytest.mark.slow
def test_a_two_step_run_still_falling_is_underfitting(tmp_path, tiny_token_files, caplog):
    result, lines = train(tmp_path, tiny_token_files, caplog, schedule={"max_steps": 2, "eval_every": 1},
                          optimizer={"learning_rate": 1e-2, "warmup_steps": 0})
    diagnosis = result.diagnosis
    assert diagnosis.kind == "underfitting" and diagnosis.best_step == 2 and diagnosis.best_val_loss > 7
    assert diagnosis.summary.startswith("underfitting: validation loss fell from ")
    assert diagnosis.summary.endswith(": both still falling at the end")
    assert f"Training curves: {diagnosis.summary}; what could do better: {diagnosis.advice}" in lines


@pytest.mark.slow
def test_a_run_whose_learning_rate_has_decayed_to_zero_is_converged(tmp_path, tiny_token_files, caplog):
    # evaluations at steps 14, 28 and 30; the cosine schedule reaches 0 at step 30, so the loss stops moving
    result, lines = train(tmp_path, tiny_token_files, caplog,
                          schedule={"max_steps": 30, "eval_every": 14, "log_every": 4},
                          optimizer={"learning_rate": 1e-2, "min_lr_ratio": 0})
    # every evaluation is written, on logging steps (every 4) or not
    metrics = next((tmp_path / "logs").rglob("metrics.jsonl"))
    assert [step for step, _ in read_curves(metrics, up_to_step=30).valid] == [14, 28, 30]
    diagnosis = result.diagnosis
    assert diagnosis.kind == "converged" and diagnosis.best_step == 30
    assert diagnosis.summary.startswith("converged: validation loss ")
    assert f"Training curves: {diagnosis.summary}; what could do better: {diagnosis.advice}" in lines
    assert select_checkpoints(result.checkpoints, AveragingConfig(k=2), diagnosis).reason == \
        "steps 27, 30: the 2 newest (averaging.select: last_k)"
