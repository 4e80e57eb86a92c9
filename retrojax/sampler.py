"""Batched multi-turn KV-cache sampler whose rows rewind with the environment.

Each trial owns one *row* of a fixed-shape KV cache (``rows`` × ``max_len`` slots). Per agent tick the caller:

    sampler.append(rows, chunks)               # new observation tokens: one jitted prefill (bucketed)
    outs = sampler.generate(rows, 256, key=k,  # one jitted lax.while_loop until every listed row stopped
                            stop_token_ids=[im_end], stop_strings=["</action>"])
    pos = sampler.mark(row)                    # at an environment checkpoint C_j: remember the position
    sampler.rewind(row, pos)                   # rewind to C_j: the row's context is that prefix again
    sampler.reset(row)                         # a new trial in this row

Generated tokens become part of the row's conversation (the next append continues after them). Rows not listed
in a call are never written. Rewinding recomputes nothing: slot i always holds the keys/values of conversation
token i, so returning to a prefix is a change of the row's length on host; later appends overwrite the stale
slots.

Bookkeeping (host, numpy): per-row token ids and lengths (:class:`retrojax.sampling.rows.RowBook`). The last
token of a conversation is *pending* — its keys/values are written by the next append or by the first decode
step, which needs its logits anyway — so every slot is written exactly once and no logits are stored.

Device (jit, static shapes, cache donated; the cached forward pass is ``Qwen3.hidden_cached``, which
updates the cache in place and limits attention to a power-of-two window of leading slots that covers the
listed rows — ``min_window`` up to ``max_len``): ``_prefill`` writes up to one bucket of tokens per row
(``chunk_buckets``; longer chunks go in several calls), ``_decode`` runs the whole decode in one
``lax.while_loop`` (its layers unrolled over per-layer weight copies on CPU, scanned elsewhere; see
below): sampling (:mod:`retrojax.sampling.distribution`), stop token ids, stop strings via per-token
automaton tables (:mod:`retrojax.sampling.stops`), per-row token limits. Compilations are bounded:
per attention window, one per chunk bucket and one per (power-of-two max_new_tokens, stop-id count,
stop-string table shape); :func:`program_bounds` counts them for a run's stage bound (retrojax.programs).

Decode on CPU reads each layer's weights from its own array (``Qwen3.layer_weights``, sliced once per model
and kept until ``update_model``): a matmul on CPU cannot read a slice of the stacked weights in place, and
slicing per step (a layer scan) or per call (page faults on a fresh copy) cost more than the decode itself at
real widths. The price is one more copy of the layer weights in memory while the sampler holds them. On an
accelerator the decode scans one compiled layer body over the stacked weights and holds no copies
(``layer_copies``, ``sampler.layer_copies``; auto = copies on CPU only: ``retrojax.model.qwen3.
use_layer_copies``).

Paged keys/values (``kv="paged"``; :mod:`retrojax.sampling.pages`, docs/paged-cache.md): instead of
``rows`` × ``max_len`` slots, one pool of fixed-size pages and a page table per row. A row takes pages as it
grows and returns them when it rewinds past them or resets (a rewind truncates the page table, keeping the
partially used last page); rows whose conversations start with the same full pages (the trials of one task, a
server's requests with one system prompt) hold those pages once, and a write into a shared page copies it
first. The tokens and log-probs are those of the dense cache: on CPU attention gathers each row's pages into
the dense window's layout; on GPU/TPU prefill, appends and decode read only each row's used pages in a Pallas
kernel (retrojax.kernels.paged_attention). When a call needs more pages than are free, rows outside the call
are evicted (least recently used first: their pages go back to the pool, their conversation stays on host) and
recomputed by a prefill when next used; a call whose own rows do not fit together runs in groups that do
(recompute preemption: no host copy of keys/values is kept, a prefill is cheap next to a decode of the same
tokens).

Capacity: a row holds at most ``max_len`` tokens. ``append`` past it raises :class:`CacheOverflowError` before
anything is written (check ``room(row)`` first); ``generate`` stops a row that fills up with finish reason
``length`` and says so in ``Generation.reason``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retrojax.model.qwen3 import (
    PAGE_K_AXES,
    PAGE_V_AXES,
    KVCache,
    PagedKVCache,
    Qwen3,
    init_cache,
    init_paged_cache,
    use_layer_copies,
)
from retrojax.parallel.rules import MeshFromArgs, partition_spec, rules_for
from retrojax.parallel.shard import model_mesh, place_cache
from retrojax.sampling.distribution import row_keys, sample
from retrojax.sampling.pages import PAGE_SIZE, PageBook, pages_for
from retrojax.sampling.rows import CacheOverflowError, RowBook, SamplerError, bucket_for, clip_buckets
from retrojax.sampling.stops import (
    StopStringTables,
    first_stop_token_index,
    pow2_at_least,
    token_bytes_table,
    truncate_text,
)

__all__ = ["CacheOverflowError", "Generation", "Sampler", "SamplerError"]

_WHY_LENGTH, _WHY_STOP_TOKEN, _WHY_STOP_STRING = 0, 1, 2
_NO_WRITE = 1 << 30  # a write start past every cache and window: the row is not written
KV_KINDS = ("paged", "dense")

# How often each jitted function was traced (= compiled); tests bound it.
TRACES: collections.Counter[str] = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Generation:
    """One row's reply from :meth:`Sampler.generate`.

    ``ids``/``logprobs`` cover every generated token (all of them are now in the row's conversation, including
    a final stop token). ``text`` is the decoded reply without a final stop token and cut just after the first
    stop string (None without a tokenizer). ``finish_reason`` is ``'stop'`` or ``'length'``; ``reason`` says
    which stop token/string or which limit (``max_new_tokens`` or a full cache row); ``stop`` is the stop
    token id or stop string that ended it, else None.
    """

    row: int
    ids: np.ndarray
    logprobs: np.ndarray
    text: str | None
    finish_reason: str
    reason: str
    stop: int | str | None = None


class Sampler:
    """Fixed ``rows`` × ``max_len`` KV cache over a :class:`Qwen3` model; see the module docstring.

    ``tokenizer`` (optional) needs ``decode(ids) -> str`` for ``Generation.text`` and a readable vocabulary
    for stop strings (see :func:`retrojax.sampling.stops.token_bytes_table`). ``chunk_buckets`` are the
    prefill lengths compiled for. ``cache_dtype`` defaults to the model's dtype. ``min_out_len``: the
    shortest output buffer a decode program is compiled for; a caller whose calls ask for different token
    counts (a policy's 24-token moves and 96-token reflections) sets the largest, so they share one program
    per (rows, window). Only the buffer's size changes: the loop stops at each row's limit, so the tokens
    are the same.

    ``kv``: ``"dense"`` (``rows`` × ``max_len`` slots) or ``"paged"`` (module docstring): a pool of ``pages``
    pages of ``page_size`` slots (default: room for every row at ``max_len``, so nothing is ever evicted; at
    least one full row) shared by the rows; a window that is not whole pages reads its last page in part.

    ``layer_copies`` (``sampler.layer_copies``): decode over per-layer weight copies (True) or a layer scan
    over the stacked weights (False); None takes the model's ``layer_copies`` attribute (set from the config
    by ``build_model``), else ``auto`` (``retrojax.model.qwen3.use_layer_copies``: copies on CPU only).
    """

    def __init__(
        self,
        model: Qwen3,
        *,
        rows: int,
        max_len: int,
        tokenizer: Any = None,
        chunk_buckets: Sequence[int] = (32, 128, 512, 2048),
        cache_dtype: Any = None,
        min_window: int = 256,
        min_out_len: int = 16,
        kv: str = "dense",
        page_size: int = PAGE_SIZE,
        pages: int | None = None,
        layer_copies: bool | str | None = None,
    ):
        self.config = model.config
        self.layer_copies = use_layer_copies(getattr(model, "layer_copies", "auto") if layer_copies is None
                                             else layer_copies)
        self.book = RowBook(rows, max_len, self.config.vocab_size)
        self.buckets = clip_buckets(chunk_buckets, max_len)
        if isinstance(min_window, bool) or not isinstance(min_window, int) or min_window <= 0:
            raise SamplerError(f"min_window must be a positive int, got {min_window!r}")
        self.min_window = min_window
        if isinstance(min_out_len, bool) or not isinstance(min_out_len, int) or min_out_len <= 0:
            raise SamplerError(f"min_out_len must be a positive int, got {min_out_len!r}")
        self.min_out_len = min_out_len
        self.tokenizer = tokenizer
        self._graphdef, self._state = nnx.split(model)
        self._layers: list[dict[str, jax.Array]] | None = None  # per-layer weight copies (first decode)
        if kv not in KV_KINDS:
            raise SamplerError(f"kv must be one of {KV_KINDS}, got {kv!r}")
        self.kv = kv
        self.paged: PageBook | None = None
        if kv == "paged":
            if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
                raise SamplerError(f"page_size must be a positive int, got {page_size!r}")
            per_row = pages_for(max_len, page_size)
            pages = rows * per_row + 1 if pages is None else int(pages)
            if pages < per_row + 1:
                raise SamplerError(f"pages={pages}: the pool must hold one full row ({per_row} pages of "
                                   f"{page_size} slots) and the null page")
            self.paged = PageBook(rows, pages, page_size, per_row)
            self.cache: KVCache | PagedKVCache = _place_pages(
                init_paged_cache(self.config, pages, page_size, cache_dtype or model.dtype), model)
        else:
            self.cache = place_cache(init_cache(self.config, rows, max_len, cache_dtype or model.dtype),
                                     model)  # on a mesh: rows over data×fsdp, kv heads over tp
        self._last_use = np.zeros((rows,), np.int64)  # paged: each row's last call (eviction order)
        self._lost = np.zeros((rows,), np.int64)  # paged: slots an eviction dropped (recomputed on next use)
        self._calls = 0
        self._stop_tables: StopStringTables | None = None
        self._device_tables: dict[tuple[str, ...], tuple[jax.Array, jax.Array]] = {}
        self.stats = {"prefill_tokens": 0, "prefill_calls": 0, "decode_calls": 0, "decode_steps": 0,
                      "generated_tokens": 0, "shared_pages": 0, "copied_pages": 0, "evicted_rows": 0,
                      "recomputed_tokens": 0}

    # --- public: sizes and bookkeeping ------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.book.rows

    @property
    def max_len(self) -> int:
        return self.book.max_len

    def length(self, row: int) -> int:
        """Tokens in ``row``'s conversation."""
        return int(self.book.length[self.book.row(row)])

    def room(self, row: int) -> int:
        """Tokens ``row`` can still take (appended or generated) before its cache row is full."""
        row = self.book.row(row)
        return self.max_len - int(self.book.length[row])

    def tokens(self, row: int) -> np.ndarray:
        """A copy of ``row``'s conversation ids (prompt, appended and generated tokens, in order)."""
        row = self.book.row(row)
        return self.book.tokens[row, : self.book.length[row]].copy()

    def mark(self, row: int) -> int:
        """The row's current position (its length); pass it to :meth:`rewind` later."""
        return self.length(row)

    def rewind(self, row: int, position: int) -> None:
        """Return ``row`` to its first ``position`` tokens, exactly as before the later tokens; no compute.

        ``position`` refers to the row's *current* conversation (0 ≤ position ≤ length).
        """
        row = self.book.row(row)
        self.book.length[row] = self.book.position(row, position)
        if self.paged is not None:  # pages past the mark go back to the pool; the last partial one stays
            self.paged.truncate(row, max(int(self.book.length[row]) - 1, 0))

    def reset(self, row: int) -> None:
        """Empty ``row`` (a new conversation)."""
        self.rewind(row, 0)

    def update_model(self, model: Qwen3) -> None:
        """Sample from new weights of the same architecture (e.g. after a learner update).

        Cached keys/values were computed with the old weights; reset or rewind rows whose context must be
        recomputed. Paged: no row shares a page computed before the update.
        """
        if model.config != self.config:
            raise SamplerError("update_model needs a model with the same config as the sampler's")
        self._graphdef, self._state = nnx.split(model)
        self._layers = None
        if self.paged is not None:
            self.paged.forget_prefixes()

    def release_weights(self) -> None:
        """Let go of the weights and the per-layer copies (a learner update is about to replace them), so
        the update does not hold them beside its own; rows and the cache stay. ``update_model`` brings
        weights back; sampling before it raises :class:`SamplerError`."""
        self._state = None
        self._layers = None

    def _weights(self) -> Any:
        if self._state is None:
            raise SamplerError("the sampler's weights were released (release_weights); call update_model "
                               "with the new model first")
        return self._state

    # --- public: device work ------------------------------------------------------------------------
    def append(self, rows: Sequence[int], token_chunks: Sequence[Sequence[int]]) -> None:
        """Append ``token_chunks[i]`` to row ``rows[i]``'s conversation (prefill), all rows together.

        Raises :class:`CacheOverflowError` (writing nothing) if a row would exceed ``max_len``.
        """
        self._weights()  # released weights: an error before any row changes
        rows = self.book.row_list(rows)
        if isinstance(token_chunks, (str, bytes)) or len(token_chunks) != len(rows):
            raise SamplerError(f"append needs one token chunk per row: {len(rows)} rows")
        chunks = [self.book.chunk(r, c) for r, c in zip(rows, token_chunks, strict=True)]
        over = [(r, int(self.book.length[r]), c.size) for r, c in zip(rows, chunks, strict=True)
                if self.book.length[r] + c.size > self.max_len]
        if over:
            detail = ", ".join(f"row {r}: {n} + {k} tokens" for r, n, k in over)
            raise CacheOverflowError(f"append would exceed max_len={self.max_len} ({detail}); nothing "
                                     "written. Rewind/reset the row or use a longer cache.")
        if self.paged is not None:
            grown = [r for r, c in zip(rows, chunks, strict=True) if c.size]
            for r, c in zip(rows, chunks, strict=True):
                self.book.extend(r, c)
                self.stats["prefill_tokens"] += int(c.size)
            for group in self._groups(grown, {r: int(self.book.length[r]) - 1 for r in grown}):
                self._materialize(group)
            return
        pending: dict[int, tuple[int, np.ndarray]] = {}
        for r, c in zip(rows, chunks, strict=True):
            if c.size == 0:
                continue
            start = self.book.written(r)
            self.book.extend(r, c)
            self.stats["prefill_tokens"] += int(c.size)
            # write every token but the new last one (it stays pending), starting at the old pending token
            to_write = self.book.tokens[r, start : int(self.book.length[r]) - 1]
            if to_write.size:
                pending[r] = (start, to_write)
        while pending:
            width = bucket_for(max(t.size for _, t in pending.values()), self.buckets)
            ids = np.zeros((self.rows, width), dtype=np.int32)
            write_start = np.full((self.rows,), self.max_len, dtype=np.int32)
            left: dict[int, tuple[int, np.ndarray]] = {}
            reach = 1
            for r, (start, toks) in pending.items():
                part = toks[:width]
                ids[r, : part.size] = part
                write_start[r] = start
                reach = max(reach, start + part.size)
                if toks.size > width:
                    left[r] = (start + width, toks[width:])
            self._run_prefill(ids, write_start, self._window(reach))
            self.stats["prefill_calls"] += 1
            pending = left

    def next_logits(self, rows: Sequence[int]) -> np.ndarray:
        """Float32 logits [len(rows), V] of the next token of each listed row (rows must be non-empty)."""
        self._weights()
        rows = self._nonempty_rows(rows, "next_logits")
        if not rows:
            return np.zeros((0, self.config.vocab_size), np.float32)
        if self.paged is not None:
            out: dict[int, np.ndarray] = {}
            for group in self._groups(rows, {r: int(self.book.length[r]) for r in rows}):
                self._materialize(group)
                self._copy_pages([c for r in group for c in self.paged.reserve(r, int(self.book.length[r]))])
                logits = self._next_logits_rows(group)
                for r in group:
                    out[r] = logits[r]
                    self.paged.trim(r)  # the pending token's slot was written, not kept: it stays pending
            return np.stack([out[r] for r in rows])
        return self._next_logits_rows(rows)[rows]

    def _next_logits_rows(self, rows: list[int]) -> np.ndarray:
        """Logits [self.rows, V] of the listed rows' pending tokens (one device call; other rows: garbage)."""
        tok = np.zeros((self.rows,), dtype=np.int32)
        pos = np.full((self.rows,), self.max_len, dtype=np.int32)
        for r in rows:
            pos[r] = self.book.length[r] - 1
            tok[r] = self.book.tokens[r, pos[r]]
        window = self._window(int(pos[rows].max()) + 1)
        logits, self.cache = _next_logits(self._graphdef, self._weights(), self.cache, jnp.asarray(tok),
                                          jnp.asarray(pos), self._pages(window), window=window)
        return np.asarray(logits)

    def generate(
        self,
        rows: Sequence[int],
        max_new_tokens: int | Sequence[int],
        temperature: float | Sequence[float] = 1.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] | Sequence[Sequence[str]] = (),
        key: jax.Array | None = None,
    ) -> list[Generation]:
        """Decode all listed rows together until each hits a stop token/string, its token limit or a full row.

        ``max_new_tokens``: one limit for all rows or one per listed row. ``stop_token_ids``: ids that end a
        row (``None``: the tokenizer's ``stop_token_ids`` if it has them, else none; ``()``: none).
        ``stop_strings``: strings that end a row, for all rows (``["</action>"]``) or one list per listed row
        (``[["</action>"], ["</remark>"]]``). ``temperature``/``top_p``/``top_k``: one value for all rows or
        one per listed row (rows with different settings still decode together). Greedy where
        ``temperature == 0``; otherwise ``key`` (a ``jax.random`` key) is required, and the same key and
        inputs give the same tokens. Returns one :class:`Generation` per listed row, in order.
        """
        self._weights()
        rows = self._nonempty_rows(rows, "generate")
        limits = self._check_limits(max_new_tokens, len(rows))
        knobs = [self._check_knobs(t, p, k) for t, p, k in zip(
            self._per_row(temperature, len(rows), "temperature"), self._per_row(top_p, len(rows), "top_p"),
            self._per_row(top_k, len(rows), "top_k"), strict=True)]
        stop_ids = self._check_stop_ids(stop_token_ids)
        row_strings = self._check_stop_strings(stop_strings, len(rows))
        if any(t > 0 for t, _, _ in knobs) and key is None:
            raise SamplerError("sampling with temperature > 0 needs an explicit key=jax.random.key(...)")
        if not rows:
            return []
        key = jax.random.key(0) if key is None else key

        tok = np.zeros((self.rows,), dtype=np.int32)
        pos = np.zeros((self.rows,), dtype=np.int32)
        limit = np.zeros((self.rows,), dtype=np.int32)
        temperature = np.zeros((self.rows,), dtype=np.float32)
        top_p = np.ones((self.rows,), dtype=np.float32)
        top_k = np.zeros((self.rows,), dtype=np.int32)
        for r, (t, p, k) in zip(rows, knobs, strict=True):
            temperature[r], top_p[r], top_k[r] = t, p, k
        for r, lim in zip(rows, limits, strict=True):
            n = int(self.book.length[r])
            tok[r], pos[r] = self.book.tokens[r, n - 1], n - 1
            limit[r] = min(lim, self.max_len - n)
        stop_id_arr = np.full((pow2_at_least(len(stop_ids)),), -1, dtype=np.int32)
        stop_id_arr[: len(stop_ids)] = stop_ids
        all_strings = tuple(dict.fromkeys(x for strings in row_strings for x in strings))
        table, table_lens = self._stop_string_tables(all_strings)
        applies = np.zeros((self.rows, table_lens.shape[0]), dtype=bool)
        for r, strings in zip(rows, row_strings, strict=True):
            applies[r, [all_strings.index(x) for x in strings]] = True
        out_len = pow2_at_least(max(limits), max(16, self.min_out_len))
        window = self._window(max(int(pos[r] + max(limit[r], 1)) for r in rows))

        per_row = {"tok": tok, "pos": pos, "limit": limit, "applies": applies, "temperature": temperature,
                   "top_p": top_p, "top_k": top_k}
        if self.paged is None:
            out_ids, out_lp, count, why, steps = self._run_decode(
                per_row, stop_id_arr, table, table_lens, key, out_len=out_len, window=window)
            self.stats["decode_calls"] += 1
            self.stats["decode_steps"] += int(steps)
        else:
            out_ids, out_lp, count, why = self._decode_paged(
                rows, per_row, stop_id_arr, table, table_lens, key, out_len=out_len)
        gens = [self._finish_row(r, out_ids[r, : count[r]], out_lp[r, : count[r]], int(why[r]), lim, strings)
                for r, lim, strings in zip(rows, limits, row_strings, strict=True)]
        if self.paged is not None:
            for r in rows:  # a reply cut on host (stop string) holds keys/values past its conversation
                self.paged.truncate(r, int(self.book.length[r]) - 1)
        return gens

    # --- paged keys/values ----------------------------------------------------------------------------
    def _decode_paged(self, rows: list[int], per_row: dict[str, np.ndarray], stop_ids: np.ndarray,
                      table: jax.Array, table_lens: jax.Array, key: jax.Array, *, out_len: int) -> tuple:
        """``generate``'s decode over pages: each group of rows that fits the pool gets its conversation's
        keys and values (recomputed if evicted) and pages for every token it may write, then decodes. A row's
        draws depend on (key, step, row) only, so groups give the tokens one call would."""
        pos, limit = per_row["pos"], per_row["limit"]
        out_ids = np.zeros((self.rows, out_len), np.int32)
        out_lp = np.zeros((self.rows, out_len), np.float32)
        count = np.zeros((self.rows,), np.int32)
        why = np.zeros((self.rows,), np.int32)
        for group in self._groups(rows, {r: int(pos[r] + limit[r]) for r in rows}):
            self._materialize(group)
            self._copy_pages([c for r in group for c in self.paged.reserve(r, int(pos[r] + limit[r]))])
            sub = dict(per_row)
            sub["limit"] = np.zeros_like(limit)
            sub["limit"][group] = limit[group]
            window = self._window(max(int(pos[r] + max(limit[r], 1)) for r in group))
            ids, lp, n, w, steps = self._run_decode(sub, stop_ids, table, table_lens, key, out_len=out_len,
                                                    window=window)
            self.stats["decode_calls"] += 1
            self.stats["decode_steps"] += int(steps)
            for r in group:
                out_ids[r], out_lp[r], count[r], why[r] = ids[r], lp[r], n[r], w[r]
                tokens = np.concatenate([self.book.tokens[r, : int(self.book.length[r])], ids[r, : n[r]]])
                self.paged.wrote(r, int(pos[r] + n[r]), tokens)
                self.paged.trim(r)
        return out_ids, out_lp, count, why

    def _groups(self, rows: list[int], slots: dict[int, int]):
        """Yield ``rows`` in groups whose pages (``slots[r]`` slots each) fit the pool together, making room
        for each group first. Rows evicted for room, in order: rows outside the call (least recently used
        first), rows of this call already served, rows still to come (last first); their conversations stay
        on host and are recomputed when next used."""
        pb = self.paged
        todo, done = list(rows), []
        while todo:
            group: list[int] = []
            promised = 0
            for r in todo:
                need = pb.new_pages_for(r, slots[r])
                if not self._make_room(promised + need, set(group) | {r}, rows, done, todo):
                    break
                group.append(r)
                promised += need
            if not group:  # cannot happen: the pool holds one full row (checked in __init__)
                raise SamplerError(f"row {todo[0]} does not fit the page pool ({pb.pages} pages)")
            self._calls += 1
            self._last_use[group] = self._calls
            yield group
            done += group
            todo = [r for r in todo if r not in group]

    def _make_room(self, need: int, keep: set[int], call: list[int], done: list[int],
                   todo: list[int]) -> bool:
        """Evict rows (see ``_groups``) until ``need`` pages are free; False if it cannot."""
        pb = self.paged
        if pb.free >= need:
            return True
        in_call = set(call)
        outside = sorted((r for r in range(self.rows) if r not in in_call and pb.count[r]),
                         key=lambda r: self._last_use[r])
        for r in [*outside, *done, *reversed(todo)]:
            if r in keep or not pb.count[r]:
                continue
            self._lost[r] = max(int(self._lost[r]), int(pb.kv_len[r]))
            pb.truncate(r, 0)
            self.stats["evicted_rows"] += 1
            if pb.free >= need:
                return True
        return False

    def _materialize(self, rows: list[int]) -> None:
        """Give every listed row the keys/values of its conversation but the pending last token: share indexed
        pages of the same prefix, then prefill the rest in chunk buckets. Rows that share pages another listed
        row is still writing wait for them (a row's own pages are written before any row reads them)."""
        pb = self.paged
        target = {r: max(int(self.book.length[r]) - 1, 0) for r in rows}
        work: dict[int, int] = {}
        deps: dict[int, set[int]] = {}
        claimed: list[int] = []
        copies: list[tuple[int, int]] = []
        for r in rows:
            pb.truncate(r, target[r])
            if pb.kv_len[r] >= target[r]:
                continue
            tokens = self.book.tokens[r]
            taken = pb.share(r, tokens, target[r])
            self.stats["shared_pages"] += len(taken)
            deps[r] = set(taken) & pb.pending
            if pb.kv_len[r] < target[r]:
                copies += pb.reserve(r, target[r])
                claimed += pb.claim(r, target[r], tokens)
                work[r] = int(pb.kv_len[r])
                self.stats["recomputed_tokens"] += max(min(int(self._lost[r]), target[r]) - work[r], 0)
            self._lost[r] = 0
        self._copy_pages(copies)
        try:
            while work:
                ready = [r for r in work if not deps.get(r, set()) & pb.pending]
                if not ready:
                    raise SamplerError("paged prefill: rows wait on pages no listed row writes")
                width = bucket_for(max(target[r] - work[r] for r in ready), self.buckets)
                ids = np.zeros((self.rows, width), dtype=np.int32)
                write_start = np.full((self.rows,), self.max_len, dtype=np.int32)
                reach = 1
                for r in ready:
                    part = self.book.tokens[r, work[r] : min(work[r] + width, target[r])]
                    ids[r, : part.size] = part
                    write_start[r] = work[r]
                    reach = max(reach, work[r] + part.size)
                self._run_prefill(ids, write_start, self._window(reach))
                self.stats["prefill_calls"] += 1
                for r in ready:
                    work[r] = min(work[r] + width, target[r])
                    pb.wrote(r, work[r], self.book.tokens[r])
                    if work[r] >= target[r]:
                        del work[r]
        except BaseException:
            pb.drop_pending(claimed)
            for r in rows:  # keys/values the failed calls were to write are not there
                pb.truncate(r, 0 if r in work or deps.get(r) else int(pb.kv_len[r]))
            raise

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write on device: page ``src`` to page ``dst`` for each pair (padded to a power of two)."""
        if not copies:
            return
        n = pow2_at_least(len(copies), 1)
        src = np.zeros((n,), np.int32)
        dst = np.full((n,), self.paged.pages, np.int32)  # padding: out of the pool, dropped
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self.cache = _copy_pages(self.cache, jnp.asarray(src), jnp.asarray(dst))
        self.stats["copied_pages"] += len(copies)

    def _pages(self, window: int) -> jax.Array | None:
        """The rows' page tables over ``window`` slots (paged), else None."""
        if self.paged is None:
            return None
        return jnp.asarray(self.paged.table[:, : pages_for(window, self.paged.page_size)])

    # --- device calls (a subclass may run them on a subset of the rows, e.g. retrojax.serve.batching) ----
    def _run_prefill(self, ids: np.ndarray, write_start: np.ndarray, window: int) -> None:
        """Prefill ``ids`` [rows, width] at ``write_start`` [rows] (``max_len``: row untouched)."""
        self.cache = _prefill(self._graphdef, self._weights(), self.cache, jnp.asarray(ids),
                              jnp.asarray(write_start), self._pages(window), window=window)

    def _run_decode(self, per_row: dict[str, np.ndarray], stop_ids: np.ndarray, table: jax.Array,
                    table_lens: jax.Array, key: jax.Array, *, out_len: int, window: int) -> tuple:
        """Decode every row at once. ``per_row``: host arrays [rows] (tok, pos, limit, temperature, top_p,
        top_k) and applies [rows, strings]; rows with limit 0 are untouched. Returns host arrays ids, logprobs
        [rows, out_len], count, why [rows] and the number of steps run."""
        a = {k: jnp.asarray(v) for k, v in per_row.items()}
        self.cache, out_ids, out_lp, count, why, steps = _decode(
            self._graphdef, self._weights(), self._layer_weights(), self.cache, a["tok"], a["pos"],
            a["limit"], jnp.asarray(stop_ids), table, table_lens, a["applies"], a["temperature"], a["top_p"],
            a["top_k"], key, self._pages(window), out_len=out_len, window=window)
        return (*(np.asarray(x) for x in (out_ids, out_lp, count, why)), steps)

    # --- host-side functions --------------------------------------------------------------------------
    def _window(self, reach: int) -> int:
        """Static attention window covering slots < ``reach``: a power of two >= min_window, <= max_len."""
        return min(self.max_len, pow2_at_least(reach, self.min_window))

    def windows(self) -> tuple[int, ...]:
        """Every attention window a call can use (:func:`windows`)."""
        return windows(self.max_len, self.min_window)

    def program_bounds(self, decode_shapes: int = 1, row_buckets: int = 1) -> dict[str, int]:
        """:func:`program_bounds` for this sampler."""
        return program_bounds(max_len=self.max_len, chunk_buckets=self.buckets, min_window=self.min_window,
                              decode_shapes=decode_shapes, layer_copies=self.layer_copies,
                              page_table=0 if self.paged is None else self.paged.table.size,
                              row_buckets=row_buckets)

    def _nonempty_rows(self, rows: Sequence[int], what: str) -> list[int]:
        rows = self.book.row_list(rows)
        empty = [r for r in rows if self.book.length[r] == 0]
        if empty:
            raise SamplerError(f"{what}: row(s) {empty} are empty; append a prompt first")
        return rows

    def _check_limits(self, max_new_tokens, n_rows: int) -> list[int]:
        per_row = [max_new_tokens] * n_rows if isinstance(max_new_tokens, (int, np.integer)) \
            else list(max_new_tokens)
        if len(per_row) != n_rows:
            raise SamplerError(f"max_new_tokens: give one int, or one per listed row ({n_rows})")
        for m in per_row:
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
                raise SamplerError(f"max_new_tokens must be ints >= 0, got {m!r}")
        return [int(m) for m in per_row]

    @staticmethod
    def _per_row(value, n_rows: int, name: str) -> list:
        """One knob value for all listed rows, or one per listed row."""
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
            return [value] * n_rows
        values = list(value)
        if len(values) != n_rows:
            raise SamplerError(f"{name}: give one value, or one per listed row ({n_rows})")
        return values

    @staticmethod
    def _check_knobs(temperature, top_p, top_k) -> tuple[float, float, int]:
        if not isinstance(temperature, (int, float, np.number)) or not np.isfinite(temperature) \
                or temperature < 0:
            raise SamplerError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not isinstance(top_p, (int, float, np.number)) or not 0.0 < top_p <= 1.0:
            raise SamplerError(f"top_p must be in (0, 1], got {top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise SamplerError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        return float(temperature), float(top_p), int(top_k)

    def _check_stop_ids(self, stop_token_ids: Sequence[int] | None) -> list[int]:
        if stop_token_ids is None:
            stop_token_ids = [i for i in getattr(self.tokenizer, "stop_token_ids", ())
                              if i < self.config.vocab_size]
        if isinstance(stop_token_ids, (int, np.integer)):
            stop_token_ids = [stop_token_ids]
        ids = []
        for t in stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) \
                    or not 0 <= t < self.config.vocab_size:
                raise SamplerError(f"stop token id {t!r} is not an id in [0, {self.config.vocab_size})")
            ids.append(int(t))
        return sorted(set(ids))

    def _check_stop_strings(self, stop_strings, n_rows: int) -> list[tuple[str, ...]]:
        """One tuple of stop strings per listed row (a flat list applies to every row)."""
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        stop_strings = list(stop_strings)
        per_row = stop_strings if stop_strings and not isinstance(stop_strings[0], str) \
            else [stop_strings] * n_rows
        if len(per_row) != n_rows:
            raise SamplerError(f"stop_strings: give one list for all rows, or one list per listed row "
                               f"({n_rows})")
        out = []
        for strings in per_row:
            strings = [strings] if isinstance(strings, str) else list(strings)
            for x in strings:
                if not isinstance(x, str) or not x:
                    raise SamplerError(f"stop strings must be non-empty str, got {x!r}")
            out.append(tuple(dict.fromkeys(strings)))
        if any(out) and self.tokenizer is None:
            raise SamplerError("stop_strings need a tokenizer (Sampler(..., tokenizer=...))")
        return out

    def _layer_weights(self) -> list[dict[str, jax.Array]] | None:
        """Each layer's weights as separate arrays (sliced once per model; see the module docstring), or None
        without ``layer_copies``: the decode then scans the stacked weights."""
        if not self.layer_copies:
            return None
        if self._layers is None:
            self._layers = _slice_layers(self._graphdef, self._weights())
        return self._layers

    def _stop_string_tables(self, stop_strings: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
        """Device copies of the stop-string tables (built and uploaded once per set of strings)."""
        if stop_strings not in self._device_tables:
            if not stop_strings:
                table, lens = np.zeros((1, 1, self.config.vocab_size), np.int16), np.full((1,), -1, np.int32)
            else:
                if self._stop_tables is None:
                    vocab_bytes = token_bytes_table(self.tokenizer, self.config.vocab_size)
                    self._stop_tables = StopStringTables(vocab_bytes)
                table, lens = self._stop_tables.build(stop_strings)
            if len(self._device_tables) >= 16:
                self._device_tables.pop(next(iter(self._device_tables)))
            self._device_tables[stop_strings] = (jnp.asarray(table), jnp.asarray(lens))
        return self._device_tables[stop_strings]

    def _decode_text(self, ids: Sequence[int]) -> str:
        """Decoded text; ids past the tokenizer's vocabulary (padded model vocab) decode to nothing."""
        tok = self.tokenizer
        known = len(tok) if hasattr(tok, "__len__") else getattr(tok, "vocab_size", None)
        return tok.decode([int(i) for i in ids if known is None or int(i) < known])

    def _finish_row(self, row: int, ids: np.ndarray, logprobs: np.ndarray, why: int, max_new_tokens: int,
                    stop_strings: tuple[str, ...]) -> Generation:
        """Record a row's generated tokens in its conversation and describe how it ended."""
        stop: int | str | None = None
        if why != _WHY_STOP_STRING and stop_strings and self.tokenizer is not None:
            # safety net for vocabularies whose byte table is inexact: cut at the first stop string on host
            k = first_stop_token_index(ids.tolist(), stop_strings, self._decode_text)
            if k is not None:
                ids, logprobs, why = ids[:k], logprobs[:k], _WHY_STOP_STRING
        self.book.extend(row, ids.astype(np.int32))
        self.stats["generated_tokens"] += int(ids.size)
        if why == _WHY_STOP_TOKEN:
            stop = int(ids[-1])
            finish, reason = "stop", f"stop token {stop}"
        elif why == _WHY_STOP_STRING:
            finish, reason = "stop", "stop string"
        elif ids.size >= max_new_tokens:
            finish, reason = "length", f"max_new_tokens={max_new_tokens} reached"
        else:
            finish, reason = "length", (f"cache row full: {int(self.book.length[row])} of "
                                        f"max_len={self.max_len} tokens; rewind/reset the row or use a "
                                        "longer cache")
        text = None
        if self.tokenizer is not None:
            body = ids[:-1] if why == _WHY_STOP_TOKEN else ids
            text = self._decode_text(body)
            if stop_strings:
                text, matched = truncate_text(text, stop_strings)
                if why == _WHY_STOP_STRING and matched is not None:
                    stop, reason = matched, f"stop string {matched!r}"
        return Generation(row=row, ids=ids.astype(np.int32), logprobs=logprobs.astype(np.float32), text=text,
                          finish_reason=finish, reason=reason, stop=stop)


# --- device functions ----------------------------------------------------------------------------
def windows(max_len: int, min_window: int) -> tuple[int, ...]:
    """Every attention window a sampler's call can use: powers of two from ``min_window``, then ``max_len``
    (what ``Sampler._window`` picks for some reach)."""
    out, w = [], min(max_len, pow2_at_least(1, min_window))
    while w < max_len:
        out.append(w)
        w *= 2
    return (*out, max_len)


def program_bounds(*, max_len: int, chunk_buckets: Sequence[int], min_window: int = 256,
                   decode_shapes: int = 1, layer_copies: bool = True, page_table: int = 0,
                   row_buckets: int = 1) -> dict[str, int]:
    """The most programs one sampler's calls can compile, per jitted function, from the shapes ``append``,
    ``generate`` and ``next_logits`` choose: per window (and per row bucket, ``RowBucketSampler``), a
    prefill per chunk bucket (``clip_buckets``), ``decode_shapes`` decodes (the caller's distinct (output
    length, stop-id count, stop-table shape) combinations) and one next-logits; one layer slice (with layer
    copies); paged (``page_table``: rows × pages per row), one page copy per power-of-two copy count up to
    the table. An upper bound: a window below a chunk bucket never prefills it, and callers rarely use
    ``next_logits``."""
    w = len(windows(max_len, min_window)) * row_buckets
    out = {"_prefill_impl": w * len(clip_buckets(chunk_buckets, max_len)), "_decode_impl": w * decode_shapes,
           "_next_logits_impl": w, "_slice_layers_impl": 1 if layer_copies else 0}
    if page_table:
        out["_copy_pages_impl"] = int(np.log2(pow2_at_least(page_table, 1))) + 1
    return out


def _prefill_impl(graphdef, state, cache: KVCache | PagedKVCache, ids: jax.Array, write_start: jax.Array,
                  pages: jax.Array | None = None, *, window: int) -> KVCache | PagedKVCache:
    """Write ``ids`` [R, T] into slots ``write_start[r] + t`` (write_start >= window: row untouched);
    ``pages``: the rows' page tables when ``cache`` is a page pool."""
    TRACES["prefill"] += 1
    model = nnx.merge(graphdef, state)
    positions = write_start[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    _, cache = model.hidden_cached(ids, positions, cache, write_start, window, pages=pages)
    return cache


def _next_logits_impl(graphdef, state, cache: KVCache | PagedKVCache, tok: jax.Array, pos: jax.Array,
                      pages: jax.Array | None = None, *, window: int):
    """Feed each row's pending token (write_start == max_len: row untouched) and return its logits."""
    TRACES["next_logits"] += 1
    model = nnx.merge(graphdef, state)
    hidden, cache = model.hidden_cached(tok[:, None], pos[:, None], cache, pos, window, pages=pages)
    return model.project(hidden[:, 0]), cache


def _decode_impl(graphdef, state, layers, cache: KVCache | PagedKVCache, tok, pos, limit, stop_ids, table,
                 table_lens, applies, temperature, top_p, top_k, key, pages=None, *, out_len: int,
                 window: int):
    """The whole decode: one ``lax.while_loop`` over steps, all rows in lockstep, finished rows frozen."""
    TRACES["decode"] += 1
    model = nnx.merge(graphdef, state)
    rows = tok.shape[0]
    n_strings = table.shape[0]
    string_idx = jnp.arange(n_strings)[None, :]

    def cond(c):
        return (c["i"] < jnp.max(limit)) & jnp.any(~c["done"])

    def body(c):
        live = ~c["done"]
        write = jnp.where(live, c["pos"], _NO_WRITE)
        hidden, new_cache = model.hidden_cached(c["tok"][:, None], c["pos"][:, None], c["cache"], write,
                                                window, layers, pages)
        logits = model.project(hidden[:, 0])
        new_tok, lp = sample(logits, row_keys(key, c["i"], rows), temperature, top_p, top_k)
        new_tok = jnp.where(live, new_tok, 0)
        count = c["count"] + live
        at_stop_id = jnp.any(new_tok[:, None] == stop_ids[None, :], axis=-1) & live
        sstate = jnp.where(live[:, None], table[string_idx, c["sstate"], new_tok[:, None]], c["sstate"])
        at_stop_str = jnp.any((sstate == table_lens[None, :]) & applies, axis=-1) & live
        why = jnp.where(at_stop_id, _WHY_STOP_TOKEN, jnp.where(at_stop_str, _WHY_STOP_STRING, c["why"]))
        return {
            "i": c["i"] + 1,
            "cache": new_cache,
            "tok": jnp.where(live, new_tok, c["tok"]),
            "pos": jnp.where(live, c["pos"] + 1, c["pos"]),
            "done": c["done"] | at_stop_id | at_stop_str | (count >= limit),
            "count": count,
            "why": why.astype(jnp.int32),
            "sstate": sstate.astype(table.dtype),
            "ids": c["ids"].at[:, c["i"]].set(new_tok),
            "lp": c["lp"].at[:, c["i"]].set(jnp.where(live, lp, 0.0)),
        }

    init = {
        "i": jnp.int32(0),
        "cache": cache,
        "tok": tok,
        "pos": pos,
        "done": limit <= 0,
        "count": jnp.zeros((rows,), jnp.int32),
        "why": jnp.zeros((rows,), jnp.int32),
        "sstate": jnp.zeros((rows, n_strings), table.dtype),
        "ids": jnp.zeros((rows, out_len), jnp.int32),
        "lp": jnp.zeros((rows, out_len), jnp.float32),
    }
    c = jax.lax.while_loop(cond, body, init)
    return c["cache"], c["ids"], c["lp"], c["count"], c["why"], c["i"]


def _copy_pages_impl(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Page ``src[i]`` of every layer to page ``dst[i]`` (``dst`` past the pool: dropped)."""
    TRACES["copy_pages"] += 1
    return PagedKVCache(k=cache.k.at[:, dst].set(cache.k[:, src], mode="drop"),
                        v=cache.v.at[:, dst].set(cache.v[:, src], mode="drop"))


def _place_pages(pool: PagedKVCache, model: Qwen3) -> PagedKVCache:
    """A page pool on the model's mesh (kv heads over tp, pages replicated); identity on one device."""
    mesh = model_mesh(model)
    if mesh is None:
        return pool
    rules = rules_for("rollout")

    def put(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        spec = partition_spec(axes, x.shape, mesh, rules, what="kv pages")
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

    return PagedKVCache(k=put(pool.k, PAGE_K_AXES), v=put(pool.v, PAGE_V_AXES))


def _slice_layers_impl(graphdef, state) -> list[dict[str, jax.Array]]:
    """The model's per-layer weight copies for ``_decode`` (one jit per architecture)."""
    TRACES["slice_layers"] += 1
    return nnx.merge(graphdef, state).layer_weights()


# Module-level jits: samplers over models of the same architecture share compilations (graphdef is static).
# MeshFromArgs: on a multi-device mesh they trace under the rollout sharding rules (cache layout kept).
_prefill = MeshFromArgs(jax.jit(_prefill_impl, static_argnums=(0,), donate_argnums=(2,),
                                static_argnames=("window",)))
_next_logits = MeshFromArgs(jax.jit(_next_logits_impl, static_argnums=(0,), donate_argnums=(2,),
                                    static_argnames=("window",)))
_decode = MeshFromArgs(jax.jit(_decode_impl, static_argnums=(0,), donate_argnums=(3,),
                               static_argnames=("out_len", "window")))
_slice_layers = jax.jit(_slice_layers_impl, static_argnums=(0,))
_copy_pages = MeshFromArgs(jax.jit(_copy_pages_impl, donate_argnums=(0,)))
