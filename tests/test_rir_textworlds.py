"""RIR on the host text worlds: restores replay the retained commands without divergence (the bridge checks
every replayed observation), and the restored observation equals the one recorded at C_r.

ScienceWorld runs on find-living-thing:225/226, which start in the art studio: its three wood cups are listed
in a new order after each reset, so these restores pass only because the bridge compares listings as
multisets and the world's state key (an exact-text check reported them as diverged)."""

from __future__ import annotations

import pytest

from retrojax import config
from retrojax.agent.env_api import make_env
from retrojax.agent.rir.policies import RIRRandomPolicy
from retrojax.agent.rir.runner import RIRRunner, make_specs
from retrojax.agent.rir.settings import Settings

pytestmark = pytest.mark.textworlds


@pytest.mark.parametrize(
    "world, split",
    [("scienceworld", "scienceworld-find-living-thing:test"), ("alfworld", "alfworld-gen:test")],
)
def test_rir_restores_by_replay_without_divergence(world, split, tmp_path):
    cfg = config.load(
        None,
        [
            f"env.name={world}",
            f"env.cache_dir={tmp_path}",
            "env.text_workers=2",
            "env.step_timeout_s=120",
            "env.num_tasks=2",
        ],
    )
    env = make_env(cfg, split)
    try:
        runner = RIRRunner(
            cfg,
            env,
            RIRRandomPolicy(rollback_prob=0.35, malformed=0.0),
            settings=Settings(rollback_budget=3, agent_budget=10),
        )
        batch = runner.run(make_specs([0, 1], [0], 1, ["RIR", "RIR/restart"]))
        assert env.errors() == {}
    finally:
        env.close()
    records = batch.records
    assert sum(r.rollbacks for r in records) >= 2
    assert all(len(r.restore_ok) == r.rollbacks and all(r.restore_ok) for r in records)
    assert all(r.agent_calls <= 10 for r in records)
