"""The People's Daily (January 1998) corpus format: ``word/POS`` tokens separated by spaces, stripped to
plain text (the numpy kernel, or the compiled one from ``_fast.c`` when it was built).

Like :mod:`train_deploy.corpus.wiki` for MediaWiki dumps, this module knows only the format; cutting the
file into chunks and naming or skipping bad lines is :mod:`train_deploy.corpus.readers`' work.
"""

from __future__ import annotations

import numpy as np

from train_deploy.corpus.native import compiled


def strip_pos_tags(lines: list[str]) -> list[str]:
    """``迈向/v  充满/v  ＷＴＯ/nx`` → ``迈向充满ＷＴＯ``: drop POS tags and the spaces between words,
    keeping one space between two words that would otherwise run together as Latin letters or digits
    (ASCII or full-width). A tag is ``/`` and letters followed by spaces or the end of the line, so
    ``TCP/IP/nx`` keeps ``TCP/IP``.

    Vectorised over a batch of lines (one tag every few characters makes per-match regex
    substitution the slowest step of reading this corpus).
    """
    if not lines:
        return []
    stripped = strip_pos_tag_bytes("\n".join(lines).encode("utf-8")).decode("utf-8")
    return [line.strip() for line in stripped.split("\n")]


def strip_pos_tag_bytes(text: bytes) -> bytes:
    """:func:`strip_pos_tags` on UTF-8 bytes, lines kept (tags and the spaces after them are ASCII, so
    removing them never splits a multi-byte character). The compiled kernel when it was built."""
    return compiled.strip_pos_tags(text) if compiled is not None else strip_pos_tag_bytes_numpy(text)


def strip_pos_tag_bytes_numpy(text: bytes) -> bytes:
    """The numpy version of :func:`strip_pos_tag_bytes`: the reference the compiled kernel is tested against."""
    data = np.frombuffer(text + b"\0", dtype=np.uint8)  # b"\0": end of text
    n = len(data) - 1
    slashes = np.flatnonzero(data == 0x2F)
    start = slashes[_is_letter(data[slashes + 1])]  # "/" then a letter
    end = _skip(data, start + 1, _is_letter)  # first byte after the tag's letters
    start, end = start[data[end] <= 0x20], end[data[end] <= 0x20]  # then a space, tab, line end or text end
    after = _skip(data, end, _is_blank)  # first byte after the spaces that follow the tag
    keep_space = (after > end) & _alnum_at(data, after) & _alnum_before(data, start)
    stop = np.where(keep_space, after - 1, after)
    delta = np.zeros(n + 1, dtype=np.int8)
    delta[start] = 1
    delta[stop] -= 1
    return data[:n][np.cumsum(delta[:n], dtype=np.int8) == 0].tobytes()


def _is_letter(values: np.ndarray) -> np.ndarray:
    return ((values | 0x20) >= 0x61) & ((values | 0x20) <= 0x7A)


def _is_blank(values: np.ndarray) -> np.ndarray:
    return (values == 0x20) | (values == 0x09)


def _skip(data: np.ndarray, positions: np.ndarray, predicate) -> np.ndarray:
    """Advance each position past a run of bytes for which ``predicate`` holds (never past the end)."""
    positions = positions.copy()
    active = np.flatnonzero(predicate(data[positions]))
    while len(active):
        positions[active] += 1
        active = active[predicate(data[positions[active]])]
    return positions


def _alnum_at(data: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Does an ASCII or full-width (U+FF10-19, FF21-3A, FF41-5A) letter or digit start at each position?"""
    first = data[positions]
    ascii_ = _is_letter(first) | ((first >= 0x30) & (first <= 0x39))
    second = data[np.minimum(positions + 1, len(data) - 1)]
    third = data[np.minimum(positions + 2, len(data) - 1)]
    return ascii_ | ((first == 0xEF) & _full_width(second, third))


def _alnum_before(data: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Does an ASCII or full-width letter or digit end just before each position?"""
    last = data[np.maximum(positions - 1, 0)]
    ascii_ = (_is_letter(last) | ((last >= 0x30) & (last <= 0x39))) & (positions >= 1)
    lead, second = data[np.maximum(positions - 3, 0)], data[np.maximum(positions - 2, 0)]
    return ascii_ | ((positions >= 3) & (lead == 0xEF) & _full_width(second, last))


def _full_width(second: np.ndarray, third: np.ndarray) -> np.ndarray:
    """UTF-8 bytes 2-3 of U+FF10-FF19, U+FF21-FF3A (EF BC ..) or U+FF41-FF5A (EF BD ..)."""
    return ((second == 0xBC) & (((third >= 0x90) & (third <= 0x99)) | ((third >= 0xA1) & (third <= 0xBA)))) \
        | ((second == 0xBD) & (third >= 0x81) & (third <= 0x9A))
