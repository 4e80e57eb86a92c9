"""Text form of a MineSweeper state: what the agent and a person see.

One line per row, ``Row 1: ? ? . 1 ? ?``: ``?`` hidden, ``.`` open blank, ``1``–``8`` open number,
``*`` the mine that was hit. Rows and columns are 1-indexed in all text. Hidden mines are never shown.
``parse`` rebuilds a state from such text plus the (secret) mine layout, for tests and tools.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from envs.minesweeper.deduce import counts_np
from envs.minesweeper.rules import State, state_from_arrays

_ROW = re.compile(r"^\s*Row\s+(\d+)\s*:\s*(.*?)\s*$")


def render(state: State) -> str:
    """Rows ``Row i: c c c`` of one unbatched state (the mine layout stays hidden)."""
    board = np.asarray(state.board)
    revealed = np.asarray(state.revealed, bool)
    if board.ndim != 2:
        raise ValueError(f"render takes one unbatched state, got a board of shape {board.shape}")
    lines = []
    for r in range(board.shape[0]):
        cells = []
        for c in range(board.shape[1]):
            v = int(board[r, c])
            cells.append("?" if not revealed[r, c] else "*" if v < 0 else "." if v == 0 else str(v))
        lines.append(f"Row {r + 1}: " + " ".join(cells))
    return "\n".join(lines)


def _mine_mask(mines, shape: tuple[int, int]) -> np.ndarray:
    """A bool mask of ``shape`` from a bool mask (dtype bool) or a sequence of 0-indexed (row, col) pairs."""
    arr = np.asarray(mines)
    if arr.dtype == bool:
        if arr.shape != shape:
            raise ValueError(f"mine mask has shape {arr.shape}, the text shows a board of shape {shape}")
        return arr
    mask = np.zeros(shape, bool)
    for pair in mines:
        if len(pair) != 2:
            raise ValueError(f"mines must be a bool mask or (row, col) pairs, got {pair!r}")
        r, c = (int(x) for x in pair)
        if not (0 <= r < shape[0] and 0 <= c < shape[1]):
            raise ValueError(f"mine ({r}, {c}) lies outside the {shape[0]}x{shape[1]} board (0-indexed)")
        mask[r, c] = True
    return mask


def parse(text: str, mines) -> State:
    """Rebuild a ``State`` from rendered rows and the mine layout.

    ``mines`` is a bool[H, W] mask (dtype bool) or a sequence of 0-indexed (row, col) pairs. Raises
    ``ValueError`` when the text is malformed or disagrees with the layout (a wrong number, ``*`` on a
    safe cell, an open mine shown as a number).
    """
    rows: list[list[str]] = []
    for i, line in enumerate(ln for ln in text.strip().splitlines() if ln.strip()):
        m = _ROW.match(line)
        if not m:
            raise ValueError(f"line {i + 1} is not 'Row N: ...': {line!r}")
        if int(m.group(1)) != i + 1:
            raise ValueError(f"line {i + 1} is labelled Row {m.group(1)}")
        rows.append(m.group(2).split())
    if not rows or any(len(r) != len(rows[0]) for r in rows) or not rows[0]:
        raise ValueError("rows must be non-empty and all the same length")
    shape = (len(rows), len(rows[0]))
    mask = _mine_mask(mines, shape)
    board = counts_np(mask)
    revealed = np.zeros(shape, bool)
    for r, row in enumerate(rows):
        for c, sym in enumerate(row):
            if sym == "?":
                continue
            revealed[r, c] = True
            want = "*" if board[r, c] < 0 else "." if board[r, c] == 0 else str(int(board[r, c]))
            if sym not in {"*", "."} and not (sym.isdigit() and len(sym) == 1):
                raise ValueError(f"unknown symbol {sym!r} at row {r + 1}, column {c + 1}")
            if sym != want:
                raise ValueError(f"row {r + 1}, column {c + 1} shows {sym!r} but the layout gives {want!r}")
    return state_from_arrays(jnp.asarray(board, jnp.int8), jnp.asarray(revealed))
