"""The Pallas forest-attention kernel (interpret mode on CPU) equals the dense masked reference, and the
learner's loss and gradients with ``model.attention: pallas`` equal the XLA path's.

Shapes are fixed per dtype (one compiled program each) and hypothesis draws the forests: chains, wide fans,
one-token branches, rows of several trees, padding nodes, keys nobody sees; the row length is not a multiple
of the blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from retrojax.config import LearnConfig
from retrojax.kernels import forest_attention
from retrojax.kernels.forest_attention import BLOCK_Q, visit_lists
from retrojax.kernels.reference import forest_attention_reference, forest_mask
from retrojax.learn.advantages import compute_advantages
from retrojax.learn.batch import plan_batches
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.update import Update, make_optimizer, split_model
from retrojax.model import Qwen3, Qwen3Config

B, T, N, KVH, D = 2, 56, 4, 2, 16  # 56 tokens: 3.5 blocks of 16
BLOCKS = (16, 32)  # block_q, block_k: unequal, so the block classification is exercised both ways


def forest_exits(pops: list[int], pad: int = 0) -> np.ndarray:
    """tree_exit of a DFS-ordered forest: before token i (i > 0) ``pops[i]`` open tokens close (all of them:
    a new tree), then i opens; the last ``pad`` tokens are padding that sees only itself."""
    real = len(pops) - pad
    exits = np.arange(1, len(pops) + 1, dtype=np.int32)
    stack: list[int] = []
    for i in range(real):
        if i:
            for _ in range(min(pops[i], len(stack))):
                exits[stack.pop()] = i
        stack.append(i)
    for j in stack:
        exits[j] = real
    return exits


# a row: pops per token (0: a child, 1: a sibling, more: climb or start a new tree) and a padding tail
rows_of_forests = st.tuples(st.lists(st.integers(0, 6), min_size=T, max_size=T), st.integers(0, T // 4))


@functools.cache
def _programs(dtype: str):
    """Jitted (outputs, grads) of the kernel and of the reference for a random cotangent."""

    def run(attend, q, k, v, exits, w):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, exits), q, k, v)
        return out, vjp(w.astype(out.dtype))

    kernel = functools.partial(forest_attention, block_q=BLOCKS[0], block_k=BLOCKS[1], interpret=True)
    reference = functools.partial(run, forest_attention_reference)
    return jax.jit(functools.partial(run, kernel)), jax.jit(reference)


def _inputs(dtype, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, T, N, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, KVH, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, KVH, D), jnp.float32)
    w = jax.random.normal(keys[3], (B, T, N, D), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), w


def _errors(dtype, exits: np.ndarray, relative: bool = False) -> list[float]:
    """Max |kernel - reference| of the output and dQ, dK, dV; ``relative``: over max(1, max |reference|)
    (bfloat16 rounds a gradient of magnitude 8 by up to 0.016 on its own)."""
    kernel, reference = _programs(jnp.dtype(dtype).name)
    q, k, v, w = _inputs(dtype)
    e = jnp.asarray(exits)
    got = kernel(q, k, v, e, w)
    # the reference runs in float32 on the same (rounded) inputs
    want = reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), e, w)
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    return [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / (max(1.0, float(jnp.max(jnp.abs(b))))
                                                                  if relative else 1.0))
            for a, b in zip(flat_got, flat_want, strict=True)]


CHAIN = [0] * T
FAN = [0, 0] + [1] * (T - 2)  # a root, every later token its child: wide and one token deep
TREES = [0 if i % 9 else T for i in range(T)]  # several chains (sequences) in one row
BRANCHES = [0] * 20 + [1, 0, 2, 0, 1] * 7 + [0]  # a prompt chain, one-token branches, short subtrees


def _two_rows(a: list[int], b: list[int], pad_a: int = 0, pad_b: int = 0) -> np.ndarray:
    return np.stack([forest_exits(a, pad_a), forest_exits(b, pad_b)])


@settings(max_examples=6, deadline=None)
@given(st.tuples(rows_of_forests, rows_of_forests), st.integers(0, 2 ** 16))
@example(((CHAIN, 0), (FAN, 5)), 0)
@example(((TREES, 3), (BRANCHES, 0)), 0)
def test_kernel_equals_reference_float32(rows, seed):
    exits = np.stack([forest_exits(*rows[0]), forest_exits(*rows[1])])
    if seed % 3 == 0:  # row 1 as the rows layout's mask becomes: causal, right padding is keys nobody sees
        idx = np.arange(T, dtype=np.int32)
        exits[1] = np.where(idx < T - seed % 11, T, idx)
    if seed % 2 == 0:  # a key nobody sees at the front: query 0 sees no key at all (zeros)
        exits[0, 0] = 0
    errors = _errors(jnp.float32, exits)
    assert max(errors) <= 1e-5, errors


@settings(max_examples=3, deadline=None)
@given(st.tuples(rows_of_forests, rows_of_forests))
@example(((BRANCHES, 4), (TREES, 0)))
def test_kernel_equals_reference_bfloat16(rows):
    exits = np.stack([forest_exits(*rows[0]), forest_exits(*rows[1])])
    errors = _errors(jnp.bfloat16, exits, relative=True)
    assert max(errors) <= 2e-2, errors


def test_reference_sees_ancestors_only():
    """The mask the kernel reproduces: a fan's leaves see the root and themselves, never each other."""
    exits = _two_rows(FAN, CHAIN)
    mask = np.asarray(forest_mask(exits))
    assert mask[0, 5].nonzero()[0].tolist() == [0, 5]
    assert mask[1, 5].nonzero()[0].tolist() == list(range(6))


def test_visit_lists_skip_blocks_no_query_needs():
    """Rows of independent 16-token sequences: each query block visits only its own key block (full blocks
    never: a diagonal block is masked), so the work is linear in the row length, not quadratic."""
    t = 128
    exits = jnp.asarray(np.repeat(np.arange(16, t + 1, 16), 16)[None].astype(np.int32))
    order, counts = visit_lists(exits, 16, 16)
    assert np.asarray(counts[0]).tolist() == [[0, 1]] * 8
    assert np.asarray(order[0, :, 0]).tolist() == list(range(8))
    causal = jnp.full((1, t), t, jnp.int32)  # one causal row: every block below the diagonal is full
    _, counts = visit_lists(causal, 16, 16)
    assert np.asarray(counts[0]).tolist() == [[i, 1] for i in range(8)]


# The learner's step with the kernel: a micro model and a synthetic trial archive (growing conversations,
# rewinds, reflections; retrojax.learn.synthetic) whose sequences (55-67 tokens) cross the model's 64-token
# kernel blocks, in rows of 160 tokens (padded to three blocks by the kernel): the rows layout's padding keys
# fill whole blocks nobody visits, and the packed layout puts two chains in a row. (Real trial archives of
# 2048-token rows run through the XLA layouts in tests/test_learn_layout_exact.py; interpret mode costs per
# block visited, so the kernel's learner check keeps its rows short.)
STEP_MODEL = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=256)
STEP_ROW = 160


@functools.cache
def _step_archive():
    arch = synthetic_archive(np.random.default_rng(0), tasks=1, trials=2, vocab=STEP_MODEL.vocab_size,
                             segments=2, decisions=2, prompt_len=40, turn_len=6, output_len=8)
    rng = np.random.default_rng(1)
    for c in arch.calls:  # the random model's log-probs sit near -log(V): ratios spread around 1, some clip
        noise = rng.normal(0.0, 0.3, len(c.output_ids))
        c.logprobs = (-np.log(STEP_MODEL.vocab_size) + noise).astype(np.float32)
    return arch


STEP_LEARN = LearnConfig(learning_rate=1e-3, seq_buckets=(STEP_ROW,), max_batch_tokens=STEP_ROW * 16,
                         logprob_chunk=32)


@functools.cache
def _step_update(attention: str) -> tuple[Update, object]:
    """One jitted update per attention kind (both layouts share its optimizer step; compiles are most of
    this check's time) and its optimizer."""
    graphdef, template, _ = split_model(Qwen3(STEP_MODEL, rngs=nnx.Rngs(0), attention=attention))
    tx, _ = make_optimizer(STEP_LEARN, 10)
    return Update(graphdef, template, tx, clip_eps=STEP_LEARN.clip_eps, chunk=STEP_LEARN.logprob_chunk), tx


def _learner_step(layout: str, attention: str):
    """(loss, gradients, new parameters, plan) of one optimizer step from fresh weights."""
    lc, arch = STEP_LEARN, _step_archive()
    plan = plan_batches(arch, compute_advantages(arch, "sa_grpo"), lambda_ref=lc.lambda_ref,
                        seq_buckets=lc.seq_buckets, max_batch_tokens=lc.max_batch_tokens,
                        rng=np.random.default_rng(1), layout=layout)
    _, _, params = split_model(Qwen3(STEP_MODEL, rngs=nnx.Rngs(0), attention=attention))
    upd, tx = _step_update(attention)
    ((mb,),) = plan.minibatches
    acc = upd.accumulate(params, None, {k: jnp.asarray(v) for k, v in mb.arrays.items()})
    loss, grads = float(acc["stats"]["loss"]), jax.tree.map(np.asarray, acc["grads"])
    params, _, _ = upd.apply(params, tx.init(params), acc)
    return loss, grads, jax.tree.map(np.asarray, params), plan


@pytest.fixture(scope="module")
def xla_rows_step():
    """The XLA path's one-sequence-per-row step (tests/test_learn_layout_exact.py shows the packed layout's
    step equals it within 1e-5)."""
    return _learner_step("rows", "xla")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_learner_step_with_the_kernel_equals_xla(xla_rows_step, layout):
    """One learner step (loss, gradients, new parameters) on a trial archive with ``model.attention:
    pallas`` equals the XLA path's: the rows layout runs its causal + padding mask through the kernel, the
    packed layout its chains."""
    want_loss, want_grads, want_params, rows_plan = xla_rows_step
    loss, grads, params, plan = _learner_step(layout, "pallas")
    mb = plan.minibatches[0][0].arrays
    if layout == "rows":  # some sequence crosses a kernel block, and padding fills whole blocks
        lengths = mb["attention_mask"].sum(axis=1)
        assert lengths.max() > BLOCK_Q and lengths.max() + BLOCK_Q <= STEP_ROW
    else:  # rows of two chains or more
        assert mb["input_ids"].shape[0] < rows_plan.minibatches[0][0].arrays["input_ids"].shape[0]
    assert plan.stats["batch/trained_tokens"] == rows_plan.stats["batch/trained_tokens"]
    assert abs(want_loss) > 1e-4
    np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=0)
    for got, want in ((grads, want_grads), (params, want_params)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_model_attention_setting_reaches_the_model():
    """``model.attention`` from the config is the built model's; auto is xla on this CPU backend."""
    from retrojax import config
    from retrojax.model.build import build_model
    from retrojax.model.qwen3 import use_pallas_attention

    assert build_model(config.load(None, ["model.attention=pallas"])).attention == "pallas"
    assert build_model(config.load(None)).attention == "auto"
    assert use_pallas_attention("auto") is (jax.default_backend() in ("gpu", "tpu"))
    with pytest.raises(config.ConfigError):
        config.load(None, ["model.attention=triton"])
