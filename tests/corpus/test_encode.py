"""The per-chunk kernel: one process's :class:`ChunkEncoder` turns a planned chunk into shards and statistics."""

from __future__ import annotations

import os

import numpy as np

from tests.helpers.corpus import encode
from tests.helpers.project import corpus_params
from train_deploy.corpus.encode import ChunkEncoder
from train_deploy.pipelines.corpus.nodes import plan_inputs


def test_a_chunk_is_encoded_into_its_shards_with_the_counts_its_progress_reported(tmp_path, tiny_tokenizer):
    config, plan = plan_inputs(corpus_params())
    reported: list[tuple[int, int]] = []
    encoder = ChunkEncoder(config, tiny_tokenizer, progress=lambda *counts: reported.append(counts))
    chunk = plan.chunks[1]
    (tmp_path / "a").mkdir()
    result = encoder.encode(chunk, tmp_path / "a").stamp()
    assert {f"000001.{split}.{suffix}" for split in ("train", "valid") for suffix in ("bin", "hash", "sizes")} <= {
        p.name for p in (tmp_path / "a").iterdir()}  # and the near-duplicate signatures
    sizes = np.concatenate([np.fromfile(tmp_path / "a" / f"000001.{split}.sizes", dtype=np.int32)
                            for split in ("train", "valid")])
    kept = result.documents_read - sum(result.dropped.values())
    assert result.index == 1 and kept == len(sizes) > 0 and result.tokens_encoded == int(sizes.sum())
    assert [sum(column) for column in zip(*reported, strict=True)] == [kept, result.tokens_encoded]
    assert result.process == os.getpid() and result.peak_rss_mb > 10

    (tmp_path / "b").mkdir()  # another encoder, the same chunk: the same bytes
    ChunkEncoder(config, tiny_tokenizer).encode(chunk, tmp_path / "b")
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}


def test_validation_split_is_chosen_by_document_hash_and_seed(tmp_path, tiny_tokenizer):
    _, a = encode(tmp_path / "a", tiny_tokenizer, encoding={"validation_fraction": 0.1})
    _, b = encode(tmp_path / "b", tiny_tokenizer, encoding={"validation_fraction": 0.1, "split_seed": 7})
    assert 0.05 < a.splits["valid"].documents / a.documents.kept < 0.15
    assert (tmp_path / "a/tokens/valid.bin").read_bytes() != (tmp_path / "b/tokens/valid.bin").read_bytes()
