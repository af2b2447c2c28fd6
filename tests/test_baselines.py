"""N-gram baselines: equal to counts made here with plain dicts, Kneser–Ney distributions that sum to 1 and equal a
value worked by hand, k and discounts chosen on the training split's tail, chunking changes nothing, cached per
window set, and a verdict against the strongest."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from train_deploy import baselines as baselines_module
from train_deploy.baselines import (
    CACHE_FILE,
    DISCOUNT_GRID,
    K_GRID,
    Baselines,
    KneserNey,
    baselines_for,
    count_ngrams,
    holdout_start,
    ngram_baselines,
)
from train_deploy.training.evaluation import validation_windows

VOCAB = 11


def corpus(tokens: int, seed: int = 0) -> np.ndarray:
    """Tokens with structure for a bigram to find: each id mostly followed by (id · 3 + 1) mod V."""
    rng = np.random.default_rng(seed)
    out = [int(rng.integers(VOCAB))]
    for _ in range(tokens - 1):
        out.append((out[-1] * 3 + 1) % VOCAB if rng.random() < 0.6 else int(rng.integers(VOCAB - 2)))
    return np.array(out, dtype=np.uint16)


def corpus3(tokens: int, seed: int = 0) -> np.ndarray:
    """Tokens with structure only a trigram finds: each id mostly (2·a + 3·b + 1) mod V after a, b."""
    rng = np.random.default_rng(seed)
    out = [int(rng.integers(VOCAB)), int(rng.integers(VOCAB))]
    for _ in range(tokens - 2):
        out.append((2 * out[-2] + 3 * out[-1] + 1) % VOCAB if rng.random() < 0.7 else int(rng.integers(VOCAB - 2)))
    return np.array(out, dtype=np.uint16)


def dict_unigram(train: list[int], targets: list[int], k: float) -> float:
    counts = Counter(train)
    return -sum(math.log((counts[b] + k) / (len(train) + k * VOCAB)) for b in targets) / len(targets)


def dict_bigram(train: list[int], pairs: list[tuple[int, int]], k: float) -> float:
    pair_counts = Counter(zip(train, train[1:], strict=False))
    before = Counter(train[:-1])
    return -sum(math.log((pair_counts[(a, b)] + k) / (before[a] + k * VOCAB)) for a, b in pairs) / len(pairs)


def dict_kneser_ney(train: list[int], discounts: list[float]):
    """``p(history, w)`` under interpolated Kneser–Ney of order ``len(discounts)`` (2 or 3), counted with dicts:
    each level ``(max(c(h w) − D, 0) + D · N1+(h ·) · lower) / c(h ·)``, or ``lower`` for an unseen ``h``; the
    levels below the highest count distinct tokens before (continuations); the unigram one mixes in 1/V."""
    pairs = Counter(zip(train, train[1:], strict=False))
    triples = Counter(zip(train, train[1:], train[2:], strict=False))
    continuation = Counter(b for _, b in pairs)               # N1+(· b): distinct a before b
    middle = Counter((b, c) for _, b, c in triples)           # N1+(· b c): distinct a before (b, c)

    def level(table: Counter, h: tuple, w: int, d: float, lower: float) -> float:
        after = {key[-1]: n for key, n in table.items() if key[:-1] == h}
        total = sum(after.values())
        return (max(after.get(w, 0) - d, 0) + d * len(after) * lower) / total if total else lower

    def p(history: tuple, w: int) -> float:
        d = discounts
        unigram = (max(continuation[w] - d[0], 0) + d[0] * len(continuation) / VOCAB) / len(pairs)
        if len(d) == 2:
            return level(pairs, history[-1:], w, d[1], unigram)
        return level(triples, history[-2:], w, d[2], level(middle, history[-1:], w, d[1], unigram))

    return p


def dict_kn_loss(train: list[int], grams: list[tuple], discounts: list[float]) -> float:
    """Mean ``-log p`` of the last token of each of ``grams`` after the others, under :func:`dict_kneser_ney`."""
    p = dict_kneser_ney(train, discounts)
    return -sum(math.log(p(gram[:-1], gram[-1])) for gram in grams) / len(grams)


def grams(tokens: list[int], n: int) -> list[tuple]:
    return list(zip(*(tokens[i:] for i in range(n)), strict=False))


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


def test_kneser_ney_equals_the_value_worked_by_hand_on_a_toy_corpus():
    # a b a b c (a=0, b=1, c=2; id 3 never seen), every discount 0.5:
    # pairs ab ×2, ba, bc: 3 types; each of a, b, c continues 1 of them: P1(w) = (1 − .5 + .5·3/4) / 3 = 0.875/3
    # bigram P(b | a) = (2 − .5)/2 + .5·1/2·P1(b) = 0.75 + 0.25·0.875/3
    # trigram P(c | a b): triples aba, bab, abc; c(ab ·) = 2 over 2 types. The middle level counts continuations:
    # (b a) and (b c) are each seen after one token, so P2(c | b) = (1 − .5 + .5·2·P1(c)) / 2
    # and P3(c | a b) = (1 − .5 + .5·2·P2(c | b)) / 2
    p1 = 0.875 / 3
    p2 = (0.5 + p1) / 2
    kn = KneserNey(count_ngrams(np.array([0, 1, 0, 1, 2], dtype=np.uint16), 4))
    assert kn.bigram(np.array([0]), np.array([1]))([0.5, 0.5])[0] == pytest.approx(0.75 + 0.25 * p1, rel=1e-12)
    assert kn.trigram(np.array([0]), np.array([1]), np.array([2]))([0.5] * 3)[0] == pytest.approx((0.5 + p2) / 2,
                                                                                                  rel=1e-12)
    assert kn.bigram(np.array([3]), np.array([3]))([0.5, 0.5])[0] == pytest.approx(0.5 * 3 / 4 / 3)  # unseen: 1/V


@pytest.mark.parametrize("discounts", [[0.05, 0.3, 0.5], [0.75, 0.75, 0.75], [1.0, 1.0, 1.0]])
def test_every_kneser_ney_distribution_sums_to_one_over_the_vocabulary(discounts):
    kn = KneserNey(count_ngrams(corpus3(400), VOCAB))
    every = np.arange(VOCAB)
    # seen contexts, a pair seen only as a pair's second half or never, a token that never came first
    for a, b in [(0, 1), (1, 4), (4, 3), (VOCAB - 1, VOCAB - 1), (VOCAB - 2, 0)]:
        bigram = kn.bigram(np.full(VOCAB, b), every)(discounts[:2])
        trigram = kn.trigram(np.full(VOCAB, a), np.full(VOCAB, b), every)(discounts)
        assert bigram.sum() == pytest.approx(1.0, abs=1e-12) and bigram.min() > 0
        assert trigram.sum() == pytest.approx(1.0, abs=1e-12) and trigram.min() > 0


def test_kneser_ney_discounts_are_chosen_on_the_training_tail_and_never_by_the_windows():
    train = corpus3(500).tolist()
    cut = holdout_start(len(train))
    head, tail = train[:cut], train[cut:]
    one, other = (corpus3(9 * 12, seed=s).reshape(12, 9).astype(np.int64) for s in (1, 2))

    got = ngram_baselines(np.array(train, dtype=np.uint16), one, VOCAB, chunk_tokens=64)

    assert ngram_baselines(np.array(train, dtype=np.uint16), other, VOCAB).kn_trigram_discounts == \
        got.kn_trigram_discounts  # other windows, the same choice
    for name, order in (("kn_bigram_discounts", 2), ("kn_trigram_discounts", 3)):
        chosen = getattr(got, name)
        best = dict_kn_loss(head, grams(tail, order), chosen)
        for i, d in ((i, d) for i in range(order) for d in DISCOUNT_GRID):  # no single change is better on the tail
            assert dict_kn_loss(head, grams(tail, order), [*chosen[:i], d, *chosen[i + 1 :]]) >= best - 1e-12
    # scored with the whole split's counts; a window's first target from the bigram (one token before it)
    bigrams = [gram for row in one.tolist() for gram in grams(row, 2)]
    trigrams = [gram for row in one.tolist() for gram in [tuple(row[:2]), *grams(row, 3)]]
    kn_trigram = dict_kneser_ney(train, got.kn_trigram_discounts)
    kn_bigram = dict_kneser_ney(train, got.kn_bigram_discounts)
    expected = -sum(math.log((kn_bigram if len(g) == 2 else kn_trigram)(g[:-1], g[-1])) for g in trigrams)
    expected /= len(trigrams)
    assert got.kn_bigram_loss == pytest.approx(dict_kn_loss(train, bigrams, got.kn_bigram_discounts), rel=1e-12)
    assert got.kn_trigram_loss == pytest.approx(expected, rel=1e-12)
    assert got.kn_trigram_loss < got.kn_bigram_loss < got.bigram_loss  # each finds more of the structure
    assert got.strongest() == ("Kneser-Ney trigram", got.kn_trigram_loss)


def test_a_vocabulary_too_large_for_trigram_keys_has_the_other_baselines(monkeypatch):
    monkeypatch.setattr(baselines_module, "MAX_TRIGRAM_VOCAB", VOCAB - 1)
    got = ngram_baselines(corpus(300), corpus(90, seed=2)[:81].reshape(9, 9).astype(np.int64), VOCAB)
    assert got.kn_trigram_loss is None and got.kn_trigram_discounts is None
    assert got.strongest()[0] in ("add-k bigram", "Kneser-Ney bigram")


def test_the_verdict_is_against_the_strongest_baseline_and_only_a_measured_loss_warns():
    baselines = Baselines(unigram_loss=7.5, bigram_loss=6.0, unigram_k=1.0, bigram_k=0.01, windows=64,
                          seq_length=128, train_tokens=1000, kn_bigram_loss=5.8, kn_bigram_discounts=[1.0, 0.75],
                          kn_trigram_loss=5.2, kn_trigram_discounts=[1.0, 0.8, 0.85])
    assert baselines.strongest() == ("Kneser-Ney trigram", 5.2)
    beaten, lost = baselines.describe(5.1), baselines.describe(5.5)  # 5.5: below both bigrams, not the trigram
    assert "below the strongest (Kneser-Ney trigram)" in beaten and "NOT" not in beaten
    assert "NOT below the Kneser-Ney trigram baseline (5.5000 vs 5.2000)" in lost
    assert "add-k bigram 6.0000 (k=0.01), Kneser-Ney bigram 5.8000, Kneser-Ney trigram 5.2000" in lost
    assert (baselines.level(5.1), baselines.level(5.5)) == (logging.INFO, logging.WARNING)
    # nothing measured (a resumed run that had already finished): the figures, no verdict, no warning
    assert baselines.level(None) == logging.INFO and "NOT" not in baselines.describe(None)
    assert baselines.describe(None).startswith("no validation loss measured in this run")
    assert baselines.metrics() == {"baseline_unigram_loss": 7.5, "baseline_bigram_loss": 6.0,
                                   "baseline_kn_bigram_loss": 5.8, "baseline_kn_trigram_loss": 5.2}


def test_a_report_made_before_the_kneser_ney_baselines_still_reads_and_judges_by_the_bigram():
    old = {"unigram_loss": 7.5, "bigram_loss": 6.0, "unigram_k": 1.0, "bigram_k": 0.01, "windows": 8,
           "seq_length": 32, "train_tokens": 100, "model_loss": 5.9, "model_beats_bigram": True}
    baselines = Baselines.from_report(old)
    assert baselines.strongest() == ("add-k bigram", 6.0) and baselines.beaten_by(5.9)
    assert baselines.metrics() == {"baseline_unigram_loss": 7.5, "baseline_bigram_loss": 6.0}
