"""learn.layout packed | tree | tree_long give the rows layout's loss, gradients and step on trial-loop
archives.

The archive comes from the real trial loop (``Runner``) on Sokoban under T@3 with a noisy scripted policy:
model-initiated rewinds, reflections with remarks, and byte-level prompts (contexts of 0.8k–1.5k tokens, the
length of a text world's prompts). Its behaviour log-probs are drawn around the model's so that some ratios
clip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from retrojax import config
from retrojax.config import LearnConfig
from retrojax.learn.advantages import compute_advantages
from retrojax.learn.batch import build_sequences, plan_batches
from retrojax.learn.layout import from_sequence, pack, unique_tokens
from retrojax.learn.update import Update, make_optimizer, split_model
from retrojax.model import Qwen3, Qwen3Config

MICRO = Qwen3Config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048)
BUCKETS = (2048,)


@pytest.fixture(scope="module")
def archive():
    from retrojax.agent.env_api import make_env
    from retrojax.agent.policies import OraclePolicy
    from retrojax.agent.runner import Runner, make_specs

    # the demo's board notes off: the layout arithmetic does not depend on them and the archive stays the size
    # the suite's time was measured with; two trials per level (three cost the suite ~35 s more)
    cfg = config.load("configs/demo.yaml", ["trial.prompt_style=compact", "trial.max_calls=6",
                                            "env.board_notes=false"])
    env = make_env(cfg, f"{cfg.env.split}:train")
    try:
        arch = Runner(cfg, env, OraclePolicy(0.5)).run(make_specs(range(2), [3], 2, ["T@3"]))
    finally:
        env.close()
    rng = np.random.default_rng(0)
    for c in arch.calls:  # the random model's log-probs sit near -log(V): ratios spread around 1
        c.logprobs = (-np.log(MICRO.vocab_size) + rng.normal(0.0, 0.3, len(c.output_ids))).astype(np.float32)
    assert any(r.trigger == "model" for r in arch.recoveries)
    assert any(c.role == "reflection" for c in arch.calls)
    assert max(len(c.prompt_ids) for c in arch.calls) > 1200
    return arch


# One jitted update per (minibatches, learning rate) for the whole module: the layouts' steps share its
# compiled apply step, and their accumulate steps wherever two layouts' microbatches have the same shapes
# (the update is a pure function of params, optimizer state and arrays; every step starts from fresh weights)
_UPDATES: dict[tuple[int, float], tuple] = {}


def _step(arch, layout: str, minibatches: int, lr: float, max_batch_tokens: int = 4096):
    lc = LearnConfig(learning_rate=lr, seq_buckets=BUCKETS, max_batch_tokens=max_batch_tokens,
                     logprob_chunk=256, minibatches=minibatches)
    adv = compute_advantages(arch, "sa_grpo")
    plan = plan_batches(arch, adv, lambda_ref=lc.lambda_ref, seq_buckets=BUCKETS,
                        max_batch_tokens=lc.max_batch_tokens, minibatches=minibatches,
                        rng=np.random.default_rng(1), layout=layout)
    model = Qwen3(MICRO, rngs=nnx.Rngs(0))
    graphdef, template, params = split_model(model)
    if (minibatches, lr) not in _UPDATES:
        tx, _ = make_optimizer(lc, 10)
        _UPDATES[(minibatches, lr)] = tx, Update(graphdef, template, tx, clip_eps=lc.clip_eps,
                                                 chunk=lc.logprob_chunk)
    tx, upd = _UPDATES[(minibatches, lr)]
    opt = tx.init(params)
    losses, grads = [], []
    for group in plan.minibatches:
        acc = None
        for mb in group:
            acc = upd.accumulate(params, acc, {k: jnp.asarray(v) for k, v in mb.arrays.items()})
        losses.append(float(acc["stats"]["loss"]))
        grads.append(jax.tree.map(np.asarray, acc["grads"]))
        params, opt, _ = upd.apply(params, opt, acc)
    return losses, grads, jax.tree.map(np.asarray, params), plan


@pytest.fixture(scope="module")
def rows_step(archive):
    """The one-sequence-per-row reference step, computed once per (minibatches, lr) for the whole module."""
    cache: dict = {}

    def get(minibatches: int, lr: float):
        if (minibatches, lr) not in cache:
            cache[(minibatches, lr)] = _step(archive, "rows", minibatches, lr)
        return cache[(minibatches, lr)]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("minibatches, layouts, budget", [
    # tree rows of ≤ 2048 tokens run the dense causal blocks that long rows of ≤ 4096 would (tree_long there
    # compiled three row lengths, ~23 s of the suite's time, for no path the tree layout does not cover)
    (1, ("packed", "tree"), 4096),
    (2, ("tree",), 4096),
    (1, ("tree_long",), 8192),  # long rows past qwen3.TREE_SPARSE_FROM: the block-sparse attention
])
def test_packed_and_tree_steps_equal_rows(archive, rows_step, minibatches, layouts, budget):
    lr = 1e-3
    want_loss, want_grads, want_params, rows_plan = rows_step(minibatches, lr)
    assert rows_plan.stats["batch/trained_tokens"] > 0 and any(abs(x) > 1e-4 for x in want_loss)
    for layout in layouts:
        loss, grads, params, plan = _step(archive, layout, minibatches, lr, budget)
        if budget > 4096:
            from retrojax.model.qwen3 import TREE_SPARSE_FROM

            assert max(mb.arrays["input_ids"].shape[1] for mb in plan.microbatches) > TREE_SPARSE_FROM
        assert plan.stats["batch/trained_tokens"] == rows_plan.stats["batch/trained_tokens"]
        np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=0)
        for g, w in zip(grads, want_grads, strict=True):
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        if layout == "tree":  # the shared prompts are laid out once (two trials per state: 0.58 / 0.67 here)
            share = 0.6 if minibatches == 1 else 0.7  # (a minibatch of half the trials shares less)
            assert plan.stats["batch/padded_tokens"] < share * rows_plan.stats["batch/padded_tokens"]


def test_tree_positions_are_near_the_distinct_tokens(archive):
    adv = compute_advantages(archive, "sa_grpo")
    seqs, _ = build_sequences(archive, adv, lambda_ref=0.5, max_len=max(BUCKETS))
    items = [from_sequence(s) for s in seqs]
    tree = pack(items, lengths=BUCKETS, max_batch_tokens=4096, share=True)
    flat = pack(items, lengths=BUCKETS, max_batch_tokens=4096, share=False)
    distinct = unique_tokens(items)
    assert distinct <= tree.nodes < flat.nodes == sum(it.inputs.size for it in items)
    assert tree.nodes <= 1.5 * distinct  # rows of 2048 split only a few shared prefixes
