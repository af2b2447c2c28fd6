"""Document cleaning: Unicode normalisation, control and ANSI removal, whitespace normalisation, optional t2s.

Cleaning runs on batches: the documents are joined with a separator and every rule is a vectorised
pass over the UTF-32 code points of the joined text. NFKC is a table lookup for characters whose NFKC
form is one to four characters (``℃`` → ``°C``) that cannot interact with their neighbours (no combining
marks, no canonical composition partners); a document holding any other character, or an ANSI escape, is cleaned by
``Cleaner.clean_one``, the same rules as regular expressions and ``unicodedata.normalize``. Both paths
give identical results (tested).

Normalisation policies (``corpus.cleaning.normalization``, :func:`normalize`):

- ``nfkc``: Unicode NFKC.
- ``zh`` (default): NFKC, except that the punctuation of Chinese text is kept as written. The text is cut at
  every kept character, each piece between them is NFKC-normalised, and the kept characters stay. Kept
  (:data:`ZH_KEPT`):

  * the CJK Symbols and Punctuation block U+3001–U+303F (``、。〈〉《》「」『』【】〔〕〖〗〜〃`` …; NFKC changes
    only 〶 and the Hangzhou numerals 〸〹〺 there), except the ideographic tone marks U+302A–U+302F, which
    are combining marks NFKC leaves alone (they keep NFKC's canonical ordering);
  * the full-width punctuation of Chinese prose: ``！＂＇（），：；？［］｛｝～｟｠``;
  * the ellipsis ``…`` U+2026 (the Chinese 省略号 is ``……``; NFKC would write ``......``).

  Still folded as NFKC does: full-width Latin letters and digits (``ＡＢＣ１２３`` → ``ABC123``), the ideographic
  space U+3000 (→ a space, then whitespace normalisation), the full-width symbols that sit inside numbers,
  code and formulas (``＃＄％＆＊＋－．／＜＝＞＠＼＾＿｀｜`` → ASCII, so ``１．５％`` → ``1.5%``, not ``1．5％``),
  the half-width CJK forms (``｡｢｣､･`` → ``。「」、・``), and the small and vertical presentation forms
  U+FE10–FE19, U+FE30–FE6B (``﹐`` → ``,``) as NFKC maps them.
- ``none``: no normalisation.

The tokenizer trained on the corpus carries the same policy as SentencePiece normalisation rules
(:func:`normalization_rules`), so new text is folded like the corpus wherever the tokenizer is used.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

from train_deploy.cache import cached_arrays
from train_deploy.corpus.config import CleaningConfig
from train_deploy.corpus.native import compiled

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

Normalization = Literal["zh", "nfkc", "none"]
ZH_KEPT = ("".join(chr(cp) for cp in range(0x3001, 0x3040) if not 0x302A <= cp <= 0x302F)
           + "！＂＇（），：；？［］｛｝～｟｠…")
"""What the ``zh`` policy keeps as written (see the module docstring): none of them is a combining mark."""
_ZH_KEPT_RUNS = re.compile(f"([{re.escape(ZH_KEPT)}]+)")


def normalize(text: str, policy: Normalization) -> str:
    """``text`` under a normalisation policy: the reference for the tables and the tokenizer's rules."""
    if policy == "none" or text.isascii():
        return text
    if policy == "nfkc":
        return unicodedata.normalize("NFKC", text)
    pieces = _ZH_KEPT_RUNS.split(text)  # odd places: runs of kept characters
    pieces[::2] = [unicodedata.normalize("NFKC", piece) for piece in pieces[::2]]
    return "".join(pieces)


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
        """Return the cleaned text of every document, in order (possibly empty strings).

        Vectorised over the UTF-32 code points of the joined batch; documents that the tables cannot
        handle exactly (characters with context-dependent NFKC, ANSI escapes) take :meth:`clean_one`.
        """
        c = self.config
        joined = _SEPARATOR.join(texts)
        if joined.count(_SEPARATOR) != len(texts) - 1 or (c.strip_control and "\x1b" in joined):
            return [self.clean_one(text) for text in texts]
        codes = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
        slow: np.ndarray = np.zeros(0, dtype=np.int64)
        if c.normalization != "none":
            original = codes
            codes, unsafe = _nfkc_fold(codes, c.normalization)
            if len(unsafe):  # indices into the original codes: the documents that hold them
                slow = np.unique(np.searchsorted(np.flatnonzero(original == ord(_SEPARATOR)), unsafe))
        codes = _clean_codes(codes, strip_control=c.strip_control, normalize_whitespace=c.normalize_whitespace)
        docs = codes.tobytes().decode("utf-32-le").split(_SEPARATOR)
        if c.normalize_whitespace:
            docs = [doc.strip() for doc in docs]
        if self._t2s is not None:
            docs = [self._t2s(doc) for doc in docs]
        for index in slow.tolist():
            docs[index] = self.clean_one(texts[index])
        return docs

    def clean_one(self, text: str) -> str:
        """The cleaning rules as regular expressions, one document: the reference for ``clean_batch``."""
        c = self.config
        text = normalize(text, c.normalization)
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


def _clean_codes(codes: np.ndarray, *, strip_control: bool, normalize_whitespace: bool) -> np.ndarray:
    """The regular-expression rules of :meth:`Cleaner.clean_one` (after normalisation) on code points."""
    if compiled is None:
        return clean_codes_numpy(codes, strip_control=strip_control, normalize_whitespace=normalize_whitespace)
    control, space = _class_tables()
    codes = np.require(codes, dtype=np.uint32, requirements=["C", "W"])  # the kernel compacts it in place
    return codes[: compiled.clean_codes(codes, control, space, strip_control, normalize_whitespace)]


def clean_codes_numpy(codes: np.ndarray, *, strip_control: bool, normalize_whitespace: bool) -> np.ndarray:
    """The numpy version of :func:`_clean_codes`: the reference the compiled kernel is tested against."""
    control, space = _class_tables()
    if strip_control or normalize_whitespace:
        codes = codes[~((codes == 0x0D) & (np.append(codes[1:], 0) == 0x0A))]  # \r\n → \n
        line_end = (codes == 0x0D) | (codes == 0x2028) | (codes == 0x2029) | (codes == 0x85)
        codes = np.where(line_end, 0x0A, codes)
    bmp = np.minimum(codes, 0xFFFF)
    if strip_control:
        codes = codes[~(control[bmp] & (codes <= 0xFFFF))]
        bmp = np.minimum(codes, 0xFFFF)
    if normalize_whitespace:
        codes = np.where(space[bmp] & (codes <= 0xFFFF), 0x20, codes)
        blank = codes == 0x20
        codes = codes[~(blank & _shifted(blank, 1))]  # runs of spaces → one space
        newline, blank = codes == 0x0A, codes == 0x20
        codes = codes[~(blank & (_shifted(newline, 1) | _shifted(newline, -1)))]  # no space beside a line break
        newline = codes == 0x0A
        codes = codes[~(newline & _shifted(newline, 1) & _shifted(newline, 2))]  # at most one blank line
    return codes


def _shifted(flags: np.ndarray, by: int) -> np.ndarray:
    """``flags`` moved ``by`` places to the right (left when negative), padded with False."""
    out = np.zeros_like(flags)
    if by > 0:
        out[by:] = flags[:-by]
    else:
        out[:by] = flags[-by:]
    return out


def _class_tables() -> tuple[np.ndarray, np.ndarray]:
    """BMP tables: characters `_CONTROL` removes, and whitespace other than the newline."""
    tables = _tables()
    return tables["control"], tables["space"]


@functools.cache
def _nfkc_tables(policy: Normalization = "nfkc") -> tuple[np.ndarray, np.ndarray]:
    """For each BMP code point, its form under ``policy`` (``nfkc`` or ``zh``) when it may be normalised on its
    own: ``mapping[j]`` is the j-th character, ``lengths`` how many (0: it may not; its document takes the
    exact slow path). ``zh`` is the NFKC tables with each kept character mapped to itself: the text between
    kept characters is NFKC-normalised piece by piece, so a kept character never interacts with a neighbour."""
    tables = _tables()
    mapping, lengths = tables["mapping"], tables["lengths"]
    if policy == "zh":
        kept = np.array([ord(ch) for ch in ZH_KEPT], dtype=np.int64)
        mapping, lengths = mapping.copy(), lengths.copy()
        mapping[0, kept], lengths[kept] = kept, 1
    return mapping, lengths


_MAX_EXPANSION = 4  # longer NFKC forms (a few Arabic ligatures) take the slow path
_TABLES = {"control": ((0x10000,), np.bool_), "space": ((0x10000,), np.bool_),
           "mapping": ((_MAX_EXPANSION, 0x10000), np.uint32), "lengths": ((0x10000,), np.uint8)}


@functools.cache
def _tables() -> dict[str, np.ndarray]:
    """The BMP tables, built once per machine: building them takes ~40 ms of Python in every process that
    cleans (each encoding worker, before its first chunk), loading them ~2 ms. The cache is keyed by this
    module's source and the Unicode version, so a change to either builds new tables."""
    key = unicodedata.unidata_version.encode() + Path(__file__).read_bytes()
    return cached_arrays("unicode-tables", key, _TABLES, _build_tables)


def _build_tables() -> dict[str, np.ndarray]:
    control, space = _build_class_tables()
    mapping, lengths = _build_nfkc_tables()
    return {"control": control, "space": space, "mapping": mapping, "lengths": lengths}


def _build_class_tables() -> tuple[np.ndarray, np.ndarray]:
    bmp = "".join(map(chr, range(0x10000)))  # one regex scan each instead of 65,536 calls
    control, space = np.zeros(0x10000, dtype=bool), np.zeros(0x10000, dtype=bool)
    for table, pattern in ((control, _CONTROL), (space, _SPACES)):  # re's \s is str.isspace()
        for match in pattern.finditer(bmp):
            table[match.start() : match.end()] = True
    return control, space


def _line_break(match: re.Match[str]) -> str:
    return "\n\n" if match.group().count("\n") > 1 else "\n"


def _build_nfkc_tables() -> tuple[np.ndarray, np.ndarray]:
    size = 0x10000
    decompositions = {cp: d for cp in range(size) if (d := unicodedata.decomposition(chr(cp)))}
    partners = {0x1161 + i for i in range(21)} | {0x11A8 + i for i in range(27)}  # Hangul V and T jamo
    for d in decompositions.values():
        if not d.startswith("<") and len(parts := d.split()) == 2:
            partners.add(int(parts[1], 16))
    lengths = np.ones(size, dtype=np.uint8)
    lengths[0xD800:0xE000] = 0  # surrogates
    mapping = np.zeros((_MAX_EXPANSION, size), dtype=np.uint32)
    mapping[0] = np.arange(size, dtype=np.uint32)
    for cp in range(size):
        ch = chr(cp)
        if cp in partners or unicodedata.combining(ch):
            lengths[cp] = 0
        elif cp in decompositions or not unicodedata.is_normalized("NFKC", ch):
            folded = unicodedata.normalize("NFKC", ch)
            first = unicodedata.normalize("NFKD", ch)[:1]
            if (0 < len(folded) <= _MAX_EXPANSION and ord(first) not in partners
                    and not any(unicodedata.combining(f) or ord(f) in partners for f in folded)):
                mapping[: len(folded), cp] = [ord(f) for f in folded]
                lengths[cp] = len(folded)
            else:
                lengths[cp] = 0
    return mapping, lengths


def _nfkc_fold(codes: np.ndarray, policy: Normalization = "nfkc") -> tuple[np.ndarray, np.ndarray]:
    """Table normalisation of ``codes`` under ``policy`` (``nfkc`` or ``zh``), and the indices of the code points
    the tables cannot fold alone. The kernel is the same for both: the policy is in the tables."""
    mapping, lengths = _nfkc_tables(policy)
    if compiled is not None:
        folded, unsafe = compiled.nfkc_fold(codes, mapping, lengths)
        return np.frombuffer(folded, dtype=np.uint32), np.frombuffer(unsafe, dtype=np.int64)
    return nfkc_fold_numpy(codes, policy)


def nfkc_fold_numpy(codes: np.ndarray, policy: Normalization = "nfkc") -> tuple[np.ndarray, np.ndarray]:
    """The numpy version of :func:`_nfkc_fold`: the reference the compiled kernel is tested against."""
    mapping, lengths = _nfkc_tables(policy)
    bmp = np.minimum(codes, 0xFFFF)
    count = np.where(codes <= 0xFFFF, lengths[bmp], 0)
    return _expand(codes, bmp, count, mapping), np.flatnonzero(count == 0)


def _expand(codes: np.ndarray, bmp: np.ndarray, count: np.ndarray, mapping: np.ndarray) -> np.ndarray:
    """Each code point with ``count`` > 0 replaced by its ``count`` NFKC characters; the others kept."""
    out = np.where(count > 0, mapping[0, bmp], codes)
    multi = np.flatnonzero(count > 1)  # rare (…, ℃, Ⅱ): insert their further characters after them
    if not len(multi):
        return out
    extra = count[multi].astype(np.int64) - 1
    owner = np.repeat(np.arange(len(multi)), extra)
    position = np.arange(len(owner)) - np.repeat(np.cumsum(extra) - extra, extra) + 1
    return np.insert(out, np.repeat(multi + 1, extra), mapping[position, bmp[multi][owner]])
