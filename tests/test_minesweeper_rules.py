"""MineSweeper rules on hand-made boards: rewards, cascades, first click, win/loss, text, vmap, tracing."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.minesweeper as ms
from envs.minesweeper import rules
from envs.minesweeper.deduce import counts_np, reveal_np
from envs.minesweeper.rules import state_from_arrays

step = ms.step
vstep = jax.jit(jax.vmap(ms.step))


def layout(text: str) -> np.ndarray:
    """bool mine mask from rows of '*' (mine) and '.' (safe)."""
    return np.array([[ch == "*" for ch in row.split()] for row in text.strip().splitlines()])


def hidden_state(mines: np.ndarray) -> ms.State:
    return state_from_arrays(counts_np(mines), np.zeros(mines.shape, bool))


def reveal(state: ms.State, r: int, c: int) -> tuple[ms.State, ms.Outcome]:
    return step(state, jnp.array([r, c], jnp.int32))


BOARD = layout(
    """
    * . . . . .
    . . . . . .
    . . . . * .
    . . . . . .
    . . . . . .
    . . * . . .
    """
)


def test_number_opens_one_cell():
    state, out = reveal(hidden_state(BOARD), 0, 1)
    assert float(out.reward) == 0.5 and int(out.cells_opened) == 1
    assert not bool(out.won) and not bool(out.lost)
    assert np.asarray(state.revealed).sum() == 1 and bool(state.revealed[0, 1])


def test_blank_cascade_matches_flood_fill_and_rewards_two():
    start = hidden_state(BOARD)
    state, out = reveal(start, 0, 5)
    expected = reveal_np(counts_np(BOARD), np.zeros(BOARD.shape, bool), 0, 5)
    np.testing.assert_array_equal(np.asarray(state.revealed), expected)
    assert float(out.reward) == 2.0 and int(out.cells_opened) == expected.sum() > 1
    assert not expected[BOARD].any()


def test_nothing_changes_costs_one():
    state, _ = reveal(hidden_state(BOARD), 0, 1)
    for r, c in [(0, 1), (-1, 0), (6, 0), (0, 6), (0, -1), (100, 100)]:
        new, out = reveal(state, r, c)
        assert float(out.reward) == -1.0 and int(out.cells_opened) == 0
        np.testing.assert_array_equal(np.asarray(new.revealed), np.asarray(state.revealed))
        assert not bool(out.lost) and not bool(out.won)


def test_mine_loses_and_shows_star():
    state, out = reveal(hidden_state(BOARD), 2, 4)
    assert float(out.reward) == pytest.approx(-0.1) and bool(out.lost) and not bool(out.won)
    assert int(out.cells_opened) == 1
    assert ms.render(state).splitlines()[2] == "Row 3: ? ? ? ? * ?"
    # the branch is over: further reveals change nothing and earn nothing
    after, out2 = reveal(state, 0, 5)
    assert float(out2.reward) == 0.0 and int(out2.cells_opened) == 0 and bool(out2.lost)
    np.testing.assert_array_equal(np.asarray(after.revealed), np.asarray(state.revealed))


def test_last_safe_cell_wins_ten():
    safe_cells = [tuple(rc) for rc in np.argwhere(~BOARD)]
    revealed = np.zeros(BOARD.shape, bool)
    for r, c in safe_cells[:-1]:
        revealed[r, c] = True
    state = state_from_arrays(counts_np(BOARD), revealed)
    assert not bool(ms.is_won(state))
    new, out = reveal(state, *safe_cells[-1])
    assert float(out.reward) == 10.0 and bool(out.won) and not bool(out.lost)
    assert bool(ms.is_won(new))
    _, out2 = reveal(new, 0, 0)  # a mine, but the game is already won
    assert float(out2.reward) == 0.0 and not bool(out2.lost)


def test_cascade_wraps_around_numbers():
    ring = layout(
        """
        . . . . .
        . . . . .
        . . * . .
        . . . . .
        . . . . .
        """
    )
    state, out = reveal(hidden_state(ring), 0, 0)
    # the blank ring goes all around the block of 1s and opens every safe cell, which wins
    assert int(out.cells_opened) == 24 and bool(out.won) and float(out.reward) == 10.0
    wall = layout(
        """
        . . . . . .
        . . . . . .
        * * * . . .
        . . . . . .
        . . . . . .
        . . . . . .
        """
    )
    # from the bottom-left, the blank region runs right under the row of numbers, up the gap on the
    # right, and back left along the top to the far corner
    state, out = reveal(hidden_state(wall), 5, 0)
    expected = reveal_np(counts_np(wall), np.zeros(wall.shape, bool), 5, 0)
    np.testing.assert_array_equal(np.asarray(state.revealed), expected)
    assert expected[0, 0] and expected[1, 0] and expected.sum() == 33
    assert bool(out.won) and float(out.reward) == 10.0


def test_safe_first_click_opens_a_region():
    board = ms.Board(mines=jnp.asarray(BOARD), first_click=jnp.array([0, 5]), solution_length=jnp.int32(1))
    state = ms.init(board)
    expected = reveal_np(counts_np(BOARD), np.zeros(BOARD.shape, bool), 0, 5)
    np.testing.assert_array_equal(np.asarray(state.revealed), expected)
    assert int(state.board[0, 5]) == 0 and not bool(ms.is_lost(state)) and not bool(ms.is_won(state))
    assert state.board.dtype == jnp.int8


def test_render_format_and_parse_round_trip():
    state, _ = reveal(hidden_state(BOARD), 0, 5)
    _, _ = reveal(state, 0, 0)
    lost, _ = reveal(state, 0, 0)
    text = ms.render(state)
    lines = text.splitlines()
    assert len(lines) == 6 and lines[0].startswith("Row 1: ") and lines[5].startswith("Row 6: ")
    assert all(len(line.split(": ")[1].split(" ")) == 6 for line in lines)
    assert "*" not in text and set(text.replace("Row", "").split()) <= set("?.12345678:") | {
        f"{i}:" for i in range(1, 7)
    }
    for s in (state, lost):
        back = ms.parse(ms.render(s), BOARD)
        np.testing.assert_array_equal(np.asarray(back.revealed), np.asarray(s.revealed))
        np.testing.assert_array_equal(np.asarray(back.board), np.asarray(s.board))
    pairs = [tuple(rc) for rc in np.argwhere(BOARD)]
    np.testing.assert_array_equal(np.asarray(ms.parse(text, pairs).words), np.asarray(state.words))


@pytest.mark.parametrize(
    "text, err",
    [
        ("Row 1: ? ?\nRow 2: ? ?", "shape"),
        ("Row 1: ? ? ? ? ? ?\nRow 3: ? ? ? ? ? ?", "labelled"),
        ("nonsense", "Row N"),
        ("Row 1: 5 ? ? ? ? ?\n" + "\n".join(f"Row {i}: ? ? ? ? ? ?" for i in range(2, 7)), "layout gives"),
        ("Row 1: x ? ? ? ? ?\n" + "\n".join(f"Row {i}: ? ? ? ? ? ?" for i in range(2, 7)), "unknown symbol"),
    ],
)
def test_parse_rejects_bad_text(text, err):
    with pytest.raises(ValueError, match=err):
        ms.parse(text, BOARD)


@st.composite
def boards_and_clicks(draw):
    h, w = 5, 5
    flat = draw(st.lists(st.integers(0, h * w - 1), min_size=1, max_size=5, unique=True))
    mines = np.zeros(h * w, bool)
    mines[flat] = True
    cells = draw(st.lists(st.tuples(st.integers(-1, h), st.integers(-1, w)), min_size=1, max_size=8))
    return mines.reshape(h, w), cells


@settings(max_examples=25, deadline=None)
@given(boards_and_clicks())
def test_step_matches_host_reference(case):
    mines, cells = case
    board = counts_np(mines)
    state = hidden_state(mines)
    revealed = np.zeros(mines.shape, bool)
    over = False
    for r, c in cells:
        state, out = reveal(state, r, c)
        inside = 0 <= r < 5 and 0 <= c < 5
        if over:
            assert float(out.reward) == 0.0 and int(out.cells_opened) == 0
            continue
        if not inside or revealed[r, c]:
            assert float(out.reward) == -1.0 and int(out.cells_opened) == 0
            continue
        new = reveal_np(board, revealed, r, c)
        assert int(out.cells_opened) == (new & ~revealed).sum()
        revealed = new
        lost, won = bool(mines[r, c]), bool(np.all(revealed | mines))
        want = -0.1 if lost else 10.0 if won else 2.0 if out.cells_opened > 1 else 0.5
        assert float(out.reward) == pytest.approx(want)
        assert bool(out.lost) == lost and bool(out.won) == won
        over = lost or won
        np.testing.assert_array_equal(np.asarray(state.revealed), revealed)


def test_vmapped_step_equals_per_board_step():
    rng = np.random.default_rng(0)
    states, cells = [], []
    for _ in range(8):
        mines = np.zeros(36, bool)
        mines[rng.choice(36, 4, replace=False)] = True
        s = hidden_state(mines.reshape(6, 6))
        s, _ = reveal(s, *rng.integers(0, 6, 2))
        states.append(s)
        cells.append(rng.integers(-1, 7, 2))
    batch = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)
    cells = jnp.asarray(np.stack(cells), jnp.int32)
    bnew, bout = vstep(batch, cells)
    for i, s in enumerate(states):
        new, out = step(s, cells[i])
        chex.assert_trees_all_equal(new, jax.tree_util.tree_map(lambda x, i=i: x[i], bnew))
        chex.assert_trees_all_equal(out, jax.tree_util.tree_map(lambda x, i=i: x[i], bout))


def test_step_does_not_retrace():
    traced = chex.assert_max_traces(n=1)(rules.step)
    fn = jax.jit(traced)
    state = hidden_state(BOARD)
    for cell in [(0, 1), (0, 5), (2, 4), (9, 9), (3, 3)]:
        state, _ = fn(state, jnp.array(cell, jnp.int32))
    chex.clear_trace_counter()


def _many_region_layouts() -> list[np.ndarray]:
    # dense and patterned layouts split the blank cells into many regions (up to the 2x2-block bound)
    rng = np.random.default_rng(1)
    layouts = [rng.random((6, 6)) < p for p in (0.1, 0.2, 0.3, 0.4) for _ in range(4)]
    grid = np.zeros((6, 6), bool)
    grid[1::3, :] = True
    grid[:, 1::3] = True
    return [*layouts, grid]


@pytest.mark.parametrize("with_table", [False, True])
def test_every_click_matches_flood_fill_on_many_region_boards(with_table):
    # both cascade paths (table lookup for bank states, in-jit flood fill for table-free states)
    layouts = _many_region_layouts()
    cascade = rules.cascade_table(np.stack(layouts)) if with_table else None
    cells = jnp.asarray([(r, c) for r in range(6) for c in range(6)], jnp.int32)
    for i, mines in enumerate(layouts):
        board = counts_np(mines)
        start = rules.make_state(mines, np.zeros((6, 6), bool), i, cascade)
        batch = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (36, *x.shape)), start)
        new, out = vstep(batch, cells)
        for k, (r, c) in enumerate(np.asarray(cells)):
            want = reveal_np(board, np.zeros((6, 6), bool), r, c)
            np.testing.assert_array_equal(np.asarray(new.revealed[k]), want)
            assert int(out.cells_opened[k]) == want.sum()
            won = np.all(want | mines)
            expect = -0.1 if mines[r, c] else 10.0 if won else 2.0 if want.sum() > 1 else 0.5
            assert float(out.reward[k]) == pytest.approx(expect)


def test_state_is_small():
    state = hidden_state(BOARD)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    assert nbytes == 20  # 6x6: open + mine words (2 x 2 uint32) and the table index
    assert state.words.dtype == jnp.uint32 and state.index.dtype == jnp.int32
    assert state.board.dtype == jnp.int8 and state.revealed.dtype == bool
    host = jax.tree_util.tree_map(np.asarray, state)  # host copies read the same views with numpy
    assert isinstance(host.board, np.ndarray)
    np.testing.assert_array_equal(host.board, np.asarray(state.board))
    np.testing.assert_array_equal(host.mines, BOARD)
    with pytest.raises(ValueError, match="one shape"):
        rules.make_state(BOARD, np.zeros((5, 6), bool))
    with pytest.raises(ValueError, match=r"\[N, H, W\]"):
        rules.cascade_table(BOARD)


