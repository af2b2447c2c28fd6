"""A collection against a real MLflow store with real registered versions: whatever the settings, nothing
``champion`` or ``previous`` needs goes; rejected versions' runs and logged models go through ``mlflow gc`` once
the grace period is over, and the versions stay registered with their tags."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import mlflow
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from tests.helpers.retention import MODEL, bundle_meta
from tests.mlflow_server import mlflow_auth_server  # noqa: F401  (fixture)
from train_deploy.retention import Layout, RetentionConfig, apply, human, make_plan, read_records
from train_deploy.retention.store import model_id

AGGRESSIVE = {"checkpoints": {"keep_runs": 1}, "training_logs": {"keep_runs": 1}, "bundles": {"keep_last": 1},
              "mlflow": {"grace_days": 0}}


def _project(root: Path) -> Layout:
    """A project whose folders hold runs 1-5 (5 newest, unregistered), five bundle versions and five tokenizers."""
    for run in range(1, 6):
        for kind in ("checkpoints", "logs"):
            (root / kind / f"run{run}").mkdir(parents=True)
        bundle = root / "bundle" / f"2026-12-0{run}T00.00.00.000Z" / "bundle"
        bundle.mkdir(parents=True)
        (bundle / "bundle.json").write_text(json.dumps(bundle_meta(f"bundle{run}")))
        tokenizer = root / "tokenizer.by_fingerprint" / f"t{run}"
        tokenizer.mkdir(parents=True)
        (tokenizer / "train_deploy_tokenizer.json").write_text(json.dumps({"hash": f"tokenizer{run}"}))
        (root / "tokens.by_fingerprint" / f"corpus{run}").mkdir(parents=True)
        (root / "init_from" / "champion" / f"{MODEL}-v{run}").mkdir(parents=True)
    return Layout(project=root, checkpoints=root / "checkpoints", training_logs=root / "logs",
                  bundles=root / "bundle", init_cache=root / "init_from",
                  stores=[("token_files", root / "tokens.by_fingerprint", 1),
                          ("tokenizer", root / "tokenizer.by_fingerprint", 1)])


def _local(uri: str) -> Path:
    return Path(urlsplit(uri).path if uri.startswith("file:") else uri)


def test_rejected_versions_wait_for_their_grace_period(registered, tmp_path):
    plan = make_plan(_project(tmp_path), RetentionConfig.from_params({"mlflow": {"grace_days": 7}}), MODEL,
                     registered.store.tracking_uri)
    assert not [r for r in plan.removals if r.kind.startswith("mlflow")]
    assert plan.kept.versions == {MODEL: {"2": ["previous"], "3": ["champion"]}}


def test_champion_and_previous_survive_the_most_aggressive_collection(registered, tmp_path):
    layout, uri, versions = _project(tmp_path / "project"), registered.store.tracking_uri, registered.versions
    plan = make_plan(layout, RetentionConfig.from_params(AGGRESSIVE), MODEL, uri)
    rejected = {v.run_id for n, v in versions.items() if n in ("1", "4")} | \
        {model_id(v) for n, v in versions.items() if n in ("1", "4")}
    assert {r.target for r in plan.removals if r.kind.startswith("mlflow")} == rejected
    assert all(r.bytes > 1_000_000 for r in plan.removals if r.kind.startswith("mlflow"))  # the bundle's copies
    record = apply(plan, layout, RetentionConfig.from_params(AGGRESSIVE), uri)

    survivors = {kind: sorted(p.name for p in (layout.project / kind).iterdir())
                 for kind in ("checkpoints", "logs", "tokens.by_fingerprint", "tokenizer.by_fingerprint")}
    # keep_runs 1: the newest (run5, a retry resumes it) and the newest that registered a version (run4); 2, 3 aliases
    assert survivors == {"checkpoints": ["run2", "run3", "run4", "run5"], "logs": ["run2", "run3", "run4", "run5"],
                         # keep_last 1 and no current link: the newest registered (corpus4) and the aliases'
                         "tokens.by_fingerprint": ["corpus2", "corpus3", "corpus4"],
                         "tokenizer.by_fingerprint": ["t2", "t3", "t4"]}
    assert sorted(p.name for p in (layout.project / "bundle").iterdir()) == [
        "2026-12-02T00.00.00.000Z", "2026-12-03T00.00.00.000Z", "2026-12-04T00.00.00.000Z", "2026-12-05T00.00.00.000Z"]
    assert sorted(p.name for p in (layout.project / "init_from" / "champion").iterdir()) == [
        f"{MODEL}-v2", f"{MODEL}-v3"]

    client = registered.client
    for number in ("1", "4"):  # gone for good, artifacts too; the version and its tags stay
        with pytest.raises(MlflowException):
            client.get_run(versions[number].run_id)
        with pytest.raises(MlflowException):
            client.get_logged_model(model_id(versions[number]))
        assert client.get_model_version(MODEL, number).tags["gate.decision"] == "rejected"
    for number in ("2", "3"):
        run = client.get_run(versions[number].run_id)
        assert run.info.lifecycle_stage == "active"
        assert (_local(run.info.artifact_uri) / "export" / "bundle" / "bundle.json").is_file()
        model = client.get_logged_model(model_id(versions[number]))
        assert (_local(model.artifact_location) / "MLmodel").is_file()
    assert {r["target"] for r in read_records(layout.project / "data/08_reporting/retention.jsonl")[-1]["removed"]} \
        >= rejected and record["bytes_freed"] > 2_000_000

    with registered.store.active():  # the champion still loads and answers
        model = mlflow.pyfunc.load_model(f"models:/{MODEL}@champion")
        assert len(model.predict(pd.DataFrame({"text": ["今天天气很好。"]}))) == 1


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_the_scheduler_collects_after_a_successful_run_under_its_own_lock(project):
    import sys

    from train_deploy.retention.collect import after_scheduled_run
    from train_deploy.run_control.lock import RunConfig, RunLock

    logs = project / "data" / "08_reporting" / "training_logs"
    for run in range(12):  # keep_runs 10: the two oldest go
        (logs / f"run{run:02d}").mkdir(parents=True)
        os.utime(logs / f"run{run:02d}", (time.time() - 100 + run, time.time() - 100 + run))
    lock = RunLock(project / "data")
    lock.acquire(RunConfig(), "train_deploy (train-deploy schedule)")
    try:
        after_scheduled_run(project, [sys.executable, "-m", "kedro", "run", "--pipelines", "train_deploy"], lock)
        assert lock.held_by() is not None and lock.about()["pid"] == os.getpid()  # still the scheduler's
    finally:
        lock.release()
    assert sorted(p.name for p in logs.iterdir()) == [f"run{run:02d}" for run in range(2, 12)]
    (record,) = read_records(project / "data" / "08_reporting" / "retention.jsonl")
    assert sorted(Path(r["target"]).name for r in record["removed"]) == ["run00", "run01"]


def _night(store, experiment: str, bundle: Path, status: str, register: bool = False) -> tuple[str, str, str]:
    """A run of ``experiment`` that logged the bundle as the pipeline does (``export/bundle`` and a logged model)
    and ended ``status``; with ``register``, a version of :data:`MODEL` came from it, after a first log whose
    answer was lost (a retried ``log the model``: its model is the third id). Its run and model ids."""
    from train_deploy.registry.model import log_bundle_model

    with store.active():
        mlflow.set_experiment(experiment)
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(bundle), "export/bundle")
            twin = log_bundle_model(bundle).model_id if register else ""
            info = log_bundle_model(bundle, registered_model_name=MODEL if register else None)
            mlflow.end_run(status)
    return run.info.run_id, info.model_id, twin


def test_a_killed_nights_run_and_model_and_a_retried_logs_extra_model_go_after_the_grace_period(
        tmp_path, tiny_bundle):
    from tests.helpers.registry import ModelStore

    store = ModelStore(tmp_path / "store")
    killed = _night(store, "nightly", Path(tiny_bundle), "KILLED")  # killed between log_model and register
    finished = _night(store, "nightly", Path(tiny_bundle), "FINISHED")  # a run by hand that registered nothing
    gated = _night(store, "nightly", Path(tiny_bundle), "FAILED", register=True)  # the gate failed: version 1
    elsewhere = _night(store, "another project", Path(tiny_bundle), "FAILED")
    client, layout = mlflow.MlflowClient(store.tracking_uri, store.tracking_uri), Layout(project=tmp_path)
    client.set_model_version_tag(MODEL, "1", "gate.decision", "failed")
    client.set_registered_model_alias(MODEL, "champion", "1")

    waiting = make_plan(layout, RetentionConfig.from_params({"mlflow": {"grace_days": 7}}), MODEL,
                        store.tracking_uri, "nightly")
    assert [r for r in waiting.removals if r.kind.startswith("mlflow")] == []
    config = RetentionConfig.from_params({"mlflow": {"grace_days": 0}})
    plan = make_plan(layout, config, MODEL, store.tracking_uri, "nightly")
    assert {(r.kind, r.target) for r in plan.removals} == {
        ("mlflow_run", killed[0]), ("mlflow_model", killed[1]), ("mlflow_model", gated[2])}
    assert all(r.bytes > 1_000_000 for r in plan.removals)
    assert {r.target: "ended KILLED" in r.reason or "retried log" in r.reason for r in plan.removals} == dict.fromkeys(
        (killed[0], killed[1], gated[2]), True)
    off = RetentionConfig.from_params({"mlflow": {"grace_days": 0, "unregistered": False}})
    assert make_plan(layout, off, MODEL, store.tracking_uri, "nightly").removals == []

    artifacts = _local(client.get_run(killed[0]).info.artifact_uri)
    apply(plan, layout, config, store.tracking_uri)
    with pytest.raises(MlflowException):
        client.get_run(killed[0])
    with pytest.raises(MlflowException):
        client.get_logged_model(killed[1])
    assert not artifacts.exists()
    with pytest.raises(MlflowException):
        client.get_logged_model(gated[2])
    for run_id, logged, _ in (finished, gated, elsewhere):  # a finished run, a version's, another experiment's: kept
        assert client.get_run(run_id).info.lifecycle_stage == "active"
        assert client.get_logged_model(logged).status is not None


def _two_models_project(root: Path) -> Layout:
    """Folders of five nights, oldest first: A (train_deploy_lm v1), B and C (edu_lm v1, v2), then two failed nights
    F1 and F2 (the newest, which registered nothing); each night's checkpoint and log folder, bundle version, token
    files and tokenizer; the token files' and tokenizer's links point at F2's."""
    for age, night in enumerate(("F2", "F1", "C", "B", "A")):
        stamp = time.time() - 100 * (age + 1)
        folders = [root / kind / f"run{night}" for kind in ("checkpoints", "logs")]
        folders += [root / "tokens.by_fingerprint" / f"corpus{night}", root / "tokenizer.by_fingerprint" / f"t{night}"]
        for folder in folders:
            folder.mkdir(parents=True)
        (folders[-1] / "train_deploy_tokenizer.json").write_text(json.dumps({"hash": f"tokenizer{night}"}))
        bundle = root / "bundle" / f"2026-12-0{5 - age}T00.00.00.000Z" / "bundle"
        bundle.mkdir(parents=True)
        (bundle / "bundle.json").write_text(json.dumps(bundle_meta(f"bundle{night}")))
        for folder in folders:
            os.utime(folder, (stamp, stamp))
    for name in ("train_deploy_lm-v1", "edu_lm-v1", "edu_lm-v9", "other_lm-v1"):
        (root / "init_from" / "champion" / name).mkdir(parents=True)
    (root / "tokens").symlink_to("tokens.by_fingerprint/corpusF2")
    (root / "tokenizer").symlink_to("tokenizer.by_fingerprint/tF2")
    return Layout(project=root, checkpoints=root / "checkpoints", training_logs=root / "logs",
                  bundles=root / "bundle", init_cache=root / "init_from",
                  stores=[("token_files", root / "tokens.by_fingerprint", 2),
                          ("tokenizer", root / "tokenizer.by_fingerprint", 2)])


def _version_of(client, experiment: str, model: str, night: str, status: str = "FINISHED") -> str:
    """A version of ``model`` registered from a new run of ``experiment`` (ended ``status``) for ``night``."""
    run = client.create_run(client.get_experiment_by_name(experiment).experiment_id, run_name=f"night {night}")
    client.set_terminated(run.info.run_id, status)
    if not any(m.name == model for m in client.search_registered_models()):
        client.create_registered_model(model)
    tags = {"training.run_name": f"run{night}", "bundle.fingerprint": f"bundle{night}",
            "corpus.fingerprint": f"corpus{night}", "tokenizer.hash": f"tokenizer{night}", "gate.decision": "promoted"}
    client.create_model_version(model, f"runs:/{run.info.run_id}/model", run.info.run_id, tags=tags)
    return run.info.run_id


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_another_models_champion_files_survive_gc_and_keep_last_whatever_the_model_name(tmp_path):
    from tests.helpers.registry import ModelStore

    store, layout = ModelStore(tmp_path / "store"), _two_models_project(tmp_path / "project")
    client = mlflow.MlflowClient(store.tracking_uri, store.tracking_uri)
    for experiment in ("nightly", "another project"):
        client.create_experiment(experiment, artifact_location=str(store.root / experiment))
    run_a = _version_of(client, "nightly", "train_deploy_lm", "A")
    run_b = _version_of(client, "nightly", "edu_lm", "B", status="FAILED")  # its night failed after the gate
    _version_of(client, "nightly", "edu_lm", "C")
    _version_of(client, "another project", "other_lm", "A")  # another project's model: none of ours
    failed = [client.create_run(client.get_experiment_by_name("nightly").experiment_id).info.run_id for _ in "12"]
    for run_id in failed:
        client.set_terminated(run_id, "FAILED")
    client.create_registered_model("edu_lm.aliases-lock")  # a lock held now: no model of the project
    client.set_registered_model_alias("train_deploy_lm", "champion", "1")
    client.set_registered_model_alias("edu_lm", "champion", "2")
    client.set_registered_model_alias("edu_lm", "previous", "1")

    config = RetentionConfig.from_params({"checkpoints": {"keep_runs": 1}, "training_logs": {"keep_runs": 1},
                                          "bundles": {"keep_last": 1}, "mlflow": {"grace_days": 0}})
    plan = make_plan(layout, config, "edu_lm", store.tracking_uri, "nightly")  # tonight's run: edu_lm
    removed = [(r.kind, Path(r.target).name if "/" in r.target else r.target) for r in plan.removals]
    assert removed == [("checkpoints", "runF1"), ("training_logs", "runF1"), ("bundle", "2026-12-04T00.00.00.000Z"),
                       ("token_files", "corpusF1"), ("tokenizer", "tF1"), ("init_cache", "edu_lm-v9"),
                       ("mlflow_run", failed[0]), ("mlflow_run", failed[1])]
    lines = plan.lines(layout.project)
    assert lines[len(removed):] == [
        "checkpoints         kept  checkpoints/runB: needed by edu_lm version 1 (previous)",
        "checkpoints         kept  checkpoints/runA: needed by train_deploy_lm version 1 (champion)",
        "training_logs       kept  logs/runB: needed by edu_lm version 1 (previous)",
        "training_logs       kept  logs/runA: needed by train_deploy_lm version 1 (champion)",
        "bundle              kept  bundle/2026-12-02T00.00.00.000Z: needed by edu_lm version 1 (previous)",
        "bundle              kept  bundle/2026-12-01T00.00.00.000Z: needed by train_deploy_lm version 1 (champion)",
        "token_files         kept  tokens.by_fingerprint/corpusB: needed by edu_lm version 1 (previous)",
        "token_files         kept  tokens.by_fingerprint/corpusA: needed by train_deploy_lm version 1 (champion)",
        "tokenizer           kept  tokenizer.by_fingerprint/tB: needed by edu_lm version 1 (previous)",
        "tokenizer           kept  tokenizer.by_fingerprint/tA: needed by train_deploy_lm version 1 (champion)",
        "init_cache          kept  init_from/champion/train_deploy_lm-v1: needed by train_deploy_lm version 1 "
        "(champion)",
        "init_cache          kept  init_from/champion/edu_lm-v1: needed by edu_lm version 1 (previous)",
        f"mlflow_run          kept  {run_b}: needed by edu_lm version 1 (previous)",
        f"8 to remove, {human(plan.bytes)} freed; kept for their aliases: edu_lm: version 1 (previous), version 2 "
        "(champion); train_deploy_lm: version 1 (champion)"]

    apply(plan, layout, config, store.tracking_uri)
    survivors = {kind: sorted(p.name for p in (layout.project / kind).iterdir())
                 for kind in ("checkpoints", "logs", "bundle", "tokens.by_fingerprint", "tokenizer.by_fingerprint")}
    assert survivors == {"checkpoints": ["runA", "runB", "runC", "runF2"], "logs": ["runA", "runB", "runC", "runF2"],
                         "bundle": [f"2026-12-0{day}T00.00.00.000Z" for day in (1, 2, 3, 5)],
                         "tokens.by_fingerprint": ["corpusA", "corpusB", "corpusC", "corpusF2"],
                         "tokenizer.by_fingerprint": ["tA", "tB", "tC", "tF2"]}
    assert sorted(p.name for p in (layout.project / "init_from" / "champion").iterdir()) == [
        "edu_lm-v1", "other_lm-v1", "train_deploy_lm-v1"]
    assert {client.get_run(run_id).info.lifecycle_stage for run_id in (run_a, run_b)} == {"active"}


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_an_account_without_delete_on_a_team_server_is_told_the_permission_it_needs(mlflow_auth_server,  # noqa: F811
                                                                                      monkeypatch):
    """On the guide's basic-auth server MLflow's EDIT cannot delete runs: the collection stops with one line naming
    the account and MANAGE, deletes nothing, and deletes once the admin grants MANAGE on the experiment."""
    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    from train_deploy.retention.config import MlflowRetention
    from train_deploy.retention.plan import Removal
    from train_deploy.retention.store import RetentionRefused, delete_and_collect

    server = mlflow_auth_server
    trainer = server.create_user("trainer")
    for name, value in (("MLFLOW_TRACKING_USERNAME", server.admin.username),
                        ("MLFLOW_TRACKING_PASSWORD", server.admin.password)):
        monkeypatch.setenv(name, value)
    admin = MlflowClient(server.uri)
    experiment = admin.create_experiment("train_deploy")
    run_id = admin.create_run(experiment).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", trainer.username)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", trainer.password)
    removals = [Removal(kind="mlflow_run", target=run_id, bytes=0, reason="rejected")]
    with pytest.raises(RetentionRefused) as refused:
        delete_and_collect(MlflowClient(server.uri), removals, MlflowRetention(), server.uri, Path.cwd())
    assert str(refused.value) == (
        "permission denied (HTTP 403) for 'trainer' on 127.0.0.1: deleting runs and logged models needs MANAGE on "
        "the project's experiment (MLflow's EDIT cannot delete); the admin grants it as docs/team-server.md's "
        "accounts step does")
    assert trainer.password not in str(refused.value)
    assert admin.get_run(run_id).info.lifecycle_stage == "active"

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.admin.username)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.admin.password)
    get_app_client("basic-auth", tracking_uri=server.uri).grant_user_permission("trainer", "experiment", experiment,
                                                                                "MANAGE")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", trainer.username)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", trainer.password)
    time.sleep(0.1)
    delete_and_collect(MlflowClient(server.uri), removals, MlflowRetention(), server.uri, Path.cwd())
    assert admin.get_run(run_id).info.lifecycle_stage == "deleted"
