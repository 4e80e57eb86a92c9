"""No-guess generation, splits and cache, batched init, trail rewind-and-replay, and terminal play."""

from __future__ import annotations

import argparse
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.minesweeper as ms
from envs.minesweeper import boards
from envs.minesweeper.deduce import counts_np, reveal_np
from envs.trail import trail_get, trail_init, trail_push, trail_rewind

step = ms.step
push = jax.jit(trail_push)
rewind = jax.jit(trail_rewind)


@pytest.fixture(scope="module")
def bank6():
    return ms.generate(123, 12)


@pytest.fixture(scope="module")
def bank8():
    return ms.generate(321, 4, size=8, num_mines=8)


def test_generation_is_deterministic_per_seed(bank6):
    again = ms.generate(123, 12)
    np.testing.assert_array_equal(again.mines, bank6.mines)
    np.testing.assert_array_equal(again.first_click, bank6.first_click)
    np.testing.assert_array_equal(again.solution_length, bank6.solution_length)
    other = ms.generate(124, 12)
    assert not np.array_equal(other.mines, bank6.mines)


def test_boards_have_a_safe_opening_first_click(bank6, bank8):
    for bank, (h, w), m in [(bank6, (6, 6), 3), (bank8, (8, 8), 8)]:
        assert bank.mines.shape[1:] == (h, w) and bank.num_mines == m
        assert (bank.mines.sum(axis=(1, 2)) == m).all()
        for i in range(len(bank)):
            r, c = bank.first_click[i]
            assert not bank.mines[i, max(r - 1, 0) : r + 2, max(c - 1, 0) : c + 2].any()
            state = ms.init(bank[i])
            assert np.asarray(state.revealed).sum() > 1  # the click cascaded
            assert not bool(ms.is_won(state)) and not bool(ms.is_lost(state))


def test_no_guess_boards_finish_by_deduction(bank6, bank8):
    for bank in (bank6, bank8):
        for i in range(len(bank)):
            state = ms.init(bank[i])
            reveals = 0
            while not bool(ms.is_won(state)):
                safe, _ = ms.deduce(state)
                cells = np.argwhere(safe & ~np.asarray(state.revealed))
                assert len(cells), f"board {i} needs a guess"
                for cell in cells:
                    state, out = step(state, jnp.asarray(cell, jnp.int32))
                    assert not bool(out.lost)
                reveals += 1
            assert reveals <= int(bank.solution_length[i])  # each round reveals ≥ one plan step


def test_solution_length_is_a_valid_plan(bank6):
    for i in range(len(bank6)):
        state = ms.init(bank6[i])
        plan = ms.solve_plan(np.asarray(state.board), np.asarray(state.revealed))
        assert plan is not None and len(plan) == int(bank6.solution_length[i]) >= 1
        for cell in plan:
            state, out = step(state, jnp.asarray(cell, jnp.int32))
            assert float(out.reward) > 0
        assert bool(ms.is_won(state))
        # the oracle's cells are provably safe; the shortest variant starts a shortest plan
        start = ms.init(bank6[i])
        safe, _ = ms.deduce(start)
        for shortest in (False, True):
            first = ms.safe_reveal(start, shortest=shortest)
            assert first is not None and safe[first] and not bank6.mines[i][first]
        after, _ = step(start, jnp.asarray(ms.safe_reveal(start, shortest=True), jnp.int32))
        rest = ms.solve_plan(np.asarray(after.board), np.asarray(after.revealed))
        assert len(rest) == int(bank6.solution_length[i]) - 1


def test_oracle_finishes_every_board(bank6, bank8):
    for bank in (bank6, bank8):
        for i in range(len(bank)):
            state = ms.init(bank[i])
            for _ in range(bank.mines[i].size):
                cell = ms.safe_reveal(state)
                if cell is None:
                    break
                state, out = step(state, jnp.asarray(cell, jnp.int32))
                assert float(out.reward) > 0
            assert bool(ms.is_won(state)) and ms.safe_reveal(state) is None


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_mines"):
        ms.generate(0, 1, size=4, num_mines=8)
    with pytest.raises(ValueError, match="at least"):
        ms.generate(0, 1, size=1)


def test_splits_are_cached_disjoint_and_named(tmp_path, monkeypatch):
    spec = boards.SplitSpec(6, 3, 5, 6, train_n=6, test_n=4, val_n=3)
    monkeypatch.setitem(boards.SPLITS, "minesweeper-6x6-3", spec)
    train = ms.load_split("minesweeper-6x6-3:train", cache=tmp_path)
    test = ms.load_split("minesweeper-6x6-3:test", cache=tmp_path)
    assert (len(train), len(test)) == (6, 4) and test.name == "minesweeper-6x6-3:test"
    ids = {m.tobytes() + c.tobytes() for m, c in zip(train.mines, train.first_click, strict=True)}
    assert not any(m.tobytes() + c.tobytes() in ids
                   for m, c in zip(test.mines, test.first_click, strict=True))
    assert len(list(tmp_path.rglob("*.npz"))) == 2
    assert len(ms.load_split("minesweeper-6x6-3:val", cache=tmp_path)) == 3  # train and test from the cache
    assert len(list(tmp_path.rglob("*.npz"))) == 3

    def no_generation(*args, **kwargs):
        raise AssertionError("a cached split was generated again")

    monkeypatch.setattr(boards, "generate", no_generation)
    again = ms.load_split("minesweeper-6x6-3:test", cache=tmp_path)
    np.testing.assert_array_equal(again.mines, test.mines)
    np.testing.assert_array_equal(again.solution_length, test.solution_length)
    for bad in ["minesweeper-6x6-3", "minesweeper-6x6-3:dev", "sokoban-6x6-2:test"]:
        with pytest.raises(ValueError, match="unknown minesweeper split"):
            ms.load_split(bad, cache=tmp_path)
    assert {"minesweeper-6x6-3:test", "minesweeper-8x8-8:train"} <= set(ms.split_names())


def test_init_batch_equals_init(bank6):
    idx = np.array([3, 0, 11, 3])
    batch = ms.init_batch(bank6, idx)
    assert batch.cascade is bank6.cascade  # bank states use the bank's cascade table
    for k, i in enumerate(idx):
        row = jax.tree_util.tree_map(lambda x, k=k: x[k], batch)
        one = ms.init(bank6[int(i)])  # a table-free state of the same world
        assert one.cascade is None and int(row.index) == i
        np.testing.assert_array_equal(np.asarray(row.words), np.asarray(one.words))
        for cell in [(0, 0), (5, 5), (2, 3), (9, 9)]:  # the table and the flood fill step alike
            a, out_a = ms.step(row, jnp.asarray(cell, jnp.int32))
            b, out_b = ms.step(one, jnp.asarray(cell, jnp.int32))
            np.testing.assert_array_equal(np.asarray(a.words), np.asarray(b.words))
            chex.assert_trees_all_equal(out_a, out_b)
    with pytest.raises(IndexError):
        ms.init_batch(bank6, [12])
    with pytest.raises(IndexError):
        bank6[12]


@settings(max_examples=15, deadline=None)
@given(
    board=st.integers(0, 11),
    cells=st.lists(st.tuples(st.integers(-1, 6), st.integers(-1, 6)), min_size=1, max_size=8),
    j=st.integers(0, 8),
)
def test_trail_rewind_and_replay_reproduces_states(bank6, board, cells, j):
    state = ms.init(bank6[board])
    trail = trail_init(state, 16)
    path = [state]
    scores = [0.0]
    for cell in cells:
        state, out = step(state, jnp.asarray(cell, jnp.int32))
        trail, overflowed = push(trail, state)
        assert not bool(overflowed)
        path.append(state)
        scores.append(scores[-1] + float(out.reward))
    j = min(j, len(cells))
    trail, restored = rewind(trail, j)
    chex.assert_trees_all_equal(restored, path[j])
    replay = restored
    replay_score = scores[j]
    for k, cell in enumerate(cells[j:], start=j + 1):
        replay, out = step(replay, jnp.asarray(cell, jnp.int32))
        replay_score += float(out.reward)
        trail, _ = push(trail, replay)
        chex.assert_trees_all_equal(replay, path[k])
        chex.assert_trees_all_equal(trail_get(trail, k), path[k])
    assert replay_score == pytest.approx(scores[-1])


def test_batched_trail_rewind_restores_each_trial(bank6):
    states = ms.init_batch(bank6, np.arange(4))
    first = states
    cells = jnp.array([[0, 0], [5, 5], [2, 3], [4, 1]], jnp.int32)

    @jax.jit
    def run(states, cells, targets):
        trails = jax.vmap(lambda s: trail_init(s, 8))(states)
        states, _ = jax.vmap(ms.step)(states, cells)
        trails, _ = jax.vmap(trail_push)(trails, states)
        _, restored = jax.vmap(trail_rewind)(trails, targets)
        return states, restored

    states, restored = run(states, cells, jnp.array([0, 1, 0, 1]))
    for k in range(4):
        want = first if k % 2 == 0 else states
        chex.assert_trees_all_equal(jax.tree_util.tree_map(lambda x, k=k: x[k], restored),
                                    jax.tree_util.tree_map(lambda x, k=k: x[k], want))


def test_reference_helpers_agree_with_step(bank6):
    mines = bank6.mines[0]
    board = counts_np(mines)
    r, c = bank6.first_click[0]
    want = reveal_np(board, np.zeros_like(mines), r, c)
    np.testing.assert_array_equal(np.asarray(ms.init(bank6[0]).revealed), want)


def test_play_session(bank6, monkeypatch):
    from retrojax.play import minesweeper as play

    monkeypatch.setattr(play, "load_split", lambda name: bank6)
    state = ms.init(bank6[0])
    cell = ms.safe_reveal(state)
    mine = tuple(int(x) + 1 for x in np.argwhere(bank6.mines[0])[0])
    script = (f"({cell[0] + 1},{cell[1] + 1})\nhello\n(0,9)\nrewind to C_7\nrewind to 1\n"
              f"{mine[0]},{mine[1]}\n(1,1)\nrewind to C_0\nquit\n")
    out = io.StringIO()
    code = play.main(argparse.Namespace(split="x:test", index=0), stdin=io.StringIO(script), out=out)
    text = out.getvalue()
    assert code == 0
    assert "could not read 'hello'" in text and "off the board" in text
    assert "C_7 does not exist" in text and "rewound to C_1" in text and "rewound to C_0" in text
    assert "that was a mine" in text and "branch is over" in text and text.rstrip().endswith("bye")
    assert ms.render(state) in text
    # end of input exits cleanly too; a bad index is an error message, not a crash
    for index, want in [(0, 0), (99, 2)]:
        args = argparse.Namespace(split="x:test", index=index)
        assert play.main(args, stdin=io.StringIO(""), out=io.StringIO()) == want
