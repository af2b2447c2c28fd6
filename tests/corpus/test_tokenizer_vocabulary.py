"""The default vocabulary on a user's small corpus: fitted to what the corpus holds, with a warning naming the key."""

from __future__ import annotations

import logging
from pathlib import Path

from train_deploy.corpus.config import TokenizerConfig
from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path
from train_deploy.corpus.tokenizer import TokenEncoder, tokenizer_is_current, train_tokenizer, training_sentences


def _paragraphs(size: int) -> list[str]:
    """People's Daily paragraphs from the start, about ``size`` bytes of UTF-8."""
    lines = strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines())
    kept, total = [], 0
    for line in (line for line in lines if line.strip()):
        if total >= size:
            break
        kept.append(line)
        total += len(line.encode("utf-8"))
    return kept


def _train(documents: list[str], folder: Path, config: TokenizerConfig):
    folder.mkdir()
    return train_tokenizer(training_sentences(documents, config.max_sentence_chars), config, folder, "fingerprint",
                           normalization="zh")


def test_the_default_settings_train_a_tokenizer_on_a_200kb_corpus(tmp_path, caplog):
    documents = _paragraphs(200_000)
    config = TokenizerConfig()
    with caplog.at_level(logging.WARNING, logger="train_deploy.corpus.tokenizer"):
        info = _train(documents, tmp_path / "tokenizer", config)
    assert info.vocab_size == config.vocab_size
    assert TokenEncoder(info)._sp.get_piece_size() == config.vocab_size
    assert not [r for r in caplog.records if "vocab_size" in r.getMessage()]


def test_a_corpus_too_small_for_the_vocabulary_gets_the_ids_it_has_and_a_warning_with_the_value(tmp_path, caplog):
    documents = _paragraphs(10_000)
    config = TokenizerConfig(vocab_size=8000)  # the old default, which such a corpus failed with
    with caplog.at_level(logging.WARNING, logger="train_deploy.corpus.tokenizer"):
        info = _train(documents, tmp_path / "tokenizer", config)
    encoder = TokenEncoder(info)
    assert 261 < info.vocab_size < config.vocab_size
    assert encoder._sp.get_piece_size() == info.vocab_size  # what the model's vocabulary will follow
    ids = [i for ids in encoder.encode(documents) for i in ids]
    assert max(ids) < info.vocab_size
    assert tokenizer_is_current(info, "fingerprint")
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("corpus.tokenizer.vocab_size: ") and "\n" not in warning
    assert f"set corpus.tokenizer.vocab_size: {info.vocab_size}" in warning and "8000" in warning

    again = _train(documents, tmp_path / "again", config)  # the same corpus and settings fit the same way
    assert again.vocab_size == info.vocab_size and again.hash == info.hash
