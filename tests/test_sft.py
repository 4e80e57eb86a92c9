"""The SFT warm start: packing with loss masks, the pure jitted step, and that it learns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.learn import sft
from retrojax.model.qwen3 import Qwen3, Qwen3Config


def _tiny(vocab: int = 64) -> Qwen3:
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    return Qwen3(cfg, rngs=nnx.Rngs(0))


def _ids(*xs):
    return np.asarray(xs, np.int32)


def test_pack_merges_growing_conversation_and_masks_every_output():
    p1, o1 = _ids(1, 2, 3), _ids(4, 5)
    p2 = _ids(1, 2, 3, 4, 5, 6, 7)  # extends p1 + o1
    o2 = _ids(8)
    p3, o3 = _ids(9, 9), _ids(10, 11)  # a new conversation
    examples, stats = sft.pack_calls([(p1, o1), (p2, o2), (p3, o3)], max_len=32)
    assert stats.examples == 2 and stats.calls == 3 and stats.dropped == 0
    first, second = examples
    np.testing.assert_array_equal(first.ids, [1, 2, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(first.own, [0, 0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(second.ids, [9, 9, 10, 11])
    np.testing.assert_array_equal(second.own, [0, 0, 1, 1])
    assert stats.own_tokens == 5 and stats.total_tokens == 12


def test_pack_context_only_calls_and_end_token():
    p1, o1 = _ids(1, 2), _ids(3)
    p2 = _ids(1, 2, 3, 99, 5)  # the transcript closed the turn with the end token 99
    o2 = _ids(6, 99)  # already ends with it
    examples, stats = sft.pack_calls([(p1, o1), (p2, o2)], max_len=32, train=[False, True], end_id=99)
    assert stats.examples == 1
    np.testing.assert_array_equal(examples[0].ids, [1, 2, 3, 99, 5, 6, 99])
    np.testing.assert_array_equal(examples[0].own, [0, 0, 0, 0, 0, 1, 1])
    only_context, stats = sft.pack_calls([(p1, o1)], max_len=32, train=[False])
    assert only_context == [] and stats.own_tokens == 0
    with pytest.raises(ValueError, match="flags"):
        sft.pack_calls([(p1, o1)], max_len=32, train=[True, False])


def test_pack_starts_a_new_sequence_instead_of_outgrowing_max_len():
    p1, o1 = _ids(1, 2), _ids(3)
    p2, o2 = _ids(1, 2, 3, 4, 5), _ids(6, 7)  # extends call 1 but would make a 7-token chain
    examples, stats = sft.pack_calls([(p1, o1), (p2, o2)], max_len=6)
    assert stats.examples == 1 and stats.dropped == 1  # call 1 alone is kept; call 2 alone is too long
    examples, stats = sft.pack_calls([(p1, o1), (p2, o2)], max_len=7)
    assert stats.examples == 1 and len(examples[0].ids) == 7 and int(examples[0].own.sum()) == 3


def test_pack_drops_too_long_and_skips_empty_outputs():
    examples, stats = sft.pack_calls([(_ids(1, 2, 3, 4), _ids(5, 6)), (_ids(1), _ids())], max_len=5)
    assert examples == [] and stats.dropped == 1
    with pytest.raises(ValueError):
        sft.pack_calls([], max_len=1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=6), st.integers(0, 3))
def test_collate_aligns_targets_with_own_tokens(shapes, extra_rows):
    rng = np.random.default_rng(len(shapes))
    calls = [(rng.integers(1, 50, p).astype(np.int32), rng.integers(1, 50, o).astype(np.int32))
             for p, o in shapes]
    examples, stats = sft.pack_calls(calls, max_len=64)
    batch = sft.collate(examples, len(examples) + extra_rows, 32)
    assert batch["input_ids"].shape == (len(examples) + extra_rows, 32)
    assert int(batch["loss_mask"].sum()) == stats.own_tokens - sum(int(e.own[0]) for e in examples)
    for row, ex in enumerate(examples):
        n = len(ex.ids) - 1
        np.testing.assert_array_equal(batch["targets"][row, :n], ex.ids[1:])
        np.testing.assert_array_equal(batch["loss_mask"][row, :n], ex.own[1:])
        assert not batch["attention_mask"][row, n:].any() and not batch["loss_mask"][row, n:].any()
    assert not batch["loss_mask"][len(examples):].any()


def test_bucket_for_and_errors():
    assert sft.bucket_for(65, (64, 128)) == 128
    with pytest.raises(ValueError, match="exceeds"):
        sft.bucket_for(300, (64, 128))
    assert sft.default_buckets(100) == (64, 128)


def test_loss_ignores_prompt_tokens():
    model = _tiny()
    ex = sft.Example(ids=_ids(1, 2, 3, 4, 5, 6), own=np.array([0, 0, 0, 1, 1, 0], bool))
    changed = sft.Example(ids=_ids(1, 2, 3, 4, 5, 9), own=ex.own)  # only a non-own target differs
    loss = nnx.jit(sft.sft_loss)
    a = sft.collate([ex], 1, 8)
    b = sft.collate([changed], 1, 8)
    la, _ = loss(model, {k: jnp.asarray(v) for k, v in a.items()})
    lb, _ = loss(model, {k: jnp.asarray(v) for k, v in b.items()})
    assert float(la) == pytest.approx(float(lb), rel=1e-6)
    own_changed = sft.Example(ids=_ids(1, 2, 3, 7, 5, 6), own=ex.own)
    c = sft.collate([own_changed], 1, 8)
    lc, count = loss(model, {k: jnp.asarray(v) for k, v in c.items()})
    assert float(count) == 2.0 and abs(float(lc) - float(la)) > 1e-4


def test_step_compiles_once_per_bucket_and_skips_non_finite():
    model = _tiny()
    opt = sft.make_optimizer(1e-2, steps=10)
    graphdef, params = nnx.split(model)
    opt_state = opt.init(params)
    step = sft.make_sft_step(graphdef, opt, chunk=8)
    ex = sft.Example(ids=_ids(1, 2, 3, 4, 5, 6), own=np.array([0, 0, 0, 1, 1, 1], bool))
    batch = {k: jnp.asarray(v) for k, v in sft.collate([ex, ex], 2, 16).items()}
    for _ in range(3):
        params, opt_state, metrics = step(params, opt_state, batch)
        assert int(metrics["skipped"]) == 0
    assert step._cache_size() == 1
    # A NaN in the parameters gives a non-finite loss: the step must leave everything as it was.
    params = jax.tree.map(lambda x: x, params)
    params["final_norm"].set_value(params["final_norm"][...].at[0].set(jnp.nan))
    before = jax.tree.map(np.asarray, params)
    params, opt_state, metrics = step(params, opt_state, batch)
    assert int(metrics["skipped"]) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, before)


def test_train_sft_learns_a_copy_task():
    model = _tiny()
    rng = np.random.default_rng(0)
    calls = []
    for _ in range(48):
        prompt = rng.integers(10, 40, size=int(rng.integers(6, 20))).astype(np.int32)
        calls.append((prompt, prompt[-3:][::-1].copy()))  # reverse the last three prompt tokens
    examples, _ = sft.pack_calls(calls, max_len=64)
    before = sft.evaluate_nll(model, examples, batch_size=16, chunk=16)
    history = sft.train_sft(model, examples, steps=120, batch_size=16, learning_rate=3e-3, chunk=16)
    after = sft.evaluate_nll(model, examples, batch_size=16, chunk=16)
    assert len(history) == 120 and all(h["skipped"] == 0 for h in history)
    assert after < 0.25 * before, (before, after)
