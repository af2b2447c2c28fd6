"""tools/process_group.py and `make ui`: a plain kill stops the whole process group, nothing is left running."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WRAPPER = [sys.executable, str(REPO / "tools" / "process_group.py")]


def group_of(pgid: int) -> set[int]:
    """The processes of a process group (from /proc)."""
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp
            members.add(int(stat.parent.name))
    return members


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies excluded)."""
    left = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                left.add(pid)
        except OSError:
            pass
    return left


def child_of(pid: int, timeout: float = 30.0) -> int:
    """The first child process of ``pid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no child in {timeout} s")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_plain_kill_of_the_wrapper_stops_its_whole_group_even_a_process_that_ignores_sigterm():
    tree = "sleep 300 & sh -c 'trap \"\" TERM; sleep 300; sleep 300' & wait"
    wrapper = subprocess.Popen([*WRAPPER, "--grace", "2", "--", "sh", "-c", tree])
    try:
        leader = child_of(wrapper.pid)
        wait_for(lambda: len(group_of(leader)) >= 4, 30, "the tree did not start")  # sh, sleep, sh, its sleep
        members = group_of(leader)
        assert wrapper.pid not in members  # the command's group is its own
        os.kill(wrapper.pid, signal.SIGTERM)
        assert wrapper.wait(timeout=30) == 128 + signal.SIGTERM
        wait_for(lambda: not alive(members), 10, f"left running: {alive(members)}")
    finally:
        wrapper.kill()


def test_the_wrapper_exits_with_the_commands_code_and_stops_what_it_left_behind():
    done = subprocess.run([*WRAPPER, "--grace", "2", "--", "sh", "-c", "sleep 300 & echo $!; exit 3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    orphan = int(done.stdout.split()[0])
    wait_for(lambda: not alive({orphan}), 5, "the command's background process was left running")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_plain_kill_of_make_ui_leaves_no_process_of_the_ui(project, tmp_path):
    (project / "tools").mkdir()
    shutil.copy(REPO / "tools" / "process_group.py", project / "tools")
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    # -o: the venv is taken as built (make would otherwise compare it with files this folder does not have)
    make = subprocess.Popen(["make", "--no-print-directory", "-f", str(REPO / "Makefile"),
                             "-o", f"{REPO}/.venv/.installed", f"VENV={REPO}/.venv", "ui", f"PORT={port}"],
                            cwd=project, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wrapper = child_of(make.pid)
        leader = child_of(wrapper)

        def answers() -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                return False

        wait_for(answers, 180, "the MLflow UI did not answer")
        members = group_of(leader)
        assert len(members) >= 3  # kedro, mlflow ui, its server (and workers)
        os.kill(make.pid, signal.SIGTERM)  # a plain kill of make ui
        make.wait(timeout=60)
        wait_for(lambda: not alive(members), 30, f"left running: {alive(members)}")
        assert not answers()
    finally:
        for pgid in {make.pid, *(group_of(leader) and [leader] if "leader" in locals() else [])}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
