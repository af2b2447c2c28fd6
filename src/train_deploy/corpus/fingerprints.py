"""The corpus stage's fingerprints: equal fingerprints, equal outputs (reuse, and skip-unchanged retraining).

- :func:`tokenizer_fingerprint`: what a trained tokenizer depends on (or the folder a loaded one comes from);
- :func:`corpus_fingerprint`: what the token files are made of: the inputs' contents, reading, cleaning, the
  tokenizer (by a hash of its files, or before it exists by its own fingerprint) and the split.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from train_deploy import __version__
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.readers import CorpusPlan
from train_deploy.corpus.tokenizer import tokenizer_hash
from train_deploy.hashing import digest

FORMAT = "paddlenlp-mmap-indexed-v1"


def tokenizer_fingerprint(config: CorpusConfig, plan: CorpusPlan) -> str:
    """Hash of everything a trained tokenizer depends on (or of the folder a loaded one comes from)."""
    t = config.tokenizer
    if t.mode == "load":
        return digest({"load_path": str(Path(t.load_path).resolve())})
    relevant = {k: v for k, v in asdict(t).items() if k not in ("num_threads", "load_path")}
    return digest({"input": plan.input_hash, "reader": asdict(config.reader), "cleaning": asdict(config.cleaning),
                   "tokenizer": relevant})


def corpus_fingerprint(config: CorpusConfig, plan: CorpusPlan, tokenizer: str) -> str:
    """Hash of the inputs, reading, cleaning, split and ``tokenizer`` (a hash that names it): equal fingerprints,
    equal token files."""
    e = config.encoding
    return digest({"format": FORMAT, "version": __version__, "input": plan.input_hash, "reader": asdict(config.reader),
                   "cleaning": asdict(config.cleaning), "tokenizer": tokenizer,
                   "split": {"validation_fraction": e.validation_fraction, "split_seed": e.split_seed}})


def source_fingerprint(config: CorpusConfig, plan: CorpusPlan) -> str:
    """:func:`corpus_fingerprint` known before tokenizing: a loaded tokenizer by its files' hash, a trained one by
    what it is trained from (:func:`tokenizer_fingerprint`). What skip-unchanged retraining compares."""
    t = config.tokenizer
    tokenizer = tokenizer_hash(Path(t.load_path)) if t.mode == "load" else tokenizer_fingerprint(config, plan)
    return corpus_fingerprint(config, plan, tokenizer)
