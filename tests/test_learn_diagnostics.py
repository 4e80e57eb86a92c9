"""Per-update diagnostics (``retrojax.learn.diagnostics``) on trials run through the real loop."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from retrojax import config as config_lib
from retrojax.agent.archive import Archive
from retrojax.agent.policies import OraclePolicy
from retrojax.agent.runner import run_trials
from retrojax.learn.advantages import compute_advantages
from retrojax.learn.diagnostics import KINDS, decision_kind, move_class, update_diagnostics


def _run(epsilon: float, protocol: str):
    cfg = config_lib.load("configs/sokoban.yaml", ["trial.prompt_style=compact"])
    archive, _ = run_trials(cfg, OraclePolicy(epsilon), task_ids=range(6), seeds=[1], trials_per_task=4,
                            protocols=[protocol], split="sokoban-6x6-2:test")
    return archive


def test_means_and_counts_follow_the_credits():
    archive = _run(0.5, "T@3")
    adv = compute_advantages(archive)
    diag = update_diagnostics(archive, adv)
    calls = {(c.task, c.trial, c.call_index): c for c in archive.calls}
    kind_of = {cr: decision_kind(calls[(cr.task, cr.trial, cr.call_index)]) for cr in adv.credits}
    by_kind = {k: [cr.advantage for cr in adv.credits if kind_of[cr] == k] for k in KINDS}
    assert by_kind["rewind"] and by_kind["move"], "the noisy oracle moves and rewinds"
    for kind, values in by_kind.items():
        assert diag[f"diag/count/{kind}"] == len(values)
        if values:
            assert diag[f"diag/adv/{kind}"] == pytest.approx(float(np.mean(values)))
    groups = {}
    for t in archive.trials:
        groups.setdefault(t.task, set()).add(bool(t.success))
    assert diag["diag/mixed_groups"] == pytest.approx(np.mean([len(s) == 2 for s in groups.values()]))
    assert diag["diag/solved_groups"] == pytest.approx(np.mean([s == {True} for s in groups.values()]))
    assert diag["diag/failed_groups"] == pytest.approx(np.mean([s == {False} for s in groups.values()]))
    shares = [diag[f"diag/{k}_groups"] for k in ("mixed", "solved", "failed")]
    assert sum(shares) == pytest.approx(1)
    assert all(math.isfinite(v) for v in diag.values())


def test_the_solver_saturates_its_groups():
    """Every group of the deterministic solver is all-solved: no mixed group, so no success signal."""
    archive = _run(0.0, "P@1")
    diag = update_diagnostics(archive, compute_advantages(archive))
    assert diag["diag/mixed_groups"] == 0 and diag["diag/failed_groups"] == 0
    assert diag["diag/solved_groups"] == pytest.approx(np.mean([t.success for t in archive.trials]))


def test_a_kind_without_decisions_has_a_zero_count_and_no_mean():
    archive = _run(0.0, "P@1")  # the solver: no rewinds, no reflections
    diag = update_diagnostics(archive, compute_advantages(archive))
    assert diag["diag/count/rewind"] == 0 and "diag/adv/rewind" not in diag
    assert diag["diag/count/reflection"] == 0 and "diag/adv/reflection" not in diag
    json.dumps(diag, allow_nan=False)  # summary.json and TensorBoard get finite numbers only
    assert math.isnan(update_diagnostics(Archive(), compute_advantages(Archive()))["diag/mixed_groups"])


@pytest.fixture(scope="module")
def best_archive():
    """Noisy-oracle trials (ε 0.9, T@3) on the demo's tiny rooms with each decision's best moves recorded."""
    cfg = config_lib.load("configs/demo.yaml", ["env.push_notes=true"])
    archive, _ = run_trials(cfg, OraclePolicy(0.9), task_ids=range(16), seeds=[0], trials_per_task=8,
                            protocols=["T@3"], split="sokoban-5x5-1:train", record_best=True)
    return archive


def test_the_runner_records_the_shortest_solution_moves(best_archive):
    execution = [c for c in best_archive.calls if c.role == "execution"]
    assert execution and all(c.best_actions is not None for c in execution)
    assert all(c.best_actions is None for c in best_archive.calls if c.role != "execution")
    moves = [c for c in execution if c.valid and not c.is_rewind]
    expert = [c for c in moves if c.teach]  # the oracle's expert moves start a shortest solution
    assert expert and all(move_class(c) == "move_best" for c in expert)
    assert any(move_class(c) == "move_other" for c in moves if not c.teach), "random moves leave the line"
    plain, _ = run_trials(config_lib.load("configs/demo.yaml"), OraclePolicy(0.9), task_ids=range(2),
                          seeds=[0], trials_per_task=2, protocols=["T@3"], split="sokoban-5x5-1:train")
    assert all(c.best_actions is None for c in plain.calls)  # off by default
    assert "diag/best_move_share" not in update_diagnostics(plain, compute_advantages(plain))


def test_best_and_other_moves_split_the_move_credits(best_archive):
    adv = compute_advantages(best_archive)
    diag = update_diagnostics(best_archive, adv)
    calls = {(c.task, c.trial, c.call_index): c for c in best_archive.calls}
    by = {"move_best": [], "move_other": []}
    for cr in adv.credits:
        cls = move_class(calls[(cr.task, cr.trial, cr.call_index)])
        if cls is not None:
            by[cls].append(cr.advantage)
    assert by["move_best"] and by["move_other"]
    for cls, values in by.items():
        assert diag[f"diag/count/{cls}"] == len(values)
        assert diag[f"diag/adv/{cls}"] == pytest.approx(float(np.mean(values)))
    assert diag["diag/count/move_best"] + diag["diag/count/move_other"] == diag["diag/count/move"]
    assert diag["diag/best_move_share"] == pytest.approx(len(by["move_best"]) / diag["diag/count/move"])


def test_in_failed_trials_only_progress_favours_the_best_moves(best_archive):
    """The measurement behind the bench's S: under the reward a failed trial's shortest-solution moves are
    credited below its other moves (walking to the box costs −0.1 a move and scores nothing); under endpoint
    progress above them."""
    reward = update_diagnostics(best_archive, compute_advantages(best_archive, task_score="reward"))
    progress = update_diagnostics(best_archive, compute_advantages(best_archive, task_score="progress"))
    assert reward["diag/adv_failed/move_best"] < reward["diag/adv_failed/move_other"]
    assert progress["diag/adv_failed/move_best"] > progress["diag/adv_failed/move_other"]
    for diag in (reward, progress):  # in every trial the best moves carry the higher mean
        assert diag["diag/adv/move_best"] > diag["diag/adv/move_other"]
