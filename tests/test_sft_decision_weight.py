"""Decision-weighted SFT (``sft.decision_weight``, ours): the weights reach the loss in every layout, and
the decision tokens are found from the reply text whatever the tokenizer."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.agent.chat import ByteChatTokenizer
from retrojax.learn import sft
from retrojax.learn.warm_start import decision_weights
from retrojax.model.qwen3 import Qwen3, Qwen3Config


def _ids(*xs):
    return np.asarray(xs, np.int32)


def test_pack_carries_each_calls_weights_and_the_end_token_weighs_one():
    p1, o1 = _ids(1, 2), _ids(3, 4)
    p2, o2 = _ids(1, 2, 3, 4, 99, 5), _ids(6)
    examples, _ = sft.pack_calls([(p1, o1), (p2, o2)], max_len=32, end_id=99,
                                 weights=[np.asarray([1.0, 7.0]), None])
    (ex,) = examples
    np.testing.assert_array_equal(ex.ids, [1, 2, 3, 4, 99, 5, 6, 99])
    np.testing.assert_array_equal(ex.loss_weights(), [0, 0, 1, 7, 1, 0, 1, 1])
    unweighted, _ = sft.pack_calls([(p1, o1), (p2, o2)], max_len=32, end_id=99)
    assert unweighted[0].weight is None
    np.testing.assert_array_equal(unweighted[0].loss_weights(), unweighted[0].own)


def test_context_only_calls_keep_no_weight_and_bad_weights_are_refused():
    examples, _ = sft.pack_calls([(_ids(1), _ids(2)), (_ids(1, 2, 3), _ids(4))], max_len=16,
                                 train=[False, True], weights=[np.asarray([9.0]), np.asarray([3.0])])
    np.testing.assert_array_equal(examples[0].loss_weights(), [0, 0, 0, 3])
    with pytest.raises(ValueError, match="entries for 1 calls"):
        sft.pack_calls([(_ids(1), _ids(2))], max_len=8, weights=[None, None])
    with pytest.raises(ValueError, match="output of 1 tokens"):
        sft.pack_calls([(_ids(1), _ids(2))], max_len=8, weights=[np.ones(3)])
    with pytest.raises(ValueError, match="finite"):
        sft.pack_calls([(_ids(1), _ids(2))], max_len=8, weights=[np.asarray([np.nan])])


def _tiny() -> Qwen3:
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    return Qwen3(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layout", ["rows", "packed", "tree"])
def test_the_loss_is_the_weighted_mean_of_the_trained_tokens(layout):
    """Same value in every layout, and equal to a hand-computed weighted mean of per-token NLLs."""
    model = _tiny()
    rng = np.random.default_rng(0)
    examples = []
    for n in (9, 12, 7):
        ids = rng.integers(1, 60, n).astype(np.int32)
        own = np.zeros(n, bool)
        own[n // 2:] = True
        examples.append(sft.Example(ids=ids, own=own, weight=rng.uniform(0.5, 13.0, n).astype(np.float32)))
    loss = nnx.jit(sft.sft_loss)
    batch = {k: jnp.asarray(v) for k, v in sft.make_batch(examples, 4, (16,), layout=layout).items()}
    got, count = loss(model, batch)
    num = den = 0.0
    for ex in examples:
        logits = np.asarray(model(jnp.asarray(ex.ids[None])))[0]
        lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        w = ex.loss_weights()
        for t in range(1, len(ex.ids)):
            num -= w[t] * lp[t - 1, ex.ids[t]]
            den += w[t]
    assert float(got) == pytest.approx(num / den, rel=2e-4)
    assert float(count) == sum(int(e.own[1:].sum()) for e in examples)
    plain = [sft.Example(ids=e.ids, own=e.own) for e in examples]
    nll = sft.evaluate_nll(model, plain, 4, buckets=(16,), layout=layout)
    assert sft.evaluate_nll(model, examples, 4, buckets=(16,), layout=layout) == pytest.approx(nll, rel=1e-5)


MOVES = st.sampled_from(["up", "down", "left", "right", "rewind to C_1", "up, left", "héllo"])
PROSE = st.text(st.characters(min_codepoint=32, max_codepoint=0x24FF, exclude_characters="<>"), max_size=30)


@settings(max_examples=60, deadline=None)
@given(PROSE, MOVES, PROSE, st.floats(0.1, 20.0))
def test_the_weighted_tokens_are_exactly_the_last_action(before, move, after, weight):
    tok = ByteChatTokenizer()
    text = f"{before}<action>ignored</action>\n<action>{move}</action>{after}"
    ids = np.asarray(tok.encode(text))
    w = decision_weights(ids, tok.decode, weight)
    if weight == 1.0:
        return
    assert tok.decode(ids[w == np.float32(weight)]) == move
    assert np.all(w[w != np.float32(weight)] == 1.0)
    assert decision_weights(np.asarray(tok.encode(before + after)), tok.decode, weight) is None
