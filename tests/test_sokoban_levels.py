"""Generator, banks and registered splits (small sizes; splits cached in a temporary directory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs.sokoban as sk
from envs.sokoban import levels


def test_generated_levels_are_solvable_in_range_and_deterministic():
    a = sk.generate(7, 5, dim=(6, 6), num_boxes=2, min_solution=6, max_solution=30)
    b = sk.generate(7, 5, dim=(6, 6), num_boxes=2, min_solution=6, max_solution=30)
    c = sk.generate(8, 5, dim=(6, 6), num_boxes=2, min_solution=6, max_solution=30)
    assert np.array_equal(np.asarray(a.boards), np.asarray(b.boards))
    assert not np.array_equal(np.asarray(a.boards), np.asarray(c.boards))
    assert len({np.asarray(x).tobytes() for x in a.boards}) == 5  # no duplicates
    for i in range(len(a)):
        level = a.level(i)
        assert level.num_boxes == 2 and level.shape == (6, 6)
        d = sk.solve(level)
        assert 6 <= d <= 30 and d == int(a.d0[i])
        assert np.all(level.board[[0, -1], :] == 0) and np.all(level.board[:, [0, -1]] == 0)  # walled


def test_other_shapes_and_box_counts():
    bank = sk.generate(3, 2, dim=(7, 5), num_boxes=3, min_solution=3, max_solution=80)
    assert np.asarray(bank.boards).shape == (2, 7, 5)
    assert all(bank.level(i).num_boxes == 3 for i in range(2))


def test_init_batch_matches_init_of_each_level():
    bank = sk.generate(4, 3)
    batch = sk.init_batch(bank, jnp.array([2, 0]))
    for row, i in enumerate([2, 0]):
        one = sk.init(bank.level(i))
        assert np.array_equal(np.asarray(batch.board[row]), np.asarray(one.board))
        assert int(batch.distance[row]) == int(one.distance) == int(bank.d0[i])
        assert int(batch.player[row]) == int(one.player)
    mapped = jax.vmap(sk.init, in_axes=(None, 0))(bank, jnp.array([2, 0]))
    assert np.array_equal(np.asarray(mapped.board), np.asarray(batch.board))


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="3x3"):
        sk.generate(0, 1, dim=(2, 5))
    with pytest.raises(ValueError, match="min_solution"):
        sk.generate(0, 1, min_solution=9, max_solution=3)
    with pytest.raises(RuntimeError, match="found only"):
        sk.generate(0, 2, dim=(4, 4), num_boxes=2, min_solution=90, max_solution=100, max_attempts=20)
    with pytest.raises(IndexError):
        sk.init(sk.generate(0, 1), 5)


def test_split_is_cached_and_train_test_disjoint(tmp_path, monkeypatch):
    spec = levels.SplitSpec((5, 5), 1, 2, 12, 11, 12, n_train=6, n_test=4, n_val=3)
    monkeypatch.setitem(levels.SPLITS, "sokoban-test-tiny", spec)
    monkeypatch.setenv("RETROJAX_CACHE", str(tmp_path))
    test = sk.load_split("sokoban-test-tiny:test")  # generates train first (to exclude its levels)
    train = sk.load_split("sokoban-test-tiny:train")
    assert (len(train), len(test)) == (6, 4) and test.name == "sokoban-test-tiny:test"
    assert len(list(tmp_path.glob("sokoban-test-tiny-*.npz"))) == 2
    val = sk.load_split("sokoban-test-tiny:val")  # reads train and test from the cache, adds one file
    assert len(val) == 3 and len(list(tmp_path.glob("sokoban-test-tiny-*.npz"))) == 3
    train_set = {np.asarray(b).tobytes() for b in train.boards}
    assert not any(np.asarray(b).tobytes() in train_set for b in test.boards)

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached split should be loaded, not regenerated")

    monkeypatch.setattr(levels, "generate_boards", no_generation)
    assert sk.load_split("sokoban-test-tiny:test") is test  # same process: the same bank object
    monkeypatch.setattr(levels, "_LOADED", {})
    again = sk.load_split("sokoban-test-tiny:test")  # a fresh process reads the disk cache
    assert np.array_equal(np.asarray(again.boards), np.asarray(test.boards))
    assert np.array_equal(np.asarray(again.tables.keys), np.asarray(test.tables.keys))


def test_registered_splits_and_bad_names():
    for name in ("sokoban-5x5-1", "sokoban-6x6-2", "sokoban-7x7-3", "sokoban-8x8-4"):
        assert name in sk.SPLITS
    assert {s.num_boxes for s in sk.SPLITS.values()} >= {1, 2, 3, 4}
    with pytest.raises(ValueError, match="sokoban-6x6-2:test"):
        sk.load_split("sokoban-6x6-2")
    with pytest.raises(KeyError, match="unknown split"):
        sk.load_split("sokoban-9x9-9:test")
    with pytest.raises(ValueError, match="train, test, val"):
        sk.load_split("sokoban-6x6-2:dev")
