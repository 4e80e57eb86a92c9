"""Row buckets for the serve engine: prefill and decode run on the rows that have work, padded to a bucket.

The plain :class:`~retrojax.sampler.Sampler` runs every program over all ``rows`` cache rows (rows without
work are masked, not skipped), which suits rollouts that keep every row busy. A server is different:
requests arrive a few at a time, so most prefills admit one to a handful of prompts, and with
``--max-batch 64`` each of them paid for 64 rows (a 700-token prompt: ~20 s instead of ~0.5 s on two CPU
cores). Here each call gathers the rows that have work plus padding rows up to the smallest *row bucket*
that holds them (powers of two up to ``rows``), over the attention window's leading slots only, runs the
sampler's own prefill/decode body on that sub-cache and scatters it back (in place: the cache is donated).

With paged keys/values (``kv="paged"``) nothing is gathered: the call gets the bucket rows' page tables and
attends over their pages in place; its writes land in those rows' pages.

Padding rows are other rows of the cache, written nowhere (prefill: write start past the sub-cache; decode:
limit 0) and scattered back unchanged, so they never touch a real request's tokens or a row's cached
conversation; greedy replies do not depend on which bucket or which neighbours a request ran with.

Programs are bounded and counted: one per (row bucket, prefill chunk bucket, window) and one per (row
bucket, decode length, window, stop-id and stop-table shape). :attr:`RowBucketSampler.programs` records each
shape with the seconds its first call took (trace, compile and one run);
:meth:`RowBucketSampler.program_bound` is the most the engine's calls can ever need.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from retrojax.model.qwen3 import KVCache
from retrojax.parallel.rules import MeshFromArgs
from retrojax.sampler import Sampler, SamplerError, _decode, _decode_impl, _prefill, _prefill_impl
from retrojax.sampling.rows import bucket_for
from retrojax.sampling.stops import pow2_at_least


def default_row_buckets(rows: int) -> tuple[int, ...]:
    """Powers of two below ``rows``, then ``rows``: a bucket wastes at most half its rows."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return (*out, rows)


class RowBucketSampler(Sampler):
    """A :class:`Sampler` whose device calls run on a row bucket instead of every row (module docstring).

    ``row_buckets``: ascending row counts (the last is raised to ``rows``); None: :func:`default_row_buckets`.
    ``on_program``: called with ``(shape, seconds)`` when a call needs a program not run before.
    """

    def __init__(self, model, *, rows: int, max_len: int, row_buckets: Sequence[int] | None = None,
                 on_program: Callable[[tuple, float], None] | None = None, **kwargs):
        super().__init__(model, rows=rows, max_len=max_len, **kwargs)
        buckets = default_row_buckets(rows) if row_buckets is None else tuple(int(b) for b in row_buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise SamplerError(f"row buckets must be ascending distinct positive ints, got {buckets}")
        self.row_buckets = tuple(b for b in buckets if b < rows) + (rows,)
        self.programs: dict[tuple, float] = {}
        self.on_program = on_program

    def program_bound(self, decode_shapes: int = 1) -> int:
        """The most programs the engine's calls can need: row buckets × windows × (prefill chunk buckets +
        ``decode_shapes``, the distinct (decode length, stop ids, stop table) shapes; 1 in the engine)."""
        return len(self.row_buckets) * len(self.windows()) * (len(self.buckets) + decode_shapes)

    def program_bounds(self, decode_shapes: int = 1, row_buckets: int = 0) -> dict[str, int]:
        """:meth:`Sampler.program_bounds` with each row bucket's own prefill, decode and next-logits
        programs."""
        return super().program_bounds(decode_shapes, row_buckets or len(self.row_buckets))

    def warm_up(self, stop_ids: Sequence[int], decode_steps: int) -> float:
        """Run every program the engine's calls can need once, so that none compiles while serving: for each
        row bucket and attention window, a prefill per chunk bucket that can meet that window and a decode of
        ``decode_steps`` (at most) with ``stop_ids`` and no stop strings, as :meth:`generate` shapes them.
        Rows 0..bucket-1 are written with zeros; their conversations stay empty (the book is not touched, and
        slots past a row's length are never attended). Returns the seconds taken."""
        start = time.perf_counter()
        stop = np.full((pow2_at_least(len(stop_ids)),), -1, dtype=np.int32)
        stop[: len(stop_ids)] = stop_ids
        table, table_lens = self._stop_string_tables(())
        out_len = pow2_at_least(decode_steps, max(16, self.min_out_len))
        key = jax.random.key(0)
        for rows in self.row_buckets:
            for window in self.windows():
                below = 0
                for width in self.buckets:  # a chunk of this bucket holds > ``below`` tokens: its reach
                    if self._window(below + 1) <= window:
                        ids = np.zeros((self.rows, width), dtype=np.int32)
                        write_start = np.full((self.rows,), self.max_len, dtype=np.int32)
                        write_start[:rows] = 0
                        self._run_prefill(ids, write_start, window)
                    below = width
                limit = np.zeros((self.rows,), dtype=np.int32)
                limit[:rows] = 1
                zeros = np.zeros((self.rows,), np.int32)
                per_row = {"tok": zeros, "pos": zeros, "limit": limit, "top_k": zeros,
                           "applies": np.zeros((self.rows, table_lens.shape[0]), dtype=bool),
                           "temperature": np.zeros((self.rows,), np.float32),
                           "top_p": np.ones((self.rows,), np.float32)}
                self._run_decode(per_row, stop, table, table_lens, key, out_len=out_len, window=window)
        jax.block_until_ready(self.cache)
        return time.perf_counter() - start

    # --- the device calls, on a row bucket ---------------------------------------------------------------
    def _bucket(self, live: np.ndarray) -> np.ndarray:
        """``live`` rows, then the lowest other rows, up to the smallest row bucket holding them."""
        size = bucket_for(max(live.size, 1), self.row_buckets)
        if size >= self.rows:
            return np.arange(self.rows)
        pad = np.setdiff1d(np.arange(self.rows), live, assume_unique=True)[: size - live.size]
        return np.concatenate([live, pad]).astype(np.int32)

    def _timed(self, shape: tuple, call: Callable[[], tuple]) -> tuple:
        """Run ``call``; the first time a shape is seen, wait for its result and record how long it took."""
        if shape in self.programs:
            return call()
        start = time.perf_counter()
        out = jax.block_until_ready(call())
        self.programs[shape] = seconds = time.perf_counter() - start
        if self.on_program is not None:
            self.on_program(shape, seconds)
        return out

    def _run_prefill(self, ids: np.ndarray, write_start: np.ndarray, window: int) -> None:
        idx = self._bucket(np.nonzero(write_start < self.max_len)[0])

        def every_row() -> KVCache:
            Sampler._run_prefill(self, ids, write_start, window)
            return self.cache

        def bucket() -> KVCache:
            if self.paged is not None:  # the bucket rows' page tables: no gather, no scatter
                return _prefill(self._graphdef, self._state, self.cache, jnp.asarray(ids[idx]),
                                jnp.asarray(write_start[idx]), self._pages(window)[idx], window=window)
            return _prefill_rows(self._graphdef, self._state, self.cache, jnp.asarray(idx),
                                 jnp.asarray(ids[idx]), jnp.asarray(write_start[idx]), window=window)

        shape = ("prefill", idx.size, ids.shape[1], window)
        self.cache = self._timed(shape, every_row if idx.size == self.rows else bucket)

    def _run_decode(self, per_row: dict[str, np.ndarray], stop_ids: np.ndarray, table: jax.Array,
                    table_lens: jax.Array, key: jax.Array, *, out_len: int, window: int) -> tuple:
        idx = self._bucket(np.nonzero(per_row["limit"] > 0)[0])
        shape = ("decode", idx.size, out_len, window, stop_ids.size, tuple(table.shape))
        if idx.size == self.rows:
            return self._timed(shape, lambda: Sampler._run_decode(
                self, per_row, stop_ids, table, table_lens, key, out_len=out_len, window=window))
        a = {k: jnp.asarray(v[idx]) for k, v in per_row.items()}
        if self.paged is not None:
            self.cache, *outs, steps = self._timed(shape, lambda: _decode(
                self._graphdef, self._state, self._layer_weights(), self.cache, a["tok"], a["pos"],
                a["limit"], jnp.asarray(stop_ids), table, table_lens, a["applies"], a["temperature"],
                a["top_p"], a["top_k"], key, self._pages(window)[idx], out_len=out_len, window=window))
        else:
            self.cache, *outs, steps = self._timed(shape, lambda: _decode_rows(
                self._graphdef, self._state, self._layer_weights(), self.cache, jnp.asarray(idx), a["tok"],
                a["pos"], a["limit"], jnp.asarray(stop_ids), table, table_lens, a["applies"],
                a["temperature"], a["top_p"], a["top_k"], key, out_len=out_len, window=window))
        full = []
        for x in outs:  # ids, logprobs [bucket, out_len]; count, why [bucket] -> every row (others: zeros)
            x = np.asarray(x)
            y = np.zeros((self.rows, *x.shape[1:]), x.dtype)
            y[idx] = x
            full.append(y)
        return (*full, steps)


# --- device functions: the sampler's bodies on a gathered sub-cache -----------------------------------------
def _gather(cache: KVCache, idx: jax.Array, window: int) -> KVCache:
    return KVCache(k=cache.k[:, idx, ..., :window], v=cache.v[:, idx, :, :window])


def _scatter(cache: KVCache, idx: jax.Array, window: int, sub: KVCache) -> KVCache:
    return KVCache(k=cache.k.at[:, idx, ..., :window].set(sub.k),
                   v=cache.v.at[:, idx, :, :window].set(sub.v))


def _prefill_rows_impl(graphdef, state, cache: KVCache, idx, ids, write_start, *, window: int) -> KVCache:
    """``_prefill_impl`` on rows ``idx`` (slots < window); padding rows' write start >= window drops them."""
    sub = _prefill_impl(graphdef, state, _gather(cache, idx, window), ids, write_start, window=window)
    return _scatter(cache, idx, window, sub)


def _decode_rows_impl(graphdef, state, layers, cache: KVCache, idx, tok, pos, limit, stop_ids, table,
                      table_lens, applies, temperature, top_p, top_k, key, *, out_len: int, window: int):
    """``_decode_impl`` on rows ``idx`` (slots < window); padding rows have limit 0 and write nothing.
    Sampled draws key on a row's place in the bucket (greedy replies are unaffected)."""
    sub, *outs = _decode_impl(graphdef, state, layers, _gather(cache, idx, window), tok, pos, limit, stop_ids,
                              table, table_lens, applies, temperature, top_p, top_k, key, out_len=out_len,
                              window=window)
    return (_scatter(cache, idx, window, sub), *outs)


_prefill_rows = MeshFromArgs(jax.jit(_prefill_rows_impl, static_argnums=(0,), donate_argnums=(2,),
                                     static_argnames=("window",)))
_decode_rows = MeshFromArgs(jax.jit(_decode_rows_impl, static_argnums=(0,), donate_argnums=(3,),
                                    static_argnames=("out_len", "window")))
