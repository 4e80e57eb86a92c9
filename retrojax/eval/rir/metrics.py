"""RIR metrics over :class:`~retrojax.agent.rir.controller.RIRRecord` s.

Per protocol: ``success`` with its Wilson 95% interval ``ci95``, per-seed rates (mean ± std),
``dense_reward`` (ScienceWorld: the normalized final score; the games: the binary outcome), ``actions``
(environment actions executed, abandoned ones included), ``steps`` (length of the final path), ``reviews``
(and by trigger), ``rollbacks`` (executed restores), ``recoveries``, ``aux_calls`` (and by role),
``agent_calls``, plus the keys ReTRAIL's eval table prints (``calls``, ``rewinds``, ``distinct_states``,
``actions_to_success``). :func:`paired` gives the mean paired difference of two protocols over the same
(seed, task, replicate) with a normal 95% interval.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from retrojax.agent.rir.controller import AUX_ROLES, RIRRecord
from retrojax.eval.metrics import _mean, _std, paired_difference, seed_success_rates, token_usage, wilson


def protocol_summary(records: Sequence[RIRRecord]) -> dict[str, Any]:
    n = len(records)
    wins = sum(r.success for r in records)
    seed_rates = seed_success_rates(records)
    lo, hi = wilson(wins, n)

    def mean(f) -> float:
        return _mean([float(f(r)) for r in records]) or 0.0

    solved = [r.actions for r in records if r.success]
    return {
        "n": n,
        "success": wins / n if n else 0.0,
        "ci95": [lo, hi],
        "seed_success": seed_rates,
        "seed_mean": _mean(list(seed_rates.values())) or 0.0,
        "seed_std": _std(list(seed_rates.values())),
        "dense_reward": mean(lambda r: r.dense_reward),
        "actions": mean(lambda r: r.actions),
        "steps": mean(lambda r: r.steps),
        "reviews": mean(lambda r: r.reviews),
        "reviews_by_trigger": {
            k: mean(lambda r, k=k: r.reviews_by_trigger[k]) for k in ("agent", "schedule", "failure")
        },
        "rollbacks": mean(lambda r: r.rollbacks),
        "recoveries": mean(lambda r: r.recoveries),
        "aux_calls": mean(lambda r: r.aux_calls),
        "aux_by_role": {k: mean(lambda r, k=k: r.aux_by_role[k]) for k in AUX_ROLES},
        "agent_calls": mean(lambda r: r.agent_calls),
        "invalid_turns": mean(lambda r: r.invalid_turns),
        "parse_problems": mean(lambda r: r.parse_problems),
        "calls": mean(lambda r: r.agent_calls + r.aux_calls),
        "rewinds": mean(lambda r: r.rollbacks),
        "distinct_states": mean(lambda r: r.distinct_states),
        "actions_to_success": _mean([float(a) for a in solved]),
        "api_failures": mean(lambda r: r.api_failures),
        **token_usage(records),
    }


def summarize(records: Iterable[RIRRecord]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RIRRecord]] = defaultdict(list)
    for r in records:
        groups[r.protocol].append(r)
    return {p: protocol_summary(rs) for p, rs in sorted(groups.items())}


def paired(records: Iterable[RIRRecord], a: str, b: str, field: str = "success") -> dict[str, float]:
    """Mean of ``a − b`` over runs sharing (seed, task, replicate), with its 95% interval."""
    by: dict[str, dict[tuple[int, int, int], float]] = defaultdict(dict)
    for r in records:
        by[r.protocol][(r.seed, r.task, r.replicate)] = float(getattr(r, field))
    keys = sorted(set(by[a]) & set(by[b]))
    if not keys:
        raise ValueError(f"no paired runs of {a} and {b}")
    m, lo, hi = paired_difference([by[a][k] for k in keys], [by[b][k] for k in keys])
    return {"mean": m, "lo": lo, "hi": hi, "n": len(keys)}


ACCEPTANCE = (
    ("RIR", "RIR/react", "success"),
    ("RIR", "RIR/no-rollback", "success"),
    ("RIR/hybrid-fixed", "RIR", "reviews"),
)


def acceptance(records: Sequence[RIRRecord]) -> dict[str, dict[str, Any]]:
    """The issue's oracle checks, for the protocols present: paired lower bounds above 0."""
    present = {r.protocol for r in records}
    out = {}
    for a, b, field in ACCEPTANCE:
        if a in present and b in present:
            d = paired(records, a, b, field)
            out[f"{a} - {b} ({field})"] = {**d, "pass": d["lo"] > 0}
    return out


def format_table(results: dict[str, dict[str, Any]], protocols: Sequence[str]) -> str:
    lines = [
        f"{'protocol':<20}{'SR':>7}{'95% CI':>16}{'DR':>7}{'actions':>9}{'steps':>7}{'reviews':>9}"
        f"{'rollbacks':>10}{'aux':>7}{'agent':>7}"
    ]
    for p in protocols:
        if p not in results:
            continue
        r = results[p]
        ci = f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
        lines.append(
            f"{p:<20}{r['success']:>7.3f}{ci:>16}{r['dense_reward']:>7.3f}{r['actions']:>9.1f}"
            f"{r['steps']:>7.1f}{r['reviews']:>9.2f}{r['rollbacks']:>10.2f}{r['aux_calls']:>7.2f}"
            f"{r['agent_calls']:>7.1f}"
        )
    return "\n".join(lines)
