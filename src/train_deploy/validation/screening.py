"""Dropping what the champion finds far outside the corpus's distribution (``validation.screening: drop``).

Every document of the training split is scored by the champion as the data gate scores its sample
(:func:`~train_deploy.validation.content.score_sample`: cut to :data:`~train_deploy.validation.content.TEXT_CHARS`
characters, then to its context, in batches), and those above ``limit`` nats per character are left out of a copy
of the token files: a new training split (PaddleNLP's ``.bin/.idx``, written by the corpus stage's own merge), the
validation split and the other files hard-linked (copied across file systems). The validation split is not screened:
training's validation loss, averaging and export keep scoring the same held-out text, which still shows what the
night was. The copy has its own fingerprint (the source's and the documents dropped): equal fingerprints, equal
bytes, so a training run resumes only on the same screened documents.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train_deploy.atomic import atomic_folder
from train_deploy.corpus.indexed import document_sizes, merge_shards
from train_deploy.handoffs import MANIFEST_FILE, DescriptionError, TokenizerInfo, TokenManifest, write_json
from train_deploy.hashing import digest
from train_deploy.registry.evalset import cut
from train_deploy.validation.content import TEXT_CHARS, score_sample

logger = logging.getLogger(__name__)

BATCH_DOCUMENTS = 1024
"""Documents decoded and scored at a time (the model batches them further)."""
REASON = "screening"
"""The drop reason the screened manifest counts its dropped documents under."""


class ScreeningError(ValueError):
    """Dropping would leave the training split too small to train on; the message names ``validation.screening``."""


@dataclass(frozen=True, slots=True)
class Dropped:
    """What ``validation.screening: drop`` did to tonight's training split (the report's ``dropped``)."""

    scored: int
    """Training documents the champion scored (an empty one is kept unscored)."""
    dropped: int
    """Documents above ``limit``, left out of the token files training reads."""
    share: float
    """``dropped / scored`` (0 with nothing scored)."""
    limit: float
    """Nats per character above which a document is dropped (``validation.max_document_nats_factor`` times the
    champion's own figure)."""
    seconds: float
    """Wall time of scoring and writing."""

    def line(self) -> str:
        return (f"screening: dropped {self.dropped} of {self.scored} training documents ({self.share:.1%}) above "
                f"{self.limit:.3g} nats/char (validation.screening: drop) in {self.seconds:.1f} s")


def document_scores(model, manifest: TokenManifest, tokenizer: TokenizerInfo, split: str = "train") -> np.ndarray:
    """Each document of ``split`` as ``model`` (a ``LanguageModel``) scores it, in nats per character of its first
    :data:`~train_deploy.validation.content.TEXT_CHARS` characters (NaN: nothing to score)."""
    from train_deploy.corpus.tokenizer import TokenEncoder

    prefix = manifest.prefix(split)
    sizes = document_sizes(prefix.parent / f"{prefix.name}.idx").astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    tokens = np.memmap(prefix.parent / f"{prefix.name}.bin", dtype=np.dtype(manifest.dtype), mode="r")
    decode, scores = TokenEncoder(tokenizer).decode, np.full(len(sizes), np.nan)
    for first in range(0, len(sizes), BATCH_DOCUMENTS):
        texts = {}
        for i in range(first, min(first + BATCH_DOCUMENTS, len(sizes))):
            ids = np.asarray(tokens[starts[i] : starts[i] + sizes[i]]).tolist()
            if text := cut(decode([t for t in ids if t != tokenizer.eos_id]), TEXT_CHARS):
                texts[i] = text
        scored = score_sample(model, list(texts.values()))  # a non-empty text stays one: the same order
        scores[list(texts)] = scored.per_text()
    del tokens
    return scores


def drop_documents(manifest: TokenManifest, scores: np.ndarray, limit: float, folder: Path, window: int,
                   seconds_so_far: float = 0.0) -> tuple[TokenManifest, Dropped]:
    """The token files of ``manifest`` without the training documents scored above ``limit``, published in
    ``folder/<fingerprint>`` (kept when already there), and what was dropped. Raises :class:`ScreeningError` when
    the training split left would hold fewer than ``window`` tokens (one window of training's sequence)."""
    started = time.perf_counter()
    drop = np.nan_to_num(scores, nan=-np.inf) > limit
    scored = int(np.isfinite(scores).sum())
    train = manifest.splits["train"]
    prefix = manifest.prefix("train")
    sizes = document_sizes(prefix.parent / f"{prefix.name}.idx")
    left = int(sizes[~drop].sum(dtype=np.int64))
    if left < window:
        raise ScreeningError(f"validation.screening: drop would leave {int((~drop).sum())} training documents "
                             f"({left} tokens), fewer than one window of training.batch.seq_length + 1 = {window}; "
                             "set validation.screening: report or a larger validation.max_document_nats_factor")
    fingerprint = digest({"source": manifest.fingerprint, "dropped": np.flatnonzero(drop).tolist()})
    final = Path(folder) / fingerprint
    screened = _published(final, fingerprint)
    if screened is None:
        with atomic_folder(final, "the screened token files") as staging:
            _write(manifest, drop, sizes, staging, fingerprint)
        screened = TokenManifest.read_folder(final)
    _remove_others(Path(folder), final)
    dropped = Dropped(scored, int(drop.sum()), int(drop.sum()) / scored if scored else 0.0, limit,
                      round(seconds_so_far + time.perf_counter() - started, 3))
    logger.info("%s; %d training documents left of %d", dropped.line(), screened.splits["train"].documents,
                train.documents)
    return screened, dropped


def _write(manifest: TokenManifest, drop: np.ndarray, sizes: np.ndarray, staging: Path, fingerprint: str) -> None:
    """Fill ``staging``: the training split without ``drop``, everything else linked, the manifest updated."""
    source, train = Path(manifest.path), manifest.splits["train"]
    for file in source.iterdir():
        if file.is_file() and file.name not in (f"{train.prefix}.bin", f"{train.prefix}.idx", MANIFEST_FILE):
            _link(file, staging / file.name)
    work = staging / ".source"  # merge_shards reads <prefix>.bin/.sizes/.hash: the source's bin, its sizes
    work.mkdir()
    os.symlink(source / f"{train.prefix}.bin", work / "train.bin")
    sizes.tofile(work / "train.sizes")
    np.zeros(len(sizes), dtype=np.uint64).tofile(work / "train.hash")
    documents, tokens, _ = merge_shards([work / "train"], staging / train.prefix, np.dtype(manifest.dtype), None,
                                        [drop])
    shutil.rmtree(work)
    split = dataclasses.replace(train, documents=documents, tokens=tokens,
                                bin_bytes=(staging / f"{train.prefix}.bin").stat().st_size,
                                idx_bytes=(staging / f"{train.prefix}.idx").stat().st_size)
    counts = manifest.documents
    dropped = int(drop.sum())
    counts = dataclasses.replace(counts, kept=counts.kept - dropped,
                                 dropped={**counts.dropped, REASON: counts.dropped.get(REASON, 0) + dropped})
    write_json(staging / MANIFEST_FILE, dataclasses.replace(
        manifest, fingerprint=fingerprint, splits={**manifest.splits, "train": split}, documents=counts,
        tokens={**manifest.tokens, "total": manifest.tokens["total"] - (train.tokens - tokens)},
        warnings=[*manifest.warnings, f"{dropped} training documents dropped by the data gate's screening "
                                      f"(corpus {manifest.fingerprint})"]))


def _published(final: Path, fingerprint: str) -> TokenManifest | None:
    """The screened token files already at ``final`` (a rerun on the same documents), else None."""
    try:
        found = TokenManifest.read_folder(final)
    except DescriptionError:
        return None
    return found if found.fingerprint == fingerprint else None


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def _remove_others(folder: Path, current: Path) -> None:
    """One screened copy at a time: a later night screens its own token files again."""
    for other in folder.iterdir():
        if other != current and other.is_dir() and not other.name.startswith("."):
            shutil.rmtree(other, ignore_errors=True)
