"""Shared timing harness for the environment benchmarks (``retrojax bench envs``).

Both games and their Jumanji anchors are measured the same way: ``jit(scan(vmap(step)))`` over a fixed
array of random actions, with finished rows put back to their start state by a per-row select so every
step acts on a live episode, timed as the best of several calls after a compiling warm-up call. Ours and
the anchor are timed in alternation (``paired_best``), so a change in machine load during the run hits
both figures alike instead of skewing their ratio; the rewind and its deepcopy baseline likewise
(``rewind_vs_deepcopy``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from envs.trail import trail_init, trail_push, trail_rewind


def paired_best(fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """Best wall time (s) of each of ``fns`` over ``reps`` rounds that call every function once in turn
    (after one warm-up call each, which also compiles)."""
    for fn in fns:
        jax.block_until_ready(fn())
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def select_rows(mask: jax.Array, a, b):
    """Per-row ``where`` between two batched pytrees (``mask``: bool [B])."""
    return jax.tree_util.tree_map(lambda x, y: jnp.where(mask.reshape(-1, *([1] * (x.ndim - 1))), x, y), a, b)


def resetting_rollout(step_fn: Callable, done_fn: Callable) -> Callable:
    """``run(start, actions)``: scan of ``vmap(step_fn)`` over ``actions`` ([T, B, ...]).

    ``done_fn(new_state, output) -> (reward [B], done [B])``; done rows restart from ``start``.
    """

    def run(start, actions):
        def body(states, act):
            new, out = jax.vmap(step_fn)(states, act)
            reward, done = done_fn(new, out)
            return select_rows(done, start, new), jnp.sum(reward)

        return jax.lax.scan(body, start, actions)

    return jax.jit(run)


def rewind_vs_deepcopy(states, step_fn: Callable, sample_actions: Callable, capacity: int,
                       objects: Sequence[object], rounds: int, calls: int) -> tuple[float, float]:
    """``(rewind µs per trial, deepcopy µs per object)``, timed in alternation.

    Rewind: restoring a random ``C_j`` for a whole batch at once. ``states`` is a batch of start states;
    ``capacity - 1`` turns of ``step_fn`` (unbatched) with ``sample_actions(key)`` (batched actions) fill
    a batched trail first. The rewind is jitted, vmapped and donates the trail, as the agent loop calls
    it, so only ``C_j`` and the lengths are written. Deepcopy: ``copy.deepcopy`` of every one of
    ``objects``, the way upstream code checkpoints a plain Python/numpy environment. Each of ``rounds``
    rounds deep-copies all objects once and then makes ``calls`` rewind calls, so both figures (the best
    of each) are taken under the same machine conditions and their ratio does not drift with the load.
    """
    trials = jax.tree_util.tree_leaves(states)[0].shape[0]
    trails = jax.vmap(trail_init, in_axes=(0, None))(states, capacity)
    push = jax.jit(jax.vmap(trail_push))
    step = jax.jit(jax.vmap(step_fn))
    key = jax.random.key(0)
    for _ in range(capacity - 1):
        key, sub = jax.random.split(key)
        states, _ = step(states, sample_actions(sub))
        trails, _ = push(trails, states)
    targets = jax.random.randint(key, (trials,), 0, capacity, jnp.int32)
    rewind = jax.jit(jax.vmap(trail_rewind), donate_argnums=0)
    trails, cj = rewind(trails, targets)
    jax.block_until_ready(cj)
    best_rewind = best_copy = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        copies = [copy.deepcopy(o) for o in objects]
        best_copy = min(best_copy, time.perf_counter() - t0)
        assert len(copies) == len(objects)
        for _ in range(calls):
            t0 = time.perf_counter()
            trails, cj = rewind(trails, targets)
            jax.block_until_ready((trails, cj))
            best_rewind = min(best_rewind, time.perf_counter() - t0)
    return best_rewind / trials * 1e6, best_copy / len(objects) * 1e6
