"""What the cleaning did, for a person: length histograms, drop reasons, and examples of kept and dropped documents.

The encoding workers count document lengths into fixed power-of-two bins and keep the first few documents
of each outcome per chunk (:class:`QualitySample`); the parent adds them up in chunk order, so the report
is the same for any worker count, and writes it beside the token files (``quality.json``). The corpus
stage turns it into a PNG and a text file that the catalog logs to MLflow.

The same pass also counts what the data gate compares night by night (``train_deploy.validation``): the
characters and CJK ideographs of the documents the filters keep, and their lengths in finer bins (eight per
octave) for quantiles. A report written before these counts existed holds zeros there.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.handoffs import TokenManifest

REPORT_FILE = "quality.json"
BINS = 32
"""Length bins: bin ``k`` holds lengths in ``[2**(k-1), 2**k)`` (bin 0: empty documents)."""
FINE_PER_OCTAVE = 8
FINE_BINS = FINE_PER_OCTAVE * BINS
"""Fine length bins: bin ``k >= 1`` holds lengths in ``[2**((k-1)/8), 2**(k/8))`` (bin 0: empty documents)."""
CJK_RANGES = ((0x3007, 0x3007), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x3FFFF))
"""CJK ideographs (with 〇, the ideographic zero), as ``corpus.filters`` counts them for ``min_cjk_share``."""
EXAMPLES = 3
EXAMPLE_CHARS = 400
KEPT = "kept"


def length_bins(lengths: np.ndarray) -> np.ndarray:
    """Counts of ``lengths`` per power-of-two bin (see :data:`BINS`)."""
    bins = np.zeros(BINS, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths):
        index = np.minimum(np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64) + (lengths > 0), BINS - 1)
        np.add.at(bins, index, 1)
    return bins


def fine_length_bins(lengths: np.ndarray) -> np.ndarray:
    """Counts of ``lengths`` per fine bin (see :data:`FINE_BINS`)."""
    bins = np.zeros(FINE_BINS, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths):
        octaves = np.log2(np.maximum(lengths, 1)) * FINE_PER_OCTAVE
        index = np.minimum(np.floor(octaves + 1e-9).astype(np.int64) + (lengths > 0), FINE_BINS - 1)
        np.add.at(bins, index, 1)
    return bins


def cjk_characters(texts: list[str]) -> int:
    """How many characters of ``texts`` are CJK ideographs (:data:`CJK_RANGES`)."""
    if not texts:
        return 0
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    return int(sum(np.count_nonzero((codes >= low) & (codes <= high)) for low, high in CJK_RANGES))


@dataclass(slots=True)
class QualitySample:
    """Per chunk (then summed): character lengths of kept and dropped documents and the first few of each."""

    kept_chars: list[int] = field(default_factory=lambda: [0] * BINS)
    dropped_chars: list[int] = field(default_factory=lambda: [0] * BINS)
    examples: dict[str, list[str]] = field(default_factory=dict)
    """Outcome (``kept`` or a drop reason) → the first documents with it, cut to ``EXAMPLE_CHARS``."""
    kept_characters: int = 0
    """Characters of the documents the filters kept (before de-duplication)."""
    kept_cjk: int = 0
    """Of those, CJK ideographs (:data:`CJK_RANGES`)."""
    kept_fine: list[int] = field(default_factory=lambda: [0] * FINE_BINS)
    """Character lengths of the kept documents per fine bin (:data:`FINE_BINS`), for length quantiles."""

    def add(self, texts: list[str], reasons: list[str | None]) -> None:
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        dropped = np.array([r is not None for r in reasons], dtype=bool)
        self.kept_chars = (np.asarray(self.kept_chars) + length_bins(lengths[~dropped])).tolist()
        self.dropped_chars = (np.asarray(self.dropped_chars) + length_bins(lengths[dropped])).tolist()
        self.kept_fine = (np.asarray(self.kept_fine) + fine_length_bins(lengths[~dropped])).tolist()
        self.kept_characters += int(lengths[~dropped].sum())
        self.kept_cjk += cjk_characters([text for text, reason in zip(texts, reasons, strict=True) if reason is None])
        for text, reason in zip(texts, reasons, strict=True):
            self.example(reason or KEPT, text)

    def example(self, outcome: str, text: str) -> None:
        chosen = self.examples.setdefault(outcome, [])
        if len(chosen) < EXAMPLES:
            chosen.append(text[:EXAMPLE_CHARS])

    def merge(self, other: QualitySample) -> None:
        """Add ``other`` (a later chunk): histograms summed, its examples after these."""
        self.kept_chars = [a + b for a, b in zip(self.kept_chars, other.kept_chars, strict=True)]
        self.dropped_chars = [a + b for a, b in zip(self.dropped_chars, other.dropped_chars, strict=True)]
        self.kept_fine = [a + b for a, b in zip(self.kept_fine, other.kept_fine, strict=True)]
        self.kept_characters += other.kept_characters
        self.kept_cjk += other.kept_cjk
        for outcome, texts in other.examples.items():
            for text in texts:
                self.example(outcome, text)


@dataclass(slots=True)
class CorpusQuality:
    """The report written beside the token files."""

    sample: QualitySample
    token_bins: list[int]
    """Token counts (end-of-document id included) of the documents written, per power-of-two bin."""
    dropped: dict[str, int]
    read: int
    kept: int

    def write(self, folder: Path) -> None:
        (Path(folder) / REPORT_FILE).write_text(json.dumps(asdict(self), ensure_ascii=False, indent=1),
                                                encoding="utf-8")

    @classmethod
    def of(cls, manifest: TokenManifest) -> CorpusQuality:
        """The report of a published token folder."""
        data: dict[str, Any] = json.loads((Path(manifest.path) / REPORT_FILE).read_text(encoding="utf-8"))
        return cls(sample=QualitySample(**data.pop("sample")), **data)


def report_figure(quality: CorpusQuality):
    """Three panels: characters per document (kept and dropped), tokens per kept document, and drop reasons."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (chars, tokens, reasons) = plt.subplots(1, 3, figsize=(13, 3.6))
    edges = [f"<{2**k}" if k else "0" for k in range(BINS)]
    last = max(_last_used(quality.sample.kept_chars), _last_used(quality.sample.dropped_chars), 1) + 1
    x = np.arange(last)
    chars.bar(x - 0.2, quality.sample.kept_chars[:last], 0.4, label="kept", color="#3b7dd8")
    chars.bar(x + 0.2, quality.sample.dropped_chars[:last], 0.4, label="dropped by filters", color="#c0392b")
    chars.set_title("characters per document")
    chars.legend(fontsize="small")
    last_tokens = max(_last_used(quality.token_bins), 1) + 1
    tokens.bar(np.arange(last_tokens), quality.token_bins[:last_tokens], color="#3b7dd8")
    tokens.set_title("tokens per document written")
    for axis, used in ((chars, last), (tokens, last_tokens)):
        axis.set_xticks(np.arange(used), edges[:used], rotation=60, fontsize="x-small")
        axis.set_yscale("symlog")
    counts = Counter({KEPT: quality.kept, **{k: v for k, v in quality.dropped.items() if v}})
    names = list(counts)
    reasons.barh(names, [counts[n] for n in names], color=["#3b7dd8"] + ["#c0392b"] * (len(names) - 1))
    reasons.set_xscale("symlog")
    reasons.set_title(f"{quality.read:,} documents read")
    for i, name in enumerate(names):
        reasons.text(counts[name], i, f" {counts[name]:,}", va="center", fontsize="small")
    figure.tight_layout()
    return figure


def examples_text(quality: CorpusQuality) -> str:
    """The examples of every outcome, as plain text (UTF-8)."""
    lines = [f"{quality.read} documents read, {quality.kept} kept; dropped: "
             + (", ".join(f"{k} {v}" for k, v in quality.dropped.items() if v) or "none"), ""]
    for outcome, texts in quality.sample.examples.items():
        count = quality.kept if outcome == KEPT else quality.dropped.get(outcome, 0)
        lines.append(f"== {outcome} ({count}) ==")
        for text in texts:
            lines.extend(["---", text])
        lines.append("")
    return "\n".join(lines)


def _last_used(bins: list[int]) -> int:
    used = [i for i, count in enumerate(bins) if count]
    return used[-1] if used else 0
