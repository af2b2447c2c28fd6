"""The default vocabulary on a user's small corpus: fitted to what the corpus holds, with a warning naming the key."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

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


def test_a_corpus_with_more_characters_than_the_vocabulary_gets_the_ids_it_needs_and_a_warning_with_the_keys(
        tmp_path, caplog):
    rng = random.Random(0)
    characters = [chr(code) for code in range(0x4E00, 0x4E00 + 5000)]  # every one as frequent as the others
    documents = ["".join(rng.choice(characters) for _ in range(100)) for _ in range(400)]
    config = TokenizerConfig()  # the default 4500 ids: fewer than 5000 characters + 256 bytes + specials
    with caplog.at_level(logging.WARNING, logger="train_deploy.corpus.tokenizer"):
        info = _train(documents, tmp_path / "tokenizer", config)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("corpus.tokenizer.vocab_size: 4500 ids cannot hold the ") and "\n" not in warning
    assert "corpus.tokenizer.character_coverage" in warning and "--" not in warning
    assert f"set corpus.tokenizer.vocab_size: {info.vocab_size} or more" in warning
    assert 4500 < info.vocab_size <= 5000 + 256 + 4  # unk, bos, eos, newline: the characters coverage keeps
    encoder = TokenEncoder(info)
    assert encoder._sp.get_piece_size() == info.vocab_size
    assert encoder.decode(encoder.encode(documents[:3])[0]) == documents[0]


def test_a_vocabulary_without_byte_fallback_is_fitted_up_to_the_characters_too(tmp_path):
    info = _train(_paragraphs(2_000), tmp_path / "fitted", TokenizerConfig(vocab_size=300, byte_fallback=False))
    assert info.vocab_size > 300
    assert max(i for ids in TokenEncoder(info).encode(_paragraphs(2_000)) for i in ids) < info.vocab_size


def test_sentencepieces_refusal_names_the_projects_key_not_its_flag(tmp_path):
    import io

    from train_deploy.corpus.tokenizer import _sentencepiece, _training_failed

    config = TokenizerConfig(vocab_size=300)
    with pytest.raises(RuntimeError) as refused:  # SentencePiece's own words: "… with --character_coverage option."
        _sentencepiece(_paragraphs(2_000), config, 300, io.BytesIO(), None)
    assert "--character_coverage" in str(refused.value)
    message = str(_training_failed(refused.value, 9))
    assert message.startswith("SentencePiece training failed on 9 sentences (corpus.tokenizer): Vocabulary size")
    assert "corpus.tokenizer.character_coverage" in message and "--" not in message and "\n" not in message
