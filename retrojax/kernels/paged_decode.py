"""Decode attention over the paged KV cache, in Pallas: one query per row, read page by page.

The pool is ``retrojax.model.qwen3.PagedKVCache``'s: keys [L, P, KVH, D, page_size] (slot minor), values
[L, P, KVH, page_size, D]; row b's slot s is offset ``s % page_size`` of page ``tables[b, s // page_size]``
and the row sees the slots ``< lengths[b]``. A program handles one (row, kv head): its G query heads form
one [G, D] matrix (grouped-query attention; K/V are never repeated), each page is one [D, ps] key tile and one
[ps, D] value tile read where it lies in the pool, and the pages are folded in with an online softmax in
float32 (``_page_step``: scores ``q · K`` and ``p · V`` as 2-D products in the pool's own layouts, the slots
past the length of the last page masked). No window of the row is gathered: only the row's used pages
(``ceil(length / page_size)``) are read, whatever its table holds after them (the null page 0, stale pages).
The whole layer stack is passed with the layer index as data, so a layer scan feeds the kernel no slice copy.

Two layouts of the same step, for the two Pallas backends:

* ``grid`` (TPU/Mosaic, and CPU interpret mode): grid (rows, kv heads, table pages); the layer index, the
  page tables and the lengths are scalar-prefetch operands and each key/value tile is brought in by its
  ``BlockSpec`` index map, which reads the page number from the table. Steps past a row's last used page map
  to that same page (the pipeline fetches nothing new) and compute nothing; the running max, denominator
  and accumulator live in VMEM scratch across the page axis (``arbitrary``), the output is written at the
  last step.
* ``loop`` (GPU/Triton, which has no scalar prefetch nor scratch): grid (rows, kv heads); each program holds
  its row's table and length and walks its used pages in a ``fori_loop`` of dynamic length, loading each
  tile from the pool by (layer, page) scalar indices. Triton's matrix units want at least 16 rows, so the G
  query heads are padded to ``max(16, next power of two)`` rows (the padding rows are dropped).

Numerics: float32 scores, softmax and accumulator; float32 inputs multiply at full precision
(``Precision.HIGHEST``), bfloat16 ones feed the matrix units as they are; the output is in the query's
dtype. A row of length 0 gets zeros. The dense reference is
``retrojax.kernels.reference.paged_decode_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = -1e30  # finite "minus infinity", as in forest_attention
LAYOUTS = ("grid", "loop")
TRITON_MIN_ROWS = 16  # Triton's dot takes at least 16 rows


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
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    b, n, d = q.shape
    n_layers, p, kvh, kd, ps = k_pages.shape
    if v_pages.shape != (n_layers, p, kvh, ps, d) or kd != d or n % kvh:
        raise ValueError(f"paged_decode_attention: q {q.shape}, k_pages {k_pages.shape}, v_pages "
                         f"{v_pages.shape} do not fit")
    if tables.ndim != 2 or tables.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"paged_decode_attention: tables {tables.shape} and lengths {lengths.shape} must be "
                         f"[{b}, W] and [{b}]")
    if layout is None:
        layout = "loop" if jax.default_backend() == "gpu" else "grid"
    if layout not in LAYOUTS:
        raise ValueError(f"paged_decode_attention: layout must be {' | '.join(LAYOUTS)}, got {layout!r}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    g = n // kvh
    qg = q.reshape(b, kvh, g, d)
    tables = jnp.asarray(tables, jnp.int32)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, tables.shape[1] * ps)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    run = _grid if layout == "grid" else _loop
    out = run(qg, k_pages, v_pages, tables, lengths, layer, bool(interpret))
    return out.reshape(b, n, d)


# ----------------------------------------------------------------------------------------------
# The step both layouts share
# ----------------------------------------------------------------------------------------------


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] times b [K, N], float32 result, full precision for float32 inputs."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _page_step(q, kt, vt, start, length, carry, scale: float):
    """Fold one page into the running (max [G, 1], denominator [G, 1], accumulator [G, D]).

    q [G, D]; kt [D, ps] (keys, slot minor); vt [ps, D]; the page holds slots ``start + [0, ps)``, of which
    those ``< length`` count."""
    m, denom, acc = carry
    ps = vt.shape[0]
    s = _dot(q, kt.astype(q.dtype)) * scale  # [G, ps]
    valid = (start + jax.lax.broadcasted_iota(jnp.int32, (1, ps), 1)) < length
    s = jnp.where(valid, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    prob = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr + _dot(prob.astype(q.dtype), vt.astype(q.dtype))
    return m_new, denom * corr + jnp.sum(prob, axis=1, keepdims=True), acc


def _finish(denom: jax.Array, acc: jax.Array, dtype) -> jax.Array:
    return (acc / jnp.where(denom > 0.0, denom, 1.0)).astype(dtype)


def _init(g: int, d: int):
    """The running max, denominator and accumulator before any page."""
    zeros = jnp.zeros((g, 1), jnp.float32)
    return zeros + NEG, zeros, jnp.zeros((g, d), jnp.float32)


# ----------------------------------------------------------------------------------------------
# grid layout: pages on the grid, read through scalar-prefetched tables (TPU, interpret mode)
# ----------------------------------------------------------------------------------------------


def _grid_kernel(layer_ref, tables_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
                 page_size: int, scale: float):
    del layer_ref, tables_ref  # read by the index maps
    j = pl.program_id(2)
    length = lengths_ref[pl.program_id(0)]

    @pl.when(j == 0)
    def _():
        m, denom, acc = _init(*acc_ref.shape)
        m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

    @pl.when(j * page_size < length)
    def _():
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m, denom, acc = _page_step(q_ref[...], k_ref[...], v_ref[...], j * page_size, length, carry, scale)
        m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = _finish(l_ref[...], acc_ref[...], o_ref.dtype)


def _grid(qg, k_pages, v_pages, tables, lengths, layer, interpret: bool):
    from jax.experimental.pallas import tpu as pltpu

    b, kvh, g, d = qg.shape
    ps, w = v_pages.shape[3], tables.shape[1]

    def page(r, h, j, layer_ref, tables_ref, lengths_ref):
        last = jnp.maximum(jax.lax.div(lengths_ref[r] + ps - 1, ps) - 1, 0)  # steps past it re-map to it
        return layer_ref[0], tables_ref[r * w + jnp.minimum(j, last)], h, 0, 0

    heads = pl.BlockSpec((None, None, g, d), lambda r, h, j, *_: (r, h, 0, 0))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, kvh, w),
        in_specs=[heads, pl.BlockSpec((None, None, None, d, ps), page),
                  pl.BlockSpec((None, None, None, ps, d), page)],
        out_specs=heads,
        scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                        pltpu.VMEM((g, d), jnp.float32)])
    params = {} if interpret else {"compiler_params": pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"))}
    return pl.pallas_call(
        functools.partial(_grid_kernel, page_size=ps, scale=d ** -0.5), grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype), interpret=interpret, name="paged_decode_grid",
        **params,
    )(layer, tables.reshape(-1), lengths, qg, k_pages, v_pages)


# ----------------------------------------------------------------------------------------------
# loop layout: each program walks its row's pages (GPU/Triton, interpret mode)
# ----------------------------------------------------------------------------------------------


def _loop_kernel(layer_ref, tables_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, *, page_size: int,
                 scale: float):
    layer, length = layer_ref[0], lengths_ref[0]
    q = q_ref[...]  # [Gp, D]

    def body(j, carry):
        page = tables_ref[j]
        return _page_step(q, k_ref[layer, page, :, :], v_ref[layer, page, :, :], j * page_size, length, carry,
                          scale)

    n_pages = jax.lax.div(length + page_size - 1, page_size)
    _, denom, acc = jax.lax.fori_loop(0, n_pages, body, _init(*q.shape))
    o_ref[...] = _finish(denom, acc, o_ref.dtype)


def _loop(qg, k_pages, v_pages, tables, lengths, layer, interpret: bool):
    b, kvh, g, d = qg.shape
    n_layers, p, _, _, ps = k_pages.shape
    gp = max(TRITON_MIN_ROWS, pl.next_power_of_2(g))
    qp = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    heads = pl.BlockSpec((None, None, gp, d), lambda r, h: (r, h, 0, 0))
    params = {}
    if not interpret and jax.default_backend() == "gpu":
        from jax.experimental.pallas import triton as plgpu

        params = {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=2)}
    out = pl.pallas_call(
        functools.partial(_loop_kernel, page_size=ps, scale=d ** -0.5), grid=(b, kvh),
        in_specs=[pl.BlockSpec((1,), lambda r, h: (0,)),
                  pl.BlockSpec((None, tables.shape[1]), lambda r, h: (r, 0)),
                  pl.BlockSpec((None, 1), lambda r, h: (r, 0)),
                  heads,
                  pl.BlockSpec((n_layers, p, None, d, ps), lambda r, h: (0, 0, h, 0, 0)),
                  pl.BlockSpec((n_layers, p, None, ps, d), lambda r, h: (0, 0, h, 0, 0))],
        out_specs=heads, out_shape=jax.ShapeDtypeStruct(qp.shape, qg.dtype), interpret=interpret,
        name="paged_decode_loop", **params,
    )(layer, tables, lengths[:, None], qp, k_pages, v_pages)
    return out[:, :, :g]
