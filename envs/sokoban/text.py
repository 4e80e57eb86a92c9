"""Text form of Sokoban rooms: ``parse`` (symbols, optional ``N:`` row prefixes and spaces) and ``render``.

Symbols (input and output): ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``√`` box on target,
``P`` player, ``S`` player on target. Rendering writes one row per line as ``0: # # # # # #``.
Cell codes in arrays are the symbol's index in ``SYMBOLS`` (int8), so ``WALL == 0`` … ``PLAYER_T == 6``.
"""

from __future__ import annotations

import re
from math import comb

import numpy as np

SYMBOLS = "#_OX√PS"
WALL, FLOOR, TARGET, BOX, BOX_T, PLAYER, PLAYER_T = range(7)
MAX_KEY = 2**31 - 1
MAX_CELLS = 127  # player and box cells are stored as int8 flat indices

_ROW_PREFIX = re.compile(r"^\s*\d+\s*:")


def check_encodable(height: int, width: int, num_boxes: int) -> None:
    """Raise ``ValueError`` unless the room fits the int32 state key used by the distance tables.

    Needs ``N = H * W <= 127`` (int8 cell indices), ``C(N, boxes) * N < 2^31`` and every intermediate
    ``C(c, j) * j`` of the arithmetic binomials in ``rules.state_key`` below 2^31.
    """
    cells = height * width
    if cells > MAX_CELLS:
        raise ValueError(
            f"room {height}x{width} is too large: {cells} cells, at most {MAX_CELLS} fit int8 cell indices"
        )
    worst = max((comb(c, j) * j for c in range(cells) for j in range(1, num_boxes + 1)), default=0)
    if comb(cells, num_boxes) * cells > MAX_KEY or worst > MAX_KEY:
        raise ValueError(
            f"room {height}x{width} with {num_boxes} boxes is too large for the int32 state key "
            f"(need C(H*W, boxes) * H*W < 2^31)"
        )


def parse_board(text: str) -> np.ndarray:
    """Parse a room into an int8 ``[H, W]`` array of cell codes, validating symbols and shape."""
    if not isinstance(text, str):
        raise TypeError(f"parse expects a str, got {type(text).__name__}")
    rows: list[list[int]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        body = _ROW_PREFIX.sub("", line, count=1)
        cells = [ch for ch in body if not ch.isspace()]
        if not cells:
            continue
        bad = sorted({ch for ch in cells if ch not in SYMBOLS})
        if bad:
            raise ValueError(f"line {lineno}: unknown symbol(s) {' '.join(bad)!s}; expected one of {SYMBOLS}")
        rows.append([SYMBOLS.index(ch) for ch in cells])
    if not rows:
        raise ValueError("empty room: no rows found")
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        raise ValueError(f"rows have different lengths {sorted(widths)}; a room must be rectangular")
    board = np.asarray(rows, dtype=np.int8)
    players = int(np.isin(board, (PLAYER, PLAYER_T)).sum())
    if players != 1:
        raise ValueError(f"a room needs exactly one player (P or S), found {players}")
    boxes = int(np.isin(board, (BOX, BOX_T)).sum())
    if boxes < 1:
        raise ValueError("a room needs at least one box (X or √)")
    check_encodable(board.shape[0], board.shape[1], boxes)
    return board


def render_board(board: np.ndarray) -> str:
    """Rows as ``i: c c c`` with 0-indexed row numbers and single spaces between cells."""
    board = np.asarray(board)
    if board.ndim != 2:
        raise ValueError(f"render expects one room (a 2-D board), got shape {board.shape}")
    return "\n".join(f"{i}: " + " ".join(SYMBOLS[int(c)] for c in row) for i, row in enumerate(board))
