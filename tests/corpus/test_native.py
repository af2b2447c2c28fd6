"""The compiled corpus kernels give exactly what their numpy versions give, and the stage runs without them."""

from __future__ import annotations

import random
from itertools import chain

import numpy as np
import pytest

from tests.helpers.corpus import encode, output_bytes
from train_deploy.corpus import build, cleaning, native, people_daily
from train_deploy.corpus.cleaning import _class_tables, _nfkc_tables, clean_codes_numpy, nfkc_fold_numpy
from train_deploy.corpus.people_daily import strip_pos_tag_bytes_numpy
from train_deploy.corpus.readers import people_daily_path

needs_kernels = pytest.mark.skipif(native.compiled is None, reason="the C kernels were not built here")


@needs_kernels
@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_compiled_tag_stripping_equals_numpy_on_the_corpus_and_random_text():
    data = people_daily_path().read_bytes()
    assert native.compiled.strip_pos_tags(data) == strip_pos_tag_bytes_numpy(data)
    rng = random.Random(0)
    pieces = [b"a", b"Z", b"/", b" ", b"\t", b"\n", b"\r", b"1", b"/v", b"/nx", b"\xef\xbc\x91", b"\xef\xbd\x81",
              b"\xe4\xb8\xad", b"\x00"]
    for _ in range(20000):
        text = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30)))
        assert native.compiled.strip_pos_tags(text) == strip_pos_tag_bytes_numpy(text), text


@needs_kernels
def test_compiled_cleaning_rules_equal_numpy_on_random_code_points():
    control, space = _class_tables()
    rng = np.random.default_rng(0)
    alphabet = np.array([0x20, 0x0A, 0x0D, 0x09, 0x3000, 0xA0, 0x2028, 0x2029, 0x85, 0x00, 0x1B, 0x200B, 0x4E2D,
                         0x61, 0x1F600, 0xFEFF], dtype=np.uint32)
    for _ in range(3000):
        codes = rng.choice(alphabet, size=rng.integers(0, 40))
        for flags in ((True, True), (True, False), (False, True), (False, False)):
            expected = clean_codes_numpy(codes, strip_control=flags[0], normalize_whitespace=flags[1])
            work = codes.copy()
            got = work[: native.compiled.clean_codes(work, control, space, *flags)]
            assert got.tolist() == expected.tolist(), (codes.tolist(), flags)


@needs_kernels
def test_compiled_nfkc_folding_equals_numpy_on_every_bmp_character_and_beyond():
    codes = np.concatenate([np.arange(0x10000, dtype=np.uint32), np.array([0x1F600, 0x10FFFF, 0x4E2D], np.uint32)])
    codes = np.concatenate([codes, np.random.default_rng(0).permutation(codes)])
    folded, unsafe = native.compiled.nfkc_fold(codes, *_nfkc_tables())
    expected, expected_unsafe = nfkc_fold_numpy(codes)
    assert np.frombuffer(folded, np.uint32).tolist() == expected.tolist()
    assert np.frombuffer(unsafe, np.int64).tolist() == expected_unsafe.tolist()


@needs_kernels
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_compiled_flattening_equals_numpy_and_refuses_ids_that_do_not_fit(dtype):
    ids = [[1, 2, 3], [], [65535 if dtype == np.uint16 else 2**31 - 1], [0, 7]]
    expected = np.fromiter(chain.from_iterable(ids), dtype=dtype)
    assert native.flatten_ids(ids, np.dtype(dtype), 6).tolist() == expected.tolist()
    with pytest.raises(OverflowError, match="token id 65536 does not fit 2 bytes"):
        native.compiled.flatten_ids([[65536]], 2)


def test_without_the_kernels_the_stage_writes_the_same_bytes(tmp_path, tiny_tokenizer, monkeypatch):
    _, first = encode(tmp_path / "built", tiny_tokenizer)
    for module in (native, people_daily, cleaning, build):
        monkeypatch.setattr(module, "compiled", None)
    _, second = encode(tmp_path / "numpy", tiny_tokenizer)
    assert not second.compiled_kernels
    assert output_bytes(tmp_path / "built" / "tokens") == output_bytes(tmp_path / "numpy" / "tokens")
