"""LoRA on the Flax Qwen3: no-op at init, merged == per-step, only adapters train, bf16 base + fp32 adapters,
adapters' logical axes follow their base weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retrojax.model import PRESETS, Qwen3
from retrojax.model.lora import adapter_axes, apply_lora, check_targets, join_params, merge_lora, split_params
from retrojax.parallel.shard import param_axes

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 9)), jnp.int32)


def _nonzero(model, scale=0.05):
    for i, t in enumerate(model.layers.targets):
        var = getattr(model.layers, f"{t}_lora_b")
        var.set_value(scale * jax.random.normal(jax.random.PRNGKey(i), var.shape, var.dtype))
    return model


def test_fresh_adapters_change_nothing_and_merge_matches_per_step():
    model = Qwen3(PRESETS["tiny"])
    base = model(IDS)
    apply_lora(model, rank=4, alpha=8.0, targets=("q_proj", "o", "down"))
    assert model.layers.targets == ("q", "o", "down")
    np.testing.assert_array_equal(np.asarray(model(IDS)), np.asarray(base))
    _nonzero(model)
    lora = model(IDS)
    assert float(jnp.abs(lora - base).max()) > 1e-3
    np.testing.assert_allclose(np.asarray(merge_lora(model)(IDS)), np.asarray(lora), atol=1e-5)


def test_only_adapters_get_gradients_and_bf16_base_keeps_fp32_adapters():
    model = _nonzero(apply_lora(Qwen3(PRESETS["tiny"], dtype=jnp.bfloat16), rank=4, alpha=8.0))
    graphdef, template, adapters, base = split_params(model)
    assert all("_lora_" in k for k in adapters["layers"]) and not any("_lora_" in k for k in base["layers"])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(base))
    from retrojax.learn.loss import merge_params

    grads = jax.grad(lambda a: merge_params(graphdef, template, join_params(a, base))(IDS).sum())(adapters)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["layers"]["q_lora_a"]).sum()) > 0


def test_adapter_axes_follow_the_base_weights():
    model = apply_lora(Qwen3(PRESETS["tiny"]), rank=4, alpha=8.0)
    axes = param_axes(model)["layers"]
    assert axes["q_lora_a"] == ("layers", "embed", None) and axes["q_lora_b"] == ("layers", None, "heads",
                                                                                   "head_dim")
    assert axes["o_lora_a"] == ("layers", "heads", "head_dim", None) and axes["down_lora_b"] == adapter_axes(
        "down")[1] == ("layers", None, "embed")


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="not a Qwen3 projection"):
        check_targets(["q", "lm_head"])
    with pytest.raises(ValueError, match="rank"):
        apply_lora(Qwen3(PRESETS["tiny"]), rank=0, alpha=8.0)
