"""What a run shows on the console, and the log file that keeps the rest.

Kedro configures logging (its rich handler on the root logger) before any project code runs; then:

- :func:`quiet_third_party` (from ``cli.py`` and ``settings.py``, before the project's modules are imported)
  ignores the warnings every run printed and nobody can act on (:data:`KNOWN_NOISE`: MLflow asking for type
  hints on ``predict``, OmegaConf's ``register_new_resolver`` deprecation raised inside Kedro and kedro-mlflow,
  Paddle's missing ccache, setuptools replacing distutils, PaddleNLP's swiglu and Paddle's PIR notices) and
  makes PaddleNLP's logger an ordinary one (:class:`PaddleNLPLogger`), and lets kedro-mlflow say once, not once
  per node that ran, that a failed run was closed (:class:`RunClosedOnce`);
- every log record, console line and uncaught traceback is redacted (``train_deploy.redaction``: credentials in
  URIs, secret environment values), from :func:`quiet_third_party` on;
- the run's owner (``hooks.life.RunLife``, through ``hooks.display.open_console``) writes every record of the run,
  tracebacks included, to ``logs/train_deploy.log`` in the project, and, when the console is not a terminal (a file, a
  pipe, a scheduler's log), turns the rich handler's boxes, colours and 80-column wrapping into plain lines; on a
  terminal, records are written above the progress bars (:class:`AboveProgressBars`), not into them.

``train_deploy.cli`` prints the project's own errors as one line that points at the log file; a fatal signal's
Python traceback goes into the log file too (``faulthandler``, set up by ``train_deploy.run_control.signals``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from logging.handlers import RotatingFileHandler
from pathlib import Path

from train_deploy.redaction import redact_logging, redact_streams

LOG_FILE = Path("logs") / "train_deploy.log"
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# (message regex, category, module regex) of the warnings that carry no information for a user of the project.
KNOWN_NOISE = (
    (r"(?:\x1b\[\d+m)?Add type hints to the `predict` method", UserWarning, r"mlflow\."),
    (r"register_new_resolver\(\) is deprecated", UserWarning, r""),
    (r"No ccache found", UserWarning, r"paddle\."),
    (r"Setuptools is replacing distutils", UserWarning, r"_distutils_hack"),
    (r"[\s\S]*paddle\.incubate\.nn\.functional\.swiglu", UserWarning, r"paddlenlp\."),  # PaddleNLP's Llama, each load
    (r"Tensor do not have 'place' interface for pir", UserWarning, r"paddle\."),  # paddle.jit, on every export
)


class PaddleNLPLogger(logging.Logger):
    """``logging.getLogger("PaddleNLP")`` as an ordinary logger: when PaddleNLP is imported it adds its own
    handler (colour codes, straight to stderr), sets DEBUG and stops propagation; this logger ignores all three,
    so PaddleNLP's records reach the console and the log file like any other, from WARNING up (its INFO lines
    name temporary folders)."""

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 (logging's name)
        return

    def setLevel(self, level: int | str) -> None:  # noqa: N802
        super().setLevel(max(logging.WARNING, logging.getLevelName(level) if isinstance(level, str) else level))

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, True if name == "propagate" else value)


class KnownNoise(logging.Filter):
    """Drops the ``py.warnings`` records (Python warnings Kedro sends to logging) of :data:`KNOWN_NOISE`: MLflow
    raises its own under ``simplefilter("once")``, which no warnings filter outside it can ignore."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(re.search(message, text) and category.__name__ in text for message, category, _ in KNOWN_NOISE)


class RunClosedOnce(logging.Filter):
    """Passes kedro-mlflow's "The run '<id>' was closed because of an error in the pipeline." once per run: it logs
    the line for each time the run is on MLflow's active-run stack, where it re-opens the run before every node."""

    MLFLOW_HOOK_LOGGER = "kedro_mlflow.framework.hooks.mlflow_hook"

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "was closed because of an error" not in text:
            return True
        said = text in self._said
        self._said.add(text)
        return not said


def quiet_third_party() -> None:
    """Ignore :data:`KNOWN_NOISE`, route PaddleNLP's logger through logging (before PaddleNLP is imported) and
    install :class:`RunClosedOnce`; no MLflow download bars (carriage returns) when the console is not a terminal.
    Log records, ``sys.stdout``/``sys.stderr`` and uncaught tracebacks are redacted from here on."""
    redact_logging()
    redact_streams()
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for message, category, module in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    # conf/logging.yml keeps Python warnings off the console while Kedro loads its plugins (they import MLflow,
    # whose warnings no filter reaches); from here on they show, less the known noise.
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.setLevel(logging.WARNING)
    if not any(isinstance(f, KnownNoise) for f in py_warnings.filters):
        py_warnings.addFilter(KnownNoise())
    mlflow_hook = logging.getLogger(RunClosedOnce.MLFLOW_HOOK_LOGGER)
    if not any(isinstance(f, RunClosedOnce) for f in mlflow_hook.filters):
        mlflow_hook.addFilter(RunClosedOnce())
    if "PaddleNLP" not in logging.Logger.manager.loggerDict:
        previous = logging.getLoggerClass()
        logging.setLoggerClass(PaddleNLPLogger)
        try:
            logging.getLogger("PaddleNLP").setLevel(logging.WARNING)
        finally:
            logging.setLoggerClass(previous)


class PlainConsoleHandler(logging.StreamHandler):
    """One plain line per record on the current ``sys.stderr`` (looked up at each record, so a redirected or
    captured stream is followed), tracebacks as Python prints them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(PLAIN_FORMAT))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def log_to_file(project: Path) -> Path:
    """Send the root logger's records to ``logs/train_deploy.log`` of ``project`` (instead of another project's
    file this process wrote before); returns its path."""
    path = (Path(project) / LOG_FILE).resolve()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, ProjectLogFile)]:
        if Path(handler.baseFilename) == path:
            return path
        root.removeHandler(handler)
        handler.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    root.addHandler(ProjectLogFile(path))
    return path


class ProjectLogFile(RotatingFileHandler):
    """The project's log file: every record from INFO up, tracebacks included; 4 files of 20 MB at most."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, maxBytes=20_000_000, backupCount=3, encoding="utf-8")
        self.setFormatter(logging.Formatter(PLAIN_FORMAT))
        self.setLevel(logging.INFO)


def _project_log_handler() -> ProjectLogFile | None:
    return next((h for h in logging.getLogger().handlers if isinstance(h, ProjectLogFile)), None)


def project_log_file() -> Path | None:
    """The project's log file this process writes (None when no run of this process opened one)."""
    handler = _project_log_handler()
    return Path(handler.baseFilename) if handler is not None else None


def record_in_log_file(error: BaseException, message: str) -> Path | None:
    """Write ``message`` with ``error``'s traceback to the project's log file only; returns the file (None when
    no run of this process opened one)."""
    handler = _project_log_handler()
    if handler is None:
        return None
    logger = logging.getLogger("train_deploy.cli")
    handler.handle(logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, (), (
        type(error), error, error.__traceback__)))
    return Path(handler.baseFilename)


def plain_console_unless_terminal() -> None:
    """Replace Kedro's rich console handler with :class:`PlainConsoleHandler` when stderr is no terminal."""
    if sys.stderr.isatty():
        return
    from kedro.logging import RichHandler

    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, RichHandler)]:
        plain = PlainConsoleHandler()
        plain.setLevel(handler.level)
        for record_filter in handler.filters:
            plain.addFilter(record_filter)
        root.removeHandler(handler)
        root.addHandler(plain)


class AboveProgressBars(logging.Handler):
    """A console handler whose records are written above the progress bars (tqdm's, on the terminal): the active
    bars are cleared, the record written on its own lines, the bars drawn again below it, as ``tqdm.write`` does.
    The wrapped handler keeps its format (the rich one's columns and colours), level and filters."""

    def __init__(self, console: logging.Handler) -> None:
        super().__init__()
        self.console = console

    def handle(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.console.level:
            return False
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stderr):  # bars on stdout or stderr: both are this terminal
            return bool(self.console.handle(record))

    def emit(self, record: logging.LogRecord) -> None:  # only through handle
        self.console.emit(record)

    def flush(self) -> None:
        self.console.flush()


def log_above_bars_on_terminal() -> None:
    """Wrap the root logger's console handlers in :class:`AboveProgressBars` when stderr, where the bars are
    drawn, is a terminal (elsewhere there are no bars: they are off when the console is not a terminal)."""
    if not sys.stderr.isatty():
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if not isinstance(h, logging.FileHandler | AboveProgressBars)]:
        root.removeHandler(handler)
        root.addHandler(AboveProgressBars(handler))
