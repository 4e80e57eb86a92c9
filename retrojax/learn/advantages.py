"""Advantages over the archive Γ (host-side numpy): State-Anchored GRPO, the reflection reward, baselines.

Everything here reads only ``retrojax.agent.archive`` records. Per task u (trials of one task form a group):

- Decisions are execution calls q = (trial, segment m, position t); reflection calls are not decisions.
- ``G_q`` is the return-to-go of δ within the decision's segment, discounted by γ.
- ``A_macro`` normalizes the endpoint score S over the task's segments (each segment with at least one
  decision counts once); ``A_state`` normalizes G over decisions that share the task, the environment state
  key and the retained-history key; ``A_cont = A_macro + λ_state · A_state``.
- The reflection reward of a recovery is ``r_ref = V(resumed | s_j) − V(abandoned | s_j)`` (``advancement``)
  or ``V(resumed | s_j)`` (``v_plus_only``); eligible recoveries (eq. 18: a non-empty reflection output, a
  resumed segment with at least one decision, both values defined) are normalized over the task into A_ref.

``task_score`` says what S (and the trajectory estimators' trial outcome) is. ``progress`` (default): the
world's task progress at the endpoint (``TrialEnv.endpoint_progress``): the cumulative reward for MineSweeper
and the text worlds, ``d_0 − d_end`` for Sokoban (C.2's progress measure: 0 for a dead end, d_0 when solved).
The paper calls S the "task-progress score" and "endpoint progress" (4.1, D.5.2; our copy lacks Table 6, which
lists S per world). ``reward``: the cumulative reward along the retained path; under Sokoban's reward (−0.1
per move, ±1 box on/off target, +10 solved) a group whose trials all fail then ranks its segments by how few
moves they made, so the macro term favours failing early (measured in ``tests/test_learn_task_score.py``).

Estimators (``LearnConfig.estimator``):

- ``sa_grpo``: A_cont for decisions, A_ref for eligible reflections (the paper's method).
- ``grpo``: one outcome per trial (its final score) normalized over the task's trials; decisions only.
- ``rloo``: the trial outcome minus the mean of the task's other trials; decisions only.
- ``gigpo``: episode term (normalized trial outcome) + λ_state × step term (G normalized over decisions that
  share the task and the anchor observation, i.e. the state key alone); decisions only.
- ``gigpo_retro``: GiGPO credit for decisions inside the retrospective framework, plus A_ref for reflections.

``Norm`` subtracts the group mean and divides by (population std + ε); singleton and constant groups give 0.

``invalid_penalty`` (NOT in the paper, default 0: C.2 gives a decision with no environment transition δ = 0)
adds a fixed reward to every invalid execution turn (unparseable or cut-off output): to its δ, to the endpoint
score S of the segment it was made in, and to its trial's outcome. With a weak policy whose group has no
success, δ = 0 for an invalid turn against −0.1 per Sokoban move ranks doing nothing above acting; a penalty
equal to the move cost removes that preference (measured in ``retrojax bench learn``).

``rewind_return`` (``segment`` = the paper, D.5.2: a rewind request ends its segment with δ = 0, so its return
is 0). ``resumed`` (ours, NOT in the paper) lets a model rewind's return continue into the branch it resumes:
``G_rewind = γ · G(first decision of the resumed segment)`` (one step: that G is its own segment's return).
Why: among failed continuations from one state the paper's rule scores every rewind 0 against −0.1 per move,
so the state term favours rewinding whether or not the resumed branch went anywhere (a rewind's mean
advantage was positive in every measured update, +0.5 … +2.9, and the trained policy rewound more on held-out
levels: ``docs/results.md``). With ``resumed`` a rewind is credited with what it led to. Moves and the macro
term are unchanged; a rewind whose trial ended before the resumed branch made a decision keeps G = 0.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from retrojax.agent.archive import EXECUTION, REFLECTION, Archive, CallRecord, RecoveryRecord

ESTIMATORS = ("sa_grpo", "grpo", "rloo", "gigpo", "gigpo_retro")
REFLECTION_REWARDS = ("advancement", "v_plus_only")
REWIND_RETURNS = ("segment", "resumed")
TASK_SCORES = ("reward", "progress")
_WITH_REFLECTION = ("sa_grpo", "gigpo_retro")


@dataclasses.dataclass(frozen=True)
class Credit:
    """The advantage of one trained call (an execution decision or an eligible reflection)."""

    task: int
    trial: int
    call_index: int
    role: str  # EXECUTION | REFLECTION
    advantage: float


@dataclasses.dataclass
class Advantages:
    """All credits of one archive, plus the terms that built them (for logging and tests)."""

    credits: list[Credit]
    returns: dict[tuple[int, int, int], float]  # (task, trial, call_index) -> G
    macro: dict[tuple[int, int, int], float]  # (task, trial, call_index) -> A_macro (or episode term)
    local: dict[tuple[int, int, int], float]  # (task, trial, call_index) -> A_state (or step term)
    reflection_reward: dict[tuple[int, int, int], float]  # (task, trial, reflection call) -> r_ref (eligible)
    ineligible_recoveries: int
    stats: dict[str, float]

    def of(self, task: int, trial: int, call_index: int) -> float:
        for c in self.credits:
            if (c.task, c.trial, c.call_index) == (task, trial, call_index):
                return c.advantage
        raise KeyError(f"no credit for task {task} trial {trial} call {call_index}")


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def norm(values: Sequence[float] | np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(x − mean) / (std + eps) over one group; a singleton or constant group gives exact zeros."""
    x = np.asarray(values, np.float64)
    if x.size <= 1:
        return np.zeros_like(x)
    centered = x - x.mean()
    if np.all(centered == 0.0):
        return np.zeros_like(x)
    return centered / (x.std() + eps)


def leave_one_out(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """RLOO: each value minus the mean of the others (0 for a singleton group)."""
    x = np.asarray(values, np.float64)
    n = x.size
    if n <= 1:
        return np.zeros_like(x)
    return x - (x.sum() - x) / (n - 1)


def returns_to_go(rewards: Sequence[float] | np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """G_t = Σ_{ℓ≥t} γ^{ℓ−t} δ_ℓ for one segment's decisions in order."""
    r = np.asarray(rewards, np.float64)
    out = np.zeros_like(r)
    acc = 0.0
    for t in range(r.size - 1, -1, -1):
        acc = r[t] + gamma * acc
        out[t] = acc
    return out


def group_norm(values: Sequence[float], keys: Sequence[Hashable], eps: float = 1e-6) -> np.ndarray:
    """Norm of ``values`` within each group of equal ``keys``."""
    x = np.asarray(values, np.float64)
    out = np.zeros_like(x)
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    for idx in groups.values():
        out[idx] = norm(x[idx], eps)
    return out


def reflection_reward(rec: RecoveryRecord, kind: str = "advancement") -> float | None:
    """r_ref of one recovery, or None if a needed branch value is undefined."""
    if kind not in REFLECTION_REWARDS:
        raise ValueError(f"unknown reflection_reward {kind!r}; expected one of {REFLECTION_REWARDS}")
    if rec.v_resumed is None or rec.v_abandoned is None:
        return None
    if kind == "v_plus_only":
        return float(rec.v_resumed)
    return float(rec.v_resumed) - float(rec.v_abandoned)


def is_eligible(rec: RecoveryRecord, calls: dict[tuple[int, int, int], CallRecord],
                segment_sizes: dict[tuple[int, int, int], int]) -> bool:
    """Eq. 18: non-empty reflection output, a resumed segment with ≥1 decision, both branch values defined."""
    call = calls.get((rec.task, rec.trial, rec.reflection_call))
    if rec.reflection_call < 0 or call is None or call.role != REFLECTION:
        return False
    if np.asarray(call.output_ids).size == 0:
        return False
    if segment_sizes.get((rec.task, rec.trial, rec.resumed_segment), 0) < 1:
        return False
    return rec.v_resumed is not None and rec.v_abandoned is not None


# ----------------------------------------------------------------------------------------------
# The estimator
# ----------------------------------------------------------------------------------------------


def _segments_of_decisions(calls: Iterable[CallRecord]) -> dict[tuple[int, int, int], list[CallRecord]]:
    """(task, trial, segment) -> execution calls ordered by position (then call index)."""
    out: dict[tuple[int, int, int], list[CallRecord]] = defaultdict(list)
    for c in calls:
        if c.role == EXECUTION:
            out[(c.task, c.trial, c.segment)].append(c)
        elif c.role != REFLECTION:
            raise ValueError(f"call {c.call_index} of trial {c.trial}: unknown role {c.role!r}")
    for seg in out.values():
        seg.sort(key=lambda c: (c.position, c.call_index))
    return out


def _score(reward: float, progress: float | None, task_score: str) -> float:
    """S under ``task_score``: the cumulative reward, or the world's endpoint progress (recorded by the trial
    loop; records written before it fall back to the reward)."""
    return float(reward if task_score == "reward" or progress is None else progress)


def _trial_outcomes(archive: Archive, task_score: str) -> dict[tuple[int, int], float]:
    return {(t.task, t.trial): _score(t.final_score, t.final_progress, task_score) for t in archive.trials}


def _segment_scores(archive: Archive, task_score: str) -> dict[tuple[int, int, int], float]:
    return {(s.task, s.trial, s.index): _score(s.score, s.progress, task_score) for s in archive.segments}


def _task_trials(archive: Archive, decisions: list[CallRecord], task: int) -> list[tuple[int, int]]:
    keys = {(c.task, c.trial) for c in decisions}
    keys |= {(t.task, t.trial) for t in archive.trials if t.task == task}
    return sorted(keys)


def _outcome_credit(task_trials: list[tuple[int, int]], outcomes: dict[tuple[int, int], float],
                    kind: str, eps: float) -> dict[tuple[int, int], float]:
    """Trial-level credit for the task's trials: normalized (grpo/gigpo) or leave-one-out (rloo)."""
    missing = [k for k in task_trials if k not in outcomes]
    if missing:
        raise ValueError(f"estimator needs a TrialRecord for every trial; missing (task, trial) {missing[0]}")
    values = [outcomes[k] for k in task_trials]
    adv = leave_one_out(values) if kind == "rloo" else norm(values, eps)
    return dict(zip(task_trials, adv.tolist(), strict=True))


def _invalid_counts(calls: Iterable[CallRecord]) -> tuple[dict[tuple[int, int, int], int],
                                                           dict[tuple[int, int], int]]:
    """Invalid execution turns per (task, trial, segment) and per (task, trial)."""
    per_segment: dict[tuple[int, int, int], int] = defaultdict(int)
    per_trial: dict[tuple[int, int], int] = defaultdict(int)
    for c in calls:
        if c.role == EXECUTION and not c.valid:
            per_segment[(c.task, c.trial, c.segment)] += 1
            per_trial[(c.task, c.trial)] += 1
    return per_segment, per_trial


def _continue_rewind_returns(returns: dict[tuple[int, int, int], float], recoveries: Iterable[RecoveryRecord],
                             seg_calls: dict[tuple[int, int, int], list[CallRecord]], gamma: float) -> int:
    """``rewind_return=resumed``: add γ·G(first decision of the resumed segment) to each model rewind.

    Reads the resumed branch's returns as computed within its own segment (before any of them is continued),
    so the result does not depend on the order of recoveries. Returns how many rewinds were continued.
    """
    own = dict(returns)
    done = 0
    for rec in recoveries:
        abandoned = seg_calls.get((rec.task, rec.trial, rec.index))
        resumed = seg_calls.get((rec.task, rec.trial, rec.resumed_segment))
        if rec.trigger != "model" or not abandoned or not resumed or not abandoned[-1].is_rewind:
            continue
        last, first = abandoned[-1], resumed[0]
        returns[(last.task, last.trial, last.call_index)] += gamma * own[(first.task, first.trial,
                                                                         first.call_index)]
        done += 1
    return done


def compute_advantages(archive: Archive, estimator: str = "sa_grpo", *, lambda_state: float = 1.0,
                       gamma: float = 1.0, eps: float = 1e-6,
                       reflection_reward_kind: str = "advancement",
                       invalid_penalty: float = 0.0, rewind_return: str = "segment",
                       task_score: str = "progress") -> Advantages:
    """Credits for every trained call of ``archive`` under ``estimator`` (see the module docstring)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if rewind_return not in REWIND_RETURNS:
        raise ValueError(f"unknown rewind_return {rewind_return!r}; expected one of {REWIND_RETURNS}")
    if task_score not in TASK_SCORES:
        raise ValueError(f"unknown task_score {task_score!r}; expected one of {TASK_SCORES}")
    if reflection_reward_kind not in REFLECTION_REWARDS:
        raise ValueError(f"unknown reflection_reward {reflection_reward_kind!r}; "
                         f"expected {REFLECTION_REWARDS}")
    calls = {(c.task, c.trial, c.call_index): c for c in archive.calls}
    if len(calls) != len(archive.calls):
        raise ValueError("archive has duplicate (task, trial, call_index) records")
    seg_calls = _segments_of_decisions(archive.calls)
    seg_sizes = {k: len(v) for k, v in seg_calls.items()}
    seg_scores = _segment_scores(archive, task_score)
    invalid_seg, invalid_trial = _invalid_counts(archive.calls) if invalid_penalty else ({}, {})
    for k, n in invalid_seg.items():
        if k in seg_scores:
            seg_scores[k] += invalid_penalty * n

    returns: dict[tuple[int, int, int], float] = {}
    for seg in seg_calls.values():
        g = returns_to_go([c.reward + (0.0 if c.valid else invalid_penalty) for c in seg], gamma)
        for c, gq in zip(seg, g.tolist(), strict=True):
            returns[(c.task, c.trial, c.call_index)] = gq
    if rewind_return == "resumed":
        _continue_rewind_returns(returns, archive.recoveries, seg_calls, gamma)

    macro: dict[tuple[int, int, int], float] = {}
    local: dict[tuple[int, int, int], float] = {}
    exec_adv: dict[tuple[int, int, int], float] = {}
    outcomes = _trial_outcomes(archive, task_score)
    for k, n in invalid_trial.items():
        if k in outcomes:
            outcomes[k] += invalid_penalty * n

    by_task: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for key in seg_calls:
        by_task[key[0]].append(key)
    for task, seg_keys in sorted(by_task.items()):
        seg_keys.sort()
        decisions = [c for k in seg_keys for c in seg_calls[k]]
        dkeys = [(c.task, c.trial, c.call_index) for c in decisions]
        g = [returns[k] for k in dkeys]
        if estimator == "sa_grpo":
            missing = [k for k in seg_keys if k not in seg_scores]
            if missing:
                raise ValueError(f"decisions of (task, trial, segment) {missing[0]} have no SegmentRecord")
            a_seg = dict(zip(seg_keys, norm([seg_scores[k] for k in seg_keys], eps).tolist(), strict=True))
            a_macro = [a_seg[(c.task, c.trial, c.segment)] for c in decisions]
            a_local = group_norm(g, [(c.state_key, c.history_key) for c in decisions], eps).tolist()
        elif estimator in ("gigpo", "gigpo_retro"):
            trials = _task_trials(archive, decisions, task)
            episode = _outcome_credit(trials, outcomes, "norm", eps)
            a_macro = [episode[(c.task, c.trial)] for c in decisions]
            a_local = group_norm(g, [c.state_key for c in decisions], eps).tolist()
        else:  # grpo, rloo
            trials = _task_trials(archive, decisions, task)
            outcome = _outcome_credit(trials, outcomes, estimator, eps)
            a_macro = [outcome[(c.task, c.trial)] for c in decisions]
            a_local = [0.0] * len(decisions)
        for k, am, al in zip(dkeys, a_macro, a_local, strict=True):
            macro[k], local[k] = am, al
            exec_adv[k] = am + lambda_state * al

    credits = [Credit(k[0], k[1], k[2], EXECUTION, v) for k, v in sorted(exec_adv.items())]

    r_ref: dict[tuple[int, int, int], float] = {}
    ineligible = 0
    if estimator in _WITH_REFLECTION:
        eligible_by_task: dict[int, list[tuple[tuple[int, int, int], float]]] = defaultdict(list)
        for rec in archive.recoveries:
            r = reflection_reward(rec, reflection_reward_kind)
            if r is None or not is_eligible(rec, calls, seg_sizes):
                ineligible += 1
                continue
            eligible_by_task[rec.task].append(((rec.task, rec.trial, rec.reflection_call), r))
        for _task, items in sorted(eligible_by_task.items()):
            a = norm([r for _, r in items], eps)
            for (key, r), ar in zip(items, a.tolist(), strict=True):
                r_ref[key] = r
                credits.append(Credit(key[0], key[1], key[2], REFLECTION, ar))
    else:
        ineligible = len(archive.recoveries)

    return Advantages(credits=credits, returns=returns, macro=macro, local=local, reflection_reward=r_ref,
                      ineligible_recoveries=ineligible, stats=_stats(credits, r_ref, ineligible))


def advantages_from_config(archive: Archive, learn_cfg) -> Advantages:
    """``compute_advantages`` with the fields of a ``LearnConfig``."""
    return compute_advantages(archive, learn_cfg.estimator, lambda_state=learn_cfg.lambda_state,
                              gamma=learn_cfg.gamma, eps=learn_cfg.norm_eps,
                              reflection_reward_kind=learn_cfg.reflection_reward,
                              invalid_penalty=learn_cfg.invalid_penalty,
                              rewind_return=learn_cfg.rewind_return, task_score=learn_cfg.task_score)


def _stats(credits: list[Credit], r_ref: dict, ineligible: int) -> dict[str, float]:
    ex = np.array([c.advantage for c in credits if c.role == EXECUTION], np.float64)
    rf = np.array([c.advantage for c in credits if c.role == REFLECTION], np.float64)
    rr = np.array(list(r_ref.values()), np.float64)
    out: dict[str, float] = {
        "adv/decisions": float(ex.size),
        "adv/reflections_eligible": float(rf.size),
        "adv/reflections_ineligible": float(ineligible),
    }
    for name, arr in (("exec", ex), ("ref", rf), ("r_ref", rr)):
        if arr.size:
            out[f"adv/{name}_mean"] = float(arr.mean())
            out[f"adv/{name}_std"] = float(arr.std())
            out[f"adv/{name}_abs_mean"] = float(np.abs(arr).mean())
            out[f"adv/{name}_zero_frac"] = float(np.mean(arr == 0.0))
    return out
