"""Exact deduction against brute-force enumeration, and the shortest-plan solver against BFS."""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.minesweeper as ms
from envs.minesweeper.deduce import counts_np, deduce_visible, reveal_np, solve_plan
from envs.minesweeper.rules import state_from_arrays


def brute_force(revealed: np.ndarray, board: np.ndarray, num_mines: int) -> tuple[np.ndarray, np.ndarray]:
    """Safe/mine masks by checking every placement of the mines on hidden cells against the numbers."""
    h, w = revealed.shape
    rr, cc = np.divmod(np.arange(h * w), w)
    adjacent = (np.abs(rr[:, None] - rr[None, :]) <= 1) & (np.abs(cc[:, None] - cc[None, :]) <= 1)
    np.fill_diagonal(adjacent, False)
    hidden = np.flatnonzero(~revealed.reshape(-1))
    combos = np.array(list(itertools.combinations(hidden, num_mines)), np.int64).reshape(-1, num_mines)
    layouts = np.zeros((len(combos), h * w), bool)
    layouts[np.arange(len(combos))[:, None], combos] = True
    counts = layouts.astype(np.int32) @ adjacent.astype(np.int32)
    shown = revealed.reshape(-1)
    fits = (counts[:, shown] == board.reshape(-1)[shown]).all(axis=1)
    can_mine = layouts[fits].any(axis=0)
    can_safe = (~layouts[fits]).any(axis=0)
    hid = ~shown
    return (hid & ~can_mine).reshape(h, w), (hid & ~can_safe).reshape(h, w)


@st.composite
def observations(draw):
    h, w = draw(st.sampled_from([(4, 4), (4, 5), (5, 5), (3, 6)]))
    m = draw(st.integers(1, 4))
    flat = draw(st.lists(st.integers(0, h * w - 1), min_size=m, max_size=m, unique=True))
    mines = np.zeros(h * w, bool)
    mines[flat] = True
    mines = mines.reshape(h, w)
    board = counts_np(mines)
    safe_cells = np.argwhere(~mines)
    picks = draw(st.lists(st.integers(0, len(safe_cells) - 1), min_size=1, max_size=4))
    revealed = np.zeros((h, w), bool)
    for i in picks:
        revealed = reveal_np(board, revealed, *safe_cells[i])
    return mines, board, revealed


@settings(max_examples=60, deadline=None)
@given(observations())
def test_deduce_equals_brute_force(obs):
    mines, board, revealed = obs
    safe, mine = deduce_visible(revealed, np.where(revealed, board, 0), int(mines.sum()))
    want_safe, want_mine = brute_force(revealed, board, int(mines.sum()))
    np.testing.assert_array_equal(safe, want_safe)
    np.testing.assert_array_equal(mine, want_mine)
    # soundness against the truth, and the state-level entry point agrees
    assert not (safe & mines).any() and not (mine & ~mines).any()
    s_safe, s_mine = ms.deduce(state_from_arrays(board, revealed))
    np.testing.assert_array_equal(s_safe, safe)
    np.testing.assert_array_equal(s_mine, mine)


def test_deduce_hand_example():
    # (1,0) sees (2,0),(2,1); (1,1) sees all three; (1,2) sees (2,1),(2,2): only (2,1) fits all three 1s
    revealed = np.array([[True, True, True], [True, True, True], [False, False, False]])
    numbers = np.array([[0, 0, 0], [1, 1, 1], [0, 0, 0]])
    safe, mine = deduce_visible(revealed, numbers, 1)
    assert mine[2, 1] and safe[2, 0] and safe[2, 2]
    with pytest.raises(ms.InconsistentBoardError):
        deduce_visible(revealed, numbers, 3)  # no hidden cell left for the other two mines


def test_deduce_uses_the_mine_count():
    # a 1 in the corner holds the only mine, so every cell it does not see is safe; with 2 mines nothing is
    revealed = np.zeros((3, 3), bool)
    revealed[0, 0] = True
    numbers = np.zeros((3, 3), int)
    numbers[0, 0] = 1
    safe, mine = deduce_visible(revealed, numbers, 1)
    interior = np.ones((3, 3), bool)
    interior[:2, :2] = False
    np.testing.assert_array_equal(safe, interior)
    assert not mine.any()
    safe, mine = deduce_visible(revealed, numbers, 2)
    assert not safe.any() and not mine.any()


def test_deduce_rejects_impossible_numbers():
    revealed = np.array([[True, False], [False, False]])
    with pytest.raises(ms.InconsistentBoardError):
        deduce_visible(revealed, np.array([[5, 0], [0, 0]]), 3)


def bfs_min_reveals(board: np.ndarray, revealed: np.ndarray) -> int | None:
    """Fewest reveals of deduced-safe cells that open every safe cell (None if deduction gets stuck)."""
    mines = board == -1
    m = int(mines.sum())
    start = revealed.copy()
    queue = deque([(start, 0)])
    seen = {start.tobytes()}
    while queue:
        rev, d = queue.popleft()
        if np.all(rev | mines):
            return d
        safe, _ = deduce_visible(rev, np.where(rev, board, 0), m)
        for r, c in np.argwhere(safe & ~rev):
            nxt = reveal_np(board, rev, r, c)
            key = nxt.tobytes()
            if key not in seen:
                seen.add(key)
                queue.append((nxt, d + 1))
    return None


@settings(max_examples=15, deadline=None)
@given(observations())
def test_solve_plan_is_shortest_and_valid(obs):
    mines, board, revealed = obs
    plan = solve_plan(board, revealed)
    want = bfs_min_reveals(board, revealed)
    if want is None:
        assert plan is None
        return
    assert plan is not None and len(plan) == want
    m = int(mines.sum())
    for r, c in plan:  # every reveal on the plan is provably safe when it is made
        safe, _ = deduce_visible(revealed, np.where(revealed, board, 0), m)
        assert safe[r, c]
        revealed = reveal_np(board, revealed, r, c)
    assert np.all(revealed | mines)
