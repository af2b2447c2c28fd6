"""Latency: every form timed on the same inputs, in interleaved rounds; parity: each form by its precision's rule."""

from __future__ import annotations

import numpy as np
import pytest

from train_deploy.export import checks
from train_deploy.export.checks import ParityError, check_parity, latency_report, parity_report
from train_deploy.export.config import LatencyConfig, ParityConfig


@pytest.mark.parametrize(("repeats", "rounds"), [(7, 3), (2, 5), (4, 1)])
def test_latency_interleaves_the_forms_and_times_every_repeat(monkeypatch, repeats, rounds):
    monkeypatch.setattr(checks, "_SETTLE_S", 0.0)
    calls: list[tuple[str, tuple[int, ...]]] = []

    def form(name):
        def run(ids, mask):
            assert ids.dtype == mask.dtype == np.int64 and ids.shape == mask.shape and mask.all()
            calls.append((name, ids.shape))
            return np.zeros((*ids.shape, 5), np.float32)
        return run

    config = LatencyConfig(batch_sizes=[1, 3], seq_length=6, warmup=2, repeats=repeats, rounds=rounds)
    report = latency_report({"a": form("a"), "b": form("b")}, vocab_size=50, context=4, config=config)

    assert report["seq_length"] == 4  # capped by the context
    for batch in (1, 3):
        made = [name for name, shape in calls if shape == (batch, 4)]
        blocks = min(rounds, repeats)
        assert made.count("a") == made.count("b") == 2 + blocks + repeats  # warm-up, one untimed call a block
        timed = made[4:]  # after both forms' warm-up calls
        order = [timed[0]] + [b for a, b in zip(timed, timed[1:], strict=False) if a != b]
        assert order == ["a", "b"] * blocks  # interleaved
        for name in "ab":
            timing = report["forms"][name][f"batch_{batch}"]
            assert 0 <= timing["p50"] <= timing["p95"]


# Parity: each form by the rule of its precision, on logits a fixed table gives for each input id.
VOCAB = 50
TABLE = np.random.default_rng(1).normal(0, 3, size=(VOCAB, VOCAB)).astype(np.float32)
WINDOWS = np.random.default_rng(2).integers(0, VOCAB, size=(6, 21))


def trained(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return TABLE[ids]


def off_by(noise: float, shift: float = 0.0):
    """A form whose logits differ from the trained model's by deterministic noise of size ``noise``, plus a
    constant ``shift`` (which moves every logit and leaves every probability as it is)."""
    rng = np.random.default_rng(3)
    error = rng.uniform(-noise, noise, size=TABLE.shape).astype(np.float32)
    return lambda ids, mask: TABLE[ids] + error[ids] + shift


def test_an_fp16_form_is_judged_by_its_perplexity_not_by_the_fp32_logit_bound():
    forms = {"paddle_inference": off_by(0.01), "onnx_fp32": off_by(0.01)}
    report = parity_report(WINDOWS, trained, forms, VOCAB, ParityConfig(), precisions={"paddle_inference": "fp16"})
    assert report["precision"] == {"paddle_inference": "fp16", "onnx_fp32": "fp32"}
    assert report["max_abs_logit_diff"]["paddle_inference"] > 1e-4  # what fails the fp32 form
    fp32_diff = report["max_abs_logit_diff"]["onnx_fp32"]
    assert report["failures"] == [f"onnx_fp32 max |logit diff| {fp32_diff:.3g} > 0.0001"]
    assert abs(report["fp16_perplexity_increase"]["paddle_inference"]) < 0.01 and not report["warnings"]


def test_an_fp16_form_over_its_perplexity_bound_fails_in_one_line_naming_the_form():
    report = parity_report(WINDOWS, trained, {"paddle_inference": off_by(3.0)}, VOCAB, ParityConfig(),
                           precisions={"paddle_inference": "tensorrt_fp16"})
    increase = report["fp16_perplexity_increase"]["paddle_inference"]
    assert increase > 0.01 and not report["passed"]
    with pytest.raises(ParityError) as failure:
        check_parity(report, "the bundle of step_6")
    assert str(failure.value) == (
        f"the bundle of step_6: parity failed: paddle_inference (tensorrt_fp16) perplexity "
        f"{report['perplexity']['paddle_inference']:.4g} is {increase:+.2%} over the trained model's "
        f"{report['perplexity']['trained']:.4g} (limit +1.0%)")
    loose = parity_report(WINDOWS, trained, {"paddle_inference": off_by(3.0)}, VOCAB,
                          ParityConfig(max_fp16_perplexity_increase=increase + 0.01, max_fp16_logit_diff=10.0),
                          precisions={"paddle_inference": "tensorrt_fp16"})
    assert loose["passed"] and loose["limits"]["max_fp16_perplexity_increase"] == increase + 0.01


def test_an_fp16_logit_difference_beyond_its_tolerance_is_reported_not_failed(caplog):
    report = parity_report(WINDOWS, trained, {"paddle_inference": off_by(0.0, shift=0.5)}, VOCAB, ParityConfig(),
                           precisions={"paddle_inference": "fp16"})
    assert report["passed"] and report["fp16_perplexity_increase"]["paddle_inference"] == pytest.approx(0, abs=1e-6)
    assert report["warnings"] == ["paddle_inference (fp16) max |logit diff| 0.5 is beyond the expected 0.1 "
                                  "(judged by perplexity)"]
    assert "Parity: paddle_inference (fp16) max |logit diff| 0.5" in caplog.text


def test_forms_without_a_named_precision_keep_the_float32_and_int8_rules():
    forms = {"paddle_inference": off_by(0.0), "onnx_fp32": off_by(0.0), "onnx_int8": off_by(2.0)}
    report = parity_report(WINDOWS, trained, forms, VOCAB, ParityConfig())
    assert report["precision"] == {"paddle_inference": "fp32", "onnx_fp32": "fp32", "onnx_int8": "int8"}
    assert [f.split(" ")[0] for f in report["failures"]] == ["onnx_int8"]  # by perplexity, not by its logits
    assert "fp16_perplexity_increase" not in report
