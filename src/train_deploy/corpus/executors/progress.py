"""The encoding progress both executors show: chunks encoded of the plan's, with the time left
(:func:`train_deploy.progress.eta_text` logged every :data:`LOG_EVERY_S` seconds and at the end), and on a terminal
only a bar with the documents, tokens and tokens/s so far."""

from __future__ import annotations

import logging

from train_deploy.progress import ProgressLog

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
"""Seconds between two progress lines in the log (the last one is logged whatever the interval)."""


class EncodingProgress(ProgressLog):
    """``chunks`` to encode, known from the plan before the first is read: the stage's total. ``bar`` false draws
    no bar even on a terminal (``corpus.encoding.progress``); the log lines are written either way."""

    def __init__(self, chunks: int, bar: bool) -> None:
        super().__init__(chunks, "encoding", logger, unit="chunk", every_s=LOG_EVERY_S, bar=bar)
        self._documents = self._tokens = 0

    def show(self, chunks: int, documents: int, tokens: int) -> None:
        """Show the totals so far: ``chunks`` finished, ``documents`` and ``tokens`` encoded (partly of chunks
        still being encoded)."""
        self._documents, self._tokens = documents, tokens
        if self._bar is not None:
            rate = tokens / max(self._bar.format_dict["elapsed"], 1e-9)
            self._bar.set_postfix_str(f"{documents} docs, {tokens / 1e6:.1f} M tokens, {rate / 1e6:.2f} M tokens/s",
                                      refresh=False)
        if chunks > self.done:
            self.advance(chunks - self.done)

    def add(self, chunks: int, documents: int, tokens: int) -> None:
        """Count ``chunks`` more finished, of ``documents`` and ``tokens``."""
        self.show(self.done + chunks, self._documents + documents, self._tokens + tokens)
