"""The learner-learns check with LoRA: the tiny Qwen3 of tests/test_learner_learns.py, adapters only.

Real sampler, trial loop, advantages and jitted update (through ``Trainer``); only the rank-4 adapters train
(the base stays bit-identical, AdamW state covers the adapters only) and the rewarded action's probability
rises. The checkpoint holds the adapters and names the base.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from test_learner_learns import MICRO, Collect, WordTokenizer, config, p_right

from retrojax.config import LoraConfig
from retrojax.learn.trainer import Trainer
from retrojax.model import Qwen3
from retrojax.model.lora import apply_lora, trainable_fraction


@pytest.mark.slow
def test_lora_makes_the_rewarded_action_likely(tmp_path):
    cfg = config("sa_grpo", tmp_path)
    lora = LoraConfig(rank=8, alpha=32.0)
    cfg = dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, lora=lora, learning_rate=2e-2,
                                                                layout="rows"))
    base = Qwen3(MICRO, rngs=nnx.Rngs(0))
    # The final RMSNorm fixes |h|, so with the frozen N(0, 0.02) embedding a logit can move by < 1 whatever
    # the adapters do (P(right) could not pass ~0.2); a wider embedding lets the adapters steer the policy.
    base.embed.set_value(4.0 * base.embed[...])
    model = apply_lora(base, rank=lora.rank, alpha=lora.alpha, seed=0)
    assert 0 < trainable_fraction(model) < 0.5
    base_before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.layers, nnx.Param)))
    start = p_right(model, cfg)
    trainer = Trainer(cfg, model, WordTokenizer(), collect=Collect(cfg), num_tasks=4, tensorboard=False,
                      progress=False)
    assert sorted(trainer.params) == ["layers"] and all("_lora_" in k for k in trainer.params["layers"])
    n_adapter = sum(x.size for x in jax.tree.leaves(trainer.params))
    n_opt = sum(x.size for x in jax.tree.leaves(trainer.opt_state) if np.ndim(x) > 0)
    assert n_opt == 2 * n_adapter  # AdamW's mu and nu: adapters only
    history = trainer.fit()
    policy = trainer.model()
    end = p_right(policy, cfg)
    assert start < 0.2, start
    assert end > start + 0.3, (start, end, [h.get("train/loss") for h in history])
    after = nnx.to_pure_dict(nnx.state(policy.layers, nnx.Param))
    for name in ("q", "k", "v", "o", "gate", "up", "down", "attn_norm"):
        np.testing.assert_array_equal(np.asarray(after[name]), base_before[name])  # the base never moved
    meta = trainer.checkpoints.meta()
    assert meta["base"]["preset"] == "tiny"
    step = trainer.checkpoints.latest_step()
    saved = json.dumps(sorted(p.name for p in (tmp_path / "checkpoints" / str(step) / "params").rglob("*")))
    assert "lora" in saved or (tmp_path / "checkpoints").exists()
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["plan.route"] == "lora" and plan["plan.trainable_gb"] < plan["plan.params_gb"]
