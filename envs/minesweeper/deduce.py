"""Exact MineSweeper deduction and the reference solver (host-side numpy/Python).

``deduce`` answers which hidden cells are provably safe and which are provably mines, given only what a
player sees: the open cells' numbers and the total mine count. It is exact: it enumerates every
assignment of the frontier (hidden cells next to an open number) that satisfies all visible numbers,
component by component (frontier cells that share no number are independent), and then combines the
components' possible mine counts with the interior (hidden cells next to no open number), whose cells
are interchangeable, so that the total equals the mine count. A cell is safe (mine) when no globally
consistent assignment puts a mine (no mine) on it. It runs on the host because it is a backtracking
search with data-dependent size; on 6×6 and 8×8 boards a call takes milliseconds.

``solve_plan`` computes a shortest reveal sequence that finishes a board using only deduced-safe
cells; its length is a board's reference solution length (see ``boards.py``). ``safe_reveal`` is what
an oracle policy needs: one provably-safe cell from a state, on such a shortest plan when possible.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_NEIGHBOURS = [(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if (dr, dc) != (0, 0)]


class InconsistentBoardError(ValueError):
    """The visible numbers and the mine count admit no mine layout."""


class SearchLimitError(RuntimeError):
    """``solve_plan`` needed more branch nodes than allowed, so it cannot certify a shortest plan."""


def neighbours(r: int, c: int, h: int, w: int) -> Iterable[tuple[int, int]]:
    """The (up to 8) in-board neighbours of (r, c)."""
    for dr, dc in _NEIGHBOURS:
        rr, cc = r + dr, c + dc
        if 0 <= rr < h and 0 <= cc < w:
            yield rr, cc


def counts_np(mines: np.ndarray) -> np.ndarray:
    """int8 board from a bool mine mask: -1 on mines, else the number of adjacent mines (numpy)."""
    mines = np.asarray(mines, bool)
    h, w = mines.shape
    p = np.pad(mines.astype(np.int8), 1)
    total = sum(p[dr : dr + h, dc : dc + w] for dr in range(3) for dc in range(3)) - mines
    return np.where(mines, -1, total).astype(np.int8)


def reveal_np(board: np.ndarray, revealed: np.ndarray, r: int, c: int) -> np.ndarray:
    """Host-side reveal with cascade (same rule as ``rules.step``); returns the new revealed mask.

    Revealing a hidden blank cell opens its whole blank region (8-connected) and the region's bordering
    numbers; an already-open cell changes nothing.
    """
    h, w = board.shape
    out = np.array(revealed, bool, copy=True)
    if out[r, c]:
        return out
    seen = np.zeros((h, w), bool)
    seen[r, c] = True
    stack = [(r, c)]
    while stack:
        cr, cc = stack.pop()
        out[cr, cc] = True
        if board[cr, cc] != 0:
            continue
        for nr, nc in neighbours(cr, cc, h, w):
            if not seen[nr, nc]:
                seen[nr, nc] = True
                stack.append((nr, nc))
    return out


def _enumerate_component(cells: list[int], constraints: list[tuple[list[int], int]]):
    """All satisfying 0/1 assignments of ``cells`` (flat ids) for constraints (cell ids, mines needed).

    Returns {mine_count: (can_mine bool[n], can_safe bool[n])} over the component's cells.
    """
    n = len(cells)
    pos = {cell: i for i, cell in enumerate(cells)}
    cons_cells = [[pos[x] for x in cs] for cs, _ in constraints]
    need = [k for _, k in constraints]
    free = [len(cs) for cs in cons_cells]
    of_cell: list[list[int]] = [[] for _ in range(n)]
    for ci, cs in enumerate(cons_cells):
        for i in cs:
            of_cell[i].append(ci)
    if any(k < 0 or k > f for k, f in zip(need, free, strict=True)):
        return {}
    assign = [0] * n
    result: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def rec(i: int, mines: int) -> None:
        if i == n:
            arr = np.array(assign, bool)
            if mines in result:
                result[mines][0][arr] = True
                result[mines][1][~arr] = True
            else:
                result[mines] = (arr.copy(), ~arr)
            return
        for v in (0, 1):
            ok = True
            for ci in of_cell[i]:
                free[ci] -= 1
                need[ci] -= v
            for ci in of_cell[i]:
                if need[ci] < 0 or need[ci] > free[ci]:
                    ok = False
                    break
            if ok:
                assign[i] = v
                rec(i + 1, mines + v)
            for ci in of_cell[i]:
                free[ci] += 1
                need[ci] += v

    rec(0, 0)
    return result


def _order_cells(component: list[int], constraints: list[tuple[list[int], int]]) -> list[int]:
    """Order a component's cells so that constraints close early (breadth-first over shared numbers)."""
    members = set(component)
    touching: dict[int, list[int]] = {x: [] for x in component}
    for ci, (cs, _) in enumerate(constraints):
        for x in cs:
            if x in members:
                touching[x].append(ci)
    order: list[int] = []
    seen: set[int] = set()
    queue = [min(component)]
    seen.add(queue[0])
    while queue:
        x = queue.pop(0)
        order.append(x)
        for ci in touching[x]:
            for y in constraints[ci][0]:
                if y not in seen:
                    seen.add(y)
                    queue.append(y)
    return order


def _sumset(a: set[int], b: set[int]) -> set[int]:
    return {x + y for x in a for y in b}


def deduce_visible(
    revealed: np.ndarray, numbers: np.ndarray, num_mines: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact deduction from what a player sees.

    ``revealed``: bool[H, W]; ``numbers``: int[H, W], read only where revealed (-1 marks an open mine,
    which counts as a known mine); ``num_mines``: total mines on the board. Returns ``(safe, mine)``
    bool[H, W] masks over hidden cells (plus open mines in ``mine``). Raises ``InconsistentBoardError``
    when no layout fits.
    """
    revealed = np.asarray(revealed, bool)
    numbers = np.asarray(numbers)
    h, w = revealed.shape
    open_mine = revealed & (numbers == -1)
    hidden = ~revealed
    remaining = int(num_mines) - int(open_mine.sum())
    constraints: list[tuple[list[int], int]] = []
    for r in range(h):
        for c in range(w):
            if not revealed[r, c] or numbers[r, c] < 0:
                continue
            cells, k = [], int(numbers[r, c])
            for nr, nc in neighbours(r, c, h, w):
                if hidden[nr, nc]:
                    cells.append(nr * w + nc)
                elif open_mine[nr, nc]:
                    k -= 1
            if k < 0 or k > len(cells):
                raise InconsistentBoardError(f"cell ({r + 1},{c + 1}) shows {numbers[r, c]}: impossible")
            if cells:
                constraints.append((cells, k))
    # union-find over frontier cells sharing a number
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for cells, _ in constraints:
        for x in cells:
            parent.setdefault(x, x)
        for x in cells[1:]:
            parent[find(x)] = find(cells[0])
    groups: dict[int, list[int]] = {}
    for x in parent:
        groups.setdefault(find(x), []).append(x)
    comps = []
    for members in groups.values():
        cons = [(cs, k) for cs, k in constraints if find(cs[0]) == find(members[0])]
        order = _order_cells(members, cons)
        table = _enumerate_component(order, cons)
        if not table:
            raise InconsistentBoardError("the visible numbers admit no mine layout")
        comps.append((order, table))
    frontier = np.zeros(h * w, bool)
    frontier[list(parent)] = True
    interior = hidden.reshape(-1) & ~frontier
    n_interior = int(interior.sum())
    count_sets = [set(table) for _, table in comps]
    safe = np.zeros(h * w, bool)
    mine = np.zeros(h * w, bool)
    any_consistent = False
    for i, (order, table) in enumerate(comps):
        others = {0}
        for j, s in enumerate(count_sets):
            if j != i:
                others = _sumset(others, s)
        can_mine = np.zeros(len(order), bool)
        can_safe = np.zeros(len(order), bool)
        for k, (cm, cs) in table.items():
            if any(0 <= remaining - k - o <= n_interior for o in others):
                can_mine |= cm
                can_safe |= cs
                any_consistent = True
        idx = np.array(order)
        safe[idx] = ~can_mine
        mine[idx] = ~can_safe
    totals = {0}
    for s in count_sets:
        totals = _sumset(totals, s)
    interior_counts = [remaining - t for t in totals if 0 <= remaining - t <= n_interior]
    if not interior_counts or (comps and not any_consistent):
        raise InconsistentBoardError("the visible numbers and the mine count admit no mine layout")
    if n_interior:
        safe[interior] = all(j == 0 for j in interior_counts)
        mine[interior] = all(j == n_interior for j in interior_counts)
    safe &= hidden.reshape(-1)
    mine &= hidden.reshape(-1)
    mine |= open_mine.reshape(-1)
    return safe.reshape(h, w), mine.reshape(h, w)


def deduce(state) -> tuple[np.ndarray, np.ndarray]:
    """``(safe, mine)`` bool[H, W] masks of provably safe / provably mine cells of one (unbatched) state.

    Uses only the visible information: open cells' numbers and the total mine count.
    """
    board = np.asarray(state.board)
    if board.ndim != 2:
        raise ValueError(f"deduce takes one unbatched state, got a board of shape {board.shape}")
    revealed = np.asarray(state.revealed, bool)
    return deduce_visible(revealed, np.where(revealed, board, 0), int((board == -1).sum()))


def _units(board: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Label blank components (ids ≥ 1, 0 elsewhere) and mark numbered cells that border a blank."""
    h, w = board.shape
    label = np.zeros((h, w), np.int32)
    nxt = 0
    for r in range(h):
        for c in range(w):
            if board[r, c] == 0 and label[r, c] == 0:
                nxt += 1
                stack = [(r, c)]
                label[r, c] = nxt
                while stack:
                    cr, cc = stack.pop()
                    for nr, nc in neighbours(cr, cc, h, w):
                        if board[nr, nc] == 0 and label[nr, nc] == 0:
                            label[nr, nc] = nxt
                            stack.append((nr, nc))
    borders = np.zeros((h, w), bool)
    for r in range(h):
        for c in range(w):
            if board[r, c] > 0:
                borders[r, c] = any(board[nr, nc] == 0 for nr, nc in neighbours(r, c, h, w))
    return label, borders


def _mandatory(board: np.ndarray, revealed: np.ndarray, safe: np.ndarray, label: np.ndarray,
               borders: np.ndarray) -> tuple[int, int] | None:
    """A deduced-safe cell that every finishing plan reveals itself: blank, or a number next to no blank."""
    cand = safe & ~revealed & ((label > 0) | ((board > 0) & ~borders))
    if not cand.any():
        return None
    # prefer blank cells (they open the most), then in reading order
    blanks = cand & (label > 0)
    pick = blanks if blanks.any() else cand
    r, c = np.argwhere(pick)[0]
    return int(r), int(c)


def solve_plan(
    board: np.ndarray, revealed: np.ndarray, max_nodes: int = 20000
) -> list[tuple[int, int]] | None:
    """A shortest sequence of reveals that opens every safe cell using only deduced-safe cells.

    Returns ``None`` when deduction gets stuck (the board needs a guess); raises ``SearchLimitError``
    past ``max_nodes`` branch nodes rather than return a plan it cannot certify as shortest.
    Exactness: revealing more never shrinks what can be deduced (more constraints, fewer layouts), so
    revealing a deduced-safe *mandatory* cell (one that every finishing plan must reveal itself: any cell
    of a not-yet-open blank component, or a number that borders no blank) as soon as it is available
    never costs a reveal. Only when no mandatory cell is deducible does a plan spend a reveal on a number
    that a later cascade would open anyway; there the search branches over every deduced-safe cell
    (depth-first, memoised on the revealed set) and keeps the shortest completion.
    """
    board = np.asarray(board, np.int8)
    label, borders = _units(board)
    num_mines = int((board == -1).sum())
    memo: dict[bytes, list[tuple[int, int]] | None] = {}
    nodes = [0]

    def rec(rev: np.ndarray) -> list[tuple[int, int]] | None:
        plan: list[tuple[int, int]] = []
        while True:
            if np.all(rev | (board == -1)):
                return plan
            key = rev.tobytes()
            if key in memo:
                rest = memo[key]
                return None if rest is None else plan + rest
            safe, _ = deduce_visible(rev, np.where(rev, board, 0), num_mines)
            pick = _mandatory(board, rev, safe, label, borders)
            if pick is None:
                break
            plan.append(pick)
            rev = reveal_np(board, rev, *pick)
        options = [tuple(map(int, rc)) for rc in np.argwhere(safe & ~rev)]
        best: list[tuple[int, int]] | None = None
        for rc in options:
            nodes[0] += 1
            if nodes[0] > max_nodes:
                raise SearchLimitError(f"shortest-plan search exceeded {max_nodes} branch nodes")
            sub = rec(reveal_np(board, rev, *rc))
            if sub is not None and (best is None or len(sub) + 1 < len(best)):
                best = [rc, *sub]
        memo[key] = best
        return None if best is None else plan + best

    return rec(np.asarray(revealed, bool))


def safe_reveal(state, shortest: bool = False) -> tuple[int, int] | None:
    """A provably-safe hidden cell to reveal (0-indexed), for the oracle policy.

    Default: one ``deduce`` call, preferring a cell that every finishing plan must reveal itself (a
    blank-region cell, then a number bordering no blank), else any deduced-safe cell; following it
    finishes a no-guess board and is shortest except where only cascade-bordering numbers are deducible.
    ``shortest=True`` returns the first step of ``solve_plan`` (always on a shortest plan; slower).
    ``None`` when the episode is over or nothing can be deduced safe. The oracle may look at the mine
    layout only to rank cells that are already proven safe; safety itself comes from visible clues.
    """
    board = np.asarray(state.board)
    if board.ndim != 2:
        raise ValueError(f"safe_reveal takes one unbatched state, got a board of shape {board.shape}")
    revealed = np.asarray(state.revealed, bool)
    if (revealed & (board == -1)).any() or np.all(revealed | (board == -1)):
        return None
    if shortest:
        try:
            plan = solve_plan(board, revealed)
        except SearchLimitError:
            plan = None
        if plan:
            return plan[0]
    safe, _ = deduce(state)
    label, borders = _units(board)
    pick = _mandatory(board, revealed, safe, label, borders)
    if pick is not None:
        return pick
    cells = np.argwhere(safe & ~revealed)
    return (int(cells[0][0]), int(cells[0][1])) if len(cells) else None
