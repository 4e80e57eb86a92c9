"""8 simulated devices vs 1 device: the same logits, loss, gradients, optimizer step and greedy decoding.

Each check runs in a subprocess (the simulated device count must be set before JAX starts).
"""

from __future__ import annotations

import pytest

from retrojax.parallel.testing import run_snippet

PARITY = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from retrojax.config import from_dict
from retrojax.learn.update import make_update
from retrojax.model import PRESETS, Qwen3
from retrojax.model.build import create_sharded
from retrojax.parallel.mesh import make_mesh
from retrojax.parallel.rules import activation_sharding
from retrojax.parallel.shard import global_batch, place_params
from retrojax.sampler import Sampler

assert jax.device_count() == 8
c = PRESETS["tiny"]
mesh = make_mesh(2, 2, 2)
one = Qwen3(c, rngs=nnx.Rngs(0))
many = create_sharded(c, mesh, seed=0)
out = {}

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))

p1 = nnx.to_pure_dict(nnx.state(one))
pm = nnx.to_pure_dict(nnx.state(many))
host_params = jax.tree.map(np.asarray, pm)  # the initial weights, for the sampler check below
out["init_equal"] = max(rel(a, b) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(pm)))

rng = np.random.default_rng(0)
ids = rng.integers(0, c.vocab_size, (8, 24)).astype(np.int32)
with activation_sharding(mesh):
    logits_many = jax.jit(lambda m, x: m(x))(many, ids)
logits_one = jax.jit(lambda m, x: m(x))(one, ids)
out["logits"] = float(np.max(np.abs(np.asarray(logits_one) - np.asarray(logits_many))))

def batch(rows, length, seed):
    r = np.random.default_rng(seed)
    mask = np.zeros((rows, length), bool)
    mask[:, length // 3:] = True
    return {"input_ids": r.integers(0, c.vocab_size, (rows, length)).astype(np.int32),
            "targets": r.integers(0, c.vocab_size, (rows, length)).astype(np.int32),
            "attention_mask": np.ones((rows, length), bool),
            "old_logprobs": np.full((rows, length), -6.9, np.float32),
            "adv": r.normal(size=(rows, length)).astype(np.float32),
            "weight": np.where(mask, 1.0 / mask.sum(), 0.0).astype(np.float32),
            "exec_mask": mask, "ref_mask": np.zeros((rows, length), bool)}

cfg = from_dict({"learn": {"learning_rate": 1e-3, "logprob_chunk": 16, "max_grad_norm": 0.0}})
u1, q1, o1 = make_update(one, cfg.learn, 10)
um, qm, om = make_update(many, cfg.learn, 10, mesh=mesh)
b0 = batch(8, 32, 1)
(l1, _), g1 = u1.fwd_bwd(q1, {k: jnp.asarray(v) for k, v in b0.items()})
(lm, _), gm = um.fwd_bwd(qm, global_batch(b0, um.plan))
out["loss"] = rel(l1, lm)
out["grads"] = max(rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(gm)))
# one optimizer step, then two more over a second bucket shape: one trace per bucket
shapes = [(8, 32), (8, 32), (8, 64)]
before = jax.tree.map(np.asarray, q1)
gfirst = None
for i, (rows, length) in enumerate(shapes):
    b = batch(rows, length, 10 + i)
    if i == 0:
        gfirst = jax.tree.map(np.asarray, u1.fwd_bwd(q1, {k: jnp.asarray(v) for k, v in b.items()})[1])
    q1, o1, m1 = u1(q1, o1, {k: jnp.asarray(v) for k, v in b.items()})
    qm, om, mm = um(qm, om, global_batch(b, um.plan))
    if i == 0:
        # Adam's first step is lr * g / (|g| + eps): exact where the gradient is not at rounding level
        worst = 0.0
        for p0, a, b_, g in zip(jax.tree.leaves(before), jax.tree.leaves(q1), jax.tree.leaves(qm),
                                jax.tree.leaves(gfirst)):
            keep = np.abs(g) >= 1e-4 * np.max(np.abs(g))
            d = np.abs(np.asarray(a) - np.asarray(b_))[keep]
            worst = max(worst, float(d.max(initial=0.0)) / float(np.max(np.abs(p0))))
        out["step"] = worst
    out[f"loss{i}"] = rel(m1["loss"], mm["loss"])
out["traces"] = um.traces
out["params_on_plan"] = all(a.sharding == s
                            for a, s in zip(jax.tree.leaves(qm), jax.tree.leaves(um.plan.params)))
out["opt_on_plan"] = all(a.sharding == s for a, s in zip(jax.tree.leaves(om), jax.tree.leaves(um.plan.opt)))
out["opt_all_global"] = all(a.sharding.mesh.devices.size == 8 for a in jax.tree.leaves(om))
out["metrics_replicated"] = all(v.sharding.is_fully_replicated for v in mm.values())
out["q_spec"] = str(qm["layers"]["q"].sharding.spec)
out["embed_spec"] = str(qm["embed"].sharding.spec)

# sampler: greedy decoding with rollout-profile weights (tp only) and a sharded cache
from retrojax.learn.loss import merge_params

s1 = Sampler(merge_params(u1.graphdef, u1.template, jax.tree.map(jnp.asarray, host_params)), rows=4,
             max_len=64, chunk_buckets=(16,))
sm = Sampler(merge_params(um.graphdef, um.template, place_params(host_params, um.plan.rollout_params)),
             rows=4, max_len=64, chunk_buckets=(16,))
out["rollout_specs"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(nnx.state(sm._state))})
layout = sm.cache.k.sharding
out["cache_spec"] = str(layout.spec)
prompts = [list(rng.integers(0, 256, 5 + r)) for r in range(4)]
same_layout = []
for s in (s1, sm):
    s.append(range(4), prompts)
same_layout.append([sm.cache.k.sharding.is_equivalent_to(layout, 5), str(sm.cache.k.sharding)])
g1 = s1.generate(range(4), 6, temperature=0.0, stop_token_ids=())
gm = sm.generate(range(4), 6, temperature=0.0, stop_token_ids=())
same_layout.append([sm.cache.k.sharding.is_equivalent_to(layout, 5), str(sm.cache.k.sharding)])
for s in (s1, sm):
    s.rewind(1, 3)
    s.append([1], [[7, 8]])
h1 = s1.generate([1], 4, temperature=0.0, stop_token_ids=())
hm = sm.generate([1], 4, temperature=0.0, stop_token_ids=())
same_layout.append([sm.cache.k.sharding.is_equivalent_to(layout, 5), str(sm.cache.k.sharding)])
out["ids"] = [[a.ids.tolist(), b.ids.tolist()] for a, b in zip(g1 + h1, gm + hm)]
out["greedy_same"] = all(np.array_equal(a.ids, b.ids) for a, b in zip(g1 + h1, gm + hm))
out["greedy_lp"] = max(float(np.max(np.abs(a.logprobs - b.logprobs))) for a, b in zip(g1 + h1, gm + hm))
out["cache_layout_kept"] = all(ok for ok, _ in same_layout)
out["cache_layouts"] = same_layout
print(json.dumps(out))
"""


@pytest.mark.slow
def test_eight_devices_match_one_device():
    r = run_snippet(PARITY, devices=8)
    assert r["init_equal"] == 0.0  # created directly sharded: the same draw as on one device
    assert r["logits"] <= 1e-5
    # relative, float32 sums in another order: before and after the flattened projections the loss
    # differences measured 6.8e-7 / 2.3e-6 and those of the three steps up to 2.5e-6; the gradients' 1.5e-6
    # with XLA:CPU's loop emitters (`make test`'s --xla_cpu_use_fusion_emitters=false), below 1e-6 without
    assert r["loss"] <= 1e-5 and r["grads"] <= 5e-6
    assert r["step"] <= 1e-6  # params after one step, relative
    assert max(r["loss0"], r["loss1"], r["loss2"]) <= 1e-5  # the losses of three steps
    assert r["traces"] == 2  # two bucket shapes over three steps
    assert r["params_on_plan"] and r["opt_on_plan"] and r["opt_all_global"] and r["metrics_replicated"]
    assert r["q_spec"] == "P(None, 'fsdp', 'tp', None)"
    assert r["embed_spec"] == "P('tp', 'fsdp')"
    assert r["cache_spec"] == "P(None, ('data', 'fsdp'), 'tp', None, None)"  # k: [L, rows, kv heads, D, S]
    assert all("fsdp" not in spec and "data" not in spec for spec in r["rollout_specs"])
    assert r["greedy_same"], r["ids"]
    assert r["greedy_lp"] <= 1e-5
    assert r["cache_layout_kept"], r["cache_layouts"]
