"""Latency: every form timed on the same inputs, in interleaved rounds, with the configured number of calls."""

from __future__ import annotations

import numpy as np
import pytest

from train_deploy.export import checks
from train_deploy.export.checks import latency_report
from train_deploy.export.config import LatencyConfig


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
