"""PaddleNLP's memory-mapped indexed dataset format (``.bin`` + ``.idx``), written in a streaming way.

``.idx`` layout, as read by ``paddlenlp.data.indexed_dataset.MMapIndexedDataset``: the magic
``MMIDIDX\\0\\0``, version ``<Q`` 1, dtype code ``<B``, item count ``<Q``, document-index length ``<Q``,
then ``int32 sizes[n]``, ``int64 pointers[n]`` (byte offsets into ``.bin``) and ``int64 doc_idx[n + 1]``.
Every document is one item here, so ``doc_idx`` is ``0..n``.

Shards are written per input chunk (tokens to ``.bin``, and per document its size and a 64-bit
content hash) and merged in chunk order, dropping exact duplicates, into one ``.bin/.idx`` pair.
"""

from __future__ import annotations

import mmap
import shutil
import struct
from pathlib import Path

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
# paddlenlp.data.indexed_dataset.dtypes
_DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
                np.dtype(np.int64): 5, np.dtype(np.uint16): 8, np.dtype(np.uint32): 9}
_BLOCK_ITEMS = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest id type PaddleNLP uses for this vocabulary (its ``__best_fitting_dtype``)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class ShardWriter:
    """Appends documents (token arrays) of one chunk and one split to ``<prefix>.bin``."""

    def __init__(self, prefix: Path, dtype: np.dtype) -> None:
        self.prefix, self.dtype = prefix, dtype
        self._bin = open(_file(prefix, "bin"), "wb")  # noqa: SIM115 - closed in close()
        self.sizes: list[np.ndarray] = []
        self.hashes: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, sizes: np.ndarray, hashes: np.ndarray) -> None:
        """Append the concatenated tokens of several documents with their sizes and content hashes."""
        tokens.astype(self.dtype, copy=False).tofile(self._bin)
        self.sizes.append(np.asarray(sizes, dtype=np.int32))
        self.hashes.append(np.asarray(hashes, dtype=np.uint64))

    def close(self) -> None:
        self._bin.close()
        for parts, extension, dtype in ((self.sizes, "sizes", np.int32), (self.hashes, "hash", np.uint64)):
            (np.concatenate(parts) if parts else np.zeros(0, dtype)).tofile(_file(self.prefix, extension))


def merge_shards(prefixes: list[Path], out_prefix: Path, dtype: np.dtype,
                 seen: set[int] | None, drops: list[np.ndarray | None] | None = None) -> tuple[int, int, int]:
    """Concatenate shards in order into ``out_prefix.bin/.idx``, skipping documents whose hash is in
    ``seen`` (which is updated); ``seen=None`` keeps every document. ``drops[i]``, where given, marks further
    documents of shard ``i`` to leave out (near-duplicates); they are not counted as duplicates.

    Returns ``(documents, tokens, duplicates)``. Memory is bounded by one shard plus ``seen``.
    """
    itemsize = dtype.itemsize
    sizes_path = _file(out_prefix, "sizes")
    documents = tokens = duplicates = 0
    with open(_file(out_prefix, "bin"), "wb") as out, open(sizes_path, "wb") as sizes_out:
        for i, prefix in enumerate(prefixes):
            sizes = np.fromfile(_file(prefix, "sizes"), dtype=np.int32)
            if not len(sizes):
                continue
            drop = drops[i] if drops is not None else None
            keep = _first_occurrences(np.fromfile(_file(prefix, "hash"), dtype=np.uint64), seen, drop)
            bin_path = _file(prefix, "bin")
            if keep.all():
                with open(bin_path, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
            else:
                _copy_kept(bin_path, sizes, keep, itemsize, out)
            kept = sizes[keep]
            kept.tofile(sizes_out)
            documents += len(kept)
            tokens += int(kept.sum(dtype=np.int64))
            duplicates += int(len(sizes) - len(kept)) - (int(drop.sum()) if drop is not None else 0)
    _write_index(_file(out_prefix, "idx"), sizes_path, documents, dtype)
    sizes_path.unlink()
    return documents, tokens, duplicates


def document_sizes(idx_path: Path) -> np.ndarray:
    """The int32 token count of every document of a ``.idx`` file (the array after its 34-byte header)."""
    with open(idx_path, "rb") as idx:
        header = idx.read(34)
    count = struct.unpack("<Q", header[18:26])[0]
    return np.fromfile(idx_path, dtype=np.int32, count=count, offset=34)


def _file(prefix: Path, extension: str) -> Path:
    # Not Path.with_suffix: shard prefixes such as 000003.train already have a "suffix".
    return prefix.parent / f"{prefix.name}.{extension}"


def _first_occurrences(hashes: np.ndarray, seen: set[int] | None, drop: np.ndarray | None = None) -> np.ndarray:
    if seen is None:
        return np.ones(len(hashes), dtype=bool) if drop is None else ~drop
    keep = np.empty(len(hashes), dtype=bool)
    for i, h in enumerate(hashes.tolist()):
        keep[i] = h not in seen and (drop is None or not drop[i])
        if keep[i]:
            seen.add(h)
    return keep


def _copy_kept(bin_path: Path, sizes: np.ndarray, keep: np.ndarray, itemsize: int, out) -> None:
    """Copy the byte ranges of kept documents, merging adjacent ones into single writes."""
    ends = np.cumsum(sizes, dtype=np.int64) * itemsize
    starts = ends - sizes.astype(np.int64) * itemsize
    with open(bin_path, "rb") as src, mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as view:
        run_start = None
        for i in range(len(sizes) + 1):
            if i < len(sizes) and keep[i]:
                if run_start is None:
                    run_start = starts[i]
                continue
            if run_start is not None:
                out.write(view[run_start : ends[i - 1]])
                run_start = None


def _write_index(idx_path: Path, sizes_path: Path, count: int, dtype: np.dtype) -> None:
    """Write the ``.idx`` from a file of int32 sizes, block by block."""
    itemsize = dtype.itemsize
    with open(idx_path, "wb") as idx:
        idx.write(_MAGIC)
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", _DTYPE_CODES[dtype]))
        idx.write(struct.pack("<Q", count))
        idx.write(struct.pack("<Q", count + 1))
        with open(sizes_path, "rb") as src:
            shutil.copyfileobj(src, idx, 1 << 22)
        offset = 0
        sizes = np.memmap(sizes_path, dtype=np.int32, mode="r") if count else np.zeros(0, np.int32)
        for start in range(0, count, _BLOCK_ITEMS):
            block = sizes[start : start + _BLOCK_ITEMS].astype(np.int64) * itemsize
            pointers = np.cumsum(block) - block + offset
            offset = int(pointers[-1] + block[-1])
            pointers.tofile(idx)
        del sizes
        for start in range(0, count + 1, _BLOCK_ITEMS):
            np.arange(start, min(start + _BLOCK_ITEMS, count + 1), dtype=np.int64).tofile(idx)
