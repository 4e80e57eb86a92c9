"""Evaluation metrics over trial records: success with Wilson 95% intervals, per-seed spread, costs.

``summarize(trials)`` groups ``TrialRecord``s by protocol and reports, per protocol: the pooled success
rate and its Wilson score interval, the per-seed success rates with their mean and standard deviation,
mean calls (execution, reflection, total), rewinds (model, forced), macro-attempts, invalid turns,
distinct states visited, actions (primitive moves) to success, a served model's reported tokens
(``tokens``, summed from the records) and how trials ended (``end_reasons``: the fraction of trials per
termination reason, e.g. ``context`` when the conversation outgrew the model's context). With several
protocols it adds ``delta_pro = T@1 − P@1`` and ``delta_ref = T@3 − T@1`` when those protocols are present.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from retrojax.agent.archive import TrialRecord

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (``(0, 1)`` when ``n == 0``)."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 ≤ successes ≤ n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


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
    lo, hi = wilson(wins, n)
    solved = [t.actions_to_success for t in trials if t.success and t.actions_to_success is not None]
    return {
        "n": n,
        "success": wins / n if n else 0.0,
        "ci95": [lo, hi],
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
    its 95% interval; None when they share none."""
    keys = sorted(k for k in a if k[0] == protocol and k in b)
    return paired_difference([a[k] for k in keys], [b[k] for k in keys]) if keys else None


def paired_difference(a: Sequence[bool], b: Sequence[bool], z: float = Z95) -> tuple[float, float, float]:
    """Mean of ``a − b`` over paired trials and its normal-approximation 95% interval."""
    if len(a) != len(b) or not a:
        raise ValueError("paired_difference needs two non-empty sequences of the same length")
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    m = sum(d) / len(d)
    se = _std(d) / math.sqrt(len(d))
    return m, m - z * se, m + z * se
