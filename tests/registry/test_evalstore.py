"""The evaluation set belongs to the registered model (its assets run), not to a training run that retention may
delete: a first version whose gate failed, a second champion, retention with no grace, and the third night still
gates on the same set. A set stored in a training run before moves to the assets run when read, and retention keeps
that training run until it has."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.helpers.project import NO_SERVING_CHECK
from tests.helpers.registry import ModelStore
from train_deploy.handoffs import Bundle
from train_deploy.registry import evalset
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalstore import (
    ASSETS_TAG,
    EVAL_SET_ARTIFACT,
    TAG_EVAL_SHA256,
    TAG_EVAL_TEXTS,
    TAG_EVAL_URI,
    eval_set_run_id,
    stored_eval_set,
)
from train_deploy.registry.gate import register_and_gate
from train_deploy.registry.lineage import eval_set_corpus
from train_deploy.retention import Layout, RetentionConfig, apply, make_plan

MODEL, EXPERIMENT = "evalstore_lm", "nightly"
TEXTS = ["今天天气很好。", "我们一起去公园散步。", "这本书很有意思。", "明天会下雨吗？"]
NO_GRACE = RetentionConfig.from_params({"mlflow": {"grace_days": 0}})


def _experiment(store: ModelStore) -> str:
    found = mlflow.get_experiment_by_name(EXPERIMENT)
    return found.experiment_id if found else mlflow.create_experiment(
        EXPERIMENT, artifact_location=str(store.root / "artifacts"))


def _night(store: ModelStore, bundle: Bundle, night: int, **registry):
    """The registry stage of a night: ``register_and_gate`` in a new run of the project's experiment."""
    config = RegistryConfig.from_params({"model_name": MODEL, **NO_SERVING_CHECK, "eval_set": {"min_texts": len(TEXTS)},
                                         **registry})  # the set's 4 texts decide: the same bundle is no improvement
    tags = {"training.run_name": f"run{night}", "bundle.fingerprint": bundle.fingerprint}
    with store.active(), mlflow.start_run(experiment_id=_experiment(store)):
        mlflow.log_params({"corpus.reader.source": "people_daily", "corpus.reader.paths": "[]",
                           "registry.eval_set.path": "None"})
        return register_and_gate(bundle, config, tags, lambda: list(TEXTS))


@pytest.mark.slow
def test_a_failed_first_version_then_retention_with_no_grace_leaves_the_third_night_its_set(tmp_path, tiny_bundle):
    store, bundle = ModelStore(tmp_path / "store"), Bundle.read_folder(tiny_bundle)
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    first = _night(store, bundle, 1, serving_check={"enabled": True, "timeout_seconds": 0.5})  # cannot serve in time
    assert (first.decision, first.champion) == ("rejected", False) and "serving check failed" in first.reason
    owner = eval_set_run_id(client.get_registered_model(MODEL).tags)
    assert owner != first.run_id and client.get_run(owner).data.tags[ASSETS_TAG] == MODEL
    assert client.get_run(owner).info.run_name == f"{MODEL}.assets" and client.get_run(owner).info.status == "FINISHED"
    second = _night(store, bundle, 2)
    assert (second.decision, second.champion) == ("first", True)

    plan = make_plan(Layout(project=tmp_path), NO_GRACE, MODEL, store.tracking_uri, EXPERIMENT)
    version1 = client.get_model_version(MODEL, "1")
    assert {(r.kind, r.target) for r in plan.removals} == {
        ("mlflow_run", first.run_id), ("mlflow_model", version1.source.removeprefix("models:/"))}
    assert [why for kind, target, why in plan.kept.spared if target == owner] == []  # never a candidate
    apply(plan, Layout(project=tmp_path), NO_GRACE, store.tracking_uri)
    with pytest.raises(MlflowException):
        client.get_run(first.run_id)

    third = _night(store, bundle, 3)
    assert (third.decision, third.eval_set_sha256, third.eval_texts) == ("rejected", first.eval_set_sha256, 4)
    with store.active():
        assert stored_eval_set(client, MODEL).texts == TEXTS


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_set_left_in_a_training_run_is_kept_by_retention_then_moved_to_the_models_assets_run(tmp_path):
    store = ModelStore(tmp_path / "store")
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    data = evalset.to_jsonl(TEXTS)
    with store.active(), mlflow.start_run(experiment_id=_experiment(store)) as run:  # as the gate stored it before
        mlflow.log_params({"corpus.reader.source": "people_daily", "corpus.reader.paths": "[]",
                           "registry.eval_set.path": "None"})
        (tmp_path / "eval_set.jsonl").write_bytes(data)
        mlflow.log_artifact(str(tmp_path / "eval_set.jsonl"), str(Path(EVAL_SET_ARTIFACT).parent))
        mlflow.end_run("FAILED")  # the night failed after storing it
    held_by = run.info.run_id
    client.create_registered_model(MODEL, tags={TAG_EVAL_URI: f"runs:/{held_by}/{EVAL_SET_ARTIFACT}",
                                                TAG_EVAL_TEXTS: "4", TAG_EVAL_SHA256: evalset.sha256(data)})

    waiting = make_plan(Layout(project=tmp_path), NO_GRACE, MODEL, store.tracking_uri, EXPERIMENT)
    assert waiting.removals == []
    assert waiting.lines(tmp_path)[0] == (f"mlflow_run          kept  {held_by}: needed by registered model "
                                          f"{MODEL}'s eval_set.uri")

    with store.active():  # the set is downloaded from the process's tracking URI, as in a run
        stored = stored_eval_set(client, MODEL)  # moved: copied, the hash checked, the tags pointed at the copy
    tags = client.get_registered_model(MODEL).tags
    owner = eval_set_run_id(tags)
    assert (stored.texts, stored.sha256, tags[TAG_EVAL_SHA256], tags[TAG_EVAL_TEXTS]) == (
        TEXTS, evalset.sha256(data), evalset.sha256(data), "4")
    assert owner != held_by and client.get_run(owner).data.tags[ASSETS_TAG] == MODEL
    assert eval_set_corpus(client, MODEL) == ("people_daily", [])  # the corpus check reads the copied parameters
    copied = Path(client.download_artifacts(owner, EVAL_SET_ARTIFACT, str(tmp_path)))
    assert [json.loads(line)["text"] for line in copied.read_text(encoding="utf-8").splitlines()] == TEXTS

    plan = make_plan(Layout(project=tmp_path), NO_GRACE, MODEL, store.tracking_uri, EXPERIMENT)
    assert [(r.kind, r.target) for r in plan.removals] == [("mlflow_run", held_by)]
    apply(plan, Layout(project=tmp_path), NO_GRACE, store.tracking_uri)
    with store.active():
        assert stored_eval_set(client, MODEL).texts == TEXTS
    assert eval_set_run_id(client.get_registered_model(MODEL).tags) == owner  # read again: nothing moves twice


def test_a_set_that_cannot_move_is_still_read_and_the_refusal_logged(tmp_path, caplog):
    store = ModelStore(tmp_path / "store")
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    data = evalset.to_jsonl(TEXTS)
    with store.active(), mlflow.start_run(experiment_id=_experiment(store)) as run:
        (tmp_path / "eval_set.jsonl").write_bytes(data)
        mlflow.log_artifact(str(tmp_path / "eval_set.jsonl"), str(Path(EVAL_SET_ARTIFACT).parent))
    uri = f"runs:/{run.info.run_id}/{EVAL_SET_ARTIFACT}"
    client.create_registered_model(MODEL, tags={TAG_EVAL_URI: uri, TAG_EVAL_SHA256: evalset.sha256(data)})
    client.delete_experiment(run.info.experiment_id)  # no run can be made there: the move is refused

    with store.active(), caplog.at_level("WARNING"):
        assert stored_eval_set(client, MODEL).texts == TEXTS
    assert client.get_registered_model(MODEL).tags[TAG_EVAL_URI] == uri
    assert f"Registered model {MODEL}: the evaluation set stays in run {run.info.run_id} for now" in caplog.text
