"""Oracle acceptance of RIR (one paired batch per world, 3 seeds, every test task): SR(RIR) − SR(RIR/react)
and SR(RIR) − SR(RIR/no-rollback) have paired 95% lower bounds above 0, and RIR/hybrid-fixed reviews more
than RIR. The report's full-size run (8 replicates, every variant) is `retrojax eval … --seeds 3`."""

from __future__ import annotations

import pytest

from retrojax import config
from retrojax.eval.protocol import evaluate, make_policy
from retrojax.eval.rir.metrics import paired


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, split", [("sokoban", "sokoban-6x6-2:test"), ("minesweeper", "minesweeper-6x6-3:test")]
)
def test_oracle_acceptance_paired_batch(world, split, monkeypatch):
    cfg = config.load(f"configs/rir_{world}.yaml")
    captured = {}
    import retrojax.eval.rir.run as run

    original = run.run_rir

    def keep(*args, **kwargs):
        captured["batch"] = original(*args, **kwargs)
        return captured["batch"]

    monkeypatch.setattr(run, "run_rir", keep)
    protocols = ["RIR", "RIR/react", "RIR/no-rollback", "RIR/hybrid-fixed"]
    report = evaluate(cfg, make_policy("oracle:0.3", cfg), split, protocols, seeds=3, trials_per_task=1)
    records = captured["batch"].records
    assert report["tasks"] == 128 and len(records) == 4 * 128 * 3
    for other in ("RIR/react", "RIR/no-rollback"):
        d = paired(records, "RIR", other)
        assert d["n"] == 384 and d["lo"] > 0, (world, other, d)
    res = report["results"]
    assert res["RIR/hybrid-fixed"]["reviews"] > res["RIR"]["reviews"]
    for name in protocols:
        assert set(res[name]) >= {
            "success",
            "ci95",
            "dense_reward",
            "actions",
            "reviews",
            "rollbacks",
            "aux_calls",
        }
