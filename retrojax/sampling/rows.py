"""Host-side bookkeeping of the sampler's rows: token history, lengths, argument checks, bucketing.

Everything here is plain numpy/Python; the device only ever sees fixed-shape arrays built from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SamplerError(ValueError):
    """A call to the sampler with arguments it cannot honour (unknown row, bad length, bad knob...)."""


class CacheOverflowError(SamplerError):
    """An append that would push a row past the cache length; nothing was written."""


class RowBook:
    """Per-row conversation ids and lengths for ``rows`` rows of capacity ``max_len`` tokens.

    A row's conversation is ``tokens[row, :length[row]]``. The KV cache holds keys/values for all of it except
    the last token, which is *pending*: it is fed (and its slot written) by the next append or decode step. So
    every slot is written exactly once per conversation, and rewinding is only a change of ``length``.
    """

    def __init__(self, rows: int, max_len: int, vocab_size: int):
        if rows <= 0 or max_len <= 1:
            raise SamplerError(f"need rows >= 1 and max_len >= 2, got rows={rows}, max_len={max_len}")
        self.rows, self.max_len, self.vocab_size = int(rows), int(max_len), int(vocab_size)
        self.tokens = np.zeros((rows, max_len), dtype=np.int32)
        self.length = np.zeros((rows,), dtype=np.int64)

    # --- checks ---------------------------------------------------------------------------------
    def row(self, row) -> int:
        """``row`` as a valid row index, or a clear error."""
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
            raise SamplerError(f"row must be an int, got {row!r}")
        if not 0 <= int(row) < self.rows:
            raise SamplerError(f"unknown row {int(row)}: the sampler has rows 0..{self.rows - 1}")
        return int(row)

    def row_list(self, rows: Sequence[int]) -> list[int]:
        """Validated, duplicate-free list of rows."""
        if isinstance(rows, (int, np.integer)):
            raise SamplerError("rows must be a sequence of row indices, e.g. [0, 3]")
        out = [self.row(r) for r in rows]
        if len(set(out)) != len(out):
            twice = sorted(r for r in set(out) if out.count(r) > 1)
            raise SamplerError(f"rows listed twice in one call: {twice}")
        return out

    def chunk(self, row: int, chunk) -> np.ndarray:
        """A token chunk as int32 ids in the vocabulary, or a clear error naming the row."""
        arr = np.asarray(chunk)
        if arr.ndim != 1:
            raise SamplerError(f"row {row}: a token chunk must be a 1-D sequence of ids, got {arr.shape}")
        if arr.size == 0:
            return np.zeros((0,), dtype=np.int32)
        if not np.issubdtype(arr.dtype, np.integer):
            raise SamplerError(f"row {row}: token ids must be integers, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise SamplerError(f"row {row}: token id {int(bad[0])} outside the vocabulary "
                               f"[0, {self.vocab_size})")
        return arr.astype(np.int32)

    def position(self, row: int, position) -> int:
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
            raise SamplerError(f"row {row}: position must be an int, got {position!r}")
        if position < 0:
            raise SamplerError(f"row {row}: position must be >= 0, got {int(position)}")
        if position > self.length[row]:
            raise SamplerError(
                f"row {row}: position {int(position)} is beyond the row's conversation "
                f"(length {int(self.length[row])})"
            )
        return int(position)

    # --- state ------------------------------------------------------------------------------------
    def written(self, row: int) -> int:
        """Cache slots holding valid keys/values for ``row`` (all tokens but the pending last one)."""
        return max(int(self.length[row]) - 1, 0)

    def extend(self, row: int, ids: np.ndarray) -> None:
        n = int(self.length[row])
        self.tokens[row, n : n + ids.size] = ids
        self.length[row] = n + ids.size


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket ≥ n (buckets ascending); the largest one when n exceeds them all (caller loops)."""
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def clip_buckets(buckets: Sequence[int], max_len: int) -> tuple[int, ...]:
    """Ascending, distinct chunk buckets; any bucket at or above the cache length becomes the cache length."""
    if not buckets or any(int(b) <= 0 for b in buckets):
        raise SamplerError(f"chunk buckets must be a non-empty list of positive ints, got {tuple(buckets)}")
    return tuple(sorted({min(int(b), max_len) for b in buckets}))
