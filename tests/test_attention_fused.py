"""``model.attention: fused`` (jax.nn.dot_product_attention, XLA's implementation on this CPU) equals the
einsum path for the learner's ``rows`` and ``packed`` layouts, prefill and decode; the sampler's layer-scan
decode without weight copies (``sampler.layer_copies: false``) equals the copies path, and the plan's bytes
drop by the copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import retrojax.model.qwen3 as q3
from retrojax import config
from retrojax.model.qwen3 import Qwen3, Qwen3Config, attention_kind, token_logprobs, use_layer_copies
from retrojax.plan.bound import inference_resident_bytes, layer_param_count, train_resident_bytes
from retrojax.sampler import Sampler

CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
T = 24  # with CAUSAL_Q_BLOCK = 16 below, the fused path's XLA query blocks (16 + 8 rows) run too


def _rows_batch() -> dict[str, jax.Array]:
    """Two right-padded rows (``learn.layout: rows``)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (2, T)).astype(np.int32)
    mask = np.arange(T)[None] < np.array([[T], [13]])
    return {"input_ids": jnp.asarray(ids), "targets": jnp.asarray(np.roll(ids, -1, 1)),
            "attention_mask": jnp.asarray(mask), "weight": jnp.asarray(mask[:, :-1].astype(np.float32))}


def _packed_batch() -> dict[str, jax.Array]:
    """Two rows of packed chains (``learn.layout: packed``): ``tree_exit`` = the chain's end, positions
    restart at 0, padding tokens see only themselves; terms score some tokens, one twice."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, CFG.vocab_size, (2, T)).astype(np.int32)
    chains = [[0, 7, 15, 22], [0, 18]]  # starts of each chain; the rest of the row is padding
    exits, pos = np.tile(np.arange(1, T + 1, dtype=np.int32), (2, 1)), np.zeros((2, T), np.int32)
    for r, starts in enumerate(chains):
        for lo, hi in zip(starts[:-1], starts[1:], strict=True):
            exits[r, lo:hi], pos[r, lo:hi] = hi, np.arange(hi - lo)
    nodes = np.array([[0, 3, 5, 8, 13, 16, 20, 20], [1, 2, 9, 12, 16, 17, 17, 4]], np.int32)
    return {"input_ids": jnp.asarray(ids), "positions": jnp.asarray(pos), "tree_exit": jnp.asarray(exits),
            "term_node": jnp.asarray(nodes), "targets": jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 8))),
            "weight": jnp.ones((2, 8), jnp.float32)}


def _loss_and_grads(attention: str, batch: dict[str, jax.Array]):
    graphdef, state = nnx.split(Qwen3(CFG, rngs=nnx.Rngs(3)))

    def loss(state):
        model = nnx.merge(graphdef, state)
        model.attention = attention
        if "tree_exit" in batch:
            lp = token_logprobs(model, batch["input_ids"], batch["targets"], positions=batch["positions"],
                                tree_exit=batch["tree_exit"], target_nodes=batch["term_node"])
        else:
            lp = token_logprobs(model, batch["input_ids"], batch["targets"],
                                attention_mask=batch["attention_mask"])[:, :-1]
        return jnp.sum(lp * batch["weight"]), lp

    (_, lp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return lp * batch["weight"], grads


@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_learner_logprobs_and_gradients_match(monkeypatch, layout):
    monkeypatch.setattr(q3, "CAUSAL_Q_BLOCK", 16)
    batch = _rows_batch() if layout == "rows" else _packed_batch()
    lp_x, g_x = _loss_and_grads("xla", batch)
    lp_f, g_f = _loss_and_grads("fused", batch)
    np.testing.assert_allclose(np.asarray(lp_f), np.asarray(lp_x), atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_x), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_x)) > 1e-3  # gradients are not all zero


def _sample(attention: str, layer_copies: bool, kv: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prefill three rows of different lengths, decode greedily, append to two and decode again."""
    model = Qwen3(CFG, rngs=nnx.Rngs(5))
    model.attention = attention
    sampler = Sampler(model, rows=3, max_len=64, chunk_buckets=(16,), min_window=32, kv=kv, page_size=8,
                      layer_copies=layer_copies)
    rng = np.random.default_rng(2)
    sampler.append([0, 1, 2], [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 11, 16)])
    outs = sampler.generate([0, 1, 2], 6, temperature=0.0)
    sampler.append([0, 2], [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 9)])
    outs += sampler.generate([0, 2], 5, temperature=0.0)
    assert (sampler._layer_weights() is None) == (not layer_copies)
    return [(o.ids, o.logprobs) for o in outs]


def test_prefill_decode_fused_and_layer_scan_match_default():
    """Greedy tokens and log-probs: fused attention (paged cache) and the layer scan without copies (dense)
    equal the default path (einsum attention over per-layer copies, dense)."""
    base = _sample("xla", True, "dense")
    for attention, copies, kv in (("fused", True, "paged"), ("xla", False, "dense")):
        got = _sample(attention, copies, kv)
        for (ids, lp), (ids0, lp0) in zip(got, base, strict=True):
            np.testing.assert_array_equal(ids, ids0)
            np.testing.assert_allclose(lp, lp0, atol=1e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_selects_the_fused_attention_and_the_kernels_on_accelerators(monkeypatch, backend):
    """On GPU/TPU, ``model.attention: auto`` runs jax.nn.dot_product_attention for rows and the dense cache
    and the Pallas kernels for forests and the page pool; the decode scans stacked weights (no copies)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    paths = ("rows", "forest", "cache", "paged_decode", "paged_prefill")
    assert [attention_kind("auto", p) for p in paths] == ["fused", "pallas", "fused", "pallas", "pallas"]
    assert use_layer_copies("auto") is False


def test_settings_resolve_and_admission_drops_copies():
    assert [attention_kind("auto", p) for p in ("rows", "forest", "cache")] == ["xla"] * 3  # this CPU
    assert [attention_kind("pallas", p) for p in ("rows", "forest", "cache")] == ["pallas", "pallas", "fused"]
    assert attention_kind("fused", "forest") == "fused"
    with pytest.raises(ValueError, match="model.attention"):
        attention_kind("cudnn", "rows")
    assert use_layer_copies("auto") is True and use_layer_copies(False) is False
    with pytest.raises(ValueError, match="layer_copies"):
        use_layer_copies("sometimes")

    on = config.load(None, ["model.attention=fused", "sampler.layer_copies=true"])
    off = config.load(None, ["sampler.layer_copies=false"])
    assert on.model.attention == "fused" and off.sampler.layer_copies is False
    assert config.load(None).sampler.layer_copies == "auto"
    with pytest.raises(config.ConfigError):
        config.load(None, ["sampler.layer_copies=maybe"])
    copies = layer_param_count(q3.PRESETS[on.model.preset]) * np.dtype(on.model.dtype).itemsize
    assert copies > 0
    on_bytes, off_bytes = train_resident_bytes(on), train_resident_bytes(off)
    assert on_bytes["layer_copies"] == copies and off_bytes["layer_copies"] == 0
    assert sum(on_bytes.values()) - sum(off_bytes.values()) == copies
    assert inference_resident_bytes(CFG, "bfloat16", True)["layer_copies"] == layer_param_count(CFG) * 2
    assert inference_resident_bytes(CFG, "bfloat16", False)["layer_copies"] == 0
    assert inference_resident_bytes(CFG, "bfloat16")["layer_copies"] == layer_param_count(CFG) * 2  # auto
