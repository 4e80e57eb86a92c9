"""The collector lets go of its sampling weights before each update (they are stale after it, and on a real
model they are gigabytes held beside the update's own), and the next collection samples with the new ones."""

from __future__ import annotations

import numpy as np
import pytest

from retrojax.learn.trainer import Trainer
from retrojax.sampler import SamplerError


def test_the_update_runs_without_the_samplers_weights_and_the_next_collection_uses_the_new_ones(tmp_path):
    from retrojax.config import load
    from retrojax.model.build import build_model, build_tokenizer

    cfg = load("configs/sokoban_tiny.yaml", [
        f"run.out_dir={tmp_path}", "learn.updates=2", "learn.tasks_per_update=1", "trial.trials_per_task=2",
        "learn.kl_coef=0.01", "learn.seq_buckets=[2048]", "eval.every=-1", "env.num_tasks=4",
        "trial.max_calls=2", "learn.learning_rate=1e-2"])
    tr = Trainer(cfg, build_model(cfg), build_tokenizer(cfg), progress=False, tensorboard=False)
    released: list[bool] = []

    class CheckingUpdate:  # the trainer's update, checking what the collector holds while it runs
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, params, opt_state, group):
            sampler = tr.collect.policy.sampler
            length = sampler.book.length.copy()
            with pytest.raises(SamplerError, match="released"):
                sampler.append([0], [[1]])
            np.testing.assert_array_equal(sampler.book.length, length)  # the error changed no row
            released.append(tr.collect.policy.model is None)
            return self.inner(params, opt_state, group)

    tr.update = CheckingUpdate(tr.update)
    try:
        history = tr.fit()
    finally:
        tr.close()
    assert released and all(released)
    assert len(history) == 2
    for h in history:  # the second collection sampled with the updated weights (θ_old is recomputed)
        assert h["check/logprob_gap_max"] < 1e-4 and np.isfinite(h["train/loss"])
    assert history[1]["train/skipped_steps"] == 0.0
