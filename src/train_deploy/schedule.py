"""`train-deploy schedule`: retrain on a cron schedule on one machine, or once for system cron / systemd.

Each run is a child process, ``python -m kedro run --pipeline P [--env E] [--params …]`` in the project
folder, in its own process group, with ``TRAIN_DEPLOY_TRIGGER=schedule``. A slot whose project is held by
another run (the run lock, ``train_deploy.run_lock``) is skipped and logged; a failed run is retried with
exponential back-off (``backoff``, 2 × ``backoff``, …) up to ``retries`` times, then the scheduler waits for
the next slot. Missed slots are never caught up: a run that outlasts later slots is followed by at most one
late run. SIGTERM or SIGINT stops the current run's process group (SIGTERM; the run's own hooks stop its
training processes), waits for it and exits 0.

    train-deploy schedule --cron "0 3 * * *"                  # every night at 03:00, in the foreground
    train-deploy schedule --once --pipeline train_deploy      # one run now (with retries), exit with its code
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from train_deploy.run_lock import RunLock

logger = logging.getLogger(__name__)

TRIGGER_VARIABLE = "TRAIN_DEPLOY_TRIGGER"
STOP_GRACE = 30.0
"""Seconds a stopped run's process group has to end after SIGTERM before it is killed."""


@dataclass(kw_only=True, slots=True)
class Schedule:
    """What to run, where and when."""

    command: list[str]
    """The run's command line (``kedro run …``)."""
    project: Path
    """The project folder: the run's working directory; its ``data/`` holds the run lock."""
    cron: str | None = None
    """A cron expression (five fields, or six with seconds last); None runs once."""
    retries: int = 0
    """Retries of a failed run before waiting for the next slot."""
    backoff: float = 60.0
    """Seconds before the first retry; each further retry waits twice as long."""


@dataclass(slots=True)
class _Stop:
    """The scheduler's stop request, and the run to stop with it."""

    event: threading.Event = field(default_factory=threading.Event)
    child: subprocess.Popen | None = None

    def request(self, signum: int, _frame=None) -> None:
        logger.info("%s received: stopping", signal.Signals(signum).name)
        self.event.set()
        if self.child is not None and self.child.poll() is None:
            _signal_group(self.child.pid, signal.SIGTERM)


def _signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to a process group; False when the group is gone."""
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _run_once(schedule: Schedule, stop: _Stop) -> int:
    """One run of the command in its own process group; its exit code."""
    started = time.monotonic()
    logger.info("started: %s (in %s)", shlex.join(schedule.command), schedule.project)
    child = subprocess.Popen(schedule.command, cwd=schedule.project, start_new_session=True,
                             env={**os.environ, TRIGGER_VARIABLE: "schedule"})
    stop.child = child
    if stop.event.is_set():  # a signal came between the start and the line above
        _signal_group(child.pid, signal.SIGTERM)
    try:
        rc = child.wait()
    finally:
        stop.child = None
    if stop.event.is_set():
        _reap_group(child.pid)
    logger.info("finished: rc %d after %.1f s", rc, time.monotonic() - started)
    return rc


def _reap_group(pgid: int) -> None:
    """Wait for what is left of a stopped run's process group, killing it after :data:`STOP_GRACE` seconds."""
    deadline = time.monotonic() + STOP_GRACE
    while _signal_group(pgid, 0):
        if time.monotonic() > deadline:
            logger.warning("process group %d still running %.0f s after SIGTERM: killing it", pgid, STOP_GRACE)
            _signal_group(pgid, signal.SIGKILL)
            return
        time.sleep(0.1)


def run_with_retries(schedule: Schedule, stop: _Stop) -> int:
    """A run and its retries; the last exit code (0 for a run skipped because the project is held)."""
    holder = RunLock(schedule.project / "data").held_by()
    if holder is not None:
        logger.info("skipped: %s holds the project %s", holder, schedule.project)
        return 0
    rc = _run_once(schedule, stop)
    for attempt in range(1, schedule.retries + 1):
        if rc == 0 or stop.event.is_set():
            break
        delay = schedule.backoff * 2 ** (attempt - 1)
        logger.warning("run failed (rc %d): retry %d of %d in %g s", rc, attempt, schedule.retries, delay)
        if stop.event.wait(delay):
            break
        rc = _run_once(schedule, stop)
    if rc != 0 and not stop.event.is_set():
        logger.error("run failed (rc %d) after %d retries", rc, schedule.retries)
    return rc


def serve(schedule: Schedule, stop: _Stop) -> None:
    """Run at every slot of ``schedule.cron`` until stopped; missed slots give one late run, not a backlog."""
    from croniter import croniter

    slot = croniter(schedule.cron, dt.datetime.now()).get_next(dt.datetime)
    late = False
    while True:
        if not late:
            logger.info("next slot at %s", slot.isoformat(sep=" "))
            if stop.event.wait(max(0.0, (slot - dt.datetime.now()).total_seconds())):
                return
        logger.info("slot %s%s", slot.isoformat(sep=" "), " (late: missed while the previous run ran)" if late else "")
        run_with_retries(schedule, stop)
        if stop.event.is_set():
            return
        now = dt.datetime.now()
        missed = croniter(schedule.cron, now).get_prev(dt.datetime)
        late = not late and missed > slot  # one late run for the slots a run outlasted, never more
        slot = missed if late else croniter(schedule.cron, now).get_next(dt.datetime)


def kedro_command(pipeline: str, env: str | None, params: str | None) -> list[str]:
    """``kedro run`` with this interpreter's Kedro (cron and systemd start with a bare PATH)."""
    command = [sys.executable, "-m", "kedro", "run", "--pipelines", pipeline]
    if env:
        command += ["--env", env]
    if params:
        command += ["--params", params]
    return command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train-deploy", description="Scheduled runs of train_deploy.")
    commands = parser.add_subparsers(dest="subcommand", required=True)
    sub = commands.add_parser("schedule", help="run a pipeline on a cron schedule, or once (--once)")
    when = sub.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help='cron expression, e.g. "0 3 * * *" (a sixth field, last, is seconds)')
    when.add_argument("--once", action="store_true", help="run once now (with retries), exit with its code")
    sub.add_argument("--pipeline", default="train_deploy")
    sub.add_argument("--env", help="Kedro environment (conf/<env>)")
    sub.add_argument("--params", help="kedro run --params, e.g. training.schedule.max_steps=100")
    sub.add_argument("--retries", type=int, default=0, help="retries of a failed run (default 0)")
    sub.add_argument("--backoff", type=float, default=60.0, help="seconds before the first retry (default 60)")
    sub.add_argument("--project", type=Path, default=Path.cwd(), help="project folder (default: here)")
    sub.add_argument("--command", help=argparse.SUPPRESS)  # tests: a tiny script in place of kedro run
    return parser


def _schedule(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Schedule:
    """The validated schedule of the command line (parser.error names a bad option and exits 2)."""
    from croniter import croniter

    if args.cron is not None and not croniter.is_valid(args.cron):
        parser.error(f"--cron {args.cron!r}: not a cron expression (minute hour day month weekday [second])")
    if args.retries < 0:
        parser.error(f"--retries {args.retries}: must be 0 or more")
    if args.backoff < 0:
        parser.error(f"--backoff {args.backoff}: must be 0 or more seconds")
    project = args.project.resolve()
    if not (project / "pyproject.toml").is_file():
        parser.error(f"--project {project}: no pyproject.toml there (run from the project folder or name it)")
    command = shlex.split(args.command) if args.command else kedro_command(args.pipeline, args.env, args.params)
    return Schedule(command=command, project=project, cron=args.cron, retries=args.retries, backoff=args.backoff)


def main(argv: list[str] | None = None) -> int:
    """``train-deploy schedule …``; any other arguments run the project like ``kedro run`` (as before)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "schedule":
        from train_deploy.__main__ import main as run_project

        return run_project()
    parser = _parser()
    schedule = _schedule(parser.parse_args(argv), parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop.request)
    signal.signal(signal.SIGINT, stop.request)
    if schedule.cron is None:
        rc = run_with_retries(schedule, stop)
        return 0 if stop.event.is_set() else rc
    serve(schedule, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
