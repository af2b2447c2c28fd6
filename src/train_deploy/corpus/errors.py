"""The corpus stage's error, in a module of its own: the training data loader and serving raise or catch it
without importing the readers (and the libraries they need)."""

from __future__ import annotations


class CorpusError(ValueError):
    """Bad corpus input; the message names the file (and line where it applies)."""
