"""The export says how far it is and how long is left, one line after each part (``progress.eta_text``)."""

from __future__ import annotations

import logging
import re

import pytest

from tests.helpers.export import export_into

pytestmark = pytest.mark.slow


def test_the_export_logs_its_parts_with_the_time_left(tmp_path, tiny_checkpoint, tiny_tokenizer, tiny_token_files,
                                                        caplog):
    with caplog.at_level(logging.INFO, logger="train_deploy.export.bundle"):
        export_into(tmp_path / "bundle", tiny_checkpoint, tiny_tokenizer, tiny_token_files)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("export: ")]
    shape = re.compile(r"^export: part (\d)/5 \((\d+)%\), (\d+):(\d\d) elapsed, ~(\d+):(\d\d) left$")
    matches = [shape.match(line) for line in lines]
    assert all(matches), lines
    assert [(int(m[1]), int(m[2])) for m in matches] == [(1, 20), (2, 40), (3, 60), (4, 80), (5, 100)]
    elapsed = [int(m[3]) * 60 + int(m[4]) for m in matches]
    assert elapsed == sorted(elapsed) and lines[-1].endswith("~0:00 left")
