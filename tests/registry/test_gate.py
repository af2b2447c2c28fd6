"""The promotion gate on real bundles of the tiny model in a real MLflow store (SQLite, or a server for outages)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from tests.helpers.project import NO_SERVING_CHECK
from tests.helpers.registry import GateProcess, ModelStore
from tests.mlflow_server import mlflow_server  # noqa: F401  (the fixture)
from train_deploy.handoffs import Bundle, TrainingResult
from train_deploy.registry.aliases import AliasLock, rollback
from train_deploy.registry.config import RegistryConfig, RetryConfig
from train_deploy.registry.evalset import EvalSetError, cut, jsonl_texts, validation_texts
from train_deploy.registry.evalstore import ASSETS_TAG, EVAL_SET_ARTIFACT, TAG_EVAL_SHA256, eval_set_run_id
from train_deploy.registry.gate import (
    SERVING_TAG,
    GateError,
    RegistryDecision,
    decide,
    register_and_gate,
    register_version,
    version_tags,
)
from train_deploy.registry.history import read_history
from train_deploy.registry.retry import RegistryUnreachable, Retrying
from train_deploy.retrain import CORPUS_TAG, TRAINING_TAG, trained_alike

MODEL = "gate_test_lm"
# A small, quick evaluation set that fits the tiny model's context of 128 tokens.
EVAL_SET = {"documents": 12, "max_chars": 60}
# Six steps of the tiny model move nats per character by about half a percent a few steps (6.276 after 1 step,
# 6.244 after 3, 6.208 after 6): the gate is asked for 0.3%.
MIN_IMPROVEMENT = 0.003


@pytest.fixture
def store(tmp_path) -> ModelStore:
    return ModelStore(tmp_path / "store")


@contextlib.contextmanager
def a_run(uri: str, artifacts: Path | None) -> Iterator[str]:
    """A new MLflow run in ``uri`` (the process's tracking and registry URI meanwhile); yields its id."""
    saved = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        experiment = mlflow.get_experiment_by_name("gate-tests")
        experiment_id = experiment.experiment_id if experiment else mlflow.create_experiment(
            "gate-tests", artifact_location=None if artifacts is None else str(artifacts))
        with mlflow.start_run(experiment_id=experiment_id) as run:
            yield run.info.run_id
    finally:
        mlflow.set_tracking_uri(saved[0])
        mlflow.set_registry_uri(saved[1])


def gate(uri: str, bundle: Bundle, result: TrainingResult, texts: partial, artifacts: Path | None = None,
         extra_tags: dict[str, str] | None = None, **registry) -> RegistryDecision:
    """``register_and_gate`` of ``bundle`` in a new run of the store at ``uri``."""
    config = RegistryConfig.from_params(registry_params(**registry))
    with a_run(uri, artifacts):
        return register_and_gate(bundle, config, tags(bundle, result, texts) | (extra_tags or {}), texts)


def registry_params(**registry) -> dict:
    """The ``registry`` block of these tests (no serving check unless asked), with ``registry`` over it."""
    return {"model_name": MODEL, "eval_set": EVAL_SET, "min_improvement": MIN_IMPROVEMENT, **NO_SERVING_CHECK,
            **registry}


def tags(bundle: Bundle, result: TrainingResult, texts: partial) -> dict[str, str]:
    return version_tags(bundle, texts.args[0], result, "0123abc")


@pytest.fixture(scope="module")
def texts(tiny_token_files, tiny_tokenizer) -> partial:
    return partial(validation_texts, tiny_token_files, tiny_tokenizer, EVAL_SET["documents"], EVAL_SET["max_chars"])


def aliases(uri: str) -> dict[str, str]:
    model = MlflowClient(uri, uri).get_registered_model(MODEL)
    return {alias: str(version) for alias, version in model.aliases.items()}


@pytest.mark.slow
def test_promotion_sequence_first_worse_better_forced(store, step_bundles, tiny_run, texts):
    uri, client = store.tracking_uri, MlflowClient(store.tracking_uri, store.tracking_uri)
    run = partial(gate, uri, result=tiny_run, texts=texts, artifacts=store.root / "artifacts")

    first = run(step_bundles[3], serving_check={"enabled": True})  # started as production starts it
    assert (first.decision, first.version, first.champion) == ("first", "1", True)
    assert aliases(uri) == {"champion": "1"}
    check = client.get_model_version(MODEL, "1").tags[SERVING_TAG]
    assert check.startswith("passed: served models:/gate_test_lm/1 from a fresh process") and "generate in" in check

    worse = run(step_bundles[1])
    assert (worse.decision, worse.version, worse.champion) == ("rejected", "2", False)
    assert worse.candidate_value > worse.champion_value == pytest.approx(first.candidate_value)
    assert aliases(uri) == {"champion": "1"}
    tags = client.get_model_version(MODEL, "2").tags
    assert tags["gate.decision"] == "rejected" and tags["gate.metric"] == "nats_per_char"
    assert f"{worse.candidate_value:.4f}" in tags["gate.reason"] and f"{first.candidate_value:.4f}" in tags[
        "gate.reason"]
    assert "registry.min_improvement" in tags["gate.reason"]
    assert float(tags["gate.candidate"]) == pytest.approx(worse.candidate_value, abs=1e-6)

    better = run(step_bundles[6])
    assert (better.decision, better.champion, better.previous_champion) == ("promoted", True, "1"), better.reason
    assert aliases(uri) == {"champion": "3", "previous": "1"}

    forced = run(step_bundles[1], force=True)
    assert forced.decision == "forced" and "registry.force" in forced.reason
    assert forced.candidate_value > forced.champion_value  # worse, promoted anyway
    assert aliases(uri) == {"champion": "4", "previous": "3"}

    # One evaluation set for every decision: stored by the first run, its hash on the registered model.
    model = client.get_registered_model(MODEL)
    assert {first.eval_set_sha256, worse.eval_set_sha256, better.eval_set_sha256} == {model.tags[TAG_EVAL_SHA256]}
    owner = eval_set_run_id(model.tags)  # the model's assets run, not the first run (retention may delete that)
    assert owner != first.run_id and client.get_run(owner).data.tags[ASSETS_TAG] == MODEL
    assert model.tags["eval_set.uri"] == f"runs:/{owner}/{EVAL_SET_ARTIFACT}"
    stored = Path(client.download_artifacts(owner, EVAL_SET_ARTIFACT, str(store.root)))
    assert [json.loads(line)["text"] for line in stored.read_text(encoding="utf-8").splitlines()] == texts()
    assert model.tags["eval_set.texts"] == str(len(texts())) == str(first.eval_texts)
    assert [event["decision"] for event in read_history(client, MODEL)] == ["first", "rejected", "promoted", "forced"]

    # Where the version comes from.
    version = client.get_model_version(MODEL, "3")
    assert version.run_id == better.run_id and version.tags["source.run_id"] == better.run_id
    assert version.tags["corpus.fingerprint"] == texts.args[0].fingerprint
    assert version.tags["tokenizer.hash"] == step_bundles[6].meta.tokenizer["hash"]
    assert version.tags["git.commit"] == "0123abc"
    assert json.loads(version.tags["training.layout"]) == tiny_run.layout
    assert float(version.tags["parity.max_abs_logit_diff.paddle_inference"]) <= 1e-4


def test_decide_needs_the_relative_improvement():
    config = RegistryConfig.from_params({"min_improvement": 0.05})
    assert decide(1.90, "3", 2.0, config)[0] == "promoted"  # 5% fewer nats per character
    assert decide(1.91, "3", 2.0, config)[0] == "rejected"  # 4.5%
    assert decide(2.0, "3", 2.0, RegistryConfig.from_params({"min_improvement": 0.0}))[0] == "rejected"  # equal
    decision, reason = decide(2.2, "3", 2.0, config)
    assert decision == "rejected" and "10.00% above champion version 3's 2.0000" in reason
    assert decide(5.0, None, None, config)[0] == "first"
    assert decide(5.0, "3", 2.0, RegistryConfig.from_params({"force": True}))[0] == "forced"


@pytest.mark.slow
def test_a_changed_evaluation_set_is_refused_in_one_line_and_nothing_moves(store, step_bundles, tiny_run, texts):
    uri = store.tracking_uri
    first = gate(uri, step_bundles[3], tiny_run, texts, store.root / "artifacts")
    client = MlflowClient(uri, uri)
    owner = eval_set_run_id(client.get_registered_model(MODEL).tags)
    stored = Path(client.get_run(owner).info.artifact_uri) / EVAL_SET_ARTIFACT
    stored.write_text(stored.read_text(encoding="utf-8").replace("。", "，", 1), encoding="utf-8")

    with pytest.raises(EvalSetError) as error:
        gate(uri, step_bundles[6], tiny_run, texts, store.root / "artifacts")
    message = str(error.value)
    assert "\n" not in message and f"runs:/{owner}/{EVAL_SET_ARTIFACT}" in message
    assert f"the model records {first.eval_set_sha256}" in message
    assert aliases(uri) == {"champion": "1"}
    assert [str(v.version) for v in client.search_model_versions(f"name='{MODEL}'")] == ["1"]  # refused before logging


@pytest.mark.slow
def test_an_unreachable_server_is_retried_then_named_and_aliases_stay(mlflow_server, step_bundles,  # noqa: F811
                                                                       tiny_run, texts):
    uri = mlflow_server.uri
    gate(uri, step_bundles[3], tiny_run, texts)
    client = MlflowClient(uri, uri)
    assert client.get_model_version(MODEL, "1").run_id  # the model and its artifacts went through the server

    config = RegistryConfig.from_params({"model_name": MODEL, "eval_set": EVAL_SET,
                                         "retries": {"attempts": 3, "wait_seconds": 0.5}})
    with a_run(uri, None):
        mlflow_server.stop()
        started = time.monotonic()
        try:
            with pytest.raises(RegistryUnreachable) as error:
                register_and_gate(step_bundles[6], config, tags(step_bundles[6], tiny_run, texts), texts)
            elapsed = time.monotonic() - started
        finally:
            mlflow_server.start()
    message = str(error.value)
    assert "\n" not in message and f"MLflow tracking server {uri} did not answer" in message
    assert "after 3 tries 0.5 s apart; no alias was changed" in message
    assert elapsed < 30  # MLflow's own retries (minutes) are off: three tries, two waits
    assert aliases(uri) == {"champion": "1"}
    assert [str(v.version) for v in client.search_model_versions(f"name='{MODEL}'")] == ["1"]


def test_a_configured_jsonl_set_is_cut_at_sentence_ends_and_bad_lines_are_named(tmp_path):
    assert cut("  今天天气很好。明天也好。后天呢  ", 10) == "今天天气很好。"  # the last sentence end within 10
    assert cut("一二三。四五六七八九十十一", 10) == "一二三。四五六七八九"  # none in the second half: at the limit
    path = tmp_path / "eval.jsonl"
    lines = ['{"text": "今天天气很好。明天也好。后天呢"}', "", '{"text": "人民日报"}', '{"text": "多余"}']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert jsonl_texts(path, 2, 10) == ["今天天气很好。", "人民日报"]
    path.write_text('{"text": "好"}\n{"txt": "好"}\n', encoding="utf-8")
    with pytest.raises(EvalSetError, match=rf'^{path}:2: expected {{"text": "…"}}, got {{"txt": "好"}}$'):
        jsonl_texts(path, 5, 10)
    with pytest.raises(EvalSetError, match=rf"^registry.eval_set.path: {tmp_path / 'nope.jsonl'} does not exist$"):
        jsonl_texts(tmp_path / "nope.jsonl", 5, 10)


def stored_files(client: MlflowClient, version: str) -> Path:
    """Where the store keeps the model files of ``version`` (a local artifact folder)."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    return Path(local_file_uri_to_path(client.get_model_version_download_uri(MODEL, version)))


@pytest.mark.slow
def test_an_unscorable_champion_fails_the_gate_in_one_line_and_force_replaces_it_saying_so(store, tiny_bundle,
                                                                                           tiny_run, texts):
    uri, client, bundle = store.tracking_uri, MlflowClient(store.tracking_uri, store.tracking_uri), Bundle.read_folder(
        tiny_bundle)
    run = partial(gate, uri, bundle, tiny_run, texts, store.root / "artifacts")
    fingerprints = {CORPUS_TAG: "a corpus", TRAINING_TAG: "a configuration"}
    run()
    damaged = list(stored_files(client, "1").rglob("*.pdiparams"))
    assert damaged
    for path in damaged:  # the champion's weights are gone from the store
        path.unlink()

    with pytest.raises(GateError) as error:
        run(extra_tags=fingerprints)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"registered model {MODEL}: champion version 1 could not be "
                                                      "scored (")
    assert message.endswith("no alias was changed (registry.force: true promotes the candidate without a comparison)")
    assert aliases(uri) == {"champion": "1"}
    assert client.get_model_version(MODEL, "2").tags["gate.decision"] == "failed"
    assert trained_alike(client, MODEL, fingerprints) is None  # never counted as trained and gated

    forced = run(force=True)
    assert (forced.decision, forced.version, forced.champion_value) == ("forced", "3", None)
    assert forced.reason.startswith("registry.force: promoted without a comparison, champion version 1 could not be "
                                    "scored (") and "\n" not in forced.reason
    assert aliases(uri) == {"champion": "3", "previous": "1"}
    assert [event["decision"] for event in read_history(client, MODEL)] == ["first", "forced"]


@pytest.mark.slow
def test_a_rollback_while_a_gate_scores_is_compared_with_not_undone(store, step_bundles, tiny_run, texts, tmp_path):
    uri, client = store.tracking_uri, MlflowClient(store.tracking_uri, store.tracking_uri)
    run = partial(gate, uri, result=tiny_run, texts=texts, artifacts=store.root / "artifacts")
    run(step_bundles[6])
    run(step_bundles[1], force=True)  # a bad champion: version 2, previous 1
    retry = Retrying(RetryConfig(attempts=1), uri)
    with AliasLock(client, MODEL, "a test holding the lock", retry) as lock:
        process = GateProcess(tmp_path / "gate", uri, step_bundles[3], registry_params(),
                              tags(step_bundles[3], tiny_run, texts), texts())
        process.wait_for("waiting for the lock")  # scored against version 2, which it beats
        rollback(client, MODEL, retry, lock=lock)  # champion 1 (6 steps), previous 2
    result = process.result()
    assert (result["version"], result["decision"]) == ("3", "rejected")
    assert "champion version 1's" in result["reason"] and result["reason"].endswith(
        "(compared again: champion moved from version 2 to 1 while the candidate was scored)")
    assert aliases(uri) == {"champion": "1", "previous": "2"}  # the rollback stands
    assert [event["decision"] for event in read_history(client, MODEL)] == ["first", "forced", "rollback", "rejected"]


@pytest.mark.slow
def test_two_first_gates_started_together_on_one_server_share_one_evaluation_set_and_the_better_is_champion(
        mlflow_server, step_bundles, tiny_run, texts, tmp_path):  # noqa: F811
    uri, client = mlflow_server.uri, MlflowClient(mlflow_server.uri, mlflow_server.uri)
    # Two machines' first runs on a fresh model, each with an evaluation set of its own validation split.
    own = {3: texts()[:-2], 6: texts()[2:]}
    gates = {step: GateProcess(tmp_path / f"gate_{step}", uri, step_bundles[step], registry_params(),
                               tags(step_bundles[step], tiny_run, texts), own[step]) for step in (3, 6)}
    results = {step: process.result() for step, process in gates.items()}
    better, worse = results[6]["version"], results[3]["version"]
    assert aliases(uri)["champion"] == better, results

    stored = client.get_registered_model(MODEL).tags[TAG_EVAL_SHA256]  # one set, stored once, gated on by both
    assert {client.get_model_version(MODEL, v).tags["gate.eval_set.sha256"] for v in (better, worse)} == {stored}
    history = read_history(client, MODEL)
    assert sorted(event["version"] for event in history) == sorted([better, worse])  # both decisions recorded
    if results[3]["decision"] == "first":  # it took the lock first: then the better one was promoted over it
        assert results[6]["decision"] == "promoted" and aliases(uri) == {"champion": better, "previous": worse}
    else:  # it took the lock second and lost to the better one, compared on the same set
        assert (results[6]["decision"], results[3]["decision"]) == ("first", "rejected"), results
        assert f"champion version {better}'s" in results[3]["reason"] and aliases(uri) == {"champion": better}
    printed = subprocess.run([str(Path(sys.executable).parent / "train-deploy-registry"), "history", "--model", MODEL,
                              "--tracking-uri", uri], capture_output=True, text=True, timeout=120, check=True).stdout
    assert [row.split()[3:5] for row in printed.splitlines()[1:]] == [[e["decision"], e["version"]] for e in history]


@pytest.mark.slow
def test_a_candidate_that_cannot_be_served_in_time_is_rejected_and_the_champion_kept(store, step_bundles, tiny_run,
                                                                                    texts):
    uri, client = store.tracking_uri, MlflowClient(store.tracking_uri, store.tracking_uri)
    run = partial(gate, uri, result=tiny_run, texts=texts, artifacts=store.root / "artifacts")
    run(step_bundles[3])
    # Forced, so only the serving check stands between it and champion; no server starts and answers in 1 s.
    late = run(step_bundles[6], force=True, serving_check={"enabled": True, "timeout_seconds": 1})
    assert (late.decision, late.champion) == ("rejected", False)
    assert late.reason.startswith("the serving check failed: the server did not answer /ping within the time limit")
    assert aliases(uri) == {"champion": "1"}
    tags = client.get_model_version(MODEL, "2").tags
    assert tags["gate.decision"] == "rejected" and tags[SERVING_TAG].startswith("failed: the server did not answer")
    assert [event["decision"] for event in read_history(client, MODEL)] == ["first", "rejected"]


def test_a_registration_whose_answer_is_lost_is_not_registered_twice(store, tiny_bundle, monkeypatch):
    """``mlflow.register_model`` creates the version, then polls it until it is ready: a server failing in between
    (its database restarting, seen on PostgreSQL) fails the call after the version exists. The retry finds it."""
    from train_deploy.registry.model import log_bundle_model

    real, calls = mlflow.register_model, []

    def fails_after_the_create(*args, **kwargs):
        calls.append(real(*args, **kwargs).version)
        if len(calls) == 1:
            raise mlflow.exceptions.MlflowException("API request to endpoint /api/2.0/mlflow/model-versions/get "
                                                    "failed with error code 500 != 200")
        return calls[-1]

    monkeypatch.setattr(mlflow, "register_model", fails_after_the_create)
    client, retry = MlflowClient(store.tracking_uri, store.tracking_uri), Retrying(
        RetryConfig(attempts=2, wait_seconds=0), store.tracking_uri)
    with a_run(store.tracking_uri, None) as run_id:
        uri = log_bundle_model(Path(tiny_bundle)).model_uri
        assert register_version(client, retry, MODEL, uri, {"source.run_id": run_id}, run_id) == "1"
        assert register_version(client, retry, MODEL, uri, {"source.run_id": run_id}, run_id) == "1"  # a rerun
    assert calls == [1] and [str(v.version) for v in client.search_model_versions(f"name = '{MODEL}'")] == ["1"]
