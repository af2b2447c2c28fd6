"""Near-duplicate removal: MinHash signatures of character shingles, LSH banding, first document kept.

Signatures are computed by the encoding workers, a batch at a time, with one-permutation hashing (Li, Owen and
Zhang 2012) and rotation densification (Shrivastava and Li 2014): every shingle is hashed once, its hash picks
one of ``permutations`` bins and the bin keeps its smallest value, so the cost is one hash per character
instead of one per character and permutation (datasketch's ``MinHash.update``). A short document (fewer
shingles than twice the bins) takes each shingle several times, each copy hashed anew: that keeps its Jaccard
similarity to any other document and leaves few empty bins to densify, whose borrowed values would make its
estimate noisy (one-line boilerplate with a changed name looked alike). The decision is made afterwards, by
the parent, in input order (:class:`NearDuplicateIndex`): the bands of a signature are looked up among the
documents kept so far, a candidate counts when the estimated Jaccard similarity reaches the threshold, and the
first document of each cluster is kept. It therefore never depends on how the input was chunked or on the
worker count. The band and row counts are datasketch's (``MinHashLSH``'s choice for the threshold).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xxhash

from train_deploy.corpus.config import CleaningConfig
from train_deploy.corpus.filters import code_points, window_hashes

_EMPTY = np.uint32(0xFFFFFFFF)


def minhash_signatures(texts: list[str], ngram: int, permutations: int) -> np.ndarray:
    """``(len(texts), permutations)`` uint32 MinHash signatures of the documents' character ``ngram``-shingles.

    A document shorter than ``ngram`` has one shingle, itself."""
    bits = permutations.bit_length() - 1
    signatures = np.full((len(texts), permutations), _EMPTY, dtype=np.uint32)
    if not texts:
        return signatures
    documents, hashes = shingle_hashes(texts, ngram)
    short = [i for i, text in enumerate(texts) if len(text) < ngram]
    if short:
        whole = np.array([xxhash.xxh3_64_intdigest(texts[i].encode("utf-8")) for i in short], dtype=np.uint64)
        documents, hashes = np.concatenate([documents, short]), np.concatenate([hashes, _mix(whole)])
    documents, hashes = _spread_short(documents, hashes, len(texts), permutations)
    slots = documents * permutations + (hashes >> np.uint64(64 - bits)).astype(np.int64)
    # The bin from the top bits, the value from bits 20..51: independent parts of a multiply-shift hash too.
    np.minimum.at(signatures.reshape(-1), slots, (hashes >> np.uint64(20)).astype(np.uint32))
    _densify(signatures)
    return signatures


def shingle_hashes(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """``(documents, hashes)``: each character ``ngram``-shingle of ``texts`` as the index of its text and a 64-bit
    hash, in text order (a text shorter than ``ngram`` has none)."""
    codes, owner = code_points(texts)
    starts = max(0, len(codes) - ngram + 1)
    hashes = window_hashes(codes.astype(np.uint64), ngram)[:starts]
    inside = (owner[:starts] == owner[ngram - 1 :]) & (owner[:starts] >= 0)
    return owner[:starts][inside], _mix(hashes[inside])


def _spread_short(documents: np.ndarray, hashes: np.ndarray, count: int,
                  permutations: int) -> tuple[np.ndarray, np.ndarray]:
    """Each shingle of a document with fewer than ``2 × permutations`` shingles taken ``m`` times, each copy hashed
    anew, so that about ``2 × permutations`` values fill its bins. Copying every shingle ``m`` times keeps the
    Jaccard similarity of two documents, and few bins are left to densification, whose borrowed values make the
    estimate of short documents noisy."""
    shingles = np.bincount(documents, minlength=count)
    copies = np.clip(-(-2 * permutations // np.maximum(shingles, 1)), 1, len(_MULTIPLIERS))[documents]
    if (copies == 1).all():  # every copy 0 is multiplied by the same odd number: the same as above
        return documents, hashes * _MULTIPLIERS[0]
    copy = np.arange(int(copies.sum())) - np.repeat(np.cumsum(copies) - copies, copies)
    # Multiply-shift with an odd multiplier per copy: a fresh hash of the same shingle in one multiplication.
    return np.repeat(documents, copies), np.repeat(hashes, copies) * _MULTIPLIERS[copy]


_MULTIPLIERS = np.random.default_rng(0xC0FFEE).integers(0, 2**63, size=2048, dtype=np.uint64) * np.uint64(2)
_MULTIPLIERS |= np.uint64(1)


def _densify(signatures: np.ndarray) -> None:
    """Fill each empty bin from the next non-empty bin to its right (circularly), marked by the distance, so two
    documents with the same shingles get the same signature (rotation densification)."""
    rows = np.flatnonzero((signatures == _EMPTY).any(axis=1) & (signatures != _EMPTY).any(axis=1))
    if not len(rows):
        return
    part = signatures[rows]
    empty = part == _EMPTY
    filled = ~empty
    for distance in range(1, part.shape[1]):
        donors = np.concatenate([part[:, distance:], part[:, :distance]], axis=1)
        take = empty & np.concatenate([filled[:, distance:], filled[:, :distance]], axis=1)
        part[take] = donors[take] ^ np.uint32(distance * 0x9E3779B1 & 0xFFFFFFFF)
        empty &= ~take
        if not empty.any():
            break
    signatures[rows] = part


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: polynomial hashes of similar text differ in every bit afterwards."""
    z = values.astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def lsh_bands(threshold: float, permutations: int) -> tuple[int, int]:
    """``(bands, rows)`` that datasketch's ``MinHashLSH`` chooses for ``threshold`` (equal weight on false
    positives and negatives)."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=permutations)
    return lsh.b, lsh.r


class NearDuplicateIndex:
    """The signatures of the documents kept so far, and their LSH bands; decides document by document, in order.

    Memory, per kept document: its signature (``4 × permutations`` bytes), one dictionary entry per band and its
    content hash; about 2 kB with 128 permutations (measured with tracemalloc on 50,000 documents)."""

    def __init__(self, threshold: float, permutations: int) -> None:
        self.threshold, self.permutations = threshold, permutations
        self.bands, self.rows = lsh_bands(threshold, permutations)
        self._tables: list[dict[int, int]] = [{} for _ in range(self.bands)]
        self._kept = np.zeros((1024, permutations), dtype=np.uint32)
        self._count = 0
        self._hashes: set[int] = set()
        weights = np.random.default_rng(0x5EED).integers(1, 2**63, size=self.rows, dtype=np.uint64) | np.uint64(1)
        self._weights = weights

    def add(self, signatures: np.ndarray, hashes: list[int] | None = None) -> np.ndarray:
        """Which of these documents (in order) are near-duplicates of a kept one; the others are kept and indexed.
        With ``hashes`` (content hashes), an exact copy of a kept document is left to the exact pass: neither
        judged nor kept."""
        keys = self._band_keys(signatures)
        duplicate = np.zeros(len(signatures), dtype=bool)
        for i in range(len(signatures)):
            if hashes is not None and hashes[i] in self._hashes:
                continue
            row = keys[i].tolist()
            if self._near_kept(signatures[i], row):
                duplicate[i] = True
                continue
            self._keep(signatures[i], row)
            if hashes is not None:
                self._hashes.add(hashes[i])
        return duplicate

    def matches(self, signatures: np.ndarray) -> np.ndarray:
        """Which of these documents are near-duplicates of a kept one, judged as :meth:`add` does; none is kept."""
        keys = self._band_keys(signatures)
        return np.array([self._near_kept(signatures[i], keys[i].tolist()) for i in range(len(signatures))],
                        dtype=bool)

    def _near_kept(self, signature: np.ndarray, keys: list[int]) -> bool:
        """Whether a kept document that shares a band with ``signature`` reaches the threshold."""
        needed = self.threshold * self.permutations
        candidates = {table[key] for table, key in zip(self._tables, keys, strict=True) if key in table}
        return any(np.count_nonzero(self._kept[c] == signature) >= needed for c in candidates)

    def _keep(self, signature: np.ndarray, keys: list[int]) -> None:
        if self._count == len(self._kept):
            self._kept = np.concatenate([self._kept, np.zeros_like(self._kept)])
        self._kept[self._count] = signature
        for table, key in zip(self._tables, keys, strict=True):
            table.setdefault(key, self._count)
        self._count += 1

    def _band_keys(self, signatures: np.ndarray) -> np.ndarray:
        """``(documents, bands)`` 64-bit keys, one per band of ``rows`` signature values."""
        used = signatures[:, : self.bands * self.rows].astype(np.uint64).reshape(len(signatures), self.bands, self.rows)
        return _mix((used * self._weights).sum(axis=2, dtype=np.uint64) + np.arange(self.bands, dtype=np.uint64))


class SignatureWriter:
    """A chunk's signatures, with each document's content hash and split, in input order (``<prefix>.sig/.doc``)."""

    _DOC = np.dtype([("hash", "<u8"), ("valid", "u1")])

    def __init__(self, prefix: Path, config: CleaningConfig) -> None:
        self.prefix, self.config = prefix, config
        self._signatures: list[np.ndarray] = []
        self._documents: list[np.ndarray] = []

    def add(self, texts: list[str], hashes: np.ndarray, valid: np.ndarray) -> None:
        """Sign the kept documents of a batch; ``hashes`` are their content hashes, ``valid`` their split."""
        c = self.config
        self._signatures.append(minhash_signatures(texts, c.near_dedup_ngram, c.near_dedup_permutations))
        documents = np.empty(len(texts), dtype=self._DOC)
        documents["hash"], documents["valid"] = hashes, valid
        self._documents.append(documents)

    def close(self) -> None:
        width = self.config.near_dedup_permutations
        signatures = np.concatenate(self._signatures) if self._signatures else np.zeros((0, width), np.uint32)
        documents = np.concatenate(self._documents) if self._documents else np.zeros(0, self._DOC)
        signatures.tofile(f"{self.prefix}.sig")
        documents.tofile(f"{self.prefix}.doc")

    @classmethod
    def read(cls, prefix: Path, width: int) -> tuple[np.ndarray, np.ndarray]:
        signatures = np.fromfile(f"{prefix}.sig", dtype=np.uint32).reshape(-1, width)
        return signatures, np.fromfile(f"{prefix}.doc", dtype=cls._DOC)


NEAR_DUPLICATE = "near_duplicate"
"""Drop reason: a near-duplicate of a document kept earlier in the same split."""
NEAR_TRAINING = "near_duplicate_of_training"
"""Drop reason: a validation document that is a near-duplicate of a training document."""
NEAR_EVAL_SET = "near_duplicate_of_eval_set"
"""Drop reason: a training document that holds a text of the registered model's evaluation set."""


def near_duplicates(prefixes: list[Path], config: CleaningConfig,
                    excluded: list[np.ndarray] | None = None) -> dict[str, dict[str, list[np.ndarray]]]:
    """For each split, for each drop reason, one mask per chunk (in ``prefixes`` order) of the documents to leave out.

    The training split is judged first, in input order (:data:`NEAR_DUPLICATE`), leaving out the documents that
    ``excluded`` marks (one mask per chunk over its training documents: dropped already, neither judged nor kept).
    Then each validation document is compared with the training documents kept: a near-duplicate of one is dropped
    from validation (:data:`NEAR_TRAINING`), the training one stays, so that no document is scored on a near-twin of
    what the model was trained on; the rest are judged among themselves (:data:`NEAR_DUPLICATE`). With
    ``deduplicate``, an exact copy of a kept document is left to the exact pass and counted there (copies share a
    split: the split is picked by the text's hash)."""
    index = NearDuplicateIndex(config.near_dedup_threshold, config.near_dedup_permutations)
    masks: dict[str, dict[str, list[np.ndarray]]] = {"train": {NEAR_DUPLICATE: []},
                                                     "valid": {NEAR_TRAINING: [], NEAR_DUPLICATE: []}}
    for i, prefix in enumerate(prefixes):
        signatures, hashes = _split_signatures(prefix, config, valid=False)
        judged = ~excluded[i] if excluded is not None else np.ones(len(signatures), dtype=bool)
        duplicate = np.zeros(len(signatures), dtype=bool)
        duplicate[judged] = index.add(signatures[judged], _chosen(hashes, judged))
        masks["train"][NEAR_DUPLICATE].append(duplicate)
    for prefix in prefixes:  # against the training documents only, before any validation document is kept
        masks["valid"][NEAR_TRAINING].append(index.matches(_split_signatures(prefix, config, valid=True)[0]))
    for prefix, of_training in zip(prefixes, masks["valid"][NEAR_TRAINING], strict=True):
        signatures, hashes = _split_signatures(prefix, config, valid=True)
        duplicate = np.zeros(len(signatures), dtype=bool)
        duplicate[~of_training] = index.add(signatures[~of_training], _chosen(hashes, ~of_training))
        masks["valid"][NEAR_DUPLICATE].append(duplicate)
    return masks


def _split_signatures(prefix: Path, config: CleaningConfig, valid: bool) -> tuple[np.ndarray, list[int] | None]:
    """One split's signatures of a chunk, in order, and their content hashes (None without ``deduplicate``)."""
    signatures, documents = SignatureWriter.read(prefix, config.near_dedup_permutations)
    members = documents["valid"].astype(bool) == valid
    return signatures[members], documents["hash"][members].tolist() if config.deduplicate else None


def _chosen(hashes: list[int] | None, members: np.ndarray) -> list[int] | None:
    return None if hashes is None else [h for h, member in zip(hashes, members.tolist(), strict=True) if member]


class TextOverlap:
    """Which documents hold one of a few short texts (an evaluation set): a document holds a text when it contains at
    least ``threshold`` of the text's distinct character ``ngram``-shingles (the containment of the text in the
    document), counted exactly.

    Not the Jaccard similarity of whole documents: an evaluation text is cut to a hundred characters or so, and a
    training document that holds it word for word is many times longer, so their Jaccard similarity is small though
    the model would have learnt the text. A document whose Jaccard similarity to a text reaches ``threshold`` holds
    it (containment is never below it). A text shorter than ``ngram`` has no shingle and is held by none."""

    def __init__(self, texts: list[str], ngram: int, threshold: float) -> None:
        self.ngram, self.threshold = ngram, threshold
        owners, hashes = shingle_hashes(list(texts), ngram)
        pairs = np.unique(np.stack([hashes, owners.astype(np.uint64)], axis=1), axis=0)  # sorted by hash
        self._hashes, self._owners = pairs[:, 0], pairs[:, 1].astype(np.int64)
        self._sizes = np.bincount(self._owners, minlength=len(texts))
        self._count = len(texts)

    def holders(self, documents: list[str]) -> np.ndarray:
        """One flag per document: it holds at least one of the texts."""
        return self._holds(documents).any(axis=1)

    def held(self, documents: list[str]) -> np.ndarray:
        """One flag per text: at least one of ``documents`` holds it."""
        return self._holds(documents).any(axis=0)

    def _holds(self, documents: list[str]) -> np.ndarray:
        """``(documents, texts)``: whether the document holds the text."""
        if not documents or not len(self._hashes):
            return np.zeros((len(documents), self._count), dtype=bool)
        owners, hashes = shingle_hashes(documents, self.ngram)
        pairs = np.unique(np.stack([hashes, owners.astype(np.uint64)], axis=1), axis=0)
        first = np.searchsorted(self._hashes, pairs[:, 0], side="left")
        counts = np.searchsorted(self._hashes, pairs[:, 0], side="right") - first
        taken = np.repeat(np.arange(len(pairs)), counts)  # one row per (document shingle, text holding it)
        offsets = np.arange(len(taken)) - np.repeat(np.cumsum(counts) - counts, counts)
        texts = self._owners[np.repeat(first, counts) + offsets]
        documents_of = pairs[taken, 1].astype(np.int64)
        shared = np.bincount(documents_of * self._count + texts, minlength=len(documents) * self._count)
        share = shared.reshape(len(documents), self._count) / np.maximum(self._sizes, 1)
        return (share >= self.threshold) & (self._sizes > 0)
