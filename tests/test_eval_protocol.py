"""Protocol runs: OraclePolicy(0.3) orders T@3 ≥ T@1 ≥ P@1 with statistical support; `retrojax eval`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retrojax import cli, config
from retrojax.agent.games import MineSweeperEnv, SokobanEnv
from retrojax.agent.policies import OraclePolicy
from retrojax.agent.runner import run_trials
from retrojax.eval.metrics import paired_difference
from retrojax.eval.protocol import make_policy

CFG = config.load(None, [])
# P@1 has no branch budget (C.4); the ordering below compares protocols at the same turn allowance per path
CAPPED = config.load(None, [f"trial.p1_max_turns={CFG.trial.branch_budget}"])


@pytest.mark.parametrize("world,split", [(SokobanEnv, "sokoban-6x6-2:test"),
                                         (MineSweeperEnv, "minesweeper-6x6-3:test")])
def test_oracle_protocol_ordering(world, split):
    env = world(split)
    assert env.num_tasks >= 128
    # every task × 3 seeds × 1 trial per protocol, all protocols in one batch (1,152 trials)
    archive, metrics = run_trials(CAPPED, OraclePolicy(0.3), task_ids=range(128), seeds=[0, 1, 2],
                                  trials_per_task=1, protocols=["P@1", "T@1", "T@3"], env=env,
                                  record_tokens=False)
    env.close()
    wins = {p: {} for p in ("P@1", "T@1", "T@3")}
    for t in archive.trials:
        wins[t.protocol][(t.seed, t.task)] = t.success
    keys = sorted(wins["P@1"])
    assert len(keys) == 384 and all(sorted(w) == keys for w in wins.values())
    p1, t1, t3 = (np.array([wins[p][k] for k in keys]) for p in ("P@1", "T@1", "T@3"))
    assert t3.mean() >= t1.mean() >= p1.mean()
    # paired over (seed, task): T@3 is significantly better than T@1 and P@1; T@1 is not worse than P@1
    assert paired_difference(list(t3), list(t1))[1] > 0
    assert paired_difference(list(t3), list(p1))[1] > 0
    assert paired_difference(list(t1), list(p1))[1] > -0.02
    r = metrics["results"]
    assert r["T@3"]["ci95"][0] > r["P@1"]["ci95"][1]  # non-overlapping Wilson intervals
    assert r["T@3"]["rewinds_forced"] > 0 and r["P@1"]["rewinds"] == 0 and r["T@1"]["rewinds_forced"] == 0


def test_eval_cli_json(tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = cli.main(["eval", "--config", "configs/minesweeper.yaml", "--policy", "oracle:0.3",
                     "--protocol", "P@1,T@1", "--protocol", "T@3", "--tasks", "4", "--seeds", "2",
                     "--set", "trial.trials_per_task=1", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    for p in ("P@1", "T@1", "T@3"):
        r = report["results"][p]
        assert 0 <= r["success"] <= 1 and len(r["ci95"]) == 2 and r["ci95"][0] <= r["success"] <= r["ci95"][1]
        assert r["calls"] > 0 and r["rewinds"] >= 0 and r["n"] == 8
        assert set(r["seed_success"]) == {"0", "1"}
    assert report["delta_pro"] == report["results"]["T@1"]["success"] - report["results"]["P@1"]["success"]
    assert "delta_ref" in report and report["split"] == "minesweeper-6x6-3:test"
    text = capsys.readouterr().out
    assert "Δref" in text and "T@3" in text
    assert cli.main(["eval", "--config", "configs/minesweeper.yaml", "--policy", "nonsense"]) == 2
    assert cli.main(["eval", "--config", "configs/sokoban.yaml", "--protocol", "Q@2"]) == 2
    assert "unknown protocol" in capsys.readouterr().err


def test_make_policy_specs():
    assert make_policy("oracle:0.25", CFG).epsilon == 0.25
    assert make_policy("random", CFG).rewind_prob == 0.1
    for bad in ("oracle:x", "oracle:2", "model:", "greedy"):
        with pytest.raises(ValueError):
            make_policy(bad, CFG)


def test_eval_over_several_worlds_reports_the_equal_benchmark_mean(tmp_path, capsys):
    """C.5: M_s = mean over worlds of seed s's success (each world weighs 1), then mean ± std over seeds."""
    out = tmp_path / "worlds.json"
    code = cli.main(["eval", "--config", "configs/sokoban.yaml,configs/minesweeper.yaml", "--policy",
                     "oracle:0.3", "--protocol", "P@1,T@3", "--tasks", "3", "--seeds", "2",
                     "--set", "trial.trials_per_task=2", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    worlds = report["worlds"]
    assert set(worlds) == {"sokoban-6x6-2:test", "minesweeper-6x6-3:test"}
    for p in ("P@1", "T@3"):
        agg = report["benchmark_mean"][p]
        per_seed = {s: np.mean([w["results"][p]["seed_success"][s] for w in worlds.values()]) for s in "01"}
        assert agg["per_seed"] == pytest.approx(per_seed)
        assert agg["mean"] == pytest.approx(np.mean(list(per_seed.values())))
        assert agg["seed_std"] == pytest.approx(np.std(list(per_seed.values()), ddof=1))
    assert "equal-benchmark mean" in capsys.readouterr().out
