"""``StaticRef``: how a state points at large shared data without carrying it."""

from __future__ import annotations

from typing import Generic, TypeVar

import jax
import numpy as np

T = TypeVar("T")


class StaticRef(Generic[T]):
    """Identity-hashed holder of shared read-only data (a bank's distance or cascade tables) that a state
    keeps as a static, non-pytree field: ``jit``, ``vmap`` and trails never copy the data per state or per
    checkpoint; under ``jit`` it is a constant of the program (one program per holder, compared by identity).
    """

    __slots__ = ("value",)

    def __init__(self, value: T):
        self.value = value

    def __repr__(self) -> str:
        leaves = jax.tree_util.tree_leaves(self.value)
        shapes = ", ".join("x".join(map(str, np.shape(x))) or "()" for x in leaves)
        return f"StaticRef({type(self.value).__name__}: {shapes})"
