"""MineSweeper rules as pure, jittable functions over a tiny state pytree.

State. A board's cells are bits: cell ``(r, c)`` is bit ``i % 32`` of word ``i // 32`` with
``i = r * W + c``, so a 6×6 board is two uint32 words. ``State.words`` is ``uint32[2, K]``: row 0 the
open cells, row 1 the mine layout (it lives in the state because ``step`` needs it; text never shows it,
except the one mine that was hit). ``State.index`` names the board's row in an optional shared cascade
table. There is no random key: a restored checkpoint is exactly the world as it was. The counts board,
``revealed`` and ``mines`` masks are properties computed from the words (with numpy for host copies).

Cascade: revealing a blank cell opens all connected blank cells and their bordering numbered cells; a
numbered cell opens only itself. Two exact ways, same result (a test checks every click):

- Table lookup (the fast path): states made by ``init_batch(bank, …)`` point at their bank's
  ``CascadeTable`` (a static, identity-compared field, like Sokoban's distance tables), which stores for
  every board and cell the words a click opens (built once per bank by the flood fill below, one
  batched jitted call). A step is then one gather and a few integer ops on K
  words — the state that flows through ``scan``/``vmap``/trails is 20 bytes for 6×6.
- Flood fill (states without a table: ``init(board)``, ``parse``, hand-made states): a bounded fixed
  point inside jit (``lax.while_loop``, at most H·W rounds of "grow the opened set by the 8-neighbours of
  its blank cells"); branch-free under ``vmap``, where it runs until every board of the batch is done.

Rewards per reveal: +0.5 when exactly one cell opens, +2.0 when more than one opens, -1.0 when nothing
changes (cell already revealed or out of range), -0.1 when a mine is revealed (the branch is lost), and
+10.0 (instead of the opening reward) for the reveal that opens the last non-mine cell. Stepping a state
that is already won or lost changes nothing and gives reward 0 (the episode is over; callers mask it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.static import StaticRef

REWARD_ONE = 0.5
REWARD_CASCADE = 2.0
REWARD_NOTHING = -1.0
REWARD_MINE = -0.1
REWARD_WIN = 10.0

MINE = -1  # board value of a mine cell
OPEN, MINES = 0, 1  # rows of State.words


def num_words(shape: tuple[int, int]) -> int:
    """uint32 words per bit mask of an H×W board."""
    h, w = shape
    if h < 1 or w < 1:
        raise ValueError(f"board shape must be positive, got {shape}")
    return -(-(h * w) // 32)


def _xp(x):
    """numpy for host arrays, jax.numpy otherwise (so properties work on host copies without dispatch)."""
    return np if isinstance(x, np.ndarray) else jnp


def to_words(mask, xp=jnp):
    """bool[..., H, W] -> uint32[..., K]: bit ``i % 32`` of word ``i // 32`` is cell ``i = r * W + c``."""
    h, w = mask.shape[-2:]
    k = num_words((h, w))
    lead = mask.shape[:-2]
    flat = xp.reshape(mask, (*lead, h * w)).astype(xp.uint32)
    flat = xp.concatenate([flat, xp.zeros((*lead, k * 32 - h * w), xp.uint32)], axis=-1)
    bits = xp.reshape(flat, (*lead, k, 32)) << xp.arange(32, dtype=xp.uint32)
    return xp.sum(bits, axis=-1, dtype=xp.uint32)


def from_words(words, shape: tuple[int, int]):
    """uint32[..., K] -> bool[..., H, W] (inverse of ``to_words``)."""
    xp = _xp(words)
    h, w = shape
    cells = np.arange(h * w)
    bits = (words[..., cells // 32] >> (cells % 32).astype(np.uint32)) & np.uint32(1)
    return xp.reshape(bits != 0, (*words.shape[:-1], h, w))


def adjacent_counts(mines):
    """int8 board from a bool mine mask [..., H, W]: -1 on mines, else the number of mine neighbours."""
    xp = _xp(mines)
    m = mines.astype(xp.int8)
    h, w = mines.shape[-2:]
    p = xp.pad(m, [(0, 0)] * (m.ndim - 2) + [(1, 1), (1, 1)])
    total = sum(p[..., dr : dr + h, dc : dc + w] for dr in range(3) for dc in range(3)) - m
    return xp.where(mines, xp.int8(MINE), total.astype(xp.int8))


def dilate(mask: jax.Array) -> jax.Array:
    """3×3 dilation of a bool[..., H, W] mask (separable: rows, then columns)."""
    pad = [(0, 0)] * (mask.ndim - 2)
    p = jnp.pad(mask, [*pad, (0, 0), (1, 1)])
    rows = p[..., :, :-2] | p[..., :, 1:-1] | p[..., :, 2:]
    p = jnp.pad(rows, [*pad, (1, 1), (0, 0)])
    return p[..., :-2, :] | p[..., 1:-1, :] | p[..., 2:, :]


def flood_open(mines: jax.Array, cell_mask: jax.Array) -> jax.Array:
    """bool[H, W]: the cells a click on ``cell_mask`` (one cell, or none) opens, by the bounded fixed
    point ``R ← R ∪ dilate(R ∩ blank)`` (at most H·W rounds; the cascade when the cell is blank)."""
    h, w = mines.shape
    blank = ~dilate(mines)

    def body(carry):
        region, _, i = carry
        grown = region | dilate(region & blank)
        return grown, jnp.any(grown != region), i + 1

    region, _, _ = jax.lax.while_loop(lambda c: c[1] & (c[2] < h * w), body,
                                      (cell_mask, jnp.any(cell_mask & blank), jnp.int32(0)))
    return region


@struct.dataclass
class CascadeTable:
    """For each board of a bank and each cell: the words a click there opens (``clicks[b, i]``)."""

    clicks: jax.Array  # uint32 [N, H*W, K]


@jax.jit
def _clicks_of(mines: jax.Array) -> jax.Array:
    h, w = mines.shape[-2:]
    cells = jnp.eye(h * w, dtype=bool).reshape(h * w, h, w)
    opened = jax.vmap(lambda m: jax.vmap(lambda c: flood_open(m, c))(cells))(mines)
    return to_words(opened)


def cascade_table(mines) -> StaticRef:
    """The cascade table of a stack of mine layouts bool[N, H, W] (one flood fill per board and cell)."""
    mines = jnp.asarray(mines, bool)
    if mines.ndim != 3:
        raise ValueError(f"cascade_table takes mines of shape [N, H, W], got {mines.shape}")
    return StaticRef(CascadeTable(clicks=_clicks_of(mines)))


@struct.dataclass
class Board:
    """One task: the mine layout, the safe first click (row, col) and its reference solution length."""

    mines: jax.Array  # bool[H, W]
    first_click: jax.Array  # int32[2], 0-indexed (row, col); never a mine, always a blank cell
    solution_length: jax.Array  # int32 scalar: minimum reveals after the first click (see boards.py)


@struct.dataclass
class State:
    """The world: open and mine bit words, the board's row in its cascade table (if any), and the shape."""

    words: jax.Array  # uint32[2, K]: row OPEN = revealed cells, row MINES = mine layout
    index: jax.Array  # int32: the board's row in ``cascade`` (0 when there is no table)
    shape: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))
    cascade: StaticRef | None = struct.field(pytree_node=False, default=None)

    @property
    def revealed(self):
        """bool[..., H, W]: which cells are open."""
        return from_words(self.words[..., OPEN, :], self.shape)

    @property
    def mines(self):
        """bool[..., H, W]: the mine layout (never rendered)."""
        return from_words(self.words[..., MINES, :], self.shape)

    @property
    def board(self):
        """int8[..., H, W]: -1 on mines, else the number of adjacent mines (composed from the words)."""
        return adjacent_counts(self.mines)


@struct.dataclass
class Outcome:
    """What one reveal did."""

    reward: jax.Array  # float32
    won: jax.Array  # bool: every non-mine cell is open (after this reveal)
    lost: jax.Array  # bool: a mine is open (after this reveal)
    cells_opened: jax.Array  # int32: cells this reveal opened (0 when nothing changed)


def make_state(mines, revealed, index=0, cascade: StaticRef | None = None) -> State:
    """A ``State`` from bool[H, W] mine and revealed masks (jittable; ``cascade`` is static)."""
    mines, revealed = jnp.asarray(mines, bool), jnp.asarray(revealed, bool)
    if mines.ndim != 2 or mines.shape != revealed.shape:
        raise ValueError(f"mines and revealed must be bool[H, W] of one shape, got {mines.shape} and "
                         f"{revealed.shape}")
    words = jnp.stack([to_words(revealed), to_words(mines)])
    return State(words=words, index=jnp.asarray(index, jnp.int32), shape=tuple(mines.shape), cascade=cascade)


@jax.jit
def state_from_arrays(board: jax.Array, revealed: jax.Array) -> State:
    """A table-free ``State`` from an int8 count board (-1 = mine) and a bool[H, W] revealed mask."""
    return make_state(jnp.asarray(board) == MINE, revealed)


@functools.cache
def _cell_words(shape: tuple[int, int]) -> np.ndarray:
    """uint32[H*W, K]: the words of each single cell (host constant per board shape)."""
    h, w = shape
    return to_words(np.eye(h * w, dtype=bool).reshape(h * w, h, w), np)


@functools.cache
def _full_words(shape: tuple[int, int]) -> np.ndarray:
    return to_words(np.ones(shape, bool), np)


def _full(shape: tuple[int, int]) -> jax.Array:
    """uint32[K]: every cell of the board set."""
    return jnp.asarray(_full_words(shape))


def is_lost(state: State) -> jax.Array:
    """A mine has been revealed."""
    return jnp.any((state.words[..., OPEN, :] & state.words[..., MINES, :]) != 0, axis=-1)


def is_won(state: State) -> jax.Array:
    """Every non-mine cell is open and no mine is."""
    return jnp.all((state.words[..., OPEN, :] ^ state.words[..., MINES, :]) == _full(state.shape), axis=-1)


def init(board: Board) -> State:
    """The first observation of a table-free state: the safe first click's cascade is open."""
    mines = jnp.asarray(board.mines, bool)
    state = make_state(mines, jnp.zeros(mines.shape, bool))
    state, _ = step(state, jnp.asarray(board.first_click, jnp.int32))
    return state


def _opened_by_click(state: State, flat: jax.Array, target: jax.Array) -> jax.Array:
    """uint32[K]: the cells a click on flat cell ``flat`` opens (``target``: its bit; zero off-board,
    where the caller discards the result anyway)."""
    if state.cascade is not None:
        return state.cascade.value.clicks[state.index, flat]
    cell = from_words(target, state.shape)
    return to_words(flood_open(from_words(state.words[MINES], state.shape), cell))


def step(state: State, cell: jax.Array) -> tuple[State, Outcome]:
    """Reveal ``cell`` = int32 (row, col), 0-indexed. Jittable and vmappable; see the module doc."""
    cell = jnp.asarray(cell, jnp.int32)
    h, w = state.shape
    full = _full(state.shape)
    r, c = cell[0], cell[1]
    in_range = (r >= 0) & (r < h) & (c >= 0) & (c < w)
    flat = jnp.where(in_range, r * w + c, 0)
    # the clicked cell's bit, looked up in a constant table (cheap to recompute inside fused loops)
    target = jnp.where(in_range, jnp.asarray(_cell_words(state.shape))[flat], jnp.uint32(0))
    opened_now, mines = state.words[OPEN], state.words[MINES]
    hidden = ~opened_now & full
    fresh = jnp.any((target & hidden) != 0)
    lost = jnp.any((opened_now & mines) != 0)
    over = lost | jnp.all((opened_now ^ mines) == full)
    opened = jnp.where(over | ~fresh, jnp.uint32(0), _opened_by_click(state, flat, target) & hidden)
    new_open = opened_now | opened
    # one reduction over the words for three facts: a mine opened, a safe cell still hidden, and more
    # than one cell opened (``opened`` holds the target whenever it counts, so "more" = "not just it";
    # no popcount, so the count below is only computed where ``cells_opened`` is used)
    facts = jnp.any(jnp.stack([opened & mines, (new_open ^ mines) ^ full, opened ^ target]) != 0, axis=-1)
    hit_mine, won, many = facts[0], ~facts[1], facts[2]
    opening = jnp.where(won, REWARD_WIN, jnp.where(many, REWARD_CASCADE, REWARD_ONE))
    reward = jnp.where(hit_mine, REWARD_MINE, opening)
    reward = jnp.where(fresh, reward, REWARD_NOTHING)
    reward = jnp.where(over, 0.0, reward).astype(jnp.float32)
    n = jnp.sum(jax.lax.population_count(opened).astype(jnp.int32))
    new = state.replace(words=jnp.stack([new_open, mines]))
    return new, Outcome(reward=reward, won=won, lost=lost | hit_mine, cells_opened=n)
