"""Fixed-length training samples from the ``.bin/.idx`` token files, in a seed-determined order.

The token file is one stream of documents, each ending with EOS. Sample ``i`` is the window
``tokens[i·L : i·L + L + 1]`` (inputs and shifted labels). Every epoch visits all samples in a
permutation drawn from ``seed + epoch``; the global sample index ``consumed_samples + j`` therefore
names the same sequence whatever the parallel layout, which is what makes runs with different
``dp`` match and a resumed run continue exactly (only ``consumed_samples`` is saved).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from train_deploy.corpus.errors import CorpusError


class TokenWindows:
    """Random-access fixed-length windows over one split of the token files."""

    def __init__(self, prefix: Path, seq_length: int, seed: int, dtype: str) -> None:
        path = Path(f"{prefix}.bin")
        if not path.is_file() or path.stat().st_size == 0:  # numpy: "cannot mmap an empty file", no name
            raise CorpusError(f"{path}: {'missing' if not path.is_file() else 'holds no tokens'}; use more text or "
                             "a larger corpus.encoding.validation_fraction (for the validation split)")
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_length, self.seed = seq_length, seed
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise CorpusError(f"{path}: {len(self.tokens)} tokens cannot fill one sample of seq_length "
                             f"{seq_length} + 1; use more text or a shorter training.batch.seq_length")

    def window(self, index: int) -> np.ndarray:
        """The ``index``-th window in training order (``index`` may run past one epoch)."""
        epoch, position = divmod(index, self.num_samples)
        start = int(self._order(epoch)[position]) * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def batch(self, first: int, count: int) -> np.ndarray:
        """Windows ``first .. first + count - 1`` stacked: shape ``[count, seq_length + 1]``."""
        return np.stack([self.window(first + i) for i in range(count)])

    def in_file_order(self, count: int) -> np.ndarray:
        """The first ``count`` windows in file order (fixed evaluation samples); ``count`` ≥ 1."""
        if count < 1:
            raise ValueError(f"in_file_order: count must be at least 1, got {count}")
        count = min(count, self.num_samples)
        span = count * self.seq_length
        flat = np.asarray(self.tokens[: span + 1], dtype=np.int64)
        return np.stack([flat[i * self.seq_length : (i + 1) * self.seq_length + 1] for i in range(count)])

    @lru_cache(maxsize=2)  # noqa: B019 - one sampler per process, a couple of epochs in flight
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.RandomState((self.seed + epoch) % 2**32).permutation(self.num_samples)
