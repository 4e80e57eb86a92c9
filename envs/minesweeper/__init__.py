"""Jittable MineSweeper: cascade reveal, no-guess boards, exact deduction (see ``rules.py``)."""

from envs.minesweeper.boards import SPLITS, BoardBank, generate, init_batch, load_split, split_names
from envs.minesweeper.deduce import (
    InconsistentBoardError,
    deduce,
    deduce_visible,
    safe_reveal,
    solve_plan,
)
from envs.minesweeper.rules import Board, Outcome, State, init, is_lost, is_won, step
from envs.minesweeper.text import parse, render

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
