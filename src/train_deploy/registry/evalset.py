"""The fixed evaluation set of a registered model, and the number the gate compares on it.

The set is a list of short texts, stored as JSON lines (``{"text": …}``) whose sha256 names it. It is made
once, by the first registration of a model, from the first validation documents of the token files (decoded
with the tokenizer they were encoded with) or from a configured JSONL file; every later candidate and champion
of that model is scored on the same bytes (``train_deploy.registry.gate`` compares them in nats per character).

No text of a set made from the validation split has a near-twin in the training split: the corpus stage leaves out
of validation the documents that near-duplicate training ones, and a cut text that a training document holds all
the same (its opening is another document's, say) is passed over here, with the corpus stage's own settings
(``corpus.cleaning.near_dedup_ngram`` and ``near_dedup_threshold``, as the token files record them). Each later
night, the corpus stage leaves out of the training split the documents that hold a text of the stored set.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from train_deploy.handoffs import TokenizerInfo, TokenManifest

# Where a sentence may end: Chinese and Western full stops, question and exclamation marks, semicolons, ellipsis.
SENTENCE_ENDS = "。！？；…!?;."
_BLOCK_TOKENS = 1 << 20
_TRAINING_BATCH = 512  # training documents decoded and compared with the candidate texts at once

logger = logging.getLogger(__name__)


class EvalSetError(ValueError):
    """The evaluation set cannot be built or read; the message names the file or the key."""


def cut(text: str, max_chars: int) -> str:
    """``text`` without surrounding blanks, cut to at most ``max_chars`` characters after the last sentence end
    within them (in the second half of the limit; else at the limit)."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    end = max(head.rfind(mark) for mark in SENTENCE_ENDS)
    return head[: end + 1] if end >= max_chars // 2 else head


def validation_texts(token_files: TokenManifest, tokenizer: TokenizerInfo, count: int, max_chars: int) -> list[str]:
    """The first ``count`` non-empty documents of the validation split, decoded and :func:`cut`, passing over a cut
    text that a training document holds (see the module's docstring)."""
    from train_deploy.corpus.tokenizer import TokenEncoder

    if tokenizer.hash != token_files.tokenizer.hash:
        raise EvalSetError(f"{tokenizer.path}: tokenizer {tokenizer.hash} is not the one the token files in "
                           f"{token_files.path} were encoded with ({token_files.tokenizer.hash})")
    encoder = TokenEncoder(tokenizer)
    candidates = (text for ids in _documents(Path(f"{token_files.prefix('valid')}.bin"), token_files.dtype,
                                             tokenizer.eos_id) if (text := cut(encoder.decode(ids), max_chars)))
    texts: list[str] = []
    passed_over = 0
    while len(texts) < count and (batch := list(itertools.islice(candidates, count - len(texts)))):
        held = _held_by_training(batch, token_files, encoder.decode, tokenizer.eos_id)
        texts += [text for text, twin in zip(batch, held, strict=True) if not twin]
        passed_over += int(held.sum())
    if passed_over:
        logger.info("Evaluation set: %d validation text(s) passed over, a training document holds each", passed_over)
    if not texts:
        raise EvalSetError(f"{token_files.prefix('valid')}.bin: no validation document to evaluate on; set "
                           "registry.eval_set.path or a larger corpus.encoding.validation_fraction")
    return texts


def _held_by_training(texts: list[str], token_files: TokenManifest, decode: Callable[[list[int]], str],
                      eos_id: int) -> np.ndarray:
    """One flag per text: a document of the training split holds it (``corpus.dedup.TextOverlap``, with the
    cleaning settings the token files were made with)."""
    from train_deploy.corpus.config import CleaningConfig
    from train_deploy.corpus.dedup import TextOverlap

    cleaning, default = token_files.config.get("cleaning", {}), CleaningConfig()
    overlap = TextOverlap(texts, int(cleaning.get("near_dedup_ngram", default.near_dedup_ngram)),
                          float(cleaning.get("near_dedup_threshold", default.near_dedup_threshold)))
    held = np.zeros(len(texts), dtype=bool)
    train = Path(f"{token_files.prefix('train')}.bin")
    if token_files.splits["train"].tokens == 0:
        return held
    documents = (decode(ids) for ids in _documents(train, token_files.dtype, eos_id))
    while batch := list(itertools.islice(documents, _TRAINING_BATCH)):
        held |= overlap.held(batch)
    return held


def jsonl_texts(path: str | Path, count: int, max_chars: int) -> list[str]:
    """The first ``count`` texts of a JSONL file of ``{"text": …}`` lines, :func:`cut`; errors name file and line."""
    path = Path(path)
    texts = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip() and (text := cut(_text_of(line, f"{path}:{number}"), max_chars)):
                    texts.append(text)
                    if len(texts) == count:
                        break
    except FileNotFoundError:
        raise EvalSetError(f"registry.eval_set.path: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalSetError(f"registry.eval_set.path: {path} is unreadable ({exc})") from None
    if not texts:
        raise EvalSetError(f"registry.eval_set.path: {path} holds no text")
    return texts


def to_jsonl(texts: Sequence[str]) -> bytes:
    """The stored form of a set: one ``{"text": …}`` line per text, UTF-8 (its sha256 names the set)."""
    return "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts).encode("utf-8")


def from_jsonl(data: bytes, where: str) -> list[str]:
    """The texts of a stored set; ``where`` names it in errors."""
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise EvalSetError(f"{where}: not UTF-8 ({exc})") from None
    return [_text_of(line, f"{where}:{number}") for number, line in enumerate(lines, 1) if line.strip()]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _text_of(line: str, where: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise EvalSetError(f"{where}: not JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise EvalSetError(f'{where}: expected {{"text": "…"}}, got {line.strip()[:80]}')
    return record["text"]


def _documents(path: Path, dtype: str, eos_id: int) -> Iterator[list[int]]:
    """Each document's ids (without its end-of-document id) from a token file, in file order."""
    if not path.is_file() or path.stat().st_size == 0:
        raise EvalSetError(f"{path}: {'missing' if not path.is_file() else 'holds no tokens'}; set "
                           "registry.eval_set.path or a larger corpus.encoding.validation_fraction")
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    pending: list[int] = []
    for first in range(0, len(tokens), _BLOCK_TOKENS):
        block = np.asarray(tokens[first : first + _BLOCK_TOKENS], dtype=np.int64)
        start = 0
        for end in np.flatnonzero(block == eos_id):
            yield pending + block[start:end].tolist()
            pending, start = [], int(end) + 1
        pending += block[start:].tolist()
    if pending:
        yield pending
