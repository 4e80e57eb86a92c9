"""Metrics: Wilson intervals, per-protocol summaries and deltas (clustered intervals: test_eval_clustered)."""

from __future__ import annotations

import math

import pytest

from retrojax.agent.archive import TrialRecord
from retrojax.eval.metrics import paired_difference, summarize, wilson


def test_wilson_known_values():
    lo, hi = wilson(5, 10)
    assert math.isclose(lo, 0.2366, abs_tol=1e-4) and math.isclose(hi, 0.7634, abs_tol=1e-4)
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and math.isclose(hi, 0.2775, abs_tol=1e-4)
    lo, hi = wilson(10, 10)
    assert math.isclose(lo, 0.7225, abs_tol=1e-4) and hi == 1.0
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson(3, 2)


def _trial(i, protocol, seed, success, **kw):
    return TrialRecord(trial=i, task=i % 4, seed=seed, protocol=protocol, success=success,
                       calls_execution=kw.get("calls", 4), calls_reflection=kw.get("refl", 0),
                       rewinds_model=kw.get("rm", 0), rewinds_forced=kw.get("rf", 0),
                       distinct_states=5, actions_to_success=7 if success else None)


def test_summarize_protocols_and_deltas():
    trials = [_trial(i, "P@1", i % 2, i % 4 == 0) for i in range(8)]
    trials += [_trial(i, "T@1", i % 2, i % 2 == 0, rm=1, refl=1) for i in range(8)]
    trials += [_trial(i, "T@3", i % 2, i < 6, rf=1, refl=1) for i in range(8)]
    out = summarize(trials)
    r = out["results"]
    assert r["P@1"]["success"] == 0.25 and r["T@1"]["success"] == 0.5 and r["T@3"]["success"] == 0.75
    assert out["delta_pro"] == 0.25 and out["delta_ref"] == 0.25
    assert r["T@1"]["calls"] == 5 and r["T@1"]["rewinds"] == 1 and r["T@3"]["rewinds_forced"] == 1
    assert r["P@1"]["seed_success"] == {"0": 0.5, "1": 0.0}
    assert math.isclose(r["P@1"]["seed_std"], math.sqrt(0.125))
    assert r["P@1"]["actions_to_success"] == 7 and r["P@1"]["rooms"] == 4
    # P@1: tasks 0 and 2 (two seeds each) split 1/1 and 0/0, 1 and 3 fail twice: clustered by task, never
    # narrower than the per-trial interval
    lo, hi = r["P@1"]["ci95"]
    naive = wilson(2, 8)
    assert lo <= naive[0] and hi >= naive[1] and r["P@1"]["effective_trials"] <= 8
    assert "delta_ref" not in summarize(trials[:8])


def test_paired_difference():
    m, lo, hi = paired_difference([True, True, False, True], [False, True, False, False])
    assert m == 0.5 and lo < m < hi
    assert paired_difference([True] * 3, [True] * 3) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        paired_difference([True], [])
