"""Nodes of the corpus stage: thin, typed seams between the catalog and ``train_deploy.corpus``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from train_deploy.corpus.build import encode_corpus, sample_documents, tokenizer_fingerprint
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.readers import CorpusPlan, plan_corpus
from train_deploy.corpus.tokenizer import load_tokenizer, saved_tokenizer, train_tokenizer, training_sentences

logger = logging.getLogger(__name__)


def plan_inputs(corpus: dict[str, Any]) -> dict[str, Any]:
    """Return the validated configuration and the chunked, fingerprinted input plan."""
    config = CorpusConfig.from_params(corpus)
    plan = plan_corpus(config.reader)
    logger.info("Corpus: %d file(s), %.1f MB, %d chunk(s), content hash %s", len(plan.files),
                plan.input_bytes / 1e6, len(plan.chunks), plan.input_hash[:12])
    return {"config": config, "plan": plan}


def prepare_tokenizer(corpus_plan: dict[str, Any]) -> dict[str, Any]:
    """Return the tokenizer description, training or loading it unless an identical one is saved."""
    config: CorpusConfig = corpus_plan["config"]
    plan: CorpusPlan = corpus_plan["plan"]
    output_dir = Path(config.tokenizer.output_dir)
    fingerprint = tokenizer_fingerprint(config, plan)
    if info := saved_tokenizer(output_dir, fingerprint):
        logger.info("Tokenizer unchanged (fingerprint %s): reusing %s", fingerprint[:12], output_dir)
        return info.to_dict()
    if config.tokenizer.mode == "load":
        return load_tokenizer(Path(config.tokenizer.load_path), output_dir, fingerprint).to_dict()
    sentences = training_sentences(sample_documents(config, plan), config.tokenizer.max_sentence_chars)
    return train_tokenizer(sentences, config.tokenizer, output_dir, fingerprint).to_dict()


def encode_tokens(corpus_plan: dict[str, Any], tokenizer: dict[str, Any]) -> dict[str, Any]:
    """Return the token manifest after encoding the corpus (or reusing unchanged outputs)."""
    from train_deploy.corpus.tokenizer import TokenizerInfo

    return encode_corpus(corpus_plan["config"], corpus_plan["plan"], TokenizerInfo(**tokenizer))


def corpus_metrics(token_manifest: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Return the manifest's counts and throughput as MLflow metrics (logged with the prefix `corpus.`)."""
    m = token_manifest
    values = {
        "documents_read": m["documents"]["read"],
        "documents_kept": m["documents"]["kept"],
        "train_tokens": m["splits"]["train"]["tokens"],
        "valid_tokens": m["splits"]["valid"]["tokens"],
        "tokens_per_second": m["throughput"]["tokens_per_second"],
        "wall_time_seconds": m["wall_time_seconds"],
        "reused": float(bool(m.get("reused"))),
    }
    values.update({f"dropped.{k}": v for k, v in m["documents"]["dropped"].items()})
    values.update({f"skipped.{k}": v for k, v in m["documents"]["skipped_bad_input"].items()})
    return {key: {"value": float(value), "step": 0} for key, value in values.items()}
