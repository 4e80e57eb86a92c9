"""``TrialEnv`` adapters for the functional JAX games: Sokoban and MineSweeper.

All slots' active paths live on device as ONE batched ``envs.trail.Trail`` (leaves
``[num_slots, capacity, ...]``). Each operation is one jitted call over *all* slots with a mask for the
slots it concerns, so shapes never change and each function compiles once per env:

- ``reset``: vmapped ``trail_init`` of the tasks' start states, selected into the masked slots;
- ``step``: vmapped game step from each slot's newest checkpoint, then vmapped ``trail_push``;
- ``rewind``: the masked slots' trail lengths set to ``j + 1`` (a checkpoint is an array slice).

After each operation the current states come back to the host once (a few dozen bytes per slot) for
rendering, state keys and the scripted policies' solver queries. The path score (cumulative reward) per
checkpoint is kept on the host too, because MineSweeper's branch value is a sum of rewards.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from envs import trail as trail_lib
from retrojax.agent import parse
from retrojax.agent.env_api import Action, StepInfo, TrialEnv, state_key_of_arrays


def _select(mask: jax.Array, new: Any, old: Any) -> Any:
    """Per-slot ``where`` over pytrees whose leaves share the leading slot axis."""
    def pick(a, b):
        m = mask.reshape(mask.shape + (1,) * (a.ndim - 1))
        return jnp.where(m, a, b)

    return jax.tree_util.tree_map(pick, new, old)


class FunctionalEnv(TrialEnv):
    """Shared machinery; subclasses give the start states, the step and the text/solver views."""

    code_width: int = 1

    def __init__(self, split: str):
        self.split = split
        self.trail: trail_lib.Trail | None = None
        self.num_slots = 0
        self.capacity = 0
        self._scores: list[list[float]] = []
        self._tasks = np.zeros(0, np.int64)
        self._host: Any = None

    # -- subclass hooks ------------------------------------------------------------------------------
    @abc.abstractmethod
    def _start_states(self, tasks: np.ndarray) -> Any:
        """Batched start states of ``tasks`` (device pytree, leading axis len(tasks))."""

    @abc.abstractmethod
    def _step_fn(self) -> Callable[[Any, Any, jax.Array], tuple[Any, dict[str, jax.Array]]]:
        """Unbatched ``(aux, state, code int32[code_width]) -> (state, outcome dict of scalars)``."""

    @abc.abstractmethod
    def _aux(self) -> Any:
        """Shared read-only data passed (traced, not baked in) to every step, e.g. distance tables."""

    @abc.abstractmethod
    def _info(self, slot: int, out: dict[str, np.ndarray] | None, action: Action | None) -> StepInfo:
        """The ``StepInfo`` of a slot after a reset (``out`` None) or a step."""

    # -- lifecycle -----------------------------------------------------------------------------------
    def open(self, num_slots: int, capacity: int) -> None:
        if num_slots < 1 or capacity < 2:
            raise ValueError(f"need num_slots ≥ 1 and capacity ≥ 2, got {num_slots}, {capacity}")
        self.num_slots, self.capacity = num_slots, capacity
        self._tasks = np.zeros(num_slots, np.int64)
        start = self._start_states(self._tasks)
        self.trail = jax.vmap(lambda s: trail_lib.trail_init(s, capacity))(start)
        self._scores = [[0.0] for _ in range(num_slots)]
        self._refresh()

    def close(self) -> None:
        self.trail = None
        self._host = None

    def _refresh(self) -> None:
        cur = _last_slots(self.trail)
        self._host = jax.tree_util.tree_map(np.asarray, cur)
        self._derive(cur)

    def _derive(self, current: Any) -> None:
        """Hook: compute batched host views of the current states (called after every operation)."""

    def _mask(self, slots: Sequence[int]) -> np.ndarray:
        if self.trail is None:
            raise RuntimeError(f"{self.name}: open() the env before using it")
        mask = np.zeros(self.num_slots, bool)
        idx = np.asarray(slots, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_slots):
            raise IndexError(f"slots must lie in [0, {self.num_slots})")
        if len(set(idx.tolist())) != idx.size:
            raise ValueError("a slot may appear only once per call")
        mask[idx] = True
        return mask

    # -- operations ----------------------------------------------------------------------------------
    def reset(self, slots: Sequence[int], tasks: Sequence[int]) -> list[StepInfo]:
        mask = self._mask(slots)
        tasks = np.asarray(tasks, np.int64)
        if tasks.size and (tasks.min() < 0 or tasks.max() >= self.num_tasks):
            raise IndexError(f"task ids must lie in [0, {self.num_tasks}) for split {self.split}")
        full = self._tasks.copy()
        full[np.asarray(slots, np.int64)] = tasks
        self._tasks = full
        self.trail = _reset_slots(self.capacity, self.trail, self._start_states(full), jnp.asarray(mask))
        for s in slots:
            self._scores[s] = [0.0]
        self._refresh()
        return [self._info(s, None, None) for s in slots]

    def step(self, slots: Sequence[int], actions: Sequence[Action]) -> list[StepInfo]:
        mask = self._mask(slots)
        codes = np.zeros((self.num_slots, self.code_width), np.int32)
        for s, a in zip(slots, actions, strict=True):
            if not a.is_move:
                raise ValueError(f"step takes moves only, got a {a.kind} action for slot {s}")
            codes[s] = self._encode(a)
        self.trail, out, overflow = _step_slots(self._step_fn(), self.trail, self._aux(), jnp.asarray(codes),
                                                jnp.asarray(mask))
        out = {k: np.asarray(v) for k, v in out.items()}
        overflow = np.asarray(overflow)
        self._refresh()
        infos = []
        for s, a in zip(slots, actions, strict=True):
            if overflow[s]:
                infos.append(StepInfo(valid=False, message="the checkpoint trail is full"))
                continue
            self._scores[s].append(self._scores[s][-1] + float(out["reward"][s]))
            infos.append(self._info(s, out, a))
        return infos

    def rewind(self, slots: Sequence[int], targets: Sequence[int]) -> None:
        mask = self._mask(slots)
        full = np.zeros(self.num_slots, np.int32)
        for s, j in zip(slots, targets, strict=True):
            if not 0 <= j < len(self._scores[s]):
                raise IndexError(f"slot {s}: checkpoint C_{j} does not exist (path C_0 … "
                                 f"C_{len(self._scores[s]) - 1})")
            full[s] = j
            del self._scores[s][j + 1 :]
        self.trail = _rewind_slots(self.trail, jnp.asarray(full), jnp.asarray(mask))
        self._refresh()

    def _encode(self, action: Action) -> np.ndarray:
        return np.asarray(action.code, np.int32)

    def path_length(self, slot: int) -> int:
        """Checkpoints on the slot's active path (for tests and tools)."""
        return len(self._scores[slot])

    def trail_length(self, slot: int) -> int:
        return int(np.asarray(self.trail.length)[slot])

    def current_state(self, slot: int) -> Any:
        """Host (numpy) copy of the slot's current state."""
        return jax.tree_util.tree_map(lambda x: x[slot], self._host)

    def state_key(self, slot: int) -> str:
        return state_key_of_arrays(*jax.tree_util.tree_leaves(self.current_state(slot)))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _reset_slots(capacity: int, tr: trail_lib.Trail, fresh: Any, mask: jax.Array) -> trail_lib.Trail:
    new = jax.vmap(lambda s: trail_lib.trail_init(s, capacity))(fresh)
    return _select(mask, new, tr)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _step_slots(step_one: Callable, tr: trail_lib.Trail, aux: Any, codes: jax.Array, mask: jax.Array):
    """One step of every masked slot from its newest checkpoint, then a push of the new checkpoint."""
    cur = jax.vmap(trail_lib.trail_last)(tr)
    new_state, out = jax.vmap(step_one, in_axes=(None, 0, 0))(aux, cur, codes)
    pushed, overflow = jax.vmap(trail_lib.trail_push)(tr, new_state)
    return _select(mask & ~overflow, pushed, tr), out, overflow & mask


@functools.partial(jax.jit, donate_argnums=0)
def _rewind_slots(tr: trail_lib.Trail, targets: jax.Array, mask: jax.Array) -> trail_lib.Trail:
    length = jnp.where(mask, jnp.clip(targets, 0, tr.length - 1) + 1, tr.length).astype(jnp.int32)
    return tr.replace(length=length)


_last_slots = jax.jit(jax.vmap(trail_lib.trail_last))


def _split_of(cfg: Any, split: str | None, family: str) -> str:
    name = split or cfg.env.split
    if ":" not in name:
        name = f"{name}:train"
    if not name.startswith(family):
        raise ValueError(f"split {name!r} is not a {family} split")
    return name


# --------------------------------------------------------------------------------------------------
# Sokoban
# --------------------------------------------------------------------------------------------------


class SokobanEnv(FunctionalEnv):
    """Sokoban slots; progress = exact solver distance (inf when dead); V = d0 − d_end."""

    name = "sokoban"
    prompt_key = "sokoban"
    value_from_initial = True  # C.2: V = d_0 − d_end with d_0 the initial state's distance, not the anchor's
    code_width = 3
    lists_best_actions = True  # every shortest-solution move, from the distance table (one jitted call)

    def __init__(self, split: str, cache_dir: str | None = None, num_tasks: int | None = None,
                 board_notes: bool = False, push_notes: bool = False):
        import envs.sokoban as sokoban

        super().__init__(split)
        self.lib = sokoban
        self.board_notes = board_notes  # ours: relations of boxes, you and targets under the grid
        self.push_notes = push_notes  # ours: the push toward each box's target and the free moves
        self.bank = sokoban.load_split(split, cache_dir)
        self._n = len(self.bank) if num_tasks is None else min(num_tasks, len(self.bank))
        self.height, self.width = (int(x) for x in self.bank.boards.shape[1:])
        board0 = np.asarray(self.bank.boards[0])
        self.boxes = int(np.isin(board0, (3, 4)).sum())

    @property
    def num_tasks(self) -> int:
        return self._n

    def _start_states(self, tasks: np.ndarray) -> Any:
        return self.lib.init_batch(self.bank, jnp.asarray(tasks, jnp.int32))

    def _aux(self) -> Any:
        return self.bank.tables

    def _step_fn(self):
        return _sokoban_step

    def _encode(self, action: Action) -> np.ndarray:
        codes = np.zeros(self.code_width, np.int32)
        codes[: len(action.code)] = np.asarray(action.code, np.int32) + 1  # parse: 0..3 → rules: 1..4
        return codes

    def _info(self, slot: int, out: dict[str, np.ndarray] | None, action: Action | None) -> StepInfo:
        dist = int(self._host.distance[slot])
        progress = float("inf") if dist < 0 else float(dist)
        key = self.state_key(slot)
        if out is None:
            return StepInfo(progress=progress, state_key=key, solved=dist == 0, failed=dist < 0,
                            message="start")
        n = len(action.code)
        applied, on = int(out["applied"][slot]), int(out["on_target"][slot])
        msg = f"{applied} of {n} moves changed the board; {on} of {self.boxes} boxes on targets"
        if dist == 0:
            msg += "; solved"
        elif dist < 0:
            msg += "; dead end: the puzzle can no longer be solved"
        return StepInfo(reward=float(out["reward"][slot]), solved=dist == 0, failed=dist < 0,
                        progress=progress, state_key=key, message=msg, moves=applied)

    def _derive(self, current: Any) -> None:
        self._boards = np.asarray(_sokoban_boards(current))  # composed once per operation, for all slots

    def state_key(self, slot: int) -> str:
        """Hash of the board and player (the level index and distance follow from them)."""
        return state_key_of_arrays(self._boards[slot], self._host.player[slot])

    def observations(self, slots: Sequence[int]) -> list[str]:
        from envs.sokoban.text import board_notes, push_notes

        notes = [fn for on, fn in ((self.board_notes, board_notes), (self.push_notes, push_notes)) if on]
        return ["\n".join([self.lib.render(self._boards[s]), *(fn(self._boards[s]) for fn in notes)])
                for s in slots]

    def parse_action(self, text: str) -> Action:
        return parse.parse_sokoban(text)

    def branch_value(self, progress: Sequence[float], solved: bool, failed: bool) -> float:
        d0 = float(progress[0])
        if not np.isfinite(d0):
            return 0.0
        d_end = 0.0 if solved else d0 if (failed or not np.isfinite(progress[-1])) else float(progress[-1])
        return d0 - d_end

    def endpoint_progress(self, progress: Sequence[float], score: float, solved: bool, failed: bool) -> float:
        """C.2's progress d_0 − d_end of the path from ``C_0`` (0 for a dead end, d_0 when solved), not the
        move-penalised reward: among failed segments the reward ranks the shortest first."""
        return self.branch_value(progress, solved, failed)

    def prompt_fields(self, task: int) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, "boxes": self.boxes}

    def task_scale(self, task: int) -> float:
        """d0: the exact shortest solution length of the level (``TrialRecord.d0``)."""
        return float(np.asarray(self.bank.d0)[task])

    def expert_actions(self, slots: Sequence[int]) -> list[str | None]:
        """One move that starts a shortest solution (the first such in up, down, left, right order)."""
        return [moves[0] if moves else None for moves in self.optimal_actions(slots)]

    def optimal_actions(self, slots: Sequence[int]) -> list[list[str]]:
        """Every move that starts a shortest solution (none in a dead state)."""
        optimal = np.asarray(_sokoban_optimal(self.bank.tables, self.trail))
        return [[parse.SOKOBAN_MOVES[int(m)] for m in np.nonzero(optimal[s])[0]] for s in slots]

    def random_actions(self, slots: Sequence[int], rng: np.random.Generator,
                       avoid: Sequence[frozenset[str]] = ()) -> list[str]:
        out = []
        for i, _ in enumerate(slots):
            banned = avoid[i] if i < len(avoid) else frozenset()
            options = [m for m in parse.SOKOBAN_MOVES if m not in banned] or list(parse.SOKOBAN_MOVES)
            out.append(options[int(rng.integers(len(options)))])
        return out


def _sokoban_step(tables: Any, state: Any, code: jax.Array):
    import envs.sokoban as sokoban

    new, out = sokoban.step_with(tables, state, code)
    return new, {"reward": out.reward, "solved": out.solved, "dead": out.dead, "applied": out.moves_applied,
                 "on_target": out.boxes_on_target, "distance": out.distance}


@jax.jit
def _sokoban_boards(states: Any) -> jax.Array:
    return states.board


@jax.jit
def _sokoban_optimal(tables: Any, tr: trail_lib.Trail) -> jax.Array:
    import envs.sokoban as sokoban

    return jax.vmap(lambda t: sokoban.optimal_moves_with(tables, trail_lib.trail_last(t)))(tr)


def make_sokoban(cfg: Any, split: str | None = None) -> SokobanEnv:
    return SokobanEnv(_split_of(cfg, split, "sokoban"), cfg.env.cache_dir, cfg.env.num_tasks,
                      board_notes=cfg.env.board_notes, push_notes=cfg.env.push_notes)


# --------------------------------------------------------------------------------------------------
# MineSweeper
# --------------------------------------------------------------------------------------------------


class MineSweeperEnv(FunctionalEnv):
    """MineSweeper slots; progress = cumulative reward along the path; V = reward after the anchor."""

    name = "minesweeper"
    prompt_key = "minesweeper"
    code_width = 2

    def __init__(self, split: str, cache_dir: str | None = None, num_tasks: int | None = None):
        import envs.minesweeper as ms

        super().__init__(split)
        self.lib = ms
        self.bank = ms.load_split(split, cache_dir)
        self._n = len(self.bank) if num_tasks is None else min(num_tasks, len(self.bank))
        self.height, self.width = self.bank.shape
        self._expert_cache: dict[tuple[int, bytes], tuple[int, int] | None] = {}

    @property
    def num_tasks(self) -> int:
        return self._n

    def _start_states(self, tasks: np.ndarray) -> Any:
        return self.lib.init_batch(self.bank, tasks)

    def _aux(self) -> Any:
        return ()

    def _derive(self, current: Any) -> None:
        self._revealed = np.asarray(current.revealed, bool)
        self._lost = np.asarray(self.lib.is_lost(current))
        self._won = np.asarray(self.lib.is_won(current))

    def _step_fn(self):
        return _minesweeper_step

    def _info(self, slot: int, out: dict[str, np.ndarray] | None, action: Action | None) -> StepInfo:
        key = self.state_key(slot)
        lost, won = bool(self._lost[slot]), bool(self._won[slot])
        score = self._scores[slot][-1]
        if out is None:
            return StepInfo(progress=score, state_key=key, solved=won, failed=lost, message="start")
        opened = int(out["opened"][slot])
        if lost:
            msg = "hit a mine"
        elif won:
            msg = f"opened {opened} cell{'s' * (opened != 1)}; every safe cell is open"
        elif opened == 0:
            msg = "nothing happened: that cell was already open"
        else:
            msg = f"opened {opened} cell{'s' * (opened != 1)}"
        return StepInfo(reward=float(out["reward"][slot]), solved=won, failed=lost, progress=score,
                        state_key=key, message=msg, moves=1)

    def observations(self, slots: Sequence[int]) -> list[str]:
        return [self.lib.render(self.current_state(s)) for s in slots]

    def parse_action(self, text: str) -> Action:
        return parse.parse_minesweeper(text, self.height, self.width)

    def branch_value(self, progress: Sequence[float], solved: bool, failed: bool) -> float:
        return float(progress[-1]) - float(progress[0])

    def prompt_fields(self, task: int) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, "mines": int(self.bank.num_mines)}

    def task_scale(self, task: int) -> float:
        """The board's reference solution length in reveals (``TrialRecord.d0``)."""
        return float(self.bank.solution_length[task])

    def expert_actions(self, slots: Sequence[int]) -> list[str | None]:
        out: list[str | None] = []
        for s in slots:
            key = (int(self._tasks[s]), self._revealed[s].tobytes())
            if key not in self._expert_cache:
                self._expert_cache[key] = self.lib.safe_reveal(self.current_state(s))
            cell = self._expert_cache[key]
            out.append(None if cell is None else f"({cell[0] + 1}, {cell[1] + 1})")
        return out

    def random_actions(self, slots: Sequence[int], rng: np.random.Generator,
                       avoid: Sequence[frozenset[str]] = ()) -> list[str]:
        out = []
        for i, s in enumerate(slots):
            banned = avoid[i] if i < len(avoid) else frozenset()
            hidden = np.argwhere(~self._revealed[s])
            cells = [f"({r + 1}, {c + 1})" for r, c in hidden]
            options = [c for c in cells if c not in banned] or cells or ["(1, 1)"]
            out.append(options[int(rng.integers(len(options)))])
        return out


def _minesweeper_step(aux: Any, state: Any, code: jax.Array):
    import envs.minesweeper as ms

    new, out = ms.step(state, code)
    return new, {"reward": out.reward, "won": out.won, "lost": out.lost, "opened": out.cells_opened}


def make_minesweeper(cfg: Any, split: str | None = None) -> MineSweeperEnv:
    return MineSweeperEnv(_split_of(cfg, split, "minesweeper"), cfg.env.cache_dir, cfg.env.num_tasks)
