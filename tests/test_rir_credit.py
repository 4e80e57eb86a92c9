"""Reviewer credit (retrojax.learn.rir_credit) through the real path: RIR trials of a scripted policy through
the controller and runner on the line world, then the credits — the agent's outcome term per task group,
each executed recovery's calls credited with its normalized advancement, Continue reviews untrained."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from rir_line_world import LineWorld

from retrojax import config
from retrojax.agent.rir.policies import RIRVisibleOracle
from retrojax.agent.rir.replies import ROLLBACK, parse_review
from retrojax.agent.rir.runner import RIRRunner
from retrojax.agent.rir.settings import Settings
from retrojax.agent.trial import TrialSpec
from retrojax.learn.advantages import norm
from retrojax.learn.batch import build_sequences
from retrojax.learn.rir_credit import RECOVERY_ROLES, recovery_calls, reviewer_credit

CFG = config.Config()


def _batch(tasks: int = 3, per_task: int = 8):
    specs = [TrialSpec(trial=i * per_task + r, task=i, seed=0, replicate=r, protocol="RIR")
             for i in range(tasks) for r in range(per_task)]
    runner = RIRRunner(CFG, LineWorld(length=5, tasks=tasks), RIRVisibleOracle(0.5),
                       settings=Settings(agent_budget=16), record_tokens=True)
    return runner.run(specs)


def test_recoveries_record_the_abandoned_and_resumed_values():
    batch = _batch()
    restores = [x for r in batch.records for x in r.restores]
    assert restores and all("v_abandoned" in x and "v_resumed" in x for x in restores)
    # the line world's branch value is progress gained from C_r, or -1 for a fall
    assert all(x["v_abandoned"] >= -1.0 and x["v_resumed"] >= -1.0 for x in restores)
    for rec in batch.records:  # the final path's value from C_0: the goal cell when solved, -1 after a fall
        assert rec.final_value == 5.0 if rec.success else -1.0 <= rec.final_value < 5.0
    assert any(r.success for r in batch.records) and not all(r.success for r in batch.records)


def test_credits_are_the_outcome_term_and_each_recoverys_advancement():
    batch = _batch()
    adv = reviewer_credit(batch.archive, batch.records, lambda_ref=1.0, task_score="progress")
    credit = {(c.trial, c.call_index): c for c in adv.credits}
    calls = defaultdict(list)
    for c in batch.archive.calls:
        calls[c.trial].append(c)
    groups = defaultdict(list)
    for rec in batch.records:
        groups[rec.task].append(rec)
    rollback_reviews = 0
    for recs in groups.values():
        macro = norm([r.final_value for r in recs])
        blocks, rewards = [], []
        for rec, a in zip(recs, macro, strict=True):
            for c in calls[rec.trial]:
                if c.role == "execution" and c.teach:
                    assert credit[(c.trial, c.call_index)].advantage == pytest.approx(a)
                elif c.role == "execution":  # the oracle's random moves: context only
                    assert (c.trial, c.call_index) not in credit
            for x in rec.restores:
                block = recovery_calls(sorted(calls[rec.trial], key=lambda c: c.call_index), x["after_call"])
                assert block[0].role == "review" and parse_review(block[0].output_text).verdict == ROLLBACK
                assert [c.role for c in block] == [r for r in RECOVERY_ROLES if r in {c.role for c in block}]
                blocks.append(block)
                rewards.append(x["v_resumed"] - x["v_abandoned"])
        for block, a in zip(blocks, norm(rewards), strict=True):
            rollback_reviews += 1
            for c in block:
                assert credit[(c.trial, c.call_index)].advantage == pytest.approx(a)
                assert credit[(c.trial, c.call_index)].role == "reflection"
    assert rollback_reviews > 0 and adv.stats["credit/recoveries"] == rollback_reviews
    # a review that said Continue is never trained
    for c in batch.archive.calls:
        if c.role == "review" and parse_review(c.output_text).verdict != ROLLBACK:
            assert (c.trial, c.call_index) not in credit
    # ReTRAIL's batch builder takes the credits: recovery calls are their own sequences, weighted λ_ref
    seqs, _ = build_sequences(batch.archive, adv, lambda_ref=1.0, max_len=1 << 16)
    assert sum(s.spans[0].role == "reflection" for s in seqs) == adv.stats["credit/recovery_calls"]
    seqs0, _ = build_sequences(batch.archive, adv, lambda_ref=0.0, max_len=1 << 16)
    assert all(sp.role == "execution" for s in seqs0 for sp in s.spans)  # the control trains the agent only


def test_task_score_reward_is_success_and_bad_scores_are_refused():
    batch = _batch(tasks=2)
    adv = reviewer_credit(batch.archive, batch.records, task_score="reward")
    by_trial = {r.trial: r for r in batch.records}
    for task in {r.task for r in batch.records}:
        recs = [r for r in batch.records if r.task == task]
        want = dict(zip([r.trial for r in recs], norm([float(r.success) for r in recs]), strict=True))
        got = {c.trial: c.advantage for c in adv.credits
               if c.role == "execution" and by_trial[c.trial].task == task}
        assert all(np.isclose(got[t], want[t]) for t in got)
    with pytest.raises(ValueError, match="task_score"):
        reviewer_credit(batch.archive, batch.records, task_score="value")
