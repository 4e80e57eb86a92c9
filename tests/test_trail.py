"""The generic checkpoint trail: push/get/rewind semantics, overflow signal, jit/vmap behaviour."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.trail import (
    Trail,
    TrailOverflowError,
    trail_get,
    trail_get_checked,
    trail_init,
    trail_last,
    trail_push,
    trail_push_checked,
    trail_rewind,
    trail_rewind_checked,
)


def make(i: int) -> dict:
    return {"board": jnp.full((2, 3), i, jnp.int8), "score": jnp.float32(i / 2), "meta": (jnp.int32(i),)}


def same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


push = jax.jit(trail_push)
rewind = jax.jit(trail_rewind)
get = jax.jit(trail_get)


def test_init_push_get_rewind():
    trail = trail_init(make(0), 4)
    assert isinstance(trail, Trail) and trail.capacity == 4 and int(trail.length) == 1
    for i in range(1, 4):
        trail, over = push(trail, make(i))
        assert not bool(over)
    assert int(trail.length) == 4
    assert all(same(get(trail, j), make(j)) for j in range(4))
    assert same(trail_last(trail), make(3))
    trail, c1 = rewind(trail, 1)
    assert int(trail.length) == 2 and same(c1, make(1))
    trail, _ = push(trail, make(9))  # the slot after C_1 is reused
    assert same(get(trail, 2), make(9)) and int(trail.length) == 3


def test_overflow_returns_flag_and_leaves_trail_unchanged():
    trail = trail_init(make(0), 2)
    trail, over = push(trail, make(1))
    assert not bool(over)
    full, over = push(trail, make(2))
    assert bool(over) and int(full.length) == 2 and same(full, trail)
    with pytest.raises(TrailOverflowError, match="capacity 2"):
        trail_push_checked(trail, make(2))


def test_indices_are_clamped_in_jit_and_checked_on_host():
    trail = trail_init(make(0), 3)
    trail, _ = push(trail, make(1))
    assert same(get(trail, 7), make(1)) and same(get(trail, -3), make(0))
    with pytest.raises(IndexError, match="C_2"):
        trail_get_checked(trail, 2)
    with pytest.raises(IndexError):
        trail_rewind_checked(trail, -1)
    t2, c = trail_rewind_checked(trail, 0)
    assert int(t2.length) == 1 and same(c, make(0))


def test_bad_capacity_or_state_is_a_clear_error():
    with pytest.raises(ValueError, match="capacity"):
        trail_init(make(0), 0)
    with pytest.raises(ValueError, match="leaf"):
        trail_init({}, 3)


def test_vmapped_trails_keep_their_own_lengths_without_retracing():
    b = 3
    states = jax.tree.map(lambda *xs: jnp.stack(xs), *[make(i) for i in range(b)])
    trails = jax.vmap(trail_init, in_axes=(0, None))(states, 2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def vpush(trails, states, mask):
        new, over = jax.vmap(trail_push)(trails, states)
        sel = lambda n, o: jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
        keep = jax.tree.map(sel, new, trails)
        return keep, over & mask

    trails, over = vpush(trails, states, jnp.array([True, False, True]))
    assert list(np.asarray(trails.length)) == [2, 1, 2] and not bool(over.any())
    trails, over = vpush(trails, states, jnp.array([True, True, False]))
    assert list(np.asarray(over)) == [True, False, False]
    assert list(np.asarray(trails.length)) == [2, 2, 2]
    trails, cj = jax.vmap(trail_rewind)(trails, jnp.array([0, 1, 0]))
    assert list(np.asarray(trails.length)) == [1, 2, 1]
    assert list(np.asarray(cj["meta"][0])) == [0, 1, 2]
    chex.clear_trace_counter()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("push"), st.integers(0, 99)),
                          st.tuples(st.just("rewind"), st.integers(0, 6))), max_size=20))
def test_trail_matches_a_list_model(ops):
    capacity = 5
    trail = trail_init(make(0), capacity)
    model = [0]
    for op, arg in ops:
        if op == "push":
            trail, over = push(trail, make(arg))
            assert bool(over) == (len(model) == capacity)
            if len(model) < capacity:
                model.append(arg)
        else:
            trail, cj = rewind(trail, arg)
            j = min(arg, len(model) - 1)
            model = model[: j + 1]
            assert same(cj, make(model[-1]))
        assert int(trail.length) == len(model)
    assert all(same(get(trail, j), make(v)) for j, v in enumerate(model))
