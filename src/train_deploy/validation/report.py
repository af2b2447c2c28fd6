"""The data gate's verdict: tonight's statistics against the champion's under the configured bounds.

:class:`ValidationReport` is the typed record of one night (JSON: :meth:`ValidationReport.to_json`): the run's
``validation/report.json`` artifact, and what the ``validation_stopped`` alert carries. A night past a bound
in ``validation.mode: stop`` raises :class:`ValidationStopped`, which holds the report.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Literal

from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.content import SampleScores
from train_deploy.validation.screening import Dropped
from train_deploy.validation.statistics import CorpusStatistics

Outcome = Literal["passed", "stopped", "warned", "not_compared"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One statistic past its bound."""

    statistic: str
    """Its name in :class:`~train_deploy.validation.statistics.CorpusStatistics` (``drop_shares.<reason>``,
    ``length_quantiles.<p>`` for an entry of a mapping), or ``screening.flagged_share`` (:class:`Screening`'s
    ``share``)."""
    champion: float | None
    """The champion's value (None for a bound on tonight's value alone)."""
    tonight: float
    bound: str
    """The bound, in words, naming its key: ``change of at most 0.1 (validation.max_cjk_share_change)``."""

    def line(self) -> str:
        before = f"champion {_number(self.champion)}, " if self.champion is not None else ""
        return f"{self.statistic}: {before}tonight {_number(self.tonight)}; bound: {self.bound}"


@dataclass(slots=True)
class ValidationReport:
    """What the data gate decided about tonight's corpus, and why."""

    outcome: Outcome
    """passed; stopped (past a bound, mode stop); warned (past a bound, let through by ``validation.mode: warn`` or
    ``retrain.force``); not_compared (no champion, or one without statistics)."""
    model_name: str
    champion_version: str | None
    reason: str
    """One line: what was compared with what, and the result."""
    failures: list[Finding] = field(default_factory=list)
    tonight: dict[str, Any] = field(default_factory=dict)
    """Tonight's statistics (JSON)."""
    champion: dict[str, Any] | None = None
    """The champion's statistics (JSON), when it records them."""
    screening: Screening | None = None
    """The champion's verdict on each scored document of tonight's sample (None: nothing scored)."""
    dropped: Dropped | None = None
    """What ``validation.screening: drop`` left out of the training split (None: nothing screened)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def block(self) -> str:
        """The report for the console: its reason, one line per failing statistic, and when one failed, the
        sample's documents that scored worst."""
        lines = [self.reason, *(f"  {finding.line()}" for finding in self.failures)]
        if self.screening is not None:
            lines.append(f"  {self.screening.line()}")
            if self.failures:
                lines += [f"    {worst['nats_per_char']:.2f}  {worst['text']}" for worst in self.screening.worst]
        if self.dropped is not None:
            lines.append(f"  {self.dropped.line()}")
        return "\n".join(lines)


@dataclass(slots=True)
class Screening:
    """Tonight's sampled documents as the champion scored them, one by one."""

    scored: int
    """Documents scored."""
    flagged: int
    """Documents past ``limit``."""
    share: float
    """``flagged / scored``: an estimate of the share of tonight's kept documents past ``limit``."""
    limit: float | None
    """Nats per character past which a document is flagged (``validation.max_document_nats_factor`` times the
    champion's own figure; None: no screening)."""
    worst: list[dict[str, Any]]
    """The 3 that scored worst: ``nats_per_char`` and ``text`` (one line of at most 80 characters, without
    credentials, secrets or paths: ``train_deploy.validation.content.shown_line``)."""

    def line(self) -> str:
        past = (f"{self.flagged} of {self.scored} sampled documents ({self.share:.0%}) above {self.limit:.3g} "
                "nats/char (validation.max_document_nats_factor)" if self.limit is not None else
                f"{self.scored} sampled documents scored")
        return f"screening: {past}; worst under the champion:" if self.worst else f"screening: {past}"


def screen(scores: SampleScores | None, champion: CorpusStatistics | None, config: ValidationConfig
           ) -> Screening | None:
    """The champion's per-document verdict on tonight's scored sample (None when nothing was scored)."""
    if scores is None or not len(scores.texts):
        return None
    per_text = scores.per_text()
    own = champion.nats_per_char if champion is not None else None
    factor = config.max_document_nats_factor
    limit = factor * own if factor is not None and own else None
    flagged = int((per_text > limit).sum()) if limit is not None else 0
    order = sorted(range(len(per_text)), key=lambda i: -per_text[i])[:3]
    worst = [{"nats_per_char": round(float(per_text[i]), 4), "text": line}
             for i, line in zip(order, scores.worst(3), strict=True)]
    return Screening(len(per_text), flagged, flagged / len(per_text), limit, worst)


class ValidationStopped(RuntimeError):
    """Tonight's corpus is past the data gate's bounds (``validation.mode: stop``): the run stops before training.
    ``kedro run`` prints the first line and exits 3 (``train_deploy.cli``); :attr:`report` holds the details."""

    def __init__(self, report: ValidationReport) -> None:
        failing = "; ".join(f"{f.statistic} {_number(f.champion)} → {_number(f.tonight)}" if f.champion is not None
                            else f"{f.statistic} {_number(f.tonight)}" for f in report.failures)
        super().__init__(f"the corpus is past the data gate's bounds against {report.model_name} version "
                         f"{report.champion_version} ({failing}); nothing was trained (validation.mode: warn or "
                         "retrain.force: true trains anyway)")
        self.report = report


def decide(tonight: CorpusStatistics, champion: tuple[str, CorpusStatistics | None] | None, config: ValidationConfig,
           model_name: str, force: bool = False, scores: SampleScores | None = None) -> ValidationReport:
    """The report on ``tonight`` against ``champion`` (its version and statistics; None: no champion yet): past a
    bound, ``stopped``, or ``warned`` when ``config.mode`` is warn or ``force`` (``retrain.force``) is set;
    ``scores``: the champion's score of each of tonight's sampled documents, screened one by one."""
    screening = screen(scores, champion[1] if champion else None, config)
    report = _decided(tonight, champion, config, model_name, force, screening)
    report.screening = screening
    return report


def _decided(tonight: CorpusStatistics, champion: tuple[str, CorpusStatistics | None] | None,
             config: ValidationConfig, model_name: str, force: bool, screening: Screening | None
             ) -> ValidationReport:
    record = tonight.to_json()
    if champion is None:
        return ValidationReport("not_compared", model_name, None, f"Corpus statistics recorded; nothing compared: "
                                f"{model_name} has no champion yet", tonight=record)
    version, statistics = champion
    if statistics is None:
        return ValidationReport("not_compared", model_name, version, f"Corpus statistics recorded; nothing compared: "
                                f"{model_name} version {version} (champion) records none (registered before the data "
                                "gate)", tonight=record)
    failures = compare(tonight, statistics, config) + _flagged(screening, config)
    against = f"{model_name} version {version} (champion)"
    if not failures:
        return ValidationReport("passed", model_name, version, f"Corpus statistics within the data gate's bounds "
                                f"against {against}", tonight=record, champion=statistics.to_json())
    count = f"{len(failures)} corpus statistic{'s' if len(failures) > 1 else ''} past the data gate's bounds"
    if force or config.mode == "warn":
        why = "retrain.force: true" if force else "validation.mode: warn"
        return ValidationReport("warned", model_name, version, f"{count} against {against}; training anyway "
                                f"({why}):", failures, record, statistics.to_json())
    return ValidationReport("stopped", model_name, version, f"{count} against {against}; the run stops before "
                            "training (validation.mode: warn or retrain.force: true trains anyway):", failures, record,
                            statistics.to_json())


def compare(tonight: CorpusStatistics, champion: CorpusStatistics, config: ValidationConfig) -> list[Finding]:
    """Every statistic of ``tonight`` past its bound in ``config`` against ``champion`` (a bound or value that is
    None is not checked)."""
    return [finding for finding in _findings(tonight, champion, config) if finding is not None]


def _findings(now: CorpusStatistics, then: CorpusStatistics, c: ValidationConfig) -> Iterator[Finding | None]:
    yield _relative(now.documents_kept, then.documents_kept, "documents_kept", c, "documents")
    yield _relative(now.characters, then.characters, "characters", c, "characters")
    if c.max_cjk_share_change is not None and None not in (now.cjk_share, then.cjk_share):
        if abs(now.cjk_share - then.cjk_share) > c.max_cjk_share_change:
            yield Finding("cjk_share", then.cjk_share, now.cjk_share,
                          f"change of at most {c.max_cjk_share_change:g} (validation.max_cjk_share_change)")
    limit = c.max_nats_per_char_increase
    if limit is not None and now.nats_per_char is not None and then.nats_per_char:
        if now.nats_per_char / then.nats_per_char - 1 > limit:
            yield Finding("nats_per_char", then.nats_per_char, now.nats_per_char, f"relative increase of at most "
                          f"{limit:g} (validation.max_nats_per_char_increase); tonight "
                          f"{now.nats_per_char / then.nats_per_char - 1:+.1%}")
    yield _above(now.character_distance, c.max_character_distance, "character_distance", "max_character_distance")
    yield _above(now.duplicate_share, c.max_duplicate_share, "duplicate_share", "max_duplicate_share")
    yield _above(now.byte_fallback_rate, c.max_byte_fallback_rate, "byte_fallback_rate", "max_byte_fallback_rate")
    limit = c.max_tokens_per_character_change
    if limit is not None and now.tokens_per_character and then.tokens_per_character:
        if abs(now.tokens_per_character / then.tokens_per_character - 1) > limit:
            yield Finding("tokens_per_character", then.tokens_per_character, now.tokens_per_character,
                          f"relative change of at most {limit:g} (validation.max_tokens_per_character_change)")
    factor = c.max_length_quantile_factor
    if factor is not None and now.length_quantiles and then.length_quantiles:
        for name, before in then.length_quantiles.items():
            after = now.length_quantiles.get(name)
            if after is not None and before > 0 and not before / factor <= after <= before * factor:
                yield Finding(f"length_quantiles.{name}", before, after,
                              f"within a factor {factor:g} (validation.max_length_quantile_factor)")
    if c.max_drop_share_increase is not None:
        for reason in sorted(now.drop_shares.keys() | then.drop_shares.keys()):
            before, after = then.drop_shares.get(reason, 0.0), now.drop_shares.get(reason, 0.0)
            if after - before > c.max_drop_share_increase:
                yield Finding(f"drop_shares.{reason}", before, after, f"increase of at most "
                              f"{c.max_drop_share_increase:g} (validation.max_drop_share_increase)")


def _flagged(screening: Screening | None, config: ValidationConfig) -> list[Finding]:
    """The screening's share of flagged documents past ``validation.max_flagged_share`` (none without screening)."""
    limit = config.max_flagged_share
    if screening is None or screening.limit is None or limit is None or screening.share <= limit:
        return []
    return [Finding("screening.flagged_share", None, screening.share, f"at most {limit:g} of the sampled documents "
                    f"above {config.max_document_nats_factor:g}x the champion's own nats/char "
                    f"(validation.max_flagged_share); tonight {screening.flagged} of {screening.scored}")]


def _relative(now: int | None, then: int | None, statistic: str, c: ValidationConfig, key: str) -> Finding | None:
    """A count's relative decrease past ``max_<key>_decrease`` or increase past ``max_<key>_increase``."""
    if now is None or not then:
        return None
    change = now / then - 1
    exact = Fraction(now - then, then)  # counts compared exactly: 700/1000 - 1 is not -0.3 in floating point
    for limit, name, past in ((getattr(c, f"max_{key}_decrease"), f"max_{key}_decrease", -exact),
                              (getattr(c, f"max_{key}_increase"), f"max_{key}_increase", exact)):
        if limit is not None and past > Fraction(repr(limit)):  # the bound as written (0.3 is 3/10)
            which = "decrease" if name.endswith("decrease") else "increase"
            return Finding(statistic, then, now, f"a relative {which} of at most {limit:g} (validation.{name}); "
                                                 f"tonight {change:+.1%}")
    return None


def _above(value: float | None, limit: float | None, statistic: str, key: str) -> Finding | None:
    if value is None or limit is None or value <= limit:
        return None
    return Finding(statistic, None, value, f"at most {limit:g} (validation.{key})")


def _number(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"
