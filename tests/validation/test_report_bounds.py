"""The data gate's bounds as pure functions (``train_deploy.validation.report``): each statistic just inside and just
past its bound, the outcome's order (no champion, none recorded, passed, warned, stopped) and every reason word for
word, on statistics written by hand. No tokenizer, no model: these run once per mutant of ``make mutation``
(tests/validation/test_report.py decides on real nights)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.content import SampleScores
from train_deploy.validation.report import (
    Finding,
    Screening,
    ValidationReport,
    ValidationStopped,
    _number,
    compare,
    decide,
    screen,
)
from train_deploy.validation.screening import Dropped
from train_deploy.validation.statistics import CorpusStatistics

THEN = CorpusStatistics(documents_read=1200, documents_kept=1000, characters=100_000, tokens=50_000,
                        tokens_per_character=0.5, length_quantiles={"p50": 100.0, "p90": 400.0}, cjk_share=0.9,
                        drop_shares={"short": 0.1, "empty": 0.0}, duplicate_share=0.01, byte_fallback_rate=0.02,
                        nats_per_char=2.0)
OFF = {key: None for key in ("max_documents_decrease", "max_documents_increase", "max_characters_decrease",
                             "max_characters_increase", "max_cjk_share_change", "max_duplicate_share",
                             "max_byte_fallback_rate", "max_tokens_per_character_change",
                             "max_length_quantile_factor", "max_drop_share_increase", "max_nats_per_char_increase",
                             "max_character_distance")}


def _only(key: str, value: float, **changes) -> list[Finding]:
    """The findings of ``THEN`` changed by ``changes`` against ``THEN``, with only the bound ``key`` set."""
    return compare(replace(THEN, **changes), THEN, ValidationConfig(**{**OFF, key: value}))


def test_the_same_statistics_pass_every_default_bound():
    assert compare(THEN, THEN, ValidationConfig()) == []


@pytest.mark.parametrize(("key", "kept", "finding"), [
    ("max_documents_decrease", 750, None),
    ("max_documents_decrease", 749, Finding("documents_kept", 1000, 749, "a relative decrease of at most 0.25 "
                                            "(validation.max_documents_decrease); tonight -25.1%")),
    ("max_documents_increase", 5000, None),
    ("max_documents_increase", 5001, Finding("documents_kept", 1000, 5001, "a relative increase of at most 4 "
                                             "(validation.max_documents_increase); tonight +400.1%")),
])
def test_the_document_count_may_move_up_to_its_bounds(key, kept, finding):
    assert _only(key, {"max_documents_decrease": 0.25, "max_documents_increase": 4.0}[key],
                 documents_kept=kept) == ([finding] if finding else [])


@pytest.mark.parametrize(("kept", "characters", "refused"), [(700, 130_000, []), (699, 130_001, [
    "documents_kept", "characters"])])
def test_a_bound_reached_exactly_passes_though_its_float_is_not_exact(kept, characters, refused):
    """0.3 and 1.3 as written: 700/1000 - 1 is not -0.3 and 130000/100000 - 1 is not 0.3 in floating point."""
    bounds = ValidationConfig(**{**OFF, "max_documents_decrease": 0.3, "max_characters_increase": 0.3})
    findings = compare(replace(THEN, documents_kept=kept, characters=characters), THEN, bounds)
    assert [finding.statistic for finding in findings] == refused


def test_the_character_count_has_its_own_bounds_and_an_unknown_count_is_not_checked():
    assert _only("max_characters_decrease", 0.3, characters=69_000) == [Finding(
        "characters", 100_000, 69_000, "a relative decrease of at most 0.3 (validation.max_characters_decrease); "
                                       "tonight -31.0%")]
    assert _only("max_characters_increase", 0.5, characters=150_001)[0].bound.startswith(
        "a relative increase of at most 0.5 (validation.max_characters_increase)")
    assert _only("max_characters_increase", 0.5, characters=150_000) == []
    assert _only("max_characters_decrease", 0.3, characters=None) == []
    assert compare(THEN, replace(THEN, characters=0), ValidationConfig(**{**OFF, "max_characters_increase": 0.1})) \
        == []


def test_a_decrease_past_its_bound_is_found_even_with_an_increase_bound_set():
    both = {**OFF, "max_documents_decrease": 0.1, "max_documents_increase": 0.1}
    assert [f.bound[:21] for f in compare(replace(THEN, documents_kept=800), THEN, ValidationConfig(**both))] == [
        "a relative decrease o"]
    assert [f.bound[:21] for f in compare(replace(THEN, documents_kept=1200), THEN, ValidationConfig(**both))] == [
        "a relative increase o"]


def test_the_cjk_share_may_change_by_its_bound_either_way():
    assert _only("max_cjk_share_change", 0.1, cjk_share=0.8) == []
    assert _only("max_cjk_share_change", 0.1, cjk_share=0.79) == [Finding(
        "cjk_share", 0.9, 0.79, "change of at most 0.1 (validation.max_cjk_share_change)")]
    assert [f.tonight for f in _only("max_cjk_share_change", 0.05, cjk_share=0.96)] == [0.96]
    assert _only("max_cjk_share_change", 0.05, cjk_share=None) == []
    exact = replace(THEN, cjk_share=0.75)  # 0.75 - 0.5 is 0.25 exactly in floating point: at the bound, not past
    assert compare(replace(THEN, cjk_share=0.5), exact, ValidationConfig(**{**OFF, "max_cjk_share_change": 0.25})) \
        == []


def test_the_loss_under_the_champion_may_rise_by_its_bound():
    assert _only("max_nats_per_char_increase", 0.15, nats_per_char=2.3) == []
    assert _only("max_nats_per_char_increase", 0.15, nats_per_char=2.32) == [Finding(
        "nats_per_char", 2.0, 2.32, "relative increase of at most 0.15 (validation.max_nats_per_char_increase); "
                                    "tonight +16.0%")]
    assert _only("max_nats_per_char_increase", 0.15, nats_per_char=None) == []
    assert _only("max_nats_per_char_increase", 0.25, nats_per_char=2.5) == []  # 2.5 / 2 - 1 is 0.25 exactly
    assert compare(THEN, replace(THEN, nats_per_char=None), ValidationConfig(**{**OFF,
                                                                              "max_nats_per_char_increase": 0.0})) == []


@pytest.mark.parametrize(("key", "field", "limit"), [
    ("max_character_distance", "character_distance", 0.1),
    ("max_duplicate_share", "duplicate_share", 0.3),
    ("max_byte_fallback_rate", "byte_fallback_rate", 0.25),
])
def test_tonights_own_figures_may_reach_their_limit(key, field, limit):
    assert _only(key, limit, **{field: limit}) == []
    assert _only(key, limit, **{field: limit + 0.001}) == [Finding(
        field, None, limit + 0.001, f"at most {limit:g} (validation.{key})")]
    assert _only(key, None, **{field: 1.0}) == []


def test_an_unknown_figure_of_tonight_is_not_checked():
    assert _only("max_character_distance", 0.1, character_distance=None) == []
    assert _only("max_byte_fallback_rate", 0.1, byte_fallback_rate=None) == []


def test_tokens_per_character_may_change_by_its_bound_either_way():
    assert _only("max_tokens_per_character_change", 0.25, tokens_per_character=0.625) == []
    assert _only("max_tokens_per_character_change", 0.25, tokens_per_character=0.375) == []
    assert _only("max_tokens_per_character_change", 0.25, tokens_per_character=0.63) == [Finding(
        "tokens_per_character", 0.5, 0.63, "relative change of at most 0.25 "
                                           "(validation.max_tokens_per_character_change)")]
    assert [f.tonight for f in _only("max_tokens_per_character_change", 0.25, tokens_per_character=0.37)] == [0.37]
    assert _only("max_tokens_per_character_change", 0.25, tokens_per_character=None) == []


def test_each_length_quantile_stays_within_a_factor():
    assert _only("max_length_quantile_factor", 2.0, length_quantiles={"p50": 50.0, "p90": 800.0}) == []
    assert _only("max_length_quantile_factor", 2.0, length_quantiles={"p50": 49.0, "p90": 801.0}) == [
        Finding("length_quantiles.p50", 100.0, 49.0, "within a factor 2 (validation.max_length_quantile_factor)"),
        Finding("length_quantiles.p90", 400.0, 801.0, "within a factor 2 (validation.max_length_quantile_factor)")]
    assert _only("max_length_quantile_factor", 2.0, length_quantiles={"p50": 1.0}) == [
        Finding("length_quantiles.p50", 100.0, 1.0, "within a factor 2 (validation.max_length_quantile_factor)")]
    assert _only("max_length_quantile_factor", 2.0, length_quantiles=None) == []
    short = replace(THEN, length_quantiles={"p50": 0.5})  # a quantile below one is compared too
    assert [f.statistic for f in compare(replace(THEN, length_quantiles={"p50": 2.0}), short,
                                         ValidationConfig(**{**OFF, "max_length_quantile_factor": 2.0}))] == [
        "length_quantiles.p50"]
    zero = replace(THEN, length_quantiles={"p50": 0.0})
    assert compare(replace(THEN, length_quantiles={"p50": 5.0}), zero,
                   ValidationConfig(**{**OFF, "max_length_quantile_factor": 2.0})) == []


def test_a_drop_reason_may_grow_by_its_bound_and_a_new_reason_counts_from_zero():
    assert _only("max_drop_share_increase", 0.2, drop_shares={"short": 0.3, "empty": 0.0}) == []
    assert _only("max_drop_share_increase", 0.2, drop_shares={"short": 0.31, "empty": 0.21, "binary": 0.25}) == [
        Finding("drop_shares.binary", 0.0, 0.25, "increase of at most 0.2 (validation.max_drop_share_increase)"),
        Finding("drop_shares.empty", 0.0, 0.21, "increase of at most 0.2 (validation.max_drop_share_increase)"),
        Finding("drop_shares.short", 0.1, 0.31, "increase of at most 0.2 (validation.max_drop_share_increase)")]
    assert _only("max_drop_share_increase", 0.2, drop_shares={}) == []
    exact = replace(THEN, drop_shares={"short": 0.25})  # 0.5 - 0.25 is 0.25 exactly: at the bound, not past
    assert compare(replace(THEN, drop_shares={"short": 0.5}), exact,
                   ValidationConfig(**{**OFF, "max_drop_share_increase": 0.25})) == []


def _scores(per_char: list[float]) -> SampleScores:
    return SampleScores([f"text {i}" for i in range(len(per_char))], np.array(per_char) * 10, np.full(len(per_char),
                                                                                                      10))


def test_screening_flags_the_documents_past_the_factor_of_the_champions_own_loss():
    screened = screen(_scores([2.0, 2.4, 2.41, 5.123456]), THEN, ValidationConfig(max_document_nats_factor=1.2))
    assert screened == Screening(4, 2, 0.5, 2.4, [{"nats_per_char": 5.1235, "text": "text 3"},
                                                  {"nats_per_char": 2.41, "text": "text 2"},
                                                  {"nats_per_char": 2.4, "text": "text 1"}])
    assert screened.line() == ("screening: 2 of 4 sampled documents (50%) above 2.4 nats/char "
                               "(validation.max_document_nats_factor); worst under the champion:")
    unlimited = screen(_scores([2.0, 9.0]), THEN, ValidationConfig(max_document_nats_factor=None))
    assert (unlimited.flagged, unlimited.share, unlimited.limit) == (0, 0.0, None)
    assert unlimited.line() == "screening: 2 sampled documents scored; worst under the champion:"
    assert screen(_scores([2.0, 9.0]), None, ValidationConfig()).limit is None
    assert screen(_scores([2.0]), replace(THEN, nats_per_char=None), ValidationConfig()).limit is None
    assert screen(None, THEN, ValidationConfig()) is None
    assert screen(_scores([]), THEN, ValidationConfig()) is None
    assert Screening(1, 0, 0.0, None, []).line() == "screening: 1 sampled documents scored"


def test_the_outcome_without_a_champion_or_its_statistics_is_not_compared():
    first = decide(THEN, None, ValidationConfig(), "lm")
    assert (first.outcome, first.model_name, first.champion_version, first.failures, first.champion) == (
        "not_compared", "lm", None, [], None)
    assert first.reason == "Corpus statistics recorded; nothing compared: lm has no champion yet"
    assert first.tonight == THEN.to_json()
    older = decide(THEN, ("4", None), ValidationConfig(), "lm")
    assert (older.outcome, older.model_name, older.champion_version, older.champion) == (
        "not_compared", "lm", "4", None)
    assert older.tonight == THEN.to_json()
    assert older.reason == ("Corpus statistics recorded; nothing compared: lm version 4 (champion) records none "
                            "(registered before the data gate)")


def test_passed_warned_and_stopped_say_what_was_compared():
    passed = decide(THEN, ("4", THEN), ValidationConfig(), "lm")
    assert (passed.outcome, passed.model_name, passed.champion_version, passed.failures) == ("passed", "lm", "4", [])
    assert passed.reason == "Corpus statistics within the data gate's bounds against lm version 4 (champion)"
    assert (passed.tonight, passed.champion) == (THEN.to_json(), THEN.to_json())
    small = replace(THEN, documents_kept=100, characters=10_000)
    stopped = decide(small, ("4", THEN), ValidationConfig(), "lm")
    assert (stopped.outcome, stopped.model_name, stopped.champion_version) == ("stopped", "lm", "4")
    assert [f.statistic for f in stopped.failures] == ["documents_kept", "characters"]
    assert stopped.reason == ("2 corpus statistics past the data gate's bounds against lm version 4 (champion); the "
                              "run stops before training (validation.mode: warn or retrain.force: true trains "
                              "anyway):")
    assert (stopped.tonight, stopped.champion) == (small.to_json(), THEN.to_json())
    warned = decide(replace(THEN, documents_kept=100), ("4", THEN), ValidationConfig(mode="warn"), "lm")
    assert (warned.outcome, warned.model_name, warned.champion_version, len(warned.failures), warned.champion) == (
        "warned", "lm", "4", 1, THEN.to_json())
    assert warned.reason == ("1 corpus statistic past the data gate's bounds against lm version 4 (champion); "
                             "training anyway (validation.mode: warn):")
    forced = decide(replace(THEN, documents_kept=100), ("4", THEN), ValidationConfig(), "lm", force=True)
    assert (forced.outcome, forced.tonight) == ("warned", replace(THEN, documents_kept=100).to_json())
    assert forced.reason.endswith("; training anyway (retrain.force: true):")


def test_the_flagged_share_is_a_failure_past_its_bound_only():
    config = ValidationConfig(max_document_nats_factor=1.2, max_flagged_share=0.25)
    stopped = decide(THEN, ("4", THEN), config, "lm", scores=_scores([2.0, 2.0, 2.0, 5.0, 5.0]))
    assert stopped.failures == [Finding("screening.flagged_share", None, 0.4, "at most 0.25 of the sampled documents "
                                        "above 1.2x the champion's own nats/char (validation.max_flagged_share); "
                                        "tonight 2 of 5")]
    assert stopped.screening == Screening(5, 2, 0.4, 2.4, stopped.screening.worst)
    at_bound = decide(THEN, ("4", THEN), config, "lm", scores=_scores([2.0, 2.0, 2.0, 5.0]))
    assert (at_bound.outcome, at_bound.failures) == ("passed", [])
    assert at_bound.screening.share == 0.25
    off = ValidationConfig(max_document_nats_factor=1.2, max_flagged_share=None)
    assert decide(THEN, ("4", THEN), off, "lm", scores=_scores([5.0])).outcome == "passed"
    unlimited = ValidationConfig(max_document_nats_factor=None, max_flagged_share=0.0)
    assert decide(THEN, ("4", THEN), unlimited, "lm", scores=_scores([5.0])).outcome == "passed"
    assert decide(THEN, None, config, "lm", scores=_scores([5.0])).screening.limit is None


def test_the_stop_error_and_the_console_block_name_each_failure():
    tonight = replace(THEN, documents_kept=100, character_distance=0.123456)
    report = decide(tonight, ("4", THEN), ValidationConfig(), "lm", scores=_scores([2.0, 9.0]))
    assert str(ValidationStopped(report)) == (
        "the corpus is past the data gate's bounds against lm version 4 (documents_kept 1,000 → 100; "
        "character_distance 0.1235); nothing was trained (validation.mode: warn or retrain.force: true trains anyway)")
    assert ValidationStopped(report).report is report
    assert report.block().splitlines() == [
        report.reason,
        "  documents_kept: champion 1,000, tonight 100; bound: a relative decrease of at most 0.3 "
        "(validation.max_documents_decrease); tonight -90.0%",
        "  character_distance: tonight 0.1235; bound: at most 0.1 (validation.max_character_distance)",
        "  screening: 1 of 2 sampled documents (50%) above 2.4 nats/char (validation.max_document_nats_factor); "
        "worst under the champion:",
        "    9.00  text 1",
        "    2.00  text 0"]
    report.dropped = Dropped(scored=10, dropped=1, share=0.1, limit=2.4, seconds=1.25)
    assert report.block().splitlines()[-1] == ("  screening: dropped 1 of 10 training documents (10.0%) above 2.4 "
                                               "nats/char (validation.screening: drop) in 1.2 s")
    quiet = decide(THEN, ("4", THEN), ValidationConfig(), "lm", scores=_scores([2.0]))
    assert quiet.block().splitlines() == [quiet.reason, "  screening: 0 of 1 sampled documents (0%) above 2.4 "
                                          "nats/char (validation.max_document_nats_factor); worst under the champion:"]
    assert Finding("x", None, 1.5, "b").line() == "x: tonight 1.5; bound: b"
    assert _number(None) == "none"
    assert ValidationReport("passed", "lm", None, "r").to_json()["screening"] is None
