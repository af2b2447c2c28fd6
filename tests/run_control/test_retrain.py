"""Skip-unchanged as pure functions (``train_deploy.run_control.retrain``): the fingerprints against the champion's,
versions trained alike, and the order of the check (force, no champion, unchanged, changed but tried), each reason
word for word, with a stand-in MLflow client. These run once per mutant of ``make mutation``; tests/test_retrain.py
runs the same decisions end to end through ``kedro run`` and a real store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from train_deploy.config import ConfigError
from train_deploy.run_control import retrain
from train_deploy.run_control.retrain import (
    CORPUS_TAG,
    TRAINING_TAG,
    RetrainCheck,
    RetrainConfig,
    check_for_changes,
    compare,
    current_fingerprints,
)

CURRENT = {CORPUS_TAG: "c1", TRAINING_TAG: "t1"}
CORPUS = "the corpus (inputs, reading, cleaning, tokenizer or split)"


def test_the_same_fingerprints_are_nothing_to_retrain_naming_the_model():
    assert compare(CURRENT, {**CURRENT, "other": "x"}, "champion version 3", "lm") == (
        False, "nothing to retrain: the corpus and the training configuration are those of champion version 3 of lm "
               "(retrain.force: true trains anyway)")
    assert compare(CURRENT, CURRENT, "champion version 3") == (
        False, "nothing to retrain: the corpus and the training configuration are those of champion version 3 "
               "(retrain.force: true trains anyway)")


def test_each_changed_fingerprint_is_named():
    assert compare(CURRENT, {CORPUS_TAG: "c0", TRAINING_TAG: "t1"}, "champion version 3") == (
        True, f"{CORPUS} changed since champion version 3")
    assert compare(CURRENT, {CORPUS_TAG: "c1", TRAINING_TAG: "t0"}, "champion version 3") == (
        True, "the training configuration changed since champion version 3")
    assert compare(CURRENT, {CORPUS_TAG: "c0", TRAINING_TAG: "t0"}, "champion version 3") == (
        True, f"{CORPUS} and the training configuration changed since champion version 3")


@pytest.mark.parametrize("recorded", [{}, {CORPUS_TAG: "c1"}, {TRAINING_TAG: "t1"}])
def test_a_champion_without_both_fingerprints_is_retrained(recorded):
    assert compare(CURRENT, recorded, "champion version 3", "lm") == (
        True, "champion version 3 records no fingerprints (registered before change detection)")


def _version(number: str, **tags: str):
    return SimpleNamespace(version=number, tags=tags)


class _Client:
    """What the check asks of MLflow: the champion's tags, and a search of versions by tag."""

    tracking_uri = "sqlite:///unused.db"

    def __init__(self, versions: dict[str, SimpleNamespace] | None = None) -> None:
        self.versions = versions or {}
        self.searches: list[str] = []

    def get_model_version(self, name: str, version: str):
        assert name == "lm"
        return self.versions[version]

    def search_model_versions(self, query: str):
        self.searches.append(query)
        assert query.startswith("name = 'lm' and ")
        return [v for v in self.versions.values() if all(v.tags.get(t) == CURRENT[t] for t in CURRENT)]


def test_only_a_version_the_gate_decided_on_counts_as_trained_alike_and_the_newest_of_them():
    client = _Client({"2": _version("2", **CURRENT, **{"gate.decision": "rejected"}),
                      "10": _version("10", **CURRENT, **{"gate.decision": "undecided"}),
                      "11": _version("11", **CURRENT, **{"gate.decision": "failed"}),
                      "12": _version("12", **CURRENT),
                      "9": _version("9", **CURRENT, **{"gate.decision": "promoted"})})
    assert retrain.trained_alike(client, "lm", CURRENT).version == "10"  # by number, not as text ("9" > "10")
    assert client.searches == [f"name = 'lm' and tags.`{CORPUS_TAG}` = 'c1' and tags.`{TRAINING_TAG}` = 't1'"]
    assert retrain.trained_alike(_Client({"3": _version("3", **CURRENT)}), "lm", CURRENT) is None
    assert retrain.trained_alike(_Client(), "lm", CURRENT) is None


@pytest.fixture
def check(monkeypatch):
    """``check_for_changes(params, client, champion)`` with the client, the champion and the fingerprints given, and
    the interrupted moves it repaired (model names) first."""
    repaired: list[str] = []
    retried: list[str] = []

    class Retry:  # the registry's retries, recording what each call is named (a failure's message names it)
        def __init__(self, retries, uri: str) -> None:
            assert uri == _Client.tracking_uri and retries.attempts >= 1

        def __call__(self, what: str, call):
            retried.append(what)
            return call()

    def repair(found, name, retry):
        assert found is not None and isinstance(retry, Retry)
        repaired.append(name)

    def run(params: dict, client: _Client, champion: str | None) -> RetrainCheck:
        repaired.clear()
        retried.clear()

        def alias_version(found, name, alias):
            assert (found, name, alias) == (client, "lm", "champion") and repaired == ["lm"]
            return champion

        monkeypatch.setattr(retrain, "MlflowClient", lambda: client)
        monkeypatch.setattr(retrain, "current_fingerprints", lambda given: dict(CURRENT) if given is params else {})
        monkeypatch.setattr(retrain, "repair_interrupted", repair)
        monkeypatch.setattr(retrain, "Retrying", Retry)
        monkeypatch.setattr(retrain, "alias_version", alias_version)
        return check_for_changes(params)

    run.repaired, run.retried = repaired, retried
    return run


PARAMS = {"registry": {"model_name": "lm"}}


def test_force_trains_without_asking_the_registry(check):
    assert check({**PARAMS, "retrain": {"force": True}}, _Client(), "3") == RetrainCheck(
        True, "retrain.force is true", CURRENT)
    assert check.repaired == []


def test_no_champion_trains(check):
    assert check({**PARAMS, "retrain": {"force": False}}, _Client(), None) == RetrainCheck(
        True, "lm has no champion yet", CURRENT)
    assert check.repaired == ["lm"]


def test_the_champions_fingerprints_skip_and_a_change_trains(check):
    same = _Client({"3": _version("3", **CURRENT)})
    assert check(PARAMS, same, "3") == RetrainCheck(
        False, "nothing to retrain: the corpus and the training configuration are those of champion version 3 of lm "
               "(retrain.force: true trains anyway)", CURRENT)
    assert same.searches == []
    assert check.retried == ["find the champion", "read the champion's tags"]
    changed = _Client({"3": _version("3", **{CORPUS_TAG: "c0", TRAINING_TAG: "t1"})})
    assert check(PARAMS, changed, "3") == RetrainCheck(True, f"{CORPUS} changed since champion version 3", CURRENT)
    assert len(changed.searches) == 1
    assert check.retried == ["find the champion", "read the champion's tags", "find versions trained alike"]


def test_a_change_already_tried_and_not_champion_is_skipped_naming_its_decision(check):
    tried = _Client({"3": _version("3", **{CORPUS_TAG: "c0", TRAINING_TAG: "t0"}),
                     "4": _version("4", **CURRENT, **{"gate.decision": "rejected"})})
    assert check(PARAMS, tried, "3") == RetrainCheck(False, (
        "nothing to retrain: version 4 was trained on this corpus with this configuration and is not champion (gate: "
        "rejected); champion is version 3 (retrain.force: true trains anyway)"), CURRENT)


def test_the_retrain_block_is_named_in_its_errors():
    with pytest.raises(ConfigError, match=r"^retrain.force: expected true or false, got 'maybe'$"):
        RetrainConfig.from_params({"force": "maybe"})
    assert RetrainConfig.from_params(None) == RetrainConfig(force=False)


def test_the_fingerprints_follow_the_corpus_and_the_training_configuration(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("第一篇文章。\n\n第二篇文章。\n", encoding="utf-8")
    reader = {"reader": {"source": "text", "paths": [str(corpus)], "max_bytes": None}}
    first = current_fingerprints({"corpus": reader})
    assert sorted(first) == [CORPUS_TAG, TRAINING_TAG] and first == current_fingerprints({"corpus": reader})
    trained = current_fingerprints({"corpus": reader, "training": {"optimizer": {"learning_rate": 0.00123}}})
    assert (trained[CORPUS_TAG], trained[TRAINING_TAG] != first[TRAINING_TAG]) == (first[CORPUS_TAG], True)
    corpus.write_text("第一篇文章。\n\n第三篇文章。\n", encoding="utf-8")
    changed = current_fingerprints({"corpus": reader})
    assert (changed[CORPUS_TAG] != first[CORPUS_TAG], changed[TRAINING_TAG]) == (True, first[TRAINING_TAG])


def test_a_runs_fingerprints_are_its_two_tags(monkeypatch):
    tags = {CORPUS_TAG: "c1", TRAINING_TAG: "t1", "other": "x"}
    runs = {"r1": SimpleNamespace(data=SimpleNamespace(tags=tags)),
            "r2": SimpleNamespace(data=SimpleNamespace(tags={TRAINING_TAG: "t2"}))}
    monkeypatch.setattr(retrain, "MlflowClient", lambda: SimpleNamespace(get_run=runs.__getitem__))
    assert retrain.run_fingerprints("r1") == CURRENT
    assert retrain.run_fingerprints("r2") == {TRAINING_TAG: "t2"}
