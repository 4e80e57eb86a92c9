"""The ReTRAIL objective (paper eq. 19) on a prepared batch: clipped surrogate with per-token weights.

Each trained token carries its call's advantage ``adv`` and ``weight`` (its call's share of its task
objective, see ``retrojax.learn.batch``), so the token-averaged, decision-averaged, task-averaged objective is
a plain weighted sum. Execution and reflection tokens are summed separately (disjoint masks) for logging;
reflection weights already include λ_ref. Optional KL to a frozen reference (k3) when ``kl_coef > 0``.

Log-probabilities come from ``retrojax.model.token_logprobs`` (chunked; never [B, T, V] logits).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from retrojax.learn.precision import cast_like
from retrojax.model import token_logprobs


def merge_params(graphdef: Any, template: Any, params: dict) -> Any:
    """The nnx module for ``params`` (a pure dict), built from ``graphdef`` and an abstract state template.

    Each weight takes the template's dtype: float32 master weights (retrojax.learn.precision) become the
    model's compute dtype here, inside the traced loss, so their gradients come back in float32.
    """
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, cast_like(state, template))


def model_logprobs(graphdef: Any, template: Any, params: dict, batch: dict[str, jax.Array],
                   chunk: int, temperature: float = 1.0) -> jax.Array:
    """Per-token log-probs of the batch's targets under the policy as sampled (at ``temperature``).

    A token-forest batch (``tree_exit`` present, see ``retrojax.learn.layout``) gives one log-prob per term.
    """
    model = merge_params(graphdef, template, params)
    if "tree_exit" in batch:
        return token_logprobs(model, batch["input_ids"], batch["targets"], positions=batch["positions"],
                              tree_exit=batch["tree_exit"], target_nodes=batch["term_node"], chunk=chunk,
                              temperature=temperature)
    return token_logprobs(model, batch["input_ids"], batch["targets"],
                          attention_mask=batch["attention_mask"], chunk=chunk, temperature=temperature)


def surrogate_loss(new_lp: jax.Array, batch: dict[str, jax.Array], *, clip_eps: float,
                   clip_eps_high: float | None = None, kl_coef: float = 0.0
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Eq. 19 from per-token log-probs under the current policy. Returns (loss, metrics)."""
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    em = batch["exec_mask"]
    rm = batch["ref_mask"]
    mask = em | rm
    adv = batch["adv"]
    w = batch["weight"]
    # Masked positions get log-ratio 0 so that nothing non-finite reaches the gradient through them.
    log_ratio = jnp.where(mask, new_lp - batch["old_logprobs"], 0.0)
    ratio = jnp.exp(log_ratio)
    surr = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + hi) * adv)
    loss_exec = -jnp.sum(jnp.where(em, w * surr, 0.0))
    loss_ref = -jnp.sum(jnp.where(rm, w * surr, 0.0))
    loss = loss_exec + loss_ref
    metrics: dict[str, jax.Array] = {}
    if kl_coef > 0.0:
        d = jnp.where(mask, batch["ref_logprobs"] - new_lp, 0.0)
        k3 = jnp.exp(d) - d - 1.0
        loss_kl = kl_coef * jnp.sum(jnp.where(mask, w * k3, 0.0))
        loss = loss + loss_kl
        metrics["loss_kl"] = loss_kl
    n = jnp.maximum(jnp.sum(mask), 1)

    def mean(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(mask, x, 0.0)) / n

    adv_mean = mean(adv)
    metrics.update(
        loss=loss,
        loss_exec=loss_exec,
        loss_ref=loss_ref,
        clip_frac=mean(((ratio < 1.0 - clip_eps) | (ratio > 1.0 + hi)).astype(jnp.float32)),
        approx_kl=mean(ratio - 1.0 - log_ratio),
        ratio_mean=mean(ratio),
        entropy_est=mean(-new_lp),
        adv_token_mean=adv_mean,
        adv_token_std=jnp.sqrt(jnp.maximum(mean(jnp.square(adv)) - adv_mean ** 2, 0.0)),
        trained_tokens=jnp.sum(mask).astype(jnp.float32),
    )
    return loss, metrics
