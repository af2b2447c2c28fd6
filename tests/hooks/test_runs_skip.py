"""The skip-unchanged step of a run's life (``train_deploy.hooks.runs.skip_if_unchanged``) with the change check and
MLflow's fluent run calls stood in: which pipelines it checks, what it tags the run with, and when it stops the
session. These run once per mutant of ``make mutation``; tests/test_retrain.py runs it end to end through ``kedro
run`` and a real store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from train_deploy.hooks import runs
from train_deploy.hooks.runs import run_status, skip_if_unchanged
from train_deploy.run_control.retrain import (
    CORPUS_TAG,
    OUTCOME_TAG,
    REASON_TAG,
    TRAINING_TAG,
    NothingToRetrain,
    RetrainCheck,
)

FINGERPRINTS = {CORPUS_TAG: "c1", TRAINING_TAG: "t1"}
PARAMS = {"registry": {"model_name": "lm"}}


class _Catalog:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load(self, name: str):
        self.loaded.append(name)
        return PARAMS


def _pipeline(*names: str):
    return SimpleNamespace(nodes=[SimpleNamespace(name=name) for name in names])


@pytest.fixture
def mlflow_run(monkeypatch):
    """The tags set on the active MLflow run (``active`` False: no run), and the params each check was given."""
    state = SimpleNamespace(active=True, tags={}, calls=[], checked=[], result=None)

    def set_tags(tags: dict) -> None:
        state.calls.append("set_tags")
        state.tags.update(tags)

    def set_tag(key: str, value: str) -> None:
        state.calls.append("set_tag")
        state.tags[key] = value

    def check(params):
        state.checked.append(params)
        return state.result

    fluent = SimpleNamespace(active_run=lambda: SimpleNamespace() if state.active else None, set_tags=set_tags,
                             set_tag=set_tag)
    monkeypatch.setattr(runs, "mlflow", fluent)
    monkeypatch.setattr(runs, "check_for_changes", check)
    return state


def test_a_changed_run_is_tagged_with_its_fingerprints_and_reason_and_goes_on(mlflow_run, caplog):
    mlflow_run.result = RetrainCheck(True, "lm has no champion yet", FINGERPRINTS)
    catalog = _Catalog()
    caplog.set_level("INFO", logger="train_deploy.hooks.runs")
    assert skip_if_unchanged(_pipeline("train_model", "register_bundle", "x"), catalog) is None
    assert mlflow_run.tags == {**FINGERPRINTS, REASON_TAG: "lm has no champion yet"}
    assert mlflow_run.calls == ["set_tags"] and mlflow_run.checked == [PARAMS] and catalog.loaded == ["parameters"]
    assert [r.getMessage() for r in caplog.records] == ["Retraining: lm has no champion yet"]


def test_an_unchanged_run_is_tagged_skipped_and_stops_the_session_saying_why(mlflow_run):
    mlflow_run.result = RetrainCheck(False, "nothing to retrain: same", FINGERPRINTS)
    with pytest.raises(NothingToRetrain, match="^nothing to retrain: same$"):
        skip_if_unchanged(_pipeline("train_model", "register_bundle"), _Catalog())
    assert mlflow_run.tags == {**FINGERPRINTS, REASON_TAG: "nothing to retrain: same", OUTCOME_TAG: "skipped"}


def test_without_an_mlflow_run_nothing_is_tagged(mlflow_run):
    mlflow_run.active = False
    mlflow_run.result = RetrainCheck(False, "nothing to retrain: same", FINGERPRINTS)
    with pytest.raises(NothingToRetrain):
        skip_if_unchanged(_pipeline("train_model", "register_bundle"), _Catalog())
    mlflow_run.result = RetrainCheck(True, "changed", FINGERPRINTS)
    skip_if_unchanged(_pipeline("train_model", "register_bundle"), _Catalog())
    assert mlflow_run.calls == [] and mlflow_run.tags == {}


def test_the_blocks_built_once_are_checked_without_reading_the_catalog(mlflow_run):
    mlflow_run.result = RetrainCheck(True, "changed", FINGERPRINTS)
    catalog, configs = _Catalog(), {"registry": object()}
    skip_if_unchanged(_pipeline("train_model", "register_bundle"), catalog, configs)
    assert mlflow_run.checked == [configs] and mlflow_run.checked[0] is configs and catalog.loaded == []


@pytest.mark.parametrize("names", [(), ("train_model",), ("register_bundle", "evaluate")])
def test_a_pipeline_that_does_not_train_and_register_is_not_checked(mlflow_run, names):
    catalog = _Catalog()
    assert skip_if_unchanged(_pipeline(*names), catalog) is None
    assert mlflow_run.checked == [] and catalog.loaded == [] and mlflow_run.tags == {}


def test_a_run_is_recorded_finished_failed_or_killed_by_how_it_ended():
    assert run_status(None) == "FINISHED"
    assert run_status(NothingToRetrain("same")) == "FINISHED"
    assert run_status(ValueError("x")) == "FAILED"
    assert run_status(KeyboardInterrupt()) == "KILLED"
    assert run_status(SystemExit(143)) == "KILLED"
    assert run_status(runs.RunAbandoned()) == "KILLED"
