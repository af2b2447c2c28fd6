"""One pipeline run at a time per project: an OS lock on the project's data folder.

Two runs of one project would share node outputs, the checkpoint folder (each pruning the other's resume
point), the launcher's log folder and the local MLflow store. The lock is ``fcntl.flock`` on
``data/.train_deploy.lock``: the kernel releases it when its holder exits or is
killed, so no stale lock outlives a crash. The holder describes itself (pid, host, pipeline, start time, and
as the run goes on its MLflow run and the node it is in) in ``data/.train_deploy.lock.json``, so that a second
run can say who holds it, and so that what a killed run was doing is known after it
(``train_deploy.run_control.signals``): a description left behind is a run that died holding the lock.

A parent can take the lock and hand it to a child (``train-deploy schedule``: no other run can start between
the scheduler's check and its ``kedro run``): :meth:`RunLock.hand_over` gives the open lock file and the
environment variable :data:`HANDED_FD_VARIABLE` that names it; the child's :meth:`RunLock.acquire` adopts it.

A description names its process by :func:`holder_identity`: the pid, and what tells pid namespaces apart (the
namespace's inode and the boot id). Containers that share a data folder and a host name (``--network host``,
``hostNetwork`` pods) each count pids from 1, so a pid alone would take a dead run of another container for this
process (:func:`is_this_process`) and never report it; the alias lock of ``train_deploy.registry.aliases`` judges
its holders the same way (:func:`process_gone`).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from train_deploy.atomic import write_json
from train_deploy.config import block, from_mapping, setting

logger = logging.getLogger(__name__)

LOCK_FILE, HOLDER_FILE = ".train_deploy.lock", ".train_deploy.lock.json"
HANDED_FD_VARIABLE = "TRAIN_DEPLOY_RUN_LOCK_FD"
"""Set by a parent that holds the lock for its child: the number of the child's inherited lock file descriptor."""


@block
class RunConfig:
    """The ``run`` parameter block: how runs of one project share it."""

    lock: Literal["fail", "wait"] = "fail"
    """A second run while one holds the project: stop at once naming the holder, or wait until it ends."""
    wait_timeout: Annotated[float, Field(gt=0)] | None = setting(None, unit="seconds or null")
    """With ``lock: wait``: give up after this many seconds (null waits as long as it takes)."""

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RunConfig:
        return from_mapping(cls, params, "run")


class RunLockHeld(RuntimeError):
    """Another run holds the project; the message names it (``holder``: as :meth:`RunLock.holder` says)."""

    def __init__(self, message: str, holder: str = "") -> None:
        super().__init__(message)
        self.holder = holder


class RunLock:
    """The run lock of the project whose data folder is ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path, self.holder_path = self.folder / LOCK_FILE, self.folder / HOLDER_FILE
        self.previous: dict[str, Any] | None = None
        """What a run that died holding the lock had recorded (found by :meth:`acquire`), or None."""
        self._fd: int | None = None
        self._handed = False  # the lock was adopted from a parent, which holds it too
        self._about: dict[str, Any] = {}

    def acquire(self, config: RunConfig, pipeline: str) -> None:
        """Take the lock for a run of ``pipeline`` (or adopt the one a parent handed over), or raise
        :class:`RunLockHeld` naming the holder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = self._adopt()
        self._handed = fd is not None
        if fd is None:
            fd = self._take(config)
        self._fd = fd
        found = self.about()
        if self._handed:
            found = (found or {}).get("previous")
        self.previous = ({k: v for k, v in found.items() if k != "previous"}
                         if found and not is_this_process(found) else None)
        self._about = {**holder_identity(), "pipeline": pipeline,
                       "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        self.record()

    def _take(self, config: RunConfig) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if _try_lock(fd):
                return fd
            if config.lock == "fail":
                holder = self.holder()
                raise RunLockHeld(f"{self.path}: another run of this project is running ({holder}); "
                                  "wait for it, or set run.lock: wait to queue behind it", holder)
            logger.info("Waiting for the run that holds %s (%s)", self.path, self.holder())
            deadline = None if config.wait_timeout is None else time.monotonic() + config.wait_timeout
            while not _try_lock(fd):
                if deadline is not None and time.monotonic() >= deadline:
                    raise RunLockHeld(f"{self.path}: still held after run.wait_timeout = {config.wait_timeout} s "
                                      f"({self.holder()})")
                time.sleep(0.5)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _adopt(self) -> int | None:
        """The lock file a parent handed over (:meth:`hand_over`), if it is this lock's; the variable is taken
        out of the environment, so that no process this one starts believes it holds the lock."""
        named = os.environ.pop(HANDED_FD_VARIABLE, None)
        if not named or not named.isdigit():
            return None
        fd = int(named)
        try:
            if os.path.samestat(os.fstat(fd), self.path.stat()) and _try_lock(fd):
                return fd
        except OSError:
            pass
        logger.warning("%s=%s is not this project's run lock (%s): taking the lock as usual", HANDED_FD_VARIABLE,
                       named, self.path)
        return None

    def hand_over(self) -> tuple[int, dict[str, str]]:
        """For a child that runs under this lock: the descriptor to pass it (``pass_fds``) and the environment
        variable that names it. The child's description replaces this one while it runs."""
        assert self._fd is not None, "hand_over() of a lock not held"
        return self._fd, {HANDED_FD_VARIABLE: str(self._fd)}

    def record(self, **fields: Any) -> None:
        """Add ``fields`` (the MLflow run, the node being run, …) to the holder's description."""
        self._about.update(fields)
        if self.previous and not self._handed:
            self._about.setdefault("previous", self.previous)  # for a child this lock may be handed to
        write_json(self.holder_path, self._about)

    def reclaim(self, died: bool) -> dict[str, Any] | None:
        """After the child this lock was handed to ended (``died``: killed by a signal): the description it left
        if it died holding the lock, kept as ``previous``; this holder's description is written again."""
        left = self.about() if died else None
        dead = {k: v for k, v in left.items() if k != "previous"} if left and not is_this_process(left) else None
        if dead:
            self.previous = dead
            self._about["previous"] = dead
        self.record()
        return dead

    def release(self, leave: dict[str, Any] | None = None) -> None:
        """Give the lock back (the holder's description first, so nobody reads a stale one as current; ``leave``:
        the description of a run that died under this lock, left for the next run to report). A lock adopted from
        a parent stays held by the parent."""
        if self._fd is None:
            return
        if leave:
            write_json(self.holder_path, leave)
        else:
            self.holder_path.unlink(missing_ok=True)
        if not self._handed:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def about(self) -> dict[str, Any] | None:
        """The holder's description (None when there is none, or it cannot be read)."""
        try:
            about = json.loads(self.holder_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return about if isinstance(about, dict) else None

    def holder(self) -> str:
        """Who holds the lock, as the holder described itself."""
        about = self.about()
        try:
            return (f"pid {about['pid']} on {about['host']}, pipeline {about['pipeline']}, "
                    f"started {about['started_at']}" + (f", in node {about['node']}" if about.get("node") else ""))
        except (KeyError, TypeError):
            return "a run that has not described itself yet"

    def held_by(self) -> str | None:
        """Who holds the lock now (:meth:`holder`), or None when it is free; checked without keeping it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            return None if _try_lock(fd) else self.holder()
        finally:
            os.close(fd)  # closing the only descriptor of a lock taken here releases it


def holder_identity() -> dict[str, Any]:
    """This process as a lock's holder records it: pid and host name, and the pid namespace's inode
    (``pid:[4026531836]``) and the boot id that say where the pid means something (empty when unreadable)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "pid_ns": _proc_text("ns/pid"),
            "boot": _proc_text("sys/kernel/random/boot_id")}


def same_pid_namespace(record: dict[str, Any]) -> bool:
    """Whether ``record`` (a :func:`holder_identity`) was made in this process's pid namespace and boot: only then
    does its pid name a process here. A record without them (an older one) does not; on a system without
    ``/proc`` (no pid namespaces), the host name decides."""
    mine = holder_identity()
    if not (mine["pid_ns"] and mine["boot"]):
        return bool(record.get("host")) and record.get("host") == mine["host"]
    return all(record.get(key) == mine[key] for key in ("pid_ns", "boot"))


def is_this_process(record: dict[str, Any]) -> bool:
    """Whether ``record`` describes this very process (its pid, in its pid namespace, since this boot)."""
    return record.get("pid") == os.getpid() and same_pid_namespace(record)


def process_gone(record: dict[str, Any]) -> bool:
    """Whether the process ``record`` names is known to be gone: its pid namespace and boot are this process's
    and no process has its pid. A process in another namespace, on another host or before a reboot is never
    judged (its pid may be any process here, or none)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not same_pid_namespace(record):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # no signal sent: whether the pid exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, another user's
    return False


def _proc_text(name: str) -> str:
    """``/proc/self/<name>`` (a link's target, or a file's first line) for ``ns/...``, ``/proc/<name>`` else; ''
    when it cannot be read."""
    try:
        if name.startswith("ns/"):
            return os.readlink(f"/proc/self/{name}")
        return Path("/proc", name).read_text(encoding="ascii").strip()
    except OSError:
        return ""


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
