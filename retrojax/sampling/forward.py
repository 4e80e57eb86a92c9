"""The sampler's cached forward pass: Qwen3 blocks over a KV cache updated in place.

Same contract and same block math as :meth:`retrojax.model.qwen3.Qwen3.hidden_cached` (it calls the model
module's own norm / projection / attention functions), but the cache travels through the layer scan as loop
*carry* and each layer scatters its new keys/values into it at ``[layer, row, slot]``. XLA then updates the
buffer in place; passing the cache as scanned input/output instead makes it re-stack the whole cache on
every decode step, which on CPU cost ~60 ms per step for a 32 × 2048-slot cache of the tiny model (vs ~µs).
Attention can also be limited to a static ``window`` of leading slots (the sampler picks a power of two that
covers the listed rows), so short conversations in a long cache read only what they use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from retrojax.model import qwen3
from retrojax.model.qwen3 import KVCache, Qwen3


def hidden_cached(model: Qwen3, input_ids: jax.Array, positions: jax.Array, cache: KVCache,
                  write_start: jax.Array, window: int | None = None) -> tuple[jax.Array, KVCache]:
    """Final-norm hidden [B, T, H] and the updated cache; token t of row b goes to slot write_start[b] + t
    (slots >= S dropped, so write_start[b] == S leaves row b untouched) and attends slots <= its own.

    ``window`` (static): attention reads only slots ``< window``; the caller guarantees every query that
    matters sits below it. Decode cost then follows the conversations' length, not the cache's.
    """
    c = model.config
    b, t = input_ids.shape
    s = cache.k.shape[2] if window is None else min(int(window), cache.k.shape[2])
    h = jnp.take(model.embed[...], input_ids, axis=0, mode="clip")
    positions = jnp.asarray(positions, jnp.int32)
    slots = jnp.asarray(write_start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= slots[:, :, None]  # [B, T, S]
    rows = jnp.arange(b)[:, None]
    params = model.layers.arrays()

    def body(carry, layer):
        h, ck, cv = carry
        p = jax.tree.map(lambda w: w[layer], params)
        x = qwen3.rms_norm(h, p["attn_norm"], c.rms_norm_eps)
        q, k, v = qwen3._qkv(p, x, positions, c)
        ck = ck.at[layer, rows, slots].set(k.astype(ck.dtype), mode="drop")
        cv = cv.at[layer, rows, slots].set(v.astype(cv.dtype), mode="drop")
        keys, values = ck[layer, :, :s], cv[layer, :, :s]
        attn = qwen3.attend(q, keys.astype(q.dtype), values.astype(q.dtype), mask)
        return (qwen3._finish_block(p, h, attn, c), ck, cv), None

    (h, k_new, v_new), _ = jax.lax.scan(body, (h, cache.k, cache.v), jnp.arange(c.num_hidden_layers))
    return qwen3.rms_norm(h, model.final_norm[...], c.rms_norm_eps), KVCache(k=k_new, v=v_new)
