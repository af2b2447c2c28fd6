"""The model card and the end-of-run summary say what the training curves said, and advise by it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from train_deploy.baselines import MEASURED
from train_deploy.export.card import model_card
from train_deploy.handoffs import (
    Bundle,
    BundleMeta,
    CheckpointState,
    CurveDiagnosis,
    LatencyReport,
    ParityReport,
    from_json,
)
from train_deploy.hooks.display import ShowResults

pytestmark = pytest.mark.slow  # the session's tiny bundle is an export

OVERFIT = CurveDiagnosis(kind="overfitting", best_step=20, best_val_loss=7.7459, last_val_loss=8.114,
                         summary="overfitting: validation loss was lowest at step 20 (7.7459) and rose to 8.1140 by "
                                 "step 60 while training loss fell from 5.5339 to 2.1883",
                         advice="fewer steps (training.schedule.max_steps near 20), more text, or stronger "
                                "regularisation (training.optimizer.weight_decay; this model has no dropout)")


def diagnosed_bundle(tiny_bundle: Path, folder: Path, diagnosis: CurveDiagnosis | None) -> Path:
    """A copy of the session's bundle whose ``bundle.json`` records ``diagnosis`` as the export node writes it."""
    shutil.copytree(tiny_bundle, folder)
    meta = json.loads((folder / "bundle.json").read_text(encoding="utf-8"))
    meta["source"]["diagnosis"] = None if diagnosis is None else dataclasses.asdict(diagnosis)
    (folder / "bundle.json").write_text(json.dumps(meta), encoding="utf-8")
    return folder


def card_of(folder: Path, tiny_checkpoint: Path) -> str:
    state = json.loads((tiny_checkpoint / "state.json").read_text(encoding="utf-8"))
    return model_card(BundleMeta.read(folder), from_json(CheckpointState, state, "state.json"),
                      ParityReport.read(folder), LatencyReport.read(folder))


def test_the_card_says_what_the_curves_said_and_its_warning_advises_by_them(tiny_bundle, tiny_checkpoint, tmp_path):
    card = card_of(diagnosed_bundle(tiny_bundle, tmp_path / "bundle", OVERFIT), tiny_checkpoint)
    head = card.split("## Model", 1)[0]  # the tiny model loses to the baselines: the warning at the top advises
    assert "The training curves show the run overfitting: what could do better is fewer steps " \
           "(training.schedule.max_steps near 20), more text, or stronger regularisation " \
           "(training.optimizer.weight_decay; this model has no dropout); until then do not rely" in head
    assert "a longer run on more text or a GPU" not in card
    assert f"- Training curves: {OVERFIT.summary}. What could do better: {OVERFIT.advice}.\n" in card


def test_a_bundle_without_a_diagnosis_keeps_the_general_advice(tiny_bundle, tiny_checkpoint, tmp_path):
    unknown = CurveDiagnosis(kind="unknown", summary="1 evaluation(s) of validation loss: too few to read a trend "
                                                     "(two or more are needed)")
    for name, diagnosis in (("none", None), ("unknown", unknown)):
        card = card_of(diagnosed_bundle(tiny_bundle, tmp_path / name, diagnosis), tiny_checkpoint)
        assert "More steps (`training.schedule.max_steps`), a longer run on more text or a GPU do better; until " \
               "then do not rely" in card
    assert "- Training curves: 1 evaluation(s) of validation loss: too few to read a trend (two or more are " \
           "needed).\n" in card


class _Pipeline:
    def all_outputs(self) -> set[str]:
        return {"export_bundle"}


def test_the_end_of_run_summary_gives_the_diagnosis_and_its_advice(tiny_bundle, tiny_token_files, tmp_path,
                                                                   capsys):
    folder = diagnosed_bundle(tiny_bundle, tmp_path / "bundle", OVERFIT)
    catalog = {"export_bundle": Bundle.read_folder(folder), "token_files": tiny_token_files}
    ShowResults().after_pipeline_run({}, _Pipeline(), type("Catalog", (), {"load": lambda self, name: catalog[name]})())
    lines = capsys.readouterr().out.splitlines()
    assert f"  training curves: {OVERFIT.summary}; what could do better: {OVERFIT.advice}" in lines
    validation = next(line for line in lines if line.startswith("  validation: "))
    assert validation.endswith("; the training curves show the run overfitting, so what could beat it is fewer "
                               "steps (training.schedule.max_steps near 20), more text, or stronger regularisation "
                               "(training.optimizer.weight_decay; this model has no dropout) " + MEASURED)
