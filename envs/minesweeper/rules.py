"""MineSweeper rules as pure, jittable functions over a small state pytree.

State: ``board`` (int8[H, W]: -1 for a mine, else the number of adjacent mines) plus three row
bitboards (one unsigned int per row, bit ``c`` = column ``c``): ``open_rows`` (revealed cells),
``mine_rows`` and ``blank_rows`` (cells with no adjacent mine). The bitboards make a step a handful of
integer ops on H words instead of H·W cells; ``state.revealed`` unpacks ``open_rows`` to bool[H, W].
The mine layout lives in the state because ``step`` needs it, but text rendering never shows it (only
the one mine that was hit). There is no random key: a restored checkpoint is exactly the world as it was.
``won``/``lost`` are derived from the bitboards. A 6×6 state is 54 bytes.

A reveal opens the chosen hidden cell; a blank cell cascades: all connected blank cells and their
bordering numbered cells open. The cascade is a bounded fixed-point loop inside ``step``
(``lax.while_loop``, at most H·W rounds) of 3×3 bitboard dilations of the open blank cells restricted to
hidden cells; under ``vmap`` it is branch-free (per-board decisions are ``jnp.where`` selects and the
loop runs until every board of the batch has reached its fixed point).

Rewards per reveal: +0.5 when exactly one cell opens, +2.0 when more than one opens, -1.0 when nothing
changes (cell already revealed or out of range), -0.1 when a mine is revealed (the branch is lost), and
+10.0 (instead of the opening reward) for the reveal that opens the last non-mine cell. Stepping a state
that is already won or lost changes nothing and gives reward 0 (the episode is over; callers mask it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

REWARD_ONE = 0.5
REWARD_CASCADE = 2.0
REWARD_NOTHING = -1.0
REWARD_MINE = -0.1
REWARD_WIN = 10.0

MINE = -1  # board value of a mine cell
MAX_WIDTH = 32


def row_dtype(width: int):
    """Smallest unsigned dtype holding one row of ``width`` cells as bits."""
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"board width must lie in [1, {MAX_WIDTH}], got {width}")
    return jnp.uint8 if width <= 8 else jnp.uint16 if width <= 16 else jnp.uint32


def pack_rows(mask: jax.Array) -> jax.Array:
    """bool[..., H, W] -> row bitboards uint[..., H] (bit c of row r = mask[r, c])."""
    w = mask.shape[-1]
    dt = row_dtype(w)
    return jnp.sum(mask.astype(dt) << jnp.arange(w, dtype=dt), axis=-1, dtype=dt)


def unpack_rows(rows: jax.Array, width: int) -> jax.Array:
    """Row bitboards uint[..., H] -> bool[..., H, W]."""
    return ((rows[..., None] >> jnp.arange(width, dtype=rows.dtype)) & 1).astype(bool)


@struct.dataclass
class Board:
    """One task: the mine layout, the safe first click (row, col) and its reference solution length."""

    mines: jax.Array  # bool[H, W]
    first_click: jax.Array  # int32[2], 0-indexed (row, col); never a mine, always a blank cell
    solution_length: jax.Array  # int32 scalar: minimum reveals after the first click (see boards.py)


@struct.dataclass
class State:
    """The world: adjacent-mine counts (-1 = mine) and row bitboards of open, mine and blank cells."""

    board: jax.Array  # int8[H, W]
    open_rows: jax.Array  # uint[H]: bit c of row r set when (r, c) is revealed
    mine_rows: jax.Array  # uint[H]: constant per board
    blank_rows: jax.Array  # uint[H]: constant per board (cells with no adjacent mine, not mines)

    @property
    def revealed(self) -> jax.Array:
        """bool[..., H, W]: which cells are open."""
        return unpack_rows(self.open_rows, self.board.shape[-1])


@struct.dataclass
class Outcome:
    """What one reveal did."""

    reward: jax.Array  # float32
    won: jax.Array  # bool: every non-mine cell is open (after this reveal)
    lost: jax.Array  # bool: a mine is open (after this reveal)
    cells_opened: jax.Array  # int32: cells this reveal opened (0 when nothing changed)


def adjacent_counts(mines: jax.Array) -> jax.Array:
    """int8 board from a bool mine mask: -1 on mines, else the number of the 8 neighbours that are mines."""
    m = mines.astype(jnp.int8)
    p = jnp.pad(m, [(1, 1), (1, 1)])
    h, w = mines.shape
    total = sum(p[dr : dr + h, dc : dc + w] for dr in range(3) for dc in range(3)) - m
    return jnp.where(mines, jnp.int8(MINE), total.astype(jnp.int8))


def state_from_arrays(board: jax.Array, revealed: jax.Array) -> State:
    """A ``State`` from an int8 count board (-1 = mine) and a bool[H, W] revealed mask."""
    board = jnp.asarray(board, jnp.int8)
    return State(
        board=board,
        open_rows=pack_rows(jnp.asarray(revealed, bool)),
        mine_rows=pack_rows(board == MINE),
        blank_rows=pack_rows(board == 0),
    )


def _full(width: int, dtype) -> jax.Array:
    return jnp.asarray((1 << width) - 1, dtype)


def cascade(seed: jax.Array, blank_rows: jax.Array, hidden: jax.Array, width: int) -> jax.Array:
    """Row bitboard of the cells opened by revealing ``seed`` (at most one bit set; may be empty).

    Fixed point of ``opened = seed | (dilate(opened & blank) & hidden)``, where ``hidden`` already
    excludes bits past the board's width; blank cells have no mine neighbours, so the dilation never
    reaches a mine. Bounded by H·W rounds.
    """
    h = seed.shape[-1]
    zero = jnp.zeros((1,), seed.dtype)

    def grow(opened: jax.Array) -> jax.Array:
        g = opened & blank_rows
        g = g | (g << 1) | (g >> 1)
        g = g | jnp.concatenate([g[1:], zero]) | jnp.concatenate([zero, g[:-1]])
        return opened | (g & hidden)

    def cond(carry):
        _, changed, i = carry
        return changed & (i < h * width)

    def body(carry):
        opened, _, i = carry
        grown = grow(opened)
        return grown, jnp.any(grown != opened), i + 1

    opened, _, _ = jax.lax.while_loop(cond, body, (seed, jnp.any(seed != 0), jnp.int32(0)))
    return opened


def is_lost(state: State) -> jax.Array:
    """A mine has been revealed."""
    return jnp.any((state.open_rows & state.mine_rows) != 0, axis=-1)


def is_won(state: State) -> jax.Array:
    """Every non-mine cell is open and no mine is."""
    full = _full(state.board.shape[-1], state.open_rows.dtype)
    return jnp.all((state.open_rows ^ state.mine_rows) == full, axis=-1)


def init(board: Board) -> State:
    """The first observation: counts from the mine layout, with the safe first click's cascade open."""
    counts = adjacent_counts(jnp.asarray(board.mines, bool))
    h, w = counts.shape
    empty = state_from_arrays(counts, jnp.zeros((h, w), bool))
    click = jnp.asarray(board.first_click, jnp.int32)
    state, _ = step(empty, click)
    return state


def step(state: State, cell: jax.Array) -> tuple[State, Outcome]:
    """Reveal ``cell`` = int32 (row, col), 0-indexed. Jittable and vmappable; see the module doc."""
    cell = jnp.asarray(cell, jnp.int32)
    h, w = state.board.shape
    dt = state.open_rows.dtype
    full = _full(w, dt)
    r, c = cell[0], cell[1]
    in_range = (r >= 0) & (r < h) & (c >= 0) & (c < w)
    bit = jnp.where(in_range, jnp.left_shift(jnp.uint32(1), jnp.clip(c, 0, w - 1).astype(jnp.uint32)), 0)
    target = jnp.where(jnp.arange(h) == r, bit.astype(dt), jnp.zeros((), dt))
    lost = is_lost(state)
    over = lost | is_won(state)
    hidden = ~state.open_rows & full
    fresh = jnp.any((target & hidden) != 0)
    seed = jnp.where(over, jnp.zeros((), dt), target & hidden)
    opened = cascade(seed, state.blank_rows, hidden, w)
    n = jnp.sum(jax.lax.population_count(opened).astype(jnp.int32))
    hit_mine = jnp.any((opened & state.mine_rows) != 0)
    new = state.replace(open_rows=state.open_rows | opened)
    won = is_won(new)
    opening = jnp.where(won, REWARD_WIN, jnp.where(n > 1, REWARD_CASCADE, REWARD_ONE))
    reward = jnp.where(hit_mine, REWARD_MINE, opening)
    reward = jnp.where(fresh, reward, REWARD_NOTHING)
    reward = jnp.where(over, 0.0, reward).astype(jnp.float32)
    return new, Outcome(reward=reward, won=won, lost=lost | hit_mine, cells_opened=n)
