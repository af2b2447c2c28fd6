"""N-gram baselines: what counting alone scores on the validation windows a model is evaluated on.

A language model that does not beat counting has learnt little; every evaluation reports these numbers beside
the model's loss (training, averaging, export's ``parity.json`` and model card, MLflow), and its verdict is
against the **strongest** of them (:meth:`Baselines.strongest`):

- **unigram**, add-k: ``p(b) = (c(b) + k) / (N + k·V)``;
- **add-k bigram**: ``p(b | a) = (c(a, b) + k) / (c(a, ·) + k·V)``;
- **Kneser–Ney bigram and trigram**, interpolated, one absolute discount ``D_n ∈ (0, 1]`` per order (Chen and
  Goodman 1998, "An empirical study of smoothing techniques for language modeling", eq. 23–25). The highest order
  discounts every count it has seen and gives the mass it frees to the order below,
  ``p(w | h) = max(c(h w) − D_n, 0) / c(h ·) + D_n · N1+(h ·) / c(h ·) · p(w | h′)`` (``h′``: ``h`` without its first
  token; ``p(w | h′)`` alone when ``h`` was never seen). The lower orders count continuations instead of
  occurrences, ``N1+(· h′ w)`` (how many distinct tokens were seen before ``h′ w``), and the unigram level is
  interpolated the same way with the uniform distribution ``1/V``, so no token has probability 0 and every
  context's distribution sums to 1.

``c`` counts every n-gram of adjacent tokens of the training split (across document ends too: the windows a model
is scored on span them). All are in nats per predicted token, the unit of
:func:`train_deploy.training.evaluation.mean_token_loss`, over the same targets: positions ``1 .. seq_length`` of every
window, each predicted from the tokens before it in the window (the trigram predicts position 1, which has one
token before it, with the Kneser–Ney bigram).

**k and the discounts are chosen on the training split only**: counted on all but its last
:data:`HOLDOUT_FRACTION` (at most :data:`HOLDOUT_MAX_TOKENS`), each value of :data:`K_GRID` (add-k) and of
:data:`DISCOUNT_GRID` (Kneser–Ney, one discount at a time until none changes) is scored on that held-out tail and
the best kept; the final tables count the whole split. The validation windows never choose anything.

Counting streams the memory-mapped ``.bin`` file in chunks of :data:`CHUNK_TOKENS`; bigrams and trigrams are
sparse tables (sorted ``a·V + b`` and ``(a·V + b)·V + c`` keys and their counts, merged chunk by chunk), so memory
grows with the distinct n-grams seen, never with ``V²``; the trigram needs ``V³ < 2⁶³`` (a vocabulary of at most
:data:`MAX_TRIGRAM_VOCAB` ids; larger ones have no trigram baseline). The scores of a token folder are cached in its
``baselines.json``, per window set, so a stage that asks again (or the next run on the same token files) does not
recount.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.handoffs import TokenManifest, write_json

logger = logging.getLogger(__name__)

K_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
"""Add-k values tried on the held-out tail of the training split."""
DISCOUNT_GRID = tuple(round(0.05 * i, 2) for i in range(1, 21))
"""Kneser–Ney discounts tried on the held-out tail (0.05 … 1.0; above 1 a context's probabilities would not sum
to 1)."""
START_DISCOUNT = 0.75
"""Where the search over :data:`DISCOUNT_GRID` starts for every order."""
HOLDOUT_FRACTION = 0.1
"""Share of the training split (its end) that chooses k and the discounts."""
HOLDOUT_MAX_TOKENS = 1_000_000
"""At most this many held-out tokens: enough to choose them on any corpus."""
CHUNK_TOKENS = 1 << 22
"""Tokens counted at once (32 MiB of int64 keys per order)."""
MAX_TRIGRAM_VOCAB = 2_097_151
"""The largest vocabulary whose trigram keys ``(a·V + b)·V + c`` fit an int64."""
CACHE_FILE = "baselines.json"
_FORMAT = 2  # of the cache; a change of the method or the grids must change it; 2: Kneser–Ney bigram and trigram


@dataclass(kw_only=True, slots=True)
class Baselines:
    """Unigram, bigram and trigram cross-entropy (nats/token) of a set of validation windows."""

    unigram_loss: float
    bigram_loss: float
    """The add-k bigram's."""
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
    kn_bigram_loss: float | None = None
    """The interpolated Kneser–Ney bigram's (None in reports made before it)."""
    kn_bigram_discounts: list[float] | None = None
    """Its discounts ``[unigram level, bigram]``, chosen on the training split."""
    kn_trigram_loss: float | None = None
    """The interpolated Kneser–Ney trigram's (None before it, or for a vocabulary over :data:`MAX_TRIGRAM_VOCAB`)."""
    kn_trigram_discounts: list[float] | None = None
    """Its discounts ``[unigram level, bigram level, trigram]``, chosen on the training split."""

    @classmethod
    def from_report(cls, report: dict) -> Baselines:
        """The baselines in a report (``parity.json``, a bundle's ``val_baselines``): its other keys are ignored,
        and reports made before the Kneser–Ney models have none."""
        return cls(**{f.name: report[f.name] for f in fields(cls) if f.name in report})

    def losses(self) -> dict[str, float]:
        """Every baseline's loss by its name, weakest model first."""
        named = {"unigram": self.unigram_loss, "add-k bigram": self.bigram_loss,
                 "Kneser-Ney bigram": self.kn_bigram_loss, "Kneser-Ney trigram": self.kn_trigram_loss}
        return {name: loss for name, loss in named.items() if loss is not None}

    def strongest(self) -> tuple[str, float]:
        """The name and loss of the baseline with the lowest loss: the one a model must beat."""
        return min(self.losses().items(), key=lambda item: item[1])

    def beaten_by(self, loss: float | None) -> bool:
        """Whether a model's loss on the same windows is below the strongest baseline's."""
        return loss is not None and loss < self.strongest()[1]

    def level(self, loss: float | None) -> int:
        """The log level of :meth:`describe`: a warning only for a measured loss that does not beat the strongest
        baseline (no loss, as when a resumed run had nothing left to train, has nothing to warn about)."""
        return logging.WARNING if loss is not None and not self.beaten_by(loss) else logging.INFO

    def metrics(self) -> dict[str, float]:
        """``baseline_<name>_loss`` of each baseline (``unigram``, ``bigram``: add-k; ``kn_bigram``,
        ``kn_trigram``), for MLflow."""
        named = {"unigram": self.unigram_loss, "bigram": self.bigram_loss, "kn_bigram": self.kn_bigram_loss,
                 "kn_trigram": self.kn_trigram_loss}
        return {f"baseline_{name}_loss": loss for name, loss in named.items() if loss is not None}

    def describe(self, loss: float | None, advice: str | None = None) -> str:
        """One line: the model's loss beside every baseline, and whether it beats the strongest; when it does not,
        ``advice`` says what could (the training curves' reading, ``training.diagnosis.beat_advice``), else the
        general advice, a larger model trained longer."""
        figures = ", ".join(f"{name} {value:.4f}" + (f" (k={self.bigram_k:g})" if name == "add-k bigram" else "")
                            for name, value in self.losses().items())
        if loss is None:
            return (f"no validation loss measured in this run; n-gram baselines of its {self.windows} evaluation "
                    f"windows of {self.seq_length} tokens: {figures}")
        where = f"on the same {self.windows} windows of {self.seq_length} tokens"
        name, best = self.strongest()
        verdict = (f"below the strongest ({name})" if self.beaten_by(loss) else
                   f"NOT below the {name} baseline ({loss:.4f} vs {best:.4f}): the model predicts worse than "
                   f"counting {_COUNTED.get(name, 'tokens')}; "
                   f"{advice or 'a larger model trained longer (more steps, a GPU) is what could beat it'} "
                   f"{MEASURED}")
        return f"validation loss {loss:.4f} nats/token vs {figures} {where}: {verdict}"


MEASURED = ("(measured: the default model on 2 CPU cores passes the Kneser-Ney trigram after 8,400 steps, "
            "41 minutes; docs/benchmarks.md, Learning curve)")
"""What ``benchmarks/bench_learning_curve.py`` measured for the default run (docs/benchmarks.md): the scale of the
advice, since only a measurement says how much longer is enough."""
_COUNTED = {"add-k bigram": "token pairs", "Kneser-Ney bigram": "token pairs", "Kneser-Ney trigram": "token triples"}


@dataclass(slots=True)
class NgramCounts:
    """Unigram counts ``[V]`` and sparse bigram and trigram tables (sorted keys ``a·V + b`` and
    ``(a·V + b)·V + c``, and their counts) of a token stream; no trigram table (``triple_keys`` None) when the
    vocabulary is over :data:`MAX_TRIGRAM_VOCAB`."""

    vocab_size: int
    unigram: np.ndarray
    pair_keys: np.ndarray
    pair_counts: np.ndarray
    triple_keys: np.ndarray | None
    triple_counts: np.ndarray | None

    @classmethod
    def empty(cls, vocab_size: int) -> NgramCounts:
        triples = vocab_size <= MAX_TRIGRAM_VOCAB
        return cls(vocab_size, np.zeros(vocab_size, np.int64), _NONE, _NONE, _NONE if triples else None,
                   _NONE if triples else None)

    def merge(self, other: NgramCounts) -> NgramCounts:
        if not len(self.pair_keys):  # no pair, so no triple, counted yet: nothing to merge but the unigrams
            return NgramCounts(self.vocab_size, self.unigram + other.unigram, other.pair_keys, other.pair_counts,
                               other.triple_keys, other.triple_counts)
        pairs = _merge(self.pair_keys, self.pair_counts, other.pair_keys, other.pair_counts)
        triples = ((None, None) if self.triple_keys is None else
                   _merge(self.triple_keys, self.triple_counts, other.triple_keys, other.triple_counts))
        return NgramCounts(self.vocab_size, self.unigram + other.unigram, *pairs, *triples)

    def add_k_unigram(self, targets: np.ndarray) -> Callable[[float], np.ndarray]:
        """``p(k)``: the probabilities of ``targets`` under the add-k unigram model."""
        seen, total = self.unigram[targets], self.unigram.sum()
        return lambda k: (seen + k) / (total + k * self.vocab_size)

    def add_k_bigram(self, previous: np.ndarray, targets: np.ndarray) -> Callable[[float], np.ndarray]:
        """``p(k)``: the probabilities of ``targets`` after ``previous`` under the add-k bigram model."""
        before = np.bincount(self.pair_keys // self.vocab_size, weights=self.pair_counts,
                             minlength=self.vocab_size)[previous]
        seen = _lookup(self.pair_keys, self.pair_counts, previous.astype(np.int64) * self.vocab_size + targets)
        return lambda k: (seen + k) / (before + k * self.vocab_size)


_NONE = np.zeros(0, np.int64)


def _merge(keys: np.ndarray, counts: np.ndarray, more_keys: np.ndarray,
           more_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sorted table of the keys of two, the counts of a key in both summed."""
    unique, inverse = np.unique(np.concatenate([keys, more_keys]), return_inverse=True)
    summed = np.bincount(inverse, weights=np.concatenate([counts, more_counts]), minlength=len(unique))
    return unique, summed.astype(np.int64)


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """``values`` of the sorted ``keys`` at each of ``query``, 0 where a key is absent."""
    if not len(keys):
        return np.zeros(len(query), values.dtype)
    at = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    return np.where(keys[at] == query, values[at], 0)


def count_ngrams(tokens: np.ndarray, vocab_size: int, chunk_tokens: int = CHUNK_TOKENS,
                 first: int = 0) -> NgramCounts:
    """Counts of the n-grams of ``tokens`` (an array or a memory map) that end at position ``first`` or later,
    read ``chunk_tokens`` at a time (with the two tokens before each chunk, for the pairs and triples across)."""
    counts = NgramCounts.empty(vocab_size)
    for start in range(first, len(tokens), chunk_tokens):
        lead = min(start, 2)
        part = np.asarray(tokens[start - lead : start + chunk_tokens], dtype=np.int64)
        own = part[lead:]
        if own.max(initial=0) >= vocab_size:
            raise ValueError(f"token id {int(own.max())} is outside the vocabulary of {vocab_size} ids")
        pairs = (part[:-1] * vocab_size + part[1:])[max(lead - 1, 0) :]
        keys, pair_counts = np.unique(pairs, return_counts=True)
        triples = (None, None)
        if counts.triple_keys is not None:
            triples = np.unique(((part[:-2] * vocab_size + part[1:-1]) * vocab_size + part[2:])[max(lead - 2, 0) :],
                                return_counts=True)
        counts = counts.merge(NgramCounts(vocab_size, np.bincount(own, minlength=vocab_size), keys, pair_counts,
                                          *triples))
    return counts


class KneserNey:
    """Interpolated Kneser–Ney bigram and trigram probabilities from one table of counts (module docstring):
    what every context needs is derived once, so scoring a discount is arithmetic on arrays."""

    def __init__(self, counts: NgramCounts) -> None:
        v = self.vocab_size = counts.vocab_size
        self.pair_keys, self.pair_counts = counts.pair_keys, counts.pair_counts
        before = counts.pair_keys // v
        self.pair_context_total = np.bincount(before, weights=counts.pair_counts, minlength=v)  # c(a ·)
        self.pair_context_types = np.bincount(before, minlength=v)                              # N1+(a ·)
        self.continuation = np.bincount(counts.pair_keys % v, minlength=v)                     # N1+(· b)
        self.pair_types = len(counts.pair_keys)                                                 # N1+(· ·)
        self.continued = int(np.count_nonzero(self.continuation))                               # distinct b continued
        self.triple_keys, self.triple_counts = counts.triple_keys, counts.triple_counts
        if counts.triple_keys is None:
            return
        contexts = counts.triple_keys // v                                                     # sorted: a·V + b
        self.context_keys, starts, self.context_types = np.unique(contexts, return_index=True, return_counts=True)
        self.context_total = (np.add.reduceat(counts.triple_counts, starts) if len(starts)
                              else np.zeros(0, np.int64))                                       # c(a b ·)
        self.suffix_keys, self.suffix_types = np.unique(counts.triple_keys % (v * v), return_counts=True)
        self.middle_total = np.bincount(self.suffix_keys // v, weights=self.suffix_types, minlength=v)  # N1+(· b ·)
        self.middle_types = np.bincount(self.suffix_keys // v, minlength=v)                    # N1+(b •) of triples

    def bigram(self, previous: np.ndarray, targets: np.ndarray) -> Callable[[list[float]], np.ndarray]:
        """``p(discounts)``: the bigram probabilities of ``targets`` after ``previous`` for discounts
        ``[unigram level, bigram]``."""
        previous, targets = previous.astype(np.int64), targets.astype(np.int64)
        unigram = self._unigram(targets)
        seen = _lookup(self.pair_keys, self.pair_counts, previous * self.vocab_size + targets)
        bigram = _interpolate(seen, self.pair_context_total[previous], self.pair_context_types[previous])
        return lambda d: bigram(d[1], unigram(d[0]))

    def trigram(self, first: np.ndarray, previous: np.ndarray,
                targets: np.ndarray) -> Callable[[list[float]], np.ndarray]:
        """``p(discounts)``: the trigram probabilities of ``targets`` after ``first, previous`` for discounts
        ``[unigram level, bigram level, trigram]``."""
        v = self.vocab_size
        first, previous, targets = first.astype(np.int64), previous.astype(np.int64), targets.astype(np.int64)
        unigram = self._unigram(targets)
        bigram = _interpolate(_lookup(self.suffix_keys, self.suffix_types, previous * v + targets),  # N1+(· b c)
                              self.middle_total[previous], self.middle_types[previous])
        context = first * v + previous
        trigram = _interpolate(_lookup(self.triple_keys, self.triple_counts, context * v + targets),
                               _lookup(self.context_keys, self.context_total, context),
                               _lookup(self.context_keys, self.context_types, context))
        return lambda d: trigram(d[2], bigram(d[1], unigram(d[0])))

    def _unigram(self, targets: np.ndarray) -> Callable[[float], np.ndarray]:
        """``p(d)``: the continuation unigram of ``targets`` with discount ``d``, interpolated with 1/V."""
        counts = self.continuation[targets]
        return lambda d: (np.maximum(counts - d, 0) + d * self.continued / self.vocab_size) / self.pair_types


def _interpolate(seen: np.ndarray, total: np.ndarray, types: np.ndarray) -> Callable[[float, np.ndarray], np.ndarray]:
    """``p(D, lower)``: ``max(seen − D, 0) / total + D · types / total · lower`` for the queries whose context was
    counted (``total > 0``), ``lower`` for the others; what does not depend on ``D`` is computed once."""
    known = total > 0
    inverse = np.where(known, 1.0 / np.where(known, total, 1), 0.0)
    share, unknown = types * inverse, (~known).astype(np.float64)
    return lambda d, lower: np.maximum(seen - d, 0) * inverse + (d * share + unknown) * lower


def _mean_loss(p: np.ndarray) -> float:
    return float(-np.log(p).mean())


def tune_discounts(score: Callable[[list[float]], float], orders: int) -> list[float]:
    """The discounts (one per order) of :data:`DISCOUNT_GRID` with the lowest ``score``: from
    :data:`START_DISCOUNT` for all, each in turn set to its best with the others fixed, until none changes."""
    chosen = [START_DISCOUNT] * orders
    for _ in range(10):
        before = list(chosen)
        for order in range(orders):
            chosen[order] = min(DISCOUNT_GRID, key=lambda d: score([*chosen[:order], d, *chosen[order + 1 :]]))
        if chosen == before:
            break
    return chosen


def holdout_start(train_tokens: int) -> int:
    """Where the held-out tail that chooses k and the discounts begins in a training split of ``train_tokens``."""
    tail = min(max(3, int(train_tokens * HOLDOUT_FRACTION)), HOLDOUT_MAX_TOKENS)
    return max(2, train_tokens - tail)


def ngram_baselines(train: np.ndarray, windows: np.ndarray, vocab_size: int,
                    chunk_tokens: int = CHUNK_TOKENS) -> Baselines:
    """Every baseline of ``windows`` (``[n, seq_length + 1]``) counted on the training tokens ``train``."""
    if len(train) < 4:
        raise ValueError(f"the training split holds {len(train)} tokens: too few to count n-grams")
    cut = holdout_start(len(train))
    head = count_ngrams(train[:cut], vocab_size, chunk_tokens)
    rest = count_ngrams(train, vocab_size, chunk_tokens, first=cut)  # what ends in the tail (checks its ids too)
    chosen = _choose(head, np.asarray(train[cut:], dtype=np.int64))
    table = head.merge(rest)  # the whole split
    windows = np.asarray(windows, dtype=np.int64)
    previous, targets = windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)
    kn = KneserNey(table)
    kn_bigram = kn.bigram(previous, targets)(chosen["kn_bigram"]).reshape(len(windows), -1)
    kn_trigram = None
    if "kn_trigram" in chosen and windows.shape[1] > 2:
        kn_trigram = kn.trigram(windows[:, :-2].reshape(-1), windows[:, 1:-1].reshape(-1),
                                windows[:, 2:].reshape(-1))(chosen["kn_trigram"])
        kn_trigram = np.concatenate([kn_bigram[:, :1], kn_trigram.reshape(len(windows), -1)], axis=1)
    return Baselines(
        unigram_loss=_mean_loss(table.add_k_unigram(targets)(chosen["unigram"])),
        bigram_loss=_mean_loss(table.add_k_bigram(previous, targets)(chosen["bigram"])), unigram_k=chosen["unigram"],
        bigram_k=chosen["bigram"], windows=int(len(windows)), seq_length=int(windows.shape[1] - 1),
        train_tokens=int(len(train)), kn_bigram_loss=_mean_loss(kn_bigram), kn_bigram_discounts=chosen["kn_bigram"],
        kn_trigram_loss=None if kn_trigram is None else _mean_loss(kn_trigram),
        kn_trigram_discounts=None if kn_trigram is None else chosen["kn_trigram"])


def _choose(head: NgramCounts, tail: np.ndarray) -> dict[str, Any]:
    """The add-k models' k and the Kneser–Ney models' discounts, each the best on the held-out ``tail`` (tokens
    that follow ``head``) under the tables of ``head``."""
    kn = KneserNey(head)
    unigram, bigram = head.add_k_unigram(tail[1:]), head.add_k_bigram(tail[:-1], tail[1:])
    kn_bigram = kn.bigram(tail[:-1], tail[1:])
    chosen: dict[str, Any] = {"unigram": min(K_GRID, key=lambda k: _mean_loss(unigram(k))),
                              "bigram": min(K_GRID, key=lambda k: _mean_loss(bigram(k))),
                              "kn_bigram": tune_discounts(lambda d: _mean_loss(kn_bigram(d)), 2)}
    if kn.triple_keys is not None and len(tail) > 2:
        trigram = kn.trigram(tail[:-2], tail[1:-1], tail[2:])
        chosen["kn_trigram"] = tune_discounts(lambda d: _mean_loss(trigram(d)), 3)
    return chosen


def baselines_for(tokens: TokenManifest, windows: np.ndarray) -> Baselines:
    """:func:`ngram_baselines` of ``windows`` on the training split of ``tokens``, cached in its folder.

    The cache (``baselines.json``) holds the token files' fingerprint and one entry per window set (by a
    hash of the windows); a folder that cannot be written only costs the counting.
    """
    cache = Path(tokens.path) / CACHE_FILE
    key = hashlib.blake2b(np.ascontiguousarray(windows, dtype=np.int64).tobytes(), digest_size=8).hexdigest()
    entries = _read_cache(cache, tokens.fingerprint)
    if key in entries:
        return Baselines.from_report(entries[key])
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
            if isinstance(entry, dict) and set(entry) == {f.name for f in fields(Baselines)}}
