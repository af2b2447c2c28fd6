"""Parity of every exported form with the trained model, and latency of each form."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from train_deploy.baselines import Baselines
from train_deploy.export.config import LatencyConfig, ParityConfig
from train_deploy.export.runtime import Logits, log_softmax

logger = logging.getLogger(__name__)

_BATCH_BYTES = 256 * 2**20  # logits held at once while comparing


class ParityError(RuntimeError):
    """An exported form does not compute what the trained model computes; the message has the numbers."""


def parity_report(windows: np.ndarray, reference: Logits, forms: dict[str, Logits], vocab_size: int,
                  config: ParityConfig, precisions: dict[str, str] | None = None,
                  baselines: Baselines | None = None) -> dict[str, Any]:
    """Compare each form's logits with ``reference`` on ``windows`` ``[n, seq + 1]``; the verdict is in the report.

    Each form is judged by the rule of its precision (``precisions``: ``fp32`` unless named, ``int8`` for
    ``onnx_int8``): float32 forms must match within ``max_logit_diff``; fp16 and TensorRT forms (any other
    precision) may raise the trained model's perplexity by at most ``max_fp16_perplexity_increase``, and
    their |logit| difference is only held against ``max_fp16_logit_diff`` as a warning; the int8 model's
    perplexity may exceed ONNX fp32's by at most ``max_int8_perplexity_increase``. ``baselines`` (the n-gram
    baselines of the same ``windows``) go into the report beside the trained model's loss, as information.
    """
    precisions = {name: "int8" if name == "onnx_int8" else "fp32" for name in forms} | (precisions or {})
    ids, targets = windows[:, :-1].astype(np.int64), windows[:, 1:].astype(np.int64)
    mask = np.ones_like(ids)
    step = max(1, _BATCH_BYTES // (ids.shape[1] * vocab_size * 4))
    diff = dict.fromkeys(forms, 0.0)
    nll = dict.fromkeys(["trained", *forms], 0.0)
    for first in range(0, len(ids), step):
        part = slice(first, first + step)
        expected = reference(ids[part], mask[part])
        nll["trained"] += _nll(expected, targets[part])
        for name, run in forms.items():
            logits = run(ids[part], mask[part])
            diff[name] = max(diff[name], float(np.abs(logits - expected).max()))
            nll[name] += _nll(logits, targets[part])
    tokens = targets.size
    perplexity = {name: float(np.exp(total / tokens)) for name, total in nll.items()}
    report: dict[str, Any] = {
        "samples": int(len(ids)), "seq_length": int(ids.shape[1]), "reference": "trained model, Paddle eager",
        "precision": {name: precisions[name] for name in forms},
        "max_abs_logit_diff": diff, "perplexity": perplexity,
        "limits": {"max_logit_diff": config.max_logit_diff, "max_fp16_logit_diff": config.max_fp16_logit_diff,
                   "max_fp16_perplexity_increase": config.max_fp16_perplexity_increase,
                   "max_int8_perplexity_increase": config.max_int8_perplexity_increase},
    }
    if baselines is not None:
        report["baselines"] = baseline_report(baselines, nll["trained"] / tokens)
    report["failures"], report["warnings"] = _judge(report, config)
    report["passed"] = not report["failures"]
    for warning in report["warnings"]:
        logger.warning("Parity: %s", warning)
    return report


def baseline_report(baselines: Baselines, model_loss: float) -> dict[str, Any]:
    """The n-gram baselines of the parity windows beside the trained model's loss on them (nats/token)."""
    return {**dataclasses.asdict(baselines), "model_loss": model_loss,
            "model_beats_bigram": baselines.beaten_by(model_loss)}


def _judge(report: dict[str, Any], config: ParityConfig) -> tuple[list[str], list[str]]:
    """Failures and warnings of a parity report, one line each naming the form; fills in the increases."""
    diff, perplexity, failures, warnings = report["max_abs_logit_diff"], report["perplexity"], [], []
    for name, precision in report["precision"].items():
        if precision == "fp32":
            if diff[name] > config.max_logit_diff:
                failures.append(f"{name} max |logit diff| {diff[name]:.3g} > {config.max_logit_diff:g}")
        elif precision != "int8":
            increase = perplexity[name] / perplexity["trained"] - 1
            report.setdefault("fp16_perplexity_increase", {})[name] = increase
            if increase > config.max_fp16_perplexity_increase:
                failures.append(f"{name} ({precision}) perplexity {perplexity[name]:.4g} is {increase:+.2%} over the "
                                f"trained model's {perplexity['trained']:.4g} "
                                f"(limit {config.max_fp16_perplexity_increase:+.1%})")
            if diff[name] > config.max_fp16_logit_diff:
                warnings.append(f"{name} ({precision}) max |logit diff| {diff[name]:.3g} is beyond the expected "
                                f"{config.max_fp16_logit_diff:g} (judged by perplexity)")
    if "onnx_int8" in diff and "onnx_fp32" in diff:
        increase = perplexity["onnx_int8"] / perplexity["onnx_fp32"] - 1
        report["int8_perplexity_increase"] = increase
        if increase > config.max_int8_perplexity_increase:
            failures.append(f"onnx_int8 perplexity {perplexity['onnx_int8']:.4g} is {increase:+.2%} over onnx_fp32 "
                            f"{perplexity['onnx_fp32']:.4g} (limit {config.max_int8_perplexity_increase:+.0%})")
    return failures, warnings


def check_parity(report: dict[str, Any], where: str) -> None:
    if not report["passed"]:
        raise ParityError(f"{where}: parity failed: {'; '.join(report['failures'])}")


_SETTLE_S = 0.25


def latency_report(forms: dict[str, Logits], vocab_size: int, context: int, config: LatencyConfig,
                   seed: int = 0) -> dict[str, Any]:
    """p50/p95 milliseconds of one forward pass per form, batch size and the configured sequence length.

    Forms are timed in interleaved rounds (``config.rounds``), so that a shared machine's drift in speed
    weighs on every form alike instead of on whichever ran last; before each form's block, a pause lets
    the previous engine's worker threads stop spinning (OpenMP spins 200 ms after each parallel region by
    default, and would take a core from the next engine), and one untimed call warms the form up again.
    """
    seq = min(config.seq_length, context)
    rng = np.random.default_rng(seed)
    report: dict[str, Any] = {"seq_length": seq, "repeats": config.repeats, "unit": "ms", "forms": {}}
    for batch in config.batch_sizes:
        args = (rng.integers(3, vocab_size, size=(batch, seq), dtype=np.int64), np.ones((batch, seq), np.int64))
        times: dict[str, list[float]] = {name: [] for name in forms}
        for run in forms.values():
            for _ in range(config.warmup):
                run(*args)
        rounds = max(1, min(config.rounds, config.repeats))
        for r in range(rounds):
            for name, run in forms.items():
                time.sleep(_SETTLE_S)
                run(*args)  # untimed: the first call after the pause finds cold caches and sleeping threads
                times[name] += time_calls(run, args, config.repeats // rounds + (r < config.repeats % rounds))
        for name, values in times.items():
            report["forms"].setdefault(name, {})[f"batch_{batch}"] = {
                "p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}
    return report


def time_calls(call: Callable[..., Any], args: tuple, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``call(*args)``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(*args)
        times.append((time.perf_counter() - start) * 1000)
    return times


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    log_probs = log_softmax(logits.astype(np.float64))
    return float(-np.take_along_axis(log_probs, targets[..., None], axis=-1).sum())
