"""Document cleaning: NFKC, control and ANSI removal, whitespace normalisation, optional t2s.

Cleaning runs on batches: the documents are joined with a separator and every rule is one pass over
the joined text. NFKC, the costliest rule, is a table lookup on the UTF-32 code points for characters
whose NFKC form is one character and that cannot interact with their neighbours (no combining marks,
no canonical composition partners); a document holding any other character gets CPython's full
``unicodedata.normalize``. Both paths give identical results (tested).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable

import numpy as np

from train_deploy.corpus.config import CleaningConfig

# CSI sequences (colours, cursor moves), then two-byte escapes such as ESC c.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# C0/C1 controls except tab and newline, DEL, zero-width and bidi marks, BOM; \r is handled below.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff]")
_ANSI_OR_CONTROL = re.compile(f"{_ANSI.pattern}|{_CONTROL.pattern}")
_NEWLINES = re.compile(r"\r\n?|[\u2028\u2029\x85]")
_SPACES = re.compile(r"[^\S\n]+")
# After _SPACES: the spaces around a line break, and blank lines beyond one.
_LINE_BREAKS = re.compile(r" ?\n(?: ?\n)* ?")
# Joins the documents of a batch: a private-use character, untouched by every rule above.
_SEPARATOR = "\ue000"


class Cleaner:
    """Cleans documents; ``clean_batch`` is the fast path, calling the cleaner cleans one document."""

    def __init__(self, config: CleaningConfig) -> None:
        self.config = config
        self._t2s: Callable[[str], str] | None = None
        if config.traditional_to_simplified:
            import opencc  # opencc-python-reimplemented: pure Python, no native build

            self._t2s = opencc.OpenCC("t2s").convert

    def __call__(self, text: str) -> str:
        return self.clean_batch([text])[0]

    def clean_batch(self, texts: list[str]) -> list[str]:
        """Return the cleaned text of every document, in order (possibly empty strings)."""
        joined = _SEPARATOR.join(texts)
        if joined.count(_SEPARATOR) != len(texts) - 1:  # a document holds the separator itself
            return [self._clean(text) for text in texts]
        if self.config.nfkc:
            joined = nfkc(joined, _SEPARATOR)
        return [text.strip() if self.config.normalize_whitespace else text
                for text in self._clean(joined, normalized=True).split(_SEPARATOR)]

    def _clean(self, text: str, normalized: bool = False) -> str:
        c = self.config
        if c.nfkc and not normalized:
            text = unicodedata.normalize("NFKC", text)
        if c.strip_control or c.normalize_whitespace:
            text = _NEWLINES.sub("\n", text)
        if c.strip_control:
            text = _ANSI_OR_CONTROL.sub("", text)
        if c.normalize_whitespace:
            text = _SPACES.sub(" ", text)
            text = _LINE_BREAKS.sub(_line_break, text)
            text = text.strip()
        if self._t2s is not None:
            text = self._t2s(text)
        return text


def _line_break(match: re.Match[str]) -> str:
    return "\n\n" if match.group().count("\n") > 1 else "\n"


def nfkc(text: str, separator: str | None = None) -> str:
    """``unicodedata.normalize("NFKC", text)``, fast for text made of simple characters.

    With ``separator``, ``text`` is several documents joined by it; only the documents holding a
    character outside the table are normalised the slow way.
    """
    simple, mapping = _nfkc_tables()
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    in_table = codes < len(simple)
    ok = np.zeros(len(codes), dtype=bool)
    ok[in_table] = simple[codes[in_table]]
    if ok.all():
        return mapping[codes].tobytes().decode("utf-32-le")
    if separator is None:
        return unicodedata.normalize("NFKC", text)
    mapped = np.where(ok, mapping[np.minimum(codes, len(simple) - 1)], codes)
    parts = mapped.tobytes().decode("utf-32-le").split(separator)
    originals = text.split(separator)
    boundaries = np.flatnonzero(codes == ord(separator))
    for index in np.unique(np.searchsorted(boundaries, np.flatnonzero(~ok))):
        parts[index] = unicodedata.normalize("NFKC", originals[index])
    return separator.join(parts)


@functools.cache
def _nfkc_tables() -> tuple[np.ndarray, np.ndarray]:
    """For each BMP code point: may it be normalised on its own, and to which code point."""
    size = 0x10000
    decompositions = {cp: d for cp in range(size) if (d := unicodedata.decomposition(chr(cp)))}
    partners = {0x1161 + i for i in range(21)} | {0x11A8 + i for i in range(27)}  # Hangul V and T jamo
    for d in decompositions.values():
        if not d.startswith("<") and len(parts := d.split()) == 2:
            partners.add(int(parts[1], 16))
    simple = np.ones(size, dtype=bool)
    simple[0xD800:0xE000] = False  # surrogates
    mapping = np.arange(size, dtype=np.uint32)
    for cp in range(size):
        ch = chr(cp)
        if cp in partners or unicodedata.combining(ch):
            simple[cp] = False
        elif cp in decompositions or not unicodedata.is_normalized("NFKC", ch):
            folded = unicodedata.normalize("NFKC", ch)
            first = unicodedata.normalize("NFKD", ch)[:1]
            if len(folded) == 1 and not unicodedata.combining(folded) and ord(first) not in partners:
                mapping[cp] = ord(folded)
            else:
                simple[cp] = False
    return simple, mapping
