"""Speed figures for MineSweeper (called by ``retrojax bench envs``), and the Jumanji anchor.

Steps/s: ``jit(lax.scan(vmap(step)))`` over 100 turns with uniformly random cells (drawn before timing, so
the figure measures the environment, not the random number generator); a board that is won or lost is
put back to its initial state inside the scan (a select), the same for Jumanji, so both keep stepping
live boards. Rewind: restoring ``C_j`` (random j) for 1024 trials at once from a batched trail of 16
checkpoints with a donated buffer, against ``copy.deepcopy`` of 1024 plain numpy MineSweeper objects (the
way upstream code checkpoints). Times are the best of several runs; our rollout and Jumanji's are
timed in alternation at each batch size (``benchkit.paired_best``), and so are the rewinds and the
deepcopies (``benchkit.rewind_vs_deepcopy``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs.benchkit import paired_best, resetting_rollout, rewind_vs_deepcopy
from envs.minesweeper.boards import BoardBank, generate, init_batch, load_split
from envs.minesweeper.rules import step

BATCHES = (1, 64, 1024, 4096)
TURNS = 100
QUICK_TURNS = 4  # --quick: a smoke test of the code path at every batch size, not a figure
JUMANJI_NOTE = (
    "note: Jumanji's Minesweeper reveals only the chosen cell (no cascade) and ends an episode on an "
    "invalid action; ours opens the full cascade on every reveal."
)


def _cells(batch: int, h: int, w: int, turns: int = TURNS) -> jax.Array:
    """int32[turns, batch, 2] uniformly random cells (the same for every environment at one batch size)."""
    return jax.random.randint(jax.random.key(batch), (turns, batch, 2), 0, jnp.array([h, w]), jnp.int32)


def _bank(quick: bool) -> BoardBank:
    return generate(7, 16) if quick else load_split("minesweeper-6x6-3:train")


def _jumanji_rollouts() -> dict[int, Callable[[], object]] | None:
    """Jumanji's Minesweeper (6×6, 3 mines) rollouts per batch size, or None when jumanji is missing."""
    try:
        from jumanji.environments import Minesweeper
        from jumanji.environments.logic.minesweeper.generator import UniformSamplingGenerator
    except ImportError:
        print("jumanji is not installed: no jumanji.minesweeper figures")
        return None
    print(JUMANJI_NOTE)
    env = Minesweeper(generator=UniformSamplingGenerator(num_rows=6, num_cols=6, num_mines=3))
    run = resetting_rollout(env.step, lambda s, ts: (ts.reward, ts.last()))
    out = {}
    for b in BATCHES:
        start, _ = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(0), b))
        out[b] = lambda start=start, cells=_cells(b, 6, 6): run(start, cells)
    return out


def _steps_per_s(quick: bool) -> dict[str, float]:
    """``minesweeper.steps_per_s.B`` and, with jumanji installed, ``jumanji.minesweeper.steps_per_s.B``."""
    bank = _bank(quick)
    h, w = bank.shape
    run = resetting_rollout(step, lambda s, o: (o.reward, o.won | o.lost))
    theirs = _jumanji_rollouts()
    turns = QUICK_TURNS if quick else TURNS
    out = {}
    for b in BATCHES:
        start = init_batch(bank, np.arange(b) % len(bank))
        cells = _cells(b, h, w, turns)
        fns = [lambda start=start, cells=cells: run(start, cells)] + ([theirs[b]] if theirs else [])
        secs = paired_best(fns, 1 if quick else 10)
        out[f"minesweeper.steps_per_s.{b}"] = b * turns / secs[0]
        if theirs:
            out[f"jumanji.minesweeper.steps_per_s.{b}"] = b * TURNS / secs[1]
    return out


class NumpyMineSweeper:
    """The shape of a plain numpy MineSweeper environment's state, for the deepcopy comparison."""

    def __init__(self, mines: np.ndarray, first_click: tuple[int, int]) -> None:
        self.mines = mines.astype(bool)
        self.mine_positions = [tuple(int(x) for x in p) for p in np.argwhere(mines)]
        padded = np.pad(self.mines.astype(np.int64), 1)
        h, w = mines.shape
        self.counts = sum(padded[r : r + h, c : c + w] for r in range(3) for c in range(3)) - self.mines
        self.revealed = np.zeros(mines.shape, bool)
        self.history: list[tuple[int, int]] = [first_click]
        self.total_reward = 0.0
        self.done = False


def _rewind(quick: bool) -> dict[str, float]:
    trials, capacity = 1024, 16
    bank = _bank(quick)
    h, w = bank.shape
    states = init_batch(bank, np.arange(trials) % len(bank))
    cells = lambda key: jax.random.randint(key, (trials, 2), 0, jnp.array([h, w]), jnp.int32)
    objs = [NumpyMineSweeper(bank.mines[i % len(bank)], tuple(bank.first_click[i % len(bank)]))
            for i in range(trials)]
    rounds, calls = (1, 2) if quick else (10, 20)
    ours, deepcopy = rewind_vs_deepcopy(states, step, cells, capacity, objs, rounds, calls)
    return {"minesweeper.rewind_us_per_trial": ours, "minesweeper.deepcopy_rewind_us_per_trial": deepcopy}


def _generate_speed(quick: bool) -> dict[str, float]:
    """Seconds per accepted no-guess 6×6 board (3 mines), including rejected candidates and solving."""
    generate(11, 2)  # compile the on-device candidate sampler
    n = 8 if quick else 64
    t0 = time.perf_counter()
    generate(12_345, n)
    return {"minesweeper.generate_s_per_board": (time.perf_counter() - t0) / n}


def measure(quick: bool = False) -> dict[str, float]:
    """``minesweeper.*`` figures (steps/s at B ∈ {1, 64, 1024, 4096}, rewind vs deepcopy, generation) and
    the Jumanji anchor ``jumanji.minesweeper.steps_per_s.*`` (``quick``: a small generated bank,
    ``QUICK_TURNS`` turns per rollout and one repetition)."""
    return {**_steps_per_s(quick), **_rewind(quick), **_generate_speed(quick)}
