"""Dense references for the kernels of this package: the same math, written the plain way, for tests.

``forest_attention_reference`` materializes the [B, T, T] mask and scores, so it is for small shapes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity", as in retrojax.model.qwen3


def forest_mask(tree_exit: jax.Array) -> jax.Array:
    """[B, T, T] bool: query i sees key j iff j <= i < tree_exit[b, j] (j an ancestor-or-self of i)."""
    tree_exit = jnp.asarray(tree_exit, jnp.int32)
    t = tree_exit.shape[-1]
    qi = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    kj = jnp.arange(t, dtype=jnp.int32)[None, None, :]
    return (kj <= qi) & (qi < tree_exit[:, None, :])


def forest_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, tree_exit: jax.Array) -> jax.Array:
    """Grouped-query attention under the forest mask, float32 softmax, full precision products.

    q [B, T, N, D]; k, v [B, T, KVH, D]; query head n reads kv head n // (N // KVH). A query that sees no key
    gets zeros (as the kernel does). Returns [B, T, N, D] in q's dtype.
    """
    b, t, n, d = q.shape
    kvh = k.shape[2]
    hi = jax.lax.Precision.HIGHEST
    mask = forest_mask(tree_exit)[:, None, None]  # [B, 1, 1, T, T]
    qg = q.reshape(b, t, kvh, n // kvh, d).astype(jnp.float32)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32), precision=hi) * d ** -0.5
    s = jnp.where(mask, s, NEG)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision=hi)
    return out.reshape(b, t, n, d).astype(q.dtype)
