"""Training sequences → rows of a token forest: packed sequences and shared prefixes, each token once.

Four layouts (``learn.layout``):

- ``rows``: one right-padded sequence per row (``retrojax.learn.batch``; kept for comparison);
- ``packed``: several sequences per row, each a chain with positions restarting at 0, attending only within
  itself; rows filled to a token budget;
- ``tree``: the sequences of a row share their common prefixes as a token tree (the trials of a task share the
  prompt, the resumed and the abandoned branch of a rewind share the C_j prefix): every distinct prefix token
  is one position, its position id is its depth, and it attends to exactly its ancestors;
- ``tree_long``: ``tree`` with long rows (``pack(long_rows=True)``): a row holds up to the microbatch budget,
  so a whole task tree is usually one row and each of its prefixes is laid out once.

A row is laid out in DFS preorder, so every token's subtree is an index interval ``[i, tree_exit[i])`` and
"key j is an ancestor-or-self of query i" is ``j <= i < tree_exit[j]`` (see ``retrojax.model.qwen3.
tree_block_mask``): the whole attention description is one int32 per token, from which the model computes
each query block's mask on the fly. Trained tokens are separate *terms* ``[rows, K]``: term k of a row is
predicted by the row's token ``term_node[k]`` and carries its own target, advantage, weight and old log-prob,
so two trials that wrote the same tokens in the same context keep their own terms on one shared node. Only
the terms pay for the LM head.

Packing (host numpy): a row's sequences are inserted in lexicographic order of their input tokens, so the
longest prefix a new sequence shares with a row is the one it shares with the row's last sequence, a new
sequence adds ``len - lcp`` nodes, and creation order is DFS preorder. Each sequence goes to the open row
where it adds the fewest nodes (ties: the fullest), or opens a new row; rows of one microbatch all have the
length ``L`` (from ``lengths``), the row count is a power of two and K is ``L >> j`` for ``j ∈ 0..2``, so a
run compiles a bounded number of update programs. ``long_rows``: rows of up to the microbatch budget, one per
microbatch, with the block-sparse attention (see ``pack``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

LAYOUTS = ("rows", "packed", "tree", "tree_long")
NODE_KEYS = ("input_ids", "positions", "tree_exit")
TERM_INDEX_KEYS = ("term_node", "targets")
# K ∈ {L, L/2, L/4}: a term pays only for the LM head (about 1/8 of a position's linear flops at the demo's
# shapes, 1/9 at Qwen3-4B's), so an L/8 step would save ~1.5% of a row's flops, and it split row lengths
# into two programs (`bench learn --recipe transfer`, seed 0: 20 update programs with it, 15 without, the
# same run to the last digit otherwise)
_K_STEPS = 3


@dataclasses.dataclass
class Trained:
    """One training sequence: its tokens and, per trained token, its index in ``tokens`` and its values.

    ``index[m] = i`` (1 <= i < len(tokens)) trains ``tokens[i]`` given ``tokens[:i]``; ``values[name][m]`` is
    that token's advantage, weight, old log-prob, masks... (any per-token fields the loss needs).
    """

    tokens: np.ndarray  # int32 [n]
    index: np.ndarray  # int64 [m]
    values: dict[str, np.ndarray]  # name -> [m]

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, np.int32).reshape(-1)
        self.index = np.asarray(self.index, np.int64).reshape(-1)
        if self.tokens.size < 2:
            raise ValueError(f"a training sequence needs at least 2 tokens, got {self.tokens.size}")
        if self.index.size and (self.index.min() < 1 or self.index.max() >= self.tokens.size):
            raise ValueError(f"trained indices must lie in [1, {self.tokens.size}), got "
                             f"{self.index.min()}..{self.index.max()}")
        for k, v in self.values.items():
            if len(v) != self.index.size:
                raise ValueError(f"values[{k!r}] has {len(v)} entries for {self.index.size} trained tokens")

    @property
    def inputs(self) -> np.ndarray:
        """The tokens that are model inputs (the last token is only ever a target)."""
        return self.tokens[:-1]


def from_sequence(seq: Any, scale: float = 1.0) -> Trained:
    """A ``retrojax.learn.batch.Sequence_`` (token ids + trained call spans) as a ``Trained``.

    The values are the per-token fields of the update's loss, exactly as ``batch._fill`` writes them.
    """
    from retrojax.agent.archive import EXECUTION

    index, cols = [], {k: [] for k in ("old_logprobs", "adv", "weight", "exec_mask", "ref_mask")}
    for sp in seq.spans:
        n_out = len(sp.call.output_ids)
        index.append(np.arange(sp.start, sp.start + n_out))
        cols["old_logprobs"].append(np.asarray(sp.call.logprobs, np.float32)[:n_out])
        cols["adv"].append(np.full(n_out, sp.advantage, np.float32))
        cols["weight"].append(np.full(n_out, np.float32(sp.weight * scale), np.float32))
        cols["exec_mask"].append(np.full(n_out, sp.role == EXECUTION))
        cols["ref_mask"].append(np.full(n_out, sp.role != EXECUTION))
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    values = {k: cat[k].astype(bool if k.endswith("_mask") else np.float32) for k in cat}
    return Trained(np.asarray(seq.tokens, np.int32), np.concatenate(index) if index else np.zeros(0), values)


def from_example(ids: np.ndarray, own: np.ndarray, weight: np.ndarray | None = None) -> Trained:
    """An SFT example (token ids, own-token flags, optional per-token loss weights) as a ``Trained`` whose
    ``loss_mask`` value is each trained token's weight (1 without ``weight``)."""
    own = np.asarray(own, bool)
    index = np.flatnonzero(own[1:]) + 1
    values = np.ones(index.size, np.float32) if weight is None else np.asarray(weight, np.float32)[index]
    return Trained(np.asarray(ids, np.int32), index, {"loss_mask": values})


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def lexicographic(items: Sequence[Trained]) -> list[int]:
    """Indices of ``items`` in lexicographic order of their input tokens (a prefix sorts first)."""
    return sorted(range(len(items)), key=lambda i: items[i].inputs.tolist())


def unique_tokens(items: Sequence[Trained]) -> int:
    """Nodes of the one token tree of every sequence's inputs: the distinct (prefix, token) positions."""
    order = lexicographic(items)
    total, prev = 0, None
    for i in order:
        x = items[i].inputs
        total += x.size - (common_prefix(prev, x) if prev is not None else 0)
        prev = x
    return total


class _Row:
    """One row under construction: node arrays in DFS preorder and its terms."""

    def __init__(self, length: int):
        self.length = length
        self.ids = np.zeros(length, np.int32)
        self.depth = np.zeros(length, np.int32)
        self.exit = np.arange(1, length + 1, dtype=np.int32)  # padding: a node that sees only itself
        self.count = 0
        self.path = np.zeros(0, np.int64)  # node index of each input token of the last sequence
        self.last: np.ndarray | None = None
        self.members: list[tuple[Trained, np.ndarray]] = []  # (item, node index of each of its inputs)
        self.n_terms = 0

    def shared(self, x: np.ndarray, share: bool) -> int:
        return common_prefix(self.last, x) if share and self.last is not None else 0

    def add(self, item: Trained, lcp: int) -> None:
        x = item.inputs
        new = x.size - lcp
        lo, hi = self.count, self.count + new
        if self.path.size:  # the last sequence's nodes below the branch point are complete
            self.exit[self.path[lcp:]] = lo
        self.ids[lo:hi] = x[lcp:]
        self.depth[lo:hi] = np.arange(lcp, x.size, dtype=np.int32)
        self.path = np.concatenate([self.path[:lcp], np.arange(lo, hi)])
        self.count, self.last = hi, x
        self.members.append((item, self.path))
        self.n_terms += item.index.size

    def close(self) -> None:
        if self.path.size:
            self.exit[self.path] = self.count
            self.path = self.path[:0]


@dataclasses.dataclass
class Packing:
    """Microbatches of one layout and their accounting."""

    microbatches: list[dict[str, np.ndarray]]
    rows: int  # non-padding rows
    positions: int  # rows × length over all microbatches (padding included)
    nodes: int  # real (non-padding) token positions
    terms: int  # trained tokens
    row_groups: list[list[_Row]] | None = dataclasses.field(default=None, repr=False)  # rows per microbatch

    def shapes(self) -> list[tuple[int, int, int]]:
        """(rows, length, terms per row) of every microbatch."""
        return [(*mb["input_ids"].shape, mb["term_node"].shape[1]) for mb in self.microbatches]


def _row_bucket(n: int) -> int:
    return 1 << max(0, int(np.ceil(np.log2(max(n, 1)))))


def _fit(n: int, lengths: Sequence[int]) -> int:
    for b in sorted(lengths):
        if n <= b:
            return int(b)
    raise ValueError(f"{n} tokens exceed the largest row length {max(lengths)}")


def terms_widths(length: int) -> tuple[int, ...]:
    """Every K a microbatch of row length ``length`` may have: ``length >> j`` (j < 3), ascending."""
    return tuple(sorted({max(1, length >> j) for j in range(_K_STEPS)}))


def terms_width(n_terms: int, length: int) -> int:
    """K for a microbatch whose fullest row has ``n_terms`` terms: the smallest of ``terms_widths``."""
    for k in terms_widths(length):
        if n_terms <= k:
            return k
    raise ValueError(f"{n_terms} terms exceed a row of {length}")


def rows_per_microbatch(length: int, max_batch_tokens: int) -> int:
    """Rows of ``length`` tokens in one microbatch: the largest power of two that fits the budget (≥ 1)."""
    return max(1, 1 << int(np.floor(np.log2(max(1, max_batch_tokens // length)))))


def row_counts(cap: int) -> tuple[int, ...]:
    """Every padded row count of a microbatch of at most ``cap`` rows (``_row_bucket``: powers of two)."""
    return tuple(sorted({_row_bucket(n) for n in range(1, cap + 1)}))


def microbatch_shapes(layout: str, lengths: Sequence[int], max_batch_tokens: int
                      ) -> tuple[tuple[int, int, int], ...]:
    """Every (rows, length, terms width) a microbatch of ``layout`` may have (K 0: the ``rows`` layout has
    no terms), from the rules ``pack`` and ``retrojax.learn.batch.plan_batches`` shape microbatches by: the
    update compiles at most one program per shape."""
    if layout == "rows":
        return tuple((r, int(b), 0) for b in sorted(set(lengths))
                     for r in row_counts(rows_per_microbatch(int(b), max_batch_tokens)))
    if forest_options(layout)["long_rows"]:
        return tuple((1, b, k) for b in row_lengths(lengths, max_batch_tokens) for k in terms_widths(b))
    cap = rows_per_microbatch(max(lengths), max_batch_tokens)
    return tuple((r, int(b), k) for b in sorted(set(lengths)) for r in row_counts(cap)
                 for k in terms_widths(int(b)))


def pack_rows(items: Sequence[Trained], length: int, share: bool = True) -> list[_Row]:
    """Rows of at most ``length`` tokens (and ``length`` terms) holding every item (see the module doc)."""
    if share:
        order = lexicographic(items)
    else:  # first fit decreasing
        order = sorted(range(len(items)), key=lambda i: -items[i].inputs.size)
    rows: list[_Row] = []
    for i in order:
        item = items[i]
        n = item.inputs.size
        if n > length:
            raise ValueError(f"a sequence of {n + 1} tokens does not fit rows of {length} (+1) tokens")
        best, best_key = None, None
        for r in rows:
            lcp = r.shared(item.inputs, share)
            if r.count + n - lcp > length or r.n_terms + item.index.size > length:
                continue
            key = (n - lcp, -r.count)
            if best_key is None or key < best_key:
                best, best_key = (r, lcp), key
        if best is None:
            rows.append(_Row(length))
            best = (rows[-1], 0)
        best[0].add(item, best[1])
    for r in rows:
        r.close()
    return rows


def _arrays(rows: Sequence[_Row], n_rows: int, length: int, value_keys: Iterable[str],
            dtypes: dict[str, Any]) -> dict[str, np.ndarray]:
    k = terms_width(max((r.n_terms for r in rows), default=1), length)
    out = {
        "input_ids": np.zeros((n_rows, length), np.int32),
        "positions": np.zeros((n_rows, length), np.int32),
        "tree_exit": np.tile(np.arange(1, length + 1, dtype=np.int32), (n_rows, 1)),
        "term_node": np.zeros((n_rows, k), np.int32),
        "targets": np.zeros((n_rows, k), np.int32),
    }
    for name in value_keys:
        out[name] = np.zeros((n_rows, k), dtypes[name])
    for j, r in enumerate(rows):
        n = r.count
        out["input_ids"][j, :n] = r.ids[:n]
        out["positions"][j, :n] = r.depth[:n]
        out["tree_exit"][j, :n] = r.exit[:n]
        at = 0
        for item, path in r.members:
            m = item.index.size
            out["term_node"][j, at:at + m] = path[item.index - 1]
            out["targets"][j, at:at + m] = item.tokens[item.index]
            for name in value_keys:
                out[name][j, at:at + m] = item.values[name]
            at += m
    return out


ROW_STEPS = 16  # row lengths are the sequence buckets and the multiples of capacity / ROW_STEPS


def row_capacity(lengths: Sequence[int], max_batch_tokens: int) -> int:
    """Tokens of the longest token-forest row: the microbatch budget (at least the longest bucket)."""
    return int(max(max(lengths), max_batch_tokens))


def row_lengths(lengths: Sequence[int], max_batch_tokens: int) -> tuple[int, ...]:
    """Every length a token-forest row may have: the sequence buckets and ``capacity · j / ROW_STEPS``.

    A row is cut to the smallest of these that holds it, so a part-filled row wastes less than one step;
    the set is fixed by the config, so a run compiles at most ``len(row_lengths) × 3`` update programs.
    """
    cap = row_capacity(lengths, max_batch_tokens)
    steps = {-(-cap * j // ROW_STEPS) for j in range(1, ROW_STEPS + 1)}
    return tuple(sorted({int(b) for b in lengths} | steps))


def forest_options(layout: str) -> dict[str, bool]:
    """``pack``'s keyword arguments for a token-forest layout (``learn.layout`` packed | tree | tree_long)."""
    if layout not in LAYOUTS[1:]:
        raise ValueError(f"a token-forest layout is one of {LAYOUTS[1:]}, got {layout!r}")
    return {"share": layout != "packed", "long_rows": layout == "tree_long"}


def pack(items: Sequence[Trained], *, lengths: Sequence[int], max_batch_tokens: int,
         share: bool = True, long_rows: bool = False) -> Packing:
    """Microbatches of token-forest rows holding every item (``share=False``: the ``packed`` layout).

    Bucket rows (default): rows are packed at the largest of ``lengths``; a microbatch holds the largest power
    of two of rows whose tokens fit ``max_batch_tokens`` (at least one row); its length is the smallest of
    ``lengths`` that holds its fullest row, and its row count is padded to a power of two with empty rows.

    ``long_rows`` (``learn.layout=tree_long``): rows are packed up to ``row_capacity`` tokens (the microbatch
    budget), so a whole task tree usually fits one row and its prefixes are laid out once; each microbatch is
    one row, cut to the smallest of ``row_lengths`` that holds it. Rows longer than
    ``qwen3.TREE_SPARSE_FROM`` run the block-sparse attention, which skips the key blocks no query of a block
    can see: fewer positions and attention pairs, but on CPU its per-pair cost is ~3× the dense blocks' (see
    docs/learner-layout.md), so it is not the default.
    """
    if not items:
        return Packing([], 0, 0, 0, 0)
    keys = list(items[0].values)
    dtypes = {k: np.asarray(items[0].values[k]).dtype for k in keys}
    if long_rows:
        sizes = row_lengths(lengths, max_batch_tokens)
        rows = pack_rows(items, sizes[-1], share)
        groups = [[r] for r in rows]
        mbs = [_arrays([r], 1, _fit(max(r.count, r.n_terms), sizes), keys, dtypes) for r in rows]
    else:
        top = max(lengths)
        rows = pack_rows(items, top, share)
        cap = rows_per_microbatch(top, max_batch_tokens)
        mbs, groups = [], []
        for lo in range(0, len(rows), cap):
            group = rows[lo:lo + cap]
            length = _fit(max(max(r.count, r.n_terms) for r in group), lengths)
            mbs.append(_arrays(group, _row_bucket(len(group)), length, keys, dtypes))
            groups.append(group)
    return Packing(mbs, len(rows), int(sum(m["input_ids"].size for m in mbs)),
                   int(sum(r.count for r in rows)), int(sum(r.n_terms for r in rows)), groups)


def unpack_logprobs(packing: Packing, logprobs: Sequence[np.ndarray], items: Sequence[Trained]
                    ) -> list[np.ndarray]:
    """Per item, the log-probs of its trained tokens (in ``item.index`` order) from per-microbatch [R, K]
    term log-probs: the inverse of ``pack`` on the terms."""
    found: dict[int, np.ndarray] = {}
    ids = {id(it): i for i, it in enumerate(items)}
    rows = _rows_of(packing)
    for mb_rows, lp in zip(rows, logprobs, strict=True):
        lp = np.asarray(lp)
        for j, r in enumerate(mb_rows):
            at = 0
            for item, _ in r.members:
                found[ids[id(item)]] = lp[j, at:at + item.index.size]
                at += item.index.size
    return [found.get(i, np.zeros(0, np.float32)) for i in range(len(items))]


def _rows_of(packing: Packing) -> list[list[_Row]]:
    if packing.row_groups is None:
        raise ValueError("this packing does not keep its rows")
    return packing.row_groups
