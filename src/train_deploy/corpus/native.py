"""The corpus stage's optional compiled kernels (``_fast.c``), or None where they were not built.

``setup.py`` builds them wherever a C compiler exists; without one the install goes on and the stage
uses the numpy versions, which give the same bytes, more slowly. The manifest records which ran.
"""

from __future__ import annotations

from itertools import chain
from types import ModuleType

import numpy as np

compiled: ModuleType | None
try:
    from train_deploy.corpus import _fast as compiled
except ImportError:
    compiled = None


def flatten_ids(ids: list[list[int]], dtype: np.dtype, count: int) -> np.ndarray:
    """The id lists of a batch as one array of ``dtype`` (uint16 or int32) holding ``count`` ids."""
    if compiled is not None:
        return np.frombuffer(compiled.flatten_ids(ids, np.dtype(dtype).itemsize), dtype=dtype)
    return np.fromiter(chain.from_iterable(ids), dtype=dtype, count=count)
