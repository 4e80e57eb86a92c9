"""Dense references for the kernels of this package: the same math, written the plain way, for tests.

``forest_attention_reference`` materializes the [B, T, T] mask and scores, so it is for small shapes only;
``paged_decode_reference`` and ``paged_attention_reference`` gather every row's whole window of pages.
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


def paged_decode_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                           lengths: jax.Array, layer: int = 0) -> jax.Array:
    """One query per row against its gathered pages, float32 softmax, full precision products.

    q [B, N, D]; k_pages [L, P, KVH, D, ps], v_pages [L, P, KVH, ps, D] (or one layer's, without L); tables
    int32 [B, W]; row b sees slots < lengths[b] of its window (slot s: page tables[b, s // ps], offset
    s % ps). A row of length 0 gets zeros. Returns [B, N, D] in q's dtype.
    """
    if k_pages.ndim == 5:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    b, n, d = q.shape
    _, kvh, _, ps = k_pages.shape
    w = tables.shape[1]
    hi = jax.lax.Precision.HIGHEST
    kt = k_pages[tables].transpose(0, 2, 3, 1, 4).reshape(b, kvh, d, w * ps).astype(jnp.float32)
    vw = v_pages[tables].transpose(0, 2, 1, 3, 4).reshape(b, kvh, w * ps, d).astype(jnp.float32)
    mask = jnp.arange(w * ps)[None, None, None, :] < jnp.asarray(lengths)[:, None, None, None]  # [B,1,1,S]
    qg = q.reshape(b, kvh, n // kvh, d).astype(jnp.float32)
    s = jnp.einsum("bkgd,bkds->bkgs", qg, kt, precision=hi) * d ** -0.5
    s = jnp.where(mask, s, NEG)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    out = jnp.einsum("bkgs,bksd->bkgd", p, vw, precision=hi)
    return out.reshape(b, n, d).astype(q.dtype)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                              starts: jax.Array, lengths: jax.Array, layer: int = 0) -> jax.Array:
    """T queries per row against its gathered pages, float32 softmax, full precision products.

    q [B, T, N, D]; k_pages [L, P, KVH, D, ps], v_pages [L, P, KVH, ps, D] (or one layer's, without L); tables
    int32 [B, W]; query token j of row b sees slots ``<= starts[b] + j`` and ``< lengths[b]`` of its window
    (slot s: page tables[b, s // ps], offset s % ps). A query that sees no slot gets zeros. Returns
    [B, T, N, D] in q's dtype.
    """
    if k_pages.ndim == 5:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    b, t, n, d = q.shape
    _, kvh, _, ps = k_pages.shape
    w = tables.shape[1]
    hi = jax.lax.Precision.HIGHEST
    kt = k_pages[tables].transpose(0, 2, 3, 1, 4).reshape(b, kvh, d, w * ps).astype(jnp.float32)
    vw = v_pages[tables].transpose(0, 2, 1, 3, 4).reshape(b, kvh, w * ps, d).astype(jnp.float32)
    slot = jnp.arange(w * ps)[None, None, :]
    query = jnp.asarray(starts)[:, None, None] + jnp.arange(t)[None, :, None]
    mask = ((slot <= query) & (slot < jnp.asarray(lengths)[:, None, None]))[:, None, None]  # [B, 1, 1, T, S]
    qg = q.reshape(b, t, kvh, n // kvh, d).astype(jnp.float32)
    s = jnp.einsum("btkgd,bkds->bkgts", qg, kt, precision=hi) * d ** -0.5
    s = jnp.where(mask, s, NEG)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    out = jnp.einsum("bkgts,bksd->btkgd", p, vw, precision=hi)
    return out.reshape(b, t, n, d).astype(q.dtype)
