"""The project's hashes, one helper per job (ground floor: imports nothing of the project).

- :func:`digest`: a fingerprint of a JSON-able payload (configuration, inputs), blake2b of its sorted JSON;
  equal payloads give equal fingerprints in any process, which is what reuse and skip-unchanged compare.
- :func:`hash_folder`: a folder's content (relative names and bytes, streamed), blake2b.
- :func:`file_record`: a file's size and xxh3-128 hash, streamed, as checkpoints and bundles record them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container
from pathlib import Path
from typing import Any

_BLOCK = 1 << 24


def digest(payload: Any, size: int = 16) -> str:
    """Hex blake2b (``size`` bytes) of ``payload`` as sorted JSON."""
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=size).hexdigest()


def hash_folder(folder: Path, skip: Container[str] = ()) -> str:
    """Hex blake2b-128 of every file under ``folder`` (but those named in ``skip``), in sorted relative-path order:
    each file contributes its relative POSIX path, a NUL byte and its bytes."""
    folder = Path(folder)
    hasher = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in skip):
        hasher.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                hasher.update(block)
    return hasher.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "xxh3_128": hex}`` of ``path``, read once in blocks."""
    import xxhash

    hasher = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            hasher.update(block)
            size += len(block)
    return {"bytes": size, "xxh3_128": hasher.hexdigest()}
