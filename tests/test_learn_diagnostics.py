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
from retrojax.learn.diagnostics import KINDS, decision_kind, update_diagnostics


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
