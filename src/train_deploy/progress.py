"""How far a long piece of work is and how long is left: one line of text, logged; a live bar on a terminal only.

:func:`eta_text` is the one place the line is written (``step 425/1400 (30%), 2:05 elapsed, ~4:50 left``): the
training worker logs it at its log interval, the corpus stage and the export through :class:`ProgressLog`. The time
left is the elapsed time per unit of work so far times the units left: a plain rate, monotone in what is done.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any


def duration_text(seconds: float) -> str:
    """``m:ss`` under an hour, ``h:mm:ss`` from one (``2:05``, ``1:02:05``)."""
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta_text(done: int, total: int, elapsed_s: float, unit: str = "step", start: int = 0) -> str:
    """``<unit> done/total (pct%), elapsed, ~left`` (``step 425/1400 (30%), 2:05 elapsed, ~4:50 left``): ``elapsed_s``
    were spent on the units past ``start`` (a resumed run's first step), the time left goes at that rate; unknown
    (``?``) before the first of them is done."""
    if total <= 0:
        raise ValueError(f"total: {total}: must be positive")
    done = min(max(done, 0), total)
    left = duration_text(elapsed_s / (done - start) * (total - done)) if done > start else "?"
    return f"{unit} {done}/{total} ({100 * done // total}%), {duration_text(elapsed_s)} elapsed, ~{left} left"


class ProgressLog:
    """Progress of ``total`` units of work: :func:`eta_text` logged every ``every_s`` seconds and at the end, and a
    tqdm bar drawn only when standard error is a terminal. Used as a context manager; :meth:`advance` counts."""

    def __init__(self, total: int, what: str, logger: logging.Logger, unit: str = "step", every_s: float = 10.0,
                 bar: bool = True) -> None:
        self.total, self.what, self.unit, self.every_s, self.logger = total, what, unit, every_s, logger
        self.done, self.started = 0, time.monotonic()
        self._logged_at = self.started
        self._bar: Any = None
        if bar and total > 0 and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, dynamic_ncols=True, mininterval=1.0, leave=False)

    def __enter__(self) -> ProgressLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()
        if kind is None and self.total > 0:
            self._log()

    def advance(self, units: int = 1) -> None:
        self.done += units
        if self._bar is not None:
            self._bar.update(units)
        if time.monotonic() - self._logged_at >= self.every_s and self.done < self.total:
            self._log()

    def _log(self) -> None:
        self._logged_at = time.monotonic()
        self.logger.info("%s: %s", self.what, eta_text(self.done, self.total, self._logged_at - self.started,
                                                        self.unit))
