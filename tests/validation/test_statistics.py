"""Corpus statistics as the validation stage reads them equal what a direct count over the kept documents gives."""

from __future__ import annotations

import json

import numpy as np
import sentencepiece as spm

from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CleaningConfig
from train_deploy.corpus.filters import QualityFilter
from train_deploy.corpus.tokenizer import SP_MODEL_FILE, TokenEncoder
from train_deploy.validation import statistics
from train_deploy.validation.statistics import CorpusStatistics, byte_fallback_rate

CJK = ((0x3007, 0x3007), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x3FFFF))


def _kept(texts: list[str]) -> list[str]:
    """The documents the default cleaning and filters keep."""
    cleaned = Cleaner(CleaningConfig()).clean_batch(texts)
    return [text for text, reason in zip(cleaned, QualityFilter(CleaningConfig()).reasons(cleaned), strict=True)
            if reason is None]


def test_statistics_equal_a_direct_count_over_the_kept_documents(nights, night_texts, tiny_tokenizer):
    s, kept = nights["champion"], _kept(night_texts["champion"])
    assert s.duplicate_share == 0  # so the token files hold exactly these documents
    characters = sum(map(len, kept))
    assert (s.documents_read, s.documents_kept, s.characters) == (len(night_texts["champion"]), len(kept), characters)
    cjk = sum(1 for text in kept for c in text if any(low <= ord(c) <= high for low, high in CJK))
    assert s.cjk_share == cjk / characters and 0.8 < s.cjk_share < 1
    ids = [i for text in kept for i in TokenEncoder(tiny_tokenizer).encode([text])[0]]
    assert s.tokens_per_character == len(ids) / characters
    pieces = spm.SentencePieceProcessor(model_file=f"{tiny_tokenizer.path}/{SP_MODEL_FILE}")
    assert s.byte_fallback_rate == sum(map(pieces.is_byte, ids)) / len(ids) > 0  # the tiny tokenizer covers 98%
    lengths = np.array([len(text) for text in kept])
    for q, name in ((0.1, "p10"), (0.5, "p50"), (0.9, "p90")):
        exact = np.quantile(lengths, q)
        assert abs(s.length_quantiles[name] / exact - 1) < 0.1, (name, s.length_quantiles[name], exact)


def test_the_byte_fallback_rate_of_a_large_corpus_is_estimated_from_evenly_spaced_blocks(
        monkeypatch, nights, tiny_token_files, tiny_tokenizer):
    exact = byte_fallback_rate(tiny_token_files, tiny_tokenizer)
    monkeypatch.setattr(statistics, "BYTE_SAMPLE_TOKENS", 8192)  # of ~100,000: 64 blocks of 128
    assert abs(byte_fallback_rate(tiny_token_files, tiny_tokenizer) - exact) < 0.25 * exact


def test_the_versions_tag_holds_the_statistics_in_one_compact_line(nights):
    s = nights["english"]
    tag = s.compact()
    assert "\n" not in tag and " " not in tag  # its length: the next test
    assert CorpusStatistics.from_json(json.loads(tag)).documents_read == s.documents_read
    assert CorpusStatistics.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_the_versions_tag_with_the_character_shares_fits_a_sql_stores_5000_characters(nights):
    tags = {name: night.compact() for name, night in nights.items()}
    assert max(len(tag) for tag in tags.values()) <= 5000, {name: len(tag) for name, tag in tags.items()}
    assert len(json.loads(tags["champion"])["character_shares"]) == 257  # the top 256 characters and other
    assert not {" ", "\n"} & json.loads(tags["english"])["character_shares"].keys()
