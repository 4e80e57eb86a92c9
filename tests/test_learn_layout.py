"""Token-forest layout: random prefix trees pack, unpack and score like each sequence alone (hypothesis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrojax.learn.layout import (
    Trained,
    common_prefix,
    pack,
    row_capacity,
    row_lengths,
    terms_width,
    unique_tokens,
    unpack_logprobs,
)
from retrojax.model import Qwen3, Qwen3Config, qwen3, token_logprobs
from retrojax.model.qwen3 import tree_attention_mask

MICRO = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256)
LENGTHS = (32, 64)
BUDGET = 256  # tokens per microbatch: one row of at most 256
BLOCK = 16  # the tree attention's block here, so rows of up to 256 run the block-sparse path


@pytest.fixture(autouse=True)
def small_tree_blocks(monkeypatch):
    monkeypatch.setattr(qwen3, "TREE_BLOCK", BLOCK)
    monkeypatch.setattr(qwen3, "TREE_SPARSE_FROM", 2 * BLOCK)  # long rows (up to 256) run block-sparse


@st.composite
def prefix_trees(draw, max_items: int = 10):
    """Sequences that branch off each other at random depths (small vocab: coincidental sharing too)."""
    vocab = draw(st.sampled_from([3, 64]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    n = draw(st.integers(1, max_items))
    seqs: list[np.ndarray] = []
    for _ in range(n):
        if seqs and rng.random() < 0.8:
            base = seqs[int(rng.integers(len(seqs)))]
            base = base[: int(rng.integers(0, base.size + 1))]
        else:
            base = np.zeros(0, np.int32)
        extra = int(rng.integers(max(0, 2 - base.size), 25))
        s = np.concatenate([base, rng.integers(0, vocab, extra).astype(np.int32)])[:LENGTHS[-1] + 1]
        seqs.append(s)
    items = []
    for s in seqs:
        index = np.flatnonzero(rng.random(s.size - 1) < 0.5) + 1
        items.append(Trained(s, index, {"w": rng.random(index.size).astype(np.float32)}))
    return items


_MODEL: list[Qwen3] = []


def _model() -> Qwen3:
    if not _MODEL:
        _MODEL.append(Qwen3(MICRO, rngs=nnx.Rngs(0)))
    return _MODEL[0]


_score = jax.jit(lambda params, graphdef, batch: token_logprobs(
    nnx.merge(graphdef, params), batch["input_ids"], batch["targets"], positions=batch["positions"],
    tree_exit=batch["tree_exit"], target_nodes=batch["term_node"], chunk=16), static_argnums=1)


def _alone(model, items):
    """Each item's trained-token log-probs from its own right-padded row (the rows layout)."""
    width = LENGTHS[-1]
    ids = np.zeros((16, width), np.int32)
    tgt = np.zeros((16, width), np.int32)
    am = np.zeros((16, width), bool)
    out = []
    for lo in range(0, len(items), 16):
        ids[:], tgt[:], am[:] = 0, 0, False
        part = items[lo:lo + 16]
        for r, it in enumerate(part):
            n = it.tokens.size - 1
            ids[r, :n], tgt[r, :n], am[r, :n] = it.tokens[:-1], it.tokens[1:], True
        lp = np.asarray(_rows(nnx.state(model), nnx.graphdef(model), ids, tgt, am))
        out += [lp[r, it.index - 1] for r, it in enumerate(part)]
    return out


_rows = jax.jit(lambda params, graphdef, ids, tgt, am: token_logprobs(
    nnx.merge(graphdef, params), ids, tgt, attention_mask=am, chunk=16), static_argnums=1)


def _padded(mb, rows: int, length: int, k: int) -> dict[str, jax.Array]:
    """The microbatch grown to [rows, length] nodes and [rows, k] terms with padding (what ``pack`` pads)."""
    out = {}
    for name in ("input_ids", "positions", "tree_exit", "term_node", "targets"):
        v = mb[name]
        width = length if name in ("input_ids", "positions", "tree_exit") else k
        grown = np.zeros((rows, width), v.dtype)
        if name == "tree_exit":
            grown[:] = np.arange(1, width + 1)
        grown[: v.shape[0], : v.shape[1]] = v
        out[name] = jnp.asarray(grown)
    return out


def _node_paths(packing, items):
    """Per item, (microbatch, row, node index of each input token) as the packer placed it."""
    where = {}
    for m, group in enumerate(packing.row_groups):
        for j, r in enumerate(group):
            for item, path in r.members:
                where[id(item)] = (m, j, path)
    return [where[id(it)] for it in items]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=prefix_trees(), share=st.booleans(), long_rows=st.booleans())
def test_pack_places_every_sequence_as_a_root_path(items, share, long_rows):
    packing = pack(items, lengths=LENGTHS, max_batch_tokens=BUDGET, share=share, long_rows=long_rows)
    for (m, j, path), it in zip(_node_paths(packing, items), items, strict=True):
        mb = packing.microbatches[m]
        x = it.inputs
        assert np.array_equal(mb["input_ids"][j, path], x)
        assert np.array_equal(mb["positions"][j, path], np.arange(x.size))
        visible = np.asarray(tree_attention_mask(mb["tree_exit"][j:j + 1]))[0]
        for p in range(x.size):  # the token at depth p sees exactly the item's first p + 1 tokens
            assert set(np.flatnonzero(visible[path[p]])) == set(path[: p + 1].tolist())
    for mb in packing.microbatches:
        rows, length = mb["input_ids"].shape
        if long_rows:
            assert rows == 1 and length in row_lengths(LENGTHS, BUDGET)
            assert length <= row_capacity(LENGTHS, BUDGET)
        else:
            assert rows & (rows - 1) == 0 and length in LENGTHS and rows * length <= max(BUDGET, length)
        assert mb["term_node"].shape[1] in {max(1, length >> j) for j in range(4)}
    assert packing.terms == sum(it.index.size for it in items)
    if share:  # one tree per row: never more positions than the sequences' own, never fewer than distinct
        assert unique_tokens(items) <= packing.nodes <= sum(it.inputs.size for it in items)
    else:
        assert packing.nodes == sum(it.inputs.size for it in items)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=prefix_trees(), share=st.booleans(), long_rows=st.booleans())
def test_packed_trees_score_like_each_sequence_alone(items, share, long_rows):
    model = _model()
    packing = pack(items, lengths=LENGTHS, max_batch_tokens=BUDGET, share=share, long_rows=long_rows)
    shape = (1, BUDGET) if long_rows else (4, LENGTHS[-1])  # one compile per kind of row
    lps = []
    for mb in packing.microbatches:  # padded to one shape: one compile for every example
        rows, k = mb["term_node"].shape
        lp = _score(nnx.state(model), nnx.graphdef(model), _padded(mb, *shape, shape[1]))
        lps.append(np.asarray(lp)[:rows, :k])
    got = unpack_logprobs(packing, lps, items)
    want = _alone(model, items)
    for g, w, it in zip(got, want, items, strict=True):
        assert g.shape == (it.index.size,)
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    # the values travel with their terms
    for (m, j, _), it, in zip(_node_paths(packing, items), items, strict=True):
        mb = packing.microbatches[m]
        row_w = mb["w"][j]
        assert np.isin(it.values["w"], row_w).all()


def test_shared_prompt_is_laid_out_once():
    prompt = np.arange(40, dtype=np.int32) % 60
    items = [Trained(np.concatenate([prompt, [61, 62, t]]), np.array([41, 42]), {"w": np.ones(2, np.float32)})
             for t in (1, 2, 3)]
    tree = pack(items, lengths=(64,), max_batch_tokens=64, share=True)
    flat = pack(items, lengths=(64, 128), max_batch_tokens=128, share=False)
    assert tree.nodes == 42 and unique_tokens(items) == 42  # the three inputs are identical: one chain
    assert tree.terms == 6 and flat.nodes == 3 * 42
    assert common_prefix(items[0].tokens, items[1].tokens) == 42


def test_bad_items_are_refused():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        Trained(np.array([1]), np.zeros(0), {})
    with pytest.raises(ValueError, match="trained indices"):
        Trained(np.array([1, 2, 3]), np.array([0]), {})
    with pytest.raises(ValueError, match="does not fit"):
        pack([Trained(np.arange(70), np.array([5]), {"w": np.ones(1)})], lengths=(64,), max_batch_tokens=64)
    assert terms_width(9, 64) == 16 and terms_width(64, 64) == 64
    assert terms_width(3, 64) == 16  # K never below L/4: fewer programs for a negligible LM-head cost
