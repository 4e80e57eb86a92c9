"""Per-update learning diagnostics from the archive and its advantages (host numpy).

What a careful RL engineer watches before changing a knob: whether the groups can rank at all (groups with
both a success and a failure), where the credit goes by decision kind (a policy can learn "stop" or "rewind"
without reading the board if those kinds carry positive mean advantage in failed trials), and how many turns
are invalid. Logged by the trainer under ``diag/…`` each update.

Where the world recorded its best actions at each decision (``CallRecord.best_actions``, Sokoban in RL
collection) the moves split further into ``best`` (the move starts a shortest solution) and ``other``: the
gradient can only teach the board if ``diag/adv/move_best`` sits above ``diag/adv/move_other``, in failed
trials too (``diag/adv_failed/…``), which are most trials of a weak policy.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from retrojax.agent.archive import EXECUTION, Archive, CallRecord
from retrojax.learn.advantages import Advantages

KINDS = ("move", "rewind", "invalid", "reflection")
MOVE_CLASSES = ("move_best", "move_other")  # moves at states whose best actions were recorded
GROUP_SHARES = ("mixed", "solved", "failed")  # diag/<share>_groups: how the task groups split by outcome


def decision_kind(call: CallRecord) -> str:
    """move | rewind | invalid | reflection of one trained call."""
    if call.role != EXECUTION:
        return "reflection"
    if not call.valid:
        return "invalid"
    return "rewind" if call.is_rewind else "move"


def move_class(call: CallRecord) -> str | None:
    """move_best | move_other for a valid move whose state's best actions were recorded; None otherwise (a
    dead state lists none: every move there is ``move_other``). A multi-move action counts by its first
    move."""
    if call.best_actions is None or decision_kind(call) != "move":
        return None
    first = call.action.split(",")[0].strip()
    return "move_best" if first in call.best_actions else "move_other"


def group_outcomes(archive: Archive) -> dict[int, str]:
    """task → ``mixed`` (a success and a failure), ``solved`` (every trial) or ``failed`` (no trial)."""
    by_task: dict[int, list[bool]] = defaultdict(list)
    for t in archive.trials:
        by_task[t.task].append(bool(t.success))
    return {task: "solved" if all(v) else "mixed" if any(v) else "failed" for task, v in by_task.items()}


def group_composition(archive: Archive) -> dict[str, float]:
    """Shares of task groups that are mixed (a success and a failure: the only groups whose macro advantage
    can rank trials), all solved and all failed — NaN each without trials. A pool whose groups saturate into
    all-solved / all-failed leaves RL without a success signal however long it runs."""
    outcomes = list(group_outcomes(archive).values())
    if not outcomes:
        return dict.fromkeys(GROUP_SHARES, float("nan"))
    return {share: float(np.mean([o == share for o in outcomes])) for share in GROUP_SHARES}


def update_diagnostics(archive: Archive, adv: Advantages) -> dict[str, float]:
    """``diag/mixed_groups`` / ``diag/solved_groups`` / ``diag/failed_groups``, ``diag/adv/<kind>`` (mean
    advantage over all trials), ``diag/adv_failed/<kind>`` (in failed trials only; a mean is left out when its
    kind made no decision), ``diag/count/<kind>`` and ``diag/invalid_per_trial``; with recorded best actions
    also ``move_best`` / ``move_other`` as kinds and ``diag/best_move_share`` (best among those moves)."""
    calls = {(c.task, c.trial, c.call_index): c for c in archive.calls}
    success = {(t.task, t.trial): bool(t.success) for t in archive.trials}
    values: dict[str, list[float]] = defaultdict(list)
    failed: dict[str, list[float]] = defaultdict(list)
    for cr in adv.credits:
        call = calls.get((cr.task, cr.trial, cr.call_index))
        if call is None:
            continue
        lost = not success.get((cr.task, cr.trial), False)
        for kind in (decision_kind(call), move_class(call)):
            if kind is None:
                continue
            values[kind].append(cr.advantage)
            if lost:
                failed[kind].append(cr.advantage)
    out = {f"diag/{name}_groups": share for name, share in group_composition(archive).items()}
    recorded = any(c.best_actions is not None for c in archive.calls)
    for kind in KINDS + (MOVE_CLASSES if recorded else ()):
        out[f"diag/count/{kind}"] = float(len(values[kind]))
        if values[kind]:  # a kind with no decision this update has a count of 0 and no mean (not NaN)
            out[f"diag/adv/{kind}"] = float(np.mean(values[kind]))
        if failed[kind]:
            out[f"diag/adv_failed/{kind}"] = float(np.mean(failed[kind]))
    n_classed = len(values["move_best"]) + len(values["move_other"])
    if n_classed:
        out["diag/best_move_share"] = len(values["move_best"]) / n_classed
    n_trials = len(archive.trials)
    invalid = sum(1 for c in archive.calls if c.role == EXECUTION and not c.valid)
    out["diag/invalid_per_trial"] = invalid / n_trials if n_trials else float("nan")
    return out
