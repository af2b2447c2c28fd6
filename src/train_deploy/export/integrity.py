"""A bundle's files against what ``bundle.json`` records of them, checked when a bundle is loaded.

From format 9 (:data:`~train_deploy.handoffs.HASHED_BUNDLE_FORMAT`) ``bundle.json`` ``files`` records every other
file of the bundle by its relative name: size and xxh3-128 hash (``train_deploy.hashing.file_record``).
:func:`verify_bundle` reads each file once, in blocks, and raises :class:`BundleError` naming the first file that is
missing, of another size or of other content, by its name inside the bundle (never an absolute path: the
message can reach a served model's response). A copy of the bundle (an MLflow artifact download) verifies as
the original, since the names are relative.

A format 7 or 8 bundle records sizes alone (8) or nothing usable (7): it loads with one warning that its contents
are not verified and says to re-export it; the sizes it records are checked.
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

from train_deploy.export.errors import BundleError
from train_deploy.handoffs import BUNDLE_FILE, HASHED_BUNDLE_FORMAT, BundleMeta, FileRecord
from train_deploy.hashing import file_record

logger = logging.getLogger(__name__)

_FIX = "re-export the bundle, or copy it again from where it was published"


def bundle_file_records(folder: Path) -> dict[str, FileRecord]:
    """Size and xxh3-128 hash of every file under ``folder`` but ``bundle.json``, by relative POSIX name, sorted."""
    folder = Path(folder)
    return {path.relative_to(folder).as_posix(): FileRecord(**file_record(path))
            for path in sorted(folder.rglob("*")) if path.is_file() and path != folder / BUNDLE_FILE}


def verify_bundle(folder: Path, meta: BundleMeta) -> int:
    """Check every file ``meta.files`` records against the file in ``folder``; return how many were hashed.

    Raises :class:`BundleError` naming the file (relative to the bundle) that is missing, truncated or
    altered. A bundle older than format 9 has its recorded sizes checked and is loaded with a warning."""
    folder = Path(folder)
    hashed = bool(meta.files) and all(isinstance(record, FileRecord) for record in meta.files.values())
    if meta.format >= HASHED_BUNDLE_FORMAT and not hashed:
        raise BundleError(f"{BUNDLE_FILE}: files: a format {meta.format} bundle records every file's size and hash, "
                          f"this one does not; {_FIX}")
    for name, record in meta.files.items():
        if name == BUNDLE_FILE:  # a format 8 bundle recorded its own size before its last rewrite
            continue
        path = _inside(folder, name)
        if not path.is_file():
            raise BundleError(f"{name}: missing from the bundle ({BUNDLE_FILE} records it); {_FIX}")
        expected = record.bytes if isinstance(record, FileRecord) else record
        size = path.stat().st_size
        if size != expected:
            raise BundleError(f"{name}: {size} bytes, {BUNDLE_FILE} records {expected} (truncated or overwritten); "
                              f"{_FIX}")
        if isinstance(record, FileRecord):
            found = file_record(path)["xxh3_128"]
            if found != record.xxh3_128:
                raise BundleError(f"{name}: content differs from {BUNDLE_FILE}'s record (xxh3-128 {found}, "
                                  f"recorded {record.xxh3_128}): altered or damaged; {_FIX}")
    if not hashed:
        logger.warning("%s: bundle format %d records no file hashes, so its files are not verified (their sizes "
                       "only); re-export it to have them checked on every load", folder, meta.format)
        return 0
    logger.debug("%s: %d files verified against %s", folder, len(meta.files), BUNDLE_FILE)
    return len(meta.files)


def _inside(folder: Path, name: str) -> Path:
    """``folder / name``, refusing a recorded name that is absolute or leaves the bundle."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise BundleError(f"{BUNDLE_FILE}: files: {name[:200]!r} is not a name inside the bundle; {_FIX}")
    return folder / relative
