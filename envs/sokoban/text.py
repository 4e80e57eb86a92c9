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


def _direction(dr: int, dc: int) -> str:
    vertical = "up" if dr < 0 else "down" if dr > 0 else ""
    horizontal = "left" if dc < 0 else "right" if dc > 0 else ""
    return "-".join(w for w in (vertical, horizontal) if w) or "here"


def _player_cell(board: np.ndarray, what: str) -> tuple[int, int]:
    """The player's (row, col); ``what`` names the notes for the error on a room without exactly one."""
    player = np.argwhere(np.isin(board, (PLAYER, PLAYER_T)))
    if len(player) != 1:
        raise ValueError(f"{what} need exactly one player, found {len(player)}")
    return int(player[0][0]), int(player[0][1])


def _nearest(targets: np.ndarray, cell: tuple[int, int]) -> tuple[int, int]:
    """The target (rows of ``targets``) nearest to ``cell`` in moves (Manhattan distance; first on ties)."""
    tr, tc = targets[int(np.argmin(np.abs(targets - cell).sum(axis=1)))]
    return int(tr), int(tc)


def board_notes(board: np.ndarray) -> str:
    """One line per box not on a target: where it lies from you and where the nearest free target lies from
    it, e.g. ``box r2 c2: left of you; nearest target r1 c1: up-left of the box``.

    Ours, for tiny models (``env.board_notes``): the grid says the same, but a two-layer model learns to
    find these relations from a grid slowly (docs/benchmarks.md#learn).
    """
    board = np.asarray(board)
    pr, pc = _player_cell(board, "board notes")
    targets = np.argwhere(np.isin(board, (TARGET, PLAYER_T)))
    lines = []
    for br, bc in ((int(r), int(c)) for r, c in np.argwhere(board == BOX)):
        line = f"box r{br} c{bc}: {_direction(br - pr, bc - pc)} of you"
        if len(targets):
            tr, tc = _nearest(targets, (br, bc))
            line += f"; nearest target r{tr} c{tc}: {_direction(tr - br, tc - bc)} of the box"
        lines.append(line)
    return "\n".join(lines) if lines else "every box is on a target"


_MOVES = (("up", -1, 0), ("down", 1, 0), ("left", 0, -1), ("right", 0, 1))


def push_notes(board: np.ndarray) -> str:
    """Where to stand for the push that moves each box toward its nearest target, and the moves that do
    not hit a wall, e.g. ``push box r2 c2 up: stand at r3 c2, down-left of you`` + ``free moves: up, left``.

    Ours, for tiny models (``env.push_notes``): the board notes give the relations a plan combines; these
    lines give the combination (a push along the axis with the longer way to go, whose standing and landing
    cells are not walls), so a two-layer model can learn a rule that carries to rooms it has not seen. The
    line proposes a push; it does not check dead states or paths, and the grid stays the source of truth.
    """
    board = np.asarray(board)
    pr, pc = _player_cell(board, "push notes")
    h, w = board.shape
    blocked = lambda r, c: not (0 <= r < h and 0 <= c < w) or board[r, c] == WALL  # noqa: E731
    boxes = np.isin(board, (BOX, BOX_T))
    targets = np.argwhere(np.isin(board, (TARGET, PLAYER_T)))
    lines = []
    for br, bc in ((int(r), int(c)) for r, c in np.argwhere(board == BOX)):
        if not len(targets):
            break
        tr, tc = _nearest(targets, (br, bc))
        # pushes toward the target, the longer way first (vertical on a tie: sorted keeps the order)
        toward = [(name, dr, dc) for name, dr, dc in _MOVES
                  if (dr and dr == np.sign(tr - br)) or (dc and dc == np.sign(tc - bc))]
        push = None
        for name, dr, dc in sorted(toward, key=lambda m: -abs(tr - br if m[1] else tc - bc)):
            stand, land = (br - dr, bc - dc), (br + dr, bc + dc)
            if not blocked(*stand) and not blocked(*land) and not boxes[land]:
                push = name, stand
                break
        if push is None:
            lines.append(f"push box r{br} c{bc}: no push toward its target from here")
            continue
        (name, (sr, sc)) = push
        where = "where you are" if (sr, sc) == (pr, pc) else f"{_direction(sr - pr, sc - pc)} of you"
        lines.append(f"push box r{br} c{bc} {name}: stand at r{sr} c{sc}, {where}")
    free = []
    for name, dr, dc in _MOVES:
        r, c = pr + dr, pc + dc
        if blocked(r, c) or (boxes[r, c] and (blocked(r + dr, c + dc) or boxes[r + dr, c + dc])):
            continue
        free.append(name)
    lines.append("free moves: " + (", ".join(free) if free else "none"))
    return "\n".join(lines)


_PUSH_LINE = re.compile(r"push box r\d+ c\d+ (up|down|left|right): stand at r\d+ c\d+, (.+)")


def follow_push_notes(text: str) -> str | None:
    """The move a player that reads only the push notes makes: push when standing on the first note's spot,
    else step toward the spot by a free move other than the push itself, else any other free move.

    ``text`` is any text holding the notes (a prompt, or :func:`push_notes` itself); ``None`` when it holds
    no ``free moves:`` line. The rule sees no grid and does no search: it is the baseline a policy that reads
    the same notes should beat (measured: 27 of the first 32 test rooms of ``sokoban-5x5-1`` within 8 moves).
    """
    lines = [line.strip() for line in text.splitlines()]
    free_line = next((line for line in reversed(lines) if line.startswith("free moves: ")), None)
    if free_line is None:
        return None
    free = [m for m in free_line.removeprefix("free moves: ").split(", ") if m != "none"] or ["up"]
    first = next((line for line in lines if line.startswith("push box ")), "")
    m = _PUSH_LINE.fullmatch(first)
    if m is None:
        return free[0]
    if m[2] == "where you are":
        return m[1]
    toward = m[2].removesuffix(" of you").split("-")
    return next((w for w in toward if w in free and w != m[1]),
                next((w for w in free if w not in toward), toward[0]))
