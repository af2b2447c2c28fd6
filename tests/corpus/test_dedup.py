"""Near-duplicate removal: MinHash signatures of character shingles and the in-order LSH decision."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from tests.helpers.corpus import encode, output_bytes, random_chinese
from train_deploy.config import ConfigError
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.dedup import NearDuplicateIndex, TextOverlap, lsh_bands, minhash_signatures
from train_deploy.corpus.tokenizer import TokenEncoder
from train_deploy.handoffs import TokenizerInfo, TokenManifest


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
        # 9 twins share a split with their original; 11 cross it, and the validation one is dropped
        assert manifest.documents.dropped["near_duplicate"] == 9 and manifest.documents.kept == 200
        assert manifest.documents.dropped["near_duplicate_of_training"] == 11
        outputs.append(output_bytes(tmp_path / f"w{workers}" / "tokens"))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("near_dedup_permutations", 100, "must be a power of two"),
    ("near_dedup_threshold", 0.3, r"must be in \[0.5, 1\)"),
])
def test_bad_near_dedup_settings_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=f"^corpus.cleaning.{key}: {message}"):
        CorpusConfig.from_params({"cleaning": {key: value}})


def _is_valid(text: str, fraction: float, seed: int = 1234) -> bool:
    """The split a document goes to, by the rule of ``corpus.encode``: the second half of its seeded 128-bit hash."""
    second = np.frombuffer(xxhash.xxh3_128_digest(text.encode("utf-8"), seed), dtype="<u8")[1]
    return bool(second < np.uint64(int(fraction * 2**64)))


def split_texts(manifest: TokenManifest, split: str, tokenizer: TokenizerInfo) -> list[str]:
    """The documents of a split of published token files, decoded, in file order."""
    tokens = np.fromfile(f"{manifest.prefix(split)}.bin", dtype=manifest.dtype).tolist()
    encoder, documents, start = TokenEncoder(tokenizer), [], 0
    for end in (i for i, token in enumerate(tokens) if token == tokenizer.eos_id):
        documents.append(encoder.decode(tokens[start:end]))
        start = end + 1
    return documents


def two_editions(chapters: int = 30, shared: int = 20) -> tuple[list[str], list[str]]:
    """Two editions of one manual: the second repeats ``shared`` chapters of the first with one character changed
    (near-twins) and adds chapters of its own."""
    first = random_chinese(chapters, 300, seed=11)
    second = [t[:150] + ("的" if t[150] != "的" else "是") + t[151:] for t in first[:shared]]
    return first, second + random_chinese(chapters - shared, 300, seed=12)


def test_near_twins_across_the_split_never_reach_validation_and_the_training_one_stays(tmp_path, tiny_tokenizer):
    first, second = two_editions()
    path = tmp_path / "manual.txt"
    path.write_text("\n\n".join(first + second) + "\n", encoding="utf-8")
    _, manifest = encode(tmp_path, tiny_tokenizer, encoding={"validation_fraction": 0.4},
                         reader={"source": "text", "paths": [str(path)], "chunk_bytes": 4096, "max_bytes": None})
    valid = {text: _is_valid(text, 0.4) for text in first + second}
    pairs = list(zip(first[:20], second[:20], strict=True))
    crossing = [(a, b) for a, b in pairs if valid[a] != valid[b]]
    assert (len(crossing), sum(valid[a] and valid[b] for a, b in pairs)) == (7, 5)  # the corpus shows both cases
    assert manifest.documents.dropped["near_duplicate_of_training"] == 7  # the validation one of each crossing pair
    assert manifest.documents.dropped["near_duplicate"] == 13  # the later one of a pair within a split
    assert manifest.documents.kept == 40
    dropped = {b for a, b in pairs if valid[a] == valid[b]} | {a if valid[a] else b for a, b in crossing}
    kept = [text for text in first + second if text not in dropped]
    assert split_texts(manifest, "train", tiny_tokenizer) == [text for text in kept if not valid[text]]
    assert split_texts(manifest, "valid", tiny_tokenizer) == [text for text in kept if valid[text]]


def test_a_short_text_is_held_by_a_long_document_that_contains_most_of_its_shingles():
    text, other = random_chinese(2, 100, seed=21)
    body = random_chinese(1, 2000, seed=22)[0]
    holder = body[:900] + text[:40] + "的" + text[41:] + body[900:]  # one change: 5 of 97 shingles lost
    partial = body[:900] + text[:65] + body[900:]  # 61 of 97 shingles: under 0.8
    assert len(shingles(text) & shingles(holder)) / len(shingles(text)) >= 0.9
    assert len(shingles(text) | shingles(holder)) > 10 * len(shingles(text) & shingles(holder))  # Jaccard < 0.1
    overlap = TextOverlap([text, other, "短"], 5, 0.8)
    assert overlap.holders([body, holder, partial, other + body]).tolist() == [False, True, False, True]
    assert overlap.held([holder, partial]).tolist() == [True, False, False]
    assert overlap.held([]).tolist() == [False, False, False]
