"""Stopping a process tree (SIGTERM to a process and its descendants, SIGKILL to those left after a grace period),
and ending this process quickly (:func:`exit_now`).

:func:`stop_process_tree` is the one helper for stopping: ``train-deploy schedule`` stops a run with it, the
training node its launcher and workers (``training/launch.py``), the corpus stage its encoding helpers, and the
serving check its server.

:func:`exit_now` is how a process that imported Paddle ends on its own (the training worker, the project's
``run``): Python's normal exit after ``import paddle``/``paddlenlp`` spends seconds in the interpreter's teardown
(freeing every module and object, destroying Paddle's C++ singletons) after the exit handlers have run. Nothing
the project relies on happens there, so the helper runs what does matter (``atexit`` handlers, logging's flush and
close, the std streams' flush) and then leaves with ``os._exit``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import NoReturn

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


def exit_now(code: int) -> NoReturn:
    """End this process with exit status ``code``, skipping the interpreter's teardown.

    Runs what a normal exit runs before the teardown, in the same order: ``threading._shutdown()`` (waits for the
    non-daemon threads, then runs ``concurrent.futures``' exit hooks), the ``atexit`` handlers (the run lock's
    release, MLflow ending its active runs, the signal watch's ``ended()``, logging's own shutdown),
    ``logging.shutdown()`` (again, for handlers added by an exit handler) and a flush of ``sys.stdout`` and
    ``sys.stderr``; then ``os._exit(code)``, which leaves out only the teardown of modules and objects: seconds after
    ``import paddlenlp`` (measured: 7-12 s against 1-2 s at load).
    Call it only at the very end of a process's own entry point, never from code a test may call in-process."""
    try:
        threading._shutdown()  # noqa: SLF001 -- what Py_FinalizeEx calls first
        atexit._run_exitfuncs()  # noqa: SLF001 -- the handlers a normal exit runs, in the same (LIFO) order
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    finally:
        os._exit(code)
