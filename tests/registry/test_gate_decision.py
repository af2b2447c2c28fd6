"""The gate's decision on a registered version (``train_deploy.registry.gate.gate_version``) against the in-memory
registry of tests/registry/test_aliases_fast.py, with the scores given instead of computed: what is tagged, recorded
and moved for each decision, the comparison made again when champion moved meanwhile, and a champion that cannot be
scored. These run once per mutant of ``make mutation``; tests/registry/test_gate.py runs the gate on real models."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pytest

from tests.registry.test_aliases_fast import NAME, Named, Store
from train_deploy.registry import gate
from train_deploy.registry.config import RegistryConfig, ServingCheckConfig
from train_deploy.registry.evalstore import EvalSet
from train_deploy.registry.gate import GateError, RegistryDecision, decision_tags, gate_version, promotion_event
from train_deploy.registry.infra import ServingCheckFailed
from train_deploy.registry.paired import TextScores
from train_deploy.registry.rules import BaselineCheck

TEXTS = EvalSet(texts=[f"text {n}" for n in range(20)], sha256="abc")
BASELINE = BaselineCheck(val_loss=2.5, baseline="unigram", baseline_loss=4.0)


def _scores(nats_per_char: float) -> TextScores:
    chars = np.full(20, 100.0)
    return TextScores(nats=chars * nats_per_char * np.linspace(0.9, 1.1, 20), chars=chars)


class _Scores(dict):
    """Version → its score, with the versions scored, in order (``asked``)."""

    asked: list[str]


@pytest.fixture
def scored(monkeypatch):
    """Version → its score (a version missing from it cannot be scored); the versions scored, in order."""
    scores = _Scores()
    scores.asked = asked = []

    def score(uri: str, texts: list[str], config: RegistryConfig) -> TextScores:
        assert uri.startswith(f"models:/{NAME}/") and texts == TEXTS.texts and config.model_name == NAME
        version = uri.rsplit("/", 1)[1]
        asked.append(version)
        if version not in scores:
            raise OSError(f"model files of version {version} are gone\nsecond line")
        return scores[version]

    monkeypatch.setattr(gate, "score", score)
    return scores


def _config(**changes) -> RegistryConfig:
    """The stage's configuration; the serving check (a real server, ``tests/registry/test_gate.py``) off."""
    return RegistryConfig(model_name=NAME, serving_check=ServingCheckConfig(enabled=False), **changes)


def _store(**aliases_: str) -> Store:
    store = Store()
    store.add(NAME, **aliases_)
    return store


def _champion_moves_while_scored(store: Store, monkeypatch, to: str) -> None:
    """A rollback lands while the candidate is scored: champion is ``to`` from the gate's second look on."""
    alias_version, seen = gate.alias_version, []

    def moved(client, name, alias):
        seen.append(alias)
        if len(seen) == 2:
            store.models[NAME]["aliases"]["champion"] = to
        return alias_version(client, name, alias)

    monkeypatch.setattr(gate, "alias_version", moved)


def test_a_better_candidate_is_promoted_in_one_recorded_move(scored):
    store = _store(champion="1")
    scored.update({"1": _scores(2.0), "2": _scores(1.5)})
    result = gate_version(store, Named(), _config(), "2", "run2", TEXTS, BASELINE)
    assert (result.decision, result.champion, result.previous_champion, result.version, result.run_id) == (
        "promoted", True, "1", "2", "run2")
    assert store.models[NAME]["aliases"] == {"champion": "2", "previous": "1"}
    assert store.models[NAME]["versions"]["2"] == decision_tags(result)
    (move,) = [json.loads(v) for k, v in store.written if k == "aliases.move"]
    assert move["tags"] == decision_tags(result) and (move["champion"], move["previous"], move["start"]) == (
        "2", "1", "1")
    history = json.loads(store.tags()[move["event"]])
    assert history == json.loads(json.dumps(promotion_event(result)))


def test_a_worse_candidate_is_tagged_rejected_and_nothing_moves(scored):
    store = _store(champion="1", previous="0")
    scored.update({"1": _scores(1.5), "2": _scores(2.0)})
    retry = Named()
    result = gate_version(store, retry, _config(), "2", "run2", TEXTS, BASELINE)
    assert (result.decision, result.champion, result.previous_champion) == ("rejected", False, "1")
    assert store.models[NAME]["aliases"] == {"champion": "1", "previous": "0"}
    assert store.models[NAME]["versions"]["2"] == decision_tags(result)
    assert [k for k, _ in store.written if k == "aliases.move"] == []
    assert retry.names[:2] == ["find the champion", "score the candidate"]
    release = ["read the registered model", "drop the claim", "read the lock", "delete the lock"]
    assert retry.names[-6:] == ["tag the version", "record the history", *release]
    (event,) = [json.loads(v) for k, v in store.tags().items() if k.startswith("history.")]
    assert event == json.loads(json.dumps(promotion_event(result)))


def test_the_first_version_becomes_champion(scored):
    store = _store()
    scored["1"] = _scores(1.5)
    result = gate_version(store, Named(), _config(), "1", "run1", TEXTS, BASELINE)
    assert (result.decision, result.champion, result.previous_champion, result.champion_value) == (
        "first", True, None, None)
    assert store.models[NAME]["aliases"] == {"champion": "1"}
    assert scored.asked == ["1"]


def test_a_champion_moved_while_scoring_is_compared_again_saying_so(scored, monkeypatch):
    store = _store(champion="1")
    scored.update({"1": _scores(1.0), "3": _scores(2.5), "2": _scores(2.0)})
    _champion_moves_while_scored(store, monkeypatch, "3")
    result = gate_version(store, Named(), _config(), "2", "run2", TEXTS, BASELINE)
    assert (result.decision, result.previous_champion) == ("promoted", "3")
    assert result.reason.endswith(" (compared again: champion moved from version 1 to 3 while the candidate was "
                                  "scored)")
    assert scored.asked == ["2", "1", "3"]
    assert store.models[NAME]["aliases"] == {"champion": "2", "previous": "3"}


def test_a_champion_that_cannot_be_scored_fails_the_gate_unless_forced(scored):
    store = _store(champion="1")
    scored["2"] = _scores(2.0)
    with pytest.raises(GateError, match=(
            r"^registered model lm: champion version 1 could not be scored \(OSError: model files of version 1 are "
            r"gone\); no alias was changed \(registry.force: true promotes the candidate without a comparison\)$")):
        gate_version(store, Named(), _config(), "2", "run2", TEXTS, BASELINE)
    assert store.models[NAME]["aliases"] == {"champion": "1"} and store.models[NAME]["versions"] == {}
    result = gate_version(store, Named(), _config(force=True), "2", "run2", TEXTS, BASELINE)
    assert (result.decision, result.champion) == ("forced", True)
    assert store.models[NAME]["aliases"] == {"champion": "2", "previous": "1"}


def test_a_promotion_the_serving_check_refuses_is_rejected_naming_why(scored, monkeypatch):
    store = _store(champion="1")
    scored.update({"1": _scores(2.0), "2": _scores(1.5)})
    monkeypatch.setattr(gate, "serving_failure", lambda client, retry, config, version: "no answer in 60 s")
    result = gate_version(store, Named(), _config(), "2", "run2", TEXTS, BASELINE)
    assert result.decision == "rejected" and result.reason.startswith(
        "the serving check failed: no answer in 60 s (the score: the candidate's ")
    assert store.models[NAME]["aliases"] == {"champion": "1"}


def _decision(**changes) -> RegistryDecision:
    fields = dict(model_name=NAME, version="2", run_id="r", decision="promoted", reason="why", champion=True,
                  previous_champion="1", metric="nats_per_char", candidate_value=1.23456789,
                  champion_value=2.3456789, eval_set_sha256="abc", eval_texts=20,
                  decided_at="2026-12-04T08:00:00+00:00",
                  improvement=0.1234567, interval=[0.01, 0.2345678], confidence=0.95, val_loss=2.5,
                  baseline="unigram", baseline_loss=4.0)
    return RegistryDecision(**{**fields, **changes})


def test_the_decision_tags_spell_every_figure():
    assert decision_tags(_decision()) == {
        "gate.decision": "promoted", "gate.reason": "why", "gate.metric": "nats_per_char",
        "gate.candidate": "1.234568", "gate.champion": "2.345679", "gate.champion_version": "1",
        "gate.eval_set.sha256": "abc", "gate.eval_set.texts": "20", "gate.improvement": "0.123457",
        "gate.interval.low": "0.010000", "gate.interval.high": "0.234568", "gate.confidence": "0.95",
        "gate.val_loss": "2.500000", "gate.baseline": "unigram", "gate.baseline_loss": "4.000000"}
    none = decision_tags(_decision(champion_value=None, previous_champion=None, improvement=None, interval=None,
                                   confidence=None, val_loss=None, baseline=None, baseline_loss=None,
                                   reason="x" * 6000))
    assert {k: v for k, v in none.items() if v == "none"}.keys() == {
        "gate.champion", "gate.champion_version", "gate.improvement", "gate.interval.low", "gate.interval.high",
        "gate.confidence", "gate.val_loss", "gate.baseline", "gate.baseline_loss"}
    assert none["gate.reason"] == "x" * 5000


def test_the_history_entry_names_who_holds_champion_after_the_decision():
    assert promotion_event(_decision()) == {
        "time": "2026-12-04T08:00:00+00:00", "event": "gate", "decision": "promoted", "version": "2",
        "champion": "2", "previous": "1", "metric": "nats_per_char", "candidate": 1.234568,
        "champion_value": 2.345679, "improvement": 0.123457, "interval": [0.01, 0.234568], "confidence": 0.95,
        "eval_texts": 20, "val_loss": 2.5, "baseline": "unigram", "baseline_loss": 4.0, "reason": "why",
        "run_id": "r"}
    kept = promotion_event(_decision(decision="rejected", champion=False, champion_value=None, improvement=None,
                                     interval=None, val_loss=None, baseline_loss=None))
    assert (kept["champion"], kept["previous"], kept["champion_value"], kept["improvement"], kept["interval"],
            kept["val_loss"], kept["baseline_loss"]) == ("1", None, None, None, None, None, None)


@pytest.fixture
def serving(monkeypatch):
    """The serving check stood in (``tests/registry/test_infra.py`` runs the real one): the versions it checked; a
    version in ``fail`` fails with that message."""
    state = SimpleNamespace(checked=[], fail={})

    def check(uri, tracking_uri, registry_uri, config, folder):
        assert (tracking_uri, registry_uri, config.enabled, folder) == (
            mlflow.get_tracking_uri(), mlflow.get_registry_uri(), True, Path.cwd())
        version = uri.removeprefix(f"models:/{NAME}/")
        state.checked.append(version)
        if version in state.fail:
            raise ServingCheckFailed(state.fail[version])
        return "answered in 1.2 s" + " " * 6000 + "end"

    monkeypatch.setattr(gate, "check_serving", check)
    return state


def _served(**changes) -> RegistryConfig:
    return RegistryConfig(model_name=NAME, **changes)


def test_the_serving_check_tags_its_outcome_and_names_a_failure(serving, caplog):
    store = _store(champion="1")
    retry = Named()
    caplog.set_level("INFO", logger="train_deploy.registry.gate")
    assert gate.serving_failure(store, retry, _served(), "2") is None
    passed = "passed: answered in 1.2 s" + " " * 6000 + "end"
    assert store.models[NAME]["versions"]["2"] == {"gate.serving_check": passed[:5000]}
    serving.fail["3"] = "no answer in 60 s " + "x" * 6000
    assert gate.serving_failure(store, retry, _served(), "3") == serving.fail["3"]
    assert store.models[NAME]["versions"]["3"] == {"gate.serving_check": ("failed: " + serving.fail["3"])[:5000]}
    assert retry.names == ["tag the serving check", "tag the serving check"] and serving.checked == ["2", "3"]
    assert [r.getMessage() for r in caplog.records] == [
        f"lm version 2: serving check passed ({passed.removeprefix('passed: ')})",
        f"lm version 3: the serving check failed, so it cannot be promoted: {serving.fail['3']}"]


def test_a_candidate_is_served_once_before_promotion_and_a_failure_rejects_it(scored, serving):
    store = _store(champion="1")
    scored.update({"1": _scores(2.0), "2": _scores(1.5), "3": _scores(2.5)})
    assert gate_version(store, Named(), _served(), "3", "run3", TEXTS, BASELINE).decision == "rejected"
    assert serving.checked == []  # a rejected candidate is not served
    assert gate_version(store, Named(), _served(), "2", "run2", TEXTS, BASELINE).decision == "promoted"
    assert serving.checked == ["2"]
    serving.fail["4"] = "exited with code 1"
    scored["4"] = _scores(1.0)
    result = gate_version(store, Named(), _served(), "4", "run4", TEXTS, BASELINE)
    assert (result.decision, store.models[NAME]["aliases"]["champion"]) == ("rejected", "2")
    assert result.reason.startswith("the serving check failed: exited with code 1 (the score: the candidate's ")


def test_a_candidate_promoted_only_when_compared_again_is_served_then(scored, serving, monkeypatch, caplog):
    store = _store(champion="1")
    scored.update({"1": _scores(1.0), "3": _scores(2.5), "2": _scores(2.0)})
    _champion_moves_while_scored(store, monkeypatch, "3")
    caplog.set_level("INFO", logger="train_deploy.registry.gate")
    retry = Named()
    result = gate_version(store, retry, _served(), "2", "run2", TEXTS, BASELINE)
    assert (result.decision, serving.checked) == ("promoted", ["2"])
    assert "find the champion again" in retry.names
    assert [json.loads(v)["what"] for k, v in store.written if k.startswith("aliases-lock.claim.")] == [
        "gate of version 2"]
    assert "Registered model lm: champion moved from version 1 to 3 while version 2 was scored; comparing again" in [
        r.getMessage() for r in caplog.records]


def test_the_decision_record_holds_the_comparison_and_the_baseline(scored):
    store = _store(champion="1")
    scored.update({"1": _scores(2.0), "2": _scores(1.5)})
    result = gate_version(store, Named(), _config(), "2", "run2", TEXTS, BASELINE)
    assert (result.metric, result.candidate_value, result.champion_value, result.eval_set_sha256,
            result.eval_texts, result.val_loss, result.baseline, result.baseline_loss) == (
        "nats_per_char", pytest.approx(1.5), pytest.approx(2.0), "abc", 20, 2.5, "unigram", 4.0)
    assert result.improvement == pytest.approx(0.25) and result.confidence == 0.95
    assert len(result.interval) == 2 and result.interval[0] <= 0.25 <= result.interval[1]
    assert result.decided_at.endswith("+00:00")


def test_a_forced_candidate_over_an_unscorable_champion_says_why(scored, caplog):
    store = _store(champion="1")
    scored["2"] = _scores(2.0)
    retry = Named()
    result = gate_version(store, retry, _config(force=True), "2", "run2", TEXTS, BASELINE)
    assert "OSError: model files of version 1 are gone" in result.reason
    assert retry.names[:3] == ["find the champion", "score the candidate", "score the champion"]
    assert ("Registered model lm: champion version 1 could not be scored (OSError: model files of version 1 are "
            "gone); registry.force promotes the candidate without a comparison") in [
        r.getMessage() for r in caplog.records]


def test_a_candidate_rejected_when_compared_again_is_not_served(scored, serving, monkeypatch):
    store = _store(champion="1")
    scored.update({"1": _scores(1.0), "3": _scores(1.2), "2": _scores(2.0)})
    _champion_moves_while_scored(store, monkeypatch, "3")
    result = gate_version(store, Named(), _served(), "2", "run2", TEXTS, BASELINE)
    assert (result.decision, result.previous_champion, serving.checked) == ("rejected", "3", [])
