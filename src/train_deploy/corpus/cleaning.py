"""Document cleaning: NFKC, control and ANSI removal, whitespace normalisation, optional t2s."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from train_deploy.corpus.config import CleaningConfig

# CSI sequences (colours, cursor moves), then two-byte escapes such as ESC c.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# C0/C1 controls except tab and newline, DEL, zero-width and bidi marks, BOM; \r is handled below.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff]")
_NEWLINES = re.compile(r"\r\n?|[\u2028\u2029\x85]")
_SPACES = re.compile(r"[^\S\n]+")
_SPACE_AROUND_NEWLINE = re.compile(r" ?\n ?")
_BLANK_RUNS = re.compile(r"\n{3,}")


class Cleaner:
    """Callable that returns the cleaned text of one document (possibly empty)."""

    def __init__(self, config: CleaningConfig) -> None:
        self.config = config
        self._t2s: Callable[[str], str] | None = None
        if config.traditional_to_simplified:
            import opencc  # opencc-python-reimplemented: pure Python, no native build

            self._t2s = opencc.OpenCC("t2s").convert

    def __call__(self, text: str) -> str:
        c = self.config
        if c.nfkc:
            text = unicodedata.normalize("NFKC", text)
        if c.strip_control:
            text = _ANSI.sub("", text)
            text = _NEWLINES.sub("\n", text)
            text = _CONTROL.sub("", text)
        if c.normalize_whitespace:
            text = _NEWLINES.sub("\n", text)
            text = _SPACES.sub(" ", text)
            text = _SPACE_AROUND_NEWLINE.sub("\n", text)
            text = _BLANK_RUNS.sub("\n\n", text)
            text = text.strip()
        if self._t2s is not None:
            text = self._t2s(text)
        return text
