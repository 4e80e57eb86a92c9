"""Batch layout, the eq. 19 loss against a plain numpy reference, gradients, skip-on-non-finite, retracing."""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retrojax.agent.archive import EXECUTION
from retrojax.config import LearnConfig
from retrojax.learn.advantages import compute_advantages
from retrojax.learn.batch import chain_segment, extends, plan_batches
from retrojax.learn.loss import surrogate_loss
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.update import LogProbs, Update, make_optimizer, split_model
from retrojax.model import Qwen3, Qwen3Config

MICRO = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256)
BUCKETS = (48, 96)
LAMBDA_REF = 0.5


def micro_model(seed: int = 0) -> Qwen3:
    from flax import nnx

    return Qwen3(MICRO, rngs=nnx.Rngs(seed))


def per_call_logprobs(model: Qwen3, calls) -> list[np.ndarray]:
    """Each call's output log-probs from its own sequence (no chaining): the reference layout."""
    graphdef, template, params = split_model(model)
    lp = LogProbs(graphdef, template, chunk=16)
    seqs = [np.concatenate([c.prompt_ids, c.output_ids]) for c in calls]
    width = 96
    ids = np.zeros((len(seqs), width), np.int32)
    tgt = np.zeros((len(seqs), width), np.int32)
    am = np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):
        ids[i, : s.size - 1], tgt[i, : s.size - 1], am[i, : s.size - 1] = s[:-1], s[1:], True
    out = np.asarray(lp(params, {"input_ids": ids, "targets": tgt, "attention_mask": am}))
    return [out[i, len(c.prompt_ids) - 1: len(c.prompt_ids) - 1 + len(c.output_ids)]
            for i, c in enumerate(calls)]


def reference_loss(archive, adv, new_lp: dict, clip_eps: float, lambda_ref: float) -> tuple[float, float]:
    """Eq. 19 in plain numpy from the archive: per task, mean over decisions of token-mean clipped surrogate
    (A_cont) + λ_ref × one token mean over all eligible reflection tokens (A_ref); mean over tasks."""
    calls = {(c.task, c.trial, c.call_index): c for c in archive.calls}
    per_task: dict[int, dict[str, list]] = defaultdict(lambda: {"exec": [], "ref": []})
    for cr in adv.credits:
        key = (cr.task, cr.trial, cr.call_index)
        c = calls[key]
        ratio = np.exp(new_lp[key].astype(np.float64) - np.asarray(c.logprobs, np.float64))
        surr = np.minimum(ratio * cr.advantage, np.clip(ratio, 1 - clip_eps, 1 + clip_eps) * cr.advantage)
        if cr.role == EXECUTION:
            per_task[cr.task]["exec"].append(float(surr.mean()))
        else:
            per_task[cr.task]["ref"].extend(surr.tolist())  # tokens of every reflection, pooled
    ex = [-np.mean(v["exec"]) if v["exec"] else 0.0 for v in per_task.values()]
    rf = [-lambda_ref * np.mean(v["ref"]) if v["ref"] else 0.0 for v in per_task.values()]
    return float(np.mean(ex)), float(np.mean(rf))


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    arch = synthetic_archive(rng, tasks=2, trials=3, vocab=64, segments=2, decisions=3, prompt_len=24,
                             turn_len=6, output_len=8)
    model = micro_model()
    lps = per_call_logprobs(model, arch.calls)
    for c, lp in zip(arch.calls, lps, strict=True):  # behaviour log-probs near the model's: some clipped
        c.logprobs = (lp + rng.normal(0.0, 0.3, lp.shape)).astype(np.float32)
    adv = compute_advantages(arch, "sa_grpo")
    new_lp = {(c.task, c.trial, c.call_index): lp for c, lp in zip(arch.calls, lps, strict=True)}
    graphdef, template, params = split_model(model)
    tx, _ = make_optimizer(LearnConfig(learning_rate=1e-2), 10)
    upd = Update(graphdef, template, tx, clip_eps=0.2, chunk=16)
    plan = plan_batches(arch, adv, lambda_ref=LAMBDA_REF, seq_buckets=BUCKETS, max_batch_tokens=4096)
    return arch, adv, new_lp, upd, params, plan


def test_segments_chain_into_one_sequence(setup):
    arch, adv, *_ = setup
    seg0 = [c for c in arch.calls if c.trial == 0 and c.segment == 0 and c.role == EXECUTION]
    assert all(extends(a, b) for a, b in zip(seg0, seg0[1:], strict=False))
    assert [len(ch) for ch in chain_segment(seg0, 96)] == [3]
    assert [len(ch) for ch in chain_segment(seg0, 40)] == [1, 1, 1]  # a chain never outgrows the bucket
    # A re-rendered earlier turn breaks the prefix relation: one sequence per call from there on.
    altered = dataclasses.replace(seg0[1], prompt_ids=seg0[1].prompt_ids.copy())
    altered.prompt_ids[3] = (altered.prompt_ids[3] + 1) % MICRO.vocab_size
    assert not extends(seg0[0], altered)
    assert [len(ch) for ch in chain_segment([seg0[0], altered, seg0[2]], 96)] == [1, 1, 1]


def test_batch_masks_and_weights(setup):
    arch, adv, *_ = setup
    plan = plan_batches(arch, adv, lambda_ref=LAMBDA_REF, seq_buckets=BUCKETS, max_batch_tokens=4096)
    calls = {(c.task, c.trial, c.call_index): c for c in arch.calls}
    expected_tokens = sum(len(calls[(c.task, c.trial, c.call_index)].output_ids) for c in adv.credits)
    assert plan.stats["batch/trained_tokens"] == expected_tokens
    assert plan.stats["batch/prefix_breaks"] == 0
    n_tasks = len({c.task for c in adv.credits})
    weight_sum = 0.0
    for mb in plan.microbatches:
        a = mb.arrays
        assert mb.shape[1] in BUCKETS and (mb.shape[0] & (mb.shape[0] - 1)) == 0
        assert not np.any(a["exec_mask"] & a["ref_mask"])
        trained = a["exec_mask"] | a["ref_mask"]
        assert np.all(a["weight"][~trained] == 0) and np.all(a["weight"][trained] > 0)
        assert np.all(a["attention_mask"][trained])
        weight_sum += a["weight"][a["exec_mask"]].sum()  # one minibatch: microbatches sum to it
    # Execution weights: each task's decisions share 1, tasks are averaged.
    assert weight_sum == pytest.approx(1.0 if n_tasks else 0.0, rel=1e-5)
    # Zero-advantage calls can be left out (no gradient, no KL): same weights for the others.
    adv0 = copy.copy(adv)
    adv0.credits = [dataclasses.replace(adv.credits[0], advantage=0.0), *adv.credits[1:]]
    lean = plan_batches(arch, adv0, lambda_ref=LAMBDA_REF, seq_buckets=BUCKETS, max_batch_tokens=4096,
                        skip_zero=True)
    kept = sum(len(calls[(c.task, c.trial, c.call_index)].output_ids) for c in adv0.credits
               if c.advantage != 0.0)
    assert lean.stats["batch/trained_tokens"] == kept < expected_tokens
    w = np.concatenate([m.arrays["weight"][m.arrays["exec_mask"]] for m in lean.microbatches])
    full = np.concatenate([m.arrays["weight"][m.arrays["exec_mask"]] for m in plan.microbatches])
    assert set(np.round(w, 7)) <= set(np.round(full, 7))


def test_jitted_loss_equals_numpy_reference(setup):
    arch, adv, new_lp, upd, params, plan = setup
    ref_exec, ref_ref = reference_loss(arch, adv, new_lp, 0.2, LAMBDA_REF)
    assert len(plan.microbatches) == 2
    got = [jax.device_get(upd.fwd_bwd(params, mb.arrays)[0][1]) for mb in plan.microbatches]
    got_exec = sum(float(m["loss_exec"]) for m in got)  # microbatch losses add up to the minibatch's
    got_ref = sum(float(m["loss_ref"]) for m in got)
    assert got_exec == pytest.approx(ref_exec, rel=1e-4, abs=1e-6)
    assert got_ref == pytest.approx(ref_ref, rel=1e-4, abs=1e-6)
    assert 0.0 < np.mean([float(m["clip_frac"]) for m in got]) < 1.0


def test_gradient_only_through_trained_tokens(setup):
    arch, adv, new_lp, upd, params, plan = setup
    b = {k: jnp.asarray(v) for k, v in plan.microbatches[-1].arrays.items()}
    trained = np.asarray(b["exec_mask"] | b["ref_mask"])
    # d loss / d log-prob is zero at every untrained position (prompts, observations, padding).
    lp_any = jnp.asarray(np.random.default_rng(2).normal(-2.0, 0.5, trained.shape), jnp.float32)
    g = np.asarray(jax.grad(lambda lp: surrogate_loss(lp, b, clip_eps=0.2)[0])(lp_any))
    assert np.all(g[~trained] == 0.0) and np.any(g[trained] != 0.0)

    def vg(p, bb):
        (loss, _), grads = upd.fwd_bwd(p, bb)
        return loss, grads

    loss0, grad0 = vg(params, b)
    # Changing untrained targets, and everything after each row's last trained token, changes nothing.
    rng = np.random.default_rng(3)
    tgt = np.asarray(b["targets"]).copy()
    ids = np.asarray(b["input_ids"]).copy()
    tgt[~trained] = rng.integers(0, MICRO.vocab_size, size=int((~trained).sum()))
    for r in range(ids.shape[0]):
        pos = np.nonzero(trained[r])[0]
        last = pos.max() + 1 if pos.size else 0
        ids[r, last:] = rng.integers(0, MICRO.vocab_size, size=ids.shape[1] - last)
    b2 = dict(b, targets=jnp.asarray(tgt), input_ids=jnp.asarray(ids))
    loss1, grad1 = vg(params, b2)
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-6)
    for x, y in zip(jax.tree.leaves(grad0), jax.tree.leaves(grad1), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-8)
    # Finite differences along a random direction agree with the gradient (on-policy batch: ratio 1, away
    # from the clipping kinks, as in an update's first step).
    on_policy = copy.deepcopy(arch)
    for c in on_policy.calls:
        c.logprobs = new_lp[(c.task, c.trial, c.call_index)].astype(np.float32)
    plan_fd = plan_batches(on_policy, adv, lambda_ref=LAMBDA_REF, seq_buckets=BUCKETS, max_batch_tokens=4096)
    b = {k: jnp.asarray(v) for k, v in plan_fd.microbatches[-1].arrays.items()}
    loss0, grad0 = vg(params, b)
    rs = np.random.default_rng(4)
    host = jax.tree.map(np.asarray, params)
    direction = jax.tree.map(lambda x: rs.standard_normal(x.shape).astype(np.float32), host)
    scale = 1.0 / np.sqrt(sum(float(np.vdot(d, d)) for d in jax.tree.leaves(direction)))
    direction = jax.tree.map(lambda d: d * np.float32(scale), direction)  # unit norm: a small, smooth step
    h = 1e-2
    plus = vg(jax.tree.map(lambda p, d: p + np.float32(h) * d, host, direction), b)[0]
    minus = vg(jax.tree.map(lambda p, d: p - np.float32(h) * d, host, direction), b)[0]
    fd = (float(plus) - float(minus)) / (2 * h)
    pairs = zip(jax.tree.leaves(jax.device_get(grad0)), jax.tree.leaves(direction), strict=True)
    analytic = sum(float(np.vdot(g_, d_)) for g_, d_ in pairs)
    assert fd == pytest.approx(analytic, rel=1e-2, abs=1e-5)


def test_update_compiles_once_and_skips_non_finite(setup):
    arch, adv, _, upd, params, plan = setup
    b = plan.microbatches[-1].arrays
    p = jax.tree.map(jnp.copy, params)
    opt = upd.tx.init(p)
    before = jax.tree.map(np.asarray, p)
    for _ in range(3):
        p, opt, m = upd(p, opt, b)
        assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["loss"]))
    assert upd.traces == 1
    moved = jax.tree.map(np.asarray, p)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(moved),
                                                        strict=True))
    bad = dict(b, adv=np.where(b["exec_mask"] | b["ref_mask"], np.nan, b["adv"]).astype(np.float32))
    opt_before = jax.tree.map(np.asarray, opt)
    p, opt, m = upd(p, opt, bad)
    assert float(m["skipped"]) == 1.0
    for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(p), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    for x, y in zip(jax.tree.leaves(opt_before), jax.tree.leaves(opt), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert upd.traces == 1  # same shape, new values: no retrace


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_surrogate_equals_numpy_on_random_arrays(seed):
    """Asymmetric clipping and the k3 KL term, on random token arrays (no model)."""
    rng = np.random.default_rng(seed)
    shape = (3, 17)
    trained = rng.random(shape) < 0.6
    exec_mask = trained & (rng.random(shape) < 0.7)
    b = {"exec_mask": exec_mask, "ref_mask": trained & ~exec_mask,
         "adv": rng.normal(size=shape).astype(np.float32),
         "weight": np.where(trained, rng.random(shape), 0.0).astype(np.float32),
         "old_logprobs": np.where(trained, -rng.random(shape) * 3, 0.0).astype(np.float32),
         "ref_logprobs": (-rng.random(shape) * 3).astype(np.float32)}
    new = (b["old_logprobs"] + rng.normal(0, 0.4, shape)).astype(np.float32)
    lo, hi, kl = 0.2, 0.28, 0.05
    loss, m = jax.jit(lambda lp: surrogate_loss(lp, b, clip_eps=lo, clip_eps_high=hi, kl_coef=kl))(new)
    r = np.exp(new.astype(np.float64) - b["old_logprobs"])
    surr = np.minimum(r * b["adv"], np.clip(r, 1 - lo, 1 + hi) * b["adv"])
    d = b["ref_logprobs"] - new.astype(np.float64)
    k3 = np.exp(d) - d - 1
    w = b["weight"].astype(np.float64)
    want_exec = -np.sum((w * surr)[b["exec_mask"]])
    want_ref = -np.sum((w * surr)[b["ref_mask"]])
    want_kl = kl * np.sum((w * k3)[trained])
    assert float(m["loss_exec"]) == pytest.approx(want_exec, rel=1e-5, abs=1e-6)
    assert float(m["loss_ref"]) == pytest.approx(want_ref, rel=1e-5, abs=1e-6)
    assert float(m["loss_kl"]) == pytest.approx(want_kl, rel=1e-5, abs=1e-6)
    assert float(loss) == pytest.approx(want_exec + want_ref + want_kl, rel=1e-5, abs=1e-6)
    clipped = ((r < 1 - lo) | (r > 1 + hi))[trained].mean()
    assert float(m["clip_frac"]) == pytest.approx(clipped, abs=1e-6)
