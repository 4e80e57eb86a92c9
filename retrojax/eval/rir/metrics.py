"""RIR metrics over :class:`~retrojax.agent.rir.controller.RIRRecord` s.

Per protocol: ``success`` with its 95% interval ``ci95`` clustered by task (``eval.metrics``), per-seed
rates (mean ± std), ``dense_reward`` (ScienceWorld: the normalized final score; the games: the binary
outcome), ``actions`` (environment actions executed, abandoned ones included), ``steps`` (length of the
final path), ``reviews`` (and by trigger), ``rollbacks`` (executed restores), ``recoveries``, ``aux_calls``
(and by role), ``agent_calls``, plus the keys ReTRAIL's eval table prints (``calls``, ``rewinds``,
``distinct_states``, ``actions_to_success``). :func:`paired` gives the mean paired difference of two
protocols over the same (seed, task, replicate) with a normal 95% interval clustered by task.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from retrojax.agent.rir.controller import AUX_ROLES, RIRRecord
from retrojax.eval.metrics import (
    _mean,
    _std,
    clustered_wilson,
    group_by_room,
    paired_difference,
    seed_success_rates,
    token_usage,
)


def protocol_summary(records: Sequence[RIRRecord]) -> dict[str, Any]:
    n = len(records)
    wins = sum(r.success for r in records)
    seed_rates = seed_success_rates(records)
    lo, hi = clustered_wilson(group_by_room((r.task, r.success) for r in records))

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
        "resets": mean(lambda r: r.resets),  # Reflexion's new trials
        "recoveries": mean(lambda r: r.recoveries),
        "aux_calls": mean(lambda r: r.aux_calls),
        "aux_by_role": {k: mean(lambda r, k=k: r.aux_by_role[k]) for k in AUX_ROLES},
        "agent_calls": mean(lambda r: r.agent_calls),
        "invalid_turns": mean(lambda r: r.invalid_turns),
        "end_reasons": {
            k: sum(r.end_reason == k for r in records) / n for k in sorted({r.end_reason for r in records})
        },
        "parse_problems": mean(lambda r: r.parse_problems),
        # totals (not means): how often each role's reply failed to parse, out of how many calls
        "parse_failures_by_role": {k: sum(r.parse_problems_by_role[k] for r in records) for k in AUX_ROLES},
        "verdict_fallbacks_total": sum(r.verdict_fallbacks for r in records),  # reviews read as no verdict
        "aux_calls_by_role_total": {k: sum(r.aux_by_role[k] for r in records) for k in AUX_ROLES},
        "restores_refused": mean(lambda r: r.restores_refused),
        "restores_refused_total": sum(r.restores_refused for r in records),
        "marked_to_verify": mean(lambda r: r.marked_to_verify),
        "patterns_promoted": mean(lambda r: r.patterns_promoted),
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
    """Mean of ``a − b`` over runs sharing (seed, task, replicate), its 95% interval clustered by task."""
    by: dict[str, dict[tuple[int, int, int], float]] = defaultdict(dict)
    for r in records:
        by[r.protocol][(r.seed, r.task, r.replicate)] = float(getattr(r, field))
    keys = sorted(set(by[a]) & set(by[b]))
    if not keys:
        raise ValueError(f"no paired runs of {a} and {b}")
    m, lo, hi = paired_difference([by[a][k] for k in keys], [by[b][k] for k in keys],
                                  rooms=[k[1] for k in keys])
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


COMPARISONS = (
    ("RIR", "RIR/react"),
    ("RIR", "RIR/no-rollback"),
    ("RIR", "RIR/restart"),
    ("RIR", "RIR/self-refine"),  # the paper's §5.1 baselines
    ("RIR", "RIR/reflexion"),
    ("RIR", "RIR/lats"),
    ("RIR", "RIR/ga-rollback"),
)


def comparisons(records: Sequence[RIRRecord], fields: Sequence[str] = ("success", "dense_reward")) -> dict:
    """Paired differences of RIR against its main-table ablations, for the protocols present (no pass/fail:
    a model run reports what it found)."""
    present = {r.protocol for r in records}
    return {
        f"{a} - {b} ({f})": paired(records, a, b, f)
        for a, b in COMPARISONS
        if a in present and b in present
        for f in fields
    }


def format_cache(c: dict[str, Any]) -> str:
    """The model rows' prefix reuse (:class:`~retrojax.agent.rir.policies.RIRModelPolicy` counters)."""

    def share(enc: str, tot: str) -> str:
        return f"{c[enc]}/{c[tot]} tokens encoded" + (
            f" ({100 * c[enc] / c[tot]:.1f}%)" if c.get(tot) else ""
        )

    return (
        f"agent rows: {c['agent_calls']} calls, {share('agent_encoded_tokens', 'agent_prompt_tokens')}; "
        f"agent calls right after an auxiliary call: {c['agent_after_aux_calls']}, "
        f"{share('agent_after_aux_encoded_tokens', 'agent_after_aux_prompt_tokens')}; "
        f"auxiliary rows: {c['aux_calls']} calls, {share('aux_encoded_tokens', 'aux_prompt_tokens')}"
    )


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
