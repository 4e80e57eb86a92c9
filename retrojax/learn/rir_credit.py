"""Reviewer credit (beyond both papers): ReTRAIL's credit applied to RIR's roles, trained by ReTRAIL's update.

With one policy in every RIR role, an RIR trial is a group member as a ReTRAIL trial is (the task's
``trial.trials_per_task`` trials form the group):

- **agent calls** get the task-wide outcome term: the trial's score ``S`` (``learn.task_score``: ``progress``
  is the world's branch value of the final path from ``C_0``, ``reward`` the trial's success) normalized over
  the task's trials — the macro term of State-Anchored GRPO;
- **an executed recovery** — the review that said Rollback and the coarse selection, fine selection and
  patch that carried it out — earns its advancement ``r = V(resumed | C_r) − V(abandoned | C_r)``: the world's
  branch value from the restore point of the branch resumed there (up to the next restore or the trial's
  end) minus that of the branch it abandoned, normalized over the task's recoveries and weighted
  ``learn.lambda_ref``, as ReTRAIL credits a reflection (its advancement reward). Reviews that said
  Continue are not trained.

``learn.lambda_ref = 0`` is the control: the same update with the agent's term only. Values are the world's
hidden progress measure, used for credit only — no role is shown them. :class:`RIRCollect` is the
``collect`` of :class:`retrojax.learn.trainer.Trainer` for RIR trials; :meth:`RIRCollect.credit` its
``credit``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from retrojax.agent.archive import EXECUTION, REFLECTION, Archive, CallRecord
from retrojax.learn.advantages import Advantages, Credit, norm

RECOVERY_ROLES = ("review", "coarse", "fine", "patch")


def recovery_calls(calls: Sequence[CallRecord], after_call: int) -> list[CallRecord]:
    """The auxiliary calls that carried out one restore: the review that said Rollback and the coarse, fine
    and patch calls after it, up to ``after_call`` (an earlier review that said Continue is not part of it);
    empty when no review precedes the restore."""
    block: list[CallRecord] = []
    for c in reversed(calls[:after_call]):
        if c.role not in RECOVERY_ROLES:
            return []
        block.append(c)
        if c.role == "review":
            return block[::-1]
    return []


def reviewer_credit(archive: Archive, records: Sequence[Any], *, lambda_ref: float = 1.0,
                    task_score: str = "progress") -> Advantages:
    """Credits for one batch of RIR trials (see the module docstring). ``records``: the trials'
    :class:`~retrojax.agent.rir.controller.RIRRecord` (``final_value`` and the restores' values)."""
    if task_score not in ("progress", "reward"):
        raise ValueError(f"task_score must be progress or reward, got {task_score!r}")
    by_trial: dict[int, list[CallRecord]] = defaultdict(list)
    for c in archive.calls:
        by_trial[c.trial].append(c)
    for calls in by_trial.values():
        calls.sort(key=lambda c: c.call_index)
    groups: dict[int, list[Any]] = defaultdict(list)
    for rec in records:
        groups[rec.task].append(rec)
    credits: list[Credit] = []
    macro: dict[tuple[int, int, int], float] = {}
    reward: dict[tuple[int, int, int], float] = {}
    ineligible = 0
    for task, recs in sorted(groups.items()):
        scores = [float(r.final_value) if task_score == "progress" else float(r.success) for r in recs]
        for rec, a in zip(recs, norm(scores), strict=True):
            for c in by_trial.get(rec.trial, []):
                if c.role == EXECUTION and c.teach and len(c.output_ids):
                    credits.append(Credit(task, rec.trial, c.call_index, EXECUTION, float(a)))
                    macro[(task, rec.trial, c.call_index)] = float(a)
        recoveries: list[tuple[list[CallRecord], float]] = []
        for rec in recs:
            for x in rec.restores:
                block = recovery_calls(by_trial.get(rec.trial, []), int(x["after_call"]))
                if "v_resumed" not in x or not block:
                    ineligible += 1
                    continue
                recoveries.append((block, float(x["v_resumed"]) - float(x["v_abandoned"])))
        for (block, r), a in zip(recoveries, norm([r for _, r in recoveries]), strict=True):
            for c in block:
                if len(c.output_ids):
                    credits.append(Credit(task, c.trial, c.call_index, REFLECTION, float(a)))
            reward[(task, block[0].trial, block[0].call_index)] = r
    stats = {"credit/recoveries": float(len(reward)), "credit/ineligible_recoveries": float(ineligible),
             "credit/advancement_mean": float(np.mean(list(reward.values()))) if reward else 0.0,
             "credit/recovery_calls": float(sum(c.role == REFLECTION for c in credits)),
             "credit/lambda_ref": float(lambda_ref)}
    return Advantages(credits, {}, macro, {}, reward, ineligible, stats)


class RIRCollect:
    """``collect`` for the learner: RIR trials (``protocol``, default RIR itself) of the training split with
    one ``ModelPolicy`` in every role; keeps the batch's records for :meth:`credit`."""

    def __init__(self, cfg: Any, tokenizer: Any, protocol: str = "RIR"):
        from retrojax.agent.env_api import make_env

        self.cfg, self.tokenizer, self.protocol = cfg, tokenizer, protocol
        self.env = make_env(cfg, f"{cfg.env.split.split(':')[0]}:train")
        self.policy: Any = None
        self.runner: Any = None
        self.records: list[Any] = []

    def __call__(self, model: Any, tasks: Sequence[int], seeds: Sequence[int]) -> tuple[Archive, dict]:
        from retrojax.agent.policies import ModelPolicy
        from retrojax.agent.rir.policies import RIRModelPolicy
        from retrojax.agent.rir.runner import RIRRunner
        from retrojax.agent.trial import TrialSpec

        if len(tasks) != len(seeds):
            raise ValueError(f"collect needs one seed per task, got {len(tasks)} tasks, {len(seeds)} seeds")
        if self.policy is None:
            self.policy = RIRModelPolicy(ModelPolicy.from_config(self.cfg, model, self.tokenizer))
            self.runner = RIRRunner(self.cfg, self.env, self.policy, record_tokens=True)
        else:
            inner = self.policy.inner
            inner.model = model
            if inner.sampler is not None:
                inner.sampler.update_model(model)
        self.policy.inner.seed, self.policy.inner.ticks = int(seeds[0]) if seeds else 0, 0
        b = self.cfg.trial.trials_per_task
        specs = [TrialSpec(trial=i * b + r, task=int(task), seed=int(seed), replicate=r,
                           protocol=self.protocol)
                 for i, (task, seed) in enumerate(zip(tasks, seeds, strict=True)) for r in range(b)]
        batch = self.runner.run(specs)
        self.records = list(batch.records)
        recs = self.records
        metrics = {"success": float(np.mean([r.success for r in recs])),
                   "rollbacks_per_trial": float(np.mean([r.rollbacks for r in recs])),
                   "reviews_per_trial": float(np.mean([r.reviews for r in recs])),
                   "invalid_per_trial": float(np.mean([r.invalid_turns for r in recs])),
                   "parse_problems_per_trial": float(np.mean([r.parse_problems for r in recs]))}
        return batch.archive, metrics

    def credit(self, archive: Archive, learn_cfg: Any) -> Advantages:
        """:func:`reviewer_credit` of the last collection (the learner's ``credit``)."""
        return reviewer_credit(archive, self.records, lambda_ref=float(learn_cfg.lambda_ref),
                               task_score=str(learn_cfg.task_score))

    def release(self) -> None:
        """Drop the policy's weights and its sampler's before the update (as ``RunnerCollect`` does)."""
        if self.policy is not None:
            self.policy.inner.model = None
            if self.policy.inner.sampler is not None:
                self.policy.inner.sampler.release_weights()

    def close(self) -> None:
        self.env.close()
