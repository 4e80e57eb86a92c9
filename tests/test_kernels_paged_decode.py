"""The Pallas paged decode kernel (interpret mode on this CPU): both layouts equal the gathered dense
reference on drawn page tables (pages shared between rows, ragged lengths, partly used last pages, the null
page in unused slots). The sampler with the kernel selected: tests/test_kernels_paged_attention.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.kernels.paged_decode import paged_decode_attention
from retrojax.kernels.reference import paged_decode_reference

L, P, KVH, G, D, PS, B, W = 2, 9, 2, 2, 16, 4, 3, 4  # one compiled shape per (layout, dtype)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _pool(dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, KVH * G, D)), dtype)
    k = jnp.asarray(rng.normal(size=(L, P, KVH, D, PS)), dtype)
    v = jnp.asarray(rng.normal(size=(L, P, KVH, PS, D)), dtype)
    return q, k, v


POOLS = {dtype: _pool(dtype) for dtype in TOL}
KERNELS = {(layout, dtype): jax.jit(lambda q, k, v, t, n, layer, layout=layout: paged_decode_attention(
    q, k, v, t, n, layer=layer, layout=layout)) for layout in ("grid", "loop") for dtype in TOL}
REFERENCE = jax.jit(paged_decode_reference, static_argnums=5)


@st.composite
def page_tables(draw) -> tuple[np.ndarray, np.ndarray]:
    """Per row a length in [0, W·PS] and its used pages drawn from 1..P-1 (rows may share pages; a row may
    list one page twice), the null page 0 after them."""
    lengths = np.array([draw(st.integers(0, W * PS)) for _ in range(B)], np.int32)
    tables = np.zeros((B, W), np.int32)
    for r, n in enumerate(lengths):
        used = -(-int(n) // PS)
        tables[r, :used] = draw(st.lists(st.integers(1, P - 1), min_size=used, max_size=used))
    return tables, lengths


@settings(max_examples=12, deadline=None)
@given(drawn=page_tables(), layer=st.integers(0, L - 1), layout=st.sampled_from(["grid", "loop"]),
       dtype=st.sampled_from(list(TOL)))
def test_kernel_equals_reference(drawn, layer, layout, dtype):
    tables, lengths = map(jnp.asarray, drawn)
    q, k, v = POOLS[dtype]
    got = KERNELS[layout, dtype](q, k, v, tables, lengths, jnp.int32(layer))
    want = REFERENCE(q, k, v, tables, lengths, layer)
    assert got.dtype == dtype and got.shape == q.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0)
    assert not got[np.asarray(lengths) == 0].any()  # a row that sees nothing gets zeros


def test_kernel_reads_only_used_pages():
    """Pages past a row's length are never read and the keys past it on its last page are masked: poisoning
    them with NaN changes nothing (values there are stale but finite in a pool: a zero weight keeps them
    out); a bad layout is refused."""
    q, k, v = POOLS[jnp.float32]
    tables = jnp.asarray([[1, 2, 3, 0], [4, 0, 0, 0], [1, 2, 5, 6]], jnp.int32)
    lengths = jnp.asarray([9, 4, 16], jnp.int32)
    k_bad = k.at[:, 3, :, :, 1:].set(jnp.nan).at[:, 7:].set(jnp.nan).at[:, 0].set(jnp.nan)
    v_bad = v.at[:, 7:].set(jnp.nan).at[:, 0].set(jnp.nan)
    want = REFERENCE(q, k, v, tables, lengths, 1)
    for layout in ("grid", "loop"):
        got = KERNELS[layout, jnp.float32](q, k_bad, v_bad, tables, lengths, jnp.int32(1))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="layout"):
        paged_decode_attention(q, k, v, tables, lengths, layout="rows")
