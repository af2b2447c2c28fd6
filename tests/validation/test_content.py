"""The data gate's content checks (issue 39) at both sides of each bound, the character distance and the sample
lines a report shows; no model (the champion's checks on real nights: test_content_nights.py)."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest

from train_deploy.registry.config import RegistryConfig
from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.content import OTHER, SampleScores, character_distance, character_shares, shown_line
from train_deploy.validation.records import champion_bundle
from train_deploy.validation.report import ValidationStopped, decide, screen
from train_deploy.validation.statistics import CorpusStatistics

_COUNTED = {"documents_read": 100, "documents_kept": 100, "characters": 1000, "tokens": 900,
            "tokens_per_character": 0.9, "length_quantiles": None, "cjk_share": 0.9}


def _statistics(**figures) -> CorpusStatistics:
    """A night whose counted statistics are the same as :data:`_COUNTED`'s, with ``figures``."""
    return CorpusStatistics(**(_COUNTED | figures))


def _decided(tonight: CorpusStatistics, champion: CorpusStatistics, **config):
    return decide(tonight, ("3", champion), ValidationConfig(**config), "lm")


@pytest.mark.parametrize(("tonight", "outcome"), [(5.0, "passed"), (5.001, "stopped"), (3.0, "passed")])
def test_the_champions_loss_is_stopped_only_past_its_relative_increase(tonight, outcome):
    report = _decided(_statistics(nats_per_char=tonight), _statistics(nats_per_char=4.0),
                      max_nats_per_char_increase=0.25)  # bound: +25% = 5.0 (exact in binary)
    assert report.outcome == outcome, report.block()
    if outcome == "stopped":
        (finding,) = report.failures
        assert (finding.statistic, finding.champion, finding.tonight) == ("nats_per_char", 4.0, 5.001)
        assert finding.line().count("\n") == 0 and "validation.max_nats_per_char_increase" in finding.line()
        assert "+25.0%" in finding.line()
        assert "nats_per_char 4 → 5.001" in str(ValidationStopped(report))


@pytest.mark.parametrize(("distance", "outcome"), [(0.1, "passed"), (0.1001, "stopped")])
def test_the_character_distance_is_stopped_only_past_its_bound(distance, outcome):
    report = _decided(_statistics(character_distance=distance), _statistics(character_shares={"的": 1.0}))
    assert report.outcome == outcome
    assert [f.statistic for f in report.failures] == ([] if outcome == "passed" else ["character_distance"])


def test_the_default_content_bounds_are_the_calibrated_ones():
    assert (ValidationConfig().max_nats_per_char_increase, ValidationConfig().max_character_distance) == (0.15, 0.1)
    assert _decided(_statistics(nats_per_char=4.59), _statistics(nats_per_char=4.0)).outcome == "passed"  # +14.75%
    assert _decided(_statistics(nats_per_char=4.61), _statistics(nats_per_char=4.0)).outcome == "stopped"


def test_content_bounds_set_to_null_are_not_checked():
    report = _decided(_statistics(nats_per_char=9.0, character_distance=0.9), _statistics(nats_per_char=4.0),
                      max_nats_per_char_increase=None, max_character_distance=None)
    assert report.outcome == "passed" and report.failures == []


def test_a_champion_registered_before_the_content_checks_still_gates_and_says_why_the_loss_is_skipped(caplog):
    older = CorpusStatistics.from_json({"schema": 1} | _COUNTED)  # as its tag holds it: no content figures
    assert (older.nats_per_char, older.character_shares) == (None, None)
    assert _decided(_statistics(nats_per_char=9.0, character_distance=None), older).outcome == "passed"
    assert _decided(_statistics(documents_kept=10), older).outcome == "stopped"  # the other statistics still gate
    with caplog.at_level(logging.INFO), champion_bundle(RegistryConfig(model_name="lm"), ("3", older)) as bundle:
        assert bundle is None
    assert ("lm version 3 (champion) records no loss on its own corpus (registered before the content checks): "
            "nats_per_char is not compared tonight") in caplog.messages


def test_the_character_distance_is_zero_for_the_same_shares_and_one_for_disjoint_characters():
    counts = Counter("的的的了了是")
    shares = character_shares(counts)
    assert shares == pytest.approx({"的": 0.5, "了": 0.3333, "是": 0.1667, OTHER: 0.0}, abs=1e-12)  # 4 digits
    assert character_distance(counts, shares) == pytest.approx(0.0, abs=1e-3)
    assert character_distance(Counter("abc"), {"的": 1.0, OTHER: 0.0}) == pytest.approx(1.0)
    assert character_distance(Counter(), shares) is None and character_shares(Counter()) == {}
    # characters outside the reference's top ones fall in its "other" bucket
    assert character_distance(Counter("xy"), {"的": 0.5, OTHER: 0.5}) == pytest.approx(
        float(np.sqrt((0.5 * np.log2(0.5 / 0.25) + 0.5 * np.log2(0.5 / 0.75) + np.log2(1 / 0.75)) / 2)))


def test_character_shares_keep_the_top_characters_and_other():
    shares = character_shares(Counter("aaaabbbcc d"), top=2)
    assert shares == pytest.approx({"a": 0.3636, "b": 0.2727, OTHER: 0.3637}, abs=1e-12)


def _scores(per_char: list[float]) -> SampleScores:
    texts = [f"文本{i}" for i in range(len(per_char))]
    return SampleScores(texts, np.array([10 * x for x in per_char]), np.array([10] * len(per_char)))


def test_screening_flags_documents_past_the_factor_and_shows_the_three_worst():
    screened = screen(_scores([2.0, 3.0, 3.001, 9.0, 1.0]), _statistics(nats_per_char=2.0),
                      ValidationConfig(max_document_nats_factor=1.5))
    assert (screened.scored, screened.flagged, screened.share, screened.limit) == (5, 2, 0.4, 3.0)  # 3.0 is not past
    assert screened.worst == [{"nats_per_char": 9.0, "text": "文本3"}, {"nats_per_char": 3.001, "text": "文本2"},
                              {"nats_per_char": 3.0, "text": "文本1"}]
    assert screened.line() == ("screening: 2 of 5 sampled documents (40%) above 3 nats/char "
                               "(validation.max_document_nats_factor); worst under the champion:")
    assert screen(None, None, ValidationConfig()) is None
    unscreened = screen(_scores([5.0]), None, ValidationConfig())
    assert (unscreened.flagged, unscreened.limit) == (0, None)


def test_a_stopped_report_shows_the_worst_sample_lines_and_a_passed_one_does_not():
    champion = _statistics(nats_per_char=2.0)
    stopped = decide(_statistics(nats_per_char=9.0), ("3", champion), ValidationConfig(), "lm",
                     scores=_scores([9.0, 2.0]))
    assert stopped.block().splitlines()[-2:] == ["    9.00  文本0", "    2.00  文本1"]
    passed = decide(_statistics(nats_per_char=2.0), ("3", champion), ValidationConfig(), "lm",
                    scores=_scores([9.0, 2.0]))
    assert passed.block().splitlines()[-1].startswith("  screening: 1 of 2")


def test_a_shown_line_is_one_line_of_80_characters_without_secrets_or_paths():
    text = ("加QQ 12345678 访问 http://user:pw@shop.cn/a?token=abc 密钥 api_key=sk1234 "
            "/home/alice/secret.txt\n第二行 " + "长" * 100)
    line = shown_line(text)
    assert "\n" not in line and len(line) == 80 and line.endswith("…")
    assert "12345678" in line and "shop.cn" in line
    for leaked in ("pw", "token=abc", "sk1234", "/home/alice"):
        assert leaked not in line, line


# --- the share of flagged documents (issue 39: spam mixed into good text) ------------------------------------------

@pytest.mark.parametrize(("per_char", "outcome"), [
    ([2.5] * 6 + [2.0] * 19, "passed"),  # 6 of 25 = 0.24 flagged: not past the bound
    ([2.5] * 7 + [2.0] * 18, "stopped"),  # 7 of 25 = 0.28
    ([2.4] * 7 + [2.0] * 18, "passed"),  # 2.4 = 1.2 x 2.0 is not past the factor
])
def test_the_share_of_flagged_documents_is_stopped_only_past_its_bound(per_char, outcome):
    champion = _statistics(nats_per_char=2.0)
    report = decide(_statistics(nats_per_char=2.0), ("3", champion), ValidationConfig(max_flagged_share=0.24), "lm",
                    scores=_scores(per_char))
    assert report.outcome == outcome, report.block()
    if outcome == "stopped":
        (finding,) = report.failures
        assert finding.line() == ("screening.flagged_share: tonight 0.28; bound: at most 0.24 of the sampled documents "
                                  "above 1.2x the champion's own nats/char (validation.max_flagged_share); tonight 7 "
                                  "of 25")
        assert "(screening.flagged_share 0.28)" in str(ValidationStopped(report))
        assert report.block().splitlines()[-3:] == ["    2.50  文本0", "    2.50  文本1", "    2.50  文本2"]


def test_the_flagged_share_is_not_checked_without_screening_or_with_its_bound_null():
    champion, flagged = _statistics(nats_per_char=2.0), _scores([9.0] * 4)
    assert decide(_statistics(), ("3", champion), ValidationConfig(), "lm", scores=flagged).outcome == "passed"
    bounded = ValidationConfig(max_flagged_share=0.24)
    assert decide(_statistics(), ("3", champion), ValidationConfig(max_flagged_share=0.24,
                                                                   max_document_nats_factor=None), "lm",
                  scores=flagged).outcome == "passed"
    older = _statistics()  # a champion without its own loss: nothing to flag against
    assert decide(_statistics(), ("3", older), bounded, "lm", scores=flagged).outcome == "passed"
    assert decide(_statistics(), None, bounded, "lm", scores=flagged).outcome == "not_compared"
    assert decide(_statistics(), ("3", champion), ValidationConfig(mode="warn", max_flagged_share=0.24), "lm",
                  scores=flagged).failures[0].statistic == "screening.flagged_share"


def test_the_default_screening_bounds_are_the_calibrated_ones():
    config = ValidationConfig()
    assert (config.max_document_nats_factor, config.max_flagged_share) == (1.2, None)  # off: depends on the champion

