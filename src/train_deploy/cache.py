"""Derived data kept once per machine: arrays that take long to build and little to load, stored raw in
:func:`cache_dir`. Deleting that folder is always safe: what is missing is built again."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from train_deploy.atomic import atomic_path

logger = logging.getLogger(__name__)


def cached_arrays(name: str, key: bytes, layout: dict[str, tuple[tuple[int, ...], type[np.generic]]],
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays ``build`` returns (``layout``: name → shape, dtype), built once per machine.

    The cache file is named by ``name`` and a hash of ``key`` (what the arrays are derived from, such as the
    source of the code that builds them) and of this module's source, so a change to either builds new
    arrays; a file of the wrong size is rebuilt, and an unwritable cache only costs the build.
    """
    digest = hashlib.blake2b(key + Path(__file__).read_bytes(), digest_size=8)
    path = cache_dir() / f"{name}-{digest.hexdigest()}.bin"  # the arrays of layout, in order, raw
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout.values()]
    try:
        data = np.fromfile(path, dtype=np.uint8)
        if len(data) == sum(sizes):
            offsets = np.cumsum([0, *sizes])
            return {field: data[offsets[i] : offsets[i + 1]].view(dtype).reshape(shape)
                    for i, (field, (shape, dtype)) in enumerate(layout.items())}
    except OSError:
        pass
    arrays = build()
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:  # concurrent writers write the same bytes
            for field, (_, dtype) in layout.items():
                f.write(np.ascontiguousarray(arrays[field], dtype=dtype).tobytes())
    except OSError as exc:
        logger.debug("%s not cached in %s: %s", name, path.parent, exc)
    return arrays


def cache_dir() -> Path:
    """This machine's cache folder for derived data: ``$TRAIN_DEPLOY_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/train_deploy``, else ``~/.cache/train_deploy``."""
    if folder := os.environ.get("TRAIN_DEPLOY_CACHE_DIR"):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "train_deploy"
