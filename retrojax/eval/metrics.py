"""Evaluation metrics over trial records: success with room-clustered 95% intervals, per-seed spread, costs.

Trials of one room (a level or board, played under several seeds) are not independent: a room the policy
solves under one seed it tends to solve under the others. Every interval here therefore counts rooms, not
trials. ``clustered_wilson`` is the Wilson score interval at the trials' *effective* number: the trial
count divided by the design effect, the cluster-robust variance of the pooled rate (each room's summed
residual, squared) over the binomial one; ``paired_difference`` with ``rooms`` pairs trials and clusters
their differences by room the same way (a paired per-room test). With one trial per room both reduce
exactly to the per-trial intervals (``wilson``, the paired normal interval), and they are never narrower.
The analytic form is deterministic (no resampling seed in a report) and keeps Wilson's behaviour at 0% and
100%; a bootstrap that resamples rooms with all their seeds gives intervals of the same width
(tests/test_eval_clustered.py compares the two).

``summarize(trials)`` groups ``TrialRecord``s by protocol and reports, per protocol: the pooled success
rate and its room-clustered interval (``ci95``; ``rooms`` and ``effective_trials`` beside it), the
per-seed success rates with their mean and standard deviation,
mean calls (execution, reflection, total), rewinds (model, forced), macro-attempts, invalid turns,
distinct states visited, actions (primitive moves) to success, a served model's reported tokens
(``tokens``, summed from the records) and how trials ended (``end_reasons``: the fraction of trials per
termination reason, e.g. ``context`` when the conversation outgrew the model's context). With several
protocols it adds ``delta_pro = T@1 − P@1`` and ``delta_ref = T@3 − T@1`` when those protocols are present.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from retrojax.agent.archive import TrialRecord

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (``(0, 1)`` when ``n == 0``)."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 ≤ successes ≤ n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    return _wilson(successes / n, n, z, successes == 0, successes == n)


def _wilson(p: float, n: float, z: float, at_zero: bool, at_one: bool) -> tuple[float, float]:
    """Wilson's interval for rate ``p`` over ``n`` (possibly fractional) trials."""
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if at_zero else max(0.0, centre - half)
    hi = 1.0 if at_one else min(1.0, centre + half)
    return lo, hi


def group_by_room(outcomes: Iterable[tuple[Hashable, float]]) -> list[list[float]]:
    """``(room, outcome)`` pairs as one list of outcomes per room (rooms in first-seen order)."""
    groups: dict[Hashable, list[float]] = {}
    for room, y in outcomes:
        groups.setdefault(room, []).append(float(y))
    return list(groups.values())


def _sizes(groups: Sequence[Sequence[float]]) -> tuple[int, int]:
    if any(len(g) == 0 for g in groups):
        raise ValueError("every room needs at least one trial")
    return sum(len(g) for g in groups), max((len(g) for g in groups), default=0)


def effective_trials(groups: Sequence[Sequence[float]]) -> float:
    """How many independent trials the outcomes (0/1, one list per room) are worth: ``n`` over the design
    effect ``Σ_room (Σ_trial (y − p̂))² / (n p̂ (1 − p̂))``, the design effect kept within [1, the largest
    room's trials]. One trial per room gives ``n``; a room's seeds that always agree count as one trial.
    At ``p̂`` of 0 or 1 nothing is seen to vary: the rooms count (``n`` over the mean trials per room)."""
    n, largest = _sizes(groups)
    if n == 0:
        return 0.0
    if largest == 1:
        return float(n)
    p = sum(sum(g) for g in groups) / n
    if p <= 0.0 or p >= 1.0:
        return float(len(groups))
    deff = sum((sum(g) - len(g) * p) ** 2 for g in groups) / (n * p * (1 - p))
    return n / min(max(deff, 1.0), float(largest))


def clustered_wilson(groups: Sequence[Sequence[bool]], z: float = Z95) -> tuple[float, float]:
    """Wilson interval of the pooled success rate of trials grouped by room (one list per room, all of a
    room's seeds in it) at their ``effective_trials``; ``wilson`` exactly when every room has one trial."""
    n, largest = _sizes(groups)
    wins = sum(sum(bool(y) for y in g) for g in groups)
    if largest <= 1:
        return wilson(wins, n, z)
    return _wilson(wins / n, effective_trials(groups), z, wins == 0, wins == n)


def room_success_interval(outcomes: Iterable[tuple[Hashable, bool]], z: float = Z95) -> tuple[float, float]:
    """``clustered_wilson`` of ``(room, success)`` pairs, e.g. ``((task, ok) for each trial)``."""
    return clustered_wilson(group_by_room(outcomes), z)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def seed_success_rates(records: Sequence[Any]) -> dict[str, float]:
    """Success rate per seed (seed as a string key, in order) of records with ``seed`` and ``success``."""
    by_seed: dict[int, list[bool]] = defaultdict(list)
    for r in records:
        by_seed[r.seed].append(r.success)
    return {str(s): sum(v) / len(v) for s, v in sorted(by_seed.items())}


def protocol_summary(trials: Sequence[TrialRecord]) -> dict[str, Any]:
    """Metrics of one protocol's trials (see the module docstring)."""
    n = len(trials)
    wins = sum(t.success for t in trials)
    seed_rates = seed_success_rates(trials)
    rates = list(seed_rates.values())
    rooms = group_by_room((t.task, t.success) for t in trials)
    lo, hi = clustered_wilson(rooms)
    solved = [t.actions_to_success for t in trials if t.success and t.actions_to_success is not None]
    return {
        "n": n,
        "success": wins / n if n else 0.0,
        "ci95": [lo, hi],
        "rooms": len(rooms),
        "effective_trials": effective_trials(rooms),
        "seed_success": seed_rates,
        "seed_mean": _mean(rates) or 0.0,
        "seed_std": _std(rates),
        "calls": _mean([t.calls_execution + t.calls_reflection for t in trials]),
        "calls_execution": _mean([t.calls_execution for t in trials]),
        "calls_reflection": _mean([t.calls_reflection for t in trials]),
        "rewinds": _mean([t.rewinds_model + t.rewinds_forced for t in trials]),
        "rewinds_model": _mean([t.rewinds_model for t in trials]),
        "rewinds_forced": _mean([t.rewinds_forced for t in trials]),
        "macro_attempts": _mean([t.macro_attempts for t in trials]),
        "invalid_turns": _mean([t.invalid_turns for t in trials]),
        "distinct_states": _mean([t.distinct_states for t in trials]),
        "actions_to_success": _mean(solved),
        "end_reasons": {r: c / n for r, c in sorted(_count(t.end_reason or "open" for t in trials).items())},
        **token_usage(trials),
    }


def token_usage(records: Sequence[Any]) -> dict[str, Any]:
    """A served model's reported tokens summed from the archive records (0 for local models): totals and
    per-trial means under ``tokens``."""
    n = len(records)
    prompt = sum(int(getattr(r, "prompt_tokens", 0)) for r in records)
    completion = sum(int(getattr(r, "completion_tokens", 0)) for r in records)
    return {"tokens": {"prompt_tokens": prompt, "completion_tokens": completion,
                       "prompt_tokens_per_trial": prompt / n if n else 0.0,
                       "completion_tokens_per_trial": completion / n if n else 0.0}}


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for x in items:
        out[x] += 1
    return dict(out)


def summarize(trials: Iterable[TrialRecord]) -> dict[str, Any]:
    """``{"results": {protocol: metrics}, "delta_pro": …, "delta_ref": …}`` (deltas only when defined)."""
    groups: dict[str, list[TrialRecord]] = defaultdict(list)
    for t in trials:
        groups[t.protocol].append(t)
    results = {p: protocol_summary(ts) for p, ts in sorted(groups.items())}
    out: dict[str, Any] = {"results": results}
    if "P@1" in results and "T@1" in results:
        out["delta_pro"] = results["T@1"]["success"] - results["P@1"]["success"]
    if "T@1" in results and "T@3" in results:
        out["delta_ref"] = results["T@3"]["success"] - results["T@1"]["success"]
    return out


def paired_outcomes(a: Mapping[tuple[str, int, int], bool], b: Mapping[tuple[str, int, int], bool],
                    protocol: str) -> tuple[float, float, float] | None:
    """Mean of ``a − b`` over the (protocol, level, seed) trials both policies played under ``protocol``, with
    its 95% interval clustered by level (a paired per-room test); None when they share none."""
    keys = sorted(k for k in a if k[0] == protocol and k in b)
    if not keys:
        return None
    return paired_difference([a[k] for k in keys], [b[k] for k in keys], rooms=[k[1] for k in keys])


def paired_difference(a: Sequence[float], b: Sequence[float], z: float = Z95,
                      rooms: Sequence[Hashable] | None = None) -> tuple[float, float, float]:
    """Mean of ``a − b`` over paired trials and its normal-approximation 95% interval.

    ``rooms`` (the room of each pair): the standard error is clustered by room, ``√(G/(G−1) ·
    Σ_room (Σ_trial (d − d̄))²) / n`` over ``G`` rooms, and never below the per-trial one; with one pair per
    room it is the per-trial interval exactly. A single room with several pairs gives no room-to-room spread
    to judge by: the interval is the whole range of a difference, [−1, 1] for 0/1 outcomes."""
    if len(a) != len(b) or not a:
        raise ValueError("paired_difference needs two non-empty sequences of the same length")
    if rooms is not None and len(rooms) != len(a):
        raise ValueError(f"paired_difference: {len(rooms)} rooms for {len(a)} pairs")
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    n = len(d)
    m = sum(d) / n
    se = _std(d) / math.sqrt(n)
    if rooms is not None:
        groups = group_by_room(zip(rooms, d, strict=True))
        if len(groups) == 1 and n > 1:
            return m, min(m, -1.0), max(m, 1.0)
        if len(groups) < n:
            g = len(groups)
            clustered = math.sqrt(g / (g - 1) * sum((sum(x) - len(x) * m) ** 2 for x in groups)) / n
            se = max(se, clustered)
    return m, m - z * se, m + z * se
