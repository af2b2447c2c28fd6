"""The data gate's verdict: tonight's statistics against the champion's under the configured bounds.

:class:`ValidationReport` is the typed record of one night (JSON: :meth:`ValidationReport.to_json`): the run's
``validation/report.json`` artifact, and what the ``validation_stopped`` alert carries. A night past a bound
in ``validation.mode: stop`` raises :class:`ValidationStopped`, which holds the report.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.statistics import CorpusStatistics

Outcome = Literal["passed", "stopped", "warned", "not_compared"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One statistic past its bound."""

    statistic: str
    """Its name in :class:`~train_deploy.validation.statistics.CorpusStatistics` (``drop_shares.<reason>``,
    ``length_quantiles.<p>`` for an entry of a mapping)."""
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def block(self) -> str:
        """The report for the console: its reason, then one line per failing statistic."""
        return "\n".join([self.reason, *(f"  {finding.line()}" for finding in self.failures)])


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
           model_name: str, force: bool = False) -> ValidationReport:
    """The report on ``tonight`` against ``champion`` (its version and statistics; None: no champion yet): past a
    bound, ``stopped``, or ``warned`` when ``config.mode`` is warn or ``force`` (``retrain.force``) is set."""
    record = tonight.to_json()
    if champion is None:
        return ValidationReport("not_compared", model_name, None, f"Corpus statistics recorded; nothing compared: "
                                f"{model_name} has no champion yet", tonight=record)
    version, statistics = champion
    if statistics is None:
        return ValidationReport("not_compared", model_name, version, f"Corpus statistics recorded; nothing compared: "
                                f"{model_name} version {version} (champion) records none (registered before the data "
                                "gate)", tonight=record)
    failures = compare(tonight, statistics, config)
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


def _relative(now: int | None, then: int | None, statistic: str, c: ValidationConfig, key: str) -> Finding | None:
    """A count's relative decrease past ``max_<key>_decrease`` or increase past ``max_<key>_increase``."""
    if now is None or not then:
        return None
    change = now / then - 1
    for limit, name, past in ((getattr(c, f"max_{key}_decrease"), f"max_{key}_decrease", -change),
                              (getattr(c, f"max_{key}_increase"), f"max_{key}_increase", change)):
        if limit is not None and past > limit:
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
