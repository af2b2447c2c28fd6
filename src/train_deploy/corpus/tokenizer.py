"""Tokenizer: train SentencePiece on a corpus sample, or load a PaddleNLP tokenizer; encode fast.

The saved folder is PaddleNLP's ``LlamaTokenizer`` layout (``sentencepiece.bpe.model`` plus
``tokenizer_config.json``), so ``AutoTokenizer.from_pretrained(folder)`` loads it for training and
export. Encoding calls the raw SentencePiece processor, which gives the same ids about ten times
faster than the PaddleNLP wrapper, one text at a time in the calling thread (see ``encode_batch``).

A trained tokenizer carries the corpus's normalisation policy (``corpus.cleaning.normalization``) in its
SentencePiece model: the policy as SentencePiece normalisation rules (:func:`normalization_rules`, compiled
into the model's ``precompiled_charsmap``), so every user of the model, ``AutoTokenizer.from_pretrained``
included, folds new text as the corpus was folded; and the policy's name as the normaliser's name
(``train_deploy:zh``), which :func:`recorded_normalization` reads back. Tokenizers trained before the record,
and tokenizers loaded from elsewhere, have none: they tokenize text as given, as they always did.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import sys
import tempfile
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from train_deploy.corpus.cleaning import Normalization, normalize
from train_deploy.corpus.config import TokenizerConfig
from train_deploy.corpus.native import flatten_ids
from train_deploy.handoffs import TOKENIZER_FILE as INFO_FILE
from train_deploy.handoffs import TokenizerInfo, write_json
from train_deploy.hashing import hash_folder

logger = logging.getLogger(__name__)

SP_MODEL_FILE = "sentencepiece.bpe.model"  # LlamaTokenizer.resource_files_names["vocab_file"]
_PROBE = "迈向充满希望的新世纪 ——1998年新年讲话 Hello, world!\n第二段。"
_RECORD = "train_deploy:"  # the SentencePiece normaliser's name in a tokenizer that records its policy


def tokenizer_is_current(info: TokenizerInfo, fingerprint: str) -> bool:
    """True if the saved tokenizer ``info`` was built from ``fingerprint`` and its files are intact."""
    return info.fingerprint == fingerprint and info.hash == tokenizer_hash(Path(info.path))


def train_tokenizer(sentences: Iterable[str], config: TokenizerConfig, folder: Path, fingerprint: str, *,
                    normalization: Normalization) -> TokenizerInfo:
    """Train SentencePiece on ``sentences`` (cleaned under ``normalization``) and save it, PaddleNLP-loadable and
    applying ``normalization`` to new text, into the empty ``folder``.

    The vocabulary is fitted to the corpus both ways, with a warning naming the value used: down to the pieces a
    small corpus has, and up to the characters ``character_coverage`` must cover when ``vocab_size`` is smaller.
    The sample is held in memory (SentencePiece holds it too) so that it can be trained on again."""
    model = io.BytesIO()
    sample = list(sentences)
    with tempfile.TemporaryDirectory(prefix="train_deploy-rules-") as work:
        rules = Path(work) / "rules.tsv"
        if normalization != "none":
            rules.write_text("".join(f"{_hex(source)}\t{_hex(target)}\n"
                                     for source, target in normalization_rules(normalization)), encoding="utf-8")
        requested = _train_sentencepiece(sample, config, model, rules if normalization != "none" else None)
    sp_file = folder / SP_MODEL_FILE
    sp_file.write_bytes(_recorded(model.getvalue(), normalization))
    vocab_size = _fitted_vocab_size(model.getvalue(), requested)
    _save_llama_tokenizer(sp_file, folder)
    info = TokenizerInfo(path=str(folder), vocab_size=vocab_size, eos_id=2, hash=tokenizer_hash(folder),
                         encoder="sentencepiece", fingerprint=fingerprint, source="trained")
    write_json(folder / INFO_FILE, info)
    logger.info("Trained a %s SentencePiece tokenizer (%d pieces, normalisation %s) on %d sentences",
                config.model_type, vocab_size, normalization, len(sample))
    return info


def _fitted_vocab_size(model: bytes, requested: int) -> int:
    """The trained model's vocabulary size, with a warning when the corpus could not fill ``requested`` ids."""
    import sentencepiece as spm

    trained = spm.SentencePieceProcessor(model_proto=model).get_piece_size()
    if trained < requested:
        logger.warning("corpus.tokenizer.vocab_size: this corpus has pieces for %d ids, not %d; the tokenizer (and "
                       "the model's vocabulary) has %d (set corpus.tokenizer.vocab_size: %d to silence this, or "
                       "give a larger corpus)", trained, requested, trained, trained)
    return trained


# SentencePiece's refusal of a vocabulary smaller than the characters it must cover (with its meta pieces: unk,
# bos, eos, the user symbols and, with byte_fallback, the 256 byte pieces).
_TOO_FEW_IDS = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)\.")
_MAX_VOCAB = 1_000_000  # corpus.config's limit of vocab_size


def _train_sentencepiece(sample: list[str], config: TokenizerConfig, model: io.BytesIO, rules: Path | None) -> int:
    """Train into ``model`` with ``config.vocab_size`` ids, or with as many as the corpus's characters need when
    that is fewer (with a warning naming the keys); return the vocabulary size trained with."""
    if not sample:
        raise _corpus_error("corpus is empty: no document left after cleaning to train the tokenizer on")
    try:
        _sentencepiece(sample, config, config.vocab_size, model, rules)
        return config.vocab_size
    except RuntimeError as exc:
        too_few = _TOO_FEW_IDS.search(str(exc))
        if too_few is None or not config.vocab_size < int(too_few[2]) <= _MAX_VOCAB:
            raise _training_failed(exc, len(sample)) from None
        needed = int(too_few[2])
    logger.warning("corpus.tokenizer.vocab_size: %d ids cannot hold the %d characters and special pieces this corpus "
                   "needs at corpus.tokenizer.character_coverage %g; the tokenizer (and the model's vocabulary) has "
                   "%d (set corpus.tokenizer.vocab_size: %d or more to silence this, or lower "
                   "corpus.tokenizer.character_coverage)", config.vocab_size, needed, config.character_coverage,
                   needed, needed)
    model.seek(0)
    model.truncate()
    try:
        _sentencepiece(sample, config, needed, model, rules)
    except RuntimeError as exc:
        raise _training_failed(exc, len(sample)) from None
    return needed


def _training_failed(exc: RuntimeError, sentences: int) -> Exception:
    """SentencePiece's reason in one line, its flags (``--character_coverage``) named as the project's keys."""
    reason = str(exc).strip().splitlines()[0].split("] ", 1)[-1].strip()  # drop its source location and assertion
    keys = set(TokenizerConfig.__dataclass_fields__)
    reason = re.sub(r"--(\w+)( option)?", lambda m: f"corpus.tokenizer.{m[1]}" if m[1] in keys else m[0], reason)
    return _corpus_error(f"SentencePiece training failed on {sentences} sentences (corpus.tokenizer): {reason}")


def _sentencepiece(sample: list[str], config: TokenizerConfig, vocab_size: int, model: io.BytesIO,
                   rules: Path | None) -> None:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=config.model_type,
        character_coverage=config.character_coverage,
        byte_fallback=config.byte_fallback,
        add_dummy_prefix=config.add_dummy_prefix,
        # The sample is already normalised and whitespace-cleaned by the cleaning step; the policy's rules
        # leave it as it is (decode(encode(doc)) == doc) and fold new text the same way.
        **({"normalization_rule_tsv": str(rules)} if rules else {"normalization_rule_name": "identity"}),
        remove_extra_whitespaces=False,
        user_defined_symbols=["\n"],  # paragraph breaks inside documents: one token, not a byte
        # The space symbol must be a piece even when the sample has almost no spaces; a byte-encoded
        # "▁" would decode as "▁", not as a space.
        required_chars="▁",
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        # A small corpus has fewer pieces than vocab_size asks for: train as many as it has (a warning says
        # how many) rather than fail; the tokenizer records the size it has.
        hard_vocab_limit=False,
        max_sentence_length=config.max_sentence_chars * 4,
        input_sentence_size=0,
        num_threads=config.num_threads or os.cpu_count() or 1,
        minloglevel=2,
    )


def normalization_rules(policy: Normalization) -> list[tuple[str, str]]:
    """SentencePiece rules (source → target, longest source first wins) for ``policy`` (``zh`` or ``nfkc``):
    every character that :func:`~train_deploy.corpus.cleaning.normalize` changes on its own, and every
    canonical pair it composes (``e`` + U+0301 → ``é``). Context beyond pairs (a mark after two others,
    Hangul jamo) is left to the cleaning; text the cleaning wrote is never changed by these rules."""
    rules: dict[str, str] = {}
    for cp in range(sys.maxunicode + 1):
        char = chr(cp)
        if 0xD800 <= cp < 0xE000 or unicodedata.is_normalized("NFKC", char):
            continue
        if (target := normalize(char, policy)) != char:
            rules[char] = target
    for cp in range(sys.maxunicode + 1):
        parts = unicodedata.decomposition(chr(cp)).split()
        if len(parts) == 2 and not parts[0].startswith("<"):  # a canonical pair
            pair = "".join(chr(int(part, 16)) for part in parts)
            target = normalize(pair, policy)
            if target != "".join(rules.get(char, char) for char in pair):
                rules[pair] = target
    return sorted(rules.items())


def recorded_normalization(sp_file: Path) -> Normalization | None:
    """The normalisation policy a SentencePiece model records, or None (trained before the record, or elsewhere)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(sp_file).read_bytes())
    name = proto.normalizer_spec.name
    return name.removeprefix(_RECORD) if name.startswith(_RECORD) else None  # type: ignore[return-value]


def _recorded(model: bytes, policy: Normalization) -> bytes:
    """The trained model with the policy as its normaliser's name, and without the temporary rule file's path."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    proto.normalizer_spec.name = _RECORD + policy
    proto.normalizer_spec.ClearField("normalization_rule_tsv")
    return proto.SerializeToString()


def _hex(text: str) -> str:
    return " ".join(f"{ord(char):X}" for char in text)


def load_tokenizer(source: Path, folder: Path, fingerprint: str) -> TokenizerInfo:
    """Load a PaddleNLP tokenizer from a local folder and copy it into the empty ``folder``."""
    if not source.is_dir():
        raise _corpus_error(f"{source}: tokenizer folder not found (corpus.tokenizer.load_path)")
    tokenizer = _auto_tokenizer(source)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise _corpus_error(f"{source}: tokenizer has no eos_token; documents need an end-of-document id")
    encoder = "paddlenlp"
    sp_file = _sentencepiece_file(tokenizer)
    if sp_file is not None:
        import sentencepiece as spm

        processor = spm.SentencePieceProcessor(model_file=str(sp_file))
        if processor.encode(_PROBE) == tokenizer(_PROBE, add_special_tokens=False)["input_ids"]:
            encoder = "sentencepiece"
    shutil.copytree(source, folder, dirs_exist_ok=True)
    (folder / INFO_FILE).unlink(missing_ok=True)
    info = TokenizerInfo(path=str(folder), vocab_size=len(tokenizer), eos_id=int(eos), hash=tokenizer_hash(folder),
                         encoder=encoder, fingerprint=fingerprint, source=str(source))
    write_json(folder / INFO_FILE, info)
    logger.info("Loaded tokenizer from %s (%d ids, %s encoder)", source, info.vocab_size, encoder)
    return info


class TokenEncoder:
    """Encodes batches of documents into id lists with the saved tokenizer (no special tokens).

    ``normalization`` is the policy the tokenizer records (None: none recorded); a SentencePiece tokenizer that
    records one applies it itself, so raw and cleaned text give the same ids.
    """

    def __init__(self, info: TokenizerInfo) -> None:
        self.info = info
        folder = Path(info.path)
        self.normalization: Normalization | None = None
        if info.encoder == "sentencepiece":
            import sentencepiece as spm

            sp_file = folder / SP_MODEL_FILE
            if not sp_file.is_file():
                sp_file = _sentencepiece_file(_auto_tokenizer(folder))
            self._sp = spm.SentencePieceProcessor(model_file=str(sp_file))
            self._tokenizer = None
            self.normalization = recorded_normalization(sp_file)
        else:
            self._sp = None
            self._tokenizer = _auto_tokenizer(folder)
        processor = getattr(self._sp, "_processor", None)
        self._one = processor if all(hasattr(processor, f"_EncodeAs{kind}") for kind in ("Ids", "Buffer")) else None
        """SentencePiece's own one-text calls (pybind ``_EncodeAsIds``, ``_EncodeAsBuffer``: text, sampling,
        nbest size, alpha, bos, eos, reverse), where this SentencePiece has them. Its batch call starts a new
        thread for every call, even with ``num_threads=1``: the scheduler may put it on the other core, away
        from the text just read (with two encoding workers, beside the other one)."""

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without special tokens."""
        if self._one is not None:
            encode = self._one._EncodeAsIds
            return [encode(text, False, -1, 0.0, False, False, False) for text in texts]
        if self._sp is not None:
            return self._sp.encode(texts, num_threads=1)
        return self._tokenizer(texts, add_special_tokens=False)["input_ids"]

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text followed by the end-of-document id."""
        eos = self.info.eos_id
        return [ids + [eos] for ids in self.encode(texts)]

    def encode_batch(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """The ids of every text followed by the end-of-document id, concatenated into one ``dtype`` array
        (ids must fit it: see ``indexed.token_dtype``), and each document's length (int32).

        With SentencePiece the texts are encoded one by one in this thread into int32 buffers: no new
        thread per call, and no Python int per id.
        """
        if self._one is None or self._sp.eos_id() != self.info.eos_id:
            ids = self.encode_documents(texts)
            sizes = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
            return flatten_ids(ids, dtype, int(sizes.sum(dtype=np.int64))), sizes
        encode = self._one._EncodeAsBuffer
        buffers = [encode(text, False, -1, 0.0, False, True, False) for text in texts]
        sizes = np.fromiter((memoryview(b).nbytes for b in buffers), dtype=np.int32, count=len(buffers)) >> 2
        ids = np.frombuffer(b"".join(buffers), dtype=np.int32)
        return ids.astype(dtype, copy=False), sizes

    def decode(self, ids: list[int]) -> str:
        if self._sp is not None:
            return self._sp.decode(ids)
        return self._tokenizer.decode(ids)


def training_sentences(documents: Iterable[str], max_chars: int) -> Iterator[str]:
    """Cut documents into training sentences at line breaks, none longer than ``max_chars``."""
    for doc in documents:
        for line in doc.split("\n"):
            for start in range(0, len(line), max_chars):
                piece = line[start : start + max_chars]
                if piece:
                    yield piece


# --- helpers ---------------------------------------------------------------------------------------


def _corpus_error(message: str) -> Exception:
    """The corpus stage's error; imported here so that serving, which encodes with this module, never loads the
    readers (and the HTML, charset and archive libraries they use)."""
    from train_deploy.corpus.readers import CorpusError

    return CorpusError(message)


def _auto_tokenizer(folder: Path):
    from paddlenlp.transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # PaddleNLP raises many kinds; the user needs the folder and the reason
        raise _corpus_error(f"{folder}: PaddleNLP cannot load this tokenizer ({type(exc).__name__}: {exc})") from None


def _sentencepiece_file(tokenizer) -> Path | None:
    vocab_file = getattr(tokenizer, "vocab_file", None)
    if getattr(tokenizer, "sp_model", None) is not None and vocab_file and Path(vocab_file).is_file():
        return Path(vocab_file)
    return None


def _save_llama_tokenizer(sp_file: Path, folder: Path) -> None:
    from paddlenlp.transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer(vocab_file=str(sp_file), add_bos_token=False, add_eos_token=False)
    tokenizer.save_pretrained(str(folder))


def tokenizer_hash(folder: Path) -> str:
    """The tokenizer folder's content hash (its description file aside)."""
    return hash_folder(folder, skip={INFO_FILE})
