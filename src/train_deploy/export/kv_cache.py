"""A batch's key/value cache between decode steps, kept the way its engine updates it.

Both kinds take rows from a prefill (:meth:`join`), drop rows (:meth:`keep`, order kept) and run one decode step
for every row (:meth:`decode`, the logits ``[rows, 1, vocab]``); ``lengths`` is each row's cached positions. The
batcher and ``LanguageModel.stream_ids`` only use these, so they run the same on every engine.

* :class:`SlotCache`, ONNX Runtime's in-place decode graph (``inplace.py``): one buffer per layer for keys and one
  for values, ``[rows, kv_heads, capacity, head_dim]``, each row's positions from 0; the graph writes the new
  position where it stands and attends over each row's own length. A step copies nothing of the cache. Buffers
  grow by doubling (rows and positions) and are freed when the batch empties.
* :class:`GrowingCache`, the decode graphs that return the cache grown by one position (Paddle Inference, whose
  predictor copies fed tensors, and bundles exported before format 11): rows left-padded to a common width with an
  attention mask; joining rows pads both sides to the wider one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_MIN_POSITIONS = 32  # a slot buffer's first capacity in positions (then doubled as the longest row grows)


class GrowingCache:
    """Left-padded rows, an attention mask and the caches a decode graph grows by concatenation (module
    docstring). ``decode(input_ids, attention_mask, keys, values)`` is the engine's decode step (a ``Step``)."""

    def __init__(self, decode: Callable[..., Any]) -> None:
        self._decode = decode
        self.mask = np.zeros((0, 0), np.int64)
        self.keys: list[Any] = []
        self.values: list[Any] = []

    @property
    def rows(self) -> int:
        return len(self.mask)

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(axis=1)

    def join(self, mask: np.ndarray, step: Any, rows: Sequence[int]) -> None:
        """Add ``rows`` of a prefill (its left-padded ``mask`` and ``step``) after the rows there are."""
        rows = list(rows)
        mask = mask[rows]
        keys, values = ([_take(c, rows, 0) for c in caches] for caches in (step.keys, step.values))
        if not self.rows:
            self.mask, self.keys, self.values = mask, keys, values
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = np.concatenate([_pad_mask(self.mask, width), _pad_mask(mask, width)], axis=0)
        self.keys = [_concat([_pad(a, width), _pad(b, width)]) for a, b in zip(self.keys, keys, strict=True)]
        self.values = [_concat([_pad(a, width), _pad(b, width)]) for a, b in zip(self.values, values, strict=True)]

    def keep(self, rows: Sequence[int]) -> None:
        """Only ``rows``, without the leading columns that are padding in all of them."""
        rows = list(rows)
        if len(rows) == self.rows:
            return
        if not rows:
            self.mask, self.keys, self.values = np.zeros((0, 0), np.int64), [], []
            return
        mask = self.mask[rows]
        lead = int((np.cumsum(mask, axis=1) == 0).sum(axis=1).min())
        self.mask = mask[:, lead:]
        self.keys = [_take(cache, rows, lead) for cache in self.keys]
        self.values = [_take(cache, rows, lead) for cache in self.values]

    def decode(self, input_ids: np.ndarray) -> np.ndarray:
        """One token per row (``[rows, 1]``); the caches grown by it; its logits."""
        mask = np.concatenate([self.mask, np.ones((self.rows, 1), np.int64)], axis=1)
        step = self._decode(input_ids, mask, self.keys, self.values)
        self.mask, self.keys, self.values = mask, step.keys, step.values
        return step.logits


class SlotCache:
    """Per-layer buffers the in-place decode graph writes (module docstring). ``run(input_ids, past_lengths,
    total_length, keys, values)`` runs that graph on views of the buffers and returns its logits."""

    def __init__(self, run: Callable[..., np.ndarray], layers: int, kv_heads: int, head_dim: int) -> None:
        self._run, self._layers, self._shape = run, layers, (kv_heads, head_dim)
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self._lengths = np.zeros(0, np.int32)
        self._rows = 0

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths[:self._rows]

    def join(self, mask: np.ndarray, step: Any, rows: Sequence[int]) -> None:
        """Copy ``rows`` of a prefill (left-padded: a row's positions are its last ``mask.sum()`` ones) into the next
        slots, each from position 0."""
        lengths = mask[list(rows)].sum(axis=1)
        start, width = self._rows, mask.shape[1]
        self._reserve(start + len(lengths), int(lengths.max(initial=0)))
        for slot, (row, length) in enumerate(zip(rows, lengths, strict=True), start):
            for buffers, caches in ((self.keys, step.keys), (self.values, step.values)):
                for buffer, cache in zip(buffers, caches, strict=True):
                    buffer[slot, :, :length] = np.asarray(cache[row, :, width - length:])
            self._lengths[slot] = length
        self._rows = start + len(lengths)

    def keep(self, rows: Sequence[int]) -> None:
        """Only ``rows``, in their order: the rows after the first one that moves are copied up."""
        rows = list(rows)
        if not rows:
            self.keys, self.values, self._lengths, self._rows = [], [], np.zeros(0, np.int32), 0  # memory back
            return
        first = next((i for i, row in enumerate(rows) if row != i), len(rows))
        if first < len(rows):
            moved, longest = rows[first:], int(self._lengths[rows[first:]].max())
            for buffer in (*self.keys, *self.values):
                buffer[first:len(rows), :, :longest] = buffer[moved, :, :longest]
            self._lengths[first:len(rows)] = self._lengths[moved]
        self._rows = len(rows)

    def decode(self, input_ids: np.ndarray) -> np.ndarray:
        """One token per row (``[rows, 1]``), its key and value written at the row's length; its logits."""
        n = self._rows
        lengths = self._lengths[:n]
        total = int(lengths.max()) + 1
        self._reserve(n, total)
        logits = self._run(input_ids, lengths.copy(), total, [b[:n] for b in self.keys], [b[:n] for b in self.values])
        self._lengths[:n] += 1
        return logits

    def _reserve(self, rows: int, positions: int) -> None:
        """Buffers for at least ``rows`` rows of ``positions`` positions (doubling what they hold), rows kept."""
        have_rows, have_positions = (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)
        if rows <= have_rows and positions <= have_positions:
            return
        new_rows = max(rows, 2 * have_rows if rows > have_rows else have_rows)
        new_positions = max(positions, _MIN_POSITIONS, 2 * have_positions if positions > have_positions
                            else have_positions)
        shape = (new_rows, *self._shape[:1], new_positions, self._shape[1])
        keys, values = [np.zeros(shape, np.float32) for _ in range(self._layers)], \
            [np.zeros(shape, np.float32) for _ in range(self._layers)]
        for old, new in zip([*self.keys, *self.values], [*keys, *values], strict=False):
            new[:self._rows, :, :have_positions] = old[:self._rows]
        lengths = np.zeros(new_rows, np.int32)
        lengths[:self._rows] = self._lengths[:self._rows]
        self.keys, self.values, self._lengths = keys, values, lengths


def _take(cache: Any, rows: list[int], lead: int) -> Any:
    """``rows`` of a cache ``[batch, heads, positions, dim]`` from position ``lead`` (numpy or Paddle)."""
    if len(rows) == cache.shape[0] and lead == 0 and rows == list(range(len(rows))):
        return cache
    return cache[rows][:, :, lead:]


def _pad_mask(mask: np.ndarray, width: int) -> np.ndarray:
    return np.pad(mask, ((0, 0), (width - mask.shape[1], 0)))


def _pad(cache: Any, width: int) -> Any:
    """``cache`` left-padded with zeros to ``width`` positions (masked keys: their values never count)."""
    missing = width - cache.shape[2]
    if missing == 0:
        return cache
    if isinstance(cache, np.ndarray):
        return np.pad(cache, ((0, 0), (0, 0), (missing, 0), (0, 0)))
    import paddle

    zeros = paddle.zeros([cache.shape[0], cache.shape[1], missing, cache.shape[3]], dtype=cache.dtype)
    return paddle.concat([zeros, cache], axis=2)


def _concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=0)
    import paddle

    return paddle.concat(parts, axis=0)
