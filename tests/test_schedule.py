"""`train-deploy schedule` with real processes: a tiny script stands in for `kedro run` (the hidden --command
option), except in the last test, which runs the real corpus pipeline once."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest
from kedro.framework.session import KedroSession

from tests.helpers.project import cli_params, tiny_runtime_params
from tests.http_receiver import Receiver
from train_deploy.run_control.lock import HOLDER_FILE, RunConfig, RunLock

TRAIN_DEPLOY = Path(sys.executable).parent / "train-deploy"

# The stand-in run: appends one JSON line (start time, pid, trigger, cwd) to argv[1], then does argv[2].
_RUN = """
import json, os, subprocess, sys, time
from pathlib import Path
log, mode = Path(sys.argv[1]), sys.argv[2]
with log.open("a") as f:
    f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "trigger": os.environ.get("TRAIN_DEPLOY_TRIGGER"),
                        "cwd": os.getcwd()}) + "\\n")
if mode == "fail":
    sys.exit(2)
if mode == "stopped":  # kedro run's exit status when the data gate stopped the night
    sys.exit(3)
if mode == "long_first" and len(log.read_text().splitlines()) == 1:
    time.sleep(3.3)
if mode in ("hold", "late_hold"):  # like kedro run: takes the project's run lock (after its start-up) and works
    from train_deploy.run_control.lock import RunConfig, RunLock
    time.sleep(2 if mode == "late_hold" else 0)
    lock = RunLock(Path("data"))
    lock.acquire(RunConfig(), "stand-in")
    release, deadline = log.parent / "release", time.time() + 60  # "hold": until the test lets go
    while mode == "hold" and not release.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1 if mode == "late_hold" else 0)
    lock.release()
if mode == "die":  # a run that dies of a signal in a node, holding the lock handed to it
    import signal
    from train_deploy.run_control.lock import RunConfig, RunLock
    lock = RunLock(Path("data"))
    lock.acquire(RunConfig(), "stand-in")
    lock.record(node="export_bundle", stage="export")
    os.kill(os.getpid(), signal.SIGILL)
if mode == "hang":  # a run that hangs in a node, holding the lock handed to it
    from train_deploy.run_control.lock import RunConfig, RunLock
    lock = RunLock(Path("data"))
    lock.acquire(RunConfig(), "stand-in")
    lock.record(node="train_model", stage="training")
    time.sleep(600)
if mode == "group":  # a run with a training process of its own, in its process group
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(str(log) + ".pids").write_text(f"{os.getpid()} {worker.pid}")
    time.sleep(120)
"""


@pytest.fixture
def stand_in(tmp_path) -> tuple[Path, Path]:
    """A project folder (pyproject.toml only) and the stand-in run's script."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text("")
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    return project, script


def _schedule(project: Path, script: Path, mode: str, *options: str) -> subprocess.Popen:
    command = f"{sys.executable} {script} {project.parent / 'runs.jsonl'} {mode}"
    return subprocess.Popen([str(TRAIN_DEPLOY), "schedule", "--project", str(project), "--command", command,
                             *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _runs(project: Path) -> list[dict]:
    log = project.parent / "runs.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _stop(scheduler: subprocess.Popen) -> tuple[int, str]:
    scheduler.send_signal(signal.SIGTERM)
    _, err = scheduler.communicate(timeout=20)
    return scheduler.returncode, err


@pytest.mark.parametrize(("mode", "rc"), [("ok", 0), ("fail", 2)])
def test_once_runs_in_the_project_as_a_scheduled_run_and_exits_with_its_code(stand_in, mode, rc):
    project, script = stand_in
    scheduler = _schedule(project, script, mode, "--once")
    _, err = scheduler.communicate(timeout=20)
    assert scheduler.returncode == rc, err
    [run] = _runs(project)
    assert run["trigger"] == "schedule" and Path(run["cwd"]) == project
    assert re.search(rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO .*finished: rc {rc} after \d+\.\d s$", err, re.M)


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_failed_run_is_retried_with_doubling_backoff_then_waits_for_the_next_slot(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "fail", "--cron", "* * * * * */2", "--retries", "2", "--backoff", "0.2")
    _wait_for(lambda: len(_runs(project)) >= 4)  # the first slot's run, two retries, then the next slot's run
    rc, err = _stop(scheduler)
    assert rc == 0, err
    starts = [run["t"] for run in _runs(project)]
    assert starts[1] - starts[0] >= 0.2 and starts[2] - starts[1] >= 0.4
    assert "retry 1 of 2 in 0.2 s" in err and "retry 2 of 2 in 0.4 s" in err
    failed = err.index("run failed (rc 2) after 2 retries")
    assert "next slot at" in err[failed:] and "started:" in err[failed:]  # still alive, and ran the next slot


def test_a_night_the_data_gate_stopped_is_not_retried(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "stopped", "--once", "--retries", "2", "--backoff", "0.1")
    _, err = scheduler.communicate(timeout=20)
    assert scheduler.returncode == 3 and len(_runs(project)) == 1, err
    assert "stopped by the data gate (rc 3): not retried" in err and "retry" not in err.replace("not retried", "")


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_second_trigger_while_a_run_holds_the_project_is_skipped_naming_the_holder_and_notified(stand_in):
    project, script = stand_in
    receiver = Receiver()
    (project / "conf" / "base").mkdir(parents=True)
    (project / "conf" / "nightly").mkdir()
    (project / "conf" / "nightly" / "parameters.yml").write_text(f"notify:\n  webhooks: [{receiver.url}]\n")
    first = _schedule(project, script, "hold", "--once")
    try:
        _wait_for(lambda: (_holder(project) or {}).get("pipeline") == "stand-in")  # the scheduler's, then the run's
        holder = _runs(project)[0]["pid"]
        second = _schedule(project, script, "hold", "--once", "--retries", "3", "--backoff", "0.1", "--env",
                           "nightly")
        _, err = second.communicate(timeout=60)
        assert second.returncode == 0, err  # a skip is no failure
        assert re.search(rf"INFO .*skipped: pid {holder} on .*pipeline stand-in, started .* holds the project", err)
        assert "started:" not in err and "retry" not in err and "could not notify" not in err
        assert len(_runs(project)) == 1  # the second trigger started no run
        ((_, body),) = receiver.wait_for(1, timeout=5)
        message = json.loads(body)
        assert (message["event"], message["project"], message["trigger"]) == ("skipped", "proj", "schedule")
        assert re.fullmatch(rf"pid {holder} on .*pipeline stand-in, started .* holds the project", message["reason"])
        (project.parent / "release").touch()
        assert first.wait(20) == 0
    finally:
        receiver.close()
        first.kill()
        first.communicate()


def _holder(project: Path) -> dict | None:
    try:
        return json.loads((project / "data" / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_two_schedulers_at_once_one_runs_the_other_skips_the_slot(stand_in):
    """The run takes the lock seconds after it starts (kedro run's start-up): the scheduler holds it meanwhile and
    hands it over, so the other scheduler skips the slot instead of starting a run that fails on the lock."""
    project, script = stand_in
    schedulers = [_schedule(project, script, "late_hold", "--once", "--retries", "2", "--backoff", "0.1")
                  for _ in range(2)]
    results = [(s.communicate(timeout=30), s.returncode) for s in schedulers]
    assert [rc for _, rc in results] == [0, 0], results
    logs = [err for (_, err), _ in results]
    ran = [err for err in logs if "finished: rc 0" in err]
    # The holder describes itself just after it takes the lock: a probe in between finds it undescribed.
    skipped = [err for err in logs if re.search(r"INFO .*skipped: (pid \d+ on .*pipeline train_deploy "
                                                r"\(train-deploy schedule\), started .*|a run that has not described "
                                                r"itself yet) holds the project", err)]
    assert len(ran) == 1 and len(skipped) == 1, logs
    assert "started:" not in skipped[0] and "retry" not in "".join(logs)
    assert len(_runs(project)) == 1 and _holder(project) is None  # one run; the lock given back, undescribed


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_run_past_max_hours_is_stopped_alerted_as_timed_out_and_the_next_slot_runs(stand_in):
    project, script = stand_in
    receiver = Receiver()
    (project / "conf" / "base").mkdir(parents=True)
    (project / "conf" / "nightly").mkdir()
    (project / "conf" / "nightly" / "parameters.yml").write_text(f"notify:\n  webhooks: [{receiver.url}]\n")
    scheduler = _schedule(project, script, "hang", "--cron", "* * * * * */4", "--max-hours", "0.0005", "--env",
                          "nightly", "--retries", "2", "--backoff", "0.1")  # 1.8 s a night, never retried
    try:
        _wait_for(lambda: len(_runs(project)) >= 2, seconds=30)
        ((_, body),) = receiver.wait_for(1, timeout=10)
        rc, err = _stop(scheduler)
    finally:
        receiver.close()
        scheduler.kill()
    assert rc == 0, err
    first = _runs(project)[0]["pid"]
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    assert ("ERROR train_deploy.run_control.schedule: timed out: the run took more than 0.0005 h (--max-hours); "
            "stopping it") in err
    assert re.search(r"INFO .*finished: killed by SIGTERM after \d+\.\d s \(timed out\)$", err, re.M)
    assert "retry" not in err
    message = json.loads(body)
    assert (message["event"], message["trigger"], message["node"], message["stage"]) == (
        "failed", "schedule", "train_model", "training")
    assert message["reason"] == ("timed out: the run took more than 0.0005 h (train-deploy schedule --max-hours) "
                                 "and was stopped")


def test_max_hours_must_be_positive(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "ok", "--once", "--max-hours", "0")
    _, err = scheduler.communicate(timeout=20)
    assert scheduler.returncode == 2 and "--max-hours 0.0: must be more than 0 hours" in err.splitlines()[-1]


def test_a_run_killed_by_a_signal_is_named_and_its_record_left_for_the_next_run(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "die", "--once")
    _, err = scheduler.communicate(timeout=30)
    assert scheduler.returncode == 128 + signal.SIGILL, err
    assert re.search(r"INFO .*finished: killed by SIGILL after \d+\.\d s$", err, re.M)
    [run] = _runs(project)
    left = _holder(project)  # the scheduler gave the lock back, leaving what the dead run was doing
    assert (left["pid"], left["node"], left["stage"]) == (run["pid"], "export_bundle", "export")
    lock = RunLock(project / "data")
    lock.acquire(RunConfig(), "next")
    try:
        assert lock.previous["pid"] == run["pid"] and lock.previous["node"] == "export_bundle"
    finally:
        lock.release()


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_held_run_lock_skips_a_slot_and_the_scheduler_keeps_going(stand_in):
    project, script = stand_in
    lock = RunLock(project / "data")
    lock.acquire(RunConfig(), "manual-run")
    scheduler = _schedule(project, script, "ok", "--cron", "* * * * * *")
    skipped = []
    try:
        while len(skipped) < 2:  # two slots, both skipped
            line = scheduler.stderr.readline()
            assert line, "the scheduler ended"
            skipped += [line] if "skipped:" in line else []
        assert _runs(project) == []
    finally:
        lock.release()
    _wait_for(lambda: len(_runs(project)) >= 1)
    rc, err = _stop(scheduler)
    assert rc == 0, err
    assert re.search(rf"skipped: pid {os.getpid()} on .*pipeline manual-run, started .* holds the project", skipped[0])


def test_sigterm_during_a_run_stops_its_process_group_and_exits_0(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "group", "--once", "--retries", "2", "--backoff", "0.1")
    pids_file = project.parent / "runs.jsonl.pids"
    _wait_for(pids_file.exists)
    pids = [int(pid) for pid in pids_file.read_text().split()]
    started = time.monotonic()
    rc, err = _stop(scheduler)
    assert rc == 0, err
    assert time.monotonic() - started < 10
    assert "SIGTERM received: stopping" in err and "retry" not in err
    _wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                              for pid in pids), seconds=5)


def test_sigterm_while_idle_exits_at_once(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "ok", "--cron", "0 3 1 1 *")
    _wait_for(lambda: scheduler.poll() is not None or _stderr_has(scheduler, "next slot at"), seconds=10)
    started = time.monotonic()
    rc, err = _stop(scheduler)
    assert rc == 0, err
    assert time.monotonic() - started < 2 and _runs(project) == []


def _stderr_has(process: subprocess.Popen, text: str) -> bool:
    """Reads the process's stderr up to the line holding ``text`` (blocks until a line comes)."""
    line = process.stderr.readline()
    return text in line


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_run_outlasting_several_slots_is_followed_by_one_late_run_not_a_backlog(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "long_first", "--cron", "* * * * * *")
    _wait_for(lambda: len(_runs(project)) >= 4)
    rc, err = _stop(scheduler)
    assert rc == 0, err
    slots = [(dt.datetime.fromisoformat(m[1]), bool(m[2]))
             for m in re.finditer(r"INFO .*: slot (\S+ \S+)( \(late)?", err)]
    first, late, following = slots[0], slots[1], slots[2]
    assert not first[1] and late[1] and not following[1]
    assert late[0] - first[0] >= dt.timedelta(seconds=3)  # the slot just before the long run ended
    assert following[0] > late[0]
    assert sum(is_late for _, is_late in slots) == 1  # missed slots in between never ran
    assert len(slots) == len({slot for slot, _ in slots}) == len(_runs(project))


def test_bad_cron_expression_is_refused_naming_it(stand_in):
    project, script = stand_in
    scheduler = _schedule(project, script, "ok", "--cron", "0 25 * * *")
    _, err = scheduler.communicate(timeout=20)
    assert scheduler.returncode == 2
    assert "--cron '0 25 * * *': not a cron expression" in err.splitlines()[-1]


@pytest.mark.slow
def test_scheduled_corpus_run_and_a_manual_run_are_tagged_with_their_trigger(project, tmp_path):
    params = ",".join(cli_params(tiny_runtime_params()))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    scheduled = subprocess.run([str(TRAIN_DEPLOY), "schedule", "--once", "--pipeline", "corpus", "--params", params],
                               cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert scheduled.returncode == 0, scheduled.stderr[-3000:]
    console = scheduled.stdout + scheduled.stderr  # a file, not a terminal: plain lines, none of the known noise
    assert "\x1b[" not in console and "\r" not in console and "Warning" not in console, console[-3000:]
    assert "INFO train_deploy.pipelines.corpus.nodes: Corpus: " in console
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])  # manual (reuses the tokens the scheduled run wrote)
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["train_deploy"], output_format="list", order_by=["start_time ASC"])
    assert [(r.info.status, r.data.tags.get("trigger")) for r in runs] == [("FINISHED", "schedule"),
                                                                            ("FINISHED", "manual")]


@pytest.mark.parametrize("when", [(), ("--once", "--cron", "0 3 * * *")])
def test_a_schedule_needs_exactly_one_of_cron_and_once(stand_in, when):
    project, script = stand_in
    scheduler = _schedule(project, script, "ok", *when)
    _, err = scheduler.communicate(timeout=20)
    assert (scheduler.returncode, err.splitlines()[-1]) == (2, "Error: give one of --cron or --once")
    assert _runs(project) == []
