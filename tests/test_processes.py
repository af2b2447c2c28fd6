"""Stopping a process tree and ending a process with exit_now, with real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil

from train_deploy.run_control.processes import stop_process_tree


def test_stop_process_tree_kills_what_ignores_sigterm_after_the_grace(tmp_path):
    tree = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(60)"], stdout=sys.stdout)
time.sleep(60)
"""
    root = subprocess.Popen([sys.executable, "-c", tree], stdout=subprocess.PIPE, text=True)
    assert root.stdout.readline().strip() == "ready"
    [child] = psutil.Process(root.pid).children()
    started = time.monotonic()
    assert stop_process_tree(root, grace=1.0) == []
    assert 1.0 <= time.monotonic() - started < 8
    assert root.returncode == -signal.SIGTERM
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE  # killed: its parent is gone


def test_exit_now_runs_what_a_normal_exit_runs_and_keeps_the_code(tmp_path):
    child = textwrap.dedent(f"""
        import atexit, logging, logging.handlers, sys, threading, time
        from pathlib import Path
        from train_deploy.run_control.processes import exit_now
        folder = Path({str(tmp_path)!r})
        target = logging.FileHandler(folder / "run.log")
        logging.getLogger().addHandler(logging.handlers.MemoryHandler(1000, target=target))  # written on close only
        logging.getLogger().warning("last line")
        atexit.register(lambda: (folder / "atexit").write_text("ran"))
        threading.Thread(target=lambda: (time.sleep(0.3), (folder / "thread").write_text("done"))).start()
        sys.stdout.write("unflushed")
        exit_now(5)
    """)
    ended = subprocess.run([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, timeout=60)
    assert ended.returncode == 5
    assert ended.stdout == "unflushed"
    assert (tmp_path / "run.log").read_text() == "last line\n"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"  # non-daemon threads finish first, as at a normal exit
