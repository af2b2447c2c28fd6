"""What both executors' tests check alike: the encoding stage's progress lines."""

from __future__ import annotations

import logging
import re

ETA_LINE = re.compile(r"^encoding: chunk (\d+)/(\d+) \((\d+)%\), \d+:\d\d elapsed, ~(?:\d+:\d\d|\?) left$")


def assert_eta_lines(records: list[logging.LogRecord], chunks: int) -> None:
    """The executor's progress lines are ``progress.eta_text``'s over the plan's ``chunks`` from the first line,
    counting up (each count once) to all of them, ~0:00 left at the end."""
    lines = [r.getMessage() for r in records if r.name == "train_deploy.corpus.executors.progress"]
    shapes = [ETA_LINE.match(line) for line in lines]
    assert lines and all(shapes), lines
    done = [int(m[1]) for m in shapes]
    assert chunks > 2 and {int(m[2]) for m in shapes} == {chunks}
    assert done == sorted(set(done)) and done[-1] == chunks
    assert [int(m[3]) for m in shapes] == [100 * d // chunks for d in done]
    assert lines[-1].endswith(", ~0:00 left")
