"""Tiny run descriptions for real multi-process training tests, launched as the training node does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.training import launch, training_params


@pytest.fixture(scope="session")
def dp2_run(tmp_path_factory, tiny_tokens) -> Path:
    """The folder of a 6-step two-process data-parallel run of :data:`TINY_TRAINING` (one launch per session: the
    layout test compares it with the single-process run, the two-node test compares two launchers with it)."""
    folder = tmp_path_factory.mktemp("dp2")
    launch(folder, tiny_tokens, training_params(2, parallel={"dp": 2}))
    return folder
