"""``retrojax bench credit``: where the advantages of one RL-sized batch go, under each credit rule.

One collection of training trials (``--tasks`` levels × ``trial.trials_per_task`` trials, ``trial.protocol``)
by a policy (``--policy``: ``oracle:EPS`` needs no checkpoint, ``model:DIR`` a saved policy), each decision's
shortest-solution moves recorded (Sokoban), and the advantages of that one archive under every pair of
``learn.task_score`` × ``learn.rewind_return``. Figures (stable keys), per rule ``<score>.<rewind>``:

- ``credit.<score>.<rewind>.<group>.<kind>``: mean advantage, ``….n``: decisions, for ``group`` in
  ``failed`` / ``mixed`` / ``solved`` (the task group's outcome: no trial solved / some / all) and ``kind``
  in ``move_best`` (the move starts a shortest solution), ``move_other``, ``rewind``, ``invalid``;
- ``credit.success``, ``credit.groups.{failed,mixed,solved}``: the batch itself.

RL can only teach the board where ``move_best`` is credited above ``move_other``; a rewind credited above
both in failed groups is the pull toward ending segments early (docs/benchmarks.md#credit, 2026-12-05).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from typing import Any

import numpy as np

GROUPS = ("failed", "mixed", "solved")
CREDIT_KINDS = ("move_best", "move_other", "rewind", "invalid")
QUICK = ["trial.trials_per_task=4"]


def credit_figures(archive: Any, learn_cfg: Any) -> dict[str, float]:
    """The per-rule figures of one archive (see the module docstring); other ``learn`` fields from
    ``learn_cfg`` (estimator, λ_state, γ, invalid penalty)."""
    from retrojax.learn.advantages import REWIND_RETURNS, TASK_SCORES, advantages_from_config
    from retrojax.learn.diagnostics import decision_kind, group_composition, group_outcomes, move_class

    group = group_outcomes(archive)
    out: dict[str, float] = {"credit.success": float(np.mean([t.success for t in archive.trials]))}
    out.update({f"credit.groups.{g}": share for g, share in group_composition(archive).items()})
    calls = {(c.task, c.trial, c.call_index): c for c in archive.calls}
    for score in TASK_SCORES:
        for rewind in REWIND_RETURNS:
            rule = dataclasses.replace(learn_cfg, task_score=score, rewind_return=rewind)
            adv = advantages_from_config(archive, rule)
            values: dict[tuple[str, str], list[float]] = defaultdict(list)
            for cr in adv.credits:
                call = calls[(cr.task, cr.trial, cr.call_index)]
                kind = move_class(call) or decision_kind(call)
                if kind in CREDIT_KINDS:
                    values[(group[cr.task], kind)].append(cr.advantage)
            for g in GROUPS:
                for kind in CREDIT_KINDS:
                    v = values[(g, kind)]
                    key = f"credit.{score}.{rewind}.{g}.{kind}"
                    out[f"{key}.n"] = float(len(v))
                    if v:  # no decision of that kind: a count of 0 and no mean
                        out[key] = float(np.mean(v))
    return out


def run(*, quick: bool = False, log: Any = print, policy: str = "oracle:0.9", tasks: int = 64,
        overrides: list[str] | None = None) -> dict[str, float]:
    from retrojax import config as config_lib
    from retrojax.agent.runner import run_trials
    from retrojax.eval.protocol import make_policy

    cfg = config_lib.load("configs/demo.yaml", [*(QUICK if quick else []), *(overrides or [])])
    if tasks < 1:
        raise ValueError(f"--tasks must be >= 1, got {tasks}")
    n = min(tasks, 4) if quick else tasks
    split = f"{cfg.env.split.split(':')[0]}:train"
    log(f"[credit] {policy}: {n} training levels x {cfg.trial.trials_per_task} trials, {cfg.trial.protocol}")
    archive, _ = run_trials(cfg, make_policy(policy, cfg), task_ids=range(n), seeds=[cfg.run.seed],
                            split=split, record_best=True)
    if not any(c.best_actions is not None for c in archive.calls):
        log(f"[credit] {cfg.env.name} lists no best actions: the move_best / move_other figures stay empty")
    return credit_figures(archive, cfg.learn)


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench credit [--policy P] [--tasks N] [--set K=V] [--quick] [--json PATH]``."""
    from retrojax.bench import run_and_report

    def bound(*, quick: bool, log: Any) -> dict[str, float]:
        return run(quick=quick, log=log, policy=args.policy, tasks=args.tasks, overrides=args.overrides)

    try:
        return run_and_report(bound, args)
    except ValueError as e:  # a bad policy spec, task count or --set: say so, no traceback
        print(f"retrojax bench credit: {e}", file=sys.stderr)
        return 2
