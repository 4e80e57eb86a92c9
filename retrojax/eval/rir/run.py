"""RIR protocols inside ``retrojax eval``: one paired batch of every RIR name given, same tasks and seeds."""

from __future__ import annotations

import time
from typing import Any

from retrojax.agent.env_api import make_env
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
) -> tuple[dict[str, Any], RIRBatch]:
    """Run ``protocols`` (RIR names) as one paired batch; returns (report part, batch)."""
    own = env is None
    env = make_env(cfg, split) if env is None else env
    try:
        n = env.num_tasks if tasks is None else min(tasks, env.num_tasks)
        start = time.perf_counter()
        batch = run_rir(
            cfg,
            as_rir_policy(policy, cfg),
            task_ids=range(n),
            seeds=range(seeds),
            trials_per_task=trials_per_task,
            protocols=protocols,
            env=env,
        )
        elapsed = time.perf_counter() - start
        errors = dict(env.errors()) if hasattr(env, "errors") else {}
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
        },
    }
    return part, batch
