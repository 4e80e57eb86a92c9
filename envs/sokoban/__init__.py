"""Jittable functional Sokoban (gym-sokoban rules) with exact dead-state detection.

Public API: ``parse``, ``render``, ``init``, ``init_batch``, ``step``, ``step_with``, ``solve``,
``generate``, ``load_split``, ``optimal_moves`` and the types
``State``, ``Outcome``, ``Level``, ``LevelBank``, ``Tables``.
See ``rules`` for the state/table design (small per-checkpoint state; shared exact distance tables).
"""

from __future__ import annotations

import numpy as np

from envs.sokoban import solver
from envs.sokoban.levels import (
    SPLITS,
    Level,
    LevelBank,
    bank_from_boards,
    cache_dir,
    generate,
    generate_boards,
    init,
    init_batch,
    load_split,
)
from envs.sokoban.rules import (
    MOVE_NAMES,
    Outcome,
    State,
    Tables,
    distance_of,
    optimal_moves,
    optimal_moves_with,
    step,
    step_with,
)
from envs.sokoban.text import SYMBOLS, parse_board, render_board


def parse(text: str) -> Level:
    """A ``Level`` from text (symbols ``#_OX√PS``, optional ``N:`` row prefixes and spaces)."""
    return Level(parse_board(text))


def _board_of(obj) -> np.ndarray:
    if isinstance(obj, Level):
        return obj.board
    if isinstance(obj, State):
        return np.asarray(obj.board)
    if isinstance(obj, np.ndarray) or hasattr(obj, "__array__"):
        return np.asarray(obj)
    raise TypeError(f"expected a Level, State or board array, got {type(obj).__name__}")


def render(state: State | Level | np.ndarray) -> str:
    """Rows as ``0: # # # # # #`` (0-indexed row numbers, cells separated by single spaces)."""
    return render_board(_board_of(state))


def solve(level_or_state: Level | State | np.ndarray) -> int:
    """Exact shortest solution length in primitive moves (0 if solved), −1 if unsolvable (host BFS)."""
    board = _board_of(level_or_state)
    if board.ndim != 2:
        raise ValueError(f"solve expects one room, got a board of shape {board.shape}")
    return solver.solve_board(board)


__all__ = [
    "MOVE_NAMES", "SPLITS", "SYMBOLS", "Level", "LevelBank", "Outcome", "State", "Tables",
    "bank_from_boards", "cache_dir", "distance_of", "generate", "generate_boards", "init", "init_batch",
    "load_split", "optimal_moves", "optimal_moves_with", "parse", "render", "solve", "step", "step_with",
]
