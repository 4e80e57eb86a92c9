"""Held-out intervals count rooms, not trials: a room's seeds are not independent draws."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.eval.metrics import (
    clustered_wilson,
    effective_trials,
    paired_difference,
    paired_outcomes,
    room_success_interval,
    wilson,
)

rooms_of = st.lists(st.booleans(), min_size=2, max_size=60)


def _width(ci: tuple[float, float]) -> float:
    return ci[1] - ci[0]


@settings(max_examples=60, deadline=None)
@given(rooms=rooms_of, seeds=st.integers(2, 5))
def test_agreeing_seeds_widen_the_interval(rooms, seeds):
    """Every seed of a room ends alike: the trials hold one room's worth of evidence each, and the interval
    is that of one trial per room, wider than the per-trial one."""
    groups = [[ok] * seeds for ok in rooms]
    n, wins = len(rooms) * seeds, sum(rooms) * seeds
    assert effective_trials(groups) == pytest.approx(len(rooms))
    assert clustered_wilson(groups) == pytest.approx(wilson(sum(rooms), len(rooms)))
    assert _width(clustered_wilson(groups)) > _width(wilson(wins, n))


@settings(max_examples=60, deadline=None)
@given(rooms=rooms_of)
def test_one_seed_per_room_is_the_per_trial_interval(rooms):
    groups = [[ok] for ok in rooms]
    assert effective_trials(groups) == len(rooms)
    assert clustered_wilson(groups) == wilson(sum(rooms), len(rooms))
    other = [not ok for ok in rooms]
    keys = [f"room{i}" for i in range(len(rooms))]
    assert paired_difference(rooms, other, rooms=keys) == paired_difference(rooms, other)


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(st.booleans(), min_size=1, max_size=4), min_size=1, max_size=40))
def test_never_narrower_than_per_trial_and_contains_the_rate(groups):
    flat = [ok for g in groups for ok in g]
    lo, hi = clustered_wilson(groups)
    naive = wilson(sum(flat), len(flat))
    assert lo <= naive[0] + 1e-12 and hi >= naive[1] - 1e-12
    assert 0.0 <= lo <= sum(flat) / len(flat) <= hi <= 1.0
    largest = max(len(g) for g in groups)
    assert len(flat) / largest - 1e-9 <= effective_trials(groups) <= len(flat) + 1e-9


@settings(max_examples=40, deadline=None)
@given(a=rooms_of, seeds=st.integers(2, 4), data=st.data())
def test_paired_difference_by_room(a, seeds, data):
    """Pairs whose difference is the same under every seed of a room: the paired per-room interval is the
    one of one pair per room, wider than the per-trial one whenever the differences vary."""
    b = data.draw(st.lists(st.booleans(), min_size=len(a), max_size=len(a)))
    rooms = [r for r in range(len(a)) for _ in range(seeds)]
    aa, bb = [a[r] for r in rooms], [b[r] for r in rooms]
    m, lo, hi = paired_difference(aa, bb, rooms=rooms)
    m1, lo1, hi1 = paired_difference(a, b)
    assert m == pytest.approx(m1) and lo == pytest.approx(lo1) and hi == pytest.approx(hi1)
    naive = paired_difference(aa, bb)
    if len({x - y for x, y in zip(a, b, strict=True)}) > 1:
        assert hi - lo > naive[2] - naive[1]


def test_paired_outcomes_cluster_by_level():
    a = {("T@3", level, seed): level % 3 != 0 for level in range(30) for seed in range(4)}
    b = {("T@3", level, seed): level % 5 == 0 for level in range(30) for seed in range(4)}
    m, lo, hi = paired_outcomes(a, b, "T@3")
    per_level = paired_difference([a["T@3", lv, 0] for lv in range(30)],
                                  [b["T@3", lv, 0] for lv in range(30)])
    assert (m, lo, hi) == pytest.approx(per_level)
    assert paired_outcomes(a, b, "P@1") is None
    one_room = paired_difference([True, False], [False, False], rooms=[7, 7])
    assert one_room == (0.5, -1.0, 1.0)  # no room-to-room spread to judge by
    with pytest.raises(ValueError):
        paired_difference([True], [False], rooms=[1, 2])


def test_matches_a_bootstrap_over_rooms():
    """The analytic interval against resampling rooms with all their seeds: the same width within 15% on
    128 rooms x 2 seeds whose seeds agree more often than chance."""
    rng = random.Random(0)
    groups = []
    for _ in range(128):
        p = rng.choice([0.05, 0.5, 0.95])
        groups.append([rng.random() < p for _ in range(2)])
    lo, hi = room_success_interval((i, ok) for i, g in enumerate(groups) for ok in g)
    sums = np.array([sum(g) for g in groups], float)
    draws = np.random.default_rng(0).integers(0, len(groups), size=(4000, len(groups)))
    rates = sums[draws].sum(axis=1) / (2 * len(groups))
    b_lo, b_hi = np.quantile(rates, [0.025, 0.975])
    assert abs((hi - lo) - (b_hi - b_lo)) < 0.15 * (b_hi - b_lo)
    flat = [ok for g in groups for ok in g]
    assert hi - lo > 1.1 * _width(wilson(sum(flat), len(flat)))
