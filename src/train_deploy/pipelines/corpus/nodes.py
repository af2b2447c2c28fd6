"""Nodes of the corpus stage: thin, typed seams between the catalog and ``train_deploy.corpus``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from train_deploy.corpus.build import (
    check_splits,
    encode_corpus,
    sample_documents,
    token_files_are_current,
    token_fingerprint,
)
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.fingerprints import tokenizer_fingerprint
from train_deploy.corpus.readers import CorpusPlan, plan_corpus, resolved
from train_deploy.corpus.report import CorpusQuality, examples_text, report_figure
from train_deploy.corpus.tokenizer import load_tokenizer, tokenizer_is_current, train_tokenizer, training_sentences
from train_deploy.datasets import FolderWork
from train_deploy.handoffs import InitSource, TokenizerInfo, TokenManifest, WorkFolder, to_json
from train_deploy.registry.champion import record_init_source, resolve_init_source
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalset import jsonl_texts
from train_deploy.training.config import TrainingConfig

logger = logging.getLogger(__name__)


def plan_inputs(corpus: dict[str, Any]) -> tuple[CorpusConfig, CorpusPlan]:
    """Return the validated configuration and the chunked, fingerprinted input plan."""
    config = CorpusConfig.from_params(corpus)
    config = dataclasses.replace(config, reader=resolved(config.reader))  # man_renderer: auto → the one found here
    plan = plan_corpus(config.reader)
    logger.info("Corpus: %d file(s), %.1f MB, %d chunk(s), content hash %s", len(plan.files),
                plan.input_bytes / 1e6, len(plan.chunks), plan.input_hash[:12])
    return config, plan


def configure_corpus_training(training: dict[str, Any]) -> TrainingConfig:
    """Return the ``training`` block validated once for this stage, which reads two things of it: where training
    starts (``init_from``, :func:`resolve_init`) and the window and batch the token files must fill (``batch``,
    :func:`encode_tokens`). The training stage validates it with a warm start's shape on its own."""
    return TrainingConfig.from_params(training)


def resolve_init(training: TrainingConfig, registry: dict[str, Any], corpus_config: CorpusConfig,
                 init_cache: WorkFolder) -> InitSource:
    """Return where training starts (``training.init_from``): scratch, a model folder, or the champion's
    ``pretrained/`` folder downloaded into ``init_cache`` (scratch, with the reason, when it cannot be used)."""
    source = resolve_init_source(training.init_from, corpus_config, RegistryConfig.from_params(registry),
                                 Path(init_cache.path))
    record_init_source(source)
    return source


def evaluation_set_texts(registry: dict[str, Any]) -> list[str]:
    """Return the texts tonight's training split is decontaminated against: the registered model's stored evaluation
    set, else the ``registry.eval_set.path`` file its first registration will store; none without an MLflow run
    (nothing is registered) or when the first registration will build the set from the validation split (which the
    corpus stage keeps apart from training)."""
    import mlflow
    from mlflow import MlflowClient

    from train_deploy.registry.evalstore import stored_eval_set
    from train_deploy.registry.retry import Retrying

    if mlflow.active_run() is None:
        return []
    config = RegistryConfig.from_params(registry)
    client = MlflowClient()
    stored = Retrying(config.retries, client.tracking_uri)("read the evaluation set",
                                                           lambda: stored_eval_set(client, config.model_name))
    if stored is not None:
        logger.info("Training documents are checked against registered model %s's evaluation set (%d texts, "
                    "sha256 %s)", config.model_name, len(stored.texts), stored.sha256[:12])
        return stored.texts
    texts = config.eval_set
    return jsonl_texts(texts.path, texts.documents, texts.max_chars) if texts.path else []


def prepare_tokenizer(corpus_config: CorpusConfig, corpus_plan: CorpusPlan,
                      init_source: InitSource | None = None) -> FolderWork[TokenizerInfo]:
    """Return how to fill the tokenizer folder: the warm start's (``training.init_from``), or SentencePiece trained
    on a corpus sample, or a PaddleNLP one copied."""
    if init_source is not None and init_source.tokenizer_path:  # as corpus.tokenizer.mode: load from that model
        logger.info("corpus.tokenizer is ignored: the tokenizer is %s's (training.init_from)", init_source.path)
        fingerprint = f"init_from:{init_source.hash}"
        return FolderWork(build=partial(load_tokenizer, Path(init_source.tokenizer_path), fingerprint=fingerprint),
                          keep=partial(tokenizer_is_current, fingerprint=fingerprint), what="tokenizer",
                          fingerprint=fingerprint)
    t = corpus_config.tokenizer
    fingerprint = tokenizer_fingerprint(corpus_config, corpus_plan)
    if t.mode == "load":
        build = partial(load_tokenizer, Path(t.load_path), fingerprint=fingerprint)
    else:
        def build(folder: Path) -> TokenizerInfo:
            sentences = training_sentences(sample_documents(corpus_config, corpus_plan), t.max_sentence_chars)
            return train_tokenizer(sentences, t, folder, fingerprint,
                                   normalization=corpus_config.cleaning.normalization)
    return FolderWork(build=build, keep=partial(tokenizer_is_current, fingerprint=fingerprint), what="tokenizer",
                      fingerprint=fingerprint)


def encode_tokens(corpus_config: CorpusConfig, corpus_plan: CorpusPlan, tokenizer: TokenizerInfo,
                  training: TrainingConfig | None = None,
                  eval_texts: list[str] | None = None) -> FolderWork[TokenManifest]:
    """Return how to fill the token folder: encode the corpus in parallel (kept when its fingerprint is unchanged),
    leaving out of the training split the documents that hold a text of ``eval_texts`` (the evaluation set), refusing
    token files that cannot fill one window of ``training``'s ``seq_length`` in each split, and warning of a
    validation split smaller than one evaluation batch (:func:`~train_deploy.corpus.build.check_splits`), encoded or
    kept, before the training stage starts."""
    eval_texts = eval_texts or []
    fingerprint = token_fingerprint(corpus_config, corpus_plan, tokenizer.hash, eval_texts)
    keep = partial(token_files_are_current, fingerprint=fingerprint) if corpus_config.encoding.reuse else None
    build = partial(encode_corpus, corpus_config, corpus_plan, tokenizer, eval_texts=eval_texts)
    if training is not None:
        batch = training.batch
        check = partial(check_splits, window=batch.seq_length + 1, batch=batch.micro_batch_size,
                        validation_fraction=corpus_config.encoding.validation_fraction)
        build, keep = _checked(build, keep, check)
    return FolderWork(build=build, keep=keep, what="token files", fingerprint=fingerprint)


def _checked(build: Callable[[Path], TokenManifest], keep: Callable[[TokenManifest], bool] | None,
             check: Callable[[TokenManifest], TokenManifest]):
    """``build`` and ``keep`` with ``check`` applied to the token files built, or kept, before they are used."""
    def checked_build(folder: Path) -> TokenManifest:
        return check(build(folder))

    def checked_keep(current: TokenManifest) -> bool:
        return bool(keep(current) and check(current))

    return checked_build, (checked_keep if keep is not None else None)


def report_corpus(token_files: TokenManifest) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Return the manifest's counts and throughput as MLflow metrics (prefix `corpus.`) and the manifest itself."""
    m = token_files
    values = {
        "documents_read": m.documents.read,
        "documents_kept": m.documents.kept,
        "train_tokens": m.splits["train"].tokens,
        "valid_tokens": m.splits["valid"].tokens,
        "tokens_per_second": m.throughput["tokens_per_second"],
        "wall_time_seconds": m.wall_time_seconds,
        "reused": float(m.reused),
    }
    values.update({f"dropped.{k}": v for k, v in m.documents.dropped.items()})
    values.update({f"skipped.{k}": v for k, v in m.documents.skipped_bad_input.items()})
    return {key: {"value": float(value), "step": 0} for key, value in values.items()}, to_json(m)


def report_corpus_quality(token_files: TokenManifest) -> tuple[Any, str]:
    """Return the corpus report: a figure of document lengths and drop reasons, and kept and dropped examples."""
    quality = CorpusQuality.of(token_files)
    return report_figure(quality), examples_text(quality)
