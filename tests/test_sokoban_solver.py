"""The exact BFS solver and the distance tables against a naive brute force on tiny rooms."""

from __future__ import annotations

from collections import deque

import numpy as np
import sokoban_reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.sokoban as sk
from envs.sokoban import solver


def _tiny_room(data, h: int, w: int, boxes: int) -> str:
    cells = data.draw(st.lists(st.sampled_from("#___O"), min_size=h * w, max_size=h * w))
    spot = st.integers(0, h * w - 1)
    spots = data.draw(st.lists(spot, min_size=boxes + 1, max_size=boxes + 1, unique=True))
    for i in spots[:-1]:
        cells[i] = "√" if cells[i] == "O" else "X"
    cells[spots[-1]] = "S" if cells[spots[-1]] == "O" else "P"
    return "\n".join(" ".join(cells[r * w:(r + 1) * w]) for r in range(h))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(3, 5), st.integers(1, 2), st.data())
def test_solve_equals_brute_force(h, w, boxes, data):
    text = _tiny_room(data, h, w, boxes)
    assert sk.solve(sk.parse(text)) == ref.bfs(ref.grid_of(text))


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.integers(3, 4), st.integers(1, 2), st.data())
def test_distance_table_lists_exactly_the_solvable_reachable_states(h, w, boxes, data):
    text = _tiny_room(data, h, w, boxes)
    keys, dists = solver.distance_table(sk.parse(text).board)
    start = ref.grid_of(text)
    seen, queue = {start}, deque([start])
    while queue:
        g = queue.popleft()
        for m in ref.DELTA:
            n, changed, _, _ = ref.move(g, m)
            if changed and n not in seen:
                seen.add(n)
                queue.append(n)
    solvable = sorted(d for d in (ref.bfs(g) for g in seen) if d >= 0)
    assert sorted(dists.tolist()) == solvable
    assert np.all(np.diff(keys) > 0)


def test_solved_and_unsolvable_rooms():
    assert sk.solve(sk.parse("# # # #\n# P √ #\n# # # #")) == 0
    assert sk.solve(sk.parse("# # # # #\n# P X O #\n# # # # #")) == 1
    assert sk.solve(sk.parse("# # # # #\n# X P O #\n# # # # #")) == -1
    assert sk.solve(sk.parse("# # # # #\n# P X _ #\n# # # # #")) == -1  # no target at all


def test_dense_and_sorted_lookups_agree():
    """The direct-address table over compact (floor-cell) keys and the binary search over sorted keys give
    the same distance for every state in every level's table, and −1 (dead) for states absent from it,
    including states with a box or the player on a wall."""
    import jax.numpy as jnp

    from envs.sokoban.rules import distance_at
    from envs.sokoban.solver import decode_keys, encode
    from envs.sokoban.text import WALL

    bank = sk.load_split("sokoban-6x6-2:test")
    tables = bank.tables
    cells = int(np.asarray(bank.boards[0]).size)
    assert tables.dense is not None and tables.stride > 0 and tables.floors < cells
    sorted_only = tables.replace(dense=None, stride=0, floor_rank=None, floors=0)
    counts = np.asarray(tables.counts)
    levels = np.repeat(np.arange(len(counts)), counts)
    keys = np.asarray(tables.keys)[: counts.sum()]
    boxes, player = decode_keys(keys, cells, 2)
    np.testing.assert_array_equal(encode(boxes, player, cells), keys)
    rng = np.random.default_rng(0)
    rand_boxes = np.sort(np.stack([rng.choice(cells, 2, replace=False) for _ in range(4096)]), axis=1)
    rand_player = np.array([rng.choice(np.setdiff1d(np.arange(cells), b)) for b in rand_boxes])
    rand_levels = rng.integers(0, len(counts), size=4096)
    for lv, bx, pl in ((levels, boxes, player), (rand_levels, rand_boxes, rand_player)):
        lv, bx, pl = jnp.asarray(lv, jnp.int32), jnp.asarray(bx, jnp.int8), jnp.asarray(pl, jnp.int8)
        dense = distance_at(tables, lv, bx, pl, cells)
        searched = distance_at(sorted_only, lv, bx, pl, cells)
        np.testing.assert_array_equal(np.asarray(dense), np.asarray(searched))
    present = np.asarray(distance_at(tables, jnp.asarray(levels, jnp.int32), jnp.asarray(boxes, jnp.int8),
                                     jnp.asarray(player, jnp.int8), cells))
    assert (present >= 0).all()
    walls = np.asarray(bank.boards).reshape(len(counts), -1) == WALL
    assert walls[rand_levels, rand_player].any()  # the random states do include walls
