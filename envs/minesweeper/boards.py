"""No-guess MineSweeper boards: generation, the stacked ``BoardBank``, registered splits, disk cache.

Generation (``generate``) is deterministic per seed. Candidates are drawn on device in batches: a
uniform first-click cell, and mines placed uniformly by top-k of uniform noise over the cells outside
the click's 3×3 neighbourhood (so the first click is a blank cell and opens a region). On the host each
candidate is kept only if the first click does not already win, it is not a duplicate (or listed in
``exclude``), and, with ``no_guess``, exact deduction finishes it from the first observation without a
guess.

Reference solution length: the number of reveals after the first click in a shortest plan that opens
every safe cell while revealing only cells that ``deduce`` proves safe at that moment
(``deduce.solve_plan``: greedy on cells every plan must reveal itself — any cell of an unopened blank
region, or a number bordering no blank — plus an exact branch search where only cascade-bordering numbers
are deducible). Boards whose search would exceed its node limit are skipped so every recorded length is
certified. Without ``no_guess`` a board that needs a guess records ``-1``.

Registered splits have three parts, disjoint by mine layout (the first click does not make a board new):
``:train`` is generated as it always was (it may repeat a layout with another first click), ``:test``
skips every training layout and repeats none of its own, ``:val`` skips the layouts of both. Each part has
its own seed, so the test boards do not depend on the validation boards.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from envs.minesweeper.deduce import SearchLimitError, counts_np, reveal_np, solve_plan
from envs.minesweeper.rules import Board, State, cascade_table, make_state, step
from envs.static import StaticRef

GENERATOR_VERSION = 1  # bump when generation changes, so cached banks are rebuilt
ROOMS_VERSION = 2  # held-out parts disjoint from training by mine layout (bump when that rule changes)
PARTS = ("train", "test", "val")
_BATCH = 256


@dataclasses.dataclass(frozen=True)
class BoardBank:
    """Boards stacked as arrays; ``init_batch`` starts any batch of them at once (with ``cascade``)."""

    mines: np.ndarray  # bool[N, H, W]
    first_click: np.ndarray  # int32[N, 2], 0-indexed (row, col)
    solution_length: np.ndarray  # int32[N]; -1 when the board needs a guess (only without no_guess)
    num_mines: int
    name: str = ""

    def __post_init__(self) -> None:
        n = self.mines.shape[0]
        if self.mines.ndim != 3 or self.first_click.shape != (n, 2) or self.solution_length.shape != (n,):
            raise ValueError("BoardBank arrays must be mines[N,H,W], first_click[N,2], solution_length[N]")

    def __len__(self) -> int:
        return int(self.mines.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """(H, W) of every board in the bank."""
        return int(self.mines.shape[1]), int(self.mines.shape[2])

    def __getitem__(self, i: int) -> Board:
        n = len(self)
        if not -n <= int(i) < n:
            raise IndexError(f"board index {i} out of range for a bank of {n} boards ({self.name})")
        return Board(
            mines=jnp.asarray(self.mines[i]),
            first_click=jnp.asarray(self.first_click[i], jnp.int32),
            solution_length=jnp.asarray(self.solution_length[i], jnp.int32),
        )

    @functools.cached_property
    def cascade(self) -> StaticRef:
        """The bank's cascade table (built on first use; one flood fill per board and cell)."""
        return cascade_table(self.mines)

    def boards(self) -> Board:
        """All boards as one batched ``Board`` pytree (leading axis N), on device."""
        return Board(
            mines=jnp.asarray(self.mines),
            first_click=jnp.asarray(self.first_click, jnp.int32),
            solution_length=jnp.asarray(self.solution_length, jnp.int32),
        )


@functools.partial(jax.jit, static_argnums=0)
def _start_states(cascade: StaticRef, mines: jax.Array, clicks: jax.Array, index: jax.Array) -> State:
    def one(m, click, i):
        return step(make_state(m, jnp.zeros(m.shape, bool), i, cascade), click)[0]

    return jax.vmap(one)(mines, clicks, index)


def init_batch(bank: BoardBank, indices) -> State:
    """Initial states of ``bank[indices]`` (a batched ``State`` with a leading axis) that use the bank's
    cascade table (the fast step); the same worlds as ``init(bank[i])``."""
    idx = np.asarray(indices, np.int64).reshape(-1)
    n = len(bank)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"board indices must lie in [0, {n}) for bank {bank.name!r}")
    idx = idx % max(n, 1)
    clicks = jnp.asarray(bank.first_click[idx], jnp.int32)
    return _start_states(bank.cascade, jnp.asarray(bank.mines[idx]), clicks, jnp.asarray(idx, jnp.int32))


def _zone(h: int, w: int) -> np.ndarray:
    """bool[H·W, H·W]: row k marks the 3×3 neighbourhood (inclusive) of flat cell k."""
    rr, cc = np.divmod(np.arange(h * w), w)
    return (np.abs(rr[:, None] - rr[None, :]) <= 1) & (np.abs(cc[:, None] - cc[None, :]) <= 1)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _candidates(key: jax.Array, batch: int, h: int, w: int, num_mines: int) -> tuple[jax.Array, jax.Array]:
    """``batch`` candidate (mines bool[batch, H, W], first click flat index) drawn on device."""
    k_click, k_noise = jax.random.split(key)
    clicks = jax.random.randint(k_click, (batch,), 0, h * w)
    noise = jax.random.uniform(k_noise, (batch, h * w))
    noise = jnp.where(jnp.asarray(_zone(h, w))[clicks], -1.0, noise)
    _, idx = jax.lax.top_k(noise, num_mines)
    mines = jnp.zeros((batch, h * w), bool).at[jnp.arange(batch)[:, None], idx].set(True)
    return mines.reshape(batch, h, w), clicks


def layout_key(mines: np.ndarray) -> bytes:
    """A board's identity across first clicks: its shape and mine layout."""
    mines = np.asarray(mines, bool)
    return np.asarray(mines.shape, np.int16).tobytes() + mines.tobytes()


def generate(
    seed: int,
    n: int,
    size: int | tuple[int, int] = 6,
    num_mines: int = 3,
    no_guess: bool = True,
    exclude: BoardBank | None = None,
    name: str = "",
    exclude_layouts: set[bytes] | None = None,
    stable_slots: bool = False,
) -> BoardBank:
    """``n`` boards from ``seed`` (deterministic); see the module doc for the method and solution length.

    ``exclude``: boards (same layout and first click) that must not appear. ``exclude_layouts``
    (``layout_key``s): mine layouts that must not appear under any first click; when given, the boards'
    layouts are also distinct from each other. ``stable_slots`` (with ``exclude_layouts``): the boards the
    exact-board rule alone would pick keep their places, and each place whose board repeats a layout is
    refilled, in order, by the next boards of fresh layouts further along the seed's sequence; a part
    generated before the layout rule existed then changes only where it repeated a layout.
    """
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if h < 2 or w < 2 or n < 0:
        raise ValueError(f"need a board of at least 2x2 and n >= 0, got {h}x{w}, n={n}")
    if not 1 <= num_mines <= h * w - 9:
        raise ValueError(f"num_mines must lie in [1, {h * w - 9}] for a {h}x{w} board (the first click's "
                         f"3x3 neighbourhood stays clear), got {num_mines}")
    seen: set[bytes] = set()
    if exclude is not None:
        for i in range(len(exclude)):
            seen.add(exclude.mines[i].tobytes() + exclude.first_click[i].astype(np.int32).tobytes())
    layouts = None if exclude_layouts is None else set(exclude_layouts)
    out: list[tuple[np.ndarray, np.ndarray, int] | None] = []
    holes: list[int] = []  # places whose board repeated a layout (stable_slots), refilled first to last
    base = jax.random.key(int(seed))
    attempts = 0
    while len(out) < n or holes:
        key = jax.random.fold_in(base, attempts)
        mines_b, clicks_b = (np.asarray(x) for x in _candidates(key, _BATCH, h, w, num_mines))
        attempts += 1
        if attempts > 10_000:
            raise RuntimeError(f"could not find {n} boards ({h}x{w}, {num_mines} mines) after many batches")
        for mines, flat in zip(mines_b, clicks_b, strict=True):
            click = np.array(divmod(int(flat), w), np.int32)
            ident = mines.tobytes() + click.tobytes()
            if ident in seen:
                continue
            layout = layout_key(mines) if layouts is not None else b""
            stale = layouts is not None and layout in layouts
            if stale and not (stable_slots and len(out) < n):
                continue
            board = counts_np(mines)
            revealed = reveal_np(board, np.zeros((h, w), bool), int(click[0]), int(click[1]))
            if np.all(revealed | mines):
                continue
            try:
                plan = solve_plan(board, revealed)
            except SearchLimitError:
                continue
            if plan is None and no_guess:
                continue
            seen.add(ident)
            if stale:  # the exact-board rule would take it here: hold its place for a fresh layout
                holes.append(len(out))
                out.append(None)
                continue
            if layouts is not None:
                layouts.add(layout)
            entry = (mines, click, -1 if plan is None else len(plan))
            if len(out) < n:
                out.append(entry)
            else:
                out[holes.pop(0)] = entry
            if len(out) == n and not holes:
                break
    kept = [e for e in out if e is not None]
    out_mines, out_click, out_len = ([e[i] for e in kept] for i in range(3))
    return BoardBank(
        mines=np.asarray(out_mines, bool).reshape(n, h, w),
        first_click=np.asarray(out_click, np.int32).reshape(n, 2),
        solution_length=np.asarray(out_len, np.int32).reshape(n),
        num_mines=num_mines,
        name=name,
    )


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """A registered family: board size, mines, and a seed and a count per part."""

    size: int
    num_mines: int
    train_seed: int
    test_seed: int
    train_n: int = 256
    test_n: int = 128
    val_n: int = 64
    val_seed: int | None = None  # None: test_seed + 1

    def seed_of(self, part: str) -> int:
        if part == "val":
            return self.test_seed + 1 if self.val_seed is None else self.val_seed
        return self.train_seed if part == "train" else self.test_seed

    def count_of(self, part: str) -> int:
        return {"train": self.train_n, "test": self.test_n, "val": self.val_n}[part]


SPLITS: dict[str, SplitSpec] = {
    "minesweeper-6x6-3": SplitSpec(6, 3, train_seed=60_300, test_seed=60_301),
    "minesweeper-6x6-4": SplitSpec(6, 4, train_seed=60_400, test_seed=60_401),
    "minesweeper-6x6-5": SplitSpec(6, 5, train_seed=60_500, test_seed=60_501),
    "minesweeper-6x6-6": SplitSpec(6, 6, train_seed=60_600, test_seed=60_601),
    "minesweeper-8x8-8": SplitSpec(8, 8, train_seed=80_800, test_seed=80_801),
}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Bank cache folder: under ``override``, else ``$RETROJAX_CACHE``, else ``~/.cache/retrojax``."""
    root = override or os.environ.get("RETROJAX_CACHE") or Path.home() / ".cache" / "retrojax"
    return Path(root) / "minesweeper"


def _save(path: Path, bank: BoardBank) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, mines=bank.mines, first_click=bank.first_click, solution_length=bank.solution_length,
             num_mines=np.int32(bank.num_mines))
    os.replace(tmp, path)


def _load(path: Path, name: str) -> BoardBank | None:
    try:
        with np.load(path) as z:
            return BoardBank(mines=z["mines"].astype(bool), first_click=z["first_click"].astype(np.int32),
                             solution_length=z["solution_length"].astype(np.int32),
                             num_mines=int(z["num_mines"]), name=name)
    except (OSError, KeyError, ValueError):
        return None


def _part_inputs(part: str, spec: SplitSpec) -> tuple:
    """Everything that decides a part's boards: its own seed and count and those of the parts it
    excludes (train, then test)."""
    train = (GENERATOR_VERSION, spec.size, spec.num_mines, spec.train_seed, spec.train_n)
    if part == "train":
        return train
    test = (*train, ROOMS_VERSION, spec.test_seed, spec.test_n)
    return test if part == "test" else (*test, spec.seed_of("val"), spec.val_n)


def _part_path(root: Path, family: str, part: str, spec: SplitSpec) -> Path:
    if part == "train":  # the training boards never changed: their cache file keeps its name
        return root / f"{family}-train-v{GENERATOR_VERSION}.npz"
    tag = hashlib.sha1(repr(_part_inputs(part, spec)).encode()).hexdigest()[:10]
    return root / f"{family}-{part}-v{GENERATOR_VERSION}-{tag}.npz"


def _part(family: str, part: str, root: Path) -> BoardBank:
    spec = SPLITS[family]
    path = _part_path(root, family, part, spec)
    name = f"{family}:{part}"
    bank = _load(path, name)
    if bank is not None:
        return bank
    layouts = None  # train: generated as it always was; held-out parts: no layout of an earlier part
    if part != "train":
        layouts = set()
        for earlier in PARTS[: PARTS.index(part)]:
            layouts |= {layout_key(m) for m in _part(family, earlier, root).mines}
    # test: the exact-board rule it was made with keeps its places (``stable_slots``)
    exclude = _part(family, "train", root) if part == "test" else None
    bank = generate(spec.seed_of(part), spec.count_of(part), spec.size, spec.num_mines, exclude=exclude,
                    name=name, exclude_layouts=layouts, stable_slots=part == "test")
    _save(path, bank)
    return bank


def split_names() -> list[str]:
    """Every loadable split name, ``FAMILY:train``, ``FAMILY:test`` and ``FAMILY:val``."""
    return [f"{f}:{p}" for f in SPLITS for p in PARTS]


def load_split(name: str, cache: str | os.PathLike | None = None) -> BoardBank:
    """The bank of a registered split such as ``'minesweeper-6x6-3:test'`` (parts ``train``, ``test``,
    ``val``; generated once, then cached)."""
    family, sep, part = name.partition(":")
    if not sep or part not in PARTS or family not in SPLITS:
        raise ValueError(f"unknown minesweeper split {name!r}; known: {', '.join(split_names())}")
    return _part(family, part, cache_dir(cache))
