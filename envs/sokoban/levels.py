"""Sokoban levels: ``Level`` (one room), ``LevelBank`` (levels stacked as arrays), the generator and
the registered splits.

``generate`` follows gym-sokoban's recipe, written afresh: a random-walk room topology inside walls,
targets with boxes on them plus a player placed on floor, a randomised depth-first reverse-play search
(the player walks, optionally pulling the box behind it) that keeps the layout with the best score
``box_swaps × total box displacement``, then a short random player walk. A candidate is kept only if its
exact shortest solution length lies in ``[min_solution, max_solution]``; everything is drawn from one
``numpy`` generator seeded by ``seed``, so a seed always yields the same levels.

A ``LevelBank`` is a pytree (boards, d0 and the exact distance ``Tables``) that the agent loop can pass
into jit; ``init_batch(bank, indices)`` vmaps ``init`` over level indices. Registered splits (see
``SPLITS``) are generated on first use and cached as ``.npz`` under ``$RETROJAX_CACHE`` (default
``$XDG_CACHE_HOME/retrojax`` or ``~/.cache/retrojax``).

Parts of a split are disjoint by *room* (``canonical_room``: walls, boxes and targets; where the player
stands does not make a room new). ``:train`` is generated first as it always was (it may repeat a room
with the player elsewhere); ``:test`` skips every training room and repeats none of its own, and
``:val`` skips the rooms of both. Each part has its own seed, so the test rooms do not depend on the
validation rooms, and ``:test`` keeps the places of the boards the exact-board rule chose before, refilling
only those that repeated a room (``stable_slots``). Where the generator's rooms run short the held-out parts
come from its long tail, which need not look like the training rooms (``sokoban-5x5-1``, see ``SPLITS``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.sokoban import solver
from envs.sokoban.rules import State, Tables, make_tables
from envs.sokoban.text import BOX, BOX_T, FLOOR, PLAYER, PLAYER_T, TARGET, WALL, check_encodable, parse_board
from envs.static import StaticRef

GENERATOR_VERSION = 1
ROOMS_VERSION = 2  # held-out parts disjoint from training by canonical room (bump when that rule changes)
PARTS = ("train", "test", "val")


class Level:
    """One room as an int8 ``[H, W]`` board of cell codes (host-side; equality by content)."""

    __slots__ = ("board", "_ref")

    def __init__(self, board: np.ndarray):
        board = np.asarray(board, dtype=np.int8)
        if board.ndim != 2:
            raise ValueError(f"a level board must be 2-D, got shape {board.shape}")
        self.board = board
        self._ref: StaticRef | None = None

    @classmethod
    def from_text(cls, text: str) -> Level:
        return cls(parse_board(text))

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.board.shape[0]), int(self.board.shape[1])

    @property
    def num_boxes(self) -> int:
        return int(np.isin(self.board, (BOX, BOX_T)).sum())

    def tables_ref(self) -> StaticRef:
        """This level's own one-level distance tables (computed once, then cached on the object)."""
        if self._ref is None:
            keys, dists = solver.distance_table(self.board)
            self._ref = StaticRef(
                make_tables(keys, dists, [0], [len(keys)], self.board[None], self.num_boxes)
            )
        return self._ref

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Level) and np.array_equal(self.board, other.board)

    def __hash__(self) -> int:
        return hash((self.board.shape, self.board.tobytes()))

    def __repr__(self) -> str:
        from envs.sokoban.text import render_board

        return f"Level(\n{render_board(self.board)}\n)"


@struct.dataclass
class LevelBank:
    """Levels of one shape stacked as arrays, with their exact distance tables."""

    boards: jax.Array  # int8 [L, H, W]
    players: jax.Array  # int8 [L]: flat player cell
    boxes: jax.Array  # int8 [L, num_boxes]: sorted flat box cells
    d0: jax.Array  # int16 [L]: shortest solution length from the start
    tables: Tables
    ref: StaticRef = struct.field(pytree_node=False)
    name: str = struct.field(pytree_node=False, default="")

    def __len__(self) -> int:
        return int(self.boards.shape[0])

    def level(self, index: int) -> Level:
        if not 0 <= int(index) < len(self):
            raise IndexError(f"level index {index} out of range for a bank of {len(self)} levels")
        return Level(np.asarray(self.boards[int(index)]))


def bank_from_boards(boards: list[np.ndarray] | np.ndarray, name: str = "") -> LevelBank:
    """Stack boards of one shape and one box count into a bank, computing their distance tables."""
    boards = np.asarray(boards, dtype=np.int8)
    if boards.ndim != 3 or len(boards) == 0:
        raise ValueError(f"expected a non-empty stack of 2-D boards, got shape {boards.shape}")
    nb = {int(np.isin(b, (BOX, BOX_T)).sum()) for b in boards}
    if len(nb) != 1:
        raise ValueError(f"all levels of a bank need the same number of boxes, got {sorted(nb)}")
    tabs = [solver.distance_table(b) for b in boards]
    return _assemble(boards, [t[0] for t in tabs], [t[1] for t in tabs], name)


def _assemble(boards: np.ndarray, keys: list[np.ndarray], dists: list[np.ndarray], name: str) -> LevelBank:
    counts = np.array([len(k) for k in keys], np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    num_boxes = int(np.isin(boards[0], (BOX, BOX_T)).sum())
    tables = make_tables(
        np.concatenate(keys), np.concatenate(dists), offsets, counts, boards, num_boxes
    )
    flat = boards.reshape(len(boards), -1)
    players = np.argmax(np.isin(flat, (PLAYER, PLAYER_T)), axis=1).astype(np.int8)
    boxes = np.stack([np.flatnonzero(np.isin(row, (BOX, BOX_T))) for row in flat]).astype(np.int8)
    d0 = np.array([_start_distance(b, k, d) for b, k, d in zip(boards, keys, dists, strict=True)], np.int16)
    return LevelBank(
        boards=jnp.asarray(boards), players=jnp.asarray(players), boxes=jnp.asarray(boxes),
        d0=jnp.asarray(d0), tables=tables, ref=StaticRef(tables), name=name,
    )


def _start_distance(board: np.ndarray, keys: np.ndarray, dists: np.ndarray) -> int:
    room = solver.room_of(board)
    boxes, player = solver.start_of(board)
    key = solver.keys_of(room, boxes, player)[0]
    pos = np.searchsorted(keys, key)
    return int(dists[pos]) if pos < len(keys) and keys[pos] == key else -1


# ----------------------------------------------------------------------------------------------
# init
# ----------------------------------------------------------------------------------------------


def init(level: Level | LevelBank, index: int | None = None) -> State:
    """The start state of ``level`` (a ``Level``, or level ``index`` of a ``LevelBank``)."""
    if isinstance(level, LevelBank):
        if index is None:
            raise ValueError("init(bank, index): give the level index within the bank")
        if isinstance(index, (int, np.integer)):
            if not 0 <= int(index) < len(level):
                raise IndexError(f"level index {index} out of range for a bank of {len(level)} levels")
            index = int(index)
        return init_batch(level, index)  # arrays and tracers too, so ``vmap(init, (None, 0))`` works
    if not isinstance(level, Level):
        raise TypeError(f"init expects a Level or LevelBank, got {type(level).__name__}")
    ref = level.tables_ref()
    flat = level.board.reshape(-1)
    player = int(np.argmax(np.isin(flat, (PLAYER, PLAYER_T))))
    keys = np.asarray(ref.value.keys)[: int(ref.value.counts[0])]
    dist = _start_distance(level.board, keys, np.asarray(ref.value.dists))
    return State.make(player, jnp.asarray(np.flatnonzero(np.isin(flat, (BOX, BOX_T)))), 0, dist, ref)


def init_batch(bank: LevelBank, indices: jax.Array) -> State:
    """Start states for level ``indices`` (any shape) of ``bank``; jittable, bank may be traced."""
    idx = jnp.asarray(indices, jnp.int32)
    return State.make(bank.players[idx], bank.boxes[idx], idx, bank.d0[idx], bank.ref)


# ----------------------------------------------------------------------------------------------
# generator
# ----------------------------------------------------------------------------------------------

_MASKS = (
    ((0, 0),),
    ((0, 0), (0, 1)),
    ((0, 0), (1, 0)),
    ((0, 0), (0, 1), (1, 0), (1, 1)),
    ((0, 0), (0, -1), (0, 1)),
    ((0, 0), (-1, 0), (1, 0)),
)
_DIRS = ((-1, 0), (1, 0), (0, -1), (0, 1))


def _topology(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Floor carved by a random walk with random brush shapes; the border stays wall."""
    floor = np.zeros((h, w), bool)
    r, c = int(rng.integers(1, h - 1)), int(rng.integers(1, w - 1))
    dr, dc = _DIRS[int(rng.integers(4))]
    for _ in range(int(1.5 * (h + w))):
        if rng.random() < 0.35:
            dr, dc = _DIRS[int(rng.integers(4))]
        r = min(max(r + dr, 1), h - 2)
        c = min(max(c + dc, 1), w - 2)
        for mr, mc in _MASKS[int(rng.integers(len(_MASKS)))]:
            rr, cc = r + mr, c + mc
            if 1 <= rr <= h - 2 and 1 <= cc <= w - 2:
                floor[rr, cc] = True
    return floor


def _reverse_search(rng, floor: np.ndarray, targets: list[int], player: int, budget: int, depth_limit: int):
    """Randomised DFS over reverse play; returns the best-scoring (player, boxes, score)."""
    h, w = floor.shape
    free = floor.reshape(-1)
    origin = [divmod(t, w) for t in targets]
    best = (0, player, tuple(targets))
    stack = [(player, tuple(targets), -1, 0, 0)]
    seen: set = set()
    while stack and len(seen) < budget:
        p, boxes, last, swaps, depth = stack.pop()
        key = (p, tuple(sorted(boxes)))
        if key in seen:
            continue
        seen.add(key)
        disp = sum(abs(b // w - o[0]) + abs(b % w - o[1]) for b, o in zip(boxes, origin, strict=True))
        if swaps * disp > best[0]:
            best = (swaps * disp, p, boxes)
        if depth >= depth_limit:
            continue
        r, c = divmod(p, w)
        for d in rng.permutation(4):
            dr, dc = _DIRS[d]
            r1, c1 = r + dr, c + dc
            if not (0 <= r1 < h and 0 <= c1 < w):
                continue
            p1 = r1 * w + c1
            if not free[p1] or p1 in boxes:
                continue
            behind = (r - dr) * w + (c - dc)
            options = [(p1, boxes, last, swaps, depth + 1)]
            if 0 <= r - dr < h and 0 <= c - dc < w and behind in boxes:
                i = boxes.index(behind)
                pulled = boxes[:i] + (p,) + boxes[i + 1:]
                options.append((p1, pulled, i, swaps + (i != last), depth + 1))
            if rng.random() < 0.5:
                options.reverse()
            stack.extend(options)
    return best


def _random_walk(rng, floor: np.ndarray, boxes: tuple[int, ...], player: int, steps: int) -> int:
    h, w = floor.shape
    for _ in range(steps):
        r, c = divmod(player, w)
        moves = [
            (r + dr) * w + (c + dc)
            for dr, dc in _DIRS
            if 0 <= r + dr < h and 0 <= c + dc < w and floor[r + dr, c + dc]
            and (r + dr) * w + (c + dc) not in boxes
        ]
        if not moves:
            break
        player = moves[int(rng.integers(len(moves)))]
    return player


def canonical_room(board: np.ndarray) -> bytes:
    """A board's room identity: its walls, boxes and targets (the player's square reads as what lies under
    it), with its shape. Boards that differ only in where the player stands share a room."""
    b = np.array(board, dtype=np.int8)
    b[b == PLAYER] = FLOOR
    b[b == PLAYER_T] = TARGET
    return np.asarray(b.shape, np.int16).tobytes() + b.tobytes()


def _candidate(rng, h: int, w: int, num_boxes: int, budget: int) -> np.ndarray | None:
    floor = _topology(rng, h, w)
    cells = np.flatnonzero(floor.reshape(-1))
    if len(cells) < num_boxes + 2:
        return None
    picked = rng.choice(cells, num_boxes + 1, replace=False)
    targets, player = [int(x) for x in picked[:-1]], int(picked[-1])
    score, player, boxes = _reverse_search(rng, floor, targets, player, budget, depth_limit=300)
    if score == 0:
        return None
    player = _random_walk(rng, floor, boxes, player, int(rng.integers(0, 5)))
    flat = np.where(floor.reshape(-1), FLOOR, WALL).astype(np.int8)
    flat[targets] = TARGET
    for b in boxes:
        flat[b] = BOX_T if flat[b] == TARGET else BOX
    flat[player] = PLAYER_T if flat[player] == TARGET else PLAYER
    return flat.reshape(h, w)


def generate_boards(
    seed: int, n: int, dim: tuple[int, int] = (6, 6), num_boxes: int = 2, min_solution: int = 5,
    max_solution: int = 100, exclude: set[bytes] | None = None, max_attempts: int | None = None,
    search_budget: int = 2000, exclude_rooms: set[bytes] | None = None, stable_slots: bool = False,
) -> list[np.ndarray]:
    """The boards ``generate`` would stack (host numpy); ``exclude`` skips boards by ``tobytes()``.

    ``exclude_rooms`` (``canonical_room`` keys): skip boards of these rooms, and, when given, keep the
    boards' rooms distinct from each other too. ``stable_slots`` (with ``exclude_rooms``): the boards
    the exact-board rule alone would pick keep their places, and each place whose board repeats a room is
    refilled, in order, by the next boards of fresh rooms further along the same seed's sequence; a part
    generated before the room rule existed then changes only where it repeated a room."""
    h, w = int(dim[0]), int(dim[1])
    if h < 3 or w < 3:
        raise ValueError(f"rooms need at least 3x3 cells, got {dim}")
    if num_boxes < 1:
        raise ValueError(f"num_boxes must be >= 1, got {num_boxes}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if min_solution > max_solution:
        raise ValueError(f"min_solution {min_solution} > max_solution {max_solution}")
    check_encodable(h, w, num_boxes)
    rng = np.random.default_rng(seed)
    seen = set(exclude or ())
    rooms = None if exclude_rooms is None else set(exclude_rooms)
    out: list[np.ndarray | None] = []
    holes: list[int] = []  # places whose board repeated a room (stable_slots), refilled first to last
    attempts = 0
    limit = max_attempts if max_attempts is not None else 200 * max(n, 1) + 1000
    while len(out) < n or holes:
        attempts += 1
        if attempts > limit:
            raise RuntimeError(
                f"generator found only {len(out) - len(holes)}/{n} levels in {limit} attempts "
                f"(dim={dim}, boxes={num_boxes}, solution in [{min_solution}, {max_solution}])"
            )
        board = _candidate(rng, h, w, num_boxes, search_budget)
        if board is None or board.tobytes() in seen:
            continue
        room = canonical_room(board) if rooms is not None else b""
        stale = rooms is not None and room in rooms
        if stale and not (stable_slots and len(out) < n):
            continue
        if not min_solution <= solver.solve_board(board) <= max_solution:
            continue
        seen.add(board.tobytes())
        if stale:  # the exact-board rule would take it here: hold its place for a fresh room
            holes.append(len(out))
            out.append(None)
            continue
        if rooms is not None:
            rooms.add(room)
        if len(out) < n:
            out.append(board)
        else:
            out[holes.pop(0)] = board
    return [b for b in out if b is not None]


def generate(
    seed: int, n: int, dim: tuple[int, int] = (6, 6), num_boxes: int = 2, min_solution: int = 5,
    max_solution: int = 100, **kwargs,
) -> LevelBank:
    """``n`` solvable levels, deterministic per ``seed``, stacked into a ``LevelBank``."""
    boards = generate_boards(seed, n, dim, num_boxes, min_solution, max_solution, **kwargs)
    if not boards:
        raise ValueError("generate needs n >= 1 to build a bank")
    return bank_from_boards(boards, name=f"generated-seed{seed}")


# ----------------------------------------------------------------------------------------------
# registered splits
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """A registered size: room shape, boxes, solution lengths, and a seed and a count per part."""

    dim: tuple[int, int]
    num_boxes: int
    min_solution: int
    max_solution: int
    train_seed: int
    test_seed: int
    n_train: int = 256
    n_test: int = 128
    n_val: int = 64
    val_seed: int | None = None  # None: test_seed + 1
    max_attempts: int | None = None  # candidates per held-out part (None: generate_boards' default)

    def seed_of(self, part: str) -> int:
        if part == "val":
            return self.test_seed + 1 if self.val_seed is None else self.val_seed
        return self.train_seed if part == "train" else self.test_seed

    def count_of(self, part: str) -> int:
        return {"train": self.n_train, "test": self.n_test, "val": self.n_val}[part]


SPLITS: dict[str, SplitSpec] = {
    # tiny rooms, short solutions (CPU demo). Its 256 training boards hold 139 distinct rooms, the ones the
    # generator draws most often; the held-out rooms come from its long tail (the 64 validation rooms take
    # about 117,000 candidates, hence the higher limit) and are easier: shortest solutions of 2 moves in 88
    # of 128 test and 52 of 64 validation rooms, against 96 of 256 training boards
    "sokoban-5x5-1": SplitSpec((5, 5), 1, 2, 12, 5501, 5502, max_attempts=150_000),
    "sokoban-6x6-1": SplitSpec((6, 6), 1, 3, 30, 6101, 6102),
    "sokoban-6x6-2": SplitSpec((6, 6), 2, 5, 100, 6201, 6202),
    "sokoban-6x6-3": SplitSpec((6, 6), 3, 5, 100, 6301, 6302),
    "sokoban-7x7-2": SplitSpec((7, 7), 2, 5, 100, 7201, 7202),
    "sokoban-7x7-3": SplitSpec((7, 7), 3, 5, 100, 7301, 7302),
    "sokoban-8x8-2": SplitSpec((8, 8), 2, 5, 120, 8201, 8202),
    "sokoban-8x8-3": SplitSpec((8, 8), 3, 5, 120, 8301, 8302),
    "sokoban-8x8-4": SplitSpec((8, 8), 4, 5, 120, 8401, 8402),
}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where generated banks are cached: ``override``, ``$RETROJAX_CACHE``, or the user cache dir."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("RETROJAX_CACHE"):
        return Path(os.environ["RETROJAX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "retrojax"


def _part_inputs(part: str, spec: SplitSpec) -> tuple:
    """Everything that decides a part's boards: its own seed and count and those of the parts it
    excludes (train, then test), so a part's cache file changes exactly when its boards can."""
    train = (GENERATOR_VERSION, spec.dim, spec.num_boxes, spec.min_solution, spec.max_solution,
             spec.train_seed, spec.n_train)
    if part == "train":
        return train
    test = (*train, ROOMS_VERSION, spec.test_seed, spec.n_test)
    return test if part == "test" else (*test, spec.seed_of("val"), spec.n_val)


def _split_file(directory: Path, name: str, part: str, spec: SplitSpec) -> Path:
    tag = hashlib.sha1(repr(_part_inputs(part, spec)).encode()).hexdigest()[:10]
    return directory / f"{name}-{part}-v{GENERATOR_VERSION}-{tag}.npz"


def _save(path: Path, boards: np.ndarray, keys: list[np.ndarray], dists: list[np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    counts = np.array([len(k) for k in keys], np.int64)
    np.savez_compressed(
        tmp, boards=boards, keys=np.concatenate(keys), dists=np.concatenate(dists), counts=counts
    )
    os.replace(tmp, path)


def _load(path: Path) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    with np.load(path) as z:
        boards, keys, dists, counts = z["boards"], z["keys"], z["dists"], z["counts"]
    cuts = np.cumsum(counts)[:-1]
    return boards, np.split(keys, cuts), np.split(dists, cuts)


def _split_boards(name: str, part: str, spec: SplitSpec, directory: Path):
    path = _split_file(directory, name, part, spec)
    if path.exists():
        try:
            return _load(path)
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)  # a truncated or foreign cache file: regenerate
    rooms = None  # train: generated as it always was; held-out parts: no room of an earlier part
    if part != "train":
        rooms = set()
        for earlier in PARTS[: PARTS.index(part)]:
            rooms |= {canonical_room(b) for b in _split_boards(name, earlier, spec, directory)[0]}
    exclude = None  # test: the exact-board rule it was made with keeps its places (``stable_slots``)
    if part == "test":
        exclude = {b.tobytes() for b in _split_boards(name, "train", spec, directory)[0]}
    boards = generate_boards(
        spec.seed_of(part), spec.count_of(part), spec.dim, spec.num_boxes, spec.min_solution,
        spec.max_solution, exclude=exclude, max_attempts=spec.max_attempts, exclude_rooms=rooms,
        stable_slots=part == "test",
    )
    tabs = [solver.distance_table(b) for b in boards]
    stacked = np.asarray(boards, np.int8)
    keys, dists = [t[0] for t in tabs], [t[1] for t in tabs]
    _save(path, stacked, keys, dists)
    return stacked, keys, dists


def split_names() -> list[str]:
    """Every loadable split name, ``NAME:train``, ``NAME:test`` and ``NAME:val``."""
    return [f"{name}:{part}" for name in SPLITS for part in PARTS]


def load_split(name: str, cache: str | os.PathLike | None = None) -> LevelBank:
    """A registered split as a bank, e.g. ``load_split("sokoban-6x6-2:test")``; parts ``train``, ``test``
    and ``val`` (generated once, cached on disk, and kept in memory for the rest of the process)."""
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"split name must look like 'sokoban-6x6-2:test', got {name!r}")
    base, part = name.rsplit(":", 1)
    if base not in SPLITS:
        raise KeyError(f"unknown split {base!r}; registered: {', '.join(sorted(SPLITS))}")
    if part not in PARTS:
        raise ValueError(f"split part must be one of {', '.join(PARTS)}, got {part!r} in {name!r}")
    directory = cache_dir(cache)
    memo_key = (name, SPLITS[base], str(directory.resolve()))
    if memo_key not in _LOADED:
        boards, keys, dists = _split_boards(base, part, SPLITS[base], directory)
        _LOADED[memo_key] = _assemble(np.asarray(boards, np.int8), keys, dists, name)
    return _LOADED[memo_key]


# Banks loaded in this process: loading a split twice returns the same bank (and the same static
# tables reference), so jitted steps over its states compile once.
_LOADED: dict[tuple, LevelBank] = {}
