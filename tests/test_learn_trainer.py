"""The training loop around a deterministic synthetic collector: logs, checkpoints, exact resume, export."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from retrojax.config import from_dict
from retrojax.learn.checkpoint import TrainCheckpoints
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.trainer import TaskStream, Trainer
from retrojax.model import Qwen3, Qwen3Config

MICRO = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256)


def micro_model() -> Qwen3:
    from flax import nnx

    return Qwen3(MICRO, rngs=nnx.Rngs(0))


def collect(model, tasks, seeds):
    """Trials whose tokens and rewards follow from the seeds alone (as the real runner's do)."""
    arch = synthetic_archive(np.random.default_rng(list(seeds)), tasks=len(tasks), trials=2,
                             vocab=MICRO.vocab_size, segments=2, decisions=2, prompt_len=20, turn_len=4,
                             output_len=6)
    for rec in [*arch.calls, *arch.segments, *arch.recoveries, *arch.trials]:
        rec.task = int(tasks[rec.task])
    return arch, {"trials": float(len(arch.trials))}


def config(out_dir, **learn):
    return from_dict({
        "learn": {"updates": 3, "tasks_per_update": 2, "seq_buckets": [48], "max_batch_tokens": 48 * 16,
                  "learning_rate": 1e-2, "logprob_chunk": 16, **learn},
        "eval": {"every": 2},
        "run": {"out_dir": str(out_dir), "seed": 3, "keep_checkpoints": 2},
    })


def evaluate(model, iteration):
    return {"iteration_seen": float(iteration)}


def trainer(out_dir, **learn) -> Trainer:
    return Trainer(config(out_dir, **learn), micro_model(), collect=collect, evaluate=evaluate, num_tasks=5,
                   tensorboard=True, progress=False)


def test_task_stream_is_seeded_and_resumable():
    a = TaskStream(5, seed=1)
    first = a.take(3) + a.take(4)
    assert sorted(first[:5]) == list(range(5))  # one epoch is a permutation
    b = TaskStream(5, seed=1)
    b.take(3)
    c = TaskStream(5, seed=1, **b.position())
    assert c.take(4) == first[3:]


def test_kill_and_resume_gives_the_same_params(tmp_path):
    full = trainer(tmp_path / "full")
    hist = full.fit()
    assert [h["iteration"] for h in hist] == [1.0, 2.0, 3.0]
    assert all(h["train/skipped_steps"] == 0.0 and np.isfinite(h["train/loss"]) for h in hist)
    assert "check/logprob_gap_mean" in hist[0] and hist[0]["rollout/trials"] == 4.0
    assert "eval/iteration_seen" in hist[1] and "eval/iteration_seen" not in hist[0]
    reference = jax.tree.map(np.asarray, full.params)
    full.close()

    # (The log-prob check changes no params; leaving it out of these two runs saves compiles.)
    # (Neither setting changes the update or the optimizer: both runs reuse the full run's jitted ones.)
    killed = trainer(tmp_path / "resumed", checkpoint_every=2, check_logprobs=False)
    killed.update, killed.logprobs = full.update, full.logprobs
    killed.fit(5, stop_after=3)  # "killed" after update 3, whose checkpoint was never written
    assert TrainCheckpoints(tmp_path / "resumed" / "checkpoints").all_steps() == [2]
    killed.close()
    resumed = trainer(tmp_path / "resumed", check_logprobs=False)
    resumed.update, resumed.logprobs = full.update, full.logprobs
    hist2 = resumed.fit(resume=True)
    assert resumed.iteration == 3 and [h["iteration"] for h in hist2] == [1.0, 2.0, 3.0]
    for x, y in zip(jax.tree.leaves(reference), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert hist2[-1]["train/loss"] == pytest.approx(hist[-1]["train/loss"], rel=1e-6)

    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1.0, 2.0, 3.0]
    assert list((tmp_path / "resumed" / "tb").glob("events.out.tfevents.*"))
    assert TrainCheckpoints(tmp_path / "resumed" / "checkpoints").all_steps() == [2, 3]  # keep the last 2

    out = resumed.export(tmp_path / "policy")
    from retrojax.model.checkpoint import from_pretrained

    loaded = from_pretrained(out)
    np.testing.assert_array_equal(np.asarray(loaded.embed[...]), reference["embed"])
    resumed.close()


def test_train_tasks_keeps_the_learner_on_a_pool(tmp_path):
    """``learn.train_tasks`` N: each collected group is one of the first N training levels, each revisited."""
    seen: list[int] = []

    def recording(model, tasks, seeds):
        seen.extend(int(t) for t in tasks)
        return collect(model, tasks, seeds)

    t = Trainer(config(tmp_path, train_tasks=2, updates=3), micro_model(), collect=recording,
                evaluate=evaluate, num_tasks=5, tensorboard=False, progress=False)
    t.fit()
    assert sorted(seen) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="train_tasks"):
        trainer(tmp_path, train_tasks=0)


def test_bad_learn_settings_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="old_logprobs"):
        trainer(tmp_path, old_logprobs="fresh")
    with pytest.raises(ValueError, match="estimator.*epochs"):
        trainer(tmp_path, estimator="ppo", epochs=0)


def test_cli_reports_a_bad_config(tmp_path, capsys):
    from retrojax.cli import main

    assert main(["train", "--config", "configs/sokoban_tiny.yaml", "--set", "learn.estimator=ppo"]) == 2
    assert "learn.estimator" in capsys.readouterr().err


class _CheckingUpdate:
    """The trainer's update, checking while it runs that the collector let go of its sampling weights (on a
    real model, gigabytes the update would hold beside its own): sampling raises and changes no row."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.inner, self.released = trainer, trainer.update, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, params, opt_state, group):
        from retrojax.sampler import SamplerError

        sampler = self.trainer.collect.policy.sampler
        length = sampler.book.length.copy()
        with pytest.raises(SamplerError, match="released"):
            sampler.append([0], [[1]])
        np.testing.assert_array_equal(sampler.book.length, length)
        self.released.append(self.trainer.collect.policy.model is None)
        return self.inner(params, opt_state, group)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_real_trial_loop_smoke(tmp_path, temperature):
    """Updates through the agent runner with a tiny random Qwen3: the sampler's log-probs match θ_old's
    recomputation and the update runs on the recorded tokens (a KL term keeps zero-advantage calls in). Below
    temperature 1 the learner scores the tempered distribution the rollouts were drawn from, so the gap stays
    at rounding level (scoring them untempered put it near 1 nat). At temperature 1, two updates: the
    collector holds no weights while an update runs, and the second collection samples with the updated
    weights (its log-probs match the recomputation under them)."""
    from retrojax.config import load
    from retrojax.model.build import build_model, build_tokenizer

    updates = 2 if temperature == 1.0 else 1
    cfg = load("configs/sokoban_tiny.yaml", [
        f"run.out_dir={tmp_path}", f"learn.updates={updates}", "learn.tasks_per_update=1",
        "trial.trials_per_task=2", "learn.kl_coef=0.01", "learn.seq_buckets=[2048]", "eval.every=-1",
        "env.num_tasks=4", "trial.max_calls=3", f"sampler.temperature={temperature}",
        "learn.learning_rate=1e-2"])
    tr = Trainer(cfg, build_model(cfg), build_tokenizer(cfg), progress=False, tensorboard=False)
    tr.update = checking = _CheckingUpdate(tr)
    try:
        history = tr.fit()
    finally:
        tr.close()
    assert len(history) == updates and len(checking.released) == updates and all(checking.released)
    for h in history:
        assert h["rollout/results/T@3/n"] == 2.0
        assert h["batch/sequences"] >= 1 and h["batch/dropped_calls"] == 0
        assert h["check/logprob_gap_max"] < 1e-4
        assert h["train/skipped_steps"] == 0.0 and np.isfinite(h["train/loss"])


def test_pool_lengths_keep_the_learner_on_levels_of_those_lengths(tmp_path):
    """``learn.pool_lengths`` [lo, hi]: every collected group is a level whose solution length is in range,
    read from the collector's env (the path of ``retrojax train``); a caller's ``pool`` wins."""
    seen: list[int] = []

    class Env:
        num_tasks = 6

        def task_scale(self, task):
            return float([2, 5, 3, 3, 7, 4][task])

    def recording(model, tasks, seeds):
        seen.extend(int(t) for t in tasks)
        return collect(model, tasks, seeds)

    recording.env = Env()
    t = Trainer(config(tmp_path, pool_lengths=[3, 4], updates=2, check_logprobs=False), micro_model(),
                collect=recording, evaluate=evaluate, tensorboard=False, progress=False)
    assert t.pool == [2, 3, 5]
    t.fit()
    assert sorted(seen[:3]) == [2, 3, 5] and seen[3] in (2, 3, 5)  # one pass over the pool, then a new one
    assert Trainer(config(tmp_path / "b"), micro_model(), collect=recording, pool=[4, 1],
                   tensorboard=False, progress=False).pool == [4, 1]
    with pytest.raises(ValueError, match="pool_lengths"):
        trainer(tmp_path / "c", pool_lengths=[4, 2])
