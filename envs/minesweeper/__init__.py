"""Jittable MineSweeper: cascade reveal, no-guess boards, exact deduction (see ``rules.py``).

``init`` and ``step`` are exported already wrapped in ``jax.jit`` (so host-side calls compile once per
board shape); they compose with ``vmap``, ``scan`` and an outer ``jit`` like the plain functions in
``rules``.
"""

import jax

from envs.minesweeper import rules as _rules
from envs.minesweeper.boards import SPLITS, BoardBank, generate, init_batch, load_split, split_names
from envs.minesweeper.deduce import (
    InconsistentBoardError,
    deduce,
    deduce_visible,
    safe_reveal,
    solve_plan,
)
from envs.minesweeper.rules import Board, Outcome, State, is_lost, is_won
from envs.minesweeper.text import parse, render

init = jax.jit(_rules.init)
step = jax.jit(_rules.step)

__all__ = [
    "SPLITS",
    "Board",
    "BoardBank",
    "InconsistentBoardError",
    "Outcome",
    "State",
    "deduce",
    "deduce_visible",
    "generate",
    "init",
    "init_batch",
    "is_lost",
    "is_won",
    "load_split",
    "parse",
    "render",
    "safe_reveal",
    "solve_plan",
    "split_names",
    "step",
]
