"""The registry stage as `kedro run` runs it: last in `train_deploy`, so a run failing earlier never moves an alias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kedro.framework.session import KedroSession
from mlflow import MlflowClient

from tests.helpers.project import tiny_train_deploy_params
from tests.http_receiver import Receiver
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalstore import EVAL_SET_ARTIFACT
from train_deploy.registry.history import read_history
from train_deploy.run_control.retrain import CORPUS_TAG, REASON_TAG, TRAINING_TAG, current_fingerprints

pytestmark = pytest.mark.slow

MODEL = RegistryConfig().model_name
NO_BASELINE_RULE = {"require_beats": "none"}
"""The tiny model is worse than counting (tests/registry/test_gate.py): gated without the rule unless tested."""


def _params(**blocks: dict) -> dict:
    """A quick one-process `train_deploy` with ``blocks`` merged over its blocks."""
    return tiny_train_deploy_params(1, **blocks)


def _run(project: Path, params: dict, **run) -> None:
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["train_deploy"], **run)


def _state(client: MlflowClient) -> tuple[dict[str, str], list[str]]:
    """The aliases and the versions of the registered model."""
    aliases = {alias: str(v) for alias, v in client.get_registered_model(MODEL).aliases.items()}
    return aliases, sorted(str(v.version) for v in client.search_model_versions(f"name='{MODEL}'"))


def test_failed_runs_leave_the_aliases_undecided_keeps_the_champion_and_worse_than_counting_is_no_champion(
        project, tmp_path, capsys, seed_champion):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"  # the project fixture's store
    # The champion was trained with this run's configuration on another corpus.
    fingerprints = current_fingerprints(_params())
    seed_champion(uri, **{CORPUS_TAG: "an older corpus", TRAINING_TAG: fingerprints[TRAINING_TAG]})
    client = MlflowClient(uri, uri)
    assert _state(client) == ({"champion": "1"}, ["1"])

    # Training fails inside its node: 3 processes cannot split the tiny model's 4 heads.
    with pytest.raises(Exception, match="num_attention_heads = 4 is not divisible by mp = 3"):
        _run(project, _params(training={"parallel": {"mp": 3}, "launch": {"nproc_per_node": 3}}))
    assert _state(client) == ({"champion": "1"}, ["1"])

    # A good run, gated on the model's set of 8 texts: fewer than registry.eval_set.min_texts (16), so undecided.
    receiver = Receiver()  # the team's alerts
    try:
        _run(project, _params(registry=NO_BASELINE_RULE, notify={"webhooks": [receiver.url]}))
    finally:
        receiver.close()
    decision = json.loads((project / "data/08_reporting/registry_decision.json").read_text(encoding="utf-8"))
    assert client.get_run(decision["run_id"]).data.tags[REASON_TAG] == (
        "the corpus (inputs, reading, cleaning, tokenizer or split) changed since champion version 1")
    assert (decision["version"], decision["previous_champion"], decision["eval_texts"]) == ("2", "1", 8)
    assert (decision["decision"], decision["champion"]) == ("undecided", False)
    assert decision["reason"].startswith("undecided: the evaluation set holds 8 texts, fewer than "
                                         "registry.eval_set.min_texts 16, too few to decide on; champion version 1 "
                                         "stays (the candidate's ")
    low, high = decision["interval"]
    interval = f"95% interval {low:.2%} to {high:.2%}"
    assert f"(95% interval of the improvement {low:.2%} to {high:.2%}, paired bootstrap of 8 texts)" in decision[
        "reason"]
    assert _state(client) == ({"champion": "1"}, ["1", "2"])
    out = capsys.readouterr().out
    assert out.index("Exported bundle:") < out.index(f"MLflow run: {decision['run_id']}\n")  # the last lines
    assert (f"Registered {MODEL} version 2: did not become champion (champion stays version 1) [undecided]\n"
            f"  gate: undecided, improvement {decision['improvement']:.2%} over champion version 1 ({interval}) on "
            f"an evaluation set of 8 texts\n"
            f"  validation loss {decision['val_loss']:.4f} nats/token, NOT below the unigram baseline's "
            f"{decision['baseline_loss']:.4f} on the same windows\n"
            f"  reason: {decision['reason']}\n") in out
    (alert,) = [json.loads(body) for _, body in receiver.received]
    assert (alert["event"], alert["decision"], alert["version"], alert["champion_version"]) == (
        "rejected", "undecided", "2", "1")
    assert (alert["interval"], alert["eval_texts"], alert["reason"]) == ([low, high], 8, decision["reason"])

    # The version and the run hold what a person needs to trust it.
    version = client.get_model_version(MODEL, "2")
    assert version.run_id == decision["run_id"] and version.tags["gate.reason"] == decision["reason"]
    assert (version.tags["gate.decision"], version.tags["gate.eval_set.texts"]) == ("undecided", "8")
    assert (version.tags["gate.interval.low"], version.tags["gate.interval.high"]) == (f"{low:.6f}", f"{high:.6f}")
    assert {tag: version.tags[tag] for tag in fingerprints} == fingerprints  # what the next run compares with
    assert version.tags["git.commit"] == "unknown"  # the project copy is no git checkout
    assert json.loads(version.tags["training.layout"])["dp"] == 1
    run_metrics = client.get_run(decision["run_id"]).data.metrics  # read back after the run's every other node
    size = "export.size_mb_onnx_fp32"  # every bundle has it (the fused server graph only where its kernels run)
    assert version.tags[size] == f"{run_metrics[size]:.6g}"
    artifacts = {a.path for a in client.list_artifacts(decision["run_id"], "registry")}
    assert {"registry/history.jsonl", "registry/registry_decision.json"} <= artifacts
    assert EVAL_SET_ARTIFACT not in artifacts  # the model's set came from the seeding run
    history = client.download_artifacts(decision["run_id"], "registry/history.jsonl", str(tmp_path))
    (event,) = [json.loads(line) for line in Path(history).read_text(encoding="utf-8").splitlines()]
    assert (event["version"], event["decision"], event["champion"]) == ("2", "undecided", "1")
    assert event["interval"] == [round(low, 6), round(high, 6)] and event["eval_texts"] == 8
    assert read_history(client, MODEL)[-1] == event

    # The same bundle as the first version of a new model, under the default rule: worse than the unigram, so the
    # model gets no champion.
    _run(project, _params(registry={"model_name": "edu_lm", "require_beats": "unigram"}), from_nodes=["export_bundle"])
    first = json.loads((project / "data/08_reporting/registry_decision.json").read_text(encoding="utf-8"))
    assert (first["model_name"], first["version"], first["decision"], first["champion"]) == (
        "edu_lm", "1", "rejected", False)
    assert first["reason"].startswith(f"never champion worse than counting: its validation loss "
                                      f"{first['val_loss']:.4f} nats/token is not below the unigram baseline's "
                                      f"{first['baseline_loss']:.4f} on the same ")
    assert client.get_registered_model("edu_lm").aliases == {}

    # Export fails inside its node (parity cannot hold to 1e-30); the registry never runs.
    with pytest.raises(Exception, match="parity failed"):
        _run(project, _params(export={"parity": {"samples": 2, "max_logit_diff": 1e-30}}), from_nodes=["export_bundle"])
    assert _state(client) == ({"champion": "1"}, ["1", "2"])
