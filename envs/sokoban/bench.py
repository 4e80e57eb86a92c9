"""Speed figures for Sokoban (called by ``retrojax bench envs``), and the Jumanji anchor.

``sokoban.steps_per_s.B`` counts primitive moves per second for ``jit(lax.scan(vmap(step)))`` over 100
turns of 3 uniformly random moves on B trials (moves drawn before timing); a trial that is solved or dead
is put back to its start state inside the scan (a select), so every turn steps live rooms — exact
dead/distance lookups included. ``jumanji.sokoban.steps_per_s.B`` runs Jumanji's Sokoban
(``ToyGenerator``) the same way with 300 primitive steps, so both count the same unit.
``sokoban.rewind_us_per_trial`` restores ``C_j`` for 1024 trials at once from a batched trail (jitted,
vmapped ``trail_rewind`` with the trail donated, as the agent loop calls it);
``sokoban.deepcopy_rewind_us_per_trial`` is ``copy.deepcopy`` of 1024 plain numpy Sokoban objects (the way
upstream code checkpoints). ``sokoban.generate_s_per_level`` includes the exact distance table;
``sokoban.solve_ms_per_state`` is the host BFS from a level's start. Times are the best of a few runs;
our rollout and Jumanji's are timed in alternation at each batch size (``benchkit.paired_best``), and so
are the rewind calls and the deepcopy rounds (``benchkit.rewind_vs_deepcopy``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import envs.sokoban as sk
from envs.benchkit import paired_best, resetting_rollout, rewind_vs_deepcopy

BATCHES = (1, 64, 1024, 4096)
TURNS = 100
QUICK_TURNS = 4  # --quick: a smoke test of the code path at every batch size, not a figure
MOVES_PER_TURN = 3
REWIND_TRIALS = 1024
REWIND_CAPACITY = 21
JUMANJI_NOTE = (
    "note: Jumanji's Sokoban (ToyGenerator) uses 10x10 grids and has no dead-state detection; ours are "
    "the split's rooms with an exact dead/distance table lookup after every primitive move."
)


def _bank(quick: bool) -> sk.LevelBank:
    return sk.generate(3, 16) if quick else sk.load_split("sokoban-6x6-2:train")


def _our_rollout(bank: sk.LevelBank, b: int, turns: int = TURNS) -> Callable[[], object]:
    run = resetting_rollout(sk.step, lambda s, o: (o.reward, o.solved | o.dead))
    start = sk.init_batch(bank, jnp.arange(b) % len(bank))
    moves = jax.random.randint(jax.random.key(b), (turns, b, MOVES_PER_TURN), 1, 5, jnp.int32)
    return lambda: run(start, moves)


def _jumanji_rollouts() -> dict[int, Callable[[], object]] | None:
    """Jumanji's Sokoban (ToyGenerator) rollouts of ``TURNS * MOVES_PER_TURN`` primitive steps per batch
    size, or None (with a printed note) when jumanji is not installed."""
    try:
        from jumanji.environments import Sokoban
        from jumanji.environments.routing.sokoban.generator import ToyGenerator
    except Exception as err:  # jumanji is an optional extra; any import failure means "not measured"
        print(f"note: jumanji Sokoban not measured ({type(err).__name__}: {err})")
        return None
    env = Sokoban(generator=ToyGenerator())
    run = resetting_rollout(env.step, lambda s, ts: (ts.reward, ts.last()))
    out = {}
    for b in BATCHES:
        start, _ = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(0), b))
        actions = jax.random.randint(jax.random.key(b), (TURNS * MOVES_PER_TURN, b), 0, 4, jnp.int32)
        out[b] = lambda start=start, actions=actions: run(start, actions)
    print(JUMANJI_NOTE)
    return out


def _steps_per_s(bank: sk.LevelBank, quick: bool) -> dict[str, float]:
    """``sokoban.steps_per_s.B`` and, with jumanji installed, ``jumanji.sokoban.steps_per_s.B``."""
    theirs = _jumanji_rollouts()
    turns = QUICK_TURNS if quick else TURNS
    moves = turns * MOVES_PER_TURN
    out = {}
    for b in BATCHES:
        fns = [_our_rollout(bank, b, turns)] + ([theirs[b]] if theirs else [])
        secs = paired_best(fns, 1 if quick else 10)
        out[f"sokoban.steps_per_s.{b}"] = b * moves / secs[0]
        if theirs:
            out[f"jumanji.sokoban.steps_per_s.{b}"] = b * TURNS * MOVES_PER_TURN / secs[1]
    return out


class NumpySokoban:
    """The shape of an upstream gym-sokoban environment's state, for the deepcopy comparison."""

    def __init__(self, board: np.ndarray):
        self.room_fixed = np.where(np.isin(board, (2, 4, 6)), 2, np.where(board == 0, 0, 1)).astype(np.int64)
        self.room_state = board.astype(np.int64)
        self.player_position = np.argwhere(np.isin(board, (5, 6)))[0]
        boxes = [tuple(p) for p in np.argwhere(np.isin(board, (3, 4)))]
        self.box_mapping = {b: b for b in boxes}
        self.num_boxes = len(boxes)
        self.boxes_on_target = int((board == 4).sum())
        self.num_env_steps = 0
        self.reward_last = 0.0
        self.max_steps = 120
        self.dim_room = board.shape


def _rewind_vs_deepcopy(bank: sk.LevelBank, quick: bool) -> dict[str, float]:
    states = sk.init_batch(bank, jnp.arange(REWIND_TRIALS) % len(bank))
    moves = lambda key: jax.random.randint(key, (REWIND_TRIALS, MOVES_PER_TURN), 1, 5, jnp.int32)
    boards = np.asarray(bank.boards)
    envs = [NumpySokoban(boards[i % len(boards)]) for i in range(REWIND_TRIALS)]
    rounds, calls = (1, 2) if quick else (10, 20)
    ours, deepcopy = rewind_vs_deepcopy(states, sk.step, moves, REWIND_CAPACITY, envs, rounds, calls)
    return {"sokoban.rewind_us_per_trial": ours, "sokoban.deepcopy_rewind_us_per_trial": deepcopy}


def measure(quick: bool = False) -> dict[str, float]:
    """All ``sokoban.*`` figures and the Jumanji anchor ``jumanji.sokoban.steps_per_s.*`` (``quick``: a
    small generated bank, ``QUICK_TURNS`` turns per rollout and one repetition)."""
    bank = _bank(quick)
    out = _steps_per_s(bank, quick)
    out.update(_rewind_vs_deepcopy(bank, quick))
    n = 4 if quick else 16
    t0 = time.perf_counter()
    sk.generate(101, n, dim=(6, 6), num_boxes=2)
    out["sokoban.generate_s_per_level"] = (time.perf_counter() - t0) / n
    levels = [bank.level(i) for i in range(min(len(bank), 8 if quick else 64))]
    t0 = time.perf_counter()
    for level in levels:
        sk.solve(level)
    out["sokoban.solve_ms_per_state"] = (time.perf_counter() - t0) / len(levels) * 1e3
    return out
