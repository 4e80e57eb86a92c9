"""Attention over the paged KV cache, in Pallas: T query tokens per row (prefill, append, decode), page by
page.

The pool is ``retrojax.model.qwen3.PagedKVCache``'s: keys [L, P, KVH, D, page_size] (slot minor), values
[L, P, KVH, page_size, D]; row b's slot s is offset ``s % page_size`` of page ``tables[b, s // page_size]``.
Query token j of row b sits at slot ``starts[b] + j`` and sees the slots ``<= starts[b] + j`` and
``< lengths[b]`` (the row's window cap: a token past it sees the whole window, as the sampler's gathered path
does). Grouped-query attention: the G query heads of a kv head and the T tokens form one [T·G, D] matrix (row
``j·G + g``: token j, head g; K/V are never repeated), cut into blocks of R rows. A program handles one (row,
kv head, row block): each page is one [D, ps] key tile and one [ps, D] value tile read where it lies in the
pool, folded in with an online softmax in float32 (``_page_step``: scores ``q · K`` and ``p · V`` as 2-D
products in the pool's own layouts, each query row masked past its own last visible slot). No window of the
row is gathered: a block reads only the pages up to its last row's last visible slot
(``ceil(min(starts + j + 1, lengths) / page_size)``, causal: earlier blocks read fewer), whatever the table
holds after them (the null page 0, stale pages). The whole layer stack is passed with the layer index as data,
so a layer scan feeds the kernel no slice copy. Each query row's visible limit and each block's page count are
computed outside the kernel (plain XLA over [B, T·G] integers), so the kernel does no vector integer division.

Two layouts of the same step, for the two Pallas backends:

* ``grid`` (TPU/Mosaic, and CPU interpret mode): grid (rows, kv heads, row blocks, table pages); the layer
  index, the page tables and the blocks' page counts are scalar-prefetch operands and each key/value tile is
  brought in by its ``BlockSpec`` index map, which reads the page number from the table. Steps past a block's
  last page map to that same page (the pipeline fetches nothing new) and compute nothing; the running max,
  denominator and accumulator live in VMEM scratch across the page axis (``arbitrary``), the output is
  written at the last step. R = T·G up to 128 rows, else 128.
* ``loop`` (GPU/Triton, which has no scalar prefetch nor scratch): grid (rows, kv heads, row blocks); each
  program holds its row's table and its block's page count and walks those pages in a ``fori_loop`` of dynamic
  length, loading each tile from the pool by (layer, page) scalar indices. Triton's blocks are powers of two
  and its matrix units want at least 16 rows: R = ``next power of two`` of T·G within [16, 64].

Rows past T·G (padding up to a whole block) are computed as copies of the last token's and dropped.

Numerics: float32 scores, softmax and accumulator; float32 inputs multiply at full precision
(``Precision.HIGHEST``), bfloat16 ones feed the matrix units as they are; the output is in the query's dtype.
A query that sees no slot (a row of length 0) gets zeros. Decode is the T = 1 case
(``retrojax.kernels.paged_decode``). The dense reference is
``retrojax.kernels.reference.paged_attention_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = -1e30  # finite "minus infinity", as in forest_attention
LAYOUTS = ("grid", "loop")
TRITON_MIN_ROWS = 16  # Triton's dot takes at least 16 rows
BLOCK_ROWS = {"grid": 128, "loop": 64}  # query rows (tokens × heads of a kv head) per program, at most


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                    starts: jax.Array, lengths: jax.Array, *, layer: int | jax.Array = 0,
                    layout: str | None = None, interpret: bool | None = None,
                    block_rows: int | None = None) -> jax.Array:
    """T query tokens per row against the row's pages.

    q [B, T, N, D]; k_pages [L, P, KVH, D, ps] and v_pages [L, P, KVH, ps, D] (or one layer's, without L);
    tables int32 [B, W] (page numbers; entries past a row's used pages are never read); starts int32 [B]
    (token j of row b sits at slot ``starts[b] + j`` and sees slots up to it); lengths int32 [B] (row b sees
    slots ``< lengths[b]``, at most ``W * ps``); ``layer``: which layer of the stack (a Python int or an int32
    scalar, traced in a layer scan). Returns [B, T, N, D] in q's dtype. ``layout``: ``grid`` | ``loop``
    (default: ``loop`` on GPU, ``grid`` elsewhere); ``interpret``: Pallas interpret mode (default: on the CPU
    backend); ``block_rows``: query rows (tokens × heads of a kv head) a program takes at most (default
    ``BLOCK_ROWS``; a multiple of 8 for Mosaic, a power of two >= 16 for Triton).
    """
    if k_pages.ndim == 4:
        k_pages, v_pages = k_pages[None], v_pages[None]
    b, t, n, d = q.shape
    n_layers, p, kvh, kd, ps = k_pages.shape
    if v_pages.shape != (n_layers, p, kvh, ps, d) or kd != d or n % kvh:
        raise ValueError(f"paged_attention: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} do "
                         f"not fit")
    if tables.ndim != 2 or tables.shape[0] != b or starts.shape != (b,) or lengths.shape != (b,):
        raise ValueError(f"paged_attention: tables {tables.shape}, starts {starts.shape} and lengths "
                         f"{lengths.shape} must be [{b}, W], [{b}] and [{b}]")
    if layout is None:
        layout = "loop" if jax.default_backend() == "gpu" else "grid"
    if layout not in LAYOUTS:
        raise ValueError(f"paged_attention: layout must be {' | '.join(LAYOUTS)}, got {layout!r}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    g, w = n // kvh, tables.shape[1]
    m = t * g
    cap = block_rows or BLOCK_ROWS[layout]
    if layout == "grid":
        rows = m if m <= cap else cap
    else:
        rows = min(cap, max(TRITON_MIN_ROWS, pl.next_power_of_2(m)))
    n_blocks = -(-m // rows)
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, m, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, n_blocks * rows - m), (0, 0)))
    # query row i is token min(i // G, T - 1): it sees slots < min(starts + token + 1, lengths)
    token = jnp.minimum(jnp.arange(n_blocks * rows, dtype=jnp.int32) // g, t - 1)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, w * ps)
    last = jnp.asarray(starts, jnp.int32)[:, None] + token[None]  # [B, rows × blocks]
    limits = jnp.clip(jnp.minimum(last + 1, lengths[:, None]), 0, None)
    reach = -(-limits.reshape(b, n_blocks, rows).max(axis=2) // ps)  # pages each block reads [B, blocks]
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    run = _grid if layout == "grid" else _loop
    out = run(qg, k_pages, v_pages, jnp.asarray(tables, jnp.int32), limits[..., None], reach, layer, rows,
              bool(interpret))
    return out[:, :, :m].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, n, d)


# ----------------------------------------------------------------------------------------------
# The step both layouts share
# ----------------------------------------------------------------------------------------------


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] times b [K, N], float32 result, full precision for float32 inputs."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _page_step(q, kt, vt, start, limit, carry, scale: float):
    """Fold one page into the running (max [R, 1], denominator [R, 1], accumulator [R, D]).

    q [R, D]; kt [D, ps] (keys, slot minor); vt [ps, D]; the page holds slots ``start + [0, ps)``; query row
    r sees those ``< limit[r]`` (limit [R, 1])."""
    m, denom, acc = carry
    ps = vt.shape[0]
    s = _dot(q, kt.astype(q.dtype)) * scale  # [R, ps]
    valid = (start + jax.lax.broadcasted_iota(jnp.int32, (1, ps), 1)) < limit  # [R, ps]
    s = jnp.where(valid, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    prob = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr + _dot(prob.astype(q.dtype), vt.astype(q.dtype))
    return m_new, denom * corr + jnp.sum(prob, axis=1, keepdims=True), acc


def _finish(denom: jax.Array, acc: jax.Array, dtype) -> jax.Array:
    return (acc / jnp.where(denom > 0.0, denom, 1.0)).astype(dtype)


def _init(rows: int, d: int):
    """The running max, denominator and accumulator before any page."""
    zeros = jnp.zeros((rows, 1), jnp.float32)
    return zeros + NEG, zeros, jnp.zeros((rows, d), jnp.float32)


# ----------------------------------------------------------------------------------------------
# grid layout: pages on the grid, read through scalar-prefetched tables (TPU, interpret mode)
# ----------------------------------------------------------------------------------------------


def _grid_kernel(layer_ref, tables_ref, reach_ref, q_ref, limit_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
                 acc_ref, *, page_size: int, n_blocks: int, scale: float):
    del layer_ref, tables_ref  # read by the index maps
    j = pl.program_id(3)
    reach = reach_ref[pl.program_id(0) * n_blocks + pl.program_id(2)]

    @pl.when(j == 0)
    def _():
        m, denom, acc = _init(*acc_ref.shape)
        m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

    @pl.when(j < reach)
    def _():
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m, denom, acc = _page_step(q_ref[...], k_ref[...], v_ref[...], j * page_size, limit_ref[...], carry,
                                   scale)
        m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        o_ref[...] = _finish(l_ref[...], acc_ref[...], o_ref.dtype)


def _grid(qg, k_pages, v_pages, tables, limits, reach, layer, rows: int, interpret: bool):
    from jax.experimental.pallas import tpu as pltpu

    b, kvh, mp, d = qg.shape
    ps, w = v_pages.shape[3], tables.shape[1]
    n_blocks = mp // rows

    def page(r, h, i, j, layer_ref, tables_ref, reach_ref):
        last = jnp.maximum(reach_ref[r * n_blocks + i] - 1, 0)  # steps past it re-map to it
        return layer_ref[0], tables_ref[r * w + jnp.minimum(j, last)], h, 0, 0

    block = pl.BlockSpec((None, None, rows, d), lambda r, h, i, j, *_: (r, h, i, 0))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, kvh, n_blocks, w),
        in_specs=[block, pl.BlockSpec((None, rows, 1), lambda r, h, i, j, *_: (r, i, 0)),
                  pl.BlockSpec((None, None, None, d, ps), page),
                  pl.BlockSpec((None, None, None, ps, d), page)],
        out_specs=block,
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, d), jnp.float32)])
    params = {} if interpret else {"compiler_params": pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))}
    return pl.pallas_call(
        functools.partial(_grid_kernel, page_size=ps, n_blocks=n_blocks, scale=d ** -0.5), grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype), interpret=interpret, name="paged_attention_grid",
        **params,
    )(layer, tables.reshape(-1), reach.reshape(-1), qg, limits, k_pages, v_pages)


# ----------------------------------------------------------------------------------------------
# loop layout: each program walks its block's pages (GPU/Triton, interpret mode)
# ----------------------------------------------------------------------------------------------


def _loop_kernel(layer_ref, tables_ref, reach_ref, q_ref, limit_ref, k_ref, v_ref, o_ref, *, page_size: int,
                 scale: float):
    layer, limit = layer_ref[0], limit_ref[...]
    q = q_ref[...]  # [R, D]

    def body(j, carry):
        page = tables_ref[j]
        return _page_step(q, k_ref[layer, page, :, :], v_ref[layer, page, :, :], j * page_size, limit, carry,
                          scale)

    _, denom, acc = jax.lax.fori_loop(0, reach_ref[0], body, _init(*q.shape))
    o_ref[...] = _finish(denom, acc, o_ref.dtype)


def _loop(qg, k_pages, v_pages, tables, limits, reach, layer, rows: int, interpret: bool):
    b, kvh, mp, d = qg.shape
    n_layers, p, _, _, ps = k_pages.shape
    block = pl.BlockSpec((None, None, rows, d), lambda r, h, i: (r, h, i, 0))
    params = {}
    if not interpret and jax.default_backend() == "gpu":
        from jax.experimental.pallas import triton as plgpu

        params = {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=2)}
    return pl.pallas_call(
        functools.partial(_loop_kernel, page_size=ps, scale=d ** -0.5), grid=(b, kvh, mp // rows),
        in_specs=[pl.BlockSpec((1,), lambda r, h, i: (0,)),
                  pl.BlockSpec((None, tables.shape[1]), lambda r, h, i: (r, 0)),
                  pl.BlockSpec((None, 1), lambda r, h, i: (r, i)),
                  block,
                  pl.BlockSpec((None, rows, 1), lambda r, h, i: (r, i, 0)),
                  pl.BlockSpec((n_layers, p, None, d, ps), lambda r, h, i: (0, 0, h, 0, 0)),
                  pl.BlockSpec((n_layers, p, None, ps, d), lambda r, h, i: (0, 0, h, 0, 0))],
        out_specs=block, out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype), interpret=interpret,
        name="paged_attention_loop", **params,
    )(layer, tables, reach, qg, limits, k_pages, v_pages)
