"""The gate's paired comparison: two models scored text by text on one evaluation set, and how sure the difference is.

Both models score the same texts, so the question is paired: on each text ``i`` the candidate spends ``c_i`` nats
and the champion ``h_i`` (``-Σ log p`` over the text's tokens), over the same ``k_i`` characters. The metric is nats
per character over the set, ``Σc / Σk`` and ``Σh / Σk``, and the improvement the gate asks for is relative,
``(Σh − Σc) / Σh`` (the characters cancel: both count the texts as given).

How sure: a **paired bootstrap** (Efron and Tibshirani 1993, ch. 13; Koehn 2004 for the paired form on test sets).
:data:`RESAMPLES` times, draw as many texts as the set holds, with replacement, the same texts for both models, and
compute the improvement on that draw; the interval at ``confidence`` is the two-sided percentile interval of those
improvements (``numpy.quantile``'s linear interpolation). Texts the candidate wins on and texts it loses on are drawn
together, so a difference carried by two lucky texts gets a wide interval and one that holds on every text a narrow
one. The generator is seeded (:data:`SEED`): the same scores always give the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

RESAMPLES = 2000
"""Bootstrap draws of the evaluation set (the percentile interval's tails then hold 50 draws each at 95%)."""
SEED = 0
"""The bootstrap generator's seed: the interval is a function of the scores alone."""
_DRAWS_AT_ONCE = 4_000_000
"""Text indices drawn in one call (32 MiB): a set of 100,000 texts is resampled 40 draws at a time."""


@dataclass(frozen=True, slots=True)
class TextScores:
    """One model's score of each text of a set: nats (``-Σ log p``) and characters, in the set's order."""

    nats: np.ndarray
    chars: np.ndarray

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> TextScores:
        """The scores of a ``score`` frame of the served model (``log_prob`` and ``chars`` per row)."""
        return cls(nats=-frame["log_prob"].to_numpy(dtype=np.float64), chars=frame["chars"].to_numpy(dtype=np.int64))

    @property
    def nats_per_char(self) -> float:
        """``Σ nats / Σ chars`` over the set (:func:`train_deploy.registry.model.nats_per_char` of the frame)."""
        return float(self.nats.sum() / self.chars.sum())


@dataclass(frozen=True, slots=True)
class Comparison:
    """The candidate's relative improvement over the champion in nats per character, with its interval."""

    improvement: float
    """``(champion − candidate) / champion`` on the whole set: 0.01 = 1% fewer nats per character."""
    low: float
    """The interval's lower bound (the improvement the data support at ``confidence``)."""
    high: float
    confidence: float
    texts: int

    def describe(self) -> str:
        """E.g. ``0.52% fewer nats/char (95% interval 0.31% to 0.70%, paired bootstrap of 12 texts)``."""
        how = f"{abs(self.improvement):.2%} {'fewer' if self.improvement >= 0 else 'more'} nats/char"
        return (f"{how} ({self.confidence:.0%} interval of the improvement {self.low:.2%} to {self.high:.2%}, "
                f"paired bootstrap of {self.texts} texts)")


def paired_improvement(candidate: TextScores, champion: TextScores, confidence: float,
                       resamples: int = RESAMPLES, seed: int = SEED) -> Comparison:
    """The candidate's improvement over the champion on the same texts and its paired bootstrap interval at
    ``confidence`` (see the module). Raises ValueError when the two did not score the same texts."""
    if len(candidate.nats) != len(champion.nats) or not np.array_equal(candidate.chars, champion.chars):
        raise ValueError(f"the candidate scored {len(candidate.nats)} texts and the champion {len(champion.nats)} "
                         "(or other characters): a paired comparison needs the same texts")
    n = len(candidate.nats)
    if n == 0:
        raise ValueError("no texts to compare on")
    ours, theirs = candidate.nats, champion.nats
    generator = np.random.default_rng(seed)
    per_call = max(1, _DRAWS_AT_ONCE // n)
    improvements = []
    for start in range(0, resamples, per_call):
        drawn = generator.integers(0, n, size=(min(per_call, resamples - start), n))
        champion_sums = theirs[drawn].sum(axis=1)
        improvements.append((champion_sums - ours[drawn].sum(axis=1)) / champion_sums)
    tail = (1 - confidence) / 2
    low, high = np.quantile(np.concatenate(improvements), [tail, 1 - tail])
    point = (theirs.sum() - ours.sum()) / theirs.sum()
    return Comparison(improvement=float(point), low=float(low), high=float(high), confidence=confidence, texts=n)
