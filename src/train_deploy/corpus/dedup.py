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
    codes, owner = code_points(texts)
    starts = max(0, len(codes) - ngram + 1)
    hashes = window_hashes(codes.astype(np.uint64), ngram)[:starts]
    inside = (owner[:starts] == owner[ngram - 1 :]) & (owner[:starts] >= 0)
    documents, hashes = owner[:starts][inside], _mix(hashes[inside])
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
        needed = self.threshold * self.permutations
        for i in range(len(signatures)):
            if hashes is not None and hashes[i] in self._hashes:
                continue
            row = keys[i].tolist()
            candidates = {table[key] for table, key in zip(self._tables, row, strict=True) if key in table}
            if any(np.count_nonzero(self._kept[c] == signatures[i]) >= needed for c in candidates):
                duplicate[i] = True
                continue
            self._keep(signatures[i], row)
            if hashes is not None:
                self._hashes.add(hashes[i])
        return duplicate

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


def near_duplicates(prefixes: list[Path], config: CleaningConfig) -> dict[str, list[np.ndarray]]:
    """For each split, one mask per chunk (in ``prefixes`` order) of the near-duplicates to leave out.

    The chunks are visited in input order; with ``deduplicate``, an exact copy of a kept document is left to the
    exact pass and counted there."""
    index = NearDuplicateIndex(config.near_dedup_threshold, config.near_dedup_permutations)
    masks: dict[str, list[np.ndarray]] = {"train": [], "valid": []}
    for prefix in prefixes:
        signatures, documents = SignatureWriter.read(prefix, config.near_dedup_permutations)
        duplicate = index.add(signatures, documents["hash"].tolist() if config.deduplicate else None)
        valid = documents["valid"].astype(bool)
        masks["train"].append(duplicate[~valid])
        masks["valid"].append(duplicate[valid])
    return masks
