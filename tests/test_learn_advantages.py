"""Advantages on small hand-made archives (host numpy only; no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.agent.archive import (
    EXECUTION,
    REFLECTION,
    Archive,
    CallRecord,
    RecoveryRecord,
    SegmentRecord,
    TrialRecord,
)
from retrojax.learn.advantages import (
    compute_advantages,
    group_norm,
    leave_one_out,
    norm,
    returns_to_go,
)

EPS = 1e-6


def call(task, trial, ci, seg, pos, reward=0.0, state="s", hist="h", role=EXECUTION, out=3,
         is_rewind=False):
    return CallRecord(trial=trial, task=task, call_index=ci, role=role, segment=seg, position=pos,
                      checkpoint=pos,
                      state_key=state, history_key=hist, prompt_ids=np.arange(5, dtype=np.int32),
                      output_ids=np.arange(out, dtype=np.int32), logprobs=-np.ones(out, np.float32),
                      reward=reward, is_rewind=is_rewind)


def seg(task, trial, index, calls, score, end="success"):
    return SegmentRecord(trial=trial, task=task, index=index, start_checkpoint=0, calls=calls, end_reason=end,
                         score=score)


def recovery(task, trial, index, refl, resumed, v_ab, v_res, remark="r"):
    return RecoveryRecord(trial=trial, task=task, index=index, trigger="model", from_checkpoint=2, target=0,
                          reflection_call=refl, remark=remark, abandoned_calls=[], resumed_segment=resumed,
                          v_abandoned=v_ab, v_resumed=v_res)


def trial(task, t, score):
    return TrialRecord(trial=t, task=task, seed=0, protocol="T@3", final_score=score)


def d6_archive(d=1.0) -> Archive:
    """D.6: an action with reward d, then a proactive rewind; a second trial from the same state."""
    a = Archive()
    # trial 0, segment 0: action (reward d) then rewind; reflection; segment 1: one action (reward 2)
    a.calls += [call(0, 0, 0, 0, 0, reward=d, state="s0", hist="h0"),
                call(0, 0, 1, 0, 1, reward=0.0, state="s1", hist="hA", is_rewind=True),
                call(0, 0, 2, 0, -1, role=REFLECTION, state="r", hist="r"),
                call(0, 0, 3, 1, 0, reward=2.0, state="s0", hist="h0")]  # same path, new memory
    # trial 1, segment 0: one action from the same state/history with reward 0
    a.calls += [call(0, 1, 0, 0, 0, reward=0.0, state="s0", hist="h0")]
    a.segments += [seg(0, 0, 0, [0, 1], score=1.0, end="rewind"), seg(0, 0, 1, [3], score=3.0),
                   seg(0, 1, 0, [0], score=0.0, end="failure")]
    a.recoveries += [recovery(0, 0, 0, refl=2, resumed=1, v_ab=1.0, v_res=3.0)]
    a.trials += [trial(0, 0, 3.0), trial(0, 1, 0.0)]
    return a


def test_norm_singleton_and_constant_groups_are_zero():
    assert norm([5.0]).tolist() == [0.0]
    assert norm([2.0, 2.0, 2.0]).tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_allclose(norm([0.0, 2.0]), [-1 / (1 + EPS), 1 / (1 + EPS)])
    np.testing.assert_allclose(group_norm([1, 3, 7, 7], ["a", "a", "b", "c"]),
                               [-1 / (1 + EPS), 1 / (1 + EPS), 0, 0])


def test_returns_to_go_and_leave_one_out():
    np.testing.assert_allclose(returns_to_go([1.0, 0.0, 2.0], 1.0), [3.0, 2.0, 2.0])
    np.testing.assert_allclose(returns_to_go([1.0, 0.0, 2.0], 0.5), [1.5, 1.0, 2.0])
    np.testing.assert_allclose(leave_one_out([0.0, 1.0, 2.0]), [-1.5, 0.0, 1.5])
    assert leave_one_out([4.0]).tolist() == [0.0]


def test_paper_d6_example():
    """D.6 with the paper's grouping (D.5.1: memory is not part of the key), by hand for d = 1, λ = 0.7:

    - segment scores S = {1, 3, 0} (mean 4/3, std √(14/9) ≈ 1.2472): M = Norm(S) ≈ (−0.2673, 1.3363, −1.0690);
    - the s_0 group holds all three s_0 decisions: trial 0's action before the rewind (G = d = 1), trial 1's
      action (G = 0) and trial 0's resumed action after the rewind (G = 2); mean 1, std √(2/3) ≈ 0.8165, so
      A_state = (0, −1.2247, +1.2247);
    - A_cont = M + λ A_state: before-rewind action −0.2673, trial 1 −1.0690 − 0.8573 = −1.9263, resumed
      action 1.3363 + 0.8573 = 2.1936; the rewind is alone in its group (s_1): A = M = −0.2673.
    """
    d, lam = 1.0, 0.7
    adv = compute_advantages(d6_archive(d), "sa_grpo", lambda_state=lam, eps=EPS)
    # Returns within the segment: the action gets d (its own reward, then a zero-reward rewind), the rewind 0.
    assert adv.returns[(0, 0, 0)] == d and adv.returns[(0, 0, 1)] == 0.0
    # Macro term: segment scores {1, 3, 0}, each segment once.
    scores = np.array([1.0, 3.0, 0.0])
    m = (scores - scores.mean()) / (scores.std() + EPS)
    # The rewind is alone in its (state, history) group: its total advantage is its segment's macro term M.
    assert adv.local[(0, 0, 1)] == 0.0
    assert adv.of(0, 0, 1) == pytest.approx(m[0])
    # The s0 group: trial 0 before the rewind (G = d), trial 1 (G = 0), trial 0 after the rewind (G = 2).
    g = np.array([d, 0.0, 2.0])
    local = (g - g.mean()) / (g.std() + EPS)
    np.testing.assert_allclose([adv.local[(0, 0, 0)], adv.local[(0, 1, 0)], adv.local[(0, 0, 3)]], local)
    np.testing.assert_allclose(local, [0.0, -1.2247, 1.2247], atol=1e-4)
    assert adv.of(0, 0, 0) == pytest.approx(m[0] + lam * local[0]) == pytest.approx(-0.2673, abs=1e-4)
    assert adv.of(0, 1, 0) == pytest.approx(m[2] + lam * local[1]) == pytest.approx(-1.9263, abs=1e-4)
    assert adv.of(0, 0, 3) == pytest.approx(m[1] + lam * local[2]) == pytest.approx(2.1936, abs=1e-4)
    # One eligible recovery alone in its task: normalized reflection advantage 0.
    refl = [c for c in adv.credits if c.role == REFLECTION]
    assert [(c.trial, c.call_index, c.advantage) for c in refl] == [(0, 2, 0.0)]
    assert adv.reflection_reward[(0, 0, 2)] == 2.0


def test_segments_count_once_regardless_of_their_length():
    a = Archive()
    a.calls += [call(0, 0, i, 0, i, state=f"a{i}") for i in range(3)] + [call(0, 1, 0, 0, 0, state="b")]
    a.segments += [seg(0, 0, 0, [0, 1, 2], score=0.0), seg(0, 1, 0, [0], score=2.0)]
    adv = compute_advantages(a, "sa_grpo", eps=EPS)
    for i in range(3):
        assert adv.of(0, 0, i) == pytest.approx(-1 / (1 + EPS))
    assert adv.of(0, 1, 0) == pytest.approx(1 / (1 + EPS))


def test_tasks_are_normalized_separately():
    a = Archive()
    a.calls += [call(0, 0, 0, 0, 0), call(0, 1, 0, 0, 0), call(1, 2, 0, 0, 0), call(1, 3, 0, 0, 0)]
    a.segments += [seg(0, 0, 0, [0], 0.0), seg(0, 1, 0, [0], 1.0), seg(1, 2, 0, [0], 100.0),
                   seg(1, 3, 0, [0], 300.0)]
    adv = compute_advantages(a, "sa_grpo", eps=EPS)
    vals = [adv.of(0, 0, 0), adv.of(0, 1, 0), adv.of(1, 2, 0), adv.of(1, 3, 0)]
    np.testing.assert_allclose(vals, [-1, 1, -1, 1], rtol=1e-5)


def _recovery_archive(recs, refl_outputs=(3, 3, 3, 3), resumed_sizes=(1, 1, 1, 1)) -> Archive:
    """One trial per recovery: segment 0, reflection call 1, resumed segment 1 (``resumed_sizes`` calls)."""
    a = Archive()
    for t, (rec, out, n_res) in enumerate(zip(recs, refl_outputs, resumed_sizes, strict=False)):
        a.calls += [call(0, t, 0, 0, 0), call(0, t, 1, 0, -1, role=REFLECTION, out=out)]
        a.calls += [call(0, t, 2 + i, 1, i) for i in range(n_res)]
        a.segments += [seg(0, t, 0, [0], 0.0, "rewind"), seg(0, t, 1, list(range(2, 2 + n_res)), 1.0)]
        v_ab, v_res = rec
        a.recoveries.append(recovery(0, t, 0, refl=1, resumed=1, v_ab=v_ab, v_res=v_res))
    return a


def test_reflection_normalization_positive_advancement_can_be_negative():
    a = _recovery_archive([(0.0, 1.0), (0.0, 3.0)], refl_outputs=(3, 3), resumed_sizes=(1, 1))
    adv = compute_advantages(a, "sa_grpo", eps=EPS)
    refl = {c.trial: c.advantage for c in adv.credits if c.role == REFLECTION}
    assert adv.reflection_reward[(0, 0, 1)] == 1.0  # positive advancement ...
    assert refl[0] == pytest.approx(-1 / (1 + EPS))  # ... negative advantage relative to the task's other one
    assert refl[1] == pytest.approx(1 / (1 + EPS))


def test_eligibility_rules_eq18():
    recs = [(0.0, 2.0), (0.0, 4.0), (None, 1.0), (0.0, 9.0), (1.0, 5.0)]
    a = _recovery_archive(recs, refl_outputs=(3, 3, 3, 0, 3), resumed_sizes=(1, 1, 1, 1, 0))
    adv = compute_advantages(a, "sa_grpo", eps=EPS)
    refl = {c.trial: c.advantage for c in adv.credits if c.role == REFLECTION}
    # trial 2: undefined V; trial 3: empty reflection output; trial 4: resumed segment has no decision.
    assert sorted(refl) == [0, 1]
    assert adv.ineligible_recoveries == 3
    assert refl[0] == pytest.approx(-1 / (1 + EPS)) and refl[1] == pytest.approx(1 / (1 + EPS))
    a.recoveries[0].reflection_call = -1  # no reflection call at all
    adv = compute_advantages(a, "sa_grpo", eps=EPS)
    assert sorted(c.trial for c in adv.credits if c.role == REFLECTION) == [1]


def test_v_plus_only_ablation():
    a = _recovery_archive([(5.0, 1.0), (0.0, 3.0)], refl_outputs=(3, 3), resumed_sizes=(1, 1))
    adv = compute_advantages(a, "sa_grpo", reflection_reward_kind="v_plus_only", eps=EPS)
    assert adv.reflection_reward == {(0, 0, 1): 1.0, (0, 1, 1): 3.0}
    adv = compute_advantages(a, "sa_grpo", eps=EPS)
    assert adv.reflection_reward == {(0, 0, 1): -4.0, (0, 1, 1): 3.0}


def test_trajectory_baselines():
    a = Archive()
    for t, score in enumerate([0.0, 1.0, 2.0]):
        a.calls += [call(0, t, 0, 0, 0, state="s0"), call(0, t, 1, 0, 1, state=f"x{t}"),
                    call(0, t, 2, 0, -1, role=REFLECTION)]
        a.segments.append(seg(0, t, 0, [0, 1], score))
        a.recoveries.append(recovery(0, t, 0, refl=2, resumed=0, v_ab=0.0, v_res=float(t)))
        a.trials.append(trial(0, t, score))
    grpo = compute_advantages(a, "grpo", eps=EPS)
    z = norm([0.0, 1.0, 2.0], EPS)
    for t in range(3):
        assert grpo.of(0, t, 0) == pytest.approx(z[t]) and grpo.of(0, t, 1) == pytest.approx(z[t])
    assert all(c.role == EXECUTION for c in grpo.credits)
    rloo = compute_advantages(a, "rloo")
    assert [rloo.of(0, t, 1) for t in range(3)] == pytest.approx([-1.5, 0.0, 1.5])
    assert all(c.role == EXECUTION for c in rloo.credits)


def test_gigpo_groups_by_anchor_observation_only():
    a = Archive()
    # Same state s0 but different histories: GiGPO groups them, SA-GRPO does not.
    a.calls += [call(0, 0, 0, 0, 0, reward=2.0, state="s0", hist="hA"),
                call(0, 1, 0, 0, 0, reward=0.0, state="s0", hist="hB")]
    a.segments += [seg(0, 0, 0, [0], 1.0), seg(0, 1, 0, [0], 1.0)]
    a.trials += [trial(0, 0, 4.0), trial(0, 1, 0.0)]
    sa = compute_advantages(a, "sa_grpo", eps=EPS)
    assert sa.of(0, 0, 0) == 0.0 and sa.of(0, 1, 0) == 0.0  # constant segment scores, singleton groups
    gi = compute_advantages(a, "gigpo", lambda_state=0.5, eps=EPS)
    one = 1 / (1 + EPS)
    assert gi.of(0, 0, 0) == pytest.approx(one + 0.5 * one)
    assert gi.of(0, 1, 0) == pytest.approx(-one - 0.5 * one)


def test_gigpo_retro_keeps_reflection_credit():
    a = _recovery_archive([(0.0, 1.0), (0.0, 3.0)], refl_outputs=(3, 3), resumed_sizes=(1, 1))
    a.trials += [trial(0, 0, 1.0), trial(0, 1, 2.0)]
    adv = compute_advantages(a, "gigpo_retro", eps=EPS)
    assert sorted(c.trial for c in adv.credits if c.role == REFLECTION) == [0, 1]
    assert adv.of(0, 0, 0) == pytest.approx(-1 / (1 + EPS))


def test_bad_input_errors():
    a = d6_archive()
    with pytest.raises(ValueError, match="unknown estimator"):
        compute_advantages(a, "ppo")
    with pytest.raises(ValueError, match="reflection_reward"):
        compute_advantages(a, reflection_reward_kind="v_minus")
    a.segments = a.segments[:1]
    with pytest.raises(ValueError, match="no SegmentRecord"):
        compute_advantages(a, "sa_grpo")
    b = d6_archive()
    b.trials = b.trials[:1]
    with pytest.raises(ValueError, match="TrialRecord"):
        compute_advantages(b, "grpo")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=12), st.integers(1, 4))
def test_sa_grpo_task_means_are_zero(scores, n_states):
    """Each normalization group is centred: per task the macro terms of segments average to zero."""
    a = Archive()
    for t, s in enumerate(scores):
        a.calls.append(call(0, t, 0, 0, 0, reward=s, state=f"s{t % n_states}"))
        a.segments.append(seg(0, t, 0, [0], s))
    adv = compute_advantages(a, "sa_grpo", lambda_state=1.0, eps=EPS)
    vals = np.array([c.advantage for c in adv.credits])
    assert np.all(np.isfinite(vals))
    assert abs(vals.mean()) < 1e-6 * max(1.0, math.sqrt(len(scores)))
