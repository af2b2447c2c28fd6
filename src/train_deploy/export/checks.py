"""Parity of every exported form with the trained model, and latency of each form."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from train_deploy.baselines import Baselines
from train_deploy.export.backends import Logits
from train_deploy.export.config import LatencyConfig, ParityConfig
from train_deploy.export.runtime import log_softmax

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
            "model_beats_bigram": model_loss < baselines.bigram_loss,
            "model_beats_strongest": baselines.beaten_by(model_loss)}


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


def cache_parity_report(windows: np.ndarray, reference: Logits, forms: dict[str, Any], config: ParityConfig,
                        precisions: dict[str, str] | None = None) -> dict[str, Any]:
    """Generation with each form's KV cache against full recomputation, at every step, on ``windows``.

    Row ``r`` is a prompt of ``seq // 2 - r % (seq // 4 + 1)`` tokens (left-padded to the longest), prefilled,
    then fed its window's next tokens one decode step at a time; the logits of the prefill and of every step
    must equal ``reference``'s logits of the whole window at the same positions within ``max_logit_diff``
    for float32 forms. The int8 model is compared with its own full pass (its activations are quantised per
    call, so a one-token call differs from a whole-window one) and, like fp16 forms, only reported.
    """
    precisions = {name: "int8" if name == "onnx_int8" else "fp32" for name in forms} | (precisions or {})
    ids = windows[:, :-1].astype(np.int64)
    n, seq = ids.shape
    lengths = np.array([max(1, seq // 2 - r % (seq // 4 + 1)) for r in range(n)])
    expected = reference(ids, np.ones_like(ids))
    diff: dict[str, float] = {}
    for name, form in forms.items():
        target = form(ids, np.ones_like(ids)) if precisions[name] == "int8" else expected
        diff[name] = _cached_diff(form, ids, lengths, target)
    failures, warnings = [], []
    for name, value in diff.items():
        line = f"{name} with the KV cache: max |logit diff| {value:.3g} against full recomputation"
        if precisions[name] == "fp32" and value > config.max_logit_diff:
            failures.append(f"{line} > {config.max_logit_diff:g}")
        elif precisions[name] != "fp32" and value > config.max_fp16_logit_diff:
            warnings.append(f"{line} is beyond {config.max_fp16_logit_diff:g} (reported, not enforced)")
    for warning in warnings:
        logger.warning("Parity: %s", warning)
    return {"samples": int(n), "seq_length": int(seq), "prompt_lengths": lengths.tolist(),
            "decode_steps": int(seq - lengths.max()), "reference": "full recomputation (trained model, Paddle "
            "eager; int8: its own full pass)", "max_abs_logit_diff": diff, "failures": failures,
            "warnings": warnings, "passed": not failures}


def _cached_diff(form: Any, ids: np.ndarray, lengths: np.ndarray, expected: np.ndarray) -> float:
    """Largest |logit| difference of ``form``'s prefill and decode steps against ``expected`` (same positions)."""
    width, rows = int(lengths.max()), np.arange(len(ids))
    prompt, mask = np.zeros((len(ids), width), np.int64), np.zeros((len(ids), width), np.int64)
    for r, length in enumerate(lengths):
        prompt[r, width - length:], mask[r, width - length:] = ids[r, :length], 1
    step, cache = form.prefill(prompt, mask), form.new_cache()  # the cache the engine serves with (kv_cache.py)
    cache.join(mask, step, range(len(ids)))
    worst = max(float(np.abs(step.logits[r, width - length:] - expected[r, :length]).max())
                for r, length in enumerate(lengths))
    for j in range(ids.shape[1] - width):
        logits = cache.decode(ids[rows, lengths + j][:, None])
        worst = max(worst, float(np.abs(logits[:, 0] - expected[rows, lengths + j]).max()))
    return worst


def add_cache_parity(parity: dict[str, Any], cache: dict[str, Any]) -> dict[str, Any]:
    """``parity`` with the KV-cache report under ``kv_cache``: its failures fail the whole report."""
    failures = parity["failures"] + cache["failures"]
    return {**parity, "kv_cache": cache, "failures": failures, "passed": not failures}


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


def generation_report(forms: dict[str, Any], vocab_size: int, context: int, eos_id: int, config: LatencyConfig,
                      seed: int = 0) -> dict[str, Any]:
    """Milliseconds per new token of a greedy generation with each form's KV cache (``prefill``/``decode``): batch
    1, a random prompt of ``config.seq_length`` tokens (capped so the output fits the context), then
    ``config.generate_tokens`` new tokens (end of document never chosen), prefill included; the median of
    ``config.rounds`` interleaved rounds. Empty when ``generate_tokens`` is 0."""
    from train_deploy.export.runtime import LanguageModel

    new = config.generate_tokens
    if new == 0:
        return {}
    prompt_tokens = max(1, min(config.seq_length, context - new))
    rng = np.random.default_rng(seed)
    prompt = [[eos_id, *rng.integers(3, vocab_size, prompt_tokens - 1).tolist()]]

    def greedy(row: int, logits: np.ndarray) -> int:
        logits[eos_id] = -np.inf
        return int(np.argmax(logits))

    models = {name: LanguageModel(form, None, context=context, eos_id=eos_id) for name, form in forms.items()}
    for model in models.values():  # warm-up: the first runs allocate and pick kernels
        sum(1 for _ in model.stream_ids(prompt, 2, greedy))
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(config.rounds):
        for name, model in models.items():
            time.sleep(_SETTLE_S)
            start = time.perf_counter()
            made = sum(1 for _ in model.stream_ids(prompt, new, greedy))
            times[name].append((time.perf_counter() - start) * 1000 / made)
    return {"batch": 1, "prompt_tokens": prompt_tokens, "new_tokens": new, "rounds": config.rounds,
            "unit": "ms per new token", "forms": {name: {"ms_per_token": float(np.median(values)),
                                                         "tokens_per_s": 1000 / float(np.median(values))}
                                                  for name, values in times.items()}}


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
