"""One pipeline run at a time per project: an OS lock on the project's data folder.

Two runs of one project would share node outputs, the checkpoint folder (each pruning the other's resume
point), the launcher's log folder and the local MLflow store. The lock is ``fcntl.flock`` on
``data/.train_deploy.lock`` (through ``filelock``): the kernel releases it when its holder exits or is
killed, so no stale lock outlives a crash. The holder describes itself (pid, host, pipeline, start time)
in ``data/.train_deploy.lock.json`` so that a second run can say who holds it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from train_deploy.config import check, from_mapping

logger = logging.getLogger(__name__)

LOCK_FILE, HOLDER_FILE = ".train_deploy.lock", ".train_deploy.lock.json"


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """The ``run`` parameter block: how runs of one project share it."""

    lock: Literal["fail", "wait"] = "fail"
    """A second run while one holds the project: stop at once naming the holder, or wait until it ends."""
    wait_timeout: float | None = None
    """With ``lock: wait``: give up after this many seconds (null waits as long as it takes)."""

    def __post_init__(self) -> None:
        check(self.wait_timeout is None or self.wait_timeout > 0, "run.wait_timeout",
              f"must be a positive number of seconds or null, got {self.wait_timeout}")

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RunConfig:
        return from_mapping(cls, params, "run")


class RunLockHeld(RuntimeError):
    """Another run holds the project; the message names it."""


class RunLock:
    """The run lock of the project whose data folder is ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path, self.holder_path = self.folder / LOCK_FILE, self.folder / HOLDER_FILE
        self._lock = None

    def acquire(self, config: RunConfig, pipeline: str) -> None:
        """Take the lock for a run of ``pipeline``, or raise :class:`RunLockHeld` naming the holder."""
        from filelock import FileLock, Timeout

        self.folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if config.lock == "fail":
                raise RunLockHeld(f"{self.path}: another run of this project is running ({self.holder()}); "
                                  "wait for it, or set run.lock: wait to queue behind it") from None
            logger.info("Waiting for the run that holds %s (%s)", self.path, self.holder())
            try:
                lock.acquire(timeout=-1 if config.wait_timeout is None else config.wait_timeout, poll_interval=0.5)
            except Timeout:
                raise RunLockHeld(f"{self.path}: still held after run.wait_timeout = {config.wait_timeout} s "
                                  f"({self.holder()})") from None
        self._lock = lock
        self._describe(pipeline)

    def release(self) -> None:
        """Give the lock back (the holder's description first, so nobody reads a stale one as current)."""
        if self._lock is None:
            return
        self.holder_path.unlink(missing_ok=True)
        self._lock.release()
        self._lock = None

    def holder(self) -> str:
        """Who holds the lock, as the holder described itself."""
        try:
            about = json.loads(self.holder_path.read_text(encoding="utf-8"))
            return (f"pid {about['pid']} on {about['host']}, pipeline {about['pipeline']}, "
                    f"started {about['started_at']}")
        except (OSError, ValueError, KeyError, TypeError):
            return "a run that has not described itself yet"

    def held_by(self) -> str | None:
        """Who holds the lock now (:meth:`holder`), or None when it is free; checked without keeping it."""
        from filelock import FileLock, Timeout

        self.folder.mkdir(parents=True, exist_ok=True)
        probe = FileLock(self.path)
        try:
            probe.acquire(timeout=0)
        except Timeout:
            return self.holder()
        probe.release()
        return None

    def _describe(self, pipeline: str) -> None:
        about = {"pid": os.getpid(), "host": socket.gethostname(), "pipeline": pipeline,
                 "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        tmp = self.holder_path.with_name(f"{HOLDER_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(about), encoding="utf-8")
        os.replace(tmp, self.holder_path)
