"""Corpus → tokens, the orchestration: tokenizer sample, reuse check, encoding by an executor, merge, manifest.

Each worker reads, cleans, encodes and writes whole chunks of the input (Megatron's ``--partitions``
idea; the kernel is :mod:`train_deploy.corpus.encode`, the processes or Ray tasks that run it are
:mod:`train_deploy.corpus.executors`): no text or token lists travel between processes, only small per-chunk
statistics. Shards are merged here in chunk order, so the output is byte-for-byte the same for any executor
and worker count. Whether published token files are current compares :mod:`train_deploy.corpus.fingerprints`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.atomic import scratch_folder
from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.dedup import NEAR_EVAL_SET, NEAR_TRAINING, TextOverlap, near_duplicates
from train_deploy.corpus.encode import SPLITS, ChunkResult, peak_rss_mb
from train_deploy.corpus.errors import CorpusError
from train_deploy.corpus.executors.local import run_local
from train_deploy.corpus.filters import QualityFilter
from train_deploy.corpus.fingerprints import FORMAT, corpus_fingerprint
from train_deploy.corpus.indexed import document_sizes, merge_shards, token_dtype
from train_deploy.corpus.native import compiled
from train_deploy.corpus.readers import CorpusPlan, ReadStats, iter_document_batches
from train_deploy.corpus.report import BINS, EXAMPLES, CorpusQuality, QualitySample, length_bins
from train_deploy.corpus.tokenizer import TokenEncoder
from train_deploy.handoffs import MANIFEST_FILE as MANIFEST
from train_deploy.handoffs import DocumentCounts, SplitInfo, TokenizerInfo, TokenManifest, write_json
from train_deploy.hashing import digest

logger = logging.getLogger(__name__)

_SAMPLE_BATCH = 64  # documents cleaned and filtered at once while sampling: little work past the budget
_DECODE_BATCH = 512  # training documents decoded and compared with the evaluation set at once

Drops = dict[str, dict[str, list[np.ndarray]]]
"""Split → drop reason → one mask per chunk over the split's documents of that chunk."""


def token_fingerprint(config: CorpusConfig, plan: CorpusPlan, tokenizer: str, eval_texts: Sequence[str] = ()) -> str:
    """The token files' fingerprint: :func:`corpus_fingerprint`, and, when the training split is decontaminated
    against an evaluation set (``eval_texts``), that set's texts: another set, other token files."""
    fingerprint = corpus_fingerprint(config, plan, tokenizer)
    return digest({"corpus": fingerprint, "eval_set": eval_set_digest(eval_texts)}) if eval_texts else fingerprint


def eval_set_digest(eval_texts: Sequence[str]) -> str:
    return digest(list(eval_texts))


def sample_documents(config: CorpusConfig, plan: CorpusPlan) -> Iterator[str]:
    """Cleaned documents for tokenizer training: about ``sample_bytes``, spread evenly over all chunks."""
    cleaner, quality = Cleaner(config.cleaning), QualityFilter(config.cleaning)
    sizes = [c.end - c.start if not c.compressed else Path(c.path).stat().st_size for c in plan.chunks]
    total = max(1, sum(sizes))
    for chunk, size in zip(plan.chunks, sizes, strict=True):
        budget = config.tokenizer.sample_bytes * size / total
        taken = 0
        for raw in iter_document_batches(chunk, config.reader, ReadStats(), _SAMPLE_BATCH):
            texts = cleaner.clean_batch(raw)
            for text, reason in zip(texts, quality.reasons(texts), strict=True):
                if reason is None and taken < budget:
                    yield text
                    taken += len(text.encode("utf-8"))
            if taken >= budget:
                break


def token_files_are_current(manifest: TokenManifest, fingerprint: str) -> bool:
    """True if the published token files were encoded with ``fingerprint`` and every file is whole."""
    if manifest.fingerprint != fingerprint:
        return False
    for split in manifest.splits.values():
        for suffix, size in (("bin", split.bin_bytes), ("idx", split.idx_bytes)):
            file = Path(manifest.path) / f"{split.prefix}.{suffix}"
            if not file.is_file() or file.stat().st_size != size:
                return False
    return True


def check_splits(manifest: TokenManifest, window: int, validation_fraction: float, batch: int = 1) -> TokenManifest:
    """Return ``manifest`` if its training split, and its validation split unless ``validation_fraction`` is 0 (none
    asked for), each hold one window of ``window`` tokens (``training.batch.seq_length + 1``: what training samples
    and what evaluation, averaging and export's parity score); else raise ``CorpusError``, one line naming the key
    to change. A validation split of fewer than ``batch`` windows (one evaluation batch: micro_batch_size) is
    warned about: training then does not evaluate. Checked when the corpus stage ends, before training starts."""
    train, valid = manifest.splits["train"], manifest.splits["valid"]
    if train.tokens < window:
        raise CorpusError(f"corpus: the training split holds {train.tokens} tokens ({train.documents} documents), "
                          f"fewer than one window of training.batch.seq_length + 1 = {window}; give more text or set "
                          "a shorter training.batch.seq_length")
    windows = max(0, valid.tokens - 1) // (window - 1)
    if validation_fraction == 0 or windows >= batch:
        return manifest
    if windows >= 1:
        logger.warning("corpus.encoding.validation_fraction: the validation split holds %d window(s) of "
                       "training.batch.seq_length + 1 = %d tokens, fewer than one evaluation batch "
                       "(training.batch.micro_batch_size = %d): training will not evaluate, averaging and export "
                       "score on these; %s", windows, window, batch,
                       _more_validation(manifest, batch * (window - 1) + 1, validation_fraction))
        return manifest
    raise CorpusError(f"corpus.encoding.validation_fraction: {validation_fraction:g} of the "
                      f"{train.documents + valid.documents} documents put {valid.documents} "
                      f"document{'' if valid.documents == 1 else 's'} ({valid.tokens} tokens) in the validation split, "
                      f"fewer tokens than one evaluation window of training.batch.seq_length + 1 = {window}; "
                      f"{_more_validation(manifest, window, validation_fraction)}")


def _more_validation(manifest: TokenManifest, tokens_needed: int, validation_fraction: float) -> str:
    """What to set for a validation split of ``tokens_needed`` tokens. The split takes whole documents by a hash
    of their text: enough that a split holding none, (1 - f)^n, is unlikely (5%), three times the tokens needed,
    and at least twice the share that gave too few."""
    documents = sum(split.documents for split in manifest.splits.values())
    tokens = sum(split.tokens for split in manifest.splits.values())
    wanted = max(1 - 0.05 ** (1 / max(documents, 1)), 3 * tokens_needed / max(tokens, 1), 2 * validation_fraction)
    if wanted > 0.5:
        return (f"{documents} document{'' if documents == 1 else 's'} of {tokens} tokens are too few to split: "
                f"{_more_documents(manifest.config.get('reader', {}))}")
    value = f"{math.ceil(wanted * 100) / 100:g}"
    return f"set it to {value} (--params corpus.encoding.validation_fraction={value}) or give more text"


def _more_documents(reader: dict[str, Any]) -> str:
    """How the ``reader`` settings could cut the same input into more documents, or else more text."""
    if reader.get("source") == "html":
        return ("cut the pages at their headings, one document per section (--params "
                "corpus.reader.html_split_chars=1000), or give more text")
    if reader.get("source") == "text" and reader.get("document_split") == "file":
        return "cut the files at blank lines (--params corpus.reader.document_split=blank_line), or give more text"
    return "give more text (or a shorter training.batch.seq_length)"


def encode_corpus(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, folder: Path,
                  eval_texts: Sequence[str] = ()) -> TokenManifest:
    """Encode the planned corpus into ``folder`` (empty): ``{train,valid}.{bin,idx}`` and ``manifest.json``.

    ``eval_texts``, the registered model's evaluation set: a training document that holds one of them
    (:class:`~train_deploy.corpus.dedup.TextOverlap`, with ``near_dedup_ngram`` and ``near_dedup_threshold``) is left
    out of the training split and counted as ``near_duplicate_of_eval_set``; the set itself is never changed."""
    if not plan.chunks:
        raise CorpusError(f"corpus is empty: nothing to read in {', '.join(plan.files) or 'the configured paths'}")
    started = time.perf_counter()
    work = scratch_folder(Path(folder), "shards")
    try:
        stats = _combine(_run_chunks(config, plan, tokenizer, work))
        if stats["documents_kept"] == 0:
            raise CorpusError(f"corpus is empty: no document left after cleaning in {', '.join(plan.files)} "
                              f"(read {stats['documents_read']}, dropped {dict(stats['dropped'])})")
        drops = _drops(config, plan, tokenizer, work, eval_texts)
        _drop_examples(work, plan, tokenizer, drops, stats["quality"])
        splits = _merge(config, plan, tokenizer, work, Path(folder), stats, drops)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - started
    manifest = _manifest(config, plan, tokenizer, stats, splits, wall, eval_texts)
    manifest.path = str(folder)
    token_bins = sum((length_bins(document_sizes(Path(folder) / f"{s}.idx")) for s in SPLITS), np.zeros(BINS, int))
    CorpusQuality(stats["quality"], token_bins.tolist(), manifest.documents.dropped, manifest.documents.read,
                  manifest.documents.kept).write(Path(folder))
    write_json(Path(folder) / MANIFEST, manifest)
    logger.info("Encoded %d documents, %d tokens (train %d / valid %d) in %.1f s, %.2f M tokens/s",
                manifest.documents.kept, manifest.tokens["total"], splits["train"].tokens, splits["valid"].tokens,
                wall, manifest.throughput["tokens_per_second"] / 1e6)
    for message in stats["warnings"]:
        logger.warning("skipped: %s", message)
    return manifest


def _run_chunks(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path) -> list[ChunkResult]:
    """Encode every chunk into shards in ``work`` with the configured executor; return their statistics."""
    if config.encoding.executor == "ray":
        from train_deploy.corpus.executors.ray import run_on_ray  # imports Ray (~1 s) only when asked for

        return run_on_ray(config, plan, tokenizer, work)
    return run_local(config, plan, tokenizer, work)


# --- merge and publish -----------------------------------------------------------------------------


def _combine(results: list[ChunkResult]) -> dict[str, Any]:
    read = ReadStats()
    dropped: Counter[str] = Counter()
    documents = tokens = 0
    sample = QualitySample()
    for r in sorted(results, key=lambda r: r.index):
        documents += r.documents_read
        tokens += r.tokens_encoded
        dropped.update(r.dropped)
        read.merge(r.read)
        sample.merge(r.sample)
    kept = documents - sum(dropped.values())
    peaks: dict[int, float] = {}
    for r in results:
        peaks[r.process] = max(peaks.get(r.process, 0.0), r.peak_rss_mb)
    return {"documents_read": documents, "documents_kept": kept, "tokens_encoded": tokens, "dropped": dropped,
            "quality": sample, "processes": len(peaks),
            "skipped": read.skipped, "warnings": read.warnings,
            "peak_rss_mb": {"this_process": peaks.pop(os.getpid(), peak_rss_mb()),
                            "helpers": [round(v, 1) for v in peaks.values()]}}


def _drops(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path,
           eval_texts: Sequence[str]) -> Drops:
    """What the merge leaves out beyond exact duplicates: training documents holding an evaluation text, then the
    near-duplicates (:func:`~train_deploy.corpus.dedup.near_duplicates`, when ``near_dedup``)."""
    held = _eval_set_holders(work, plan, tokenizer, eval_texts, config) if eval_texts else None
    prefixes = [work / f"{c.index:06d}" for c in plan.chunks]
    drops: Drops = near_duplicates(prefixes, config.cleaning, held) if config.cleaning.near_dedup else \
        {split: {} for split in SPLITS}
    if held is not None:
        drops["train"][NEAR_EVAL_SET] = held
    return drops


def _eval_set_holders(work: Path, plan: CorpusPlan, tokenizer: TokenizerInfo, eval_texts: Sequence[str],
                      config: CorpusConfig) -> list[np.ndarray]:
    """Per chunk, which of its training documents hold a text of ``eval_texts`` (decoded from their shards)."""
    c = config.cleaning
    overlap = TextOverlap(list(eval_texts), c.near_dedup_ngram, c.near_dedup_threshold)
    encoder, dtype = TokenEncoder(tokenizer), token_dtype(tokenizer.vocab_size)
    masks = []
    for chunk in plan.chunks:
        prefix = work / f"{chunk.index:06d}.train"
        count = len(np.fromfile(f"{prefix}.sizes", dtype=np.int32))
        masks.append(np.concatenate([np.zeros(0, bool)] + [
            overlap.holders(_shard_texts(prefix, encoder, dtype, range(first, min(first + _DECODE_BATCH, count))))
            for first in range(0, count, _DECODE_BATCH)]))
    logger.info("Evaluation set of %d texts: %d training document(s) hold one of them and are left out",
                len(eval_texts), sum(int(m.sum()) for m in masks))
    return masks


def _shard_texts(prefix: Path, encoder: TokenEncoder, dtype: np.dtype, which: Sequence[int]) -> list[str]:
    """The documents ``which`` of a shard, decoded: the text of a dropped one is kept nowhere else."""
    ends = np.cumsum(np.fromfile(f"{prefix}.sizes", dtype=np.int32), dtype=np.int64)
    tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
    try:
        return [encoder.decode(tokens[(ends[i - 1] if i else 0) : ends[i] - 1].tolist()) for i in which]
    finally:
        del tokens


def _merge(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path, folder: Path,
           stats: dict[str, Any], drops: Drops) -> dict[str, SplitInfo]:
    """Merge the chunks' shards in chunk order into ``folder/<split>.{bin,idx}``, leaving out duplicates and the
    ``drops``, each counted under its reason."""
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {}
    for split in SPLITS:
        seen: set[int] | None = set() if config.cleaning.deduplicate else None
        prefixes = [work / f"{c.index:06d}.{split}" for c in plan.chunks]
        reasons = drops[split]
        masks = [np.logical_or.reduce(chunk) for chunk in zip(*reasons.values(), strict=True)] if reasons else None
        documents, tokens, duplicates = merge_shards(prefixes, folder / split, dtype, seen, masks)
        stats["dropped"]["duplicate"] += duplicates
        for reason, chunks in reasons.items():
            count = sum(int(m.sum()) for m in chunks)
            if count or reason != NEAR_TRAINING:  # a corpus without twins across the split: the manifest as before
                stats["dropped"][reason] += count
        splits[split] = SplitInfo(prefix=split, documents=documents, tokens=tokens,
                                  bin_bytes=(folder / f"{split}.bin").stat().st_size,
                                  idx_bytes=(folder / f"{split}.idx").stat().st_size)
    stats["documents_kept"] -= stats["dropped"]["duplicate"] + sum(
        stats["dropped"][reason] for reason in {r for split in drops.values() for r in split})
    return splits


def _drop_examples(work: Path, plan: CorpusPlan, tokenizer: TokenizerInfo, drops: Drops,
                   sample: QualitySample) -> None:
    """Add the first documents of each drop reason (training split first, then validation) to the report, decoded
    from their shards: their text is not kept anywhere else."""
    encoder, dtype = TokenEncoder(tokenizer), token_dtype(tokenizer.vocab_size)
    for split in SPLITS:
        for reason, masks in drops[split].items():
            for chunk, drop in zip(plan.chunks, masks, strict=True):
                if len(sample.examples.get(reason, [])) >= EXAMPLES:
                    break
                if drop.any():
                    for text in _shard_texts(work / f"{chunk.index:06d}.{split}", encoder, dtype,
                                             np.flatnonzero(drop)[:EXAMPLES].tolist()):
                        sample.example(reason, text)


def _manifest(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, stats: dict[str, Any],
              splits: dict[str, SplitInfo], wall: float, eval_texts: Sequence[str]) -> TokenManifest:
    settings: dict[str, Any] = {"reader": asdict(config.reader), "cleaning": asdict(config.cleaning),
                                "encoding": asdict(config.encoding)}
    if eval_texts:  # what the training split was decontaminated against
        settings["eval_set"] = {"texts": len(eval_texts), "digest": eval_set_digest(eval_texts)}
    return TokenManifest(
        format=FORMAT,
        fingerprint=token_fingerprint(config, plan, tokenizer.hash, eval_texts),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        dtype=token_dtype(tokenizer.vocab_size).name,
        tokenizer=replace(tokenizer, path="", reused=False),  # what it is, not where this machine keeps it
        splits=splits,
        documents=DocumentCounts(read=stats["documents_read"], kept=stats["documents_kept"],
                                 dropped=dict(stats["dropped"]), skipped_bad_input=dict(stats["skipped"])),
        tokens={"total": sum(s.tokens for s in splits.values()), "encoded_before_dedup": stats["tokens_encoded"]},
        input={"source": config.reader.source, "files": plan.files, "content_hash": plan.input_hash,
               "bytes": plan.input_bytes, "chunks": len(plan.chunks), "skipped_files": plan.skipped_files},
        config=settings,
        warnings=stats["warnings"],
        workers=min(config.workers, len(plan.chunks)) if config.encoding.executor == "local"
        else stats["processes"],
        compiled_kernels=compiled is not None,  # _fast.c built; the numpy versions give the same bytes
        peak_rss_mb=stats["peak_rss_mb"],
        wall_time_seconds=round(wall, 3),
        throughput={"tokens_per_second": round(stats["tokens_encoded"] / wall, 1),
                    "input_megabytes_per_second": round(plan.input_bytes / 1e6 / wall, 3),
                    "documents_per_second": round(stats["documents_read"] / wall, 1)},
    )

