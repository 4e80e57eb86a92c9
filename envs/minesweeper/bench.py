"""Speed figures for MineSweeper (called by ``retrojax bench envs``), and the Jumanji anchor.

Steps/s: ``jit(lax.scan(vmap(step)))`` over 100 turns with uniformly random cells (drawn before timing, so
the figure measures the environment, not the random number generator); a board that is won or lost is
put back to its initial state inside the scan (a select), the same for Jumanji, so both keep stepping
live boards. Rewind: restoring ``C_j`` for 1024 trials at once from a batched trail, against
``copy.deepcopy`` of 1024 plain numpy MineSweeper objects (the way upstream code checkpoints).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs.minesweeper.boards import BoardBank, generate, init_batch, load_split
from envs.minesweeper.rules import step
from envs.trail import trail_init, trail_push, trail_rewind

BATCHES = (1, 64, 1024, 4096)
TURNS = 100
JUMANJI_NOTE = (
    "note: Jumanji's Minesweeper reveals only the chosen cell (no cascade) and ends an episode on an "
    "invalid action; ours runs the full cascade fixed point on every step."
)


def _time(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls (after one warm-up call that also compiles)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def _where_tree(mask: jax.Array, a, b):
    """Per-row select between two batched pytrees."""
    return jax.tree_util.tree_map(lambda x, y: jnp.where(mask.reshape(-1, *([1] * (x.ndim - 1))), x, y), a, b)


def _rollout(step_fn: Callable, done_fn: Callable) -> Callable:
    """jit(scan(vmap(step))) over TURNS random cells, resetting finished rows to their start state."""

    def run(start, cells):
        def body(states, turn_cells):
            new, out = jax.vmap(step_fn)(states, turn_cells)
            reward, done = done_fn(out)
            return _where_tree(done, start, new), jnp.sum(reward)

        return jax.lax.scan(body, start, cells)

    return jax.jit(run)


def _cells(batch: int, h: int, w: int) -> jax.Array:
    """int32[TURNS, batch, 2] uniformly random cells (the same for every environment at one batch size)."""
    return jax.random.randint(jax.random.key(batch), (TURNS, batch, 2), 0, jnp.array([h, w]), jnp.int32)


def _bank(quick: bool) -> BoardBank:
    return generate(7, 16) if quick else load_split("minesweeper-6x6-3:train")


def _steps_per_s(quick: bool) -> dict[str, float]:
    bank = _bank(quick)
    h, w = bank.shape
    run = _rollout(step, lambda o: (o.reward, o.won | o.lost))
    out = {}
    for b in BATCHES:
        start = init_batch(bank, np.arange(b) % len(bank))
        cells = _cells(b, h, w)
        secs = _time(lambda start=start, cells=cells: run(start, cells), 2 if quick else 5)
        out[f"minesweeper.steps_per_s.{b}"] = b * TURNS / secs
    return out


class _NumpyMineSweeper:
    """A plain numpy/Python MineSweeper object as upstream code keeps one per trial (for deepcopy)."""

    def __init__(self, mines: np.ndarray, first_click: tuple[int, int], seed: int) -> None:
        self.mines = mines.copy()
        self.rng = random.Random(seed)
        self.revealed = np.zeros(mines.shape, bool)
        self.board = np.full(mines.shape, -1, np.int32)
        self.history: list[tuple[int, int]] = [first_click]
        self.score = 0.0
        self.done = False


def _rewind(quick: bool) -> dict[str, float]:
    trials = 1024
    bank = _bank(quick)
    states = init_batch(bank, np.arange(trials) % len(bank))
    trails = jax.vmap(lambda s: trail_init(s, 16))(states)
    push = jax.jit(jax.vmap(trail_push))
    for _ in range(8):
        trails, _ = push(trails, states)
    rewind = jax.jit(jax.vmap(trail_rewind))
    target = jnp.full((trials,), 3, jnp.int32)
    secs = _time(lambda: rewind(trails, target), 5 if quick else 50)
    objs = [_NumpyMineSweeper(bank.mines[i % len(bank)], tuple(bank.first_click[i % len(bank)]), i)
            for i in range(trials)]
    t0 = time.perf_counter()
    copies = copy.deepcopy(objs)
    deep = time.perf_counter() - t0
    assert len(copies) == trials
    return {
        "minesweeper.rewind_us_per_trial": secs / trials * 1e6,
        "minesweeper.deepcopy_rewind_us_per_trial": deep / trials * 1e6,
    }


def _generate_speed(quick: bool) -> dict[str, float]:
    generate(11, 2)  # compile the on-device candidate sampler
    n = 8 if quick else 64
    t0 = time.perf_counter()
    generate(12_345, n)
    return {"minesweeper.generate_s_per_board": (time.perf_counter() - t0) / n}


def measure(quick: bool = False) -> dict[str, float]:
    """``minesweeper.*`` figures: steps/s at B ∈ {1, 64, 1024, 4096}, rewind vs deepcopy, generation."""
    return {**_steps_per_s(quick), **_rewind(quick), **_generate_speed(quick)}


def measure_jumanji(quick: bool = False) -> dict[str, float]:
    """``jumanji.minesweeper.steps_per_s.*``: 6×6 boards, 3 mines, the same rollout; {} without jumanji."""
    try:
        from jumanji.environments import Minesweeper
        from jumanji.environments.logic.minesweeper.generator import UniformSamplingGenerator
    except ImportError:
        print("jumanji is not installed: no jumanji.minesweeper figures")
        return {}
    print(JUMANJI_NOTE)
    env = Minesweeper(generator=UniformSamplingGenerator(num_rows=6, num_cols=6, num_mines=3))
    run = _rollout(env.step, lambda ts: (ts.reward, ts.last()))
    out = {}
    for b in BATCHES:
        start, _ = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(0), b))
        cells = _cells(b, 6, 6)
        secs = _time(lambda start=start, cells=cells: run(start, cells), 2 if quick else 5)
        out[f"jumanji.minesweeper.steps_per_s.{b}"] = b * TURNS / secs
    return out
