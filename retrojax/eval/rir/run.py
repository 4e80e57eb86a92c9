"""RIR protocols inside ``retrojax eval``: one paired batch of every RIR name given, same tasks and seeds;
:func:`format_eval` prints their columns after ReTRAIL's table (this module never imports
``eval.protocol`` or ``eval.rir.report``: both build on it)."""

from __future__ import annotations

import time
from typing import Any

from retrojax.agent.env_api import make_env
from retrojax.agent.policies import TranscriptPolicy
from retrojax.agent.rir.policies import as_rir_policy
from retrojax.agent.rir.runner import RIRBatch, run_rir
from retrojax.eval.rir import metrics


def evaluate_rir(
    cfg: Any,
    policy: Any,
    split: str,
    protocols: list[str],
    seeds: int,
    tasks: int | None = None,
    trials_per_task: int | None = None,
    env: Any = None,
    transcripts: Any = None,
) -> tuple[dict[str, Any], RIRBatch]:
    """Run ``protocols`` (RIR names) as one paired batch; returns (report part, batch). ``transcripts``: an
    open text file for one JSON line per model call (agent and auxiliary)."""
    own = env is None
    env = make_env(cfg, split) if env is None else env
    try:
        n = env.num_tasks if tasks is None else min(tasks, env.num_tasks)
        start = time.perf_counter()
        runs = as_rir_policy(policy, cfg)
        if transcripts is not None:
            runs = TranscriptPolicy(runs, transcripts)
        sync = getattr(runs, "sync_stats", None)
        before = dict(sync()) if callable(sync) else None
        batch = run_rir(
            cfg,
            runs,
            task_ids=range(n),
            seeds=range(seeds),
            trials_per_task=trials_per_task,
            protocols=protocols,
            env=env,
        )
        elapsed = time.perf_counter() - start
        errors = dict(env.errors()) if hasattr(env, "errors") else {}
        cache = _delta(before, sync()) if callable(sync) else None
    finally:
        if own:
            env.close()
    results = metrics.summarize(batch.records)
    part = {
        "results": results,
        "rir": {
            "protocols": protocols,
            "seconds": elapsed,
            "acceptance": metrics.acceptance(batch.records),
            "world_errors": {str(k): v for k, v in errors.items()},
            "comparisons": metrics.comparisons(batch.records),
            "seconds_per_trial": elapsed / max(1, len(batch.records)),  # the whole paired batch's wall time
            "groups": batch.groups,  # trials run together (sampler.max_inflight): protocols, wall seconds
        },
    }
    if cache is not None:
        part["rir"]["agent_cache"] = cache
    return part, batch


def _delta(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """This run's share of a model policy's cumulative row-sync counters."""
    base = before or {}
    return {k: v - base.get(k, 0) for k, v in after.items()}


def format_eval(report: dict[str, Any]) -> str:
    """The RIR columns of ``retrojax eval`` (printed after ReTRAIL's table)."""
    rir = report["rir"]
    lines = ["RIR variants (one paired batch):", metrics.format_table(report["results"], rir["protocols"])]
    for key, d in rir.get("acceptance", {}).items():
        if key in rir.get("comparisons", {}):
            continue  # printed with the comparisons below
        lines.append(f"paired {key}: {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] (n = {d['n']})")
    for name in rir["protocols"]:
        r = report["results"].get(name, {})
        bad = r.get("parse_failures_by_role")
        if bad and any(bad.values()):
            lines.append(
                f"{name}: auxiliary replies that failed to parse: "
                + ", ".join(f"{k} {v}/{r['aux_calls_by_role_total'][k]}" for k, v in bad.items())
                + f" (reviews with no readable verdict: {r.get('verdict_fallbacks_total', 0)})"
            )
        if r.get("restores_refused_total"):
            lines.append(f"{name}: restores refused (too few calls left): {r['restores_refused_total']}")
    for key, d in rir.get("comparisons", {}).items():
        lines.append(f"paired {key}: {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] (n = {d['n']})")
    lines.append(
        f"wall time: {rir['seconds']:.1f} s for the paired batch, {rir['seconds_per_trial']:.2f} s per trial "
        "(run one protocol alone for its own wall time per task)"
    )
    groups = rir.get("groups") or []
    if len(groups) > 1:
        for g in groups:
            lines.append(
                f"group of {g['trials']} trials ({', '.join(g['protocols'])}): {g['seconds']:.1f} s, "
                f"{g['seconds'] / max(1, g['trials']):.2f} s per trial"
            )
    cache = rir.get("agent_cache")
    if cache:
        lines.append(metrics.format_cache(cache))
    if rir.get("world_errors"):
        lines.append(f"world errors: {rir['world_errors']}")
    return "\n".join(lines)
