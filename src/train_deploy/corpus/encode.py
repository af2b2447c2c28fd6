"""The per-chunk kernel: read, clean, hash, split, encode and write one chunk's shards, in whichever process runs it.

A :class:`ChunkEncoder` is one process's state (the tokenizer's encoder, the cleaner, the quality filter), made once
per process by the executor that runs it (``train_deploy.corpus.executors``); :meth:`ChunkEncoder.encode` turns a
planned chunk into ``<index>.{train,valid}`` shards (and near-duplicate signatures) and returns the chunk's small
statistics. No text or token list leaves the process: the orchestration (``train_deploy.corpus.build``) merges
the shards in chunk order, so the output is the same bytes whichever executor and worker count ran the chunks.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path

import numpy as np
from xxhash import xxh3_128_digest

from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.dedup import SignatureWriter
from train_deploy.corpus.filters import QualityFilter
from train_deploy.corpus.indexed import ShardWriter, token_dtype
from train_deploy.corpus.readers import Chunk, ReadStats, iter_document_batches
from train_deploy.corpus.report import QualitySample
from train_deploy.corpus.tokenizer import TokenEncoder
from train_deploy.handoffs import TokenizerInfo

SPLITS = ("train", "valid")


@dataclass(slots=True)
class ChunkResult:
    """Per-chunk statistics sent back to the parent (the tokens stay on disk)."""

    index: int
    documents_read: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    read: ReadStats = field(default_factory=ReadStats)
    tokens_encoded: int = 0
    sample: QualitySample = field(default_factory=QualitySample)
    """Length histograms and the first documents of each outcome, for the corpus report."""
    process: int = 0
    """Process id of the worker that encoded the chunk."""
    peak_rss_mb: float = 0.0
    """That worker's peak resident memory so far."""

    def stamp(self) -> ChunkResult:
        """This result with the process that encoded it and that process's peak memory so far."""
        self.process, self.peak_rss_mb = os.getpid(), peak_rss_mb()
        return self


class ChunkEncoder:
    """One process's encoding state for ``config`` and ``tokenizer``; set up once, then one chunk at a time.

    ``progress(documents, tokens)`` is called after each split of each batch is written (the executors' progress
    bar); ``watch()`` before each batch (the local executor's parent: raises if a helper failed or died)."""

    def __init__(self, config: CorpusConfig, tokenizer: TokenizerInfo, *,
                 progress: Callable[[int, int], None] | None = None, watch: Callable[[], None] | None = None) -> None:
        self.config = config
        self._encoder = TokenEncoder(tokenizer)
        self._cleaner, self._quality = Cleaner(config.cleaning), QualityFilter(config.cleaning)
        self._dtype = token_dtype(tokenizer.vocab_size)
        self._progress, self._watch = progress, watch

    def encode(self, chunk: Chunk, work: Path) -> ChunkResult:
        """Read, clean, hash, split, encode and write one chunk into ``work``; return its statistics."""
        result = ChunkResult(chunk.index)
        writers = {s: ShardWriter(work / f"{chunk.index:06d}.{s}", self._dtype) for s in SPLITS}
        near_dedup = self.config.cleaning.near_dedup
        signatures = SignatureWriter(work / f"{chunk.index:06d}", self.config.cleaning) if near_dedup else None
        for batch in iter_document_batches(chunk, self.config.reader, result.read,
                                           self.config.encoding.batch_documents):
            if self._watch is not None:
                self._watch()
            self._encode_batch(batch, writers, signatures, result)
        for writer in [*writers.values(), *([signatures] if signatures else [])]:
            writer.close()
        return result

    def _encode_batch(self, raw: list[str], writers: dict[str, ShardWriter], signatures: SignatureWriter | None,
                      result: ChunkResult) -> None:
        """Clean a batch of documents, drop short ones, split them by hash, encode and append them."""
        if not raw:
            return
        result.documents_read += len(raw)
        cleaned = self._cleaner.clean_batch(raw)
        reasons = self._quality.reasons(cleaned)
        result.dropped.update(filter(None, reasons))
        result.sample.add(cleaned, reasons)
        texts = [text for text, reason in zip(cleaned, reasons, strict=True) if reason is None]
        if not texts:
            return
        # One seeded 128-bit hash per document: its first 8 bytes identify it (de-duplication), the last 8 pick
        # its split.
        encoding = self.config.encoding
        seed = encoding.split_seed % 2**64
        digests = b"".join([xxh3_128_digest(text.encode("utf-8"), seed) for text in texts])
        halves = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)
        valid = halves[:, 1] < np.uint64(int(encoding.validation_fraction * 2**64))
        if signatures is not None:
            signatures.add(texts, halves[:, 0], valid)
        for split, members in (("train", ~valid), ("valid", valid)):
            if not members.any():
                continue
            tokens, sizes = self._encoder.encode_batch(list(compress(texts, members)), self._dtype)
            writers[split].add(tokens, sizes, halves[members, 0])
            result.tokens_encoded += len(tokens)
            if self._progress is not None:
                self._progress(len(sizes), len(tokens))


def chunk_place(chunk: Chunk) -> str:
    """Where a chunk is, for messages: ``chunk 3 of /data/a.txt (bytes 0..1048576)``."""
    span = "the whole compressed file" if chunk.compressed else f"bytes {chunk.start}..{chunk.end}"
    return f"chunk {chunk.index} of {chunk.path} ({span})"


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
