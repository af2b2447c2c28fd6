"""The promotion gate on real bundles of the tiny model in a real MLflow store (SQLite, or a server for outages)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from tests.helpers.project import NO_SERVING_CHECK
from tests.helpers.registry import GateProcess, ModelStore
from tests.mlflow_server import MlflowServer, running_mlflow_server
from train_deploy.config import ConfigError
from train_deploy.handoffs import Bundle, TrainingResult
from train_deploy.registry.aliases import AliasLock, rollback
from train_deploy.registry.config import RegistryConfig, RetryConfig
from train_deploy.registry.evalset import EvalSetError, cut, jsonl_texts, validation_texts
from train_deploy.registry.evalstore import ASSETS_TAG, EVAL_SET_ARTIFACT, TAG_EVAL_SHA256, eval_set_run_id
from train_deploy.registry.gate import (
    SERVING_TAG,
    GateError,
    RegistryDecision,
    register_and_gate,
    register_version,
    version_tags,
)
from train_deploy.registry.history import read_history
from train_deploy.registry.paired import TextScores, paired_improvement
from train_deploy.registry.retry import RegistryUnreachable, Retrying
from train_deploy.registry.rules import BaselineCheck, check_baselines, decide
from train_deploy.run_control.retrain import CORPUS_TAG, TRAINING_TAG, trained_alike

MODEL = "gate_test_lm"
# A small, quick evaluation set that fits the tiny model's context of 128 tokens, large enough to decide on here.
EVAL_SET = {"documents": 12, "max_chars": 60, "min_texts": 12}
# Six steps of the tiny model move nats per character by about half a percent a few steps (6.276 after 1 step,
# 6.244 after 3, 6.208 after 6): the gate is asked for 0.3%.
MIN_IMPROVEMENT = 0.003
# Six steps leave the tiny model worse than counting (validation loss 7.55 against the unigram's 6.85 nats/token):
# these tests gate it without the baseline rule unless they test the rule.
NO_BASELINE_RULE = {"require_beats": "none"}


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
            **NO_BASELINE_RULE, **registry}


def tags(bundle: Bundle, result: TrainingResult, texts: partial) -> dict[str, str]:
    return version_tags(bundle, texts.args[0], result, "0123abc")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """One MLflow server for this module's two server tests (a start takes 10 to 40 s), each gating a model of its
    own; the outage test stops and starts it again."""
    with running_mlflow_server(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def texts(tiny_token_files, tiny_tokenizer) -> partial:
    return partial(validation_texts, tiny_token_files, tiny_tokenizer, EVAL_SET["documents"], EVAL_SET["max_chars"])


def aliases(uri: str, name: str = MODEL) -> dict[str, str]:
    model = MlflowClient(uri, uri).get_registered_model(name)
    return {alias: str(version) for alias, version in model.aliases.items()}


@pytest.mark.slow
def test_promotion_sequence_first_worse_better_forced_then_unservable_and_on_a_changed_set(store, step_bundles,
                                                                                          tiny_run, texts):
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
    assert float(version.tags["parity.max_abs_logit_diff.paddle_portable"]) <= 1e-4

    # The same store goes on (a first gate each is what these cost apart): a candidate that cannot be served in
    # time, then a changed evaluation set.
    _a_candidate_that_cannot_be_served_in_time_is_rejected_and_the_champion_kept(run, uri, client, step_bundles[6])
    _a_changed_evaluation_set_is_refused_in_one_line_and_nothing_moves(run, uri, client, first, step_bundles[6])


def _a_candidate_that_cannot_be_served_in_time_is_rejected_and_the_champion_kept(run: partial, uri: str,
                                                                                client: MlflowClient,
                                                                                candidate: Bundle) -> None:
    """Champion version 4, previous 3: version 5 is forced, so only the serving check stands between it and
    champion; no server starts and answers in 1 s."""
    late = run(candidate, force=True, serving_check={"enabled": True, "timeout_seconds": 1})
    assert (late.decision, late.champion, late.version) == ("rejected", False, "5")
    assert late.reason.startswith("the serving check failed: the server did not answer /ping within the time limit")
    assert aliases(uri) == {"champion": "4", "previous": "3"}
    tags = client.get_model_version(MODEL, "5").tags
    assert tags["gate.decision"] == "rejected" and tags[SERVING_TAG].startswith("failed: the server did not answer")
    assert [event["decision"] for event in read_history(client, MODEL)] == [
        "first", "rejected", "promoted", "forced", "rejected"]


def _a_changed_evaluation_set_is_refused_in_one_line_and_nothing_moves(run: partial, uri: str, client: MlflowClient,
                                                                       first: RegistryDecision,
                                                                       candidate: Bundle) -> None:
    """The stored set of the model's first gate (``first``) is edited: the next gate is refused before it logs."""
    owner = eval_set_run_id(client.get_registered_model(MODEL).tags)
    stored = Path(client.get_run(owner).info.artifact_uri) / EVAL_SET_ARTIFACT
    stored.write_text(stored.read_text(encoding="utf-8").replace("。", "，", 1), encoding="utf-8")

    with pytest.raises(EvalSetError) as error:
        run(candidate)
    message = str(error.value)
    assert "\n" not in message and f"runs:/{owner}/{EVAL_SET_ARTIFACT}" in message
    assert f"the model records {first.eval_set_sha256}" in message
    assert aliases(uri) == {"champion": "4", "previous": "3"}
    assert sorted(str(v.version) for v in client.search_model_versions(f"name='{MODEL}'")) == [
        "1", "2", "3", "4", "5"]  # refused before logging


@pytest.mark.slow
def test_an_unreachable_server_is_retried_then_named_and_aliases_stay(mlflow_server, step_bundles, tiny_run, texts):
    uri, name = mlflow_server.uri, f"{MODEL}_outage"  # the server's other test gates MODEL
    gate(uri, step_bundles[3], tiny_run, texts, model_name=name)
    client = MlflowClient(uri, uri)
    assert client.get_model_version(name, "1").run_id  # the model and its artifacts went through the server

    config = RegistryConfig.from_params({"model_name": name, "eval_set": EVAL_SET,
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
    assert aliases(uri, name) == {"champion": "1"}
    assert [str(v.version) for v in client.search_model_versions(f"name='{name}'")] == ["1"]


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
        mlflow_server, step_bundles, tiny_run, texts, tmp_path):
    uri, client = mlflow_server.uri, MlflowClient(mlflow_server.uri, mlflow_server.uri)
    # Two machines' first runs on a fresh model, each with an evaluation set of its own validation split.
    own = {3: texts()[:-2], 6: texts()[2:]}
    params = registry_params(eval_set={**EVAL_SET, "min_texts": 10})  # sets of 10 texts decide
    gates = {step: GateProcess(tmp_path / f"gate_{step}", uri, step_bundles[step], params,
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


# --- no decisions on noise: the paired comparison (issue 36) ------------------------------------------


def scores(nats: list[float], chars: int = 5) -> TextScores:
    return TextScores(nats=np.array(nats, dtype=np.float64), chars=np.full(len(nats), chars, dtype=np.int64))


def test_the_paired_bootstrap_interval_of_two_texts_is_exact():
    # Resampling two texts gives three sets: text 0 twice (improvement 2/20), one each (3/20), text 1 twice (4/20),
    # drawn a quarter, a half and a quarter of the time. A 95% interval's tails (2.5% each) lie in the outer sets, a
    # 60% interval's (20% each) too, a 40% interval's (30%) in the middle one.
    ours, theirs = scores([9, 8]), scores([10, 10])
    wide = paired_improvement(ours, theirs, 0.95)
    assert (wide.improvement, wide.low, wide.high, wide.texts) == (0.15, 0.1, 0.2, 2)
    assert (paired_improvement(ours, theirs, 0.6).low, paired_improvement(ours, theirs, 0.6).high) == (0.1, 0.2)
    assert (paired_improvement(ours, theirs, 0.4).low, paired_improvement(ours, theirs, 0.4).high) == (0.15, 0.15)
    assert wide.describe() == ("15.00% fewer nats/char (95% interval of the improvement 10.00% to 20.00%, paired "
                               "bootstrap of 2 texts)")


def test_the_interval_is_paired_and_deterministic():
    # Texts of very different lengths, each 1% better: unpaired, the spread of the lengths would swamp the 1%.
    theirs = scores([10.0, 400.0, 35.0, 2000.0, 90.0, 7.0, 640.0, 55.0])
    ours = TextScores(nats=theirs.nats * 0.99, chars=theirs.chars)
    tight = paired_improvement(ours, theirs, 0.95)
    assert tight.low == pytest.approx(0.01, abs=1e-12) and tight.high == pytest.approx(0.01, abs=1e-12)
    noisy = scores([9.0, 402.0, 30.0, 2010.0, 80.0, 8.0, 600.0, 60.0])
    assert paired_improvement(noisy, theirs, 0.95) == paired_improvement(noisy, theirs, 0.95)  # seeded
    assert paired_improvement(noisy, theirs, 0.95, seed=1) != paired_improvement(noisy, theirs, 0.95)
    with pytest.raises(ValueError, match="^the candidate scored 2 texts and the champion 8"):
        paired_improvement(scores([1.0, 2.0]), theirs, 0.95)


def test_the_paired_comparison_says_worse_equal_and_refuses_other_texts():
    worse = paired_improvement(scores([11.0]), scores([10.0]), 0.95)  # one text: every draw is that text
    assert (worse.improvement, worse.low, worse.high, worse.texts) == (-0.1, -0.1, -0.1, 1)
    assert worse.describe().startswith("10.00% more nats/char (95% interval")
    assert paired_improvement(scores([10.0]), scores([10.0]), 0.95).describe().startswith("0.00% fewer nats/char")
    with pytest.raises(ValueError, match=r"^the candidate scored 2 texts and the champion 2 \(or other characters\): "
                                         r"a paired comparison needs the same texts$"):
        paired_improvement(scores([1.0, 2.0], chars=4), scores([1.0, 2.0]), 0.95)
    with pytest.raises(ValueError, match="^no texts to compare on$"):
        paired_improvement(scores([]), scores([]), 0.95)


PASSED = BaselineCheck(val_loss=5.0, baseline="unigram", baseline_loss=6.0)


def rules(**registry) -> RegistryConfig:
    return RegistryConfig.from_params({"min_improvement": 0.01, **registry})


def test_the_decision_boundaries_of_the_interval_are_exact():
    champion = scores([100.0] * 16)
    even = scores([99.0] * 16)  # 1% better on every text: the interval is exactly [0.01, 0.01]
    verdict = decide(even, "3", champion, rules(), PASSED)
    assert (verdict.decision, verdict.comparison.low, verdict.comparison.high) == ("rejected", 0.01, 0.01)
    assert verdict.reason == (
        "the candidate's 19.8000 nats/char against champion version 3's 20.0000: 1.00% fewer nats/char (95% interval "
        "of the improvement 1.00% to 1.00%, paired bootstrap of 16 texts): promotion needs an improvement above "
        "1.00% (registry.min_improvement), and the interval lies at or below it")
    promoted = decide(even, "3", champion, rules(min_improvement=0.0099), PASSED)
    assert promoted.decision == "promoted" and promoted.reason.endswith(
        "the improvement exceeds 0.99% (registry.min_improvement) at that confidence")
    # 1% better on the whole set too, but 1.5% better on half the texts and 0.5% on the other half.
    mixed = scores([98.5] * 8 + [99.5] * 8)
    undecided = decide(mixed, "3", champion, rules(), PASSED)
    low, high = undecided.comparison.low, undecided.comparison.high
    assert undecided.decision == "undecided" and 0 < low < 0.01 < high and undecided.champion_value == 20.0
    assert undecided.reason.startswith("undecided: the candidate's 19.8000 nats/char against champion version 3's "
                                       "20.0000: 1.00% fewer nats/char (95% interval of the improvement ")
    assert undecided.reason.endswith(", across the 1.00% (registry.min_improvement) needed; champion version 3 stays")
    assert decide(mixed, "3", champion, rules(min_improvement=low - 1e-9), PASSED).decision == "promoted"
    assert decide(mixed, "3", champion, rules(min_improvement=low), PASSED).decision == "undecided"
    assert decide(mixed, "3", champion, rules(min_improvement=high), PASSED).decision == "rejected"
    assert decide(mixed, "3", champion, rules(min_improvement=high - 1e-9), PASSED).decision == "undecided"


def test_a_set_below_min_texts_is_undecided_except_for_the_first_version():
    champion, much_better = scores([100.0] * 16), scores([50.0] * 16)
    assert decide(much_better, "3", champion, rules(eval_set={"min_texts": 16}), PASSED).decision == "promoted"
    small = decide(much_better, "3", champion, rules(eval_set={"min_texts": 17}), PASSED)
    assert small.decision == "undecided" and small.reason.startswith(
        "undecided: the evaluation set holds 16 texts, fewer than registry.eval_set.min_texts 17, too few to decide "
        "on; champion version 3 stays (the candidate's 10.0000 nats/char against champion version 3's 20.0000: "
        "50.00% fewer nats/char (95% interval of the improvement 50.00% to 50.00%")
    first = decide(much_better, None, None, rules(eval_set={"min_texts": 17}), PASSED)
    assert (first.decision, first.champion_value, first.comparison) == ("first", None, None)
    assert first.reason == (
        "no champion yet: the first version becomes champion (the candidate's 10.0000 nats/char on the evaluation "
        "set; the evaluation set holds 16 texts, fewer than registry.eval_set.min_texts 17: later candidates will be "
        "undecided on it, so give a new model name a larger set (registry.eval_set.path, or a larger "
        "corpus.encoding.validation_fraction))")
    assert decide(much_better, None, None, rules(), PASSED).reason == (
        "no champion yet: the first version becomes champion (the candidate's 10.0000 nats/char on the evaluation "
        "set)")


def test_a_candidate_worse_than_counting_is_never_champion_unless_forced():
    champion, much_better = scores([100.0] * 16), scores([50.0] * 16)
    worse = BaselineCheck(val_loss=7.0, baseline="unigram", baseline_loss=6.5, refusal="its loss is not below")
    for who, theirs in (("3", champion), (None, None)):  # over a champion, and as the first version
        verdict = decide(much_better, who, theirs, rules(), worse)
        assert verdict.decision == "rejected" and verdict.reason.startswith(
            "never champion worse than counting: its loss is not below (the candidate's 10.0000 nats/char")
    forced = decide(much_better, "3", champion, rules(force=True), worse)
    assert forced.decision == "forced" and forced.reason.startswith("registry.force: promoted whatever the gate says")
    assert forced.reason.endswith("; it overrides the baseline rule: its loss is not below")


def with_val_loss(bundle: Bundle, loss: float) -> Bundle:
    """``bundle`` as if its validation loss had been ``loss`` on the same windows."""
    meta = dataclasses.replace(bundle.meta, source=dataclasses.replace(bundle.meta.source, val_loss=loss))
    return dataclasses.replace(bundle, meta=meta)


def test_the_baseline_rule_names_the_baseline_and_both_figures(tiny_bundle):
    bundle = Bundle.read_folder(tiny_bundle)
    base = bundle.meta.source.val_baselines  # unigram 6.85 > add-k bigram 6.00 > Kneser-Ney bigram 5.51
    unigram, bigram, kneser_ney = base["unigram_loss"], base["bigram_loss"], base["kn_bigram_loss"]
    loss = bundle.meta.source.val_loss
    assert loss > unigram > bigram > kneser_ney
    windows = f"the same {base['windows']} validation windows of {base['seq_length']} tokens"
    refused = check_baselines(bundle, "unigram")
    assert (refused.val_loss, refused.baseline, refused.baseline_loss) == (loss, "unigram", unigram)
    assert refused.refusal == (f"its validation loss {loss:.4f} nats/token is not below the unigram baseline's "
                               f"{unigram:.4f} on {windows}: it predicts worse than counting "
                               "(registry.require_beats: unigram)")
    assert check_baselines(with_val_loss(bundle, unigram), "unigram").refusal  # equal is not below
    between = with_val_loss(bundle, (unigram + bigram) / 2)
    assert check_baselines(between, "unigram") == BaselineCheck((unigram + bigram) / 2, "unigram", unigram)
    assert check_baselines(between, "bigram").baseline == "add-k bigram" and check_baselines(between, "bigram").refusal
    assert check_baselines(with_val_loss(bundle, (bigram + kneser_ney) / 2), "bigram").refusal == ""
    strict = check_baselines(with_val_loss(bundle, (bigram + kneser_ney) / 2), "kneser_ney_bigram")
    assert (strict.baseline, strict.baseline_loss) == ("Kneser-Ney bigram", kneser_ney) and strict.refusal
    off = check_baselines(bundle, "none")  # the rule off: the figures are still given
    assert off == BaselineCheck(loss, "unigram", unigram, "")


@pytest.mark.slow
def test_a_first_version_worse_than_the_unigram_is_not_made_champion(store, step_bundles, tiny_run, texts):
    uri, client = store.tracking_uri, MlflowClient(store.tracking_uri, store.tracking_uri)
    run = partial(gate, uri, result=tiny_run, texts=texts, artifacts=store.root / "artifacts", require_beats="unigram")
    source = step_bundles[6].meta.source
    loss, unigram = source.val_loss, source.val_baselines["unigram_loss"]

    refused = run(step_bundles[6])
    assert (refused.decision, refused.champion, refused.previous_champion) == ("rejected", False, None)
    assert refused.reason.startswith(f"never champion worse than counting: its validation loss {loss:.4f} nats/token "
                                     f"is not below the unigram baseline's {unigram:.4f} on the same ")
    assert client.get_registered_model(MODEL).aliases == {}  # no champion at all rather than a bad one
    tags = client.get_model_version(MODEL, "1").tags
    assert (tags["gate.decision"], tags["gate.baseline"]) == ("rejected", "unigram")
    assert (tags["gate.val_loss"], tags["gate.baseline_loss"]) == (f"{loss:.6f}", f"{unigram:.6f}")
    (event,) = read_history(client, MODEL)
    assert (event["decision"], event["champion"], event["baseline"]) == ("rejected", None, "unigram")
    assert event["val_loss"] == round(loss, 6) and event["baseline_loss"] == round(unigram, 6)

    forced = run(step_bundles[6], force=True)
    assert (forced.decision, forced.champion) == ("forced", True)
    refusal = check_baselines(step_bundles[6], "unigram").refusal
    assert forced.reason.endswith(f"; it overrides the baseline rule: {refusal}")
    assert aliases(uri) == {"champion": "2"}


@pytest.mark.slow
def test_an_undecided_comparison_keeps_the_champion_with_the_interval_in_tags_and_history(store, step_bundles,
                                                                                          tiny_run, texts):
    uri, client = store.tracking_uri, MlflowClient(store.tracking_uri, store.tracking_uri)
    run = partial(gate, uri, result=tiny_run, texts=texts, artifacts=store.root / "artifacts",
                  eval_set={**EVAL_SET, "min_texts": 13})  # one more than the set holds
    first = run(step_bundles[3])
    assert first.decision == "first" and "fewer than registry.eval_set.min_texts 13" in first.reason

    better = run(step_bundles[6])  # better on every text, but the set is too small to decide on
    assert (better.decision, better.champion, better.previous_champion) == ("undecided", False, "1")
    assert better.reason.startswith("undecided: the evaluation set holds 12 texts, fewer than "
                                    "registry.eval_set.min_texts 13, too few to decide on; champion version 1 stays")
    low, high = better.interval
    assert 0 < low <= better.improvement <= high and better.confidence == 0.95 and better.eval_texts == 12
    assert aliases(uri) == {"champion": "1"}
    tags = client.get_model_version(MODEL, "2").tags
    assert (tags["gate.decision"], tags["gate.eval_set.texts"], tags["gate.confidence"]) == ("undecided", "12", "0.95")
    assert (tags["gate.interval.low"], tags["gate.interval.high"]) == (f"{low:.6f}", f"{high:.6f}")
    event = read_history(client, MODEL)[-1]
    assert (event["decision"], event["champion"], event["eval_texts"]) == ("undecided", "1", 12)
    assert event["interval"] == [round(low, 6), round(high, 6)] and event["reason"] == better.reason
    fingerprints = {"corpus.fingerprint": tags["corpus.fingerprint"]}
    assert str(trained_alike(client, MODEL, fingerprints).version) == "2"  # decided: the next night does not retrain


def test_the_new_registry_keys_refuse_a_bad_value_naming_the_key():
    with pytest.raises(ConfigError, match=r"^registry.confidence: must be in \[0.5, 0.999\] \(got 1.0\); a two-sided "
                                          "confidence: 0.95 = a 95% interval$"):
        RegistryConfig.from_params({"confidence": 1.0})
    with pytest.raises(ConfigError, match="^registry.require_beats: 'trigram' is not one of 'unigram', 'bigram', "
                                          "'kneser_ney_bigram', 'none'$"):
        RegistryConfig.from_params({"require_beats": "trigram"})
    assert (RegistryConfig().require_beats, RegistryConfig().confidence) == ("unigram", 0.95)


def test_a_bundle_without_its_validation_baselines_is_held_to_the_parity_windows_or_refused(tiny_bundle):
    bundle = Bundle.read_folder(tiny_bundle)
    source = dataclasses.replace(bundle.meta.source, val_baselines=None)
    parity_only = dataclasses.replace(bundle, meta=dataclasses.replace(bundle.meta, source=source))
    parity = bundle.parity.baselines
    held = check_baselines(parity_only, "unigram")
    assert (held.val_loss, held.baseline, held.baseline_loss) == (parity["model_loss"], "unigram",
                                                                  parity["unigram_loss"])
    assert held.refusal.endswith(f"on the same {parity['windows']} parity windows: it predicts worse than counting "
                                 "(registry.require_beats: unigram)")
    bare = dataclasses.replace(parity_only, parity=dataclasses.replace(bundle.parity, baselines=None))
    assert check_baselines(bare, "unigram") == BaselineCheck(None, None, None, (
        "the bundle records no validation loss beside the n-gram baselines, so nothing shows it predicts better than "
        "counting (registry.require_beats: none turns the rule off)"))
    assert check_baselines(bare, "none") == BaselineCheck(None, None, None, "")
