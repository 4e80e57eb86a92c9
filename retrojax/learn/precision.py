"""Mixed precision for the learners: float32 master weights beside a model that computes in its own dtype.

A bfloat16 weight near 0.02 is spaced 1.2e-4 from its neighbours, so an AdamW step of 1e-6 rounds away and a
bfloat16 model stepped in place learns nothing. The learners (RL update, SFT) therefore keep the trainable
parameters as float32 *masters*: AdamW's moments and the gradient accumulator are then float32 too (optax
makes them like the params), and the forward and backward run in the model's dtype because the loss first
casts the masters down (:func:`cast_like`; the cast's gradient brings float32 gradients back). Checkpoints
hold the masters; what the sampler decodes with and what ``export`` writes is the cast-down copy.

``learn.master_dtype`` (ours): ``float32`` (default, the usual recipe of MaxText's ``weight_dtype``, Tunix and
PyTorch AMP) or ``model``: step the weights in the model's dtype and save their memory knowingly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MASTER_DTYPES = ("float32", "model")


def check_master_dtype(master_dtype: str) -> None:
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"learn.master_dtype must be float32 | model, got {master_dtype!r}")


def _is_low_float(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def master_copy(params: Any, master_dtype: str = "float32") -> Any:
    """``params`` with every floating leaf narrower than float32 as a float32 copy (``model``: unchanged).

    Works on arrays and on abstract ``jax.ShapeDtypeStruct`` leaves (the memory plan), keeping shardings.
    """
    check_master_dtype(master_dtype)
    if master_dtype == "model":
        return params

    def up(x: Any) -> Any:
        if not _is_low_float(x.dtype):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=getattr(x, "sharding", None))
        return x.astype(jnp.float32)

    return jax.tree.map(up, params)


def cast_like(tree: Any, like: Any) -> Any:
    """``tree`` with each leaf cast to the dtype of the matching leaf of ``like`` (arrays or abstract
    shapes of the same structure); leaves already of that dtype pass through untouched."""
    return jax.tree.map(lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), tree, like)


def dtypes_of(tree: Any) -> Any:
    """The abstract shapes (shape, dtype) of ``tree``'s leaves: what :func:`cast_like` casts back to."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
