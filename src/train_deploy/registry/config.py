"""Typed configuration of the registry stage (``conf/base/parameters_registry.yml``, block ``registry``)."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any, Literal

from pydantic import Field

from train_deploy.config import block, check, from_mapping, setting, to_dict

# MLflow's registered-model names: anything but these characters works everywhere, URIs included.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,255}$")


@block
class EvalSetConfig:
    """The fixed evaluation set, built once by the first registration of a model and kept with it."""

    path: str | None = None
    """A JSONL file of ``{"text": …}`` lines to use as the set; null = the first ``documents`` documents of the
    validation split. Read only by the first registration: later runs use the set the model already has."""
    documents: int = Field(64, ge=1, le=100_000)
    """How many validation documents (or JSONL lines) make the set (1 to 100000)."""
    min_texts: int = Field(16, ge=1, le=100_000)
    """Fewer texts than this are too few for the gate to decide on: a candidate gated on such a set is
    ``undecided`` and the champion stays (1 to 100000; a small corpus's validation split gives few documents). The
    first version of a model needs no comparison and becomes champion on any set, when it beats the baselines."""
    max_chars: int = Field(100, ge=10, le=100_000)
    """Each text is cut to at most this many characters, at the last sentence end within them when there is
    one (10 to 100000): the texts must fit the context of every model that will be compared on them."""


@block
class RetryConfig:
    """What the stage does when the tracking server does not answer."""

    attempts: int = Field(5, ge=1, le=100)
    """Tries of each registry call before the stage fails naming the server (1 to 100)."""
    wait_seconds: float = Field(10, ge=0, le=3600)
    """Seconds between two tries (0 to 3600); the stage gives up after about ``attempts × wait_seconds``."""


@block
class ServingCheckConfig:
    """Before the aliases move, the candidate is started as production starts it (``registry/infra.py``)."""

    enabled: bool = True
    """Serve the candidate from a fresh process and ask it to score and generate before it may become champion;
    a failure rejects it with the reason on the version (false: promote on the score alone)."""
    timeout_seconds: float = Field(300.0, gt=0)
    """How long the server may take to start and answer both requests (more than 0 seconds)."""


@block
class ServingConfig:
    """What one request to the served model may ask for. Recorded with the logged model (its ``model_config``, with
    ``max_batch``), so the served model applies the limits it was logged with, without the project; a request over a
    limit gets HTTP 400 naming the limit (docs/serving.md)."""

    max_chars: int = Field(2000, ge=1, le=1_000_000)
    """Most characters in one text (1 to 1000000); a longer text is refused before it is tokenized."""
    max_tokens: int = Field(8192, ge=1, le=10_000_000)
    """Most tokens one request may hold (1 to 10000000): its texts' tokens, plus ``max_new_tokens`` per prompt
    when it generates."""
    max_new_tokens: int = Field(256, ge=1, le=100_000)
    """Most new tokens a generate request may ask for per prompt (1 to 100000)."""
    time_budget_s: int = Field(30, ge=1, le=3600)
    """Seconds one request may spend in the model (1 to 3600), waiting for its engine included: a request that
    cannot start in time, or a generation still running at the end of it, gets HTTP 503 naming the budget."""


@block
class RegistryConfig:
    """The ``registry`` block: which registered model the bundle becomes a version of, and when it is promoted."""

    model_name: str = "train_deploy_lm"
    """The registered model (``models:/<model_name>@champion`` is what teams deploy)."""
    min_improvement: float = setting(0.01, ge=0, lt=1, note="a fraction: 0.01 = 1% fewer nats per character")
    """The candidate becomes ``champion`` only when its nats per character on the evaluation set are lower than
    the champion's by more than this fraction at ``confidence``: the lower bound of the paired bootstrap interval of
    the relative improvement must exceed it (``registry/paired.py``). An interval wholly at or below it rejects the
    candidate; one across it is ``undecided`` and the champion stays (0.01 = 1%; 0 = any improvement; below 1)."""
    confidence: float = setting(0.95, ge=0.5, le=0.999, note="a two-sided confidence: 0.95 = a 95% interval")
    """The two-sided confidence of the improvement's interval (0.5 to 0.999): higher asks for a larger set or a
    clearer improvement before the gate decides."""
    require_beats: Literal["unigram", "bigram", "kneser_ney_bigram", "none"] = "unigram"
    """The n-gram baseline the candidate's validation loss must be below, on the same validation windows, to become
    champion, first version included (``train_deploy.baselines``): ``unigram`` (counting tokens), ``bigram`` (the
    add-k bigram) or ``kneser_ney_bigram`` (each stricter; the unigram is always required with them). ``none`` turns
    the rule off, for tests and demos of models too small to beat counting: the reason still gives the figures."""
    force: bool = False
    """Promote the candidate whatever the comparison and the baseline rule say; recorded as ``forced``."""
    backend: Literal["paddle", "onnx"] = "paddle"
    """The form both models are scored with for the gate."""
    int8: bool = False
    """Score with the int8 ONNX model (needs backend onnx)."""
    max_batch: int = Field(64, ge=1, le=100_000)
    """Most texts one request to the served model may hold (1 to 100000); recorded with the logged model."""
    other_corpus: Literal["refuse", "compare"] = "refuse"
    """A run on another corpus than the one the model's evaluation set was made from (``corpus.reader.source`` and
    ``paths``): ``refuse`` stops it before its first node, saying to name a model of its own; ``compare`` gates it
    on that set anyway and says so in one line. Sets from ``eval_set.path`` are any corpus's."""
    serving: ServingConfig = field(default_factory=ServingConfig)
    """The served model's limits per request (`registry.serving`); recorded with the logged model."""
    eval_set: EvalSetConfig = field(default_factory=EvalSetConfig)
    """The fixed evaluation set (`registry.eval_set`)."""
    retries: RetryConfig = field(default_factory=RetryConfig)
    """An unreachable tracking server (`registry.retries`)."""
    serving_check: ServingCheckConfig = field(default_factory=ServingCheckConfig)
    """The serving check before promotion (`registry.serving_check`)."""

    def __post_init__(self) -> None:  # a name's error says what a name is made of; the rest are rules across keys
        check(bool(_MODEL_NAME.match(self.model_name)), "registry.model_name",
              f"{self.model_name[:40]!r} is not a model name (letters, digits, '_', '.', '-'; at most 256)")
        check(self.backend == "onnx" or not self.int8, "registry.int8", "true needs backend: onnx")
        check(self.eval_set.path is None or bool(self.eval_set.path.strip()), "registry.eval_set.path",
              "must be a JSONL file or null")

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RegistryConfig:
        return from_mapping(cls, params, "registry")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)
