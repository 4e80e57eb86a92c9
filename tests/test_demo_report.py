"""The run report: tables, honest comparison sentences, and the three PNG plots."""

import dataclasses

import pytest

from retrojax.eval import report

RESULTS = {
    "SFT": {"P@1": {"success": 0.25, "ci95": [0.15, 0.35], "calls": 6.0, "rewinds": 0.0, "n": 64},
            "T@1": {"success": 0.30, "ci95": [0.20, 0.40], "calls": 7.5, "rewinds": 0.4, "n": 64},
            "T@3": {"success": 0.50, "ci95": [0.38, 0.62], "calls": 11.0, "rewinds": 1.2, "n": 64}},
    "RL": {"P@1": {"success": 0.40, "ci95": [0.28, 0.52], "calls": 5.0, "rewinds": 0.0, "n": 64},
           "T@1": {"success": 0.45, "ci95": [0.33, 0.57], "calls": 6.0, "rewinds": 0.2, "n": 64},
           "T@3": {"success": 0.80, "ci95": [0.70, 0.90], "calls": 9.0, "rewinds": 0.9, "n": 64}},
}


@dataclasses.dataclass
class _Trial:
    success: bool
    macro_attempts: int


def test_success_within_attempts_is_cumulative():
    trials = [_Trial(True, 1), _Trial(True, 2), _Trial(False, 3), _Trial(True, 3)]
    assert report.success_within_attempts(trials, 3) == [0.25, 0.5, 0.75]
    with pytest.raises(ValueError):
        report.success_within_attempts([], 3)
    with pytest.raises(ValueError):
        report.success_within_attempts(trials, 0)


def test_deltas_and_sentences():
    d = report.deltas(RESULTS["SFT"])
    assert d["Δpro"] == pytest.approx(0.05) and d["Δref"] == pytest.approx(0.20)
    assert report.deltas({"P@1": {"success": 0.1}}) == {}
    better = report.compare_sentence(RESULTS, "SFT", "RL", "T@3")
    assert "improved on" in better and "do not overlap" in better and "+30.0 pts" in better
    same_ish = report.compare_sentence(RESULTS, "SFT", "RL", "T@1")
    assert "not statistically supported" in same_ish
    worse = report.compare_sentence(RESULTS, "RL", "SFT", "P@1")
    assert "did worse than" in worse
    assert "No T@9 results" in report.compare_sentence(RESULTS, "SFT", "RL", "T@9")


def test_write_report_produces_markdown_and_plots(tmp_path):
    curve = [{"update": i, "success": 0.3 + 0.05 * i, "reward": float(i),
              "eval_success": 0.5 if i == 3 else None} for i in range(4)]
    path = report.write_report(
        tmp_path / "r", title="Demo", results=RESULTS, curve=curve,
        attempts={"SFT": [0.3, 0.45, 0.5], "RL": [0.45, 0.7, 0.8]}, facts={"model": "Qwen3, 1.2M params"},
        stages=[("sft", 12.0), ("rl", 30.5)], comparisons=[("SFT", "RL", "T@3")], notes=["honest note"])
    text = path.read_text()
    assert "| RL | T@3 | 80.0% | [70.0, 90.0] | 64 | 9.00 | 0.90 |" in text
    assert "+20.0 pts" in text and "+35.0 pts" in text  # Δref of SFT and of RL
    assert "**total** | 42.5" in text and "honest note" in text and "Qwen3, 1.2M params" in text
    for png in ("success_by_protocol.png", "learning_curve.png", "success_vs_attempts.png"):
        data = (tmp_path / "r" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
        assert f"]({png})" in text


def test_write_report_without_rl_updates_says_so(tmp_path):
    path = report.write_report(tmp_path, title="t", results={"SFT": RESULTS["SFT"]})
    assert "No RL updates were run." in path.read_text()
    with pytest.raises(ValueError):
        report.write_report(tmp_path, title="t", results={})


def _history(successes, trials=48):
    return [{"iteration": i + 1, "rollout/success": s, "rollout/trials": float(trials),
             "time/collect_s": 10.0, "time/learn_s": 5.0} for i, s in enumerate(successes)]


def test_demo_notes_say_whether_training_batch_success_rose_with_intervals():
    from types import SimpleNamespace

    from retrojax import demo

    curve = demo.learning_curve(_history([0.25, 0.25, 0.5, 0.75, 0.75]))
    assert [p["wall_s"] for p in curve] == [15.0, 30.0, 45.0, 60.0, 75.0]
    change = demo.batch_success_change(curve)
    assert change["first"]["updates"] == [1, 2] and change["last"]["updates"] == [4, 5]
    assert change["first"]["trials"] == 96 and change["first"]["success"] == pytest.approx(0.25)
    assert change["last"]["success"] == pytest.approx(0.75) and not change["overlap"]
    lo, hi = change["first"]["ci95"]
    assert lo < 0.25 < hi
    note = demo.batch_success_note(change)
    assert note.startswith("Training-batch success rose: 25.0%") and "do not overlap" in note
    # three updates: the windows are update 1 and update 3 (never shared); a small change is not supported
    short = demo.batch_success_change(demo.learning_curve(_history([0.5, 0.4, 0.52], trials=16)))
    assert short["first"]["updates"] == [1] and short["last"]["updates"] == [3] and short["overlap"]
    assert "not statistically supported" in demo.batch_success_note(short)
    assert demo.batch_success_change(demo.learning_curve(_history([0.5]))) is None
    cfg = SimpleNamespace(trial=SimpleNamespace(protocol="T@3", trials_per_task=8),
                          eval=SimpleNamespace(protocols=["P@1", "T@3"]),
                          learn=SimpleNamespace(tasks_per_update=6))
    notes = demo.closing_notes(RESULTS, _history([0.25, 0.25, 0.5, 0.75]), cfg)
    assert notes[0].startswith("Training-batch success rose")
    held = [n for n in notes if n.startswith("Held-out: ")]
    assert len(held) == 2 and "T@3" in held[1] and "do not overlap" in held[1]


def test_a_paired_comparison_is_judged_by_its_paired_interval(tmp_path):
    """Held-out SFT and RL play the same levels and seeds: the report judges RL − SFT by the paired interval
    (the transfer recipe's seed 0, 2026-12-06: separate intervals overlapped while the paired one was
    [+5.4, +16.5])."""
    from retrojax import demo
    from retrojax.agent.archive import Archive, TrialRecord

    def archive(wins: list[bool]) -> Archive:
        return Archive(trials=[TrialRecord(trial=i, task=i % 8, seed=i // 8, protocol="T@1", success=ok)
                               for i, ok in enumerate(wins)])

    sft = [i % 4 == 0 for i in range(64)]  # 16 of 64
    # the same wins and 8 more, spread over four levels (two seeds each): +12.5 pts. The paired interval is
    # clustered by level, so 8 more wins on one level alone would not exclude 0
    rl = [ok or i % 8 == 2 * (i // 8 % 4) + 1 for i, ok in enumerate(sft)]
    pairs = demo.heldout_pairs(archive(sft), archive(rl), ["T@1", "T@3"])
    assert list(pairs) == [("SFT", "RL", "T@1")]  # no T@3 trials: no pair
    mean, lo, hi = pairs[("SFT", "RL", "T@1")]
    assert mean == pytest.approx(0.125) and 0 < lo < mean < hi
    one_level = [ok or i % 8 == 1 for i, ok in enumerate(sft)]
    assert demo.heldout_pairs(archive(sft), archive(one_level), ["T@1"])[("SFT", "RL", "T@1")][1] < 0
    overlapping = {"SFT": {"T@1": {"success": 0.25, "ci95": [0.16, 0.37]}},
                   "RL": {"T@1": {"success": 0.375, "ci95": [0.27, 0.50]}}}
    assert "not statistically supported" in report.compare_sentence(overlapping, "SFT", "RL", "T@1")
    sentence = report.compare_sentence(overlapping, "SFT", "RL", "T@1", paired=pairs[("SFT", "RL", "T@1")])
    assert "paired by level and seed, +12.5 pts" in sentence and "excludes 0" in sentence
    noisy = report.compare_sentence(overlapping, "SFT", "RL", "T@1", paired=(0.05, -0.02, 0.12))
    assert "includes 0" in noisy and "not statistically supported" in noisy
    path = report.write_report(tmp_path, title="t", results=overlapping, comparisons=[("SFT", "RL", "T@1")],
                               paired=pairs)
    assert "excludes 0" in path.read_text()
