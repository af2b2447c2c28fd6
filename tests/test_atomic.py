"""Atomic outputs: a folder is either the old one or the complete new one."""

from __future__ import annotations

import pytest

from train_deploy.atomic import atomic_folder


def test_folder_is_swapped_in_whole_and_a_failure_keeps_the_old_one(tmp_path):
    final = tmp_path / "out"
    with atomic_folder(final) as staging:
        (staging / "a.txt").write_text("first")
    assert (final / "a.txt").read_text() == "first"
    with pytest.raises(RuntimeError), atomic_folder(final) as staging:
        (staging / "a.txt").write_text("half")
        raise RuntimeError("interrupted")
    assert (final / "a.txt").read_text() == "first"
    with atomic_folder(final) as staging:
        (staging / "b.txt").write_text("second")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old folders left behind
