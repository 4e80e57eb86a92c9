"""The Pallas paged attention kernel for T tokens a row (interpret mode on this CPU): both layouts equal the
gathered dense reference on drawn page tables (pages shared between rows, ragged starts and window caps,
partly used last pages, the null page after the used ones, T not a multiple of the page size, several row
blocks), a NaN in any slot no query sees changes nothing, and the sampler with the kernels selected
(prefill, decode, rewind, append) gives the default path's greedy tokens and log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import retrojax.kernels as kernels
from retrojax.kernels.paged_attention import paged_attention
from retrojax.kernels.paged_decode import paged_decode_attention
from retrojax.kernels.reference import paged_attention_reference
from retrojax.model.qwen3 import Qwen3, Qwen3Config, attention_kind
from retrojax.sampler import Sampler

L, P, KVH, G, D, PS, B, W, T = 2, 9, 2, 2, 16, 4, 3, 4, 10  # one compiled shape per (layout, dtype)
BLOCK_ROWS = {"grid": 8, "loop": 16}  # T·G = 20 query rows a kv head: 3 and 2 row blocks
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _pool(dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, KVH * G, D)), dtype)
    k = jnp.asarray(rng.normal(size=(L, P, KVH, D, PS)), dtype)
    v = jnp.asarray(rng.normal(size=(L, P, KVH, PS, D)), dtype)
    return q, k, v


POOLS = {dtype: _pool(dtype) for dtype in TOL}
KERNELS = {(layout, dtype): jax.jit(lambda q, k, v, t, s, n, layer, layout=layout: paged_attention(
    q, k, v, t, s, n, layer=layer, layout=layout, block_rows=BLOCK_ROWS[layout]))
    for layout in BLOCK_ROWS for dtype in TOL}
REFERENCE = jax.jit(paged_attention_reference, static_argnums=6)


@st.composite
def page_tables(draw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row a start and a window cap in [0, W·PS] (tokens past the cap see the whole window), its used
    pages (up to the last slot a token sees) drawn from 1..P-1 (rows may share pages; a row may list one page
    twice), the null page 0 after them."""
    starts = np.array([draw(st.integers(0, W * PS)) for _ in range(B)], np.int32)
    lengths = np.array([draw(st.integers(0, W * PS)) for _ in range(B)], np.int32)
    tables = np.zeros((B, W), np.int32)
    for r in range(B):
        used = -(-min(int(starts[r]) + T, int(lengths[r])) // PS)
        tables[r, :used] = draw(st.lists(st.integers(1, P - 1), min_size=used, max_size=used))
    return tables, starts, lengths


@settings(max_examples=12, deadline=None)
@given(drawn=page_tables(), layer=st.integers(0, L - 1), layout=st.sampled_from(list(BLOCK_ROWS)),
       dtype=st.sampled_from(list(TOL)))
def test_kernel_equals_reference(drawn, layer, layout, dtype):
    tables, starts, lengths = map(jnp.asarray, drawn)
    q, k, v = POOLS[dtype]
    got = KERNELS[layout, dtype](q, k, v, tables, starts, lengths, jnp.int32(layer))
    want = REFERENCE(q, k, v, tables, starts, lengths, layer)
    assert got.dtype == dtype and got.shape == q.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0)
    assert not got[np.asarray(lengths) == 0].any()  # a row that sees nothing gets zeros


def test_kernel_reads_only_used_pages():
    """Pages past the last slot a row's tokens see are never read and the keys no token sees on its last
    page are masked: poisoning them with NaN changes nothing (values there are stale but finite in a pool: a
    zero weight keeps them out); decode is the one-token case; a bad layout is refused."""
    q, k, v = POOLS[jnp.float32]
    tables = jnp.asarray([[1, 2, 3, 7], [4, 0, 0, 0], [1, 2, 5, 6]], jnp.int32)
    starts = jnp.asarray([0, 0, 9], jnp.int32)  # sees slots < 10, < 3 (cap), all 16 (tokens past the cap)
    lengths = jnp.asarray([16, 3, 16], jnp.int32)
    k_bad = k.at[:, 3, :, :, 2:].set(jnp.nan).at[:, 4, :, :, 3:].set(jnp.nan).at[:, 7:].set(jnp.nan)
    k_bad, v_bad = k_bad.at[:, 0].set(jnp.nan), v.at[:, 7:].set(jnp.nan).at[:, 0].set(jnp.nan)
    want = REFERENCE(q, k, v, tables, starts, lengths, 1)
    for layout in BLOCK_ROWS:
        got = KERNELS[layout, jnp.float32](q, k_bad, v_bad, tables, starts, lengths, jnp.int32(1))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    one = paged_decode_attention(q[:, 0], k, v, tables, starts + 1, layer=1, layout="grid")
    np.testing.assert_allclose(np.asarray(one), np.asarray(want[:, 0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="layout"):
        paged_attention(q, k, v, tables, starts, lengths, layout="rows")


CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def _run(attention: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two rows with a shared prompt page: prefill, greedy decode, a rewind of one row into its prompt's last
    page, an append to both, a second decode."""
    model = Qwen3(CFG, rngs=nnx.Rngs(5))
    model.attention = attention
    sampler = Sampler(model, rows=2, max_len=32, chunk_buckets=(16,), min_window=32, kv="paged", page_size=8)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, CFG.vocab_size, 9).tolist()
    sampler.append([0, 1], [prompt, prompt + rng.integers(0, CFG.vocab_size, 4).tolist()])
    outs = sampler.generate([0, 1], 5, temperature=0.0)
    sampler.rewind(1, 11)
    sampler.append([0, 1], [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 6)])
    outs += sampler.generate([0, 1], 4, temperature=0.0)
    return [(o.ids, o.logprobs) for o in outs]


def test_sampler_with_the_kernels_equals_default(monkeypatch):
    """``model.attention: pallas`` selects the kernels for paged prefill/append and decode (interpret mode
    here; ``auto`` keeps the gathered XLA path on this CPU); the tokens and log-probs are the default
    path's."""
    for path in ("paged_prefill", "paged_decode"):
        assert attention_kind("auto", path) == "xla" and attention_kind("pallas", path) == "pallas"
    calls: dict[str, list[tuple[int, ...]]] = {"prefill": [], "decode": []}

    def spy(name, kernel):
        def run(*args, **kw):
            calls[name].append(args[0].shape)
            return kernel(*args, **kw)
        return run

    monkeypatch.setattr(kernels, "paged_attention", spy("prefill", paged_attention))
    monkeypatch.setattr(kernels, "paged_decode_attention", spy("decode", paged_decode_attention))
    base = _run("auto")
    assert not calls["prefill"] and not calls["decode"]
    got = _run("pallas")
    assert calls["prefill"] and all(len(shape) == 4 and shape[1] > 1 for shape in calls["prefill"])
    assert calls["decode"] and all(shape[0] == 2 for shape in calls["decode"])
    for (ids, lp), (ids0, lp0) in zip(got, base, strict=True):
        np.testing.assert_array_equal(ids, ids0)
        np.testing.assert_allclose(lp, lp0, atol=1e-5, rtol=0)
