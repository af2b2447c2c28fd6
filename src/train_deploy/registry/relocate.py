"""Where a local SQLite MLflow store keeps its artifacts: absolute locations, as MLflow records them, rewritten in
one transaction when the project folder moves.

MLflow's own tools (``mlflow.pyfunc.load_model("models:/…@champion")``, ``mlflow models serve``) resolve a stored
location from the folder they run in, so the store records absolute ones (``file:///…/mlartifacts``), and a
notebook or a CI job in any folder loads the registered models. A moved project (copied elsewhere, the old folder
removed) then names a folder that no longer exists: :func:`check_locations` finds that cheaply (a run's start and
``train-deploy serve`` say in one line what to run), and :func:`relocate` (``train-deploy relocate``) rewrites
every location under the old folder to the same place under the new one; locations recorded relative to the
project by earlier releases become absolute there too.

The columns are MLflow's: ``experiments.artifact_location``, ``runs.artifact_uri``,
``logged_models.artifact_location``, ``model_versions.source`` and ``model_versions.storage_location``. A
location on another scheme (``models:/``, ``runs:/``, ``mlflow-artifacts:``, ``s3://``) is never touched.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

logger = logging.getLogger(__name__)

LOCATION_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                    ("logged_models", "artifact_location"), ("model_versions", "source"),
                    ("model_versions", "storage_location"))
"""The (table, column) pairs of an MLflow SQL store that hold a local artifact location."""
COMMAND = "train-deploy relocate"


class StoreMoved(RuntimeError):
    """The store's artifact locations name a folder that no longer exists; the message says what to run."""


class RelocateError(RuntimeError):
    """The store cannot be relocated as asked; the message names the store or the folder."""


@dataclass(frozen=True, slots=True)
class Change:
    """One stored location and what it becomes."""

    table: str
    column: str
    rowid: int
    before: str
    after: str


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store; None for any other store."""
    return Path(tracking_uri.removeprefix("sqlite:///")) if tracking_uri.startswith("sqlite:///") else None


def _local_path(location: str) -> tuple[Path, bool] | None:
    """The folder a stored ``location`` names and whether it is written as a ``file:`` URI; None for a location
    on another scheme (a relative path is returned as it is)."""
    scheme = urlsplit(location).scheme
    if scheme == "file":
        return Path(unquote(urlsplit(location).path)), True
    if scheme == "" and location:
        return Path(location), False
    return None


def _written(path: Path, as_uri: bool) -> str:
    return path.as_uri() if as_uri else path.as_posix()


def _locations(connection: sqlite3.Connection) -> Iterator[tuple[str, str, int, str]]:
    """Every stored location: (table, column, rowid, value)."""
    tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table, column in LOCATION_COLUMNS:
        if table in tables:
            for rowid, value in connection.execute(f"SELECT rowid, {column} FROM {table}"):  # noqa: S608 (constants)
                if isinstance(value, str):
                    yield table, column, rowid, value


def planned_changes(connection: sqlite3.Connection, old: Path | None, new: Path) -> list[Change]:
    """The locations under ``old`` moved under ``new`` (in the form they are written in), and relative ones made
    absolute against ``new`` as ``file:`` URIs."""
    changes = []
    for table, column, rowid, value in _locations(connection):
        found = _local_path(value)
        if found is None:
            continue
        path, as_uri = found
        if not path.is_absolute():
            after = (new / path).as_uri()
        elif old is not None and path.is_relative_to(old) and old != new:
            after = _written(new / path.relative_to(old), as_uri)
        else:
            continue
        changes.append(Change(table, column, rowid, value, after))
    return changes


def moved_from(connection: sqlite3.Connection, new: Path) -> Path | None:
    """The folder the project was moved or copied from: the one under which most locations outside ``new`` have
    their remainder in ``new`` (``/old/project/mlartifacts/1/…`` stored, ``new/mlartifacts/1/…`` there); None when
    none does."""
    votes: collections.Counter[Path] = collections.Counter()
    for _, _, _, value in _locations(connection):
        found = _local_path(value)
        if found is None or not found[0].is_absolute() or found[0].is_relative_to(new):
            continue
        path = found[0]
        for ancestor in reversed(path.parents):  # from the root down: the longest remainder that exists in ``new``
            if (new / path.relative_to(ancestor)).exists():
                votes[ancestor] += 1
                break
    return votes.most_common(1)[0][0] if votes else None


def check_locations(tracking_uri: str, project: Path) -> str | None:
    """Raise :class:`StoreMoved` when the local store at ``tracking_uri`` names the old folder of a moved
    ``project`` (a run would write its artifacts there, a download finds nothing); return a warning line when they
    name the folder this project was copied from, or are still relative to the project; None when they are
    current or it is no local store."""
    database = sqlite_file(tracking_uri)
    if database is None or not database.is_file():
        return None
    project = project.resolve()
    with contextlib.closing(sqlite3.connect(database, timeout=30)) as connection:
        old = moved_from(connection, project)
        relative = any(not found[0].is_absolute() for *_, value in _locations(connection)
                       if (found := _local_path(value)) is not None)
    if old is not None and not old.exists():
        raise StoreMoved(f"MLflow store {database}: its artifact locations name {old}, which no longer exists (the "
                         f"project moved to {project}): run `{COMMAND} --project {project}` (--dry-run shows the "
                         "changes)")
    if old is not None:
        return (f"MLflow store {database}: its artifact locations name {old}, another folder holding this project's "
                f"files (a copy?); its runs write there: run `{COMMAND} --project {project} --from {old}` to give "
                "this copy its own")
    if relative:
        return (f"MLflow store {database}: artifact locations recorded relative to the project load only from its "
                f"folder: run `{COMMAND} --project {project}` to record them absolute")
    return None


def relocate(database: Path, new: Path, old: Path | None = None, *, dry_run: bool = False) -> list[Change]:
    """Rewrite the store's locations under ``old`` (default: :func:`moved_from`) to ``new``, and relative ones
    absolute, in one transaction (all or none); with ``dry_run`` only the changes it would make."""
    if not database.is_file():
        raise RelocateError(f"no MLflow store at {database}")
    new = new.resolve()
    with contextlib.closing(sqlite3.connect(database, timeout=30, isolation_level=None)) as connection:
        connection.execute("BEGIN IMMEDIATE")  # no writer between the plan and its updates
        try:
            old = old.resolve() if old is not None else moved_from(connection, new)
            changes = planned_changes(connection, old, new)
            if not dry_run:
                for change in changes:
                    connection.execute(f"UPDATE {change.table} SET {change.column} = ? WHERE rowid = ?",  # noqa: S608
                                       (change.after, change.rowid))
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("ROLLBACK" if dry_run else "COMMIT")
    if not dry_run:
        logger.info("Relocated %d artifact location(s) of %s to %s", len(changes), database, new)
    return changes

