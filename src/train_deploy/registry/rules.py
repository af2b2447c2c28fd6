"""The gate's rules: never a champion worse than counting, and no decision on noise.

:func:`check_baselines` reads the candidate's validation loss and the n-gram baselines of the same validation windows
from its bundle (``source.val_loss`` and ``source.val_baselines``: the training run's evaluation windows; bundles
without them: the parity windows) and refuses a candidate not below the unigram, or the stricter baseline
``registry.require_beats`` names. :func:`decide` then applies, in this order:

1. ``registry.force``: ``forced``, whatever follows says (the reason says what it overrode);
2. the baseline rule: ``rejected``, first version included, the reason naming the baseline and both figures;
3. no champion: ``first``;
4. a set of fewer than ``registry.eval_set.min_texts`` texts: ``undecided``;
5. the paired comparison (``train_deploy.registry.paired``): ``promoted`` when the interval's lower bound of the
   improvement exceeds ``registry.min_improvement``, ``rejected`` when its upper bound does not, else ``undecided``.

``undecided`` keeps the champion and counts as decided (:data:`DECIDED`): the gate did decide, that the set cannot
tell the two apart, and the same candidate gated again on the same set decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from train_deploy.baselines import Baselines
from train_deploy.handoffs import Bundle
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.paired import Comparison, TextScores, paired_improvement

Decision = Literal["first", "promoted", "rejected", "undecided", "forced"]
DECIDED = frozenset(get_args(Decision))
"""The decisions of a gate that finished; a version without one (or tagged ``failed``) was never gated."""
PROMOTING = frozenset({"first", "promoted", "forced"})
"""The decisions that make the candidate ``champion``."""
REQUIRED = {"unigram": ("unigram",), "bigram": ("unigram", "add-k bigram"),
            "kneser_ney_bigram": ("unigram", "Kneser-Ney bigram"), "none": ()}
"""The baselines (``Baselines.losses`` names) each ``registry.require_beats`` asks the candidate to be below."""


@dataclass(frozen=True, slots=True)
class BaselineCheck:
    """The candidate's validation loss beside the baseline it was held to (nats/token), and the refusal if any."""

    val_loss: float | None
    baseline: str | None
    """The baseline that refused it, else the strictest one required (the unigram's under ``none``)."""
    baseline_loss: float | None
    refusal: str = ""
    """Why it may not become champion; empty when it may."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :func:`decide` made of the scores."""

    decision: Decision
    reason: str
    champion_value: float | None
    comparison: Comparison | None = None


def check_baselines(bundle: Bundle, require: str) -> BaselineCheck:
    """Whether ``bundle``'s validation loss is below the baselines ``require`` names, on the same windows."""
    source, parity = bundle.meta.source, bundle.parity.baselines
    if source.val_baselines and source.val_loss is not None:
        report, loss = source.val_baselines, source.val_loss
        where = f"the same {report['windows']} validation windows of {report['seq_length']} tokens"
    elif parity:
        report, loss, where = parity, parity["model_loss"], f"the same {parity['windows']} parity windows"
    else:
        refusal = "" if require == "none" else (
            "the bundle records no validation loss beside the n-gram baselines, so nothing shows it predicts better "
            "than counting (registry.require_beats: none turns the rule off)")
        return BaselineCheck(None, None, None, refusal)
    losses = Baselines.from_report(report).losses()
    for name in REQUIRED[require]:
        if name not in losses:
            return BaselineCheck(loss, name, None, f"the bundle has no {name} baseline to compare its validation "
                                                   f"loss with (registry.require_beats: {require})")
        if not loss < losses[name]:
            return BaselineCheck(loss, name, losses[name], (
                f"its validation loss {loss:.4f} nats/token is not below the {name} baseline's {losses[name]:.4f} on "
                f"{where}: it predicts worse than counting (registry.require_beats: {require})"))
    name = REQUIRED[require][-1] if REQUIRED[require] else "unigram"
    return BaselineCheck(loss, name, losses[name], "")


def decide(ours: TextScores, champion: str | None, theirs: TextScores | None, config: RegistryConfig,
           baseline: BaselineCheck, unscored: str = "") -> Verdict:
    """The gate's decision on a candidate scoring ``ours`` against ``champion``'s ``theirs`` on the same texts (see
    the module; ``unscored``: why the champion has no scores, which only ``registry.force`` gets past)."""
    value = theirs.nats_per_char if theirs is not None else None
    comparison = paired_improvement(ours, theirs, config.confidence) if theirs is not None else None
    scored = f"the candidate's {ours.nats_per_char:.4f} nats/char"
    against = (f"{scored} against champion version {champion}'s {value:.4f}: {comparison.describe()}"
               if comparison is not None else f"{scored} on the evaluation set")
    if config.force:
        return _forced(champion, theirs, value, comparison, against, baseline, unscored)
    if baseline.refusal:
        return Verdict("rejected", f"never champion worse than counting: {baseline.refusal} ({against})", value,
                       comparison)
    if champion is None:
        return Verdict("first", f"no champion yet: the first version becomes champion ({against}"
                                f"{_few(len(ours.nats), config)})", None)
    if comparison is None:
        raise ValueError(f"champion version {champion} has no score ({unscored or 'not scored'})")
    return _compared(comparison, champion, against, value, config)


def _compared(comparison: Comparison, champion: str, against: str, value: float | None,
              config: RegistryConfig) -> Verdict:
    """The decision of the paired comparison, on a set large enough to decide on, or ``undecided``."""
    needed = f"{config.min_improvement:.2%} (registry.min_improvement)"
    stays = f"champion version {champion} stays"
    if comparison.texts < config.eval_set.min_texts:
        return Verdict("undecided", (f"undecided: the evaluation set holds {comparison.texts} texts, fewer than "
                                     f"registry.eval_set.min_texts {config.eval_set.min_texts}, too few to decide on; "
                                     f"{stays} ({against})"), value, comparison)
    if comparison.low > config.min_improvement:
        return Verdict("promoted", f"{against}: the improvement exceeds {needed} at that confidence", value,
                       comparison)
    if comparison.high <= config.min_improvement:
        return Verdict("rejected", f"{against}: promotion needs an improvement above {needed}, and the interval lies "
                                   "at or below it", value, comparison)
    return Verdict("undecided", f"undecided: {against}, across the {needed} needed; {stays}", value, comparison)


def _forced(champion: str | None, theirs: TextScores | None, value: float | None, comparison: Comparison | None,
            against: str, baseline: BaselineCheck, unscored: str) -> Verdict:
    overridden = f"; it overrides the baseline rule: {baseline.refusal}" if baseline.refusal else ""
    if champion is not None and theirs is None:
        return Verdict("forced", f"registry.force: promoted without a comparison, champion version {champion} could "
                                 f"not be scored ({unscored}; {against}){overridden}", None)
    return Verdict("forced", f"registry.force: promoted whatever the gate says ({against}){overridden}", value,
                   comparison)


def _few(texts: int, config: RegistryConfig) -> str:
    """The first version's note on a set too small for later decisions (empty when it is not)."""
    if texts >= config.eval_set.min_texts:
        return ""
    return (f"; the evaluation set holds {texts} texts, fewer than registry.eval_set.min_texts "
            f"{config.eval_set.min_texts}: later candidates will be undecided on it, so give a new model name a "
            "larger set (registry.eval_set.path, or a larger corpus.encoding.validation_fraction)")
