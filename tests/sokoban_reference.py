"""A deliberately naive pure-Python Sokoban (lists of symbols) to check the jitted rules and the solver."""

from __future__ import annotations

from collections import deque

DELTA = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}
BOXES = {"X", "√"}
FREE = {"_", "O"}


def grid_of(text: str) -> tuple[tuple[str, ...], ...]:
    rows = []
    for line in text.strip().splitlines():
        body = line.split(":", 1)[1] if ":" in line else line
        rows.append(tuple(ch for ch in body if not ch.isspace()))
    return tuple(rows)


def _get(grid, r, c):
    if 0 <= r < len(grid) and 0 <= c < len(grid[0]):
        return grid[r][c]
    return "#"


def _player(grid):
    for r, row in enumerate(grid):
        for c, ch in enumerate(row):
            if ch in ("P", "S"):
                return r, c
    raise ValueError("no player")


def move(grid, m: int):
    """Returns (grid', changed, box_onto_target, box_off_target)."""
    if m not in DELTA:
        return grid, False, False, False
    dr, dc = DELTA[m]
    r, c = _player(grid)
    a, b = _get(grid, r + dr, c + dc), _get(grid, r + 2 * dr, c + 2 * dc)
    g = [list(row) for row in grid]
    under = "O" if grid[r][c] == "S" else "_"
    if a in BOXES and b in FREE:
        g[r][c] = under
        g[r + dr][c + dc] = "S" if a == "√" else "P"
        g[r + 2 * dr][c + 2 * dc] = "√" if b == "O" else "X"
        return tuple(map(tuple, g)), True, b == "O", a == "√"
    if a in FREE:
        g[r][c] = under
        g[r + dr][c + dc] = "S" if a == "O" else "P"
        return tuple(map(tuple, g)), True, False, False
    return grid, False, False, False


def solved(grid) -> bool:
    return not any("X" in row for row in grid)


def bfs(grid, limit: int = 200_000) -> int:
    if solved(grid):
        return 0
    seen = {grid}
    queue = deque([(grid, 0)])
    while queue:
        g, d = queue.popleft()
        for m in DELTA:
            n, changed, _, _ = move(g, m)
            if not changed or n in seen:
                continue
            if solved(n):
                return d + 1
            seen.add(n)
            if len(seen) > limit:
                raise RuntimeError("reference BFS limit")
            queue.append((n, d + 1))
    return -1


def turn(grid, moves):
    """Reference turn: (grid', reward, moves_applied), stopping at solved or dead."""
    reward, applied = 0.0, 0
    if solved(grid) or bfs(grid) < 0:
        return grid, 0.0, 0
    for m in moves:
        if m == 0 or m not in DELTA:
            continue
        reward -= 0.1
        grid, changed, on, off = move(grid, m)
        applied += changed
        reward += float(on) - float(off)
        if changed and solved(grid):
            reward += 10.0
            break
        if changed and bfs(grid) < 0:
            break
    return grid, reward, applied
