"""The promotion history on the registered model, and `train-deploy-registry history | rollback` as a user runs them."""

from __future__ import annotations

import json
from functools import partial

import mlflow
import pytest
from mlflow import MlflowClient

from tests.helpers.project import NO_SERVING_CHECK
from tests.helpers.registry import ModelStore, registry
from train_deploy.handoffs import Bundle
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalset import validation_texts
from train_deploy.registry.gate import register_and_gate, version_tags
from train_deploy.registry.history import MAX_EVENT_CHARS, format_table, read_history, record_event

MODEL = "history_test_lm"


def aliases(client: MlflowClient) -> dict[str, str]:
    return {alias: str(version) for alias, version in client.get_registered_model(MODEL).aliases.items()}


@pytest.fixture
def promoted(tmp_path, tiny_bundle, tiny_run, tiny_token_files, tiny_tokenizer) -> ModelStore:
    """A store where version 1 was first and version 2 forced: champion 2, previous 1."""
    store = ModelStore(tmp_path / "store")
    bundle = Bundle.read_folder(tiny_bundle)
    texts = partial(validation_texts, tiny_token_files, tiny_tokenizer, 4, 40)
    tags = version_tags(bundle, tiny_token_files, tiny_run, "unknown")
    with store.active():
        experiment_id = mlflow.create_experiment("history-tests", artifact_location=str(store.root / "artifacts"))
        for force in (False, True):
            config = RegistryConfig.from_params({"model_name": MODEL, "force": force, **NO_SERVING_CHECK,
                                                 "require_beats": "none",  # the tiny model is worse than counting
                                                 "eval_set": {"documents": 4, "max_chars": 40}})
            with mlflow.start_run(experiment_id=experiment_id):
                register_and_gate(bundle, config, tags, texts)
    return store


@pytest.mark.slow
def test_rollback_command_swaps_champion_and_previous_and_history_prints_every_event(promoted):
    client = MlflowClient(promoted.tracking_uri, promoted.tracking_uri)
    assert aliases(client) == {"champion": "2", "previous": "1"}

    done = registry(promoted, "rollback", "--model", MODEL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{MODEL}: rolled back by ") and "from version 2 to version 1" in done.stdout
    assert aliases(client) == {"champion": "1", "previous": "2"}  # a second rollback would undo it

    done = registry(promoted, "history", "--model", MODEL)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split()[:4] == ["time", "(UTC)", "event", "decision"] and header.endswith("reason")
    assert [row.split()[3:6] for row in rows] == [["first", "1", "1"], ["forced", "2", "2"], ["rollback", "1", "1"]]
    assert "registry.force: promoted whatever the gate says" in rows[1]
    assert rows[1].split()[9:12] == ["0.0000", "[0.0000,0.0000]", "4"]  # the same bundle: no improvement, 4 texts
    assert [event["decision"] for event in read_history(client, MODEL)] == ["first", "forced", "rollback"]


@pytest.mark.slow
def test_commands_fail_in_one_line_naming_the_model(promoted):
    MlflowClient(promoted.tracking_uri, promoted.tracking_uri).create_registered_model("lonely")
    done = registry(promoted, "rollback", "--model", "lonely")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "registered model lonely: no version has the alias 'previous'" in done.stderr
    done = registry(promoted, "history", "--model", "nope")
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "nope" in done.stderr


def test_a_long_event_is_shortened_to_the_tag_limit(tmp_path):
    store = ModelStore(tmp_path / "store")
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    client.create_registered_model(MODEL)
    event = {"time": "2026-12-01T10:11:12.000001+00:00", "event": "gate", "decision": "rejected", "version": "7",
             "reason": "很长的理由" * 2000}
    key = record_event(client, MODEL, event)
    assert key == "history.20261201T101112.000001Z"
    stored = client.get_registered_model(MODEL).tags[key]
    assert len(stored) <= MAX_EVENT_CHARS and json.loads(stored)["reason"].endswith("…")
    record_event(client, MODEL, event)  # the same event again (a retried call) stays one entry
    (read,) = read_history(client, MODEL)
    assert format_table([read]).splitlines()[1].startswith("2026-12-01 10:11:12  gate   rejected  7")


def test_the_table_shows_the_improvement_its_interval_and_the_set_size():
    event = {"time": "2026-12-01T10:11:12.000001+00:00", "event": "gate", "decision": "undecided", "version": "7",
             "champion": "6", "candidate": 4.48, "champion_value": 4.52, "improvement": 0.008849,
             "interval": [-0.003112, 0.019246], "eval_texts": 64, "reason": "undecided: …"}
    header, row = format_table([event]).splitlines()
    assert header.split()[-5:] == ["nats/char", "improvement", "interval", "texts", "reason"]
    assert row.split()[3:] == ["undecided", "7", "6", "-", "4.4800", "4.5200", "0.0088", "[-0.0031,0.0192]", "64",
                               "undecided:", "…"]
