"""Float32 master weights beside a bfloat16 model (retrojax.learn.precision), through the real trainer.

A bfloat16 weight near 0.02 is spaced 1.2e-4 apart, so AdamW at learning rate 1e-6 stepping bfloat16 weights
in place changes almost none of them; with float32 masters every weight with a gradient moves. Checkpoints
hold the masters (resume is exact); the sampler and ``export`` get the model's dtype.
"""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_learn_trainer import MICRO, collect

from retrojax.config import from_dict
from retrojax.learn import sft
from retrojax.learn.precision import cast_like, master_copy
from retrojax.learn.trainer import Trainer
from retrojax.model import Qwen3


def bf16_trainer(out_dir, **learn) -> Trainer:
    cfg = from_dict({
        "model": {"dtype": "bfloat16"},
        "learn": {"updates": 2, "tasks_per_update": 2, "seq_buckets": [48], "max_batch_tokens": 48 * 16,
                  "learning_rate": 1e-6, "logprob_chunk": 16, "check_logprobs": False, **learn},
        "eval": {"every": -1},
        "run": {"out_dir": str(out_dir), "seed": 3},
    })
    model = Qwen3(MICRO, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    return Trainer(cfg, model, collect=collect, evaluate=None, num_tasks=4, tensorboard=False, progress=False)


def changed_fraction(before, after) -> float:
    flat_a = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(before)])
    flat_b = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(after)])
    return float(np.mean(flat_a != flat_b))


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> dict:
    """One two-update run of a bfloat16 model with float32 masters, its directory copied after update 1 (a run
    killed there) and resumed from the copy by a fresh trainer (sharing the run's jitted update), which then
    exports. The checks below read what it recorded."""
    root = tmp_path_factory.mktemp("bf16")
    full = bf16_trainer(root / "full")
    out: dict = {"init": jax.tree.map(np.asarray, full.params)}
    full.fit(1)
    out["after_1"] = jax.tree.map(np.asarray, full.params)
    out["opt_dtypes"] = [x.dtype for x in jax.tree.leaves(full.opt_state)
                         if jnp.issubdtype(x.dtype, jnp.floating)]
    out["policy_dtypes"] = [x.dtype for x in jax.tree.leaves(nnx.state(full.model(), nnx.Param))]
    shutil.copytree(root / "full", root / "resumed")
    full.fit()
    out["reference"] = jax.tree.map(np.asarray, full.params)
    resumed = bf16_trainer(root / "resumed")
    resumed.update, resumed.logprobs = full.update, full.logprobs
    full.close()
    resumed.fit(resume=True)
    out["resumed_iteration"] = resumed.iteration
    out["resumed"] = jax.tree.leaves(resumed.params)
    out["export"] = resumed.export(root / "policy")
    resumed.close()
    return out


def test_a_bfloat16_model_at_lr_1e6_moves_its_float32_masters(bf16_run, tmp_path):
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16_run["init"]))
    assert bf16_run["opt_dtypes"] and all(d == jnp.float32 for d in bf16_run["opt_dtypes"])
    moved = changed_fraction(bf16_run["init"], bf16_run["after_1"])
    assert moved > 0.5, moved  # every weight with a nonzero gradient takes a ~1e-6 step
    # what the sampler decodes with: the model's dtype
    assert bf16_run["policy_dtypes"] and all(d == jnp.bfloat16 for d in bf16_run["policy_dtypes"])

    # The same run stepping the bfloat16 weights in place: the steps round away.
    m = bf16_trainer(tmp_path / "model", master_dtype="model")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(m.params))
    before = jax.tree.map(np.asarray, m.params)
    m.fit(1)
    assert changed_fraction(before, m.params) < 0.05
    m.close()


def test_bfloat16_resume_is_exact_and_export_writes_the_model_dtype(bf16_run):
    assert bf16_run["resumed_iteration"] == 2
    reference = bf16_run["reference"]
    assert changed_fraction(bf16_run["after_1"], reference) > 0.5  # update 2 was taken after the resume
    for x, y in zip(jax.tree.leaves(reference), bf16_run["resumed"], strict=True):
        assert y.dtype == jnp.float32
        np.testing.assert_array_equal(x, np.asarray(y))
    from retrojax.model.checkpoint import from_pretrained

    loaded = from_pretrained(bf16_run["export"], dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(loaded.embed[...]),
                                  reference["embed"].astype(jnp.bfloat16).astype(np.float32))


def test_master_dtype_is_validated(tmp_path):
    with pytest.raises(ValueError, match="master_dtype"):
        bf16_trainer(tmp_path, master_dtype="float16")


def test_master_copy_upcasts_only_narrow_floats():
    tree = {"w": jnp.ones((2,), jnp.bfloat16), "h": jnp.ones((2,), jnp.float16),
            "f": jnp.ones((2,), jnp.float32), "i": jnp.ones((2,), jnp.int32),
            "a": jax.ShapeDtypeStruct((3,), jnp.bfloat16)}
    up = master_copy(tree)
    assert {k: v.dtype for k, v in up.items()} == {"w": jnp.float32, "h": jnp.float32, "f": jnp.float32,
                                                    "i": jnp.int32, "a": jnp.float32}
    assert master_copy(tree, "model") is tree
    down = cast_like({k: v for k, v in up.items() if k != "a"}, {k: v for k, v in tree.items() if k != "a"})
    assert {k: v.dtype for k, v in down.items()} == {"w": jnp.bfloat16, "h": jnp.float16, "f": jnp.float32,
                                                      "i": jnp.int32}


def test_sft_on_a_bfloat16_model_keeps_float32_masters():
    """A bfloat16 model's SFT at a tiny rate: the model's weights move (float32 masters accumulate the steps
    and the model gets them cast down), where stepping bfloat16 in place would leave them unchanged."""
    rng = np.random.default_rng(0)
    examples = [sft.Example(ids=rng.integers(2, 60, 24).astype(np.int32), own=np.arange(24) >= 12)
                for _ in range(8)]
    moved = {}
    for master in ("float32", "model"):
        model = Qwen3(MICRO, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
        sft.train_sft(model, examples, steps=40, batch_size=4, learning_rate=1e-5, warmup_steps=0, chunk=16,
                      master_dtype=master)
        after = nnx.state(model, nnx.Param)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(after))
        moved[master] = changed_fraction(before, after)
    assert moved["float32"] > 2 * moved["model"], moved


def test_the_plan_counts_float32_masters():
    from retrojax.plan.memory import plan_update, shapes_from_config

    base = from_dict({"model": {"preset": "tiny", "dtype": "bfloat16"},
                      "learn": {"seq_buckets": [16], "max_batch_tokens": 16}, "sampler": {"max_len": 16}})
    # the byte counts scale with the parameter count alone: a micro shape compiles the plan's steps quickly
    shapes = dataclasses.replace(shapes_from_config(base), config=MICRO, rows=1, length=16)
    f32 = plan_update(base, shapes, None, remat=False, lora=None)
    low = plan_update(dataclasses.replace(base, learn=dataclasses.replace(base.learn, master_dtype="model")),
                      shapes, None, remat=False, lora=None)
    assert f32["trainable"] == pytest.approx(2 * low["trainable"])
    assert f32["opt"] == pytest.approx(2 * low["opt"], rel=0.01)
    assert f32["grads"] == pytest.approx(2 * low["grads"])


@pytest.mark.slow
def test_the_learner_learns_with_a_bfloat16_model(tmp_path):
    """The whole stack (sampler, T@3 trial loop, SA-GRPO, update) on a bfloat16 model with float32 masters:
    the rewarded action becomes likely, as it does in float32 (tests/test_learner_learns.py)."""
    from test_learner_learns import MICRO as WORD_MICRO
    from test_learner_learns import Collect, WordTokenizer, config, p_right

    cfg = config("sa_grpo", tmp_path)
    # no log-prob check and no reference pass (diagnostics only, the step does not read them): two fewer
    # compiled programs per microbatch shape
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"),
                              learn=dataclasses.replace(cfg.learn, check_logprobs=False, track_kl_ref=False))
    model = Qwen3(WORD_MICRO, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    start = p_right(model, cfg)
    trainer = Trainer(cfg, model, WordTokenizer(), collect=Collect(cfg), num_tasks=4, tensorboard=False,
                      progress=False)
    history = trainer.fit()
    end = p_right(trainer.model(), cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.params))
    assert start < 0.2, start
    assert end > start + 0.3, (start, end, [h.get("train/loss") for h in history])
    trainer.close()
