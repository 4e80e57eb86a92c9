"""The sampling distribution: temperature, top-k, top-p, greedy; with the log-prob of each drawn token.

All knobs are traced values (changing them never recompiles): one scalar for every row, or one value per
row (``[B]``), so requests with different settings decode in one batch (the server's continuous batching).
The expensive sort behind top-k/top-p only runs (``lax.cond``) when one of them is active, so training
rollouts — full distribution, temperature 1 — cost a log-softmax and one uniform draw per row and step,
and their log-probs are exactly the model's log-softmax, which is what the learner recomputes.

Greedy (temperature 0) returns the argmax and, as its log-prob, the model's own log-softmax at that token
(the degenerate point-mass log-prob 0 would carry no information).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _per_row(x: jax.Array, rows: int) -> jax.Array:
    """A scalar or ``[B]`` knob as a ``[B, 1]`` column (broadcasts against ``[B, V]``)."""
    return jnp.broadcast_to(jnp.asarray(x), (rows,))[:, None]


def filter_logits(logits: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Set to -inf every logit outside the top-k and then outside the top-p nucleus (per row of [B, V]).

    ``top_p``/``top_k``: scalars or one value per row. Top-p keeps the smallest set of most likely tokens
    whose mass (after top-k) reaches ``top_p``; the most likely token is always kept. Tokens tied with the
    last kept one are kept too.
    """
    rows, vocab = logits.shape
    top_p, top_k = _per_row(top_p, rows), _per_row(top_k, rows)
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    rank = jnp.arange(vocab)[None, :]
    desc = jnp.where(rank < k, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) & (rank < k)
    keep = keep.at[:, 0].set(True)
    n_keep = jnp.sum(keep, axis=-1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row of ``logits`` [B, V] (f32) with per-row ``keys`` [B].

    Knobs are scalars or one value per row. Returns ``(tokens [B] int32, logprobs [B] f32)``; the log-prob is
    under the distribution actually sampled (after temperature and filtering), or the model's log-softmax for
    greedy rows (temperature 0).
    """
    logits = logits.astype(jnp.float32)
    rows = logits.shape[0]
    temp = _per_row(temperature, rows).astype(jnp.float32)
    top_p, top_k = _per_row(top_p, rows), _per_row(top_k, rows)
    greedy_row = temp[:, 0] <= 0.0
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def greedy(_):
        return argmax, jax.nn.log_softmax(logits, axis=-1)

    def stochastic(_):
        # greedy rows of a mixed batch keep temperature 1 and no filter: their log-probs are the model's own
        scaled = logits / jnp.where(temp > 0.0, temp, 1.0)
        filter_row = ((top_k > 0) | (top_p < 1.0)) & (temp > 0.0)
        filtered = jax.lax.cond(
            jnp.any(filter_row),
            lambda x: jnp.where(filter_row, filter_logits(x, top_p[:, 0], top_k[:, 0]), x),
            lambda x: x,
            scaled,
        )
        logp = jax.nn.log_softmax(filtered, axis=-1)
        # inverse-CDF draw: one uniform u per row (a Gumbel draw needs V random numbers per row, which
        # dominated the step on CPU); the pick is the first token whose CDF exceeds u, so P(i) = p_i and
        # tokens without mass (CDF flat there) are never picked
        cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * cdf[:, -1]
        drawn = jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1), logits.shape[-1] - 1).astype(jnp.int32)
        return jnp.where(greedy_row, argmax, drawn), logp

    tokens, logp = jax.lax.cond(jnp.all(greedy_row), greedy, stochastic, None)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def row_keys(key: jax.Array, step: jax.Array, rows: int) -> jax.Array:
    """Per-row keys for one decode step: depend only on (key, step, row), not on which other rows decode."""
    step_key = jax.random.fold_in(key, step)
    return jax.vmap(lambda r: jax.random.fold_in(step_key, r))(jnp.arange(rows))
