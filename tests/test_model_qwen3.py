"""Qwen3 forward paths agree: cached chunks, padding masks, chunked log-probs; config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from retrojax.model import PRESETS, Qwen3, Qwen3Config, count_params, init_cache, token_logprobs


@pytest.fixture(scope="module")
def tiny():
    return Qwen3(PRESETS["tiny"], rngs=nnx.Rngs(3))


@nnx.jit
def fwd(model, ids, positions=None, mask=None):
    return model(ids, positions, mask)


def _ids(b, t, seed=0, vocab=1000):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, (b, t)), jnp.int32)


def test_cached_chunks_equal_plain_forward(tiny):
    """Rows at different offsets, fed in uneven chunks, reproduce the plain forward's logits."""
    lengths = [12, 7]
    ids = _ids(2, 12, seed=1)
    ref = [np.asarray(fwd(tiny, ids[b:b + 1, :n]))[0] for b, n in enumerate(lengths)]
    cache = init_cache(tiny.config, 2, 16)
    done = [0, 0]
    got = [[], []]
    step = jax.jit(lambda ids, pos, cache, ws: tiny.hidden_cached(ids, pos, cache, ws))
    for chunk in (4, 1, 4, 4):  # two distinct shapes -> two compiles
        write = []
        for b in range(2):
            write.append(done[b] if done[b] < lengths[b] else 16)  # finished rows: write_start == S
        tok = np.zeros((2, chunk), np.int32)
        pos = np.zeros((2, chunk), np.int32)
        for b in range(2):
            n = min(chunk, lengths[b] - done[b])
            tok[b, :n] = np.asarray(ids[b, done[b]:done[b] + n])
            pos[b] = done[b] + np.arange(chunk)
        before = cache
        h, cache = step(jnp.asarray(tok), jnp.asarray(pos), cache, jnp.asarray(write, jnp.int32))
        logits = np.asarray(tiny.project(h))
        for b in range(2):
            n = min(chunk, lengths[b] - done[b])
            if n <= 0:
                np.testing.assert_array_equal(np.asarray(cache.k[:, b]), np.asarray(before.k[:, b]))
                continue
            got[b].append(logits[b, :n])
            done[b] += n
    for b in range(2):
        np.testing.assert_allclose(np.concatenate(got[b]), ref[b], atol=2e-5)


def test_padding_masks_match_unpadded(tiny):
    ids = _ids(1, 6, seed=2)
    ref = np.asarray(fwd(tiny, ids))[0]
    pad = jnp.zeros((1, 3), jnp.int32)
    left = jnp.concatenate([pad, ids], 1)
    right = jnp.concatenate([ids, pad], 1)
    mask_l = jnp.asarray([[0, 0, 0] + [1] * 6])
    mask_r = jnp.asarray([[1] * 6 + [0, 0, 0]])
    both = fwd(tiny, jnp.concatenate([left, right]), mask=jnp.concatenate([mask_l, mask_r]))
    out_l, out_r = np.asarray(both[0, 3:]), np.asarray(both[1, :6])
    assert np.isfinite(np.asarray(both)).all()
    np.testing.assert_allclose(out_l, ref, atol=2e-5)
    np.testing.assert_allclose(out_r, ref, atol=2e-5)
    # explicit positions override the default ones (a uniform shift is invisible to RoPE; a gap is not)
    uniform = np.asarray(fwd(tiny, ids, jnp.arange(6)[None] + 5))[0]
    np.testing.assert_allclose(uniform, ref, atol=2e-5)
    gapped = np.asarray(fwd(tiny, ids, jnp.asarray([[0, 1, 2, 9, 10, 11]])))[0]
    np.testing.assert_allclose(gapped[:3], ref[:3], atol=2e-5)
    assert np.abs(gapped[3:] - ref[3:]).max() > 1e-4


def test_token_logprobs_chunked_matches_full_and_grads(tiny):
    ids = _ids(2, 11, seed=4)
    inp, tgt = ids[:, :-1], ids[:, 1:]
    mask = jnp.asarray([[1] * 10, [0, 0] + [1] * 8])

    def full(model):
        logits = model(inp, attention_mask=mask)
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tgt[..., None], -1)[..., 0]

    ref = nnx.jit(full)(tiny)
    lp = nnx.jit(lambda m: token_logprobs(m, inp, tgt, attention_mask=mask, chunk=3))(tiny)
    assert lp.shape == (2, 10) and lp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref), atol=1e-5)

    weights = jnp.asarray(mask, jnp.float32)
    rematted = nnx.merge(*nnx.split(tiny))  # same weights; remat changes memory, never values
    rematted.remat = True
    g_ref = nnx.jit(nnx.grad(lambda m: (full(m) * weights).sum()))(rematted)
    chunked = lambda m: (token_logprobs(m, inp, tgt, attention_mask=mask, chunk=4) * weights).sum()
    g = nnx.jit(nnx.grad(chunked))(tiny)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_blocked_attention_is_exact():
    from retrojax.model.qwen3 import attend

    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (2, 10, 4, 8))
    k = jax.random.normal(kk, (2, 12, 2, 8))
    v = jax.random.normal(kv, (2, 12, 2, 8))
    mask = jax.random.bernoulli(jax.random.key(6), 0.7, (2, 10, 12))

    def loss(q, k, v, q_block):
        return (attend(q, k, v, mask, q_block) ** 2).sum()

    dense = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, 64)
    blocked = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, 3)
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(blocked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    out4, out = attend(q, k, v, mask, 4), attend(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(out4), np.asarray(out), atol=1e-6)


def test_causal_blocks_cut_keys_exactly(monkeypatch):
    """With a causal (and key-padding) mask, blocks that attend only to keys up to their last row give the
    same values and gradients as full attention."""
    from retrojax.model import qwen3

    monkeypatch.setattr(qwen3, "CAUSAL_Q_BLOCK", 4)
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    t = 11
    q = jax.random.normal(kq, (2, t, 4, 8))
    k = jax.random.normal(kk, (2, t, 2, 8))
    v = jax.random.normal(kv, (2, t, 2, 8))
    pad = jnp.arange(t)[None, :] < jnp.array([[t], [7]])
    mask = jnp.tril(jnp.ones((t, t), bool))[None] & pad[:, None, :]

    def loss(q, k, v, causal):
        return (qwen3.attend(q, k, v, mask, causal=causal) ** 2).sum()

    full = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, False)
    cut = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, True)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(cut), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_bf16_params_fp32_logits():
    cfg = PRESETS["tiny"]
    ids = _ids(1, 5)
    m32 = Qwen3(cfg)
    m16 = Qwen3(cfg, dtype=jnp.bfloat16)
    assert m16.embed[...].dtype == jnp.bfloat16
    out16 = fwd(m16, ids)
    assert out16.dtype == jnp.float32
    assert np.abs(np.asarray(out16) - np.asarray(fwd(m32, ids))).max() < 0.05



def test_preset_param_counts():
    counts = {k: count_params(PRESETS[k]) / 1e9 for k in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")}
    assert round(counts["qwen3-0.6b"], 3) == 0.596
    assert round(counts["qwen3-1.7b"], 3) == 1.721
    assert round(counts["qwen3-4b"], 3) == 4.022
    assert round(counts["qwen3-8b"], 2) == 8.19
    assert count_params(PRESETS["tiny"]) < 200_000


BASE = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "model_type": "qwen3"}


def test_config_layouts_and_roundtrip():
    v4 = Qwen3Config.from_hf_dict({**BASE, "rope_theta": 5e6, "rope_scaling": None})
    v5 = Qwen3Config.from_hf_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}})
    assert v4 == v5 and v4.rope_theta == 5e6
    assert Qwen3Config.from_hf_dict(v4.to_hf_dict()) == v4
    assert Qwen3Config.from_hf_dict({**BASE, "head_dim": 128}).head_dim == 128  # explicit, not hidden/heads


@pytest.mark.parametrize("bad, match", [
    ({"use_sliding_window": True}, "sliding"),
    ({"layer_types": ["sliding_attention"]}, "sliding"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "linear"),
    ({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}}, "disagrees"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"model_type": "llama"}, "llama"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"head_dim": 7}, "even"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_config_rejects_unsupported(bad, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf_dict({**BASE, **bad})


def test_config_missing_field_and_bad_json(tmp_path):
    d = dict(BASE)
    del d["num_hidden_layers"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        Qwen3Config.from_hf_dict(d)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Qwen3Config.from_json(tmp_path)
    with pytest.raises(FileNotFoundError):
        Qwen3Config.from_json(tmp_path / "nope")


def test_bad_input_shapes(tiny):
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        tiny(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        tiny(jnp.zeros((1, 4), jnp.int32), attention_mask=jnp.ones((1, 5)))
    with pytest.raises(ValueError, match="cache"):
        tiny.hidden_cached(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                           init_cache(tiny.config, 3, 8), jnp.zeros((1,), jnp.int32))
