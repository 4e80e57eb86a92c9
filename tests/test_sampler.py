"""The KV-cache sampler: parity with transformers and with one forward pass, rewind isolation, stops, errors.

All tests share one tiny random Qwen3 (a transformers checkpoint loaded with ``from_pretrained``) and one
cache shape, so the jitted prefill/decode compile once for the whole module.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import make_tiny_hf_checkpoint

from retrojax.model.checkpoint import from_pretrained
from retrojax.model.qwen3 import init_cache, token_logprobs
from retrojax.sampler import TRACES, CacheOverflowError, Sampler, SamplerError

ROWS, MAX_LEN, BUCKETS, MIN_WINDOW = 4, 64, (8, 32), 32  # windows 32 and 64 both get exercised


class LetterTokenizer:
    """A toy tokenizer for a 1000-id vocabulary: id i decodes to a fixed string of 1–3 letters."""

    def __init__(self, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.pieces = ["".join(rng.choice(list("abcdef"), size=rng.integers(1, 4))) for _ in range(vocab)]

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        return [p.encode() for p in self.pieces[:vocab_size]]

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("sampler"), seed=3)


@pytest.fixture(scope="module")
def model(ckpt):
    return from_pretrained(ckpt, dtype=jnp.float32)


def new_sampler(model, tokenizer=None) -> Sampler:
    return Sampler(model, rows=ROWS, max_len=MAX_LEN, chunk_buckets=BUCKETS, tokenizer=tokenizer,
                   min_window=MIN_WINDOW)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=n).astype(np.int32)


def full_logits(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids, jnp.int32)[None]))[0]


def test_greedy_equals_transformers_generate(model, ckpt):
    import torch
    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    prompts = [prompt(1, 3), prompt(2, 11), prompt(3, 6)]
    s = new_sampler(model)
    s.append([2, 0, 3], prompts)
    outs = s.generate([2, 0, 3], 12, temperature=0.0)
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.as_tensor(p[None], dtype=torch.long), max_new_tokens=12, do_sample=False,
                              min_new_tokens=12, pad_token_id=0)[0, len(p):].numpy()
        np.testing.assert_array_equal(out.ids, ref)
        assert out.finish_reason == "length" and "max_new_tokens" in out.reason


def test_multiturn_with_rewind_matches_one_forward_pass(model):
    s = new_sampler(model)
    key = jax.random.key(7)
    s.append([0, 1], [prompt(10, 9), prompt(11, 5)])
    first = s.generate([0, 1], 6, key=key)
    s.append([0, 1], [prompt(12, 4), prompt(13, 7)])
    mark = s.mark(0)
    s.generate([0, 1], 5, key=jax.random.fold_in(key, 1))
    s.append([0], [prompt(14, 3)])
    s.rewind(0, mark)                               # abandon a turn on row 0 only
    s.append([0, 1], [prompt(15, 20), prompt(16, 2)])  # 20 > bucket 8: prefilled in two calls
    last = s.generate([0, 1], 7, key=jax.random.fold_in(key, 2))
    for row in (0, 1):
        ids = s.tokens(row)
        ref = full_logits(model, ids)[-1]
        np.testing.assert_allclose(s.next_logits([row])[0], ref, atol=1e-4, rtol=0)
        # log-probs at temperature 1 are the model's log-softmax, as the learner computes them
        lp = np.asarray(token_logprobs(model, jnp.asarray(ids[None, :-1]), jnp.asarray(ids[None, 1:])))[0]
        n = last[row].ids.size
        np.testing.assert_allclose(last[row].logprobs, lp[-n:], atol=1e-4, rtol=0)
        np.testing.assert_array_equal(ids[-n:], last[row].ids)
    assert first[0].ids.size == 6 and s.length(1) == 5 + 6 + 7 + 5 + 2 + 7


def test_rewind_forgets_abandoned_turns_and_leaves_other_rows_alone(model):
    a, b = new_sampler(model), new_sampler(model)
    a.append([0, 1], [prompt(20, 6), prompt(21, 9)])
    row1_cache = (np.asarray(a.cache.k[:, 1]), np.asarray(a.cache.v[:, 1]))
    mark = a.mark(0)
    a.append([0], [prompt(22, 10)])
    a.generate([0], 9, key=jax.random.key(1))
    a.rewind(0, mark)
    a.append([0], [prompt(23, 4)])
    got = a.generate([0], 8, temperature=0.0)[0]
    # row 1 was never listed: bit-identical cache and bookkeeping
    np.testing.assert_array_equal(np.asarray(a.cache.k[:, 1]), row1_cache[0])
    np.testing.assert_array_equal(np.asarray(a.cache.v[:, 1]), row1_cache[1])
    assert a.length(1) == 9
    b.append([0], [np.concatenate([prompt(20, 6), prompt(23, 4)])])
    want = b.generate([0], 8, temperature=0.0)[0]
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.tokens(0), b.tokens(0))
    np.testing.assert_allclose(a.next_logits([0]), b.next_logits([0]), atol=1e-5)


def test_same_key_same_tokens_and_reset(model):
    s = new_sampler(model)
    s.append([0, 1], [prompt(30, 5), prompt(30, 5)])
    mark = s.mark(0)
    x = s.generate([0], 10, key=jax.random.key(5), top_k=50, top_p=0.9)[0]
    s.rewind(0, mark)
    y = s.generate([0], 10, key=jax.random.key(5), top_k=50, top_p=0.9)[0]
    np.testing.assert_array_equal(x.ids, y.ids)
    # a row's draws depend on (key, step, row) only: row 1 with the same prompt and key differs from row 0
    z = s.generate([1], 10, key=jax.random.key(5), top_k=50, top_p=0.9)[0]
    assert not np.array_equal(x.ids, z.ids)
    assert np.all(x.logprobs <= 0) and np.all(np.isfinite(x.logprobs))
    s.reset(0)
    assert s.length(0) == 0 and s.room(0) == MAX_LEN


def test_stop_token_ends_row_and_stays_in_conversation(model):
    s = new_sampler(model)
    s.append([0, 1], [prompt(40, 4), prompt(41, 4)])
    mark = s.mark(0)
    free = s.generate([0], 12, key=jax.random.key(2))[0]
    stop_id = int(free.ids[5])
    first = int(np.flatnonzero(free.ids == stop_id)[0])
    s.rewind(0, mark)
    out = s.generate([0, 1], [12, 3], key=jax.random.key(2), stop_token_ids=[stop_id])
    assert out[0].finish_reason == "stop" and out[0].stop == stop_id
    np.testing.assert_array_equal(out[0].ids, free.ids[: first + 1])
    assert s.length(0) == mark + first + 1
    assert out[1].finish_reason == "stop" or (out[1].ids.size == 3 and out[1].finish_reason == "length")
    # stop_token_ids=None takes the tokenizer's stop ids
    tok = LetterTokenizer(1000)
    tok.stop_token_ids = (stop_id,)
    s.tokenizer = tok
    s.rewind(0, mark)
    again = s.generate([0], 12, key=jax.random.key(2))[0]
    np.testing.assert_array_equal(again.ids, out[0].ids)
    assert again.text == "".join(tok.pieces[i] for i in again.ids[:-1])
    assert s.generate([], 4, temperature=0.0) == [] and s.next_logits([]).shape == (0, 1000)


def test_stop_string_split_across_tokens(model):
    tok = LetterTokenizer(1000)
    s = new_sampler(model, tokenizer=tok)
    s.append([0, 2], [prompt(50, 5), prompt(50, 5)])
    mark = s.mark(0)
    free, free2 = s.generate([0, 2], 16, key=jax.random.key(9))
    pieces = [tok.pieces[i] for i in free.ids]
    text, text2 = "".join(pieces), "".join(tok.pieces[i] for i in free2.ids)
    # stop strings made of the end of token k and the start of token k+1, absent from the earlier text;
    # prefer one that row 2's reply contains too, so row 2 ignoring it (not its stop string) means something
    candidates = [pieces[k][-1:] + pieces[k + 1][:2] for k in range(1, len(pieces) - 1)
                  if pieces[k][-1:] + pieces[k + 1][:2] not in "".join(pieces[:k + 1])]
    candidates = [c for c in candidates if len(c) >= 2]
    assert candidates, "no usable split stop string in the sampled text"
    stop = next((c for c in candidates if c in text2), candidates[0])
    s.rewind(0, mark)
    s.rewind(2, mark)
    out = s.generate([0, 2], 16, key=jax.random.key(9), stop_strings=[["zzzz", stop], ["zzzz"]])
    got = out[0]
    assert got.finish_reason == "stop" and got.stop == stop and got.reason == f"stop string {stop!r}"
    end = text.index(stop) + len(stop)
    assert got.text == text[:end]
    # ids run through the token that completed the string, and the row's conversation ends there
    n = next(i + 1 for i in range(len(pieces)) if stop in "".join(pieces[: i + 1]))
    np.testing.assert_array_equal(got.ids, free.ids[:n])
    assert s.length(0) == mark + n
    # row 2 listed only "zzzz" (never produced by these letters): it runs on exactly as before
    np.testing.assert_array_equal(out[1].ids, free2.ids)
    assert out[1].finish_reason == "length" and out[1].text == text2


def test_overflow_is_reported_and_isolated(model):
    s = new_sampler(model)
    s.append([0, 1], [prompt(60, MAX_LEN - 10), prompt(61, 3)])
    before = (np.asarray(s.cache.k[:, 1]), s.tokens(1))
    with pytest.raises(CacheOverflowError, match="max_len=64"):
        s.append([1, 0], [prompt(62, 2), prompt(62, 11)])
    assert s.length(0) == MAX_LEN - 10 and s.length(1) == 3  # nothing written, not even row 1's chunk
    out = s.generate([0], 30, temperature=0.0)[0]
    assert out.ids.size == 10 and out.finish_reason == "length" and "cache row full" in out.reason
    assert s.length(0) == MAX_LEN and s.room(0) == 0
    np.testing.assert_array_equal(np.asarray(s.cache.k[:, 1]), before[0])
    np.testing.assert_array_equal(s.tokens(1), before[1])
    again = s.generate([0], 5, temperature=0.0)[0]
    assert again.ids.size == 0 and again.finish_reason == "length"
    ref = full_logits(model, s.tokens(0))[-1]
    np.testing.assert_allclose(s.next_logits([0])[0], ref, atol=1e-4)


def test_bad_arguments_raise_clear_errors(model):
    s = new_sampler(model)
    s.append([0], [prompt(70, 4)])
    cases = [
        (lambda: s.append([ROWS], [[1]]), "unknown row 4"),
        (lambda: s.append([-1], [[1]]), "unknown row -1"),
        (lambda: s.append([0, 0], [[1], [2]]), "listed twice"),
        (lambda: s.append([0], [[1], [2]]), "one token chunk per row"),
        (lambda: s.append([0], [[-3]]), "token id -3 outside"),
        (lambda: s.append([0], [[1000]]), "token id 1000 outside"),
        (lambda: s.append([0], [[[1, 2]]]), "1-D"),
        (lambda: s.append([0], [[1.5]]), "integers"),
        (lambda: s.rewind(0, 5), "beyond the row"),
        (lambda: s.rewind(0, -1), ">= 0"),
        (lambda: s.rewind("0", 1), "row must be an int"),
        (lambda: s.generate([1], 4, temperature=0.0), "empty"),
        (lambda: s.generate([0], -1, temperature=0.0), "max_new_tokens"),
        (lambda: s.generate([0], [3, 4], temperature=0.0), "one per listed row"),
        (lambda: s.generate([0], 4, temperature=0.0, stop_strings=[["a"], ["b"]]), "one list per listed row"),
        (lambda: s.generate([0], 4, temperature=-1.0), "temperature"),
        (lambda: s.generate([0], 4, temperature=1.0), "explicit key"),
        (lambda: s.generate([0], 4, top_p=0.0, key=jax.random.key(0)), "top_p"),
        (lambda: s.generate([0], 4, top_k=-2, key=jax.random.key(0)), "top_k"),
        (lambda: s.generate([0], 4, temperature=0.0, stop_token_ids=[5000]), "stop token id"),
        (lambda: s.generate([0], 4, temperature=0.0, stop_strings=["x"]), "need a tokenizer"),
        (lambda: s.generate([0], 4, temperature=0.0, stop_strings=[""]), "non-empty"),
        (lambda: Sampler(model, rows=0, max_len=8), "rows >= 1"),
        (lambda: Sampler(model, rows=1, max_len=8, min_window=0), "min_window"),
    ]
    for call, message in cases:
        with pytest.raises(SamplerError, match=message):
            call()
    assert s.length(0) == 4 and s.length(1) == 0


def test_compilations_stay_bounded(model):
    s = new_sampler(model)
    before = dict(TRACES)
    for n in range(1, 40, 3):  # many lengths, two buckets (8, 32) plus chunking
        s.reset(0)
        s.append([0, 1], [prompt(n, n), prompt(n + 1, 1 + n % 5)])
    for n in (3, 9, 16):  # one power-of-two output bucket (16)
        s.generate([0, 1], n, temperature=0.0)
    windows = 2  # 32 and 64
    assert TRACES["prefill"] - before.get("prefill", 0) <= len(BUCKETS) * windows
    assert TRACES["decode"] - before.get("decode", 0) <= windows


def test_min_out_len_shares_one_decode_program_and_keeps_the_tokens(model):
    """Short and long calls (a policy's moves and reflections) share one decode program with ``min_out_len``
    set to the longest; only the output buffer grows, so the same key gives the same tokens."""
    prompts = [prompt(40, 6), prompt(41, 9)]
    runs = {}
    for min_out_len in (128, 16):  # 128: an output length no other test compiles for
        s = Sampler(model, rows=ROWS, max_len=MAX_LEN, chunk_buckets=BUCKETS, min_window=MAX_LEN,
                    min_out_len=min_out_len)
        s.append([0, 1], prompts)
        before = TRACES["decode"]
        calls = s.generate([0, 1], 5, key=jax.random.key(7)) + s.generate([0, 1], 40, key=jax.random.key(8))
        runs[min_out_len] = (calls, TRACES["decode"] - before)
    assert runs[128][1] == 1  # both calls ran the one (rows, out_len 128, window) program
    for a, b in zip(runs[128][0], runs[16][0], strict=True):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert all(g.ids.size <= 5 for g in runs[128][0][:2])
    with pytest.raises(SamplerError, match="min_out_len"):
        Sampler(model, rows=1, max_len=8, min_out_len=0)


def test_windowed_cached_forward_equals_the_full_window(model):
    cache = init_cache(model.config, 3, 32)
    ids = jnp.asarray(prompt(80, 30).reshape(3, 10))
    write_start = jnp.array([0, 5, 32], jnp.int32)  # row 2: nothing written
    positions = write_start[:, None] + jnp.arange(10)[None]
    ref, ref_cache = model.hidden_cached(ids, positions, cache, write_start)
    np.testing.assert_array_equal(np.asarray(ref_cache.k)[:, 2], np.asarray(cache.k)[:, 2])
    # a window covering every real query gives the same hidden states and cache for rows 0 and 1
    windowed, win_cache = model.hidden_cached(ids, positions, cache, write_start, window=16)
    # (fusion-order rounding: the two windows' products sum in different blocks; layer 1's keys inherit it)
    np.testing.assert_allclose(np.asarray(windowed)[:2], np.asarray(ref)[:2], rtol=1e-5, atol=1e-5)
    for a, b in ((win_cache.k, ref_cache.k), (win_cache.v, ref_cache.v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_unrolled_cached_forward_equals_the_layer_scan(model):
    """Decode loops pass per-layer weight slices (unrolled layers): the same result as the layer scan."""
    cache = init_cache(model.config, 3, 32)
    ids = jnp.asarray(prompt(81, 15).reshape(3, 5))
    write_start = jnp.array([0, 7, 32], jnp.int32)
    positions = write_start[:, None] + jnp.arange(5)[None]
    ref, ref_cache = model.hidden_cached(ids, positions, cache, write_start, window=16)
    out, out_cache = model.hidden_cached(ids, positions, cache, write_start, window=16,
                                         layers=model.layer_weights())
    for a, b in ((out, ref), (out_cache.k, ref_cache.k), (out_cache.v, ref_cache.v)):  # fusion-order rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layers holds 1"):
        model.hidden_cached(ids, positions, cache, write_start, layers=model.layer_weights()[:1])


def test_decode_loop_never_slices_the_stacked_weights_per_step(model):
    """The compiled decode (the sampler's real jit) reads each layer's weights from the sampler's per-layer
    copies; a dynamic-slice of a stacked weight (a layer scan) would copy every layer's weights every step."""
    from flax import nnx

    from retrojax.sampler import _decode

    s = new_sampler(model)
    table, lens = s._stop_string_tables(())
    r = ROWS
    zeros_i, zeros_f = jnp.zeros((r,), jnp.int32), jnp.zeros((r,), jnp.float32)
    hlo = _decode.lower(s._graphdef, s._state, s._layer_weights(), s.cache, zeros_i, zeros_i,
                        jnp.full((r,), 4, jnp.int32), jnp.full((1,), -1, jnp.int32), table, lens,
                        jnp.zeros((r, 1), bool), zeros_f, jnp.ones((r,), jnp.float32), zeros_i,
                        jax.random.key(0), out_len=16, window=MIN_WINDOW).compile().as_text()
    assert "while" in hlo
    layer_slices = {"1," + ",".join(map(str, w.shape[1:]))
                    for name, w in nnx.state(model.layers, nnx.Param).items() if not name.endswith("norm")}
    dynamic = set(re.findall(r"f32\[([\d,]*)\]\{[^}]*\} dynamic-slice\(", hlo))
    assert not dynamic & layer_slices, f"per-step weight copies: {sorted(dynamic & layer_slices)}"
    layers = s._layer_weights()
    assert len(layers) == model.config.num_hidden_layers and s._layer_weights() is layers  # sliced once
    np.testing.assert_array_equal(np.asarray(layers[1]["gate"]), np.asarray(model.layers.gate[...])[1])
    s.update_model(model)
    assert s._layer_weights() is not layers  # new weights: sliced again
