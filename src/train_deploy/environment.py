"""Environment variables set for the length of a block, then put back as they were."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def scoped_environment(variables: Mapping[str, str], *, keep_set: bool = False) -> Iterator[None]:
    """``variables`` in ``os.environ`` inside the block; afterwards each is what it was (or unset again).

    With ``keep_set``, a variable the environment already sets keeps its value (the user's choice wins).
    """
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update({name: str(value) for name, value in variables.items()
                       if not (keep_set and saved[name] is not None)})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
