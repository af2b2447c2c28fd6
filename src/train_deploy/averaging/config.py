"""Typed configuration of the averaging stage (``conf/base/parameters_averaging.yml``, block ``averaging``)."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import Field

from train_deploy.config import block, check, from_mapping

_Step = Annotated[int, Field(ge=1)]
"""A training step that has a checkpoint: they are written from step 1."""


@block
class AveragingConfig:
    select: Literal["last_k", "steps", "up_to_step", "best_k"] = "last_k"
    """last_k: the K newest, or, when the training curves show overfitting, the K kept around the step where
    validation loss was lowest (``average.select_checkpoints``); steps: exactly `steps`; up_to_step: the K newest at
    or below `max_step`; best_k: the K with the lowest validation loss recorded in their state.json."""
    k: int = Field(3, ge=1)
    """Checkpoints averaged by last_k, up_to_step and best_k (at least 1)."""
    steps: list[_Step] = field(default_factory=list)
    """select: steps: the training steps of the checkpoints to average."""
    max_step: _Step | None = None
    """select: up_to_step: the newest step that may be averaged."""
    method: Literal["uniform", "ema"] = "uniform"
    """uniform: plain mean; ema: the i-th newest checkpoint weighs decay**i (normalised)."""
    decay: float = Field(0.5, gt=0, le=1)
    """method: ema: weight ratio of each checkpoint to the next newer one, in (0, 1]."""
    too_few: Literal["raise", "warn"] = "warn"
    """Fewer checkpoints than k: stop with an error, or warn and average what exists."""
    choose: Literal["better", "averaged", "last"] = "better"
    """Which checkpoint the evaluation node passes on to export."""

    def __post_init__(self) -> None:
        check(self.select != "steps" or bool(self.steps), "averaging.steps", "select: steps needs a list of steps")
        check(self.select != "up_to_step" or self.max_step is not None, "averaging.max_step",
              "select: up_to_step needs max_step")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> AveragingConfig:
        return from_mapping(cls, params, "averaging")
