"""The corpus pipeline as Kedro runs it, on a tiny People's Daily slice, with SequentialRunner."""

from __future__ import annotations

import json

from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner

from tests.conftest import corpus_params
from train_deploy.pipelines.corpus import create_pipeline
from train_deploy.pipelines.corpus.nodes import corpus_metrics


def test_corpus_pipeline_produces_tokenizer_tokens_manifest_and_metrics(tmp_path):
    params = corpus_params(tmp_path)
    catalog = DataCatalog({"params:corpus": MemoryDataset(params)})
    outputs = SequentialRunner().run(create_pipeline(), catalog)
    manifest = json.loads((tmp_path / "tokens" / "manifest.json").read_text(encoding="utf-8"))
    tokenizer = json.loads((tmp_path / "tokenizer" / "train_deploy_tokenizer.json").read_text(encoding="utf-8"))
    assert (tmp_path / "tokens" / "train.bin").stat().st_size == manifest["splits"]["train"]["bin_bytes"]
    assert (tmp_path / "tokenizer" / "sentencepiece.bpe.model").is_file()
    assert manifest["tokenizer"]["hash"] == tokenizer["hash"]
    metrics = outputs["corpus_metrics"].load()
    assert metrics["train_tokens"]["value"] == manifest["splits"]["train"]["tokens"] > 10_000


def test_corpus_metrics_flatten_counts_for_mlflow():
    manifest = {
        "documents": {"read": 10, "kept": 7, "dropped": {"too_short": 2, "duplicate": 1},
                      "skipped_bad_input": {"invalid_utf8": 3}},
        "splits": {"train": {"tokens": 100}, "valid": {"tokens": 5}},
        "throughput": {"tokens_per_second": 1e6},
        "wall_time_seconds": 0.5,
        "reused": True,
    }
    metrics = corpus_metrics(manifest)
    assert metrics["dropped.duplicate"] == {"value": 1.0, "step": 0}
    assert metrics["skipped.invalid_utf8"]["value"] == 3.0
    assert metrics["reused"]["value"] == 1.0
