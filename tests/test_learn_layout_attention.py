"""Block-sparse tree attention: the dense ancestor mask's output and gradients, on random token forests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retrojax.learn.layout import Trained, pack, row_lengths
from retrojax.model.qwen3 import _attend_dense, attend_tree, tree_attention_mask


def _forest(seed: int, n: int = 10, vocab: int = 4) -> jnp.ndarray:
    """tree_exit of one packed row of sequences that branch off each other (small vocab: shared prefixes)."""
    rng = np.random.default_rng(seed)
    seqs: list[np.ndarray] = []
    for _ in range(n):
        base = seqs[int(rng.integers(len(seqs)))][: int(rng.integers(0, 40))] if seqs else np.zeros(0, int)
        seqs.append(np.concatenate([base, rng.integers(0, vocab, int(rng.integers(2, 40)))]).astype(np.int32))
    items = [Trained(s, np.arange(1, s.size), {"w": np.ones(s.size - 1, np.float32)}) for s in seqs]
    (mb,) = pack(items, lengths=(64,), max_batch_tokens=512, long_rows=True).microbatches
    return jnp.asarray(mb["tree_exit"])


def _qkv(t: int, rows: int = 1):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, t, 4, 8))
    k, v = (jax.random.normal(x, (rows, t, 2, 8)) for x in keys[1:])
    return q, k, v


@pytest.mark.parametrize("seed, block", [(0, 8), (1, 16), (2, 24)])
def test_block_sparse_tree_attention_equals_the_dense_mask(seed, block):
    tree_exit = _forest(seed)
    t = tree_exit.shape[1]
    assert t > block  # the block-sparse path, with a part-filled last block when block ∤ t
    q, k, v = _qkv(t)
    dense = jax.jit(lambda q, k, v: _attend_dense(q, k, v, tree_attention_mask(tree_exit)))
    sparse = jax.jit(lambda q, k, v: attend_tree(q, k, v, tree_exit, block=block))
    np.testing.assert_allclose(sparse(q, k, v), dense(q, k, v), atol=2e-6, rtol=0)
    w = jax.random.normal(jax.random.key(3), q.shape)

    def grads(f):
        return jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) * w).sum(), argnums=(0, 1, 2)))(q, k, v)

    for a, b in zip(grads(sparse), grads(dense), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_row_that_sees_nothing_stays_finite():
    """An all-zero row (a process's empty share in a multi-process step) gives zeros and finite gradients."""
    q, k, v = _qkv(40, rows=2)
    tree_exit = jnp.stack([jnp.arange(1, 41, dtype=jnp.int32) * 0 + 40, jnp.zeros(40, jnp.int32)])
    out = attend_tree(q, k, v, tree_exit, block=16)
    assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(jnp.isfinite(out)))
    g = jax.grad(lambda k: attend_tree(q, k, v, tree_exit, block=16).sum())(k)
    assert bool(jnp.all(jnp.isfinite(g)))


def test_row_lengths_are_a_fixed_small_set():
    sizes = row_lengths((512, 1280), 16384)
    assert sizes[-1] == 16384 and {512, 1280, 1024, 15360} <= set(sizes) and len(sizes) == 18
    assert row_lengths((64,), 32) == tuple(range(4, 65, 4))  # capacity: at least the longest bucket
