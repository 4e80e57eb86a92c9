"""Exact rule tests for the jittable Sokoban step on hand-made rooms, against a naive reference.

All hand-made rooms share one shape and box count so they form one bank: the jitted step compiles once.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sokoban_reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.sokoban as sk

ROOMS = {
    "walk": """
        # # # # # # #
        # P _ _ _ _ #
        # _ X O _ _ #
        # _ _ _ _ _ #
        # _ _ _ X O #
        # _ _ _ _ _ #
        # # # # # # #""",
    "solve": """
        # # # # # # #
        # √ # # # # #
        # # # # # # #
        # P X O _ _ #
        # # # # # # #
        # # # # # # #
        # # # # # # #""",
    "off": """
        # # # # # # #
        # _ _ _ _ _ #
        # P √ _ O _ #
        # _ _ _ X _ #
        # _ _ _ _ _ #
        # # # # # # #
        # # # # # # #""",
    "two": """
        # # # # # # #
        # _ _ _ _ _ #
        # P X X _ _ #
        # _ _ O O _ #
        # _ _ _ _ _ #
        # # # # # # #
        # # # # # # #""",
    "wallpush": """
        # # # # # # #
        # _ _ _ _ _ #
        # X P _ _ _ #
        # O _ _ _ _ #
        # _ _ √ _ _ #
        # # # # # # #
        # # # # # # #""",
    "dead": """
        # # # # # # #
        # _ _ _ _ _ #
        # _ X _ O _ #
        # _ P _ _ _ #
        # _ _ _ √ _ #
        # # # # # # #
        # # # # # # #""",
    "target": """
        # # # # # # #
        # _ _ _ _ _ #
        # P O X _ _ #
        # _ _ _ _ _ #
        # _ _ _ √ _ #
        # # # # # # #
        # # # # # # #""",
    "open": """
        P X O _ # # #
        _ _ _ _ # # #
        # # # # # # #
        # √ # # # # #
        # # # # # # #
        # # # # # # #
        # # # # # # #""",
    "reference": """
        # # # # # # #
        # _ _ _ _ _ #
        # _ X _ O _ #
        # _ P _ _ _ #
        # _ _ X O _ #
        # _ _ _ _ _ #
        # # # # # # #""",
}
NAMES = list(ROOMS)
BANK = sk.bank_from_boards([sk.parse(t).board for t in ROOMS.values()], name="hand-made")
jstep = jax.jit(sk.step)


def start(name: str) -> sk.State:
    return sk.init(BANK, NAMES.index(name))


def play(name: str, moves):
    return jstep(start(name), jnp.asarray(moves, jnp.int32))


def rows(state) -> list[str]:
    return [line.split(": ", 1)[1].replace(" ", "") for line in sk.render(state).splitlines()]


def test_walk_and_blocked_by_wall():
    state, out = play("walk", [3, 1, 4])
    assert rows(state)[1] == "#_P___#"
    assert int(out.moves_applied) == 1  # left and up hit walls, right walks
    assert float(out.reward) == pytest.approx(-0.3)
    assert not bool(out.dead) and not bool(out.solved)


def test_push_onto_target_then_solved_stops_early():
    state, out = play("solve", [4, 4, 4])
    assert rows(state)[3] == "#_P√__#"
    assert int(out.moves_applied) == 1  # solved after the first move: the rest is not run
    assert float(out.reward) == pytest.approx(-0.1 + 1.0 + 10.0)
    assert bool(out.solved) and int(out.distance) == 0 and int(out.boxes_on_target) == 2
    again, out2 = jstep(state, jnp.array([3, 3, 3]))  # a solved room does not move
    assert float(out2.reward) == 0.0 and int(out2.moves_applied) == 0
    assert np.array_equal(np.asarray(again.board), np.asarray(state.board))


def test_box_off_target_costs_one():
    state, out = play("off", [4, 0, 0])
    assert rows(state)[2] == "#_SXO_#" and not bool(out.dead)
    assert float(out.reward) == pytest.approx(-1.1)
    assert int(out.boxes_on_target) == 0


def test_cannot_push_two_boxes_or_into_wall():
    state, out = play("two", [4, 0, 0])
    assert int(out.moves_applied) == 0 and float(out.reward) == pytest.approx(-0.1)
    state, out = play("wallpush", [3, 0, 0])
    assert int(out.moves_applied) == 0 and not bool(out.dead)


def test_dead_stops_turn_and_agrees_with_solver():
    state, out = play("dead", [1, 4, 2])  # pushes the box against the top wall: dead at once
    assert bool(out.dead) and int(out.moves_applied) == 1
    assert sk.solve(state) == -1 and int(out.distance) == -1
    after, out2 = jstep(state, jnp.array([2, 2, 2]))
    assert int(out2.moves_applied) == 0 and float(out2.reward) == 0.0


def test_player_on_target_and_no_move_codes():
    state, out = play("target", [0, 4, 0])
    assert rows(state)[2] == "#_SX__#"
    assert float(out.reward) == pytest.approx(-0.1) and int(out.invalid_moves) == 0
    state, out = jstep(state, jnp.array([7, -1, 3]))
    assert int(out.invalid_moves) == 2 and int(out.moves_applied) == 1


def test_room_without_border_walls_treats_outside_as_wall():
    state, out = play("open", [1, 3, 4])
    assert int(out.moves_applied) == 1 and bool(out.solved)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=3, max_size=12))
def test_step_matches_reference(moves):
    grid = ref.grid_of(ROOMS["reference"])
    state = start("reference")
    for k in range(0, len(moves) - 2, 3):
        turn = moves[k:k + 3]
        grid, reward, applied = ref.turn(grid, turn)
        state, out = jstep(state, jnp.asarray(turn, jnp.int32))
        assert rows(state) == ["".join(r) for r in grid]
        assert float(out.reward) == pytest.approx(reward, abs=1e-5)
        assert int(out.moves_applied) == applied
        assert int(out.distance) == ref.bfs(grid)


def test_vmapped_step_with_equals_per_trial_step_without_retracing():
    n = len(NAMES)
    moves = jax.random.randint(jax.random.key(0), (4, n, 3), 0, 5)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def batched(tables, states, mv):
        return jax.vmap(sk.step_with, in_axes=(None, 0, 0))(tables, states, mv)

    states = sk.init_batch(BANK, jnp.arange(n))
    singles = [start(name) for name in NAMES]
    for t in range(4):
        states, out = batched(BANK.tables, states, moves[t])
        for i in range(n):
            singles[i], o = jstep(singles[i], moves[t, i])
            assert np.array_equal(np.asarray(states.board[i]), np.asarray(singles[i].board))
            assert float(out.reward[i]) == pytest.approx(float(o.reward))
            assert int(out.distance[i]) == int(o.distance)
            assert int(out.distance[i]) == sk.solve(singles[i])
    chex.clear_trace_counter()


def test_dead_and_distance_agree_with_solver_on_generated_levels():
    bank = sk.generate(21, 8)
    states = sk.init_batch(bank, jnp.arange(8))
    step = jax.jit(jax.vmap(sk.step))
    key = jax.random.key(1)
    for _ in range(6):
        key, sub = jax.random.split(key)
        states, out = step(states, jax.random.randint(sub, (8, 3), 1, 5))
    for i in range(8):
        one = jax.tree.map(lambda x, i=i: x[i], states)
        assert sk.solve(one) == int(one.distance)
        assert bool(out.dead[i]) == (sk.solve(one) == -1)


def test_optimal_moves_follow_a_shortest_solution():
    best = jax.jit(sk.optimal_moves)
    state = start("reference")
    d0 = int(state.distance)
    assert d0 == sk.solve(state) > 0
    for _ in range(d0):
        options = np.flatnonzero(np.asarray(best(state))) + 1
        assert len(options) > 0
        state, _ = jstep(state, jnp.array([options[0], 0, 0], jnp.int32))
    assert bool(state.solved)


def test_step_without_tables_is_a_clear_error():
    bare = sk.init_batch(BANK, jnp.int32(0)).replace(tables=None)
    with pytest.raises(ValueError, match="tables"):
        sk.step(bare, jnp.zeros(3, jnp.int32))


def test_state_is_one_small_vector_and_level_count_is_checked():
    state = sk.init(sk.parse("# # # # #\n# P X O #\n# # # # #"))
    leaves = jax.tree_util.tree_leaves(state)
    assert len(leaves) == 1 and leaves[0].dtype == jnp.int16 and leaves[0].shape == (4,)  # player box level d
    assert int(state.player) == 6 and state.boxes.tolist() == [7] and int(state.distance) == 1
    host = jax.tree_util.tree_map(np.asarray, state)  # host copies read the same fields
    assert int(host.level) == 0 and host.boxes.dtype == np.int8
    from envs.sokoban.rules import MAX_LEVELS, make_tables

    too_many = np.zeros((MAX_LEVELS + 1, 3, 3), np.int8)
    with pytest.raises(ValueError, match="at most"):
        make_tables(np.zeros(0, np.int32), np.zeros(0, np.int16), np.zeros(MAX_LEVELS + 1, np.int32),
                    np.zeros(MAX_LEVELS + 1, np.int32), too_many, 1)
