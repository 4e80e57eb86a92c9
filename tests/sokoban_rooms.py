"""One-box Sokoban rooms for property tests of the notes options: floor inside a wall ring, extra walls."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from hypothesis import strategies as st

from envs.sokoban.text import BOX, FLOOR, PLAYER, TARGET, WALL

Cell = tuple[int, int]


def one_box_room(shape: tuple[int, int], player: Cell, box: Cell, target: Cell,
                 walls: Iterable[Cell] = ()) -> np.ndarray:
    board = np.full(shape, WALL, np.int8)
    board[1:-1, 1:-1] = FLOOR
    for cell in walls:
        board[cell] = WALL
    board[player], board[box], board[target] = PLAYER, BOX, TARGET
    return board


@st.composite
def one_box_rooms(draw: st.DrawFn, shape: tuple[int, int] = (6, 6), max_walls: int = 0
                  ) -> tuple[np.ndarray, tuple[Cell, Cell, Cell]]:
    """A room and its (player, box, target) cells; up to ``max_walls`` inner walls (never on those cells)."""
    inner = [(r, c) for r in range(1, shape[0] - 1) for c in range(1, shape[1] - 1)]
    player, box, target = draw(st.lists(st.sampled_from(inner), min_size=3, max_size=3, unique=True))
    walls = draw(st.lists(st.sampled_from(inner), max_size=max_walls, unique=True)) if max_walls else []
    return one_box_room(shape, player, box, target, walls), (player, box, target)
