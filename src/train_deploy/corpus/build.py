"""Corpus → tokens, end to end: fingerprint, tokenizer sample, parallel encoding, merge, manifest.

Each worker reads, cleans, encodes and writes whole chunks of the input (Megatron's ``--partitions``
idea): no text or token lists travel between processes, only small per-chunk statistics. Shards are
merged in chunk order, so the output is byte-for-byte the same for any worker count.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from itertools import compress
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
from xxhash import xxh3_128_digest

from train_deploy import __version__
from train_deploy.atomic import scratch_folder
from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.dedup import SignatureWriter, near_duplicates
from train_deploy.corpus.filters import QualityFilter
from train_deploy.corpus.indexed import ShardWriter, document_sizes, merge_shards, token_dtype
from train_deploy.corpus.native import compiled
from train_deploy.corpus.readers import (
    Chunk,
    CorpusError,
    CorpusPlan,
    ReadStats,
    iter_document_batches,
)
from train_deploy.corpus.report import BINS, EXAMPLES, CorpusQuality, QualitySample, length_bins
from train_deploy.corpus.tokenizer import TokenEncoder
from train_deploy.handoffs import MANIFEST_FILE as MANIFEST
from train_deploy.handoffs import DocumentCounts, SplitInfo, TokenizerInfo, TokenManifest, write_json

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid")
_SAMPLE_BATCH = 64  # documents cleaned and filtered at once while sampling: little work past the budget
FORMAT = "paddlenlp-mmap-indexed-v1"


def tokenizer_fingerprint(config: CorpusConfig, plan: CorpusPlan) -> str:
    """Hash of everything a trained tokenizer depends on (or of the folder a loaded one comes from)."""
    t = config.tokenizer
    if t.mode == "load":
        return _digest({"load_path": str(Path(t.load_path).resolve())})
    relevant = {k: v for k, v in asdict(t).items() if k not in ("num_threads", "load_path")}
    return _digest({"input": plan.input_hash, "reader": asdict(config.reader), "cleaning": asdict(config.cleaning),
                    "tokenizer": relevant})


def corpus_fingerprint(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo) -> str:
    """Hash of the inputs, reading, cleaning, split and tokenizer: equal fingerprints, equal outputs."""
    e = config.encoding
    return _digest({"format": FORMAT, "version": __version__, "input": plan.input_hash, "reader": asdict(config.reader),
                    "cleaning": asdict(config.cleaning), "tokenizer": tokenizer.hash,
                    "split": {"validation_fraction": e.validation_fraction, "split_seed": e.split_seed}})


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
        return "give more text (or a shorter training.batch.seq_length)"
    value = f"{math.ceil(wanted * 100) / 100:g}"
    return f"set it to {value} (--params corpus.encoding.validation_fraction={value}) or give more text"


def encode_corpus(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, folder: Path) -> TokenManifest:
    """Encode the planned corpus into ``folder`` (empty): ``{train,valid}.{bin,idx}`` and ``manifest.json``."""
    if not plan.chunks:
        raise CorpusError(f"corpus is empty: nothing to read in {', '.join(plan.files) or 'the configured paths'}")
    started = time.perf_counter()
    work = scratch_folder(Path(folder), "shards")
    try:
        stats = _combine(_run_chunks(config, plan, tokenizer, work))
        near = near_duplicates([work / f"{c.index:06d}" for c in plan.chunks], config.cleaning) \
            if config.cleaning.near_dedup else None
        if stats["documents_kept"] == 0:
            raise CorpusError(f"corpus is empty: no document left after cleaning in {', '.join(plan.files)} "
                              f"(read {stats['documents_read']}, dropped {dict(stats['dropped'])})")
        if near is not None:
            _near_duplicate_examples(work, plan, tokenizer, near, stats["quality"])
        splits = _merge(config, plan, tokenizer, work, Path(folder), stats, near)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - started
    manifest = _manifest(config, plan, tokenizer, stats, splits, wall)
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


# --- workers ---------------------------------------------------------------------------------------


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


@dataclass(slots=True)
class _Worker:
    config: CorpusConfig
    encoder: TokenEncoder
    cleaner: Cleaner
    quality: QualityFilter
    work: Path
    dtype: np.dtype
    progress: tuple[Any, Any] | None
    cursor: Any
    """Shared index of the next unclaimed chunk."""
    claimed: Any
    """Shared array: the chunk each process is encoding (this process in slot 0), -1 between chunks."""
    slot: int
    watch: Callable[[], None] | None
    """In the parent: raises if a helper failed or died; called between batches."""


_WORKER: _Worker | None = None


def _init_worker(config: CorpusConfig, tokenizer: TokenizerInfo, work: Path, progress, cursor, claimed,
                 slot: int = 0, watch: Callable[[], None] | None = None) -> None:
    global _WORKER
    _WORKER = _Worker(config, TokenEncoder(tokenizer), Cleaner(config.cleaning), QualityFilter(config.cleaning), work,
                      token_dtype(tokenizer.vocab_size), progress, cursor, claimed, slot, watch)


def _encode_chunk(chunk: Chunk, work: Path | None = None) -> ChunkResult:
    """Read, clean, hash, split, encode and write one chunk (into ``work``, else the worker's folder); return its
    statistics."""
    w = _WORKER
    assert w is not None, "worker not initialised"
    work = w.work if work is None else work
    result = ChunkResult(chunk.index)
    writers = {s: ShardWriter(work / f"{chunk.index:06d}.{s}", w.dtype) for s in SPLITS}
    near_dedup = w.config.cleaning.near_dedup
    signatures = SignatureWriter(work / f"{chunk.index:06d}", w.config.cleaning) if near_dedup else None
    for batch in iter_document_batches(chunk, w.config.reader, result.read, w.config.encoding.batch_documents):
        if w.watch is not None:
            w.watch()
        _encode_batch(w, batch, writers, signatures, result)
    for writer in [*writers.values(), *([signatures] if signatures else [])]:
        writer.close()
    return result


def _encode_batch(w: _Worker, raw: list[str], writers: dict[str, ShardWriter], signatures: SignatureWriter | None,
                  result: ChunkResult) -> None:
    """Clean a batch of documents, drop short ones, split them by hash, encode and append them."""
    if not raw:
        return
    result.documents_read += len(raw)
    cleaned = w.cleaner.clean_batch(raw)
    reasons = w.quality.reasons(cleaned)
    result.dropped.update(filter(None, reasons))
    result.sample.add(cleaned, reasons)
    texts = [text for text, reason in zip(cleaned, reasons, strict=True) if reason is None]
    if not texts:
        return
    # One seeded 128-bit hash per document: its first 8 bytes identify it (de-duplication), the last 8 pick
    # its split.
    seed = w.config.encoding.split_seed % 2**64
    digests = b"".join([xxh3_128_digest(text.encode("utf-8"), seed) for text in texts])
    halves = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)
    valid = halves[:, 1] < np.uint64(int(w.config.encoding.validation_fraction * 2**64))
    if signatures is not None:
        signatures.add(texts, halves[:, 0], valid)
    for split, members in (("train", ~valid), ("valid", valid)):
        if not members.any():
            continue
        tokens, sizes = w.encoder.encode_batch(list(compress(texts, members)), w.dtype)
        writers[split].add(tokens, sizes, halves[members, 0])
        result.tokens_encoded += len(tokens)
        if w.progress is not None:
            _bump(w.progress, len(sizes), len(tokens))


def _bump(progress: tuple[Any, Any], documents: int, tokens: int) -> None:
    docs_counter, tokens_counter = progress
    with docs_counter.get_lock():
        docs_counter.value += documents
    with tokens_counter.get_lock():
        tokens_counter.value += tokens


def _run_chunks(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path) -> list[ChunkResult]:
    """Encode every chunk into shards in ``work`` with the configured executor; return their statistics."""
    if config.encoding.executor == "ray":
        from train_deploy.corpus.ray_executor import run_on_ray  # imports Ray (~1 s) only when asked for

        return run_on_ray(config, plan, tokenizer, work)
    return _run_workers(config, plan, tokenizer, work)


def _run_workers(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path) -> list[ChunkResult]:
    """Encode every chunk with ``workers`` processes: this one and ``workers - 1`` spawned helpers.

    All of them take the next unclaimed chunk from a shared cursor, so the load balances itself and
    this process starts encoding at once while the helpers are still starting up. A helper's error is
    raised here; a helper that dies (the OOM killer) fails the stage within a batch, naming its chunk.
    """
    workers = min(config.workers, len(plan.chunks))
    ctx = mp.get_context("spawn")  # no fork: the parent may hold MLflow threads and Paddle state
    progress = (ctx.Value("q", 0), ctx.Value("q", 0))
    cursor = ctx.Value("q", 0)
    claimed = ctx.Array("q", [-1] * workers, lock=False)
    init_args = (config, tokenizer, work, progress, cursor, claimed)
    helpers = _Helpers(ctx, workers - 1, init_args, plan.chunks)  # first: their start-up overlaps this one's
    try:
        _init_worker(*init_args, watch=helpers.check)
        bar = _ProgressBar(config.encoding.progress)
        results = _drain(plan.chunks, lambda: bar.update(progress))
        results += helpers.wait(lambda: bar.update(progress))
    finally:
        helpers.stop()
    bar.close(progress)
    return results


class _Helpers:
    """The spawned helper processes, watched through their result pipes and exit status (not a ``Pool``: a
    pool replaces a worker that dies and waits forever for the chunks it held)."""

    def __init__(self, ctx: Any, count: int, init_args: tuple, chunks: list[Chunk]) -> None:
        self._chunks, self._claimed = chunks, init_args[-1]
        self._processes: list[Any] = []
        self._pending: dict[int, tuple[Any, Connection]] = {}
        """Slot → (process, receiving end of its pipe), until it has sent its statistics."""
        self._results: list[ChunkResult] = []
        with _main_module_hidden():
            for slot in range(1, count + 1):
                receiver, sender = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_help, args=(slot, init_args, chunks, sender, os.getpid()),
                                      name=f"corpus-helper-{slot}", daemon=True)
                process.start()
                sender.close()  # the helper holds the only writing end: its death reads as end of file
                self._processes.append(process)
                self._pending[slot] = (process, receiver)

    def check(self) -> None:
        """Take the statistics of helpers that finished; raise a helper's error, or its death. A few µs."""
        for slot, (process, receiver) in list(self._pending.items()):
            if receiver.poll() or process.exitcode is not None:
                self._receive(slot)

    def wait(self, tick: Callable[[], None]) -> list[ChunkResult]:
        """Wait for every helper's statistics (``tick`` twice a second); raise as :meth:`check` does."""
        while self._pending:
            wait([w for process, receiver in self._pending.values() for w in (receiver, process.sentinel)], 0.5)
            tick()
            self.check()
        return self._results

    def stop(self) -> None:
        """End every helper still running (after an error, the others' work is of no use)."""
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()
        for process in self._processes:
            process.join(5)
            if process.exitcode is None:
                process.kill()
                process.join()
        for _, receiver in self._pending.values():
            receiver.close()

    def _receive(self, slot: int) -> None:
        process, receiver = self._pending.pop(slot)
        try:
            results, error = receiver.recv()
        except (EOFError, OSError):  # it died before it could send anything, or while sending
            raise self._death(slot, process) from None
        finally:
            receiver.close()
        if error is not None:
            raise error  # the helper's own exception: a CorpusError keeps its one-line message
        self._results += results

    def _death(self, slot: int, process: Any) -> CorpusError:
        process.join(5)  # the end of file can arrive a moment before the exit status
        code = process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
        position = self._claimed[slot]
        where = "while holding no chunk" if position < 0 else f"while encoding {chunk_place(self._chunks[position])}"
        return CorpusError(f"corpus helper {process.pid} died ({how}) {where}; nothing was published")


def chunk_place(chunk: Chunk) -> str:
    """Where a chunk is, for messages: ``chunk 3 of /data/a.txt (bytes 0..1048576)``."""
    span = "the whole compressed file" if chunk.compressed else f"bytes {chunk.start}..{chunk.end}"
    return f"chunk {chunk.index} of {chunk.path} ({span})"


def _help(slot: int, init_args: tuple, chunks: list[Chunk], sender: Connection, parent: int) -> None:
    """A helper process: encode chunks until none is left, then send the parent their statistics or the error."""
    try:
        _init_worker(*init_args, slot=slot)
        sender.send((_drain(chunks, lambda: _exit_if_orphaned(parent)), None))
    except Exception as exc:
        exc.add_note(f"in corpus helper {os.getpid()}:\n{''.join(traceback.format_exception(exc))}")
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        sender.send((None, exc))


def _exit_if_orphaned(parent: int) -> None:
    """A helper whose parent was killed stops instead of encoding into a folder nobody will publish."""
    if os.getppid() != parent:
        raise SystemExit(f"corpus helper {os.getpid()}: parent {parent} is gone")


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawned helpers normally import the parent's main module first: under ``kedro run`` that is the Kedro
    CLI (~0.35 s of imports before a helper can take a chunk). They only run this module's functions, so
    the main module's path and spec are hidden from ``multiprocessing`` while the helpers start."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def _drain(chunks: list[Chunk], between_chunks=None) -> list[ChunkResult]:
    """Encode chunks until none is left unclaimed."""
    w = _WORKER
    assert w is not None, "worker not initialised"
    results = []
    while True:
        with w.cursor.get_lock():
            index = w.cursor.value
            w.cursor.value += 1
            if index < len(chunks):
                w.claimed[w.slot] = index
        if index >= len(chunks):
            return results
        result = _encode_chunk(chunks[index])
        w.claimed[w.slot] = -1
        result.process, result.peak_rss_mb = os.getpid(), peak_rss_mb()
        results.append(result)
        if between_chunks is not None:
            between_chunks()


class _ProgressBar:
    def __init__(self, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc="encoding", unit=" docs", dynamic_ncols=True, mininterval=0.5,
                             disable=None)  # no bar (carriage returns) when the console is a file or a pipe
        self._started = time.perf_counter()

    def update(self, progress: tuple[Any, Any]) -> None:
        if self._bar is None:
            return
        documents, tokens = progress[0].value, progress[1].value
        self._bar.update(documents - self._bar.n)
        rate = tokens / max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(f"{tokens / 1e6:.1f} M tokens, {rate / 1e6:.2f} M tokens/s", refresh=False)

    def close(self, progress: tuple[Any, Any]) -> None:
        self.update(progress)
        if self._bar is not None:
            self._bar.close()


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


def _merge(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path, folder: Path,
           stats: dict[str, Any], near: dict[str, list[np.ndarray]] | None) -> dict[str, SplitInfo]:
    """Merge the chunks' shards in chunk order into ``folder/<split>.{bin,idx}``, leaving out duplicates and the
    ``near`` duplicates (per split, a mask per chunk)."""
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {}
    for split in SPLITS:
        seen: set[int] | None = set() if config.cleaning.deduplicate else None
        prefixes = [work / f"{c.index:06d}.{split}" for c in plan.chunks]
        drops = near[split] if near is not None else None
        documents, tokens, duplicates = merge_shards(prefixes, folder / split, dtype, seen, drops)
        stats["dropped"]["duplicate"] += duplicates
        if drops is not None:
            stats["dropped"]["near_duplicate"] += sum(int(d.sum()) for d in drops)
        splits[split] = SplitInfo(prefix=split, documents=documents, tokens=tokens,
                                  bin_bytes=(folder / f"{split}.bin").stat().st_size,
                                  idx_bytes=(folder / f"{split}.idx").stat().st_size)
    stats["documents_kept"] -= stats["dropped"]["duplicate"] + stats["dropped"]["near_duplicate"]
    return splits


def _near_duplicate_examples(work: Path, plan: CorpusPlan, tokenizer: TokenizerInfo, near: dict[str, list[np.ndarray]],
                             sample: QualitySample) -> None:
    """Add the first near-duplicates (training split first, then validation) to the report, decoded from their
    shards: their text is not kept anywhere else."""
    encoder, dtype = TokenEncoder(tokenizer), token_dtype(tokenizer.vocab_size)
    for split in SPLITS:
        for chunk, drop in zip(plan.chunks, near[split], strict=True):
            if not drop.any():
                continue
            prefix = work / f"{chunk.index:06d}.{split}"
            ends = np.cumsum(np.fromfile(f"{prefix}.sizes", dtype=np.int32), dtype=np.int64)
            tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
            for i in np.flatnonzero(drop)[:EXAMPLES].tolist():
                start = ends[i - 1] if i else 0
                sample.example("near_duplicate", encoder.decode(tokens[start : ends[i] - 1].tolist()))
            del tokens
            if len(sample.examples["near_duplicate"]) >= EXAMPLES:
                return


def _manifest(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, stats: dict[str, Any],
              splits: dict[str, SplitInfo], wall: float) -> TokenManifest:
    return TokenManifest(
        format=FORMAT,
        fingerprint=corpus_fingerprint(config, plan, tokenizer),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        dtype=token_dtype(tokenizer.vocab_size).name,
        tokenizer=replace(tokenizer, path="", reused=False),  # what it is, not where this machine keeps it
        splits=splits,
        documents=DocumentCounts(read=stats["documents_read"], kept=stats["documents_kept"],
                                 dropped=dict(stats["dropped"]), skipped_bad_input=dict(stats["skipped"])),
        tokens={"total": sum(s.tokens for s in splits.values()), "encoded_before_dedup": stats["tokens_encoded"]},
        input={"source": config.reader.source, "files": plan.files, "content_hash": plan.input_hash,
               "bytes": plan.input_bytes, "chunks": len(plan.chunks), "skipped_files": plan.skipped_files},
        config={"reader": asdict(config.reader), "cleaning": asdict(config.cleaning),
                "encoding": asdict(config.encoding)},
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


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()
