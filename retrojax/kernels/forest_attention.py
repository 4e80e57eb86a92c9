"""Flash attention over a DFS-ordered token forest, in Pallas: forward and backward (``jax.custom_vjp``).

The mask is one int32 per token: key j is visible to query i iff ``j <= i < tree_exit[j]`` (key j's subtree
is the index interval ``[j, tree_exit[j])``; see ``retrojax.model.qwen3.tree_block_mask``). A causal row is
the case ``tree_exit[j] = row end``, packed sequences ``tree_exit[j] = end of j's sequence``, a padding key
that nobody sees ``tree_exit[j] = j``: the ``rows`` and ``packed`` layouts run this same kernel.

Blocks. The row is cut into query blocks of ``block_q`` and key blocks of ``block_k`` tokens (powers of two,
at least 16). A key block's smallest and largest ``tree_exit`` classify it against a query block
``[q0, q1)``: *skipped* when it lies after the block or no key's subtree reaches ``q0``; *full* (no mask)
when every key precedes ``q0`` and every subtree covers ``q1 - 1``; *masked* otherwise. The forward and dQ
kernels walk, per query block, a compacted list of the visited key blocks (full ones first, then masked
ones; built by XLA outside the kernel from the block min/max), so work follows the ancestor pairs, not the
causal triangle. The dK/dV kernel walks, per key block, the contiguous query range that can see it,
``[k0, max tree_exit)``, split at the block's min/max into masked, full and masked segments.

Numerics: float32 scores and accumulators, online softmax; the forward saves each query's log-sum-exp and
the backward recomputes probabilities from it (FlashAttention-2). float32 inputs multiply at full precision
(``Precision.HIGHEST``: IEEE on Triton, no TF32); bfloat16 inputs feed the matrix units as they are. A query
that sees no key gets zeros. GQA: query head n reads kv head n // G through the K/V ``index_map``; the dK/dV
kernel runs per kv head and loops over its G query heads, so K/V are never repeated in memory.

Backends. On GPU it lowers through Pallas' Triton backend: the grid is (blocks, batch, heads), each program
holds one [block, head_dim] tile of Q (or K/V) and walks the whole-row K/V (or Q) refs with dynamic
``pl.ds`` slices in ``fori_loop``s of dynamic length, the visit lists are read with scalar loads, and every
product is a 2-D ``dot_general`` (the same patterns as JAX's own Triton attention). On CPU it runs in
interpret mode (``interpret=True``; tests and ``retrojax bench device --quick``). TPU (Mosaic): the block
math — 2-D ``dot_general``, ``exp``, ``max``/``sum`` reductions, iota comparisons and ``where`` — lowers as
written; the data movement does not: Mosaic wants the visit lists in SMEM through scalar prefetch
(``PrefetchScalarGridSpec``) with the key loop moved into the grid (as splash attention does), 2-D blocks
for ``tree_exit`` and the log-sum-exp (1-D int/float blocks are Triton-only here), and whole-row K/V blocks
do not fit VMEM at 16k tokens. Until that port exists ``model.attention: auto`` picks this kernel on GPU and
on TPU; set ``model.attention: xla`` on a TPU where it does not lower.

Device command: ``retrojax bench device --json device.json`` (``retrojax/bench/device.py``) times this
kernel against the XLA loop and the dense blocks; its ``--quick`` run reports the kernel's error against
``retrojax.kernels.reference.forest_attention_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = -1e30  # finite "minus infinity": a fully masked score row stays finite
BLOCK_Q = 64  # query rows per block (forward, dQ and dK/dV)
BLOCK_K = 64  # key rows per block; the forest's sparsity is seen at this granularity


def forest_attention(q: jax.Array, k: jax.Array, v: jax.Array, tree_exit: jax.Array, *,
                     block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                     interpret: bool | None = None) -> jax.Array:
    """Attention of each token to its ancestors-or-self in a DFS-ordered forest.

    q [B, T, N, D]; k, v [B, T, KVH, D] (N a multiple of KVH); tree_exit int32 [B, T]. Returns [B, T, N, D]
    in q's dtype. Rows are padded to a multiple of the blocks (padding tokens see only themselves; their
    outputs are dropped). Blocks shrink to the row (the next power of two, at least 16) for short rows.
    ``interpret``: Pallas interpret mode (default: on the CPU backend).
    """
    b, t, n, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(f"forest_attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit")
    if tree_exit.shape != (b, t):
        raise ValueError(f"forest_attention: tree_exit {tree_exit.shape} must be {(b, t)}")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"forest_attention: {name} must be a power of two >= 16, got {size}")
    fit = max(16, pl.next_power_of_2(t))
    bq, bk = min(block_q, fit), min(block_k, fit)
    tp = -(-t // max(bq, bk)) * max(bq, bk)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    exits = jnp.asarray(tree_exit, jnp.int32)
    if tp != t:
        widths = ((0, 0), (0, tp - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        tail = jnp.broadcast_to(jnp.arange(t + 1, tp + 1, dtype=jnp.int32), (b, tp - t))
        exits = jnp.concatenate([exits, tail], axis=1)
    out = _forest(q, k, v, exits, (bq, bk, bool(interpret)))
    return out[:, :t]


# ----------------------------------------------------------------------------------------------
# Block geometry (XLA, outside the kernels)
# ----------------------------------------------------------------------------------------------


def visit_lists(exits: jax.Array, bq: int, bk: int) -> tuple[jax.Array, jax.Array]:
    """Per row and query block: the key blocks to visit, full ones first then masked ones ([B, nq, nk]
    int32, the rest of each list is padding), and the two counts ([B, nq, 2] int32: full, masked)."""
    b, tp = exits.shape
    nq, nk = tp // bq, tp // bk
    blocks = exits.reshape(b, nk, bk)
    kmin, kmax = blocks.min(-1)[:, None, :], blocks.max(-1)[:, None, :]  # [B, 1, nk]
    q0 = (jnp.arange(nq, dtype=jnp.int32) * bq)[None, :, None]  # [1, nq, 1]
    k0 = (jnp.arange(nk, dtype=jnp.int32) * bk)[None, None, :]
    visit = (k0 <= q0 + bq - 1) & (kmax > q0)
    full = visit & (k0 + bk - 1 <= q0) & (kmin >= q0 + bq)
    rank = jnp.where(full, 0, jnp.where(visit, 1, 2)).astype(jnp.int32)
    order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.stack([full.sum(-1), (visit & ~full).sum(-1)], axis=-1).astype(jnp.int32)
    return order, counts


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """2-D product contracting a's axis contract[0] with b's axis contract[1], float32 result (the one
    ``dot_general`` form Pallas' Triton lowering takes: no batch axes, either operand transposed)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _mask(q0, k0, exits, bq: int, bk: int) -> jax.Array:
    """[bq, bk] bool: query q0 + a sees key k0 + c."""
    rows = q0 + jnp.arange(bq, dtype=jnp.int32)
    cols = k0 + jnp.arange(bk, dtype=jnp.int32)
    return (cols[None, :] <= rows[:, None]) & (rows[:, None] < exits[None, :])


def _cdiv(a, b: int):
    return jax.lax.div(a + (b - 1), b)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


def _fwd_kernel(order_ref, counts_ref, exits_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, bq, bk, scale):
    q0 = pl.program_id(0) * bq
    q = q_ref[...]  # [bq, D]

    def visit(masked: bool):
        def body(i, carry):
            m, denom, acc = carry
            k0 = pl.multiple_of(order_ref[i] * bk, bk)
            keys = pl.ds(k0, bk)
            kt, vt = k_ref[keys, :], v_ref[keys, :]
            s = _dot(q, kt, (1, 1)) * scale  # [bq, bk]
            if masked:
                mask = _mask(q0, k0, exits_ref[keys], bq, bk)
                s = jnp.where(mask, s, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp(s - m_new[:, None])
            if masked:
                p = jnp.where(mask, p, 0.0)
            corr = jnp.exp(m - m_new)
            acc = acc * corr[:, None] + _dot(p.astype(vt.dtype), vt, (1, 0))
            return m_new, denom * corr + jnp.sum(p, axis=1), acc

        return body

    n_full, n_masked = counts_ref[0], counts_ref[1]
    init = (jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    carry = jax.lax.fori_loop(0, n_full, visit(False), init)
    m, denom, acc = jax.lax.fori_loop(n_full, n_full + n_masked, visit(True), carry)
    seen = denom > 0.0
    denom = jnp.where(seen, denom, 1.0)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(denom), 0.0)


def _dq_kernel(order_ref, counts_ref, exits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               bq, bk, scale):
    q0 = pl.program_id(0) * bq
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def visit(masked: bool):
        def body(i, dq):
            k0 = pl.multiple_of(order_ref[i] * bk, bk)
            keys = pl.ds(k0, bk)
            kt, vt = k_ref[keys, :], v_ref[keys, :]
            p = jnp.exp(_dot(q, kt, (1, 1)) * scale - lse[:, None])
            if masked:
                p = jnp.where(_mask(q0, k0, exits_ref[keys], bq, bk), p, 0.0)
            ds = p * (_dot(do, vt, (1, 1)) - delta[:, None])
            return dq + _dot(ds.astype(kt.dtype), kt, (1, 0))

        return body

    n_full, n_masked = counts_ref[0], counts_ref[1]
    dq = jax.lax.fori_loop(0, n_full, visit(False), jnp.zeros(q.shape, jnp.float32))
    dq = jax.lax.fori_loop(n_full, n_full + n_masked, visit(True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(exits_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                bq, bk, groups, scale):
    k0 = pl.program_id(0) * bk
    kt, vt = k_ref[...], v_ref[...]  # [bk, D]
    exits = exits_ref[...]  # [bk]
    kmin, kmax = jnp.min(exits), jnp.max(exits)
    # query blocks that see some key of this block: [k0 // bq, cdiv(kmax, bq)); fully: [f0, f1)
    lo, hi = jax.lax.div(k0, bq), _cdiv(kmax, bq)
    f0 = jnp.minimum(jnp.maximum(_cdiv(k0 + bk - 1, bq), lo), hi)
    f1 = jnp.maximum(jnp.minimum(jax.lax.div(kmin, bq), hi), f0)

    def visit(masked: bool):
        def body(j, carry):
            dk, dv = carry
            q0 = pl.multiple_of(j * bq, bq)
            rows = pl.ds(q0, bq)
            if masked:
                mask = _mask(q0, k0, exits, bq, bk)
            for g in range(groups):  # the kv head's query heads
                qt, do = q_ref[rows, g, :], do_ref[rows, g, :]  # [bq, D]
                p = jnp.exp(_dot(qt, kt, (1, 1)) * scale - lse_ref[g, rows][:, None])  # [bq, bk]
                if masked:
                    p = jnp.where(mask, p, 0.0)
                dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
                ds = p * (_dot(do, vt, (1, 1)) - delta_ref[g, rows][:, None])
                dk = dk + _dot(ds.astype(qt.dtype), qt, (0, 0))
            return dk, dv

        return body

    zeros = jnp.zeros(kt.shape, jnp.float32)
    carry = jax.lax.fori_loop(lo, f0, visit(True), (zeros, zeros))
    carry = jax.lax.fori_loop(f0, f1, visit(False), carry)
    dk, dv = jax.lax.fori_loop(f1, hi, visit(True), carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers and the custom VJP
# ----------------------------------------------------------------------------------------------


def _params(interpret: bool) -> dict:
    """Triton launch parameters on GPU; nothing elsewhere (interpret mode, Mosaic)."""
    if interpret or jax.default_backend() != "gpu":
        return {}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=2)}


def _forward(q, k, v, exits, cfg):
    bq, bk, interpret = cfg
    b, tp, n, d = q.shape
    g = n // k.shape[2]
    nq = tp // bq
    order, counts = visit_lists(exits, bq, bk)
    kernel = functools.partial(_fwd_kernel, bq=bq, bk=bk, scale=d ** -0.5)
    row = pl.BlockSpec((None, tp, None, d), lambda i, r, h: (r, 0, h // g, 0))
    o, lse = pl.pallas_call(
        kernel, grid=(nq, b, n),
        in_specs=[pl.BlockSpec((None, None, order.shape[-1]), lambda i, r, h: (r, i, 0)),
                  pl.BlockSpec((None, None, 2), lambda i, r, h: (r, i, 0)),
                  pl.BlockSpec((None, tp), lambda i, r, h: (r, 0)),
                  pl.BlockSpec((None, bq, None, d), lambda i, r, h: (r, i, h, 0)), row, row],
        out_specs=[pl.BlockSpec((None, bq, None, d), lambda i, r, h: (r, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, r, h: (r, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, tp), jnp.float32)],
        interpret=interpret, name="forest_attention_fwd", **_params(interpret),
    )(order, counts, exits, q, k, v)
    return o, lse, order, counts


def _backward(q, k, v, exits, o, lse, order, counts, do, cfg):
    bq, bk, interpret = cfg
    b, tp, n, d = q.shape
    kvh = k.shape[2]
    g = n // kvh
    scale = d ** -0.5
    delta = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)
    row = pl.BlockSpec((None, tp, None, d), lambda i, r, h: (r, 0, h // g, 0))
    qblock = pl.BlockSpec((None, bq, None, d), lambda i, r, h: (r, i, h, 0))
    per_query = pl.BlockSpec((None, None, bq), lambda i, r, h: (r, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, scale=scale), grid=(tp // bq, b, n),
        in_specs=[pl.BlockSpec((None, None, order.shape[-1]), lambda i, r, h: (r, i, 0)),
                  pl.BlockSpec((None, None, 2), lambda i, r, h: (r, i, 0)),
                  pl.BlockSpec((None, tp), lambda i, r, h: (r, 0)),
                  qblock, row, row, qblock, per_query, per_query],
        out_specs=qblock, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret, name="forest_attention_dq", **_params(interpret),
    )(order, counts, exits, q, k, v, do, lse, delta)
    kblock = pl.BlockSpec((None, bk, None, d), lambda j, r, h: (r, j, h, 0))
    group_rows = pl.BlockSpec((None, tp, g, d), lambda j, r, h: (r, 0, h, 0))
    group_lse = pl.BlockSpec((None, g, tp), lambda j, r, h: (r, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, groups=g, scale=scale), grid=(tp // bk, b, kvh),
        in_specs=[pl.BlockSpec((None, bk), lambda j, r, h: (r, j)), kblock, kblock, group_rows, group_rows,
                  group_lse, group_lse],
        out_specs=[kblock, kblock],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret, name="forest_attention_dkv", **_params(interpret),
    )(exits, k, v, q, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _forest(q, k, v, exits, cfg):
    return _forward(q, k, v, exits, cfg)[0]


def _forest_fwd(q, k, v, exits, cfg):
    o, lse, order, counts = _forward(q, k, v, exits, cfg)
    return o, (q, k, v, exits, o, lse, order, counts)


def _forest_bwd(cfg, res, do):
    q, k, v, exits, o, lse, order, counts = res
    dq, dk, dv = _backward(q, k, v, exits, o, lse, order, counts, do, cfg)
    return dq, dk, dv, None


_forest.defvjp(_forest_fwd, _forest_bwd)
