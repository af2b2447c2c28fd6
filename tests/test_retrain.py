"""Change detection for scheduled retraining: a run with nothing new is recorded as skipped and trains nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kedro.framework.session import KedroSession
from mlflow import MlflowClient

from tests.helpers.project import cli_params
from tests.helpers.registry import GateProcess
from tests.helpers.retrain import _params, _write_corpus
from train_deploy.handoffs import Bundle
from train_deploy.registry.config import RegistryConfig
from train_deploy.run_control.retrain import (
    CORPUS_TAG,
    TRAINING_TAG,
    NothingToRetrain,
    RetrainCheck,
    check_for_changes,
    compare,
    current_fingerprints,
)

MODEL = RegistryConfig().model_name
TRAIN_DEPLOY = Path(sys.executable).parent / "train-deploy"


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` but the run lock's and the retention record a scheduled run appends to
    (``train_deploy.retention``), with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and ".train_deploy.lock" not in p.name
            and p.name != "retention.jsonl"}


def test_compare_names_what_changed():
    current = {CORPUS_TAG: "c1", TRAINING_TAG: "t1"}
    assert compare(current, dict(current), "champion version 3") == (
        False, "nothing to retrain: the corpus and the training configuration are those of champion version 3 "
               "(retrain.force: true trains anyway)")
    assert compare(current, {CORPUS_TAG: "c0", TRAINING_TAG: "t1"}, "champion version 3") == (
        True, "the corpus (inputs, reading, cleaning, tokenizer or split) changed since champion version 3")
    assert compare(current, {CORPUS_TAG: "c0", TRAINING_TAG: "t0"}, "v")[1].startswith(
        "the corpus (inputs, reading, cleaning, tokenizer or split) and the training configuration changed")
    assert compare(current, {"corpus.fingerprint": "x"}, "champion version 1") == (
        True, "champion version 1 records no fingerprints (registered before change detection)")


def test_fingerprints_follow_what_changes_the_model_and_ignore_how_it_runs(tmp_path):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, 0, 200)
    base = current_fingerprints(_params(corpus))
    same = _params(corpus, training={"launch": {"nproc_per_node": 2}, "schedule": {"max_steps": 4, "log_every": 2}})
    same["corpus"]["encoding"]["workers"] = 1
    assert current_fingerprints(same) == base  # processes, cadences and workers change no weights

    retokenized = _params(corpus)
    retokenized["corpus"]["tokenizer"] = {**retokenized["corpus"]["tokenizer"], "vocab_size": 1500}
    longer = _params(corpus, training={"schedule": {"max_steps": 5}})
    assert current_fingerprints(retokenized)[CORPUS_TAG] != base[CORPUS_TAG]
    assert current_fingerprints(retokenized)[TRAINING_TAG] == base[TRAINING_TAG]
    assert current_fingerprints(longer)[CORPUS_TAG] == base[CORPUS_TAG]
    assert current_fingerprints(longer)[TRAINING_TAG] != base[TRAINING_TAG]
    _write_corpus(corpus, 200, 201, mode="a")
    assert current_fingerprints(_params(corpus))[CORPUS_TAG] != base[CORPUS_TAG]


def _run(project: Path, params: dict) -> None:
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["train_deploy"])


@pytest.mark.slow
def test_unchanged_corpus_is_a_skipped_run_new_text_retrains_and_a_failing_schedule_keeps_the_champion(
        project, tmp_path, seed_champion):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, 0, 700)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"  # the project fixture's store
    client = MlflowClient(uri, uri)
    fingerprints = current_fingerprints(_params(corpus))
    seed_champion(uri, **fingerprints)  # trained on this corpus with this configuration (real runs record them:
    #                                     tests/pipelines/registry/test_pipeline.py)

    before = _files(project / "data")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    params = ",".join(cli_params(_params(corpus)))
    once = subprocess.run([str(TRAIN_DEPLOY), "schedule", "--once", "--params", params], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert once.returncode == 0, once.stderr[-3000:]  # kedro run (train_deploy.cli) ends a skipped run as a success
    assert "Skipped: nothing to retrain: the corpus and the training configuration are those of champion version 1" \
        in once.stdout
    assert _files(project / "data") == before  # nothing tokenized, trained, averaged or exported
    (skipped,) = client.search_runs([client.get_experiment_by_name("train_deploy").experiment_id])
    assert skipped.info.status == "FINISHED" and skipped.data.tags["outcome"] == "skipped"
    assert skipped.data.tags["retrain.reason"].startswith("nothing to retrain")
    assert skipped.data.metrics == {} and skipped.data.tags["trigger"] == "schedule"
    assert {tag: skipped.data.tags[tag] for tag in fingerprints} == fingerprints

    with pytest.raises(NothingToRetrain, match="those of champion version 1"):  # a session in Python says it too
        _run(project, _params(corpus))

    _write_corpus(corpus, 700, 800, mode="a")  # new text arrived
    assert check_for_changes(_params(corpus)).reason == (
        "the corpus (inputs, reading, cleaning, tokenizer or split) changed since champion version 1")
    forced = _params(corpus)
    forced["retrain"] = {"force": True}
    assert check_for_changes(forced).reason == "retrain.force is true"
    # trained on it, and the gate kept version 1: the seed's set of 8 texts is fewer than min_texts (16)
    seed_champion(uri, **current_fingerprints(_params(corpus)))
    assert check_for_changes(_params(corpus)) == RetrainCheck(False, (
        "nothing to retrain: version 2 was trained on this corpus with this configuration and is not champion "
        "(gate: undecided); champion is version 1 (retrain.force: true trains anyway)"),
        current_fingerprints(_params(corpus)))

    # The scheduler on a project whose corpus has gone: the slot's run fails and is retried with back-off, the
    # champion stays, and the scheduler lives on to run the next slot.
    corpus.unlink()
    log, project_log = tmp_path / "schedule.log", project / "logs" / "train_deploy.log"
    with log.open("w") as out:
        scheduler = subprocess.Popen([str(TRAIN_DEPLOY), "schedule", "--cron", "* * * * * */2", "--retries", "1",
                                      "--backoff", "0.2", "--params", params], cwd=project, env=env, stdout=out,
                                     stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: "started:" in log.read_text().partition("after 1 retries")[2], 180)
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(60) == 0
    finally:
        scheduler.kill()
    text = log.read_text()
    assert "run failed (rc 1): retry 1 of 1 in 0.2 s" in text
    # Each failed run says what failed in one line and where its traceback went, not 250 lines of it.
    one_line = f"CorpusError: {corpus}: no such file or folder (corpus.reader.paths)\n  traceback: {project_log}\n"
    assert text.count(one_line) >= 2 and "Traceback" not in text and "\x1b[" not in text
    assert "Traceback (most recent call last)" in project_log.read_text(encoding="utf-8")
    assert {k: str(v) for k, v in client.get_registered_model(MODEL).aliases.items()} == {"champion": "1"}
    assert len(client.search_model_versions(f"name='{MODEL}'")) == 2
    statuses = [run.info.status for run in client.search_runs([skipped.info.experiment_id], order_by=["start_time"])]
    assert statuses[:2] == ["FINISHED", "FINISHED"] and statuses[2:4] == ["FAILED", "FAILED"], statuses


@pytest.mark.slow
def test_a_version_whose_gate_was_killed_after_registering_it_does_not_stop_the_next_run(tmp_path, monkeypatch,
                                                                                        seed_champion, tiny_bundle):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, 0, 300)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    fingerprints = current_fingerprints(_params(corpus))
    seed_champion(uri, **{CORPUS_TAG: "an older corpus", TRAINING_TAG: fingerprints[TRAINING_TAG]})

    # The registry stage of a run on this corpus, killed once its version exists and before the gate decides.
    stage = GateProcess(tmp_path / "registry_stage", uri, Bundle.read_folder(tiny_bundle),
                        {"eval_set": {"documents": 8, "max_chars": 60}}, fingerprints, [])
    stage.wait_for(f"Created version '2' of model '{MODEL}'")
    stage.kill()
    client = MlflowClient(uri, uri)
    assert "gate.decision" not in client.get_model_version(MODEL, "2").tags
    assert {k: str(v) for k, v in client.get_registered_model(MODEL).aliases.items()} == {"champion": "1"}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    check = check_for_changes(_params(corpus))
    assert check.retrain, check.reason  # not "Skipped: … version 2 … (gate: unknown)"
    assert check.reason == "the corpus (inputs, reading, cleaning, tokenizer or split) changed since champion version 1"


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)
