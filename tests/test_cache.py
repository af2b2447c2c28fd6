"""The per-machine cache: where it lives, built once, rebuilt when its key changes or its file is bad."""

from __future__ import annotations

import numpy as np
import pytest

from train_deploy.cache import cache_dir, cached_arrays

LAYOUT = {"counts": ((3,), np.uint16), "grid": ((2, 4), np.float32)}


def build() -> dict[str, np.ndarray]:
    return {"counts": np.array([1, 2, 65535], dtype=np.uint16), "grid": np.arange(8, dtype=np.float32).reshape(2, 4)}


def same(got: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(got[name], array) and got[name].dtype == array.dtype for name, array in build().items())


def test_cache_folder_is_the_variable_else_xdg_else_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "own"
    monkeypatch.delenv("TRAIN_DEPLOY_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "train_deploy"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "train_deploy"


def test_arrays_are_built_once_then_loaded_and_rebuilt_for_a_new_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path))
    assert same(cached_arrays("demo", b"v1", LAYOUT, build))
    (stored,) = tmp_path.iterdir()
    assert stored.name.startswith("demo-") and stored.stat().st_size == 3 * 2 + 8 * 4
    assert same(cached_arrays("demo", b"v1", LAYOUT, lambda: pytest.fail("rebuilt despite the cache")))
    assert same(cached_arrays("demo", b"v2", LAYOUT, build))  # what the arrays derive from changed
    assert len(list(tmp_path.iterdir())) == 2


def test_a_bad_cache_file_is_rebuilt_and_an_unwritable_cache_only_costs_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    cached_arrays("demo", b"v1", LAYOUT, build)
    (stored,) = (tmp_path / "cache").iterdir()
    stored.write_bytes(stored.read_bytes()[:10])  # torn or foreign file: rebuilt and replaced
    assert same(cached_arrays("demo", b"v1", LAYOUT, build)) and stored.stat().st_size == 38
    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(stored))  # not a folder: built, not cached
    assert same(cached_arrays("demo", b"v1", LAYOUT, build))
