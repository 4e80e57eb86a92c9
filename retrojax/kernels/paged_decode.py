"""Decode attention over the paged KV cache, in Pallas: one query per row, read page by page.

Decode is the one-token case of ``retrojax.kernels.paged_attention`` (the query at slot ``lengths[b] - 1``):
the same kernel, its two layouts (``grid`` for TPU/Mosaic and CPU interpret mode, ``loop`` for GPU/Triton)
and numerics (float32 online softmax, full precision float32 products). A program handles one (row, kv head):
its G query heads form one [G, D] matrix (grouped-query attention; K/V are never repeated), and only the
row's used pages (``ceil(length / page_size)``) are read, whatever its table holds after them. A row of length
0 gets zeros. The dense reference is ``retrojax.kernels.reference.paged_decode_reference``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from retrojax.kernels.paged_attention import LAYOUTS, paged_attention

__all__ = ["LAYOUTS", "paged_decode_attention"]


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                           lengths: jax.Array, *, layer: int | jax.Array = 0, layout: str | None = None,
                           interpret: bool | None = None) -> jax.Array:
    """One decode query per row against its pages.

    q [B, N, D]; k_pages [L, P, KVH, D, ps] and v_pages [L, P, KVH, ps, D] (or one layer's, without L);
    tables int32 [B, W] (page numbers; entries past a row's used pages are never read); lengths int32 [B]
    (row b attends slots ``< lengths[b]``, at most ``W * ps``); ``layer``: which layer of the stack (a
    Python int or an int32 scalar, traced in a layer scan). Returns [B, N, D] in q's dtype.
    ``layout``: ``grid`` | ``loop`` (default: ``loop`` on GPU, ``grid`` elsewhere); ``interpret``: Pallas
    interpret mode (default: on the CPU backend).
    """
    if q.ndim != 3 or lengths.ndim != 1:
        raise ValueError(f"paged_decode_attention: q {q.shape} must be [B, N, D], lengths {lengths.shape} "
                         f"[B]")
    lengths = jnp.asarray(lengths, jnp.int32)
    return paged_attention(q[:, None], k_pages, v_pages, tables, lengths - 1, lengths, layer=layer,
                           layout=layout, interpret=interpret)[:, 0]
