"""Near-duplicate removal: MinHash signatures of character shingles and the in-order LSH decision."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.helpers.corpus import encode, output_bytes, random_chinese
from train_deploy.config import ConfigError
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.dedup import NearDuplicateIndex, lsh_bands, minhash_signatures


def shingles(text: str, n: int = 5) -> set[str]:
    return {text[i : i + n] for i in range(len(text) - n + 1)}


def test_one_changed_character_in_a_long_document_is_a_near_duplicate_and_distinct_documents_are_kept():
    original, *others = random_chinese(4, 2000, seed=1)
    changed = original[:1000] + "的" + original[1001:]
    half = original[:1000]
    signatures = minhash_signatures([original, changed, *others, half], 5, 128)
    duplicate = NearDuplicateIndex(0.8, 128).add(signatures)
    assert duplicate.tolist() == [False, True, False, False, False, False]


def test_the_estimate_follows_the_jaccard_similarity_of_the_shingles():
    rng = random.Random(3)
    base = random_chinese(1, 3000, seed=2)[0]
    for keep in (0.9, 0.7, 0.5):
        other = "".join(ch if rng.random() < keep ** 0.2 else "的" for ch in base)  # keep^(1/5): shingles survive
        a, b = shingles(base), shingles(other)
        true = len(a & b) / len(a | b)
        signatures = minhash_signatures([base, other], 5, 256)
        estimate = np.mean(signatures[0] == signatures[1])
        assert estimate == pytest.approx(true, abs=0.08), keep


def test_signatures_do_not_depend_on_the_batch():
    texts = [*random_chinese(5, 300, seed=4), "短", "恰好五个字", "", "ab"]
    together = minhash_signatures(texts, 5, 64)
    alone = np.concatenate([minhash_signatures([t], 5, 64) for t in texts])
    assert np.array_equal(together, alone)
    assert not np.array_equal(together[5], together[6])  # documents shorter than a shingle are themselves


def test_the_first_document_of_a_cluster_is_kept_and_exact_copies_are_left_to_the_exact_pass():
    a, b = random_chinese(2, 1000, seed=5)
    a2 = a[:500] + "的" + a[501:]
    signatures = minhash_signatures([a2, a, b, a, a2], 5, 128)
    index = NearDuplicateIndex(0.8, 128)
    # Hashes stand in for content hashes: the 4th document is an exact copy of the (near-dropped) 2nd one, the
    # 5th of the kept 1st one.
    assert index.add(signatures[:3], [1, 2, 3]).tolist() == [False, True, False]
    assert index.add(signatures[3:], [2, 1]).tolist() == [True, False]


def test_datasketch_chooses_the_bands():
    bands, rows = lsh_bands(0.8, 128)
    assert bands * rows <= 128 and (bands, rows) == (9, 13)


def test_near_duplicates_across_chunks_and_splits_are_removed_alike_by_one_and_two_workers(tmp_path, tiny_tokenizer):
    originals = random_chinese(200, 300, seed=6)
    near = [t[:100] + "的" + t[101:] for t in originals[::10]]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(originals + near) + "\n", encoding="utf-8")
    outputs = []
    for workers in (1, 2):
        _, manifest = encode(tmp_path / f"w{workers}", tiny_tokenizer, encoding={"workers": workers,
                             "validation_fraction": 0.3}, reader={"source": "text", "paths": [str(path)],
                             "chunk_bytes": 8192, "max_bytes": None})
        assert manifest.input["chunks"] > 10
        assert manifest.documents.dropped["near_duplicate"] == 20 and manifest.documents.kept == 200
        outputs.append(output_bytes(tmp_path / f"w{workers}" / "tokens"))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("near_dedup_permutations", 100, "must be a power of two"),
    ("near_dedup_threshold", 0.3, r"must be in \[0.5, 1\)"),
])
def test_bad_near_dedup_settings_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=f"^corpus.cleaning.{key}: {message}"):
        CorpusConfig.from_params({"cleaning": {key: value}})
