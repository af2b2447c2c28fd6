"""N-gram baselines: what counting alone scores on the validation windows a model is evaluated on.

A language model that does not beat a bigram table has learnt little; every evaluation reports these two
numbers beside the model's loss (training, averaging, export's ``parity.json`` and model card, MLflow):

- **unigram**: ``p(b) = (c(b) + k) / (N + k·V)``, ``c`` counted over every token of the training split;
- **bigram**: ``p(b | a) = (c(a, b) + k) / (c(a, ·) + k·V)``, ``c(a, b)`` counted over every pair of adjacent
  tokens of the training split (across document ends too: the windows a model is scored on span them).

Both are in nats per predicted token, the unit of :func:`train_deploy.evaluation.mean_token_loss`, over the
same targets: positions ``1 .. seq_length`` of every window, each predicted from the token before it.

**k (add-k smoothing) is chosen on the training split only**: counted on all but its last
:data:`HOLDOUT_FRACTION` (at most :data:`HOLDOUT_MAX_TOKENS`), each value of :data:`K_GRID` is scored on that
held-out tail and the best kept; the final table counts the whole split. The validation windows never
choose anything.

Counting streams the memory-mapped ``.bin`` file in chunks of :data:`CHUNK_TOKENS`; bigrams are a sparse
table (sorted ``a·V + b`` keys and their counts, merged chunk by chunk), so memory grows with the distinct
pairs seen, never with ``V²``. The scores of a token folder are cached in its ``baselines.json``, per
window set, so a stage that asks again (or the next run on the same token files) does not recount.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from train_deploy.handoffs import TokenManifest, write_json

logger = logging.getLogger(__name__)

K_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
"""Add-k values tried on the held-out tail of the training split."""
HOLDOUT_FRACTION = 0.1
"""Share of the training split (its end) that chooses k."""
HOLDOUT_MAX_TOKENS = 1_000_000
"""At most this many held-out tokens: enough to choose k on any corpus."""
CHUNK_TOKENS = 1 << 22
"""Tokens counted at once (32 MiB of int64 pair keys)."""
CACHE_FILE = "baselines.json"
_FORMAT = 1  # of the cache; a change of the method or the grid must change it


@dataclass(kw_only=True, slots=True)
class Baselines:
    """Unigram and bigram cross-entropy (nats/token) of a set of validation windows."""

    unigram_loss: float
    bigram_loss: float
    unigram_k: float
    """The add-k of the unigram model, chosen on the training split."""
    bigram_k: float
    """The add-k of the bigram model, chosen on the training split."""
    windows: int
    """Validation windows scored."""
    seq_length: int
    """Predicted tokens per window."""
    train_tokens: int
    """Tokens of the training split counted."""

    def beaten_by(self, loss: float | None) -> bool:
        """Whether a model's loss on the same windows is below the bigram baseline."""
        return loss is not None and loss < self.bigram_loss

    def metrics(self) -> dict[str, float]:
        """``baseline_unigram_loss`` and ``baseline_bigram_loss``, for MLflow."""
        return {"baseline_unigram_loss": self.unigram_loss, "baseline_bigram_loss": self.bigram_loss}

    def describe(self, loss: float | None) -> str:
        """One line: the model's loss beside both baselines, and whether it beats the bigram one."""
        verdict = ("below the bigram baseline" if self.beaten_by(loss)
                   else "NOT below the bigram baseline: the model predicts worse than counting word pairs")
        shown = "?" if loss is None else f"{loss:.4f}"
        return (f"validation loss {shown} nats/token vs unigram {self.unigram_loss:.4f} and add-k bigram "
                f"{self.bigram_loss:.4f} (k={self.bigram_k:g}) on the same {self.windows} windows of "
                f"{self.seq_length} tokens: {verdict}")


@dataclass(slots=True)
class NgramCounts:
    """Unigram counts ``[V]`` and a sparse bigram table (sorted ``a·V + b`` keys, counts) of a token stream."""

    vocab_size: int
    unigram: np.ndarray
    pair_keys: np.ndarray
    pair_counts: np.ndarray

    @classmethod
    def empty(cls, vocab_size: int) -> NgramCounts:
        return cls(vocab_size, np.zeros(vocab_size, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))

    def merge(self, other: NgramCounts) -> NgramCounts:
        keys = np.concatenate([self.pair_keys, other.pair_keys])
        counts = np.concatenate([self.pair_counts, other.pair_counts])
        unique, inverse = np.unique(keys, return_inverse=True)
        summed = np.bincount(inverse, weights=counts, minlength=len(unique)).astype(np.int64)
        return NgramCounts(self.vocab_size, self.unigram + other.unigram, unique, summed)

    def unigram_loss(self, targets: np.ndarray, k: float) -> float:
        """Mean ``-log p(b)`` of the ``targets`` under the add-k unigram model."""
        total = self.unigram.sum()
        p = (self.unigram[targets] + k) / (total + k * self.vocab_size)
        return float(-np.log(p).mean())

    def bigram_loss(self, previous: np.ndarray, targets: np.ndarray, k: float) -> float:
        """Mean ``-log p(b | a)`` of the pairs ``(previous, targets)`` under the add-k bigram model."""
        before = np.bincount(self.pair_keys // self.vocab_size, weights=self.pair_counts,
                             minlength=self.vocab_size)
        query = previous.astype(np.int64) * self.vocab_size + targets
        at = np.minimum(np.searchsorted(self.pair_keys, query), max(len(self.pair_keys) - 1, 0))
        found = self.pair_counts[at] * (self.pair_keys[at] == query) if len(self.pair_keys) else np.zeros(len(query))
        p = (found + k) / (before[previous] + k * self.vocab_size)
        return float(-np.log(p).mean())


def count_ngrams(tokens: np.ndarray, vocab_size: int, chunk_tokens: int = CHUNK_TOKENS) -> NgramCounts:
    """Unigram and bigram counts of ``tokens`` (an array or a memory map), read ``chunk_tokens`` at a time."""
    counts = NgramCounts.empty(vocab_size)
    for start in range(0, len(tokens), chunk_tokens):
        part = np.asarray(tokens[start : start + chunk_tokens + 1], dtype=np.int64)  # +1: the pair across chunks
        own = part[: chunk_tokens]
        if own.max(initial=0) >= vocab_size:
            raise ValueError(f"token id {int(own.max())} is outside the vocabulary of {vocab_size} ids")
        keys, pair_counts = np.unique(part[:-1] * vocab_size + part[1:], return_counts=True)
        counts = counts.merge(NgramCounts(vocab_size, np.bincount(own, minlength=vocab_size), keys,
                                          pair_counts.astype(np.int64)))
    return counts


def holdout_start(train_tokens: int) -> int:
    """Where the held-out tail that chooses k begins in a training split of ``train_tokens`` tokens."""
    tail = min(max(2, int(train_tokens * HOLDOUT_FRACTION)), HOLDOUT_MAX_TOKENS)
    return max(1, train_tokens - tail)


def ngram_baselines(train: np.ndarray, windows: np.ndarray, vocab_size: int,
                    chunk_tokens: int = CHUNK_TOKENS) -> Baselines:
    """Both baselines of ``windows`` (``[n, seq_length + 1]``) counted on the training tokens ``train``."""
    if len(train) < 3:
        raise ValueError(f"the training split holds {len(train)} tokens: too few to count n-grams")
    cut = holdout_start(len(train))
    head = count_ngrams(train[:cut], vocab_size, chunk_tokens)
    tail = np.asarray(train[cut:], dtype=np.int64)
    unigram_k = min(K_GRID, key=lambda k: head.unigram_loss(tail[1:], k))
    bigram_k = min(K_GRID, key=lambda k: head.bigram_loss(tail[:-1], tail[1:], k))
    # the whole split: the head's table plus the tail's own counts and the one pair across the cut
    whole = head.merge(count_ngrams(train[cut - 1 :], vocab_size, chunk_tokens))
    whole.unigram[int(train[cut - 1])] -= 1  # that token is the head's, counted twice
    previous, targets = windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)
    return Baselines(unigram_loss=whole.unigram_loss(targets, unigram_k),
                     bigram_loss=whole.bigram_loss(previous, targets, bigram_k), unigram_k=unigram_k,
                     bigram_k=bigram_k, windows=int(len(windows)), seq_length=int(windows.shape[1] - 1),
                     train_tokens=int(len(train)))


def baselines_for(tokens: TokenManifest, windows: np.ndarray) -> Baselines:
    """:func:`ngram_baselines` of ``windows`` on the training split of ``tokens``, cached in its folder.

    The cache (``baselines.json``) holds the token files' fingerprint and one entry per window set (by a
    hash of the windows); a folder that cannot be written only costs the counting.
    """
    cache = Path(tokens.path) / CACHE_FILE
    key = hashlib.blake2b(np.ascontiguousarray(windows, dtype=np.int64).tobytes(), digest_size=8).hexdigest()
    entries = _read_cache(cache, tokens.fingerprint)
    if key in entries:
        return Baselines(**entries[key])
    train = np.memmap(f"{tokens.prefix('train')}.bin", dtype=np.dtype(tokens.dtype), mode="r")
    baselines = ngram_baselines(train, windows, tokens.tokenizer.vocab_size)
    try:
        write_json(cache, {"format": _FORMAT, "fingerprint": tokens.fingerprint,
                           "windows": {**entries, key: asdict(baselines)}})
    except OSError as exc:
        logger.debug("n-gram baselines not cached in %s: %s", cache, exc)
    return baselines


def _read_cache(cache: Path, fingerprint: str) -> dict[str, dict]:
    """The cached entries when ``cache`` is of this format and these token files, else none."""
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("fingerprint") != fingerprint:
        return {}
    return {key: entry for key, entry in data.get("windows", {}).items()
            if isinstance(entry, dict) and set(entry) == set(Baselines.__slots__)}
