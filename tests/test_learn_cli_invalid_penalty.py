"""``learn.invalid_penalty`` (our option, not the paper's; default 0) on trials run through the real loop.

A policy that never writes an action tag makes only invalid turns (δ = 0, no transition); a policy that moves
pays −0.1 per Sokoban move. On a level that cannot be solved within the call budget, the paper's δ with S the
cumulative reward (``learn.task_score=reward``, the demo's) ranks the idle trial's segment above every moving
one; a penalty equal to the move cost removes that preference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from retrojax import config
from retrojax.agent.archive import EXECUTION
from retrojax.agent.policies import Generation, RandomPolicy, Request
from retrojax.agent.runner import run_trials
from retrojax.learn.advantages import advantages_from_config, compute_advantages

IDLE = 0  # replicate that never writes an action


class IdleOrRandom(RandomPolicy):
    """Replicate 0 of each task replies without an action tag (an invalid turn); the others move at random."""

    def begin(self, specs, slots, env) -> None:
        super().begin(specs, slots, env)
        self.idle = {s.trial for s in specs if s.replicate == IDLE}

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        out = super().generate(requests)
        return [Generation("I am not sure what to do.") if r.trial in self.idle else g
                for r, g in zip(requests, out, strict=True)]


@pytest.fixture(scope="module")
def archive():
    cfg = config.load("configs/sokoban_tiny.yaml", ["trial.max_calls=2", "trial.protocol=P@1"])
    from envs.sokoban.levels import load_split

    d0 = np.asarray(load_split(f"{cfg.env.split}:train").d0)
    task = int(np.flatnonzero(d0 >= 3)[0])  # two calls cannot solve it: no trial succeeds
    policy = IdleOrRandom(rewind_prob=0.0)
    arch, _ = run_trials(cfg, policy, task_ids=[task], seeds=[0], trials_per_task=6, protocols=["P@1"])
    assert not any(t.success for t in arch.trials) and len(policy.idle) == 1
    return arch, set(policy.idle)


def _macro_by_trial(adv, arch):
    out: dict[int, float] = {}
    for c in arch.calls:
        if c.role == EXECUTION:
            out[c.trial] = adv.macro[(c.task, c.trial, c.call_index)]
    return out


def test_paper_rule_ranks_the_idle_trial_first_and_the_penalty_removes_it(archive):
    arch, idle = archive
    idle_calls = [c for c in arch.calls if c.trial in idle and c.role == EXECUTION]
    assert idle_calls and all(not c.valid and c.reward == 0.0 for c in idle_calls)
    moving = [c for c in arch.calls if c.trial not in idle and c.role == EXECUTION]
    assert moving and all(c.valid and c.reward < 0 for c in moving)

    paper = compute_advantages(arch, "sa_grpo", task_score="reward")
    m = _macro_by_trial(paper, arch)
    (i,) = idle
    assert m[i] > 0 and all(m[i] > v for t, v in m.items() if t != i)  # doing nothing is ranked best

    ours = compute_advantages(arch, "sa_grpo", invalid_penalty=-0.1, task_score="reward")
    m2 = _macro_by_trial(ours, arch)
    # no longer ranked above the trials that moved (up to float32 rounding of the env's −0.1 rewards,
    # which a near-constant group's normalization magnifies to ~1e-3)
    assert m2[i] < m[i] - 1.0 and m2[i] <= max(v for t, v in m2.items() if t != i) + 0.01
    n_idle = len(idle_calls)
    same = [t for t in m2 if t != i and sum(1 for c in moving if c.trial == t) == n_idle
            and sum(c.reward for c in moving if c.trial == t) == pytest.approx(-0.1 * n_idle)]
    assert same and all(abs(m2[t] - m2[i]) < 0.01 for t in same)  # ties with trials that only walked
    for c in idle_calls:  # δ of each invalid turn is the penalty; G sums the rest of the segment
        later = sum(1 for d in idle_calls if d.segment == c.segment and d.position >= c.position)
        assert ours.returns[(c.task, c.trial, c.call_index)] == pytest.approx(-0.1 * later)
    for c in moving:  # valid decisions keep their environment rewards
        assert ours.returns[(c.task, c.trial, c.call_index)] == paper.returns[(c.task, c.trial, c.call_index)]


def test_the_penalty_is_off_by_default_and_read_from_the_config(archive):
    arch, _ = archive
    default = config.load("configs/sokoban_tiny.yaml").learn
    assert default.invalid_penalty == 0.0
    same = advantages_from_config(arch, default)
    paper = compute_advantages(arch, "sa_grpo")
    assert [c.advantage for c in same.credits] == [c.advantage for c in paper.credits]
    on = config.load("configs/sokoban_tiny.yaml", ["learn.invalid_penalty=-0.1"]).learn
    assert advantages_from_config(arch, on).macro != paper.macro
