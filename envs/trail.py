"""Checkpoint trail C_0 … C_k for any functional environment whose state is a pytree.

A ``Trail`` stores the states of one trial's active path in a fixed-capacity buffer: every leaf of
``states`` has a leading axis of length ``capacity`` and ``length`` counts the valid checkpoints
(``C_0`` lives at index 0). All functions are pure, jittable and vmappable (vmap over a batch of trails
gives each trial its own length), so a checkpoint is an array slice and a rewind is a length reset plus
one gather — no host copies.

Overflow signal: ``trail_push`` never overwrites. When the trail is full it returns the trail unchanged
and ``overflowed=True`` (a bool array, per trial under vmap); callers decide what to do (the agent loop
counts it as an invalid turn). ``trail_push_checked`` is the host-side variant that raises
``TrailOverflowError`` instead. Indices passed to ``trail_get``/``trail_rewind`` are clamped into
``[0, length-1]`` inside jit (a traced index cannot raise); ``trail_get_checked`` and
``trail_rewind_checked`` raise ``IndexError`` on the host for out-of-range indices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

PyTree = Any


class TrailOverflowError(RuntimeError):
    """Raised by the checked host-side variants when a push would exceed the trail's capacity."""


@struct.dataclass
class Trail:
    """States of the active path ``C_0 … C_{length-1}``; every leaf has a leading capacity axis."""

    states: PyTree
    length: jax.Array  # int32 scalar (per trial under vmap)

    @property
    def capacity(self) -> int:
        """Static number of checkpoint slots (the leading axis of the state leaves)."""
        return jax.tree_util.tree_leaves(self.states)[0].shape[0]


def trail_init(state: PyTree, capacity: int) -> Trail:
    """A trail holding only ``C_0 = state``; unused slots are filled with copies of ``state``."""
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"trail capacity must be a positive int, got {capacity!r}")
    if not jax.tree_util.tree_leaves(state):
        raise ValueError("trail state must be a pytree with at least one array leaf")
    states = jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(jnp.asarray(x), (capacity, *jnp.shape(x))), state
    )
    return Trail(states=states, length=jnp.asarray(1, jnp.int32))


def _clamp(trail: Trail, j: jax.Array | int) -> jax.Array:
    return jnp.clip(jnp.asarray(j, jnp.int32), 0, trail.length - 1)


def trail_get(trail: Trail, j: jax.Array | int) -> PyTree:
    """The checkpoint ``C_j`` (``j`` clamped into ``[0, length-1]``)."""
    idx = _clamp(trail, j)
    return jax.tree_util.tree_map(
        lambda x: jax.lax.dynamic_index_in_dim(x, idx, keepdims=False), trail.states
    )


def trail_last(trail: Trail) -> PyTree:
    """The newest checkpoint ``C_{length-1}``."""
    return trail_get(trail, trail.length - 1)


def trail_push(trail: Trail, state: PyTree) -> tuple[Trail, jax.Array]:
    """Append ``state`` as ``C_length``; returns ``(trail, overflowed)``; a full trail is left unchanged."""
    overflowed = trail.length >= trail.capacity
    idx = jnp.minimum(trail.length, trail.capacity - 1)

    def write(buf: jax.Array, new: jax.Array) -> jax.Array:
        old = jax.lax.dynamic_index_in_dim(buf, idx, keepdims=False)
        value = jnp.where(overflowed, old, jnp.asarray(new, buf.dtype))
        return jax.lax.dynamic_update_index_in_dim(buf, value, idx, axis=0)

    states = jax.tree_util.tree_map(write, trail.states, state)
    length = jnp.where(overflowed, trail.length, trail.length + 1).astype(jnp.int32)
    return Trail(states=states, length=length), overflowed


def trail_rewind(trail: Trail, j: jax.Array | int) -> tuple[Trail, PyTree]:
    """Keep ``C_0 … C_j`` (``j`` clamped into ``[0, length-1]``); returns ``(trail, C_j)``.

    Slots past ``j`` keep stale data but are outside ``length``, so nothing is copied except ``C_j``.
    """
    idx = _clamp(trail, j)
    return trail.replace(length=idx + 1), trail_get(trail, idx)


def trail_push_checked(trail: Trail, state: PyTree) -> Trail:
    """Host-side ``trail_push`` that raises ``TrailOverflowError`` instead of returning a flag."""
    new, overflowed = trail_push(trail, state)
    if bool(jnp.any(overflowed)):
        raise TrailOverflowError(f"trail is full: capacity {trail.capacity} checkpoints")
    return new


def _check_index(trail: Trail, j: int) -> None:
    length = int(trail.length)
    if not 0 <= int(j) < length:
        raise IndexError(f"checkpoint C_{j} does not exist: the trail holds C_0 … C_{length - 1}")


def trail_get_checked(trail: Trail, j: int) -> PyTree:
    """Host-side ``trail_get`` for an unbatched trail that raises ``IndexError`` for a missing ``C_j``."""
    _check_index(trail, j)
    return trail_get(trail, j)


def trail_rewind_checked(trail: Trail, j: int) -> tuple[Trail, PyTree]:
    """Host-side ``trail_rewind`` for an unbatched trail that raises ``IndexError`` for a missing ``C_j``."""
    _check_index(trail, j)
    return trail_rewind(trail, j)
