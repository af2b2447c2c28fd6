"""One run at a time per project, with real processes: refused or queued, never left behind by a crash."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession

from tests.helpers.project import TINY_SLICE, cli_params, tiny_runtime_params
from train_deploy.config import ConfigError
from train_deploy.run_control.lock import HOLDER_FILE, RunConfig, RunLock, RunLockHeld

KEDRO = Path(sys.executable).parent / "kedro"
_HOLD = """
import sys, time
from pathlib import Path
from train_deploy.run_control.lock import RunConfig, RunLock
lock = RunLock(Path(sys.argv[1]))  # held as long as this object lives
lock.acquire(RunConfig(), "holder-pipeline")
print("held", flush=True)
time.sleep(600)
"""


_DIE_HOLDING = """
import json, os, socket, sys
from pathlib import Path
from train_deploy.run_control.lock import RunConfig, RunLock
socket.sethostname("shared-host")  # another container with the same host name (--network host)
lock = RunLock(Path(sys.argv[1]))
lock.acquire(RunConfig(), sys.argv[2])
print(json.dumps({"pid": os.getpid(), "previous": lock.previous}), flush=True)
os._exit(0)  # dies holding the lock: no release, its description stays
"""


def own_namespaces(*command: str) -> list[str]:
    """``command`` in new pid, mount and host-name namespaces (a container's), or the test skipped where they cannot
    be made (not root, unshare missing or refused)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed: no pid namespaces to test with")
    probe = subprocess.run([unshare, "-u", "-p", "-f", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -u -p -f --mount-proc is not permitted here ({probe.stderr.strip()[:120]})")
    return [unshare, "-u", "-p", "-f", "--mount-proc", *command]


def _wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_held_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockHeld) as exc:
            RunLock(tmp_path).acquire(RunConfig(lock="fail"), "second")
        message = str(exc.value)
        assert f"pid {holder.pid} on " in message and "pipeline holder-pipeline, started 20" in message
        assert "\n" not in message and "run.lock: wait" in message
        with pytest.raises(RunLockHeld, match=r"still held after run.wait_timeout = 0.5 s"):
            RunLock(tmp_path).acquire(RunConfig(lock="wait", wait_timeout=0.5), "second")
        holder.send_signal(signal.SIGKILL)  # a crash: no clean-up code runs in the holder
        holder.wait(10)
        lock = RunLock(tmp_path)
        lock.acquire(RunConfig(lock="fail"), "after the crash")  # the kernel released it
        assert json.loads((tmp_path / HOLDER_FILE).read_text())["pid"] == os.getpid()
        lock.release()
        assert not (tmp_path / HOLDER_FILE).exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_run_that_died_in_another_pid_namespace_with_this_pid_is_reported_not_taken_for_this_one(tmp_path):
    runs = [json.loads(subprocess.run(own_namespaces(sys.executable, "-c", _DIE_HOLDING, str(tmp_path), pipeline),
                                      capture_output=True, text=True, timeout=120, check=True).stdout)
            for pipeline in ("first", "second")]
    assert [run["pid"] for run in runs] == [1, 1]  # each the first process of its container
    assert runs[0]["previous"] is None
    previous = runs[1]["previous"]  # the first container's run died holding the lock: the second reports it
    assert (previous["pid"], previous["host"], previous["pipeline"]) == (1, "shared-host", "first")
    assert previous["pid_ns"].startswith("pid:[") and len(previous["boot"]) == 36


_ADOPT = """
import json, sys
from pathlib import Path
from train_deploy.run_control.lock import RunConfig, RunLock, RunLockHeld
lock = RunLock(Path(sys.argv[1]))
lock.acquire(RunConfig(lock="fail"), "child")  # adopts the lock its parent handed over
try:
    RunLock(Path(sys.argv[1])).acquire(RunConfig(lock="fail"), "another")
except RunLockHeld as held:
    print(json.dumps({"refused": held.holder}))
lock.release()
"""


def test_a_lock_handed_to_a_child_is_adopted_and_stays_with_the_parent_after_it(tmp_path):
    parent = RunLock(tmp_path)
    parent.acquire(RunConfig(lock="fail"), "scheduler")
    try:
        fd, env = parent.hand_over()
        child = subprocess.run([sys.executable, "-c", _ADOPT, str(tmp_path)], env={**os.environ, **env},
                               pass_fds=(fd,), capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        refused = json.loads(child.stdout)["refused"]
        assert refused.startswith("pid ") and "pipeline child, started " in refused  # the child described itself
        with pytest.raises(RunLockHeld):  # the parent holds it still
            RunLock(tmp_path).acquire(RunConfig(lock="fail"), "after the child")
        assert parent.reclaim(died=False) is None and parent.about()["pipeline"] == "scheduler"
    finally:
        parent.release()
    assert RunLock(tmp_path).held_by() is None


def test_a_descriptor_that_is_not_the_lock_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    monkeypatch.setenv("TRAIN_DEPLOY_RUN_LOCK_FD", str(other))
    lock = RunLock(tmp_path / "data")
    try:
        lock.acquire(RunConfig(lock="fail"), "run")
        assert f"TRAIN_DEPLOY_RUN_LOCK_FD={other} is not this project's run lock" in caplog.text
        assert "TRAIN_DEPLOY_RUN_LOCK_FD" not in os.environ  # nothing this process starts believes it either
        with pytest.raises(RunLockHeld):
            RunLock(tmp_path / "data").acquire(RunConfig(lock="fail"), "second")
    finally:
        lock.release()
        os.close(other)


def test_run_configuration_is_checked():
    with pytest.raises(ConfigError, match=r"^run.lock: 'queue' is not one of 'fail', 'wait'"):
        RunConfig.from_params({"lock": "queue"})
    with pytest.raises(ConfigError, match=r"^run.wait_timeout: must be a positive number of seconds or null"):
        RunConfig.from_params({"wait_timeout": 0})


@pytest.mark.slow
def test_two_sessions_on_one_project_one_runs_the_other_is_refused_or_waits(project, tmp_path):
    params = tiny_runtime_params()
    params["corpus"]["reader"]["max_bytes"] = 4 * TINY_SLICE  # a few seconds of work while holding the lock
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    first = subprocess.Popen([str(KEDRO), "run", "--pipeline", "corpus", "--params", ",".join(cli_params(params))],
                             cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (project / "data" / HOLDER_FILE).exists() or first.poll() is not None)
        assert first.poll() is None, first.stderr.read()
        with pytest.raises(RunLockHeld, match=rf"pid {first.pid} on .*pipeline corpus, started "):
            with KedroSession.create(project_path=project, runtime_params=params) as session:
                session.run(pipeline_names=["corpus"])
        assert first.poll() is None  # still running: the refusal came at once
        with KedroSession.create(project_path=project, runtime_params={**params, "run": {"lock": "wait"}}) as session:
            session.run(pipeline_names=["corpus"])  # queued behind the first run, then runs
        assert first.wait(60) == 0
    finally:
        first.kill()
        first.wait()
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["train_deploy"], output_format="list", order_by=["start_time ASC"])
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]  # the refused run opened no MLflow run
    assert runs[1].info.start_time >= runs[0].info.end_time
    assert runs[1].data.metrics["corpus.reused"] == 1.0


@pytest.mark.slow
def test_a_reader_of_the_local_mlflow_store_does_not_fail_a_run(project, tmp_path):
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])  # creates the store
    reader = sqlite3.connect(tmp_path / "mlruns.db", timeout=1)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM runs").fetchall()  # a UI holding a read transaction open
        with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
            session.run(pipeline_names=["corpus"])
    finally:
        reader.close()
    assert sqlite3.connect(tmp_path / "mlruns.db").execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.slow
def test_the_lock_holder_removes_what_interrupted_runs_left_and_says_so(project, caplog):
    models = project / "data" / "06_models"
    staged = models / ".tokenizer.tdstage-k2j9x1"  # a tokenizer folder a killed run was staging
    (staged / "half").mkdir(parents=True)
    partial = models / "checkpoints" / "run" / ".step_00000004.tdstage-a1b2c3"
    partial.mkdir(parents=True)
    mine = models / ".notes.txt"  # the user's own files, dotted or not, are never touched
    mine.write_text("keep", encoding="utf-8")
    with caplog.at_level("WARNING"), KedroSession.create(project_path=project,
                                                         runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])
    assert not staged.exists() and not partial.exists() and mine.read_text(encoding="utf-8") == "keep"
    assert "Removed 2 leftover(s) of interrupted runs" in caplog.text and str(staged) in caplog.text
