"""The data gate on held-out bad corpora (tests/validation/conftest.py): each kind is stopped naming the statistics
past their bounds, a good next night passes, and warn or force lets a bad one through."""

from __future__ import annotations

import pytest

from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.report import ValidationStopped, decide
from train_deploy.validation.statistics import CorpusStatistics


def _failing(nights: dict[str, CorpusStatistics], night: str, **config) -> list[str]:
    report = decide(nights[night], ("1", nights["champion"]), ValidationConfig(**config), "lm")
    return [finding.statistic for finding in report.failures]


@pytest.mark.parametrize(("night", "expected"), [
    ("truncated", {"documents_kept", "characters"}),
    ("mojibake", {"cjk_share", "tokens_per_character"}),
    ("duplicated", {"duplicate_share", "drop_shares.duplicate"}),
    ("english", {"cjk_share", "byte_fallback_rate"}),
])
def test_each_kind_of_bad_corpus_is_stopped_naming_the_statistics_past_their_bounds(nights, night, expected):
    report = decide(nights[night], ("1", nights["champion"]), ValidationConfig(), "lm")
    assert report.outcome == "stopped"
    assert expected <= {finding.statistic for finding in report.failures}, report.block()
    stopped = ValidationStopped(report)
    assert "\n" not in str(stopped) and "lm version 1" in str(stopped)
    line = report.block().splitlines()[1]  # each failing statistic: both values and the bound, naming its key
    assert "champion" in line or "tonight" in line
    assert "(validation.max_" in line


def test_a_good_next_night_with_more_documents_of_the_same_kind_passes(nights):
    report = decide(nights["good"], ("1", nights["champion"]), ValidationConfig(), "lm")
    assert report.outcome == "passed", report.block()
    assert nights["good"].documents_kept > nights["champion"].documents_kept


def test_warn_mode_and_retrain_force_let_a_bad_night_through_with_the_report(nights):
    warned = decide(nights["english"], ("1", nights["champion"]), ValidationConfig(mode="warn"), "lm")
    forced = decide(nights["english"], ("1", nights["champion"]), ValidationConfig(), "lm", force=True)
    assert (warned.outcome, forced.outcome) == ("warned", "warned")
    assert "validation.mode: warn" in warned.reason and "retrain.force: true" in forced.reason
    assert warned.failures == forced.failures != []


def test_without_a_champion_or_its_statistics_nothing_is_compared(nights):
    first = decide(nights["english"], None, ValidationConfig(), "lm")
    older = decide(nights["english"], ("4", None), ValidationConfig(), "lm")
    assert (first.outcome, older.outcome) == ("not_compared", "not_compared")
    assert first.reason == "Corpus statistics recorded; nothing compared: lm has no champion yet"
    assert "version 4 (champion) records none" in older.reason and older.failures == []


def test_a_bound_set_to_null_is_not_checked(nights):
    assert _failing(nights, "truncated", max_documents_decrease=None, max_characters_decrease=None) == []
