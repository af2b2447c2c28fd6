"""The project's commands: Kedro's project CLI module (``cli`` and ``run``) and the ``train-deploy`` command.

Kedro loads this module's ``cli`` group over its own commands and takes its ``run`` for ``python -m train_deploy``
(Kedro's way to run a packaged project). ``run`` is ``kedro run``, except that

- a run stopped because there is nothing to retrain (``train_deploy.run_control.retrain``) says so in one line and exits
  0;
- a run the data gate stopped before training (``train_deploy.validation``) prints its one line after the report
  and exits 3 (:data:`VALIDATION_STOPPED`): a night not worth retrying until the corpus changes;
- a run failing with one of the project's own errors (configuration, corpus, checkpoint, bundle, training, …)
  prints its one-line message and where the traceback is (the project's log file, ``train_deploy.console``),
  and exits 1; any other error keeps its whole traceback on the console.
- Kedro's hint to resume a failed run (``--from-nodes …``, or "Repeat the previous command") is left out when a
  node failed on a configuration or corpus error (:class:`NoResumeHint`): a setting or the input has to change
  first, and a whole run again reuses every stage that is still current.

``train-deploy`` is ``train_deploy.commands``, which runs this ``run`` as ``train-deploy run``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click
from kedro.framework.cli.project import run as kedro_run

from train_deploy.console import quiet_third_party, record_in_log_file

quiet_third_party()  # Kedro's CLI imports this module before the project's settings

from train_deploy.config import ConfigError  # noqa: E402
from train_deploy.corpus.errors import CorpusError  # noqa: E402
from train_deploy.params import with_project_params  # noqa: E402
from train_deploy.run_control.processes import exit_now  # noqa: E402
from train_deploy.run_control.retrain import NothingToRetrain  # noqa: E402
from train_deploy.validation import STOPPED_EXIT_STATUS  # noqa: E402
from train_deploy.validation.report import ValidationStopped  # noqa: E402

PACKAGE = "train_deploy"
VALIDATION_STOPPED = STOPPED_EXIT_STATUS
"""Exit status of a run the data gate stopped (1: any other project error)."""

@click.group(name=PACKAGE)
def cli() -> None:
    """Commands of the train_deploy project."""


def _run(**options: Any) -> Any:
    """The ``run`` command; a process that is this command (:func:`_whole_process`) ends with
    ``processes.exit_now`` when the run returns or exits (SystemExit with an int code: the project's 1 and 3 too),
    skipping Paddle's seconds-long interpreter teardown. Anything else (click's usage errors, status 2; a bug's
    traceback, status 1; KeyboardInterrupt) propagates as before."""
    if not _whole_process():
        return _run_project(**options)
    try:
        _run_project(**options)
        code = 0
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            raise  # Python prints a message code and exits 1: left to it
        code = stop.code or 0
    context = click.get_current_context(silent=True)
    while context is not None:  # what leaving click's contexts does on the way out
        context.close()
        context = context.parent
    exit_now(code)


def _whole_process() -> bool:
    """Whether this process is the command: ``kedro run``, ``python -m kedro run``, ``python -m train_deploy`` or
    ``train-deploy run``, which end when the run does, not a caller's ``run.main(...)`` (a test, a notebook). The
    ``after_command_run`` CLI hook that Kedro calls after a command is skipped: its only one, kedro-telemetry's, does
    nothing here (telemetry is off: ``.telemetry``, ``DO_NOT_TRACK``)."""
    entry = Path(sys.argv[0])
    return entry.name in ("kedro", "train-deploy") or (
        entry.name == "__main__.py" and entry.parent.name in ("kedro", PACKAGE))


def _run_project(**options: Any) -> Any:
    try:
        return kedro_run.callback(**options)
    except NothingToRetrain as skipped:
        sys.stdout.write(f"\nSkipped: {skipped}\n")
        return None
    except Exception as error:
        own = project_error(error)
        if own is None:  # not one of the project's errors (a bug, or a library's): the whole traceback
            raise
        log = record_in_log_file(error, "The run failed")
        where = f"\n  traceback: {log}" if log else ""
        sys.stderr.write(f"{type(own).__name__}: {str(own).strip().splitlines()[0] if str(own).strip() else ''}"
                         f"{where}\n")
        raise SystemExit(VALIDATION_STOPPED if isinstance(own, ValidationStopped) else 1) from None


class NoResumeHint(logging.Filter):
    """Drops Kedro's resume hint, which its runner logs while the node's error is being handled, when that error is
    (or wraps) a :class:`~train_deploy.config.ConfigError` or :class:`~train_deploy.corpus.errors.CorpusError`."""

    RUNNER_LOGGERS = ("kedro.runner.sequential_runner", "kedro.runner.parallel_runner", "kedro.runner.thread_runner")
    HINTS = ("--from-nodes", "Repeat the previous command")

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(hint in record.getMessage() for hint in self.HINTS):
            return True
        return not isinstance(project_error(sys.exc_info()[1]), ConfigError | CorpusError)

    @classmethod
    def install(cls) -> None:
        """Add the filter to each Kedro runner's logger (once)."""
        for name in cls.RUNNER_LOGGERS:
            runner = logging.getLogger(name)
            if not any(isinstance(f, cls) for f in runner.filters):
                runner.addFilter(cls())


def project_error(error: BaseException | None) -> BaseException | None:
    """The project's own error (a class of a ``train_deploy`` module, whose message is one line naming the file,
    key or value) that ``error`` is or wraps (Kedro wraps what a dataset raises), or None."""
    seen: BaseException | None = error
    while seen is not None:
        if type(seen).__module__.split(".")[0] == PACKAGE:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


NoResumeHint.install()

run = click.Command("run", params=with_project_params(kedro_run.params), callback=_run, help=kedro_run.help,
                    short_help=kedro_run.short_help)
"""``kedro run`` with the project's one-line errors; Kedro's ``find_run_command`` looks for it here."""
cli.add_command(run)
