"""Stopping a process tree, with real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from train_deploy.processes import stop_process_tree


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
