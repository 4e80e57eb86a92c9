"""Host-side bookkeeping of the paged KV cache: page tables, a free list with refcounts, shared prefixes.

The device holds one pool of ``pages`` fixed-size pages (:class:`retrojax.model.qwen3.PagedKVCache`); this
module decides which page holds which slots of which row. Page 0 is the *null page*: unused table entries
point at it, it absorbs the writes of padding tokens and it is never read unmasked, so it is never handed out.

A row's valid keys/values are its first ``kv_len[row]`` slots, in pages ``table[row, :count[row]]``
(``count`` may run ahead of ``kv_len``: pages reserved for a call's writes). Pages are taken as a row grows
(:meth:`PageBook.reserve`), returned when it shrinks (:meth:`PageBook.truncate`: a rewind or a reset keeps the
partially used last page) and when a call reserved more than it wrote (:meth:`PageBook.trim`).

Shared prefixes: a page whose ``page_size`` slots are all valid is registered in an index under the key
(previous page of the row, the page's token ids), so the key names the whole token prefix up to the page's end
without hashing (no collisions; a page's content is the keys/values of exactly that prefix). A row that is
about to compute a full page first looks the key up (:meth:`PageBook.share`) and, on a hit, points its table
at the existing page and takes a reference instead. A write into a page held by several rows (a row rewound
into a shared page) copies it first (:meth:`PageBook.reserve` returns the copies to make): copy-on-write. A
page returns to the free list, and leaves the index, when its last row lets go.

Invariants (tests/test_sampler_paged.py checks them under random operations with hypothesis):
``refcount[p]`` is the number of table entries pointing at page ``p``; free pages have refcount 0 and no table
entry; the free list and the held pages partition pages 1..P-1; an indexed page that is not pending holds, in
every slot, the keys/values of the prefix its key names: a write into it copies it first when other rows hold
it, and takes it out of the index first when its only holder writes (a row rewound into it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

NULL_PAGE = 0
PAGE_SIZE = 64  # the samplers' default: a partly used last page wastes under 32 slots a row on average


class PoolFullError(RuntimeError):
    """The pool has no free page for a reservation (the sampler evicts rows before this can happen)."""


def pages_for(slots: int, page_size: int) -> int:
    """Pages that hold ``slots`` slots."""
    return -(-int(slots) // int(page_size))


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Bytes of keys and values one token takes in every layer (``config``: a Qwen3 config)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * int(dtype_bytes)


def kv_bytes_per_page(config: Any, page_size: int, dtype_bytes: int) -> int:
    """Bytes of one page of the pool (all layers' keys and values of ``page_size`` slots)."""
    return kv_bytes_per_token(config, dtype_bytes) * int(page_size)


def pages_per_row(tokens: int, page_size: int, reserve: int = 0) -> int:
    """Pages a row with ``tokens`` tokens in its conversation holds while a call may write ``reserve`` more
    (its keys/values cover every token but the pending last one; a call reserves pages for its writes)."""
    return pages_for(max(int(tokens) - 1, 0) + int(reserve), page_size)


class PageBook:
    """Page tables, reference counts, the free list and the shared-prefix index (see the module docstring)."""

    def __init__(self, rows: int, pages: int, page_size: int, max_pages: int):
        if pages < 2 or page_size < 1 or max_pages < 1:
            raise ValueError(f"need pages >= 2, page_size >= 1, max_pages >= 1; got {pages}, {page_size}, "
                             f"{max_pages}")
        self.rows, self.pages, self.page_size, self.max_pages = int(rows), int(pages), int(page_size), \
            int(max_pages)
        self.table = np.zeros((rows, max_pages), np.int32)
        self.count = np.zeros((rows,), np.int64)  # pages in each row's table
        self.kv_len = np.zeros((rows,), np.int64)  # valid slots of each row
        self.refcount = np.zeros((pages,), np.int64)
        self._free = list(range(pages - 1, 0, -1))  # a stack: the lowest page is handed out first
        self._index: dict[tuple[int, bytes], int] = {}
        self._key_of: dict[int, tuple[int, bytes]] = {}
        self._children: dict[int, set[int]] = {}
        self.pending: set[int] = set()  # indexed pages whose content a running append has yet to write

    # --- queries --------------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def held(self) -> int:
        """Distinct pages some row holds."""
        return self.pages - 1 - len(self._free)

    def row_pages(self, row: int) -> np.ndarray:
        return self.table[row, : self.count[row]].copy()

    def new_pages_for(self, row: int, slots: int) -> int:
        """Free pages a reservation of ``slots`` slots for ``row`` takes (new pages, one copy-on-write)."""
        n = max(pages_for(slots, self.page_size) - int(self.count[row]), 0)
        return n + int(self._needs_copy(row, slots))

    def indexed(self, page: int) -> bool:
        return page in self._key_of

    def indexed_prefixes(self) -> list[tuple[int, np.ndarray]]:
        """(page, the token ids it holds keys/values of) for every written indexed page (none pending)."""
        return [(page, np.frombuffer(key[1], np.int32)) for page, key in self._key_of.items()
                if page not in self.pending]

    # --- changes --------------------------------------------------------------------------------------
    def truncate(self, row: int, slots: int) -> None:
        """Keep ``row``'s first ``slots`` valid slots (at most its current ones) and the pages holding
        them."""
        slots = min(int(slots), int(self.kv_len[row]))
        keep = pages_for(slots, self.page_size)
        for p in self.table[row, keep : self.count[row]]:
            self._release(int(p))
        self.table[row, keep : self.count[row]] = NULL_PAGE
        self.count[row] = min(int(self.count[row]), keep)
        self.kv_len[row] = slots  # a kept, partly valid indexed page keeps its content until a write

    def reserve(self, row: int, slots: int) -> list[tuple[int, int]]:
        """Give ``row`` pages for its first ``slots`` slots before a call writes from ``kv_len[row]`` on.

        Returns the copies (source page, new page) the device must make first: the page the write starts in,
        when other rows hold it too (copy-on-write). Raises :class:`PoolFullError` (changing nothing) when the
        free list is too short.
        """
        slots = int(slots)
        want = pages_for(slots, self.page_size)
        if want > self.max_pages:
            raise ValueError(f"row {row}: {slots} slots need {want} pages, a table holds {self.max_pages}")
        if self.new_pages_for(row, slots) > len(self._free):
            raise PoolFullError(f"row {row}: {self.new_pages_for(row, slots)} pages wanted, "
                                f"{len(self._free)} free")
        copies = []
        if self._needs_copy(row, slots):
            i = int(self.kv_len[row]) // self.page_size
            old = int(self.table[row, i])
            new = self._take()
            self.table[row, i] = new
            self._release(old)
            copies.append((old, new))
        elif slots > int(self.kv_len[row]):
            start = int(self.kv_len[row]) // self.page_size
            if start < self.count[row]:
                page = int(self.table[row, start])
                if page not in self.pending:  # its only holder overwrites it: no longer that prefix
                    self._unindex(page)
        for i in range(int(self.count[row]), want):
            self.table[row, i] = self._take()
        self.count[row] = max(int(self.count[row]), want)
        return copies

    def wrote(self, row: int, slots: int, tokens: np.ndarray) -> None:
        """``row``'s first ``slots`` slots hold keys/values of ``tokens[:slots]``: index its full pages."""
        before, slots = int(self.kv_len[row]), int(slots)
        if pages_for(slots, self.page_size) > self.count[row]:
            raise ValueError(f"row {row}: {slots} slots written, {int(self.count[row])} pages reserved")
        self.kv_len[row] = slots
        ps = self.page_size
        for i in range(before // ps, slots // ps):
            page = int(self.table[row, i])
            self.pending.discard(page)
            if page in self._key_of:
                continue
            key = self._key(row, i, tokens)
            if key not in self._index:
                self._index[key] = page
                self._key_of[page] = key
                self._children.setdefault(key[0], set()).add(page)

    def trim(self, row: int) -> None:
        """Return the pages ``row`` reserved beyond its valid slots."""
        keep = pages_for(int(self.kv_len[row]), self.page_size)
        for p in self.table[row, keep : self.count[row]]:
            self._release(int(p))
        self.table[row, keep : self.count[row]] = NULL_PAGE
        self.count[row] = min(int(self.count[row]), keep)

    def share(self, row: int, tokens: np.ndarray, upto: int) -> list[int]:
        """Point ``row``'s next pages at indexed pages holding the same prefix, as far as ``tokens[:upto]``
        fills whole pages; returns the pages taken (their slots are valid for the row, or will be once the
        append writing a pending one ends). Only from a page boundary, with no page reserved past
        ``kv_len``."""
        ps, taken = self.page_size, []
        if int(self.kv_len[row]) % ps or int(self.count[row]) * ps != int(self.kv_len[row]):
            return taken
        i = int(self.count[row])
        while (i + 1) * ps <= upto and i < self.max_pages:
            key = self._key(row, i, tokens)
            page = self._index.get(key)
            if page is None:
                break
            self.refcount[page] += 1
            self.table[row, i] = page
            i += 1
            taken.append(page)
        self.count[row] = i
        self.kv_len[row] = i * ps
        return taken

    def claim(self, row: int, upto: int, tokens: np.ndarray) -> list[int]:
        """Index the full pages ``row`` is about to write (slots ``kv_len`` .. ``upto``, pages reserved) as
        *pending*, so rows appended with it can share them once written; returns them."""
        ps, out = self.page_size, []
        for i in range(-(-int(self.kv_len[row]) // ps), int(upto) // ps):
            page = int(self.table[row, i])
            key = self._key(row, i, tokens)
            if page in self._key_of or key in self._index:
                continue
            self._index[key] = page
            self._key_of[page] = key
            self._children.setdefault(key[0], set()).add(page)
            self.pending.add(page)
            out.append(page)
        return out

    def forget_prefixes(self) -> None:
        """Empty the shared-prefix index (new weights: held pages stay with their rows, none is shared)."""
        self._index.clear()
        self._key_of.clear()
        self._children.clear()
        self.pending.clear()

    def drop_pending(self, pages: Iterable[int]) -> None:
        """Pending pages that were not written after all (a failed call) leave the index."""
        for p in pages:
            if p in self.pending:
                self._unindex(p)

    def check(self) -> None:
        """Raise AssertionError if an invariant (module docstring) does not hold."""
        counts = np.zeros((self.pages,), np.int64)
        for r in range(self.rows):
            n = int(self.count[r])
            assert 0 <= self.kv_len[r] <= n * self.page_size, (r, self.kv_len[r], n)
            assert np.all(self.table[r, n:] == NULL_PAGE)
            assert np.all(self.table[r, :n] != NULL_PAGE)
            np.add.at(counts, self.table[r, :n], 1)
        assert np.array_equal(counts[1:], self.refcount[1:]), "refcounts differ from the tables"
        free = set(self._free)
        assert len(free) == len(self._free) and NULL_PAGE not in free
        assert all(self.refcount[p] == 0 for p in free)
        assert free | {p for p in range(1, self.pages) if self.refcount[p] > 0} == set(range(1, self.pages))
        for page, key in self._key_of.items():
            assert self._index[key] == page and self.refcount[page] > 0

    # --- internals ------------------------------------------------------------------------------------
    def _key(self, row: int, i: int, tokens: np.ndarray) -> tuple[int, bytes]:
        """The index key of ``row``'s page ``i``: (its previous page, its tokens as int32 bytes)."""
        ps = self.page_size
        return (int(self.table[row, i - 1]) if i else -1,
                np.asarray(tokens[i * ps : (i + 1) * ps], np.int32).tobytes())

    def _needs_copy(self, row: int, slots: int) -> bool:
        """The write from ``kv_len`` starts inside a page other rows hold too."""
        kv = int(self.kv_len[row])
        i = kv // self.page_size
        return slots > kv and i < self.count[row] and self.refcount[int(self.table[row, i])] > 1

    def _take(self) -> int:
        page = self._free.pop()
        self.refcount[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._unindex(page)
            self._free.append(page)

    def _unindex(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        self.pending.discard(page)
        if key is None:
            return
        del self._index[key]
        self._children.get(key[0], set()).discard(page)
        for child in list(self._children.pop(page, ())):  # their keys name this page's old prefix
            self._unindex(child)
