"""Disk use of the project's folders, and the budget a run is checked against before its first node.

Sizes are what the files take on disk (``st_blocks``), each file once however many hard links it has (a bundle
version kept unchanged is hard links to the previous one), symbolic links not followed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


def tree_bytes(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes on disk under ``path`` (a file or a folder; 0 when missing); files whose inode is in ``seen`` are
    not counted again, and the ones counted are added to it."""
    seen = set() if seen is None else seen
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    total = _counted(info, seen)
    if not os.path.isdir(path) or os.path.islink(path):
        return total
    for root, folders, files in os.walk(path, onerror=lambda _error: None):
        for name in folders + files:
            try:
                total += _counted(os.lstat(os.path.join(root, name)), seen)
            except OSError:  # removed while walking
                continue
    return total


def _counted(info: os.stat_result, seen: set[tuple[int, int]]) -> int:
    key = (info.st_dev, info.st_ino)
    if key in seen:
        return 0
    seen.add(key)
    return info.st_blocks * 512


def human(size: float) -> str:
    """``1.5 GiB``, ``320 MiB``, ``12 KiB``, ``7 B``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@dataclass(frozen=True, slots=True)
class Usage:
    """What the project's folders hold: the total and each folder's share, biggest first."""

    total: int
    folders: list[tuple[Path, int]]

    def biggest(self, count: int = 3, relative_to: Path | None = None) -> str:
        """``data/06_models/checkpoints 3.1 GiB, mlartifacts 2.0 GiB, …`` (the ``count`` biggest)."""
        def name(path: Path) -> str:
            return str(path.relative_to(relative_to)) if relative_to and path.is_relative_to(relative_to) else str(path)
        return ", ".join(f"{name(path)} {human(size)}" for path, size in self.folders[:count] if size)


def usage(roots: Iterable[Path | tuple[Path, int]]) -> Usage:
    """The disk use of ``roots`` (folders or files, or ``(folder, depth)``: split ``depth`` levels down, 2 when not
    given), each byte counted once, into the parts that name what uses the space (``data/06_models/checkpoints``)."""
    seen: set[tuple[int, int]] = set()
    pairs = [root if isinstance(root, tuple) else (root, 2) for root in roots]
    outer = _outermost(path for path, _ in pairs)
    parts: list[tuple[Path, int]] = []
    for path, depth in pairs:
        if Path(os.path.abspath(path)) in outer:
            parts += _split(Path(os.path.abspath(path)), depth, seen)
    total = sum(size for _, size in parts)
    named = sorted((part for part in parts if part[0] not in outer or not part[0].is_dir()),
                   key=lambda part: part[1], reverse=True)  # a root folder's own entry is no answer to "what uses it"
    return Usage(total=total, folders=named)


def _outermost(roots: Iterable[Path]) -> list[Path]:
    """``roots`` without those inside another one (each byte counted once)."""
    resolved = sorted({Path(os.path.abspath(root)) for root in roots}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for root in resolved:
        if not any(root.is_relative_to(outer) for outer in kept):
            kept.append(root)
    return kept


def _split(root: Path, depth: int, seen: set[tuple[int, int]]) -> list[tuple[Path, int]]:
    if depth == 0 or not root.is_dir() or root.is_symlink():
        return [(root, tree_bytes(root, seen))]
    parts = [(root, _counted(os.lstat(root), seen))]
    try:
        children = sorted(root.iterdir())
    except OSError:
        return parts
    for child in children:
        parts += _split(child, depth - 1, seen) if child.is_dir() and not child.is_symlink() else \
            [(child, tree_bytes(child, seen))]
    return parts


class OverBudget(RuntimeError):
    """A run would take the project past ``retention.disk.budget`` or fill the disk; the message is one line."""


def check_budget(roots: list[Path | tuple[Path, int]], budget: int | None, needed: int, how_estimated: str,
                 project: Path) -> Usage | None:
    """Raise :class:`OverBudget` when the use of ``roots`` (as :func:`usage`) plus ``needed`` exceeds ``budget``
    (None: no budget) or the disk has less than ``needed`` free; return the usage measured (None when nothing was
    checked)."""
    existing = [root for root in roots if (root[0] if isinstance(root, tuple) else root).exists()]
    if not existing:
        return None
    first = existing[0][0] if isinstance(existing[0], tuple) else existing[0]
    free = shutil.disk_usage(first if first.is_dir() else first.parent).free
    if budget is None and needed <= free:
        return None
    used = usage(existing)
    fix = "run `train-deploy gc` (--dry-run lists what it would remove), or lower retention.* in conf/local"
    if budget is not None and used.total + needed > budget:
        raise OverBudget(
            f"retention.disk.budget: the project uses {human(used.total)} of its budget {human(budget)} and this run "
            f"needs about {human(needed)} ({how_estimated}); biggest: {used.biggest(3, project)}; {fix}, or raise "
            "retention.disk.budget")
    if needed > free:
        raise OverBudget(
            f"disk full: {human(free)} free where {first} is, and this run needs about {human(needed)} "
            f"({how_estimated}); biggest: {used.biggest(3, project)}; {fix}, or free space on the disk")
    return used
