"""Quality filters on cleaned documents: length, share of CJK characters, repetition (Gopher), symbols and digits.

Every rule is a vectorised pass over the UTF-32 code points of a whole batch, so the filters cost a few
numpy operations per batch, not per document. A document is dropped for the first rule it fails, in the
order of :data:`REASONS`; the thresholds are those of :class:`~train_deploy.corpus.config.CleaningConfig`.

The repetition rules follow Gopher (Rae et al. 2021, table A1) with characters in place of words, as
Chinese has no spaces: the share of characters in lines that occur more than once in the document, and
the share of characters covered by character n-grams that occur more than once.
"""

from __future__ import annotations

import functools
import unicodedata
from collections import Counter

import numpy as np

from train_deploy.corpus.config import CleaningConfig

REASONS = ("too_short", "too_long", "low_cjk_share", "repeated_lines", "repeated_ngrams", "symbol_share")
"""Drop reasons of the cleaning stage, in the order they are checked."""

_OTHER, _CJK, _SYMBOL, _SPACE = 0, 1, 2, 3
# A private-use character joins the batch: it never occurs in cleaned text (the cleaner's own separator).
_JOIN = "\ue000"
_MIX = np.uint64(0x9E3779B97F4A7C15)
_BASE = 1_000_003


class QualityFilter:
    """Decides, per batch, which cleaned documents are kept and why the others are dropped."""

    def __init__(self, config: CleaningConfig) -> None:
        self.config = config

    def reasons(self, texts: list[str]) -> list[str | None]:
        """The drop reason of every document (None: kept), in order."""
        c = self.config
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        reason = np.full(len(texts), len(REASONS), dtype=np.int64)  # index into REASONS; len(REASONS) = kept

        def fail(rule: str, mask: np.ndarray) -> None:
            reason[mask & (reason == len(REASONS))] = REASONS.index(rule)

        fail("too_short", lengths < c.min_chars)
        if c.max_chars is not None:
            fail("too_long", lengths > c.max_chars)
        classes = c.min_cjk_share > 0 or c.max_symbol_share < 1
        if classes or c.max_repeated_ngram_share < 1:
            codes, owner = code_points(texts)
        if classes:
            cjk, symbols = _class_shares(codes, owner, len(texts))
            fail("low_cjk_share", cjk < c.min_cjk_share)
        if c.max_repeated_line_share < 1:
            fail("repeated_lines", np.array([repeated_line_share(t) for t in texts]) > c.max_repeated_line_share)
        if c.max_repeated_ngram_share < 1:
            shares = repeated_ngram_shares(codes, owner, lengths, c.repetition_ngram)
            fail("repeated_ngrams", shares > c.max_repeated_ngram_share)
        if classes:
            fail("symbol_share", symbols > c.max_symbol_share)
        return [REASONS[r] if r < len(REASONS) else None for r in reason.tolist()]


def repeated_line_share(text: str) -> float:
    """Share of the document's characters in non-blank lines that occur more than once in it."""
    if "\n" not in text:
        return 0.0
    lines = [line for line in text.split("\n") if line.strip()]
    counts = Counter(lines)
    repeated = sum(len(line) for line in lines if counts[line] > 1)
    return repeated / max(1, sum(map(len, lines)))


def repeated_ngram_shares(codes: np.ndarray, owner: np.ndarray, lengths: np.ndarray, n: int) -> np.ndarray:
    """Per document, the share of its characters covered by a character n-gram that occurs twice or more in it."""
    count = len(lengths)
    if len(codes) < n:
        return np.zeros(count)
    starts = len(codes) - n + 1
    hashes = window_hashes(codes.astype(np.uint64), n)[:starts]
    hashes ^= owner[:starts].astype(np.uint64) * _MIX  # the same n-gram in two documents is not a repeat
    inside = (owner[:starts] == owner[n - 1 :]) & (owner[:starts] >= 0)  # within one document
    repeated = np.zeros(starts, dtype=bool)
    repeated[inside] = _occurs_twice(hashes[inside])
    # A character is covered when one of the n windows holding it repeats.
    covered_starts = np.concatenate([[0], np.cumsum(repeated, dtype=np.int64)])
    position = np.arange(len(codes))
    covered = covered_starts[np.minimum(position + 1, starts)] > covered_starts[np.clip(position - n + 1, 0, starts)]
    covered &= owner >= 0
    return np.bincount(owner[covered], minlength=count) / np.maximum(lengths, 1)


def window_hashes(codes: np.ndarray, n: int) -> np.ndarray:
    """A polynomial hash (wrapping in 64 bits) of the ``n`` characters from each position, built from windows
    of 1, 2, 4 … characters by doubling: ``log2(n)`` passes instead of ``n``. The last ``n - 1`` are partial."""
    hashes: dict[int, np.ndarray] = {1: codes}
    width = 1
    while 2 * width <= n:
        hashes[2 * width] = _combine(hashes[width], width, hashes[width], width)
        width *= 2
    result, done = hashes[width], width
    for part in sorted(hashes, reverse=True):
        if done + part <= n:
            result, done = _combine(result, done, hashes[part], part), done + part
    return result


def _combine(left: np.ndarray, left_width: int, right: np.ndarray, right_width: int) -> np.ndarray:
    """Hash of each ``left_width``-character window followed by the ``right_width`` characters after it."""
    out = left * np.uint64(pow(_BASE, right_width, 1 << 64))
    out[: len(out) - left_width] += right[left_width:]
    return out


def _occurs_twice(hashes: np.ndarray) -> np.ndarray:
    """Which values occur more than once: buckets first (one ``bincount``), exact comparison only for the few
    values that share a bucket, so most of a batch is never sorted."""
    buckets = max(1024, 1 << (2 * len(hashes)).bit_length())
    slot = (hashes & np.uint64(buckets - 1)).astype(np.int64)
    candidates = np.flatnonzero(np.bincount(slot, minlength=buckets)[slot] > 1)
    twice = np.zeros(len(hashes), dtype=bool)
    if len(candidates):
        order = candidates[np.argsort(hashes[candidates], kind="stable")]
        values = hashes[order]
        equal = values[1:] == values[:-1]
        twice[order[1:][equal]] = True
        twice[order[:-1][equal]] = True
    return twice


def code_points(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The batch's code points and, for each, the index of its document (-1 for the joining character)."""
    joined = _JOIN.join(texts)
    codes = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    joins = codes == ord(_JOIN)
    owner = np.cumsum(joins, dtype=np.int64)
    owner[joins] = -1
    return codes, owner


def _class_shares(codes: np.ndarray, owner: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per document, the shares of CJK ideographs and of digits and symbols among its non-space characters."""
    classes = _class_table()[np.minimum(codes, 0xFFFF)]
    if len(codes) and codes.max() > 0xFFFF:  # CJK extensions B–H are ideographs; other planes are letters
        classes[codes > 0xFFFF] = np.where((codes[codes > 0xFFFF] >= 0x20000) & (codes[codes > 0xFFFF] < 0x40000),
                                           _CJK, _OTHER)
    real = owner >= 0
    counts = np.bincount(owner[real] * 4 + classes[real], minlength=4 * count).reshape(count, 4)
    visible = np.maximum(counts.sum(axis=1) - counts[:, _SPACE], 1)
    return counts[:, _CJK] / visible, counts[:, _SYMBOL] / visible


@functools.cache
def _class_table() -> np.ndarray:
    """BMP code point → CJK ideograph, digit or symbol (Unicode N* and S*), whitespace, or other."""
    table = np.zeros(0x10000, dtype=np.uint8)
    for cp in range(0x10000):
        category = unicodedata.category(chr(cp))
        if category[0] in "NS":
            table[cp] = _SYMBOL
        elif chr(cp).isspace():
            table[cp] = _SPACE
    for low, high in ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF)):
        table[low : high + 1] = _CJK
    table[0x3007] = _CJK  # 〇, the ideographic zero, is written as a character in Chinese numbers
    return table
