"""The encoding progress bar both executors show: documents encoded, tokens and tokens/s."""

from __future__ import annotations

import time


class ProgressBar:
    """Documents encoded so far, with the tokens and the rate since the bar started; nothing when ``enabled`` is
    false or the console is a file or a pipe (no carriage returns in logs)."""

    def __init__(self, enabled: bool, desc: str = "encoding") -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=desc, unit=" docs", dynamic_ncols=True, mininterval=0.5, disable=None)
        self._documents = self._tokens = 0
        self._started = time.perf_counter()

    def show(self, documents: int, tokens: int) -> None:
        """Show the totals so far: ``documents`` encoded and their ``tokens``."""
        self._documents, self._tokens = documents, tokens
        if self._bar is None:
            return
        self._bar.update(documents - self._bar.n)
        rate = tokens / max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(f"{tokens / 1e6:.1f} M tokens, {rate / 1e6:.2f} M tokens/s", refresh=False)

    def add(self, documents: int, tokens: int) -> None:
        """Count ``documents`` more, of ``tokens`` tokens."""
        self.show(self._documents + documents, self._tokens + tokens)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
