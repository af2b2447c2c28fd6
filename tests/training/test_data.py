"""Training samples: fixed windows, a seed-determined order, distinct per data-parallel rank."""

from __future__ import annotations

import numpy as np
import pytest

from train_deploy.corpus.readers import CorpusError
from train_deploy.training.data import TokenWindows


@pytest.fixture
def tokens(tmp_path):
    prefix = tmp_path / "train"
    np.arange(1000, dtype=np.uint16).tofile(f"{prefix}.bin")
    return prefix


def test_windows_are_consecutive_tokens_with_one_for_the_shifted_labels(tokens):
    windows = TokenWindows(tokens, seq_length=10, seed=0, dtype="uint16")
    assert windows.num_samples == 99
    sample = windows.window(0)
    assert len(sample) == 11 and (np.diff(sample) == 1).all() and sample[0] % 10 == 0


def test_order_is_a_permutation_fixed_by_the_seed_and_epoch(tokens):
    a = TokenWindows(tokens, 10, seed=1, dtype="uint16")
    b = TokenWindows(tokens, 10, seed=1, dtype="uint16")
    c = TokenWindows(tokens, 10, seed=2, dtype="uint16")
    first_epoch = sorted(a.window(i)[0] for i in range(99))
    assert first_epoch == list(range(0, 990, 10))
    assert [a.window(i)[0] for i in range(120)] == [b.window(i)[0] for i in range(120)]
    assert [a.window(i)[0] for i in range(20)] != [c.window(i)[0] for i in range(20)]
    assert [a.window(i)[0] for i in range(99, 109)] != [a.window(i)[0] for i in range(10)]  # next epoch reshuffles


def test_data_parallel_ranks_read_distinct_samples_that_make_up_the_global_batch(tokens):
    windows = TokenWindows(tokens, 10, seed=3, dtype="uint16")
    micro, dp, consumed = 4, 2, 16
    per_rank = [windows.batch(consumed + rank * micro, micro) for rank in range(dp)]
    assert not set(per_rank[0][:, 0]) & set(per_rank[1][:, 0])
    assert (np.concatenate(per_rank) == windows.batch(consumed, micro * dp)).all()


def test_too_little_text_for_one_sample_is_named(tmp_path):
    prefix = tmp_path / "tiny"
    np.arange(5, dtype=np.uint16).tofile(f"{prefix}.bin")
    with pytest.raises(CorpusError, match=r"tiny.bin: 5 tokens cannot fill one sample of seq_length 10"):
        TokenWindows(prefix, 10, 0, "uint16")


def test_an_empty_or_missing_split_is_named(tmp_path):
    (tmp_path / "valid.bin").write_bytes(b"")
    with pytest.raises(CorpusError, match=r"valid.bin: holds no tokens; use more text or a larger "
                                         r"corpus.encoding.validation_fraction"):
        TokenWindows(tmp_path / "valid", 10, 0, "uint16")
    with pytest.raises(CorpusError, match=r"other.bin: missing"):
        TokenWindows(tmp_path / "other", 10, 0, "uint16")
