"""The training worker's progress line: at its log interval, from rank 0, in the shape of ``progress.eta_text``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_LINE = re.compile(r"worker.py:\d+ - step (\d+)/6 \((\d+)%\), (\d+):(\d\d) elapsed, ~(\?|\d+:\d\d) left$")


def test_rank_0_logs_the_eta_line_at_every_log_interval_and_it_only_moves_forward(tiny_run):
    log = Path(tiny_run.checkpoints).parent / "logs" / "node0" / "workerlog.0"
    lines = [match for line in log.read_text(encoding="utf-8").splitlines() if (match := _LINE.search(line))]
    assert [int(m[1]) for m in lines] == [1, 2, 3, 4, 5, 6]  # log_every: 1
    assert [int(m[2]) for m in lines] == [16, 33, 50, 66, 83, 100]
    elapsed = [int(m[3]) * 60 + int(m[4]) for m in lines]
    assert elapsed == sorted(elapsed) and lines[-1][5] == "0:00"
