"""``retrojax bench learn``: figures from a demo summary (keys, windows, intervals) and the CLI entry."""

import pytest

from retrojax import cli
from retrojax.bench.learn import figures_from_summary


def test_figures_have_the_issue_keys_and_pool_the_first_and_last_two_updates():
    curve = [{"update": i + 1, "success": s, "trials": 32, "wall_s": 60.0 * (i + 1)}
             for i, s in enumerate([0.25, 0.375, 0.5, 0.5, 0.625, 0.75])]
    results = {"SFT": {"T@3": {"success": 0.3, "ci95": [0.2, 0.4]}},
               "RL": {"T@3": {"success": 0.5, "ci95": [0.4, 0.6]}}}
    f = figures_from_summary({"curve": curve, "results": results}, wall_s=500.0)
    assert f["learn.updates"] == 6 and f["learn.wall_s"] == 500.0 and f["learn.rl_wall_s"] == 360.0
    assert f["learn.success.first"] == pytest.approx((0.25 + 0.375) / 2)
    assert f["learn.success.last"] == pytest.approx((0.625 + 0.75) / 2)
    assert f["learn.success.change"] == pytest.approx(f["learn.success.last"] - f["learn.success.first"])
    assert f["learn.success.first.ci95_lo"] < f["learn.success.first"] < f["learn.success.first.ci95_hi"]
    assert f["learn.heldout.sft.T@3"] == 0.3 and f["learn.heldout.rl.T@3"] == 0.5
    assert f["learn.heldout.rl.T@3.ci95_lo"] == 0.4
    assert f["learn.curve"][0] == [1, 1.0, 0.25] and len(f["learn.curve"]) == 6


def test_bench_learn_is_a_bench_target(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "learn", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--json" in out and "--quick" in out and "--set" in out and "--compare" in out


def test_recipes_name_whole_configs_and_the_users_sets_still_win():
    from retrojax import config as config_lib
    from retrojax.bench.learn import RECIPES, recipe_sets

    pool = config_lib.load("configs/demo.yaml", recipe_sets("pool"))
    assert pool.learn.train_tasks == 4 and pool.learn.updates == 30 and pool.eval.num_tasks == 32
    transfer = config_lib.load("configs/demo.yaml", recipe_sets("transfer"))
    assert transfer.learn.train_tasks is None and transfer.sft.demo_tasks == 256
    assert transfer.env.push_notes and transfer.eval.num_tasks == 128 and transfer.eval.seeds == 2
    assert transfer.learn.updates == 60
    mine = config_lib.load("configs/demo.yaml", [*recipe_sets("transfer"), "learn.updates=7"])
    assert mine.learn.updates == 7
    with pytest.raises(ValueError, match="unknown recipe 'nope'; known: pool, transfer"):
        recipe_sets("nope")
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "learn", "--recipe", "transfer"]).recipe == "transfer"
    assert parser.parse_args(["bench", "learn"]).recipe == "pool"
    for name in RECIPES:  # the CLI offers every recipe the bench knows
        assert parser.parse_args(["bench", "learn", "--recipe", name]).recipe == name
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "learn", "--recipe", "nope"])
    assert e.value.code == 2


def test_mixed_groups_are_reported_for_the_first_and_last_windows():
    curve = [{"update": i + 1, "success": 0.5, "trials": 32, "wall_s": 60.0 * (i + 1),
              "diag/mixed_groups": m, "diag/solved_groups": (1 - m) / 2, "diag/failed_groups": (1 - m) / 2}
             for i, m in enumerate([0.25, 0.5, 0.5, 0.75])]
    results = {"SFT": {"T@3": {"success": 0.3, "ci95": [0.2, 0.4]}},
               "RL": {"T@3": {"success": 0.5, "ci95": [0.4, 0.6]}}}
    f = figures_from_summary({"curve": curve, "results": results}, wall_s=1.0)
    assert f["learn.mixed_groups.first"] == pytest.approx(0.375)
    assert f["learn.mixed_groups.last"] == pytest.approx(0.625)
    assert f["learn.solved_groups.first"] == f["learn.failed_groups.first"] == pytest.approx(0.3125)
    assert f["learn.solved_groups.last"] == pytest.approx(0.1875)


def test_compare_pairs_trials_by_level_and_seed():
    from retrojax.bench.learn_compare import compare_figures

    start = {("T@3", t, 0): t < 4 for t in range(16)}  # 4 of 16 solved
    better = {("T@3", t, 0): t < 12 for t in range(16)}  # the same 4 and 8 more
    same = dict(start)
    f = compare_figures({"sft": start, "retrail": better, "grpo": same})
    assert f["compare.sft.T@3"] == 0.25 and f["compare.retrail.T@3"] == 0.75
    assert f["compare.retrail_minus_sft.T@3"] == pytest.approx(0.5)
    assert f["compare.retrail_minus_sft.T@3.ci95_lo"] > 0.0
    assert f["compare.grpo_minus_sft.T@3"] == 0.0
    assert "compare.sft_more.T@3" not in f and "compare.retrail_minus_sft_more.T@3" not in f


def test_expert_first_move_agreement_is_reported_per_window_and_held_out():
    curve = [{"update": i + 1, "success": 0.5, "trials": 32, "wall_s": 60.0 * (i + 1),
              "rollout/expert_first_move": a} for i, a in enumerate([0.25, 0.5, 0.75, 1.0])]
    results = {"SFT": {"T@3": {"success": 0.3, "ci95": [0.2, 0.4]}},
               "RL": {"T@3": {"success": 0.5, "ci95": [0.4, 0.6]}}}
    f = figures_from_summary({"curve": curve, "results": results,
                              "heldout_expert_first_move": {"SFT": 0.3, "RL": 0.4}}, wall_s=1.0)
    assert f["learn.expert_first_move.first"] == pytest.approx(0.375)
    assert f["learn.expert_first_move.last"] == pytest.approx(0.875)
    assert f["learn.heldout.sft.expert_first_move"] == 0.3 and f["learn.heldout.rl.expert_first_move"] == 0.4
    old = figures_from_summary({"curve": curve[:2], "results": results}, wall_s=1.0)  # an older summary
    assert "learn.heldout.sft.expert_first_move" not in old


def test_greedy_held_out_figures_are_reported_when_the_run_has_them():
    curve = [{"update": i + 1, "success": 0.5, "trials": 32, "wall_s": 60.0 * (i + 1)} for i in range(4)]
    results = {"SFT": {"T@3": {"success": 0.3, "ci95": [0.2, 0.4]}},
               "RL": {"T@3": {"success": 0.5, "ci95": [0.4, 0.6]}}}
    greedy = {"SFT": {"T@3": {"success": 0.45, "ci95": [0.3, 0.6]}},
              "RL": {"T@3": {"success": 0.46, "ci95": [0.3, 0.6]}}}
    f = figures_from_summary({"curve": curve, "results": results, "results_greedy": greedy}, wall_s=1.0)
    assert f["learn.heldout.sft.greedy.T@3"] == 0.45 and f["learn.heldout.rl.greedy.T@3"] == 0.46
    assert f["learn.heldout.rl.T@3"] == 0.5  # the sampled figures stay what they were
    for summary in ({"curve": curve, "results": results}, {"curve": curve, "results": results,
                                                           "results_greedy": {}}):
        assert not any("greedy" in k for k in figures_from_summary(summary, wall_s=1.0))


def test_windows_cover_one_pass_over_a_larger_pool():
    from retrojax.learn.curves import pool_window

    assert pool_window(4, 4) == 2 and pool_window(None, 4) == 2 and pool_window(16, 4) == 4
    assert pool_window(10, 4) == 3 and pool_window(16, 0) == 2
    # 16 levels, 4 per update: updates 1-4 and 5-8 are passes over the same levels
    curve = [{"update": i + 1, "success": s, "trials": 32, "wall_s": 60.0 * (i + 1)}
             for i, s in enumerate([0.0, 0.25, 0.5, 0.25, 0.5, 0.75, 1.0, 0.75])]
    results = {"SFT": {"T@3": {"success": 0.3, "ci95": [0.2, 0.4]}},
               "RL": {"T@3": {"success": 0.5, "ci95": [0.4, 0.6]}}}
    f = figures_from_summary({"curve": curve, "results": results, "train_tasks": 16, "tasks_per_update": 4},
                             wall_s=1.0)
    assert f["learn.window_updates"] == 4
    assert f["learn.success.first"] == pytest.approx(0.25) and f["learn.success.last"] == pytest.approx(0.75)
    older = figures_from_summary({"curve": curve, "results": results, "train_tasks": 16}, wall_s=1.0)
    assert older["learn.window_updates"] == 2 and older["learn.success.first"] == pytest.approx(0.125)


def test_the_warm_starts_steps_and_stop_checks_are_reported():
    curve = [{"update": i + 1, "success": 0.5, "trials": 32, "wall_s": 60.0 * (i + 1)} for i in range(4)]
    results = {k: {"T@3": {"success": 0.1, "ci95": [0.0, 0.3]}} for k in ("SFT", "RL")}
    sft = {"steps": 240, "pool_checks": [[220, 0.25, 0.75], [240, 0.4375, 1.0]]}
    f = figures_from_summary({"curve": curve, "results": results, "sft": sft}, wall_s=1.0)
    assert f["learn.sft.steps"] == 240 and f["learn.sft.pool_checks"][-1] == [240, 0.4375, 1.0]
    f = figures_from_summary({"curve": curve, "results": results, "sft": {"steps": 225, "pool_checks": []}},
                             wall_s=1.0)
    assert f["learn.sft.steps"] == 225 and "learn.sft.pool_checks" not in f  # a fixed step count


def test_the_replay_of_the_first_window_is_paired_and_reported():
    from retrojax.learn.curves import replay_change, replay_note

    before = [True] * 4 + [False] * 12  # the first window: 4 of 16 solved in training
    after = [True] * 4 + [True] * 8 + [False] * 4  # the same 4 and 8 more on the same specs
    r = replay_change(before, after)
    assert r["first"] == 0.25 and r["replay"] == 0.75 and r["trials"] == 16
    assert r["change"] == pytest.approx(0.5) and 0.0 < r["change_ci95"][0] < 0.5 < r["change_ci95"][1]
    assert r["replay_ci95"][0] < 0.75 < r["replay_ci95"][1]
    assert "excludes 0" in replay_note(r) and "+50.0 points" in replay_note(r)
    flat = replay_change(before, list(reversed(before)))  # as many solved, other trials: no change
    assert flat["change"] == 0.0 and "holds 0" in replay_note(flat)
    assert replay_change([], []) is None and replay_note(None) is None
    with pytest.raises(ValueError, match="paired"):
        replay_change(before, after[:-1])

    curve = [{"update": i + 1, "success": 0.5, "trials": 8, "wall_s": 1.0 * (i + 1)} for i in range(4)]
    results = {"SFT": {"T@3": {"success": 0.3, "ci95": [0.2, 0.4]}},
               "RL": {"T@3": {"success": 0.5, "ci95": [0.4, 0.6]}}}
    f = figures_from_summary({"curve": curve, "results": results, "replay_first_window": r}, wall_s=1.0)
    assert f["learn.success.replay"] == 0.75 and f["learn.success.replay_change"] == pytest.approx(0.5)
    assert f["learn.success.replay_change.ci95_lo"] == r["change_ci95"][0]
    assert f["learn.success.replay.ci95_hi"] == r["replay_ci95"][1]
    without = figures_from_summary({"curve": curve, "results": results}, wall_s=1.0)
    assert "learn.success.replay" not in without


def test_the_held_out_difference_is_paired_by_level_and_seed():
    curve = [{"update": i + 1, "success": 0.5, "trials": 8, "wall_s": 1.0 * (i + 1)} for i in range(4)]
    results = {"SFT": {"T@3": {"success": 0.25, "ci95": [0.1, 0.5]}},
               "RL": {"T@3": {"success": 0.5, "ci95": [0.3, 0.7]}}}
    sft = [["T@3", t, s, t < 2] for t in range(4) for s in range(2)]  # levels 0-1 solved
    rl = [["T@3", t, s, t < 4 and not (t == 3 and s == 1)] for t in range(4) for s in range(2)]
    rl.append(["P@1", 0, 0, True])  # another protocol: not in the T@3 difference
    f = figures_from_summary({"curve": curve, "results": results,
                              "heldout_trials": {"SFT": sft, "RL": rl}}, wall_s=1.0)
    assert f["learn.heldout.rl_minus_sft.T@3"] == pytest.approx(3 / 8)  # 3 more of 8 pairs, none lost
    assert f["learn.heldout.rl_minus_sft.T@3.ci95_lo"] < 3 / 8 < f["learn.heldout.rl_minus_sft.T@3.ci95_hi"]
