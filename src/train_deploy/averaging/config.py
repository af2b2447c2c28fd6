"""Typed configuration of the averaging stage (``conf/base/parameters_averaging.yml``, block ``averaging``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from train_deploy.config import check, check_range, from_mapping


@dataclass(kw_only=True, slots=True)
class AveragingConfig:
    select: Literal["last_k", "steps", "up_to_step", "best_k"] = "last_k"
    """last_k: the K newest, or, when the training curves show overfitting, the K kept around the step where
    validation loss was lowest (``average.select_checkpoints``); steps: exactly `steps`; up_to_step: the K newest at
    or below `max_step`; best_k: the K with the lowest validation loss recorded in their state.json."""
    k: int = 3
    """Checkpoints averaged by last_k, up_to_step and best_k (at least 1)."""
    steps: list[int] = field(default_factory=list)
    """select: steps: the training steps of the checkpoints to average."""
    max_step: int | None = None
    """select: up_to_step: the newest step that may be averaged."""
    method: Literal["uniform", "ema"] = "uniform"
    """uniform: plain mean; ema: the i-th newest checkpoint weighs decay**i (normalised)."""
    decay: float = 0.5
    """method: ema: weight ratio of each checkpoint to the next newer one, in (0, 1]."""
    too_few: Literal["raise", "warn"] = "warn"
    """Fewer checkpoints than k: stop with an error, or warn and average what exists."""
    choose: Literal["better", "averaged", "last"] = "better"
    """Which checkpoint the evaluation node passes on to export."""

    def __post_init__(self) -> None:
        check_range("averaging.k", self.k, 1)
        check_range("averaging.decay", self.decay, 0, 1, open_low=True)
        check(self.select != "steps" or bool(self.steps), "averaging.steps", "select: steps needs a list of steps")
        for i, step in enumerate(self.steps):
            check_range(f"averaging.steps[{i}]", step, 1, note="checkpoints are written from step 1")
        check_range("averaging.max_step", self.max_step, 1, note="checkpoints are written from step 1")
        check(self.select != "up_to_step" or self.max_step is not None, "averaging.max_step",
              "select: up_to_step needs max_step")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> AveragingConfig:
        return from_mapping(cls, params, "averaging")
