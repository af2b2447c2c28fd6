"""Session artifacts built once for the whole test session, however many xdist workers run it.

``make test`` runs two worker processes; a session fixture is a session per worker, so each built its own tiny
tokenizer, token files, training run and export bundle (about a minute and a half of a worker's time). The
first worker to ask builds the artifact in the session's common temporary folder under a file lock (filelock,
already in the lock for MLflow); the others wait for it and load the same folder. A build that failed leaves no
``.done`` mark: the next worker to ask builds it again from an empty folder (and fails the same way, with its
own traceback).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

T = TypeVar("T")


def session_root(factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this session shares (a worker's own base is ``<root>/popen-gwN``)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T],
               load: Callable[[Path], T]) -> T:
    """``build(folder)`` by the first worker to ask, ``load(folder)`` by the others (and by the first too, so
    every worker sees the artifact as it was written)."""
    folder = session_root(factory) / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not (folder.parent / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder.parent / f"{name}.done").touch()
    return load(folder)
