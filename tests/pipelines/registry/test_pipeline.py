"""The registry stage as `kedro run` runs it: last in `train_deploy`, so a run failing earlier never moves an alias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kedro.framework.session import KedroSession
from mlflow import MlflowClient

from tests.helpers.project import tiny_train_deploy_params
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalstore import EVAL_SET_ARTIFACT
from train_deploy.retrain import CORPUS_TAG, REASON_TAG, TRAINING_TAG, current_fingerprints

pytestmark = pytest.mark.slow

MODEL = RegistryConfig().model_name


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


def test_failed_runs_leave_the_aliases_and_a_good_run_registers_gates_and_says_so(project, tmp_path, capsys,
                                                                                  seed_champion):
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

    _run(project, _params())
    decision = json.loads((project / "data/08_reporting/registry_decision.json").read_text(encoding="utf-8"))
    assert client.get_run(decision["run_id"]).data.tags[REASON_TAG] == (
        "the corpus (inputs, reading, cleaning, tokenizer or split) changed since champion version 1")
    assert decision["version"] == "2" and decision["previous_champion"] == "1"
    assert decision["decision"] in ("promoted", "rejected") and decision["eval_texts"] == 8
    champion = "2" if decision["champion"] else "1"
    after_good_run = ({"champion": champion, **({"previous": "1"} if decision["champion"] else {})}, ["1", "2"])
    assert _state(client) == after_good_run
    out = capsys.readouterr().out
    verdict = "became champion" if decision["champion"] else "did not become champion (champion stays version 1)"
    assert out.index("Exported bundle:") < out.index(f"MLflow run: {decision['run_id']}\n")  # the last lines
    assert f"Registered {MODEL} version 2: {verdict} [{decision['decision']}]\n  reason: {decision['reason']}\n" in out

    # The version and the run hold what a person needs to trust it.
    version = client.get_model_version(MODEL, "2")
    assert version.run_id == decision["run_id"] and version.tags["gate.reason"] == decision["reason"]
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
    assert (event["version"], event["decision"]) == ("2", decision["decision"])

    # Export fails inside its node (parity cannot hold to 1e-30); the registry never runs.
    with pytest.raises(Exception, match="parity failed"):
        _run(project, _params(export={"parity": {"samples": 2, "max_logit_diff": 1e-30}}), from_nodes=["export_bundle"])
    assert _state(client) == after_good_run
