"""The gate's rules as pure functions (``train_deploy.registry.rules``): the baseline rule on a bundle's figures and
the decision's order (force, baseline, first, too few texts, the paired interval), each with its exact reason. No
MLflow, no model: these run once per mutant of ``make mutation`` (tests/registry/test_gate.py gates real bundles)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.paired import Comparison, TextScores
from train_deploy.registry.rules import DECIDED, PROMOTING, BaselineCheck, _compared, check_baselines, decide

REPORT = {"unigram_loss": 6.0, "bigram_loss": 5.5, "unigram_k": 0.1, "bigram_k": 0.2, "windows": 8, "seq_length": 64,
          "train_tokens": 1000}
PARITY = {**REPORT, "windows": 4, "model_loss": 5.8}
PASSED = BaselineCheck(5.0, "unigram", 6.0, "")
REFUSED = BaselineCheck(6.5, "unigram", 6.0, "worse than counting")


def _bundle(val_baselines: dict | None = REPORT, val_loss: float | None = 5.9, parity: dict | None = PARITY):
    """A bundle as the rule reads it: ``meta.source``'s validation figures and ``parity.baselines``."""
    source = SimpleNamespace(val_baselines=val_baselines, val_loss=val_loss)
    return SimpleNamespace(meta=SimpleNamespace(source=source), parity=SimpleNamespace(baselines=parity))


def _refusal(loss: float, name: str, baseline: float, where: str, require: str) -> str:
    return (f"its validation loss {loss:.4f} nats/token is not below the {name} baseline's {baseline:.4f} on {where}: "
            f"it predicts worse than counting (registry.require_beats: {require})")


WINDOWS = "the same 8 validation windows of 64 tokens"


def test_a_validation_loss_below_the_unigram_passes_and_names_it():
    assert check_baselines(_bundle(), "unigram") == BaselineCheck(5.9, "unigram", 6.0, "")


def test_a_validation_loss_equal_to_the_unigram_is_refused_with_both_figures_and_the_windows():
    assert check_baselines(_bundle(val_loss=6.0), "unigram") == BaselineCheck(
        6.0, "unigram", 6.0, _refusal(6.0, "unigram", 6.0, WINDOWS, "unigram"))


def test_bigram_asks_for_both_and_names_the_one_that_refused():
    assert check_baselines(_bundle(val_loss=5.4), "bigram") == BaselineCheck(5.4, "add-k bigram", 5.5, "")
    assert check_baselines(_bundle(val_loss=5.5), "bigram") == BaselineCheck(
        5.5, "add-k bigram", 5.5, _refusal(5.5, "add-k bigram", 5.5, WINDOWS, "bigram"))
    assert check_baselines(_bundle(val_loss=6.1), "bigram") == BaselineCheck(
        6.1, "unigram", 6.0, _refusal(6.1, "unigram", 6.0, WINDOWS, "bigram"))


def test_kneser_ney_asked_of_a_report_without_it_is_refused_naming_the_missing_baseline():
    assert check_baselines(_bundle(val_loss=5.0), "kneser_ney_bigram") == BaselineCheck(
        5.0, "Kneser-Ney bigram", None, "the bundle has no Kneser-Ney bigram baseline to compare its validation loss "
                                        "with (registry.require_beats: kneser_ney_bigram)")
    with_kn = _bundle(val_baselines={**REPORT, "kn_bigram_loss": 5.2}, val_loss=5.1)
    assert check_baselines(with_kn, "kneser_ney_bigram") == BaselineCheck(5.1, "Kneser-Ney bigram", 5.2, "")


def test_none_holds_nothing_back_and_reports_the_unigram():
    assert check_baselines(_bundle(val_loss=9.0), "none") == BaselineCheck(9.0, "unigram", 6.0, "")


@pytest.mark.parametrize("source", [{"val_baselines": None}, {"val_loss": None}, {"val_baselines": {}}])
def test_without_both_validation_figures_the_parity_windows_are_used(source):
    assert check_baselines(_bundle(**source), "unigram") == BaselineCheck(5.8, "unigram", 6.0, "")
    refused = _bundle(**source, parity={**PARITY, "model_loss": 6.2})
    assert check_baselines(refused, "unigram") == BaselineCheck(
        6.2, "unigram", 6.0, _refusal(6.2, "unigram", 6.0, "the same 4 parity windows", "unigram"))


def test_a_bundle_without_any_baseline_is_refused_unless_the_rule_is_off():
    bare = _bundle(val_baselines=None, parity=None)
    assert check_baselines(bare, "none") == BaselineCheck(None, None, None, "")
    assert check_baselines(bare, "unigram") == BaselineCheck(None, None, None, (
        "the bundle records no validation loss beside the n-gram baselines, so nothing shows it predicts better than "
        "counting (registry.require_beats: none turns the rule off)"))
    assert check_baselines(_bundle(val_baselines=None, parity={}), "bigram").refusal.startswith("the bundle records")


def _scores(nats: list[float], chars: int = 10) -> TextScores:
    return TextScores(np.array(nats, dtype=float), np.full(len(nats), chars, dtype=np.int64))


def _config(**registry) -> RegistryConfig:
    return RegistryConfig.from_params({"eval_set": {"min_texts": 4}, **registry})


BETTER, SAME = _scores([20.0, 21.0, 19.0, 20.0]), _scores([30.0, 31.0, 29.0, 30.0])


def test_the_first_version_is_champion_and_a_small_set_is_said_so():
    verdict = decide(BETTER, None, None, _config(), PASSED)
    assert (verdict.decision, verdict.champion_value, verdict.comparison) == ("first", None, None)
    assert verdict.reason == ("no champion yet: the first version becomes champion (the candidate's 2.0000 nats/char "
                              "on the evaluation set)")
    small = decide(BETTER, None, None, _config(eval_set={"min_texts": 5}), PASSED)
    assert small.reason == (
        "no champion yet: the first version becomes champion (the candidate's 2.0000 nats/char on the evaluation set; "
        "the evaluation set holds 4 texts, fewer than registry.eval_set.min_texts 5: later candidates will be "
        "undecided on it, so give a new model name a larger set (registry.eval_set.path, or a larger "
        "corpus.encoding.validation_fraction))")


def test_the_baseline_rule_comes_before_first_and_names_the_refusal():
    verdict = decide(BETTER, None, None, _config(), REFUSED)
    assert (verdict.decision, verdict.champion_value) == ("rejected", None)
    assert verdict.reason == ("never champion worse than counting: worse than counting (the candidate's 2.0000 "
                              "nats/char on the evaluation set)")
    against = decide(BETTER, "3", SAME, _config(), REFUSED)
    assert (against.decision, against.champion_value) == ("rejected", 3.0)
    assert against.comparison is not None and against.reason.startswith(
        "never champion worse than counting: worse than counting (the candidate's 2.0000 nats/char against champion "
        "version 3's 3.0000: 33.33% fewer nats/char (95% interval of the improvement ")


def test_a_clearly_better_candidate_is_promoted_and_a_worse_rejected():
    promoted = decide(BETTER, "3", SAME, _config(), PASSED)
    assert (promoted.decision, promoted.champion_value) == ("promoted", 3.0)
    assert promoted.comparison.texts == 4 and promoted.comparison.improvement == pytest.approx(1 / 3)
    assert promoted.reason.endswith(": the improvement exceeds 1.00% (registry.min_improvement) at that confidence")
    rejected = decide(SAME, "3", BETTER, _config(), PASSED)
    assert (rejected.decision, rejected.champion_value) == ("rejected", 2.0)
    assert rejected.reason.endswith(": promotion needs an improvement above 1.00% (registry.min_improvement), and "
                                    "the interval lies at or below it")


def test_a_champion_without_scores_stops_the_gate_unless_forced():
    with pytest.raises(ValueError, match=r"^champion version 3 has no score \(its run is gone\)$"):
        decide(BETTER, "3", None, _config(), PASSED, unscored="its run is gone")
    with pytest.raises(ValueError, match=r"^champion version 3 has no score \(not scored\)$"):
        decide(BETTER, "3", None, _config(), PASSED)
    forced = decide(BETTER, "3", None, _config(force=True), REFUSED, unscored="its run is gone")
    assert (forced.decision, forced.champion_value, forced.comparison) == ("forced", None, None)
    assert forced.reason == ("registry.force: promoted without a comparison, champion version 3 could not be scored "
                             "(its run is gone; the candidate's 2.0000 nats/char on the evaluation set); it overrides "
                             "the baseline rule: worse than counting")


def test_force_promotes_a_worse_candidate_and_keeps_the_comparison():
    forced = decide(SAME, "3", BETTER, _config(force=True), PASSED)
    assert (forced.decision, forced.champion_value) == ("forced", 2.0)
    assert forced.comparison is not None and forced.comparison.improvement == pytest.approx(-0.5)
    assert forced.reason.startswith("registry.force: promoted whatever the gate says (the candidate's 3.0000 "
                                    "nats/char against champion version 3's 2.0000: 50.00% more nats/char")
    assert forced.reason.endswith("texts))")
    first = decide(SAME, None, None, _config(force=True), PASSED)
    assert (first.decision, first.champion_value, first.reason) == (
        "forced", None, "registry.force: promoted whatever the gate says (the candidate's 3.0000 nats/char on the "
                        "evaluation set)")


def _comparison(low: float, high: float, texts: int = 4) -> Comparison:
    return Comparison(improvement=(low + high) / 2, low=low, high=high, confidence=0.95, texts=texts)


@pytest.mark.parametrize(("low", "high", "texts", "decision"), [
    (0.02, 0.05, 4, "promoted"),
    (0.01, 0.05, 4, "undecided"),  # the lower bound must exceed min_improvement, not reach it
    (0.0101, 0.05, 4, "promoted"),
    (-0.05, 0.01, 4, "rejected"),  # an upper bound at min_improvement cannot promote
    (-0.05, 0.0101, 4, "undecided"),
    (0.02, 0.05, 3, "undecided"),  # fewer than min_texts: however clear
])
def test_the_interval_against_min_improvement_decides(low, high, texts, decision):
    verdict = _compared(_comparison(low, high, texts), "3", "AGAINST", 2.5, _config())
    assert (verdict.decision, verdict.champion_value, verdict.comparison) == (decision, 2.5,
                                                                             _comparison(low, high, texts))


def test_undecided_reasons_say_why_and_that_the_champion_stays():
    few = _compared(_comparison(0.02, 0.05, 3), "3", "AGAINST", 2.5, _config())
    assert few.reason == ("undecided: the evaluation set holds 3 texts, fewer than registry.eval_set.min_texts 4, too "
                          "few to decide on; champion version 3 stays (AGAINST)")
    across = _compared(_comparison(0.0, 0.05), "3", "AGAINST", 2.5, _config())
    assert across.reason == ("undecided: AGAINST, across the 1.00% (registry.min_improvement) needed; champion "
                             "version 3 stays")
    assert _compared(_comparison(0.02, 0.05), "3", "AGAINST", None, _config()).reason == (
        "AGAINST: the improvement exceeds 1.00% (registry.min_improvement) at that confidence")
    assert _compared(_comparison(-0.05, 0.0), "3", "AGAINST", None, _config()).reason == (
        "AGAINST: promotion needs an improvement above 1.00% (registry.min_improvement), and the interval lies at or "
        "below it")


def test_the_decision_sets():
    assert DECIDED == {"first", "promoted", "rejected", "undecided", "forced"}
    assert PROMOTING == {"first", "promoted", "forced"}
