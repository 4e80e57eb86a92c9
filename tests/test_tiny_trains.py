"""``retrojax train --config configs/sokoban_tiny.yaml`` trains tokens: the warm start gives RL something to
compare (issue 14, rule 3). A random tiny model never writes a parseable action, so all its trials fail alike
and every advantage is 0; after ``sft.warm_start`` on oracle demonstrations its trials differ."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retrojax import cli

# Tiny sizes for seconds on a CPU: the config's warm start (its learning rate and schedule) on fewer and
# shorter demonstrations (768-token sequences drop the longer first calls: SFT took 26 s instead of 55 s,
# and both updates still had advantages).
SMALL = ["learn.updates=2", "learn.tasks_per_update=2", "trial.trials_per_task=4", "env.num_tasks=8",
         "trial.max_calls=3", "eval.every=-1", "learn.checkpoint_every=2", "learn.check_logprobs=false",
         "sft.num_recovery_episodes=0", "sft.num_solver_episodes=8", "sft.batch_size=4", "sft.steps=80",
         "sft.seq_len=768"]


def _train(tmp_path, *extra: str) -> tuple[list[dict], dict]:
    sets = [f"run.out_dir={tmp_path}", *SMALL, *extra]
    argv = ["train", "--config", "configs/sokoban_tiny.yaml"] + [a for s in sets for a in ("--set", s)]
    assert cli.main(argv) == 0
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    return history, {}


@pytest.mark.slow  # ~60 s CPU: 80 SFT steps of the byte-level model, then two updates
def test_the_tiny_config_warm_starts_and_then_trains_tokens(tmp_path, capsys):
    history, _ = _train(tmp_path)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ws = summary["warm_start"]
    assert ws["held_out_nll_after"] < ws["held_out_nll_before"] - 1.0  # the demonstrations were learned
    assert len(history) == 2
    trained = [h for h in history if h.get("adv/exec_abs_mean", 0.0) > 0.0]
    invalid = [h.get("rollout/results/T@3/invalid_turns") for h in history]
    assert trained, invalid  # some update has non-zero advantages
    assert all("train/loss" in h and np.isfinite(h["train/loss"]) for h in trained)
    assert any(h["batch/sequences"] > 0 for h in trained)


def test_without_the_warm_start_the_random_tiny_model_has_nothing_to_train(tmp_path, capsys):
    history, _ = _train(tmp_path, "sft.warm_start=false")
    printed = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(printed[-1])
    assert "warm_start" not in summary
    # compiled programs per stage (retrojax.programs), each within the bound its shape rules give
    for stage in ("collect", "update"):
        needed = summary[f"programs.{stage}.compiled"] + summary[f"programs.{stage}.cached"]
        assert needed <= summary[f"programs.{stage}.bound"], stage
        assert any(line.startswith(f"programs: {stage} ") for line in printed)
    assert summary["programs.collect.bound"] >= 1 and "programs.collect.compiled" in history[-1]
    assert all(h.get("adv/exec_abs_mean", 0.0) == 0.0 and "train/loss" not in h for h in history)
