"""Signals and process death with real processes: Paddle's import keeps the process's own handlers, a stage killed by
a signal says where and why and ends its MLflow run FAILED, and SIGTERM ends it KILLED in every stage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from kedro.framework.session import KedroSession
from mlflow import MlflowClient

from tests.helpers.project import cli_params, tiny_runtime_params, tiny_train_deploy_params
from train_deploy.run_control.lock import HOLDER_FILE
from train_deploy.run_control.signals import fatal_signal_in_log

KEDRO = Path(sys.executable).parent / "kedro"

# A process with its own SIGTERM handler (SystemExit, so exit handlers run) that imports Paddle (and PaddleNLP), then
# gets SIGTERM or dies of SIGSEGV. argv: keep | late | none, the log file, sigterm | segv, paddle | paddlenlp.
_AFTER_PADDLE = """
import atexit, ctypes, os, signal, sys
from pathlib import Path
mode, log, end = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
from train_deploy.run_control.signals import install_termination_handler, log_fatal_signals
log_fatal_signals(log)
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
atexit.register(lambda: print("exit handlers ran", flush=True))
if mode == "keep":
    install_termination_handler()
import paddle
if sys.argv[4] == "paddlenlp":  # it sets every handler Paddle set to the default action
    import paddlenlp
if mode == "late":  # called after Paddle was imported (a served model's process may import it first)
    install_termination_handler()
print("imported", flush=True)
if end == "segv":
    ctypes.string_at(0)
os.kill(os.getpid(), signal.SIGTERM)
"""


def _after_paddle(tmp_path: Path, mode: str, end: str, imports: str = "paddle") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _AFTER_PADDLE, mode, str(tmp_path / "run.log"), end, imports],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize(("mode", "imports"), [("keep", "paddle"), ("late", "paddle"), ("keep", "paddlenlp")])
@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_sigterm_after_paddle_is_imported_runs_the_process_handler_and_its_exit_handlers(tmp_path, mode, imports):
    done = _after_paddle(tmp_path, mode, "sigterm", imports)
    assert done.returncode == 143, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["imported", "exit handlers ran"]
    assert "FatalError" not in done.stderr


def test_without_it_paddle_takes_sigterm_and_skips_the_exit_handlers(tmp_path):
    done = _after_paddle(tmp_path, "none", "sigterm")  # what every stage did: issue 28 item 4
    assert done.returncode == -signal.SIGTERM
    assert "exit handlers ran" not in done.stdout
    assert "FatalError: `Termination signal` is detected" in done.stdout + done.stderr  # Paddle's C++ report


def test_a_segfault_after_paddle_is_imported_leaves_its_traceback_in_the_log(tmp_path):
    done = _after_paddle(tmp_path, "keep", "segv")
    assert done.returncode == -signal.SIGSEGV, done.stderr[-2000:]
    log = tmp_path / "run.log"
    text = log.read_text()
    assert "Fatal Python error: Segmentation fault" in text and 'File "<string>", line 18' in text
    assert fatal_signal_in_log(log, 0) == "SIGSEGV" and fatal_signal_in_log(log, len(text)) is None
    assert "FatalError" not in done.stdout + done.stderr  # Paddle's C++ report is not printed over it


# --- a stage killed by a signal: kedro run --------------------------------------------------------------------


def _kedro_run(project: Path, store: Path, pipeline: str, params: dict, output: Path) -> subprocess.Popen:
    with output.open("w") as console:  # a file: the run writes more than a pipe holds
        return subprocess.Popen([str(KEDRO), "run", "--pipelines", pipeline, "--params", ",".join(cli_params(params))],
                                cwd=project, env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}"},
                                stdout=console, stderr=subprocess.STDOUT)


def _wait_in_stage(project: Path, run: subprocess.Popen, output: Path, stage: str, node: str | None = None) -> dict:
    """The run's holder record once it is in ``stage`` (and ``node``)."""
    deadline = time.monotonic() + 600
    while True:
        try:
            about = json.loads((project / "data" / HOLDER_FILE).read_text())
        except (OSError, ValueError):
            about = {}
        if about.get("pid") == run.pid and about.get("stage") == stage and node in (None, about.get("node")):
            return about
        assert run.poll() is None, output.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not in stage {stage} after 600 s"
        time.sleep(0.02)


def _statuses(store: Path) -> list[tuple[str, dict]]:
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("train_deploy")
    return [(run.info.status, run.data.tags)
            for run in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])]


def _paddle_loaded(pid: int) -> bool:
    return "libpaddle" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGILL, signal.SIGKILL])
def test_a_stage_killed_by_a_signal_says_which_stage_and_signal_and_ends_its_run_failed(project, tmp_path, signum):
    store, output = tmp_path / "mlruns.db", tmp_path / "console.txt"
    run = _kedro_run(project, store, "corpus", tiny_runtime_params(), output)
    try:
        about = _wait_in_stage(project, run, output, "corpus", "prepare_tokenizer")  # ~10 s of SentencePiece
        run.send_signal(signum)  # an illegal instruction in a kernel / the out-of-memory killer
        assert run.wait(60) == -signum
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + 120  # the watch ends the MLflow run after it said what happened
    while _statuses(store)[0][0] == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    [(status, tags)] = _statuses(store)
    assert status == "FAILED" and tags["failure"] == f"{signum.name} in prepare_tokenizer"
    console = output.read_text()
    report = console[console.index("The run of corpus"):].splitlines()
    log = project / "logs" / "train_deploy.log"
    assert len(report) <= 4, report
    meaning = {signal.SIGILL: "an instruction this CPU does not have",
               signal.SIGKILL: "the out-of-memory killer (see `dmesg`) or `kill -9`"}[signum]
    assert report[0].endswith(f"The run of corpus (pid {run.pid}) died in node prepare_tokenizer (stage corpus): "
                              f"killed by {signum.name} ({meaning})")
    assert report[1] == f"  log: {log}"
    assert report[2].endswith(f"MLflow run {about['mlflow_run_id']} ended FAILED")
    if signum == signal.SIGILL:  # what only the log holds: the traceback at the crash
        assert "Fatal Python error: Illegal instruction" in log.read_text()


@pytest.mark.slow
def test_the_next_run_reports_a_run_that_died_with_its_watch_and_ends_its_run_failed(project, tmp_path, caplog):
    store, output = tmp_path / "mlruns.db", tmp_path / "console.txt"
    run = _kedro_run(project, store, "corpus", tiny_runtime_params(), output)
    try:
        about = _wait_in_stage(project, run, output, "corpus", "prepare_tokenizer")
        watch = [p for p in psutil.Process(run.pid).children() if "train_deploy.run_control.signals" in
                 " ".join(p.cmdline())]
        for process in (*watch, psutil.Process(run.pid)):  # the machine went down: nobody said anything
            process.kill()
        assert len(watch) == 1 and run.wait(60) == -signal.SIGKILL
    finally:
        run.kill()
        run.wait()
    assert [status for status, _ in _statuses(store)] == ["RUNNING"]
    with caplog.at_level("WARNING"), KedroSession.create(project_path=project,
                                                         runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])
    assert [status for status, _ in _statuses(store)] == ["FAILED", "FINISHED"]
    assert (f"The previous run (pid {run.pid}, pipeline corpus, started {about['started_at']}, in node "
            f"prepare_tokenizer) ended without giving the lock back: MLflow run {about['mlflow_run_id']} ended "
            "FAILED") in caplog.text


# --- SIGTERM in the stages after Paddle is imported -----------------------------------------------------------


@pytest.mark.slow
def test_sigterm_in_the_averaging_export_and_registry_stages_ends_the_run_killed(project, tmp_path):
    """The run is frozen (SIGSTOP) as the stage starts, with Paddle imported by an earlier stage of the run, and gets
    SIGTERM: before the project's handlers were kept over Paddle's, each of these runs stayed RUNNING. Each run
    starts where the one before was stopped."""
    store = tmp_path / "mlruns.db"
    params = tiny_train_deploy_params(1)
    for number, (pipeline, stage) in enumerate([("train_deploy", "averaging"), ("averaging,export", "export"),
                                                ("export,registry", "registry")], start=1):
        output = tmp_path / f"console{number}.txt"
        run = _kedro_run(project, store, pipeline, params, output)
        try:
            _wait_in_stage(project, run, output, stage)
            run.send_signal(signal.SIGSTOP)
            assert _paddle_loaded(run.pid)  # by the corpus stage (the tokenizer), averaging, export
            run.send_signal(signal.SIGTERM)
            run.send_signal(signal.SIGCONT)
            assert run.wait(120) == 143, output.read_text()[-3000:]
        finally:
            run.kill()
            run.wait()
        statuses = [status for status, _ in _statuses(store)]
        assert statuses == ["KILLED"] * number, (stage, statuses)
        assert "FatalError" not in output.read_text()
