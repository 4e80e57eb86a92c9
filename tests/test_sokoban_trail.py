"""Rewinding a Sokoban trail to C_j and replaying the same turns reproduces the same states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.sokoban as sk
from envs.trail import trail_get, trail_init, trail_push, trail_rewind

LEVEL = sk.parse("""
0: # # # # # # #
1: # _ _ _ _ _ #
2: # _ X _ O _ #
3: # _ P _ _ _ #
4: # _ _ X O _ #
5: # _ _ _ _ _ #
6: # # # # # # #
""")
START = sk.init(LEVEL)
step = jax.jit(sk.step)
push = jax.jit(trail_push)
rewind = jax.jit(trail_rewind)
get = jax.jit(trail_get)


def same(a: sk.State, b: sk.State) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=1, max_size=8), st.data())
def test_rewind_then_replay_reproduces_states(turns, data):
    trail = trail_init(START, 9)  # one capacity for every example: one compile
    state = START
    for turn in turns:
        state, _ = step(state, jnp.asarray(turn, jnp.int32))
        trail, over = push(trail, state)
        assert not bool(over)
    j = data.draw(st.integers(0, len(turns)))
    trail, cj = rewind(trail, j)
    assert int(trail.length) == j + 1
    assert same(cj, get(trail, j))
    replay = cj
    for k, turn in enumerate(turns[j:], start=j + 1):
        replay, _ = step(replay, jnp.asarray(turn, jnp.int32))
        trail, _ = push(trail, replay)
        assert same(replay, get(trail, k))
    assert same(replay, state)
    assert trail.states.tables is START.tables  # the tables are referenced, never stacked per checkpoint
