"""Waiting in tests for something another process does: :func:`wait_for` polls a condition until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> None:
    """Return once ``condition()`` is true; raise AssertionError("<what> within <timeout> s") when ``timeout``
    seconds pass first. ``what`` names what did not happen, e.g. "no checkpoint"."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f} s")
        time.sleep(interval)
