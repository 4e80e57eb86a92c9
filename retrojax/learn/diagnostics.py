"""Per-update learning diagnostics from the archive and its advantages (host numpy).

What a careful RL engineer watches before changing a knob: whether the groups can rank at all (groups with
both a success and a failure), where the credit goes by decision kind (a policy can learn "stop" or "rewind"
without reading the board if those kinds carry positive mean advantage in failed trials), and how many turns
are invalid. Logged by the trainer under ``diag/…`` each update.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from retrojax.agent.archive import EXECUTION, Archive, CallRecord
from retrojax.learn.advantages import Advantages

KINDS = ("move", "rewind", "invalid", "reflection")
GROUP_SHARES = ("mixed", "solved", "failed")  # diag/<share>_groups: how the task groups split by outcome


def decision_kind(call: CallRecord) -> str:
    """move | rewind | invalid | reflection of one trained call."""
    if call.role != EXECUTION:
        return "reflection"
    if not call.valid:
        return "invalid"
    return "rewind" if call.is_rewind else "move"


def group_composition(archive: Archive) -> dict[str, float]:
    """Shares of task groups that are mixed (a success and a failure: the only groups whose macro advantage
    can rank trials), all solved and all failed — NaN each without trials. A pool whose groups saturate into
    all-solved / all-failed leaves RL without a success signal however long it runs."""
    by_task: dict[int, list[bool]] = defaultdict(list)
    for t in archive.trials:
        by_task[t.task].append(bool(t.success))
    if not by_task:
        return dict.fromkeys(GROUP_SHARES, float("nan"))
    groups = list(by_task.values())
    return {"mixed": float(np.mean([any(v) and not all(v) for v in groups])),
            "solved": float(np.mean([all(v) for v in groups])),
            "failed": float(np.mean([not any(v) for v in groups]))}


def update_diagnostics(archive: Archive, adv: Advantages) -> dict[str, float]:
    """``diag/mixed_groups`` / ``diag/solved_groups`` / ``diag/failed_groups``, ``diag/adv/<kind>`` (mean
    advantage over all trials), ``diag/adv_failed/<kind>`` (in failed trials only; a mean is left out when its
    kind made no decision), ``diag/count/<kind>`` and ``diag/invalid_per_trial``."""
    calls = {(c.task, c.trial, c.call_index): c for c in archive.calls}
    success = {(t.task, t.trial): bool(t.success) for t in archive.trials}
    values: dict[str, list[float]] = defaultdict(list)
    failed: dict[str, list[float]] = defaultdict(list)
    for cr in adv.credits:
        call = calls.get((cr.task, cr.trial, cr.call_index))
        if call is None:
            continue
        kind = decision_kind(call)
        values[kind].append(cr.advantage)
        if not success.get((cr.task, cr.trial), False):
            failed[kind].append(cr.advantage)
    out = {f"diag/{name}_groups": share for name, share in group_composition(archive).items()}
    for kind in KINDS:
        out[f"diag/count/{kind}"] = float(len(values[kind]))
        if values[kind]:  # a kind with no decision this update has a count of 0 and no mean (not NaN)
            out[f"diag/adv/{kind}"] = float(np.mean(values[kind]))
        if failed[kind]:
            out[f"diag/adv_failed/{kind}"] = float(np.mean(failed[kind]))
    n_trials = len(archive.trials)
    invalid = sum(1 for c in archive.calls if c.role == EXECUTION and not c.valid)
    out["diag/invalid_per_trial"] = invalid / n_trials if n_trials else float("nan")
    return out
