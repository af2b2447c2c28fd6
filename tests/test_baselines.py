"""N-gram baselines: equal to counts made here with plain dicts, chunking changes nothing, cached per window set."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from train_deploy.baselines import CACHE_FILE, K_GRID, Baselines, baselines_for, holdout_start, ngram_baselines
from train_deploy.evaluation import validation_windows

VOCAB = 11


def corpus(tokens: int, seed: int = 0) -> np.ndarray:
    """Tokens with structure for a bigram to find: each id mostly followed by (id · 3 + 1) mod V."""
    rng = np.random.default_rng(seed)
    out = [int(rng.integers(VOCAB))]
    for _ in range(tokens - 1):
        out.append((out[-1] * 3 + 1) % VOCAB if rng.random() < 0.6 else int(rng.integers(VOCAB - 2)))
    return np.array(out, dtype=np.uint16)


def dict_unigram(train: list[int], targets: list[int], k: float) -> float:
    counts = Counter(train)
    return -sum(math.log((counts[b] + k) / (len(train) + k * VOCAB)) for b in targets) / len(targets)


def dict_bigram(train: list[int], pairs: list[tuple[int, int]], k: float) -> float:
    pair_counts = Counter(zip(train, train[1:], strict=False))
    before = Counter(train[:-1])
    return -sum(math.log((pair_counts[(a, b)] + k) / (before[a] + k * VOCAB)) for a, b in pairs) / len(pairs)


def test_baselines_equal_a_direct_count_with_k_chosen_on_the_training_tail():
    train, valid = corpus(600).tolist(), corpus(200, seed=1)
    windows = np.stack([valid[i * 8 : i * 8 + 9] for i in range(20)]).astype(np.int64)
    cut = holdout_start(len(train))
    head, tail = train[:cut], train[cut:]
    unigram_k = min(K_GRID, key=lambda k: dict_unigram(head, tail[1:], k))
    bigram_k = min(K_GRID, key=lambda k: dict_bigram(head, list(zip(tail, tail[1:], strict=False)), k))
    pairs = [(int(a), int(b)) for row in windows for a, b in zip(row[:-1], row[1:], strict=True)]

    got = ngram_baselines(np.array(train, dtype=np.uint16), windows, VOCAB, chunk_tokens=37)

    assert (got.unigram_k, got.bigram_k) == (unigram_k, bigram_k)
    assert got.unigram_loss == pytest.approx(dict_unigram(train, [b for _, b in pairs], unigram_k), rel=1e-12)
    assert got.bigram_loss == pytest.approx(dict_bigram(train, pairs, bigram_k), rel=1e-12)
    assert (got.windows, got.seq_length, got.train_tokens) == (20, 8, 600)
    assert got.bigram_loss < got.unigram_loss  # the structure is there to find
    assert got.beaten_by(got.bigram_loss - 0.01) and not got.beaten_by(got.bigram_loss)


def test_chunked_counting_gives_the_same_table_as_one_pass():
    train, windows = corpus(500), corpus(90, seed=2)[:81].reshape(9, 9).astype(np.int64)
    whole = ngram_baselines(train, windows, VOCAB)
    for chunk in (1, 2, 50, 499):
        assert ngram_baselines(train, windows, VOCAB, chunk_tokens=chunk) == whole


def test_a_token_outside_the_vocabulary_is_named():
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside the vocabulary of {VOCAB} ids"):
        ngram_baselines(np.array([1, 2, VOCAB, 3, 4], dtype=np.uint16), np.array([[1, 2, 3]]), VOCAB)


def test_the_token_folder_caches_them_per_window_set(tiny_token_files, tmp_path):
    import shutil

    from train_deploy.handoffs import TokenManifest

    folder = tmp_path / "tokens"
    shutil.copytree(tiny_token_files.path, folder)
    (folder / CACHE_FILE).unlink(missing_ok=True)  # other tests' window sets, counted in the shared fixture
    tokens = TokenManifest.read_folder(folder)
    windows = validation_windows(tokens.prefix("valid"), tokens.dtype, 16, 4)
    first = baselines_for(tokens, windows)
    train = np.memmap(f"{tokens.prefix('train')}.bin", dtype=tokens.dtype, mode="r")
    assert first == ngram_baselines(train, windows, tokens.tokenizer.vocab_size)
    assert first.bigram_loss < first.unigram_loss

    cache = json.loads((Path(folder) / CACHE_FILE).read_text(encoding="utf-8"))
    assert cache["fingerprint"] == tokens.fingerprint and len(cache["windows"]) == 1
    (Path(tokens.prefix("train")).with_suffix(".bin")).write_bytes(b"")  # a recount would now fail
    assert baselines_for(tokens, windows) == first

    other = validation_windows(tokens.prefix("valid"), tokens.dtype, 8, 2)
    with pytest.raises(ValueError):  # another window set is counted again, from the (now empty) split
        baselines_for(tokens, other)


def test_the_description_says_when_the_model_loses_to_the_bigram():
    baselines = Baselines(unigram_loss=7.5, bigram_loss=6.0, unigram_k=1.0, bigram_k=0.01, windows=64,
                          seq_length=128, train_tokens=1000)
    assert "NOT below the bigram baseline" in baselines.describe(6.5)
    assert "below the bigram baseline" in baselines.describe(5.5) and "NOT" not in baselines.describe(5.5)
    assert baselines.metrics() == {"baseline_unigram_loss": 7.5, "baseline_bigram_loss": 6.0}
