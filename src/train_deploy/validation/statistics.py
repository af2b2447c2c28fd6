"""Statistics of a corpus as the corpus stage encoded it: what the data gate compares night by night.

Everything comes from what the stage wrote beside its token files (``manifest.json`` and ``quality.json``,
counted while the documents passed through the workers), except the byte-fallback rate, which counts the
tokenizer's byte pieces in the token files: all of them up to :data:`BYTE_SAMPLE_TOKENS` tokens, else
that many in evenly spaced blocks (a few milliseconds, whatever the corpus's size), and what the text says
(:mod:`.content`): the character shares of a seeded sample of the kept documents, and, given a model, its loss on
that sample in nats per character.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.corpus.report import FINE_PER_OCTAVE, CorpusQuality
from train_deploy.corpus.tokenizer import SP_MODEL_FILE
from train_deploy.handoffs import TokenizerInfo, TokenManifest
from train_deploy.validation.content import (
    SampleScores,
    character_distance,
    character_shares,
    draw_sample,
    score_sample,
)

SCHEMA = 2
QUANTILES = (0.1, 0.5, 0.9)
BYTE_SAMPLE_TOKENS = 1 << 22
_BLOCKS = 64
DUPLICATE_REASONS = ("duplicate", "near_duplicate")


@dataclass(kw_only=True, slots=True)
class CorpusStatistics:
    """One night's corpus in numbers (JSON: :meth:`to_json`; the champion's is a tag of its version). A value
    that the token files' report does not hold (written by an older version) is None and is not compared."""

    schema: int = SCHEMA
    """Version of this record's layout."""
    documents_read: int
    """Documents the readers produced."""
    documents_kept: int
    """Documents written to the token files (after the filters and de-duplication)."""
    characters: int | None
    """Characters of the documents the filters kept (before de-duplication)."""
    tokens: int
    """Tokens written (end-of-document ids included)."""
    tokens_per_character: float | None
    """Tokens per character of the documents the filters kept, end-of-document ids left out."""
    length_quantiles: dict[str, float] | None
    """Characters per kept document at the 10%, 50% and 90% quantiles (``p10``, ``p50``, ``p90``; within 9%:
    from bins of an eighth of an octave)."""
    cjk_share: float | None
    """CJK ideographs among the characters kept."""
    drop_shares: dict[str, float] = field(default_factory=dict)
    """Drop reason (a filter's, ``duplicate``, ``near_duplicate``) → its share of the documents read."""
    duplicate_share: float = 0.0
    """Exact and near duplicates among the documents read."""
    near_duplicate_share: float = 0.0
    """Near duplicates (MinHash) among the documents read."""
    byte_fallback_rate: float | None = None
    """Byte-fallback pieces among the tokens (end-of-document ids left out); None without byte pieces."""
    nats_per_char: float | None = None
    """A model's loss on the seeded sample of the kept documents, in nats per character (:mod:`.content`): on a
    registered version, the version's own on its own corpus; tonight, the champion's. None: not scored."""
    documents_scored: int = 0
    """The sample's documents that ``nats_per_char`` was measured on."""
    character_shares: dict[str, float] | None = None
    """The shares of the most frequent characters of the sample, and ``other`` for the rest (a few kB)."""
    character_distance: float | None = None
    """Tonight: the Jensen–Shannon distance (0 to 1) of the sample's characters from the champion's
    ``character_shares``; None without them."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CorpusStatistics:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    def compact(self) -> str:
        """The record as one line of JSON, rounded: what the registered version's tag holds."""
        # characters as themselves, not \\u escapes: a version's tag holds at most 5,000 characters in a SQL store
        return json.dumps(_rounded(self.to_json()), separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def corpus_statistics(manifest: TokenManifest, tokenizer: TokenizerInfo, model: str | Path | None = None,
                      champion: CorpusStatistics | None = None) -> CorpusStatistics:
    """The statistics of the published token files ``manifest`` encoded with ``tokenizer``; with ``model`` (a
    bundle folder), its loss on their sample; with ``champion``, the distance from its character shares."""
    return measure_corpus(manifest, tokenizer, model, champion)[0]


def measure_corpus(manifest: TokenManifest, tokenizer: TokenizerInfo, model: str | Path | None = None,
                   champion: CorpusStatistics | None = None) -> tuple[CorpusStatistics, SampleScores | None]:
    """:func:`corpus_statistics`, and ``model``'s score of each sampled text (None without a model)."""
    statistics = counted_statistics(manifest, tokenizer)
    sample = draw_sample(manifest, tokenizer)
    statistics.character_shares = character_shares(sample.counts) or None
    if champion is not None and champion.character_shares:
        statistics.character_distance = character_distance(sample.counts, champion.character_shares)
    if model is None:
        return statistics, None
    from train_deploy.export.runtime import LanguageModel

    scores = score_sample(LanguageModel.load(model), sample.texts)
    statistics.nats_per_char = scores.nats_per_char if len(scores.texts) else None
    statistics.documents_scored = len(scores.texts)
    return statistics, scores


def counted_statistics(manifest: TokenManifest, tokenizer: TokenizerInfo) -> CorpusStatistics:
    """The statistics the corpus stage counted, and the byte-fallback rate (no text figures)."""
    quality = CorpusQuality.of(manifest)
    sample, read = quality.sample, max(manifest.documents.read, 1)
    filtered = sum(sample.kept_chars)  # documents the filters kept: each counted once in the histogram
    counted = sample.kept_characters > 0 or filtered == 0  # False: a report from before these counts
    shares = {reason: count / read for reason, count in sorted(manifest.documents.dropped.items())}
    characters = sample.kept_characters if counted else None
    before_dedup = manifest.tokens.get("encoded_before_dedup", manifest.tokens["total"])
    return CorpusStatistics(
        documents_read=manifest.documents.read, documents_kept=manifest.documents.kept, characters=characters,
        tokens=manifest.tokens["total"],
        tokens_per_character=(before_dedup - filtered) / characters if characters else None,
        length_quantiles=length_quantiles(sample.kept_fine) if counted and filtered else None,
        cjk_share=sample.kept_cjk / characters if characters else None,
        drop_shares=shares, duplicate_share=sum(shares.get(reason, 0.0) for reason in DUPLICATE_REASONS),
        near_duplicate_share=shares.get("near_duplicate", 0.0),
        byte_fallback_rate=byte_fallback_rate(manifest, tokenizer))


def length_quantiles(fine_bins: list[int]) -> dict[str, float]:
    """The :data:`QUANTILES` of lengths counted in fine bins (``corpus.report.FINE_BINS``), interpolated
    geometrically within a bin."""
    counts = np.asarray(fine_bins, dtype=np.float64)
    cumulative = np.cumsum(counts)
    found = {}
    for q in QUANTILES:
        rank = q * cumulative[-1]
        k = int(np.searchsorted(cumulative, rank, side="left"))
        if k == 0:
            found[f"p{round(q * 100)}"] = 0.0
            continue
        inside = (rank - (cumulative[k - 1] - counts[k])) / counts[k] if counts[k] else 0.0
        found[f"p{round(q * 100)}"] = 2 ** ((k - 1 + inside) / FINE_PER_OCTAVE)
    return found


def byte_fallback_rate(manifest: TokenManifest, tokenizer: TokenizerInfo) -> float | None:
    """Byte pieces among the non-end-of-document tokens of the token files (see the module's docstring)."""
    pieces = byte_piece_ids(tokenizer)
    if pieces is None:
        return None
    lookup = np.zeros(max(tokenizer.vocab_size, int(pieces.max(initial=0)) + 1, tokenizer.eos_id + 1), dtype=np.int8)
    lookup[pieces] = 1
    lookup[tokenizer.eos_id] = 2
    files = [Path(manifest.path) / f"{split.prefix}.bin" for split in manifest.splits.values() if split.tokens]
    total = sum(split.tokens for split in manifest.splits.values())
    counts = np.zeros(3, dtype=np.int64)
    for file in files:
        tokens = np.memmap(file, dtype=np.dtype(manifest.dtype), mode="r")
        share = BYTE_SAMPLE_TOKENS * len(tokens) / max(total, 1)
        for start, stop in _blocks(len(tokens), share):
            counts += np.bincount(lookup[np.asarray(tokens[start:stop])], minlength=3)
        del tokens
    return float(counts[1] / max(counts[0] + counts[1], 1))


def byte_piece_ids(tokenizer: TokenizerInfo) -> np.ndarray | None:
    """Ids of the tokenizer's byte-fallback pieces (``<0x00>`` … ``<0xFF>``), or None when it has none or is not
    a SentencePiece model."""
    model = Path(tokenizer.path) / SP_MODEL_FILE
    if not model.is_file():
        return None
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model))
    ids = np.array([i for i in range(processor.get_piece_size()) if processor.is_byte(i)], dtype=np.int64)
    return ids if len(ids) else None


def _blocks(length: int, budget: float) -> list[tuple[int, int]]:
    """Spans of ``length`` tokens to count: all of them within ``budget``, else :data:`_BLOCKS` even blocks."""
    if length <= budget:
        return [(0, length)]
    size = max(1, int(budget) // _BLOCKS)
    return [(start, start + size) for start in np.linspace(0, length - size, _BLOCKS).astype(np.int64).tolist()]


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value
