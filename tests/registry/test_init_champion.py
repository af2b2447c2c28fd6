"""training.init_from: champion: the registered champion's pretrained/ weights and tokenizer, unless the tokenizer
configuration changed since it was trained (then scratch, with the reason on the run)."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient
from safetensors.numpy import load_file

from tests.helpers.project import corpus_params
from train_deploy.corpus.config import CorpusConfig
from train_deploy.handoffs import WorkFolder
from train_deploy.pipelines.corpus.nodes import configure_corpus_training, resolve_init
from train_deploy.training.pretrained import TOKENIZER_TAG, tokenizer_config_fingerprint

MODEL = "init_from_champion_lm"  # its own registered model: the other tests' champion is not touched
TRAINED_WITH = CorpusConfig.from_params(corpus_params())


@pytest.fixture(scope="module")
def champion(model_store, tiny_bundle) -> str:
    """The tiny bundle registered as version 1 of :data:`MODEL`, trained with :data:`TRAINED_WITH`, champion."""
    info = model_store.log(tiny_bundle, registered_model_name=MODEL)
    with model_store.active():
        client = MlflowClient()
        version = str(info.registered_model_version)
        client.set_model_version_tag(MODEL, version, TOKENIZER_TAG, tokenizer_config_fingerprint(TRAINED_WITH))
        client.set_registered_model_alias(MODEL, "champion", version)
    return version


def start(model_store, corpus: CorpusConfig, cache, name: str = MODEL):
    """The corpus stage's init node in an MLflow run; return its InitSource and the run's params and tags."""
    with model_store.active(), mlflow.start_run() as run:
        source = resolve_init(configure_corpus_training({"init_from": "champion"}), {"model_name": name}, corpus,
                              WorkFolder(path=str(cache)))
    data = MlflowClient(model_store.tracking_uri).get_run(run.info.run_id).data
    return source, data.params, data.tags


@pytest.mark.slow
def test_an_unchanged_tokenizer_configuration_starts_from_the_champions_weights(model_store, champion, tmp_path,
                                                                                tiny_checkpoint, tiny_bundle):
    source, params, tags = start(model_store, CorpusConfig.from_params(corpus_params()), tmp_path / "cache")
    assert (source.started_from, source.champion_version, source.reason) == ("champion", champion, "")
    assert (params["init_from"], params["init_from.hash"]) == ("champion", source.hash)
    assert (tags["init_from"], tags["init_from.champion_version"]) == ("champion", champion)
    started, trained = load_file(f"{source.path}/model.safetensors"), load_file(f"{tiny_checkpoint}/model.safetensors")
    assert started.keys() == trained.keys()
    for name, value in trained.items():
        np.testing.assert_array_equal(started[name], value.astype(np.float32), err_msg=name)
    # pretrained/'s copy names the end-of-document piece as its bos piece (export/pretrained.py), nothing else
    import sentencepiece

    bundle, started = (sentencepiece.SentencePieceProcessor(model_file=str(folder / "sentencepiece.bpe.model"))
                       for folder in (tiny_bundle / "tokenizer", Path(source.tokenizer_path)))
    pieces = range(bundle.get_piece_size())
    assert [started.id_to_piece(i) for i in pieces] == [bundle.id_to_piece(i) for i in pieces]
    text = "１９９８年，中国经济（ＧＤＰ）增长。"
    assert started.encode(text) == bundle.encode(text)
    assert Path(source.path).is_relative_to(tmp_path / "cache")  # downloaded into the init cache


@pytest.mark.slow
def test_a_changed_tokenizer_configuration_starts_from_scratch_with_the_reason_on_the_run(model_store, champion,
                                                                                          tmp_path):
    changed = CorpusConfig.from_params(corpus_params(tokenizer={"vocab_size": 3000}))
    source, params, tags = start(model_store, changed, tmp_path / "cache")
    assert (source.started_from, source.path, source.tokenizer_path) == ("scratch", "", "")
    assert tags["init_from"] == "scratch" and params["init_from"] == "champion"
    assert tags["init_from.reason"].startswith("the tokenizer configuration (corpus.cleaning and corpus.tokenizer) "
                                               f"is not the one champion version {champion} was trained with")
    assert not (tmp_path / "cache").exists()  # nothing downloaded


def test_no_champion_yet_starts_from_scratch_saying_so(model_store, tmp_path):
    source, _, tags = start(model_store, TRAINED_WITH, tmp_path / "cache", name="never_registered_lm")
    assert source.started_from == "scratch"
    assert tags["init_from.reason"] == "registered model never_registered_lm has no champion yet"
