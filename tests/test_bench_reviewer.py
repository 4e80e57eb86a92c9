"""``retrojax bench reviewer``: the quick run through the CLI writes every figure the issue names (not the
goals), and the paired difference clustered by level is the plain paired mean with a level-level interval."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax import cli
from retrojax.bench.reviewer import clustered_difference
from retrojax.eval.metrics import paired_difference

KEYS = [
    *(f"reviewer.parse.{r}" for r in ("review", "coarse", "fine", "patch")),
    *(f"reviewer.calls.{r}" for r in ("review", "coarse", "fine", "patch")),
    "reviewer.rollbacks_per_trial",
    "reviewer.rir_minus_react", "reviewer.rir_minus_react.ci95_lo", "reviewer.rir_minus_react.ci95_hi",
    "reviewer.restore_precision", "reviewer.review_agreement",
    "reviewer.wall_s", "reviewer.demos_s", "reviewer.sft_s", "reviewer.eval_s",
    "reviewer.success.RIR", "reviewer.success.react", "reviewer.tokens_per_trial.RIR",
    "reviewer.seconds_per_trial.RIR", "reviewer.seconds_per_trial.react",
    # --baselines: the paper's baselines demonstrated and run with the same policy in their roles
    *(f"reviewer.parse.{r}" for r in ("critique", "reflect", "value", "assist")),
    *(f"reviewer.rir_minus_{b}" for b in ("self-refine", "reflexion", "lats", "ga-rollback")),
    *(f"reviewer.demo.targets.{r}" for r in ("review", "critique", "value", "assist")),
    "reviewer.aux_calls_per_trial.lats", "reviewer.rollbacks_per_trial.ga-rollback",
    # --credit 1: one update with reviewer credit and one without, from the same start
    *(f"reviewer.credit.{arm}.{k}" for arm in ("credit", "control")
      for k in ("rir_minus_react", "rir_minus_react.ci95_lo", "at_1.success.RIR", "lambda_ref", "s")),
    "reviewer.credit.gain_over_control", "reviewer.credit.gain_over_control.ci95_hi",
]


def test_quick_run_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "reviewer.json"
    assert cli.main(["bench", "reviewer", "--quick", "--baselines", "--credit", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    missing = [k for k in KEYS if k not in figures]
    assert not missing, missing
    for r in ("review", "coarse", "fine", "patch"):
        assert 0.0 <= figures[f"reviewer.parse.{r}"] <= 1.0
    # reviews counted by the controller's calls and per trial agree (whether an untrained 2-step policy lives
    # long enough to be reviewed depends on float rounding: jax 0.12 and a fresh clone's programs differ)
    assert (figures["reviewer.calls.review"] > 0) == (figures["reviewer.reviews_per_trial"] > 0)
    lo, m, hi = (figures[f"reviewer.rir_minus_react{s}"] for s in (".ci95_lo", "", ".ci95_hi"))
    assert lo <= m <= hi
    assert figures["reviewer.credit.control.lambda_ref"] == 0.0 < figures["reviewer.credit.credit.lambda_ref"]
    assert "reviewer.parse.review:" in capsys.readouterr().out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=30), st.integers(1, 3))
def test_clustered_difference_is_the_paired_mean(pairs, reps):
    """Every level played ``reps`` times alike: the mean is the plain paired mean and the interval the paired
    interval over levels (replicates of a level are one cluster, not independent pairs)."""
    a, b = {}, {}
    for level, (x, y) in enumerate(pairs):
        for rep in range(reps):
            a[(0, level, rep)], b[(0, level, rep)] = float(x), float(y)
    m, lo, hi, n = clustered_difference(a, b)
    assert n == len(pairs) and lo <= m <= hi
    pm, plo, phi = paired_difference([x for x, _ in pairs], [y for _, y in pairs])
    assert (m, lo, hi) == pytest.approx((pm, plo, phi), abs=1e-12)


def test_clustered_difference_needs_shared_runs():
    with pytest.raises(ValueError):
        clustered_difference({(0, 1, 0): 1.0}, {(0, 2, 0): 0.0})
