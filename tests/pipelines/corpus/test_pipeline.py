"""The corpus pipeline as Kedro runs it, on a tiny People's Daily slice, with SequentialRunner."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlflow
import pytest
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner
from mlflow import MlflowClient

from tests.corpus.test_dedup import split_texts
from tests.helpers.project import corpus_params
from tests.helpers.registry import ModelStore
from train_deploy.config import ConfigError
from train_deploy.datasets import ArtifactFolderDataset, WorkFolderDataset
from train_deploy.handoffs import DocumentCounts, TokenManifest
from train_deploy.pipelines.corpus import create_pipeline
from train_deploy.pipelines.corpus.nodes import evaluation_set_texts, report_corpus
from train_deploy.registry.evalstore import store_eval_set

SRC = Path(__file__).resolve().parents[3] / "src" / "train_deploy"


def _catalog(tmp_path, training: dict | None = None, registry: dict | None = None, **encoding) -> DataCatalog:
    """The corpus stage's catalog entries as conf/base/catalog.yml declares them, in ``tmp_path``."""
    return DataCatalog({
        "params:corpus": MemoryDataset(corpus_params(encoding=encoding)),
        "params:training": MemoryDataset(training or {}),  # init_from: scratch
        "params:registry": MemoryDataset(registry or {}),
        "init_cache": WorkFolderDataset(path=str(tmp_path / "init_from")),
        "tokenizer": ArtifactFolderDataset(path=str(tmp_path / "tokenizer"), by_fingerprint=True,
                                           description="train_deploy.handoffs.TokenizerInfo"),
        "token_files": ArtifactFolderDataset(path=str(tmp_path / "tokens"), by_fingerprint=True,
                                             description="train_deploy.handoffs.TokenManifest"),
    })


def test_corpus_pipeline_publishes_tokenizer_and_token_folders_and_switching_back_to_a_corpus_encodes_nothing(
        tmp_path):
    catalog = _catalog(tmp_path)
    outputs = SequentialRunner().run(create_pipeline(), catalog)
    manifest = json.loads((tmp_path / "tokens" / "manifest.json").read_text(encoding="utf-8"))
    tokenizer = json.loads((tmp_path / "tokenizer" / "train_deploy_tokenizer.json").read_text(encoding="utf-8"))
    assert (tmp_path / "tokens" / "train.bin").stat().st_size == manifest["splits"]["train"]["bin_bytes"]
    assert (tmp_path / "tokenizer" / "sentencepiece.bpe.model").is_file()
    assert manifest["tokenizer"]["hash"] == tokenizer["hash"] and "path" not in manifest["tokenizer"]
    metrics = outputs["corpus_metrics"].load()
    assert metrics["train_tokens"]["value"] == manifest["splits"]["train"]["tokens"] > 10_000
    assert outputs["token_manifest"].load()["fingerprint"] == manifest["fingerprint"]
    loaded = catalog["token_files"].load()
    assert isinstance(loaded, TokenManifest) and loaded.path == str(tmp_path / "tokens.by_fingerprint" /
                                                                    manifest["fingerprint"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # nothing staged is left
        "tokenizer", "tokenizer.by_fingerprint", "tokens", "tokens.by_fingerprint"]

    # a second corpus (another split) beside the first, then the first again: nothing is encoded again
    SequentialRunner().run(create_pipeline(), _catalog(tmp_path, validation_fraction=0.2))
    store = tmp_path / "tokens.by_fingerprint"
    assert len(list(store.iterdir())) == 2 and (tmp_path / "tokens").resolve() != store / manifest["fingerprint"]
    files = {p: p.stat().st_mtime_ns for p in (store / manifest["fingerprint"]).iterdir()}
    again = _catalog(tmp_path)
    assert SequentialRunner().run(create_pipeline(), again)["corpus_metrics"].load()["reused"]["value"] == 1.0
    assert again["token_files"].load().reused and again["tokenizer"].load().reused
    assert (tmp_path / "tokens").resolve() == store / manifest["fingerprint"]
    assert {p: p.stat().st_mtime_ns for p in (store / manifest["fingerprint"]).iterdir()} == files  # untouched
    assert len(list(store.iterdir())) == 2 and len(list((tmp_path / "tokenizer.by_fingerprint").iterdir())) == 1


def test_corpus_report_flattens_counts_for_mlflow(tiny_token_files):
    counts = DocumentCounts(read=10, kept=7, dropped={"too_short": 2, "duplicate": 1},
                            skipped_bad_input={"invalid_utf8": 3})
    manifest = dataclasses.replace(tiny_token_files, documents=counts, reused=True)
    metrics, logged = report_corpus(manifest)
    assert metrics["dropped.duplicate"] == {"value": 1.0, "step": 0}
    assert metrics["skipped.invalid_utf8"]["value"] == 3.0
    assert metrics["reused"]["value"] == 1.0
    assert logged["documents"]["read"] == 10 and "path" not in logged and "reused" not in logged


def test_the_training_block_is_validated_once_at_the_head_of_the_stage_and_an_invalid_one_encodes_nothing(tmp_path):
    with pytest.raises(ConfigError, match=r"^training\.batch\.seq_length: must be at least 2 \(got 0\)$"):
        SequentialRunner().run(create_pipeline(), _catalog(tmp_path, training={"batch": {"seq_length": 0}}))
    assert not (tmp_path / "tokenizer").exists() and not (tmp_path / "tokens").exists()
    # the stage's one configure node validates it; the retrain check validates it the same way, once (importing the
    # node would be an import up into the stages)
    callers = {path.relative_to(SRC).as_posix(): path.read_text(encoding="utf-8").count("TrainingConfig.from_params")
               for path in (SRC / "pipelines" / "corpus" / "nodes.py", SRC / "run_control" / "retrain.py")}
    assert callers == {"pipelines/corpus/nodes.py": 1, "run_control/retrain.py": 1}


@pytest.mark.slow
def test_tonights_training_documents_that_hold_a_text_of_the_registered_models_set_are_left_out(
        tmp_path, tiny_token_files, tiny_tokenizer):
    training = split_texts(tiny_token_files, "train", tiny_tokenizer)
    texts = [training[7][:80], "一段训练语料里没有的文字，今天天气很好。"]
    store, registry = ModelStore(tmp_path / "store"), {"model_name": "edu_lm"}
    assert evaluation_set_texts(registry) == []  # no MLflow run: nothing is registered, nothing to check
    with store.active(), mlflow.start_run() as run:
        assert evaluation_set_texts(registry) == []  # no model yet
        client = MlflowClient()
        client.create_registered_model("edu_lm")
        store_eval_set(client, "edu_lm", run.info.run_id, texts)
        catalog = _catalog(tmp_path, registry=registry, validation_fraction=0.05)
        SequentialRunner().run(create_pipeline(), catalog)
    manifest = catalog["token_files"].load()
    assert manifest.documents.dropped["near_duplicate_of_eval_set"] == 1
    assert manifest.splits["train"].documents == tiny_token_files.splits["train"].documents - 1
    assert split_texts(manifest, "train", tiny_tokenizer) == training[:7] + training[8:]
    assert manifest.config["eval_set"]["texts"] == 2 and manifest.fingerprint != tiny_token_files.fingerprint
    assert split_texts(manifest, "valid", tiny_tokenizer) == split_texts(tiny_token_files, "valid", tiny_tokenizer)


def test_the_first_registrations_jsonl_set_is_checked_before_it_is_stored(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"text": "今天天气很好，我们去公园。"}\n{"text": "明天会下雨吗？"}\n', encoding="utf-8")
    registry = {"model_name": "edu_lm", "eval_set": {"path": str(path), "documents": 1}}
    with ModelStore(tmp_path / "store").active(), mlflow.start_run():
        assert evaluation_set_texts(registry) == ["今天天气很好，我们去公园。"]
