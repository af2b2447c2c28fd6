"""Stopping a process tree: SIGTERM to a process and its descendants, SIGKILL to those left after a grace period.

The one helper for the job: ``train-deploy schedule`` stops a run with it, the training node its launcher and
workers (``training/launch.py``), the corpus stage its encoding helpers, and the serving check its server.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Iterable

import psutil

logger = logging.getLogger(__name__)


def stop_process_tree(process: int | subprocess.Popen, grace: float, *, known: Iterable = ()) -> list[int]:
    """Stop ``process`` and its descendants: SIGTERM (and SIGCONT, so that a stopped process acts on it) to each,
    SIGKILL to those still running ``grace`` seconds later. ``known``: processes found earlier (psutil) that may
    have left the tree since (a worker whose launcher died). Returns the pids that survived SIGKILL."""
    popen = process if isinstance(process, subprocess.Popen) else None
    pid = popen.pid if popen is not None else int(process)
    tree = {p.pid: p for p in known}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        tree.update({p.pid: p for p in (root, *root.children(recursive=True))})
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        alive = _alive(tree.values(), popen)
        if not alive:
            return []
        logger.info("Stopping process %d: %s to %d process(es)", pid, signal.Signals(signum).name, len(alive))
        for member in alive:
            with contextlib.suppress(psutil.Error):
                member.send_signal(signum)
                member.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + wait
        while _alive(alive, popen) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = [p.pid for p in _alive(tree.values(), popen)]
    if left:
        logger.warning("Processes %s survived SIGKILL", left)
    return left


def _alive(processes: Iterable, popen: subprocess.Popen | None) -> list:
    if popen is not None:
        popen.poll()  # reap it: a zombie child is not running
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive
