"""`train-deploy schedule`: retrain on a cron schedule on one machine, or once for system cron / systemd.

Each run is a child process, ``python -m kedro run --pipeline P [--env E] [--params …]`` in the project
folder, in its own process group, with ``TRAIN_DEPLOY_TRIGGER=schedule``, under the project's run lock
(``train_deploy.run_control.lock``), which the scheduler takes and hands to the run: a slot whose project is held by
another run is skipped and logged, never failed by a race with it. A failed run is retried with
exponential back-off (``backoff``, 2 × ``backoff``, …) up to ``retries`` times, then the scheduler waits for
the next slot; a run the data gate stopped (exit 3) is not retried: the same corpus would stop it again.
Missed slots are never caught up: a run that outlasts later slots is followed by at most one
late run. A run still going after ``--max-hours`` (default :data:`MAX_HOURS`) is stopped with its processes,
logged and alerted as timed out (a ``failed`` message to the run's ``notify`` receivers, sent once the lock is
given back), not retried, and the next slot runs. SIGTERM or SIGINT stops the current run and its processes
(SIGTERM, SIGKILL to what is left after :data:`STOP_GRACE` seconds; the run's own hooks stop its training
processes) and exits 0.

    train-deploy schedule --cron "0 3 * * *"                  # every night at 03:00, in the foreground
    train-deploy schedule --once --pipeline train_deploy      # one run now (with retries), exit with its code
    train-deploy schedule --cron "0 3 * * *" --max-hours 6    # a night still running after 6 h is stopped
"""

from __future__ import annotations

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
from typing import Any

import click

from train_deploy.redaction import one_line
from train_deploy.run_control.lock import RunConfig, RunLock, RunLockHeld
from train_deploy.run_control.processes import stop_process_tree
from train_deploy.run_control.signals import DEADLINE_VARIABLE
from train_deploy.validation import STOPPED_EXIT_STATUS as VALIDATION_STOPPED

logger = logging.getLogger(__name__)

TRIGGER_VARIABLE = "TRAIN_DEPLOY_TRIGGER"
STOP_GRACE = 30.0
"""Seconds a stopped run's processes have to end after SIGTERM before they are killed."""
MAX_HOURS = 24.0
"""The default wall-clock limit of one run (``--max-hours``): a night that hangs never stops the schedule."""


@dataclass(kw_only=True, slots=True)
class Schedule:
    """What to run, where and when."""

    command: list[str]
    """The run's command line (``kedro run …``)."""
    pipeline: str = "train_deploy"
    """The pipeline it runs (named in the run lock's holder description while the scheduler holds the lock)."""
    project: Path
    """The project folder: the run's working directory; its ``data/`` holds the run lock."""
    env: str | None = None
    """The run's ``--env``: its ``notify`` block is told of a slot the scheduler skips."""
    cron: str | None = None
    """A cron expression (five fields, or six with seconds last); None runs once."""
    retries: int = 0
    """Retries of a failed run before waiting for the next slot."""
    backoff: float = 60.0
    """Seconds before the first retry; each further retry waits twice as long."""
    max_hours: float = MAX_HOURS
    """Hours one run may take: then it is stopped with its processes and reported timed out."""


@dataclass(slots=True)
class _Stop:
    """The scheduler's stop request (the run in progress is stopped by :func:`_run_once`, which waits on it)."""

    event: threading.Event = field(default_factory=threading.Event)

    def request(self, signum: int, _frame=None) -> None:
        logger.info("%s received: stopping", signal.Signals(signum).name)
        self.event.set()


@dataclass(slots=True)
class _Ended:
    """How one run ended."""

    rc: int
    """Its exit code (negative: the signal that killed it)."""
    timed_out: bool = False
    """It was stopped at ``max_hours``."""
    where: dict = field(default_factory=dict)
    """The node and stage it was in, as its holder record said (a run that timed out)."""


def _run_once(schedule: Schedule, stop: _Stop, lock: RunLock) -> _Ended:
    """One run of the command in its own process group, under the scheduler's run lock handed to it, stopped
    with its processes after ``schedule.max_hours``."""
    started = time.monotonic()
    limit = schedule.max_hours * 3600.0
    logger.info("started: %s (in %s)", shlex.join(schedule.command), schedule.project)
    fd, handed = lock.hand_over()
    child = subprocess.Popen(schedule.command, cwd=schedule.project, start_new_session=True, pass_fds=(fd,),
                             env={**os.environ, TRIGGER_VARIABLE: "schedule", **handed,
                                  DEADLINE_VARIABLE: f"{time.time() + limit:.3f}"})
    timed_out, where = False, {}
    while child.poll() is None:
        if stop.event.wait(0.2):
            stop_process_tree(child, STOP_GRACE)  # SIGTERM: the run's own hooks stop its training processes
            break
        if time.monotonic() - started >= limit:
            timed_out, where = True, _where(lock)
            logger.error("timed out: the run took more than %s (--max-hours); stopping it", _hours(schedule))
            stop_process_tree(child, STOP_GRACE)
            break
    rc = child.wait()
    ended = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"rc {rc}"
    logger.info("finished: %s after %.1f s%s", ended, time.monotonic() - started, " (timed out)" if timed_out else "")
    return _Ended(rc, timed_out, where)


def _where(lock: RunLock) -> dict:
    """The node and stage the run holding ``lock`` described itself in."""
    about = lock.about() or {}
    return {key: about.get(key) for key in ("node", "stage")}


def _hours(schedule: Schedule) -> str:
    return f"{schedule.max_hours:g} h"


def run_with_retries(schedule: Schedule, stop: _Stop) -> int:
    """A run and its retries; the last exit code (0 for a run skipped because the project is held).

    The scheduler takes the project's run lock first and hands it to each run (``train_deploy.run_control.lock``): a
    slot is skipped, never failed, when another run holds it, and no run can start between the check and the run. A run
    that timed out is not retried, and alerted once the lock is given back."""
    lock = RunLock(schedule.project / "data")
    try:
        lock.acquire(RunConfig(lock="fail"), f"{schedule.pipeline} (train-deploy schedule)")
    except RunLockHeld as held:
        logger.info("skipped: %s holds the project %s", held.holder, schedule.project)
        notify_skipped(schedule, f"{held.holder} holds the project")
        return 0
    died = None
    try:
        night = _run_once(schedule, stop, lock)
        died = lock.reclaim(died=night.rc < 0)
        for attempt in range(1, schedule.retries + 1):
            if night.rc in (0, VALIDATION_STOPPED) or night.timed_out or stop.event.is_set():
                break  # a stopped or timed-out night fails the same way again
            delay = schedule.backoff * 2 ** (attempt - 1)
            logger.warning("run failed (rc %d): retry %d of %d in %g s", night.rc, attempt, schedule.retries, delay)
            if stop.event.wait(delay):
                break
            night = _run_once(schedule, stop, lock)
            died = lock.reclaim(died=night.rc < 0)
        if night.rc == 0 and not stop.event.is_set():  # retention: train-deploy gc under this lock (never fails)
            from train_deploy.retention.collect import after_scheduled_run
            after_scheduled_run(schedule.project, schedule.command, lock)
    finally:
        lock.release(leave=died)  # a run that died under the lock: the next run reports it
    return _report(schedule, stop, night)


def _report(schedule: Schedule, stop: _Stop, night: _Ended) -> int:
    """Log how the night ended, alert a timed-out one; its exit code."""
    rc = night.rc
    if night.timed_out:
        notify_outcome(schedule, "failed", reason=f"timed out: the run took more than {_hours(schedule)} "
                                                  "(train-deploy schedule --max-hours) and was stopped", **night.where)
    elif rc == VALIDATION_STOPPED:
        logger.error("run stopped by the data gate (rc %d): not retried until the corpus changes", rc)
    elif rc != 0 and not stop.event.is_set():
        logger.error("run failed (rc %d) after %d retries", rc, schedule.retries)
    return rc


def notify_skipped(schedule: Schedule, reason: str) -> None:
    """Tell the project's ``notify`` receivers of a slot skipped before any run started (a run that starts
    reports its own outcome)."""
    notify_outcome(schedule, "skipped", reason=reason)


def notify_outcome(schedule: Schedule, event: str, **fields: object) -> None:
    """Tell the project's ``notify`` receivers (``conf/<env>``) of what the scheduler itself saw (a skipped slot,
    a run stopped at its limit), waiting for the delivery no longer than its deadline; never raises: a failure is
    logged in one line."""
    if not (schedule.project / "conf").is_dir():
        return  # no configuration, no receivers (the scheduler's tests run a script in a bare folder)
    try:
        from train_deploy.project import project_config
        from train_deploy.run_control.notify import NotifyConfig, notify

        params = project_config(schedule.project, schedule.env)["parameters"]
        notify(NotifyConfig.from_params(params.get("notify")), event, schedule.project, pipeline=schedule.pipeline,
               trigger="schedule", **fields)
    except Exception as exc:  # a broken conf/ fails the run that reads it, with its own message
        logger.warning("could not notify the %s outcome: %s", event, one_line(exc))


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


_HELP = {"help_option_names": ["-h", "--help"], "max_content_width": 120}


@click.command(name="schedule", context_settings=_HELP)
@click.option("--cron", help='cron expression, e.g. "0 3 * * *" (a sixth field, last, is seconds)')
@click.option("--once", is_flag=True, help="run once now (with retries), exit with its code")
@click.option("--pipeline", default="train_deploy", show_default=True, help="the pipeline to run")
@click.option("--env", help="Kedro environment (conf/<env>)")
@click.option("--params", help="kedro run --params, e.g. training.schedule.max_steps=100")
@click.option("--retries", type=int, default=0, show_default=True, help="retries of a failed run")
@click.option("--backoff", type=float, default=60.0, show_default=True, help="seconds before the first retry")
@click.option("--max-hours", type=float, default=MAX_HOURS, show_default=True,
              help="hours a run may take before it is stopped and reported timed out")
@click.option("--project", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              help="project folder (default: here)")
@click.option("--command", hidden=True, help="tests: a tiny script in place of kedro run")
@click.pass_context
def schedule_command(context: click.Context, **options: Any) -> None:
    """Run a pipeline on a cron schedule, or once (--once), each run under the project's run lock."""
    schedule = _schedule(**options)
    # plain lines for a daemon's log, over the rich console handler Kedro's import set (train-deploy's CLI)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop.request)
    signal.signal(signal.SIGINT, stop.request)
    if schedule.cron is not None:
        serve(schedule, stop)
        return
    rc = run_with_retries(schedule, stop)
    context.exit(0 if stop.event.is_set() else 128 - rc if rc < 0 else rc)  # killed by signal N: 128 + N, as shells


def _schedule(*, cron: str | None, once: bool, pipeline: str, env: str | None, params: str | None, retries: int,
              backoff: float, max_hours: float, project: Path, command: str | None) -> Schedule:
    """The validated schedule of the command line (a bad option: one line naming it, exit status 2)."""
    from croniter import croniter

    if (cron is None) == (not once):
        raise click.UsageError("give one of --cron or --once")
    if cron is not None and not croniter.is_valid(cron):
        raise click.UsageError(f"--cron {cron!r}: not a cron expression (minute hour day month weekday [second])")
    if retries < 0:
        raise click.UsageError(f"--retries {retries}: must be 0 or more")
    if backoff < 0:
        raise click.UsageError(f"--backoff {backoff}: must be 0 or more seconds")
    if not max_hours > 0:
        raise click.UsageError(f"--max-hours {max_hours}: must be more than 0 hours")
    project = project.resolve()
    if not (project / "pyproject.toml").is_file():
        raise click.UsageError(f"--project {project}: no pyproject.toml there (run from the project folder or name it)")
    line = shlex.split(command) if command else kedro_command(pipeline, env, params)
    return Schedule(command=line, pipeline=pipeline, project=project, env=env, cron=cron, retries=retries,
                    backoff=backoff, max_hours=max_hours)


def main(argv: list[str] | None = None) -> int:
    """``train-deploy schedule …`` (``argv``: its options, after the word ``schedule``); returns the exit status:
    a single run's, 0 after a stop request, 2 for a bad option."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        schedule_command.main(args=argv[1:] if argv[:1] == ["schedule"] else argv, prog_name="train-deploy schedule")
    except SystemExit as ended:  # click exits, even after --help or a cron schedule's stop
        return ended.code if isinstance(ended.code, int) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
