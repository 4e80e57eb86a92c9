"""Jittable Sokoban rules (gym-sokoban's): ``step(state, moves) -> (State, Outcome)``.

Design. A ``State`` is what one checkpoint needs and nothing more: the player's flat cell, the sorted box
cells (so the state key needs no scan of the board), the level's index into its tables, and the exact
distance to solution (−1 = dead), packed in one int16 vector (10 bytes with two boxes). Walls and targets
never move, so they live with the tables (``layouts``); ``State.board`` composes the int8 board on demand
(rendering, host code). The per-level distance tables (sorted state keys and distances, see
``solver.distance_table``) live in a ``Tables`` pytree that is shared, never per checkpoint: pushing a
state onto a trail copies a few dozen bytes. Two entry points use the same branch-free core:

- ``step_with(tables, state, moves)`` takes the tables explicitly; the agent loop passes one bank's
  ``Tables`` as a traced argument into its jitted, vmapped tick.
- ``step(state, moves)`` is the self-contained public form: states made by ``init``/``init_batch``
  carry a reference to their tables as a static (non-pytree) field compared by identity, so the trail
  and vmap never copy the tables, and under ``jit`` they become constants of that one program.

Exact ``dead``/``distance`` after every primitive move is a table lookup (``distance_at``). A state
reachable from the level start is solvable iff its key is in the table, so the lookup is exact, not a
heuristic. Two forms: for small rooms a direct-address array indexed by a *compact* key (the state key
over the level's non-wall cells only, e.g. 16 of 36 cells in a walled 6×6 room: 1.9k instead of 22.7k
slots per level, so the array of a whole split stays cache-sized), one gather per move; otherwise a binary
search of the int32 key in the level's segment of the flat sorted table (a fixed number of gathers).

Moves: 0 no move, 1 up, 2 down, 3 left, 4 right; a code outside 0…4 is ignored and counted in
``Outcome.invalid_moves``. Each executed non-zero move costs −0.1 (also when blocked, as in gym-sokoban);
+1 when a box moves onto a target, −1 when one moves off; +10 when the room becomes solved. A turn's
moves run in order and stop once the room is solved or dead; a solved or dead state does not move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.sokoban.text import BOX, BOX_T, FLOOR, PLAYER, PLAYER_T, TARGET, WALL
from envs.static import StaticRef

MOVE_PENALTY = -0.1
BOX_ON_REWARD = 1.0
BOX_OFF_REWARD = -1.0
SOLVED_REWARD = 10.0
MOVE_NAMES = ("none", "up", "down", "left", "right")


@struct.dataclass
class Tables:
    """Exact distances-to-solution for a bank of levels, as one flat table sorted within each level."""

    keys: jax.Array  # int32 [T]: level i's keys are keys[offsets[i] : offsets[i] + counts[i]], sorted
    dists: jax.Array  # int16 [T]
    offsets: jax.Array  # int32 [L]
    counts: jax.Array  # int32 [L]
    search_steps: int = struct.field(pytree_node=False)  # binary-search iterations (static)
    # Direct-address variant for small key spaces: dense[level * stride + compact_key] = distance (−1 dead),
    # where the compact key is the state key over the level's floor cells (floor_rank: flat cell -> index
    # among the level's non-wall cells in reading order, −1 on walls).
    dense: jax.Array | None = None  # int16 [L * stride], or None (use the binary search)
    stride: int = struct.field(pytree_node=False, default=0)  # C(floors, boxes) * floors: keys per level
    floor_rank: jax.Array | None = None  # int8 [L * cells]: level * cells + cell -> floor index, −1 wall
    floors: int = struct.field(pytree_node=False, default=0)  # most non-wall cells of any level
    # Each level's static cells as flat int8 classes (0 wall, 1 floor, 2 target): a State holds only what
    # moves (player, boxes), so the board is composed from these when it is asked for.
    layouts: jax.Array | None = None  # int8 [L, cells]
    shape: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))  # room height, width


@struct.dataclass
class State:
    """One Sokoban position: the checkpoint unit. Only what moves is stored, as ONE small int16 vector
    ``[player, box_0 … box_{nb-1}, level, distance]`` (10 bytes for two boxes), so a checkpoint is one
    array row: pushing, selecting and rewinding touch one buffer, not one per field. The walls and
    targets live in the referenced tables (``layouts``), and ``board`` composes the full int8 board.
    The fields are read through properties that work on jax and numpy (host copies) alike."""

    packed: jax.Array  # int16 [..., num_boxes + 3]
    tables: StaticRef | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def make(cls, player, boxes, level, distance, tables: StaticRef | None = None) -> State:
        """Pack the fields (``boxes`` [..., nb] sorted ascending; the others [...]) into a ``State``."""
        fields = [player, *(boxes[..., k] for k in range(boxes.shape[-1])), level, distance]
        return cls(packed=jnp.stack([jnp.asarray(f, jnp.int16) for f in fields], axis=-1), tables=tables)

    @property
    def player(self) -> jax.Array:
        """int8 [...]: the player's flat cell index r * W + c."""
        return self.packed[..., 0].astype(np.int8)

    @property
    def boxes(self) -> jax.Array:
        """int8 [..., num_boxes]: flat box cells, sorted ascending (gives the state key cheaply)."""
        return self.packed[..., 1:-2].astype(np.int8)

    @property
    def level(self) -> jax.Array:
        """int32 [...]: index of the level in its tables."""
        return self.packed[..., -2].astype(np.int32)

    @property
    def distance(self) -> jax.Array:
        """int16 [...]: exact shortest distance to solution; 0 solved, −1 dead."""
        return self.packed[..., -1]

    @property
    def solved(self) -> jax.Array:
        return self.distance == 0

    @property
    def dead(self) -> jax.Array:
        return self.distance < 0

    @property
    def board(self) -> jax.Array:
        """int8 [..., H, W] cell codes (text.SYMBOLS order), composed from the level's layout."""
        if self.tables is None:
            raise ValueError("this State carries no tables; create it with init/init_batch")
        tables = self.tables.value
        layout = tables.layouts[jnp.asarray(self.level, jnp.int32)]
        return compose(layout, self.boxes, self.player, tables.shape)


@struct.dataclass
class Outcome:
    """What one turn did (summed over its primitive moves)."""

    reward: jax.Array  # float32
    solved: jax.Array  # bool
    dead: jax.Array  # bool
    moves_applied: jax.Array  # int32: moves that changed the state
    boxes_on_target: jax.Array  # int32
    distance: jax.Array  # int16: d_end after the turn (0 solved, −1 dead)
    invalid_moves: jax.Array  # int32: codes outside 0…4 (ignored)


MAX_LEVELS = int(np.iinfo(np.int16).max)  # a State stores its level index as int16
DENSE_MAX_ENTRIES = 1 << 24  # 32 MiB of int16: above this the sorted table alone is used


def make_tables(keys, dists, offsets, counts, boards, num_boxes: int) -> Tables:
    """Build device ``Tables`` from host arrays (see ``solver.distance_table``).

    ``boards`` (int8 [L, H, W], each level's start board) give the static layouts and the floor cells;
    the direct-address array is built when every level's compact key space fits ``DENSE_MAX_ENTRIES`` in
    total (e.g. 6×6 rooms with 2 boxes: at most 16 floor cells, 120 box sets × 16 cells per level); larger
    rooms use the sorted table only.
    """
    from envs.sokoban.text import check_encodable

    boards = np.asarray(boards, np.int8)
    if len(boards) > MAX_LEVELS:
        raise ValueError(f"a bank holds at most {MAX_LEVELS} levels (a State stores the level as int16), "
                         f"got {len(boards)}")
    num_cells = boards[0].size
    check_encodable(num_cells, 1, num_boxes)
    counts = np.asarray(counts, np.int32)
    max_count = int(counts.max()) if counts.size else 0
    keys = np.asarray(keys, np.int32)
    if keys.size == 0:  # keep gathers well-defined for tables with no solvable state
        keys, dists = np.full(1, np.iinfo(np.int32).max, np.int32), np.zeros(1, np.int16)
    offsets = np.asarray(offsets, np.int32)
    dists = np.asarray(dists, np.int16)
    tables = Tables(
        keys=jnp.asarray(keys),
        dists=jnp.asarray(dists),
        offsets=jnp.asarray(offsets),
        counts=jnp.asarray(counts),
        search_steps=max(1, max_count.bit_length() + 1),
        layouts=jnp.asarray(layout_classes(boards)),
        shape=(int(boards.shape[1]), int(boards.shape[2])),
    )
    floor_masks = (boards != WALL).reshape(len(boards), -1)
    dense = _compact_dense(keys, dists, offsets, counts, floor_masks, num_boxes)
    if dense is None:
        return tables
    array, stride, rank, floors = dense
    return tables.replace(dense=jnp.asarray(array), stride=stride, floor_rank=jnp.asarray(rank),
                          floors=floors)


def _compact_dense(keys, dists, offsets, counts, floor_masks: np.ndarray, num_boxes: int):
    """``(dense, stride, floor_rank, floors)`` for the direct-address lookup, or None when too large."""
    import math

    from envs.sokoban import solver

    levels, cells = floor_masks.shape
    floors = max(int(floor_masks.sum(axis=1).max()), num_boxes + 1)
    stride = math.comb(floors, num_boxes) * floors
    if levels != len(counts) or levels * stride > DENSE_MAX_ENTRIES:
        return None
    rank = np.where(floor_masks, np.cumsum(floor_masks, axis=1) - 1, -1).astype(np.int8)
    dense = np.full(levels * stride, -1, np.int16)
    for level, (off, cnt) in enumerate(zip(offsets, counts, strict=True)):
        boxes, player = solver.decode_keys(keys[off : off + cnt], cells, num_boxes)
        r = rank[level]
        compact = solver.encode(r[boxes], r[player], floors)
        dense[level * stride + compact] = dists[off : off + cnt]
    return dense, stride, rank.reshape(-1), floors


def sort_boxes(boxes: jax.Array) -> jax.Array:
    """Sort a handful of box cells with an odd-even transposition network (no XLA sort call)."""
    cells = [boxes[i] for i in range(boxes.shape[0])]
    for r in range(len(cells)):
        for i in range(r % 2, len(cells) - 1, 2):
            a, b = cells[i], cells[i + 1]
            cells[i], cells[i + 1] = jnp.minimum(a, b), jnp.maximum(a, b)
    return jnp.stack(cells) if cells else boxes


def state_key(boxes: jax.Array, player: jax.Array, num_cells: int) -> jax.Array:
    """int32 key ``rank(boxes) * N + player``; ``rank = sum_k C(b_k, k + 1)`` over the sorted box cells.

    Binomials are computed arithmetically (``C(c, j) = C(c, j-1) * (c - j + 1) / j``, exact in int32 for
    every room ``text.check_encodable`` accepts), so the key costs a few multiplies, no gathers.
    """
    b = boxes.astype(jnp.int32)
    rank = jnp.int32(0)
    for k in range(b.shape[-1]):
        c = b[..., k]
        binom = jnp.int32(1)
        for j in range(1, k + 2):
            binom = binom * jnp.maximum(c - j + 1, 0) // j
        rank = rank + binom
    return rank * num_cells + player.astype(jnp.int32)


def lookup(tables: Tables, level: jax.Array, key: jax.Array) -> jax.Array:
    """Exact distance for a state ``key`` (any shape) by binary search in ``level``'s sorted table segment;
    −1 when absent (dead)."""
    key = jnp.asarray(key, jnp.int32)
    lo = jnp.broadcast_to(tables.offsets[level], key.shape)
    end = lo + tables.counts[level]
    last = tables.keys.shape[0] - 1

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        open_ = lo < hi
        right = tables.keys[jnp.minimum(mid, last)] < key
        return jnp.where(open_ & right, mid + 1, lo), jnp.where(open_ & ~right, mid, hi)

    lo, _ = jax.lax.fori_loop(0, tables.search_steps, halve, (lo, end))
    idx = jnp.minimum(lo, last)
    found = (lo < end) & (tables.keys[idx] == key)
    return jnp.where(found, tables.dists[idx], jnp.int16(-1)).astype(jnp.int16)


def distance_at(tables: Tables, level: jax.Array, boxes: jax.Array, player: jax.Array,
                num_cells: int) -> jax.Array:
    """Exact distance of the state (sorted ``boxes`` int8[..., nb], ``player``) in ``level``; −1 dead.

    Direct-address gather on the compact key when the tables have one, else the binary search."""
    if tables.dense is None:
        return lookup(tables, level, state_key(boxes, player, num_cells))
    lv = jnp.asarray(level, jnp.int32)
    base = lv * num_cells
    rb = jnp.take(tables.floor_rank, base[..., None] + boxes.astype(jnp.int32), mode="clip")
    rp = jnp.take(tables.floor_rank, base + player.astype(jnp.int32), mode="clip")
    on_floor = jnp.all(rb >= 0, axis=-1) & (rp >= 0)
    key = state_key(jnp.maximum(rb, 0), jnp.maximum(rp, 0), tables.floors)
    dist = jnp.take(tables.dense, lv * tables.stride + key, mode="clip")
    return jnp.where(on_floor, dist, jnp.int16(-1)).astype(jnp.int16)


def distance_of(tables: Tables, state: State) -> jax.Array:
    """Exact shortest distance to solution of ``state`` (−1 dead), via the tables."""
    return distance_at(tables, state.level, state.boxes, state.player, tables.shape[0] * tables.shape[1])


def layout_classes(boards: np.ndarray) -> np.ndarray:
    """The static part of boards [..., H, W] as flat int8 classes [..., H*W]: 0 wall, 1 floor, 2 target."""
    b = np.asarray(boards)
    flat = b.reshape(*b.shape[:-2], -1)
    target = np.isin(flat, (TARGET, BOX_T, PLAYER_T))
    return np.where(flat == WALL, 0, np.where(target, 2, 1)).astype(np.int8)


def compose(layout: jax.Array, boxes: jax.Array, player: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """int8 boards [..., H, W] from layout classes [..., cells], box cells [..., nb], player cells [...]."""
    cells = jnp.arange(layout.shape[-1])
    target = layout == 2
    board = jnp.where(layout == 0, WALL, jnp.where(target, TARGET, FLOOR))
    for k in range(boxes.shape[-1]):
        at = cells == jnp.asarray(boxes[..., k], jnp.int32)[..., None]
        board = jnp.where(at, jnp.where(target, BOX_T, BOX), board)
    at = cells == jnp.asarray(player, jnp.int32)[..., None]
    board = jnp.where(at, jnp.where(target, PLAYER_T, PLAYER), board)
    return board.astype(jnp.int8).reshape(*board.shape[:-1], *shape)


def _move(layout, shape, player, boxes, move):
    """One primitive move on (player, boxes) over the static layout (no table lookup).

    Returns ``(player, boxes, changed, pushed_on, pushed_off)``; codes outside 1…4 do nothing.
    """
    h, w = shape
    n = h * w
    m = jnp.where((move < 1) | (move > 4), 0, move)
    dr = jnp.where(m == 1, -1, jnp.where(m == 2, 1, 0))
    dc = jnp.where(m == 3, -1, jnp.where(m == 4, 1, 0))
    p = player.astype(jnp.int32)
    r, c = p // w, p % w
    r1, c1, r2, c2 = r + dr, c + dc, r + 2 * dr, c + 2 * dc
    in1 = (r1 >= 0) & (r1 < h) & (c1 >= 0) & (c1 < w)
    in2 = (r2 >= 0) & (r2 < h) & (c2 >= 0) & (c2 < w)
    i1 = jnp.clip(r1 * w + c1, 0, n - 1)
    i2 = jnp.clip(r2 * w + c2, 0, n - 1)
    k1 = jnp.where(in1, layout[i1], 0)
    k2 = jnp.where(in2, layout[i2], 0)
    bx = boxes.astype(jnp.int32)
    hit1 = bx == i1
    box1 = jnp.any(hit1) & in1
    box2 = jnp.any(bx == i2) & in2
    valid = m > 0
    push = valid & box1 & (k2 > 0) & ~box2
    moved = valid & (((k1 > 0) & ~box1) | push)
    new_boxes = sort_boxes(jnp.where(push & hit1, i2, bx)).astype(jnp.int8)
    new_player = jnp.where(moved, i1, p).astype(jnp.int8)
    return new_player, new_boxes, moved, push & (k2 == 2), push & (k1 == 2)


def step_with(tables: Tables, state: State, moves: jax.Array) -> tuple[State, Outcome]:
    """Apply a turn of primitive moves (``int32[K]``, 0 = no move) with explicit ``tables``.

    Moves update only (player, boxes) over the level's static layout, with an exact table lookup after
    each; nothing else of the state changes.
    """
    moves = jnp.asarray(moves, jnp.int32)
    shape = tables.shape
    n = shape[0] * shape[1]
    layout = tables.layouts[state.level]

    def one(carry, move):
        player, boxes, dist, reward, applied, invalid = carry
        bad = (move < 0) | (move > 4)
        active = (dist > 0) & ~bad & (move != 0)
        npl, nbx, moved, on, off = _move(layout, shape, player, boxes, move)
        nd = distance_at(tables, state.level, nbx, npl, n)
        moved = moved & active
        reward = reward + jnp.where(active, MOVE_PENALTY, 0.0)
        reward = reward + jnp.where(moved & on, BOX_ON_REWARD, 0.0)
        reward = reward + jnp.where(moved & off, BOX_OFF_REWARD, 0.0)
        reward = reward + jnp.where(moved & (nd == 0), SOLVED_REWARD, 0.0)
        carry = (
            jnp.where(moved, npl, player),
            jnp.where(moved, nbx, boxes),
            jnp.where(moved, nd, dist),
            reward,
            applied + moved.astype(jnp.int32),
            invalid + bad.astype(jnp.int32),
        )
        return carry, None

    init = (state.player, state.boxes, state.distance, jnp.float32(0.0), jnp.int32(0), jnp.int32(0))
    (player, boxes, dist, reward, applied, invalid), _ = jax.lax.scan(one, init, moves)
    new_state = State.make(player, boxes, state.level, dist, state.tables)
    outcome = Outcome(
        reward=reward.astype(jnp.float32),
        solved=dist == 0,
        dead=dist < 0,
        moves_applied=applied,
        boxes_on_target=jnp.sum(layout[boxes.astype(jnp.int32)] == 2, dtype=jnp.int32),
        distance=dist,
        invalid_moves=invalid,
    )
    return new_state, outcome


def step(state: State, moves: jax.Array) -> tuple[State, Outcome]:
    """Public step: uses the tables the state was initialised with (see module docstring)."""
    if state.tables is None:
        raise ValueError("this State carries no distance tables; create it with init/init_batch "
                         "or call step_with(tables, state, moves)")
    return step_with(state.tables.value, state, moves)


def optimal_moves_with(tables: Tables, state: State) -> jax.Array:
    """bool[4] for moves 1…4 (up, down, left, right): True where the move starts a shortest solution."""
    layout = tables.layouts[state.level]
    n = tables.shape[0] * tables.shape[1]
    dist = []
    for m in range(1, 5):
        npl, nbx, *_ = _move(layout, tables.shape, state.player, state.boxes, jnp.int32(m))
        dist.append(distance_at(tables, state.level, nbx, npl, n))
    dist = jnp.stack(dist)
    return (state.distance > 0) & (dist >= 0) & (dist == state.distance - 1)


def optimal_moves(state: State) -> jax.Array:
    """``optimal_moves_with`` using the tables the state was initialised with."""
    if state.tables is None:
        raise ValueError("this State carries no distance tables; use optimal_moves_with(tables, state)")
    return optimal_moves_with(state.tables.value, state)
