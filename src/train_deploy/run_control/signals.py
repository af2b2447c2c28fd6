"""Signals and process death: a run stopped by SIGTERM ends as its own hooks say, and a run killed outright says so.

- :func:`install_termination_handler`: ``import paddle`` installs glog's failure handler on SIGTERM and the fatal
  signals (SIGSEGV, SIGILL, SIGFPE, SIGABRT, SIGBUS): it prints a C++ report and dies again by the signal, with
  no ``finally`` and no exit handler, so a run stopped by SIGTERM stayed ``RUNNING`` in MLflow and a served
  model lost its server's graceful stop; ``import paddlenlp`` then sets them all to the default action. After
  this call, the handlers the process had before either import are put back as soon as it ends (or at once,
  when Paddle is imported already).
- :func:`log_fatal_signals`: Python's ``faulthandler`` writes the traceback of a fatal signal into the log file.
- :class:`RunWatch`: a small process beside a Kedro run. When the run's process dies without ending its run (a
  fatal signal, or SIGKILL from the out-of-memory killer), it says on the run's console which stage, which
  signal and where the log is, and ends the MLflow run ``FAILED``: what the dead process cannot do itself.
  The stage is the one the run lock's holder record names (``train_deploy.run_control.lock``); the signal is the one
  ``faulthandler`` wrote into the log, else SIGKILL, the one signal no handler sees.

Stopping a process tree (SIGTERM, grace, SIGKILL) is ``train_deploy.run_control.processes``: this module is part of the
served model's package, which imports no psutil.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import importlib.abc
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger("train_deploy.run_control.signals")  # also when run as __main__ (the watch)

NOTIFY_VARIABLE = "TRAIN_DEPLOY_NOTIFY"
"""The watch process's copy of the run's ``notify`` block (JSON)."""
DEADLINE_VARIABLE = "TRAIN_DEPLOY_DEADLINE"
"""The time (Unix seconds) after which ``train-deploy schedule`` stops a run and reports it timed out itself."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

PADDLE_SIGNALS = tuple(getattr(signal, name) for name in ("SIGSEGV", "SIGILL", "SIGFPE", "SIGABRT", "SIGBUS",
                                                          "SIGTERM") if hasattr(signal, name))
"""The signals whose handlers ``import paddle`` replaces (glog's ``InstallFailureSignalHandler``)."""
PACKAGES_THAT_SET_HANDLERS = ("paddle", "paddlenlp")
"""Packages whose import changes the handlers of :data:`PADDLE_SIGNALS`: Paddle installs glog's, PaddleNLP calls
``paddle.disable_signal_handler()``, which sets all of them to the default action (faulthandler's and the
process's SIGTERM handler included)."""

# faulthandler's first line for each fatal signal (CPython's Modules/faulthandler.c)
FATAL_HEADERS = {"Segmentation fault": "SIGSEGV", "Illegal instruction": "SIGILL", "Bus error": "SIGBUS",
                 "Floating point exception": "SIGFPE", "Aborted": "SIGABRT"}
MEANINGS = {
    "SIGILL": "an instruction this CPU does not have",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code, or a file mapped in memory that shrank",
    "SIGFPE": "an arithmetic fault in native code",
    "SIGABRT": "native code aborted",
    "SIGKILL": "the out-of-memory killer (see `dmesg`) or `kill -9`",
}
"""What each signal usually means, for the one line that reports it."""

_SIGACTION_BYTES = 512  # more than any libc's struct sigaction: saved and put back whole, never read
_fault_log: IO[str] | None = None


# --- keeping the process's own handlers when Paddle is imported -------------------------------------------


def install_termination_handler() -> None:
    """Keep this process's handlers of :data:`PADDLE_SIGNALS` over those of Paddle and PaddleNLP (idempotent).

    Call it before Paddle may be imported, in every process that imports it (the Kedro run, the served model):
    it puts the handlers in place before each import of :data:`PACKAGES_THAT_SET_HANDLERS` back when the import
    ends, whatever thread imports it. Called after Paddle was imported,
    it resets Paddle's handlers and sets the Python ones again (from the main thread only)."""
    if not _has_sigaction():
        return
    if "paddle" in sys.modules:
        _reset_paddle_handlers()
    if not any(isinstance(finder, _KeepHandlersOverPaddle) for finder in sys.meta_path):
        sys.meta_path.insert(0, _KeepHandlersOverPaddle())


class _KeepHandlersOverPaddle(importlib.abc.MetaPathFinder):
    """Finds :data:`PACKAGES_THAT_SET_HANDLERS` with the other finders and wraps their loading: the signal handlers
    in place before it are put back after it, whether it succeeded or not."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PACKAGES_THAT_SET_HANDLERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            load = spec.loader.exec_module

            def exec_module(module) -> None:
                saved = _current_handlers()
                try:
                    load(module)
                finally:
                    _put_back(saved)
                    logger.debug("Signal handlers kept over %s's", fullname)

            spec.loader.exec_module = exec_module  # this spec's own loader object (one per spec)
        return spec


def _has_sigaction() -> bool:
    return os.name == "posix"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _current_handlers() -> dict[int, ctypes.Array]:
    libc, saved = _libc(), {}
    for signum in PADDLE_SIGNALS:
        action = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(int(signum), None, action) == 0:
            saved[int(signum)] = action
    return saved


def _put_back(saved: dict[int, ctypes.Array]) -> None:
    libc = _libc()
    for signum, action in saved.items():
        libc.sigaction(signum, action, None)


def _reset_paddle_handlers() -> None:
    """Paddle is imported already: its handlers go (default actions), then the Python handlers and faulthandler,
    which Python still believes installed, are installed again (Python sets handlers from the main thread only:
    from another one, Paddle's stay)."""
    if threading.current_thread() is not threading.main_thread():
        logger.debug("Paddle's signal handlers stay: not the main thread")
        return
    import paddle

    paddle.disable_signal_handler()
    for signum in PADDLE_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler) or handler == signal.SIG_IGN:
            signal.signal(signum, handler)
    if _fault_log is not None and faulthandler.is_enabled():
        faulthandler.disable()
        faulthandler.enable(_fault_log, all_threads=True)


# --- which stop signal arrived ------------------------------------------------------------------------------


class StopSignals:
    """Records which stop signal (:data:`STOP_SIGNALS`) arrived, in front of the handlers in place, which still
    run (``SystemExit`` for SIGTERM, ``KeyboardInterrupt`` for Ctrl-C): a run's end names a signal only when one
    came. A signal whose action is the default one (no handler) ends the process before anything could say so."""

    def __init__(self) -> None:
        self.received: str | None = None
        """The name of the stop signal that arrived (the first), or None."""
        self._wrapped: dict[int, tuple[Any, Any]] = {}

    def watch(self) -> StopSignals:
        """Put the recorder in front of the current handlers (from the main thread only: elsewhere Python sets no
        handler, and none is recorded)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in STOP_SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler) and signum not in self._wrapped:
                recorder = functools.partial(self._record, handler)
                signal.signal(signum, recorder)
                self._wrapped[signum] = (handler, recorder)
        return self

    def _record(self, handler: Any, signum: int, frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name
        handler(signum, frame)

    def restore(self) -> None:
        """Put back the handlers found by :meth:`watch` where the recorder is still in place."""
        for signum, (handler, recorder) in list(self._wrapped.items()):
            if threading.current_thread() is threading.main_thread() and signal.getsignal(signum) is recorder:
                signal.signal(signum, handler)
            del self._wrapped[signum]


def describe_stop(name: str) -> str:
    """``stopped by SIGTERM`` / ``stopped by SIGINT (Ctrl-C)``."""
    return f"stopped by {name}" + (" (Ctrl-C)" if name == "SIGINT" else "")


def past_schedule_deadline() -> bool:
    """Whether ``train-deploy schedule`` gave this run a wall-clock limit (:data:`DEADLINE_VARIABLE`) and it has
    passed: a stop now is the scheduler's, which reports the night as timed out itself."""
    try:
        return time.time() >= float(os.environ[DEADLINE_VARIABLE])
    except (KeyError, ValueError):
        return False


# --- what a fatal signal leaves in the log ----------------------------------------------------------------


def log_fatal_signals(log: Path) -> None:
    """Python's ``faulthandler`` writes a fatal signal's name and every thread's traceback into ``log`` (appended;
    called again after the log was rotated, it follows the new file)."""
    global _fault_log
    log = Path(log)
    if _fault_log is not None and not _fault_log.closed and _same_file(_fault_log, log):
        return
    previous, _fault_log = _fault_log, open(log, "a", encoding="utf-8")  # noqa: SIM115 (kept open: faulthandler)
    faulthandler.enable(_fault_log, all_threads=True)
    if previous is not None:
        previous.close()


def _same_file(stream: IO[str], path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(stream.fileno()), path.stat())
    except OSError:
        return False


def fatal_signal_in_log(log: Path | None, offset: int) -> str | None:
    """The fatal signal ``faulthandler`` reported in ``log`` after byte ``offset`` (the whole file if it is now
    shorter: rotated), or None."""
    if log is None or not log.is_file():
        return None
    with log.open("rb") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(offset if offset <= size else 0)
        text = file.read().decode("utf-8", errors="replace")
    found = re.findall(r"^Fatal Python error: (" + "|".join(FATAL_HEADERS) + r")$", text, re.M)
    return FATAL_HEADERS[found[-1]] if found else None


def describe_signal(name: str) -> str:
    """``SIGILL (an instruction this CPU does not have)``."""
    return f"{name} ({MEANINGS[name]})" if name in MEANINGS else name


# --- the watch beside a run -------------------------------------------------------------------------------


class RunWatch:
    """A process beside this one that reports this process's death, if it dies before :meth:`ended`.

    Started once the run holds the lock and has its MLflow run: it waits on a pipe from this process, in a
    session of its own, ignoring SIGTERM, SIGINT and SIGHUP (a stopped run ends its MLflow run itself). The pipe
    closing without ``ended`` means this process died: the watch reads the holder record ``holder`` (the stage
    and MLflow run) and the fatal signal ``faulthandler`` wrote into ``log``, says so in three lines on the
    console and in the log, and ends the MLflow run ``FAILED`` (through ``tracking_uri``, in its environment)."""

    def __init__(self, holder: Path, log: Path | None, tracking_uri: str | None,
                 notify: dict[str, Any] | None = None) -> None:
        offset = log.stat().st_size if log is not None and log.is_file() else 0
        env = {**os.environ, **({"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else {})}
        if notify:  # the run's ``notify`` block: the watch sends the ``failed`` alert of a death
            env[NOTIFY_VARIABLE] = json.dumps(notify)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "train_deploy.run_control.signals", "watch", str(holder), str(log or ""),
             str(offset),
             str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True)

    def ended(self) -> None:
        """This process ends its run itself: the watch exits without a word (idempotent)."""
        if self._process.stdin.closed:
            return
        with contextlib.suppress(OSError):
            self._process.stdin.write(b"ended\n")
            self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(5)


def _watch(holder: Path, log: Path | None, offset: int, parent: int) -> int:
    """The watch's main: wait for ``ended`` or the parent's death; report a death."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    received = b""
    while os.getppid() == parent:  # also a parent whose pipe a forked child of its keeps open
        if select.select([sys.stdin.buffer], [], [], 0.5)[0]:
            chunk = os.read(sys.stdin.fileno(), 64)
            received += chunk
            if b"ended" in received:
                return 0
            if not chunk:
                break
    _report_death(holder, log, offset, parent)
    return 0


def _report_death(holder: Path, log: Path | None, offset: int, pid: int) -> None:
    """Say which stage died of which signal and where the log is; end the MLflow run ``FAILED``; send the
    ``failed`` alert when the run has ``notify`` receivers."""
    try:
        record = json.loads(holder.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = {}
    if record.get("pid") != pid:  # the run released the lock (it ended), or another holds it since
        return
    name = fatal_signal_in_log(log, offset) or "SIGKILL"
    where = f"node {record['node']}" if record.get("node") else "before its first node"
    stage = f" (stage {record['stage']})" if record.get("stage") else ""
    logger.error("The run of %s (pid %d) died in %s%s: killed by %s\n  log: %s", record.get("pipeline"), pid,
                 where, stage, describe_signal(name), log if log is not None else "none (not opened yet)")
    if record.get("mlflow_run_id"):  # after the console line: MLflow takes seconds to import
        logger.error("%s", end_run_failed(record["mlflow_run_id"], f"{name} in {record.get('node') or 'the run'}"))
    if os.environ.get(NOTIFY_VARIABLE) and not past_schedule_deadline():  # else the scheduler says it timed out
        from train_deploy.run_control.notify import NotifyConfig, notify

        notify(NotifyConfig.from_params(json.loads(os.environ[NOTIFY_VARIABLE])), "failed", holder.parent.parent,
               node=record.get("node"), stage=record.get("stage"), reason=f"killed by {describe_signal(name)}",
               log=str(log) if log is not None else None, pipeline=record.get("pipeline"))


def end_run_failed(run_id: str, cause: str) -> str:
    """End the MLflow run ``run_id`` ``FAILED`` tagged with ``cause``; what happened, in a few words."""
    try:
        from mlflow import MlflowClient

        client = MlflowClient()
        status = client.get_run(run_id).info.status
        if status != "RUNNING":
            return f"MLflow run {run_id} had ended {status}"
        client.set_tag(run_id, "failure", cause)
        client.set_terminated(run_id, "FAILED")
        return f"MLflow run {run_id} ended FAILED"
    except Exception as exc:  # the tracking server may be gone too: say so, in one line
        return f"MLflow run {run_id} could not be ended FAILED: {str(exc).strip().splitlines()[0][:200]}"


def _watch_main(argv: list[str]) -> int:
    from train_deploy.console import PLAIN_FORMAT
    from train_deploy.redaction import redact_logging

    holder, log, offset, parent = Path(argv[0]), Path(argv[1]) if argv[1] else None, int(argv[2]), int(argv[3])
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log is not None:
        handlers.append(logging.FileHandler(log, encoding="utf-8", delay=True))
    logging.basicConfig(level=logging.WARNING, format=PLAIN_FORMAT, handlers=handlers)  # no MLflow chatter
    redact_logging()
    return _watch(holder, log, offset, parent)


if __name__ == "__main__" and sys.argv[1:2] == ["watch"]:
    sys.exit(_watch_main(sys.argv[2:]))
