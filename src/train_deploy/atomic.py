"""Atomic, durable file output: write under a temporary name in the same folder, fsync, then rename.

Every temporary name this module makes carries a marker: ``.<name>.tdstage-XXXXXXXX`` (a folder or, with
``.tmp``, a file being written) and ``.<name>.tdold-XXXXXXXX`` (holding a folder being replaced), with an
unpredictable ``XXXXXXXX``. So what a killed run leaves behind is found here (:func:`stale_leftovers`,
:func:`clean_leftovers`) and can never be confused with anyone's own files. A disk that fills up while
writing gives one line (:class:`DiskFullError`) and leaves the older output as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_STAGE, _OLD = "tdstage", "tdold"
# What crashed runs leave: this module's staging folders and files and the holders of replaced folders;
# also the names it used before the markers (``.<name>.old-<pid>``, and a checkpoint's ``.step_<8 digits>.``
# mkdtemp folder), recognisable enough to remove.
_LEFTOVER = re.compile(rf"^\.(?P<name>.+)\.(?:{_STAGE}-[a-z0-9_]+(?:\.tmp)?|(?P<holder>{_OLD})-[a-z0-9_]+"
                       rf"|(?P<legacy_old>old)-\d+)$|^\.step_\d{{8}}\.[a-z0-9_]{{8}}$")
_MB = 2**20


class DiskFullError(OSError):
    """The disk filled up while writing an output; the message names it, the space needed and the space free."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self) -> tuple[type, tuple[str]]:  # a corpus helper sends it to the parent
        return DiskFullError, (self.strerror,)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


@contextlib.contextmanager
def atomic_path(final: Path, what: str = "the file") -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success it is fsynced and renamed to ``final``.

    On error the temporary file is removed, so ``final`` is either the old file or the complete new one;
    a full disk raises :class:`DiskFullError` naming ``final`` and ``what``.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.{_STAGE}-", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; the result is an ordinary file
        fsync_file(tmp)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except Exception as exc:
        _raise_if_disk_full(exc, final, tmp, what)
        raise
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(final: Path, what: str | None = None) -> Iterator[Path]:
    """Yield an empty folder beside ``final``; on success its tree is fsynced and it replaces ``final``.

    An existing ``final`` is moved aside first and removed after the swap, so ``final`` is always either
    the old folder or the complete new one; on error the new folder is removed. A full disk raises
    :class:`DiskFullError` naming ``final`` and ``what`` (by default the file the error names, or "the folder").
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_folder(final.parent, final.name)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp creates 0700; the result is an ordinary folder
        fsync_tree(tmp)
        _swap_in(tmp, final)
    except Exception as exc:
        _raise_if_disk_full(exc, final, tmp, what)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_symlink(link: Path, target: str) -> None:
    """Point the symbolic link ``link`` at ``target`` (relative to ``link``'s folder) in one rename: a reader
    follows either the old target or the new one. ``link`` must not be a real folder."""
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.parent / f".{link.name}.{_STAGE}-{secrets.token_hex(4)}.tmp"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
        fsync_dir(link.parent)
    finally:
        tmp.unlink(missing_ok=True)


def scratch_folder(parent: Path, name: str) -> Path:
    """A new empty folder ``parent/.<name>.tdstage-XXXXXXXX``: removed by :func:`clean_leftovers` if abandoned."""
    return Path(tempfile.mkdtemp(prefix=f".{name}.{_STAGE}-", dir=parent))


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, moving an existing ``final`` into a holder first and removing it after."""
    if not final.exists():
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return
    holder = Path(tempfile.mkdtemp(prefix=f".{final.name}.{_OLD}-", dir=final.parent))
    os.replace(final, holder / final.name)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(holder / final.name, final)
        holder.rmdir()
        raise
    fsync_dir(final.parent)
    shutil.rmtree(holder, ignore_errors=True)


def _raise_if_disk_full(exc: Exception, final: Path, staged: Path, what: str | None) -> None:
    """Raise a one-line :class:`DiskFullError` (after removing ``staged``) if ``exc`` says the disk is full."""
    if isinstance(exc, DiskFullError) or not _is_disk_full(exc):
        return
    files = [p for p in staged.rglob("*") if p.is_file()] if staged.is_dir() else [staged]
    sizes = [p.stat().st_size for p in files if p.exists()]
    if what is None:  # the file being written, when the error says
        name = getattr(exc, "filename", None)
        inside = isinstance(name, str) and staged in Path(name).parents
        what = str(Path(name).relative_to(staged)) if inside else "the folder"
    if staged.is_dir():
        shutil.rmtree(staged, ignore_errors=True)
    else:
        staged.unlink(missing_ok=True)
    needed = f"at least {math.ceil(sum(sizes) / _MB)} MB needed, " if sum(sizes) else ""
    free = shutil.disk_usage(final.parent).free // _MB
    raise DiskFullError(f"{final}: no space left on device (ENOSPC) writing {what}; {needed}{free} MB free") from exc


def _is_disk_full(exc: BaseException | None) -> bool:
    """True if ``exc`` or what caused it is ENOSPC (an OSError, or a Rust library's "os error 28")."""
    seen = 0
    while exc is not None and seen < 8:
        if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or f"(os error {errno.ENOSPC})" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


# --- what crashed runs leave behind ----------------------------------------------------------------


def stale_leftovers(folder: Path, prefix: str = "") -> list[Path]:
    """The staging folders and files and replaced-folder holders that interrupted writes left in ``folder``
    (only those whose names start with ``prefix``, e.g. ``.bundle.`` for what belongs to ``bundle``).

    Only call it while no run writes there (the run lock): a write in progress has such names too.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(prefix) and _LEFTOVER.match(p.name))


def remove_leftovers(folder: Path, prefix: str = "") -> list[Path]:
    """Remove :func:`stale_leftovers` of ``folder``; return what was removed.

    A run killed between the two renames of a folder swap leaves the old folder in its holder and no folder
    under its own name: that folder is put back, not removed.
    """
    removed = []
    for path in stale_leftovers(folder, prefix):
        match = _LEFTOVER.match(path.name)
        assert match is not None
        original = path.with_name(match["name"]) if match["name"] else None
        kept = path / match["name"] if match["holder"] else path if match["legacy_old"] else None
        if original is not None and kept is not None and kept.is_dir() and not original.exists():
            os.replace(kept, original)
            logger.warning("Restored %s from %s, left by an interrupted write", original, path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        removed.append(path)
    if removed:
        fsync_dir(Path(folder))
    return removed


def clean_leftovers(root: Path) -> list[Path]:
    """Remove what interrupted writes left anywhere under the data folder ``root``; return what was removed."""
    removed: list[Path] = []
    if not Path(root).is_dir():
        return removed
    for here, folders, _ in os.walk(root):
        removed += remove_leftovers(Path(here))
        folders[:] = sorted(p.name for p in Path(here).iterdir() if p.is_dir() and not p.is_symlink())
    return removed


# --- durable writes --------------------------------------------------------------------------------


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder``, and ``folder`` itself (the names are data too)."""
    for here, _, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_file(Path(here) / name)
        fsync_dir(Path(here))


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
