"""The Pallas paged decode kernel (interpret mode on this CPU): both layouts equal the gathered dense
reference on drawn page tables (pages shared between rows, ragged lengths, partly used last pages, the null
page in unused slots), and the sampler's greedy decode with the kernel selected equals the default path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import retrojax.kernels as kernels
from retrojax.kernels.paged_decode import paged_decode_attention
from retrojax.kernels.reference import paged_decode_reference
from retrojax.model.qwen3 import Qwen3, Qwen3Config, attention_kind
from retrojax.sampler import Sampler

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


CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def _greedy(attention: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two rows with a shared prompt page, greedy decode, an append to one row and a second decode."""
    model = Qwen3(CFG, rngs=nnx.Rngs(5))
    model.attention = attention
    sampler = Sampler(model, rows=2, max_len=32, chunk_buckets=(16,), min_window=32, kv="paged", page_size=8)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, CFG.vocab_size, 9).tolist()
    sampler.append([0, 1], [prompt, prompt + rng.integers(0, CFG.vocab_size, 4).tolist()])
    outs = sampler.generate([0, 1], 5, temperature=0.0)
    sampler.append([0], [rng.integers(0, CFG.vocab_size, 3).tolist()])
    outs += sampler.generate([0, 1], 4, temperature=0.0)
    return [(o.ids, o.logprobs) for o in outs]


def test_sampler_greedy_with_the_kernel_equals_default(monkeypatch):
    """``model.attention: pallas`` selects the kernel for paged decode (interpret mode here; ``auto`` keeps
    the gathered XLA path on this CPU); the tokens and log-probs are the default path's."""
    assert attention_kind("auto", "paged_decode") == "xla"
    assert attention_kind("pallas", "paged_decode") == "pallas"
    calls = []

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return paged_decode_attention(*args, **kw)

    monkeypatch.setattr(kernels, "paged_decode_attention", spy)
    base = _greedy("auto")
    assert not calls
    got = _greedy("pallas")
    assert calls and all(shape[0] == 2 for shape in calls)  # traced for decode (one query per row)
    for (ids, lp), (ids0, lp0) in zip(got, base, strict=True):
        np.testing.assert_array_equal(ids, ids0)
        np.testing.assert_allclose(lp, lp0, atol=1e-5, rtol=0)
