"""What a training run's own loss curves say: overfitting, underfitting or converged, and what could do better.

The curves are rank 0's ``metrics.jsonl`` (:func:`read_curves`): the validation loss ``V_0 … V_n`` of each
evaluation (steps ``e_0 … e_n``, every ``schedule.eval_every`` and the last) and the training loss logged every
``schedule.log_every`` steps. One batch's training loss is noisy, so the training loss of evaluation ``i`` is
``T_i``, the mean of the losses logged in ``(e_{i-1}, e_i]`` (the last one logged at or before ``e_i`` when that
interval logged none). Let ``V_b`` be the lowest validation loss (the earliest, on a tie) and ``tol``
:data:`TOLERANCE`. The rule (:func:`diagnose`), in this order:

1. past its minimum (``V_n > V_b + tol``):
   - **overfitting** when the training loss fell by more than ``tol`` since then (``T_n < T_b - tol``): validation
     rose while training fell;
   - else **unknown**: both rose (an unstable run, not one that learns its training text by heart);
2. still falling (``V_{n-1} - V_n > tol``):
   - **underfitting** when the training loss did not rise either (``T_n <= T_{n-1} + tol``): both still fall;
   - else **unknown**;
3. else **converged**: over the last interval the validation loss moved by at most ``tol`` and it is within
   ``tol`` of its lowest.

Fewer than two evaluations (no validation split, a run shorter than ``eval_every``) give **unknown**. Comparing
whole evaluation intervals against a tolerance keeps one noisy point from deciding: a wobble of validation loss
under ``tol`` reads as flat, a few unlucky training batches move an interval's mean little.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from train_deploy.handoffs import CurveDiagnosis

logger = logging.getLogger(__name__)

TOLERANCE = 0.02
"""Nats/token a loss must move between evaluations to count as rising or falling. Neighbouring evaluations of a
smooth run on the same windows differ by less than 0.01 from noise; the default CPU run still fell 0.06 over its
last 200 steps, and an overfit run rises by tenths."""


@dataclass(frozen=True, slots=True)
class Curves:
    """A run's losses by step, ascending: ``(step, loss)`` pairs."""

    train: list[tuple[int, float]]
    valid: list[tuple[int, float]]


def read_curves(metrics_file: Path, up_to_step: int) -> Curves:
    """The training and validation losses of ``metrics_file`` up to ``up_to_step``; for a step logged twice (a
    resumed run), the later line. A missing file gives empty curves; lines that are not metrics are skipped."""
    by_step: dict[int, dict] = {}
    try:
        text = Path(metrics_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return Curves(train=[], valid=[])
    for line in text.splitlines():
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(record, dict) and step <= up_to_step:
            by_step[step] = record
    steps = sorted(by_step)
    return Curves(train=_series(by_step, steps, "loss"), valid=_series(by_step, steps, "val_loss"))


def _series(by_step: dict[int, dict], steps: list[int], key: str) -> list[tuple[int, float]]:
    return [(s, float(by_step[s][key])) for s in steps
            if isinstance(by_step[s].get(key), int | float) and not isinstance(by_step[s][key], bool)]


def diagnose(curves: Curves, tolerance: float = TOLERANCE) -> CurveDiagnosis:
    """The case ``curves`` show, by the rule of this module's docstring, with its figures and advice."""
    valid = curves.valid
    if len(valid) < 2:
        return CurveDiagnosis(kind="unknown", summary=f"{len(valid)} evaluation(s) of validation loss: too few to "
                                                      "read a trend (two or more are needed)")
    steps, losses = [s for s, _ in valid], [v for _, v in valid]
    b = losses.index(min(losses))
    train = _interval_means(curves.train, steps)
    figures = dict(best_step=steps[b], best_val_loss=losses[b], last_val_loss=losses[-1])
    last, before = losses[-1], losses[-2]
    if last > losses[b] + tolerance:
        rose = (f"validation loss was lowest at step {steps[b]} ({losses[b]:.4f}) and rose to {last:.4f} by step "
                f"{steps[-1]}")
        if _fell(train[b], train[-1], tolerance):
            return CurveDiagnosis(kind="overfitting", **figures,
                                  summary=f"overfitting: {rose} while training loss fell from {train[b]:.4f} to "
                                          f"{train[-1]:.4f}",
                                  advice=f"fewer steps (training.schedule.max_steps near {steps[b]}), more text, or "
                                         "stronger regularisation (training.optimizer.weight_decay; this model "
                                         "has no dropout)")
        return CurveDiagnosis(kind="unknown", **figures, summary=f"{rose}, and training loss did not fall "
                                                                 f"({_figure(train[b])} to {_figure(train[-1])}): "
                                                                 "an unstable run, not overfitting")
    if before - last > tolerance:
        fell = f"validation loss fell from {before:.4f} at step {steps[-2]} to {last:.4f} at step {steps[-1]}"
        if train[-1] is not None and train[-2] is not None and train[-1] <= train[-2] + tolerance:
            return CurveDiagnosis(kind="underfitting", **figures,
                                  summary=f"underfitting: {fell} and training loss from {train[-2]:.4f} to "
                                          f"{train[-1]:.4f}: both still falling at the end",
                                  advice="more steps (training.schedule.max_steps) or a larger preset "
                                         "(training.model.preset; 350m and 1.3b on a GPU, conf/gpu)")
        return CurveDiagnosis(kind="unknown", **figures, summary=f"{fell} while training loss rose "
                                                                 f"({_figure(train[-2])} to {_figure(train[-1])})")
    return CurveDiagnosis(kind="converged", **figures,
                          summary=f"converged: validation loss {last:.4f} at step {steps[-1]}, within {tolerance:g} "
                                  f"of {before:.4f} at step {steps[-2]} and of its lowest ({losses[b]:.4f}, step "
                                  f"{steps[b]})",
                          advice="more text or a larger preset (training.model.preset), not more steps")


def _interval_means(train: list[tuple[int, float]], steps: list[int]) -> list[float | None]:
    """``T_i`` for each evaluation step: the mean training loss logged in ``(e_{i-1}, e_i]``, else the last one
    logged at or before ``e_i`` (None when none was)."""
    means, start = [], None
    for step in steps:
        inside = [loss for s, loss in train if (start is None or s > start) and s <= step]
        earlier = [loss for s, loss in train if s <= step]
        means.append(sum(inside) / len(inside) if inside else (earlier[-1] if earlier else None))
        start = step
    return means


def _fell(before: float | None, after: float | None, tolerance: float) -> bool:
    return before is not None and after is not None and after < before - tolerance


def _figure(value: float | None) -> str:
    return "?" if value is None else f"{value:.4f}"


def beat_advice(diagnosis: CurveDiagnosis | None) -> str | None:
    """What could beat a baseline the model does not, as the curves say (None: they say nothing, and
    :meth:`Baselines.describe` gives its general advice)."""
    if diagnosis is None or diagnosis.kind == "unknown":
        return None
    return f"the training curves show the run {diagnosis.kind}, so what could beat it is {diagnosis.advice}"
