"""LanguageModel normalises every text and prompt with the policy its bundle's tokenizer records."""

from __future__ import annotations

import logging
import shutil

import pytest

from tests.helpers.corpus import CLEANED, RAW, drop_record
from tests.helpers.export import as_older_bundle
from train_deploy.export import LanguageModel

pytestmark = pytest.mark.slow


def test_the_bundle_scores_and_continues_raw_and_cleaned_text_alike(tiny_bundle):
    model = LanguageModel.load(tiny_bundle, backend="onnx")
    assert model.normalization == "zh" and model.normalize(RAW) == CLEANED
    raw, cleaned = model.score([RAW, CLEANED])
    assert raw.text == RAW and cleaned.text == CLEANED
    assert raw.tokens == cleaned.tokens and len(raw.tokens) == len(model.tokenizer.encode([CLEANED])[0])
    assert raw.perplexity == pytest.approx(cleaned.perplexity, rel=1e-6)
    assert model.generate(RAW, 8, temperature=0) == model.generate(CLEANED, 8, temperature=0)
    sample = model.tokenizer.decode(model.tokenizer.encode(["中国人民，你好（ＡＢ）"])[0])
    assert sample == "中国人民，你好（AB）"  # what a generated sample decodes with: full-width punctuation


def test_a_bundle_whose_tokenizer_records_no_policy_takes_texts_as_given_and_says_so(tiny_bundle, tmp_path, caplog):
    old = shutil.copytree(tiny_bundle, tmp_path / "bundle", ignore=shutil.ignore_patterns("server"))
    drop_record(old / "tokenizer")
    as_older_bundle(old, 8)  # its files were not hashed then
    caplog.set_level(logging.INFO, logger="train_deploy.export.runtime")
    model = LanguageModel.load(old, backend="onnx")
    assert f"{old}: the tokenizer records no normalisation policy" in caplog.text
    assert model.normalization is None and model.normalize(RAW) == RAW
    raw, cleaned = model.score([RAW, CLEANED])
    assert len(raw.tokens) > len(cleaned.tokens)  # the full-width forms the corpus never held: bytes
