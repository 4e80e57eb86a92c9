"""``retrojax bench credit`` on noisy-oracle trials run through the real loop."""

from __future__ import annotations

import argparse

import pytest

from retrojax.bench import credit


@pytest.fixture(scope="module")
def figures():
    return credit.run(tasks=16, log=lambda _: None)


def test_every_decision_is_counted_once_per_rule(figures):
    rules = {k.split(".")[1] + "." + k.split(".")[2] for k in figures if k.count(".") >= 4}
    assert rules == {f"{s}.{r}" for s in ("reward", "progress") for r in ("segment", "resumed")}
    totals = {rule: sum(v for k, v in figures.items() if k.startswith(f"credit.{rule}.") and k.endswith(".n"))
              for rule in rules}
    assert len(set(totals.values())) == 1 and next(iter(totals.values())) > 100  # the same decisions
    assert sum(figures[f"credit.groups.{g}"] for g in credit.GROUPS) == pytest.approx(1.0)
    for k, v in figures.items():
        if k.endswith(".n") and v == 0:
            assert k[:-2] not in figures  # no mean without decisions


def test_the_rules_rank_failed_groups_moves_as_measured(figures):
    """In groups without a success the reward credits the shortest-solution moves far below the other moves
    (they walk toward the box at −0.1 a move and score nothing); progress closes most of that gap; the resumed
    rewind return credits rewinds below the paper's segment return."""
    f = figures

    def gap(rule: str) -> float:
        return f[f"credit.{rule}.failed.move_best"] - f[f"credit.{rule}.failed.move_other"]

    assert gap("reward.segment") < -1.0 < gap("progress.segment")
    for score in ("reward", "progress"):
        assert f[f"credit.{score}.resumed.failed.rewind"] < f[f"credit.{score}.segment.failed.rewind"]
    for rule in ("reward.segment", "progress.segment"):
        assert f[f"credit.{rule}.mixed.move_best"] > f[f"credit.{rule}.mixed.move_other"]


def test_bad_input_is_a_clear_error(capsys):
    args = argparse.Namespace(policy="oracle:0.9", tasks=0, overrides=[], quick=False, json=None)
    assert credit.main(args) == 2
    assert "--tasks must be >= 1" in capsys.readouterr().err
    args.tasks, args.policy = 2, "bogus"
    assert credit.main(args) == 2
    assert "unknown policy" in capsys.readouterr().err
