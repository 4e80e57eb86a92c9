"""ALFWorld through the replay bridge, on games generated from the wheel's PDDL domain and grammar."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from envs.textworlds import TextWorldBridge, WorkerPool
from envs.textworlds.alfworld import GoalProgress, data_tasks
from envs.textworlds.alfworld_gen import TASK_TYPES, generate_game, generated_tasks
from envs.textworlds.pool import Call

pytestmark = pytest.mark.textworlds


@pytest.fixture(scope="module")
def bridge():
    br = TextWorldBridge("alfworld", num_workers=2, timeout_s=60.0)
    yield br
    br.close()


def play_expert(br: TextWorldBridge, trial: int, max_steps: int = 30) -> list[str]:
    """Follow the planner until the episode ends; returns the observations seen."""
    seen = []
    for _ in range(max_steps):
        if br.record(trial).current.done:
            break
        (ex,) = br.expert([trial])
        assert ex.ok, ex.error
        assert ex.value is not None, "the planner found no plan"
        (out,) = br.step([trial], [ex.value])
        assert out.ok and out.obs.valid, (ex.value, out.error)
        seen.append(out.obs.text)
    return seen


def test_generation_is_deterministic_and_covers_six_task_types():
    games = [generate_game(t, 7) for t in TASK_TYPES]
    assert {g["task_type"] for g in games} == set(TASK_TYPES)
    assert generate_game("heat", 7)["pddl_problem"] == games[3]["pddl_problem"]
    assert generate_game("heat", 8)["pddl_problem"] != games[3]["pddl_problem"]
    for g in games:
        assert "UNKNOWN GOAL" not in g["grammar"] and g["task_desc"] in g["grammar"]
        assert "(:goal" in g["pddl_problem"]
    with pytest.raises(ValueError, match="unknown ALFWorld task type"):
        generate_game("juggle", 0)
    train, test = generated_tasks("train", 12), generated_tasks("test", 12)
    assert not set(train) & set(test) and len({t.split(":")[1] for t in train}) == 6


def test_goal_progress_counts_state_conditions_over_bindings():
    goal = generate_game("heat", 3)
    prog = GoalProgress(goal["pddl_problem"])
    obj, recep = goal["params"]["obj"], goal["params"]["recep"]
    base = [("objecttype", ("o1", f"{obj}type")), ("heatable", ("o1",)),
            ("receptacletype", ("r1", f"{recep}type")),
            ("objecttype", ("o2", f"{obj}type")), ("heatable", ("o2",))]
    assert prog(base) == 0.0
    assert prog(base + [("ishot", ("o1",))]) == 0.5
    assert prog(base + [("ishot", ("o1",)), ("inreceptacle", ("o2", "r1"))]) == 0.5  # different objects
    assert prog(base + [("ishot", ("o2",)), ("inreceptacle", ("o2", "r1"))]) == 1.0
    two = GoalProgress(generate_game("two", 3)["pddl_problem"])
    p = generate_game("two", 3)["params"]
    facts = [("objecttype", ("a", f"{p['obj']}type")), ("objecttype", ("b", f"{p['obj']}type")),
             ("receptacletype", ("r", f"{p['recep']}type")), ("inreceptacle", ("a", "r"))]
    assert two(facts) == 0.5  # the same object cannot count twice
    assert two(facts + [("inreceptacle", ("b", "r"))]) == 1.0
    look = generate_game("look", 3)
    lp, o = GoalProgress(look["pddl_problem"]), look["params"]["obj"].lower()
    room = [("objecttype", ("lamp", "desklamptype")), ("toggleable", ("lamp",)),
            ("inreceptacle", ("lamp", "desk")),
            ("receptacleatlocation", ("desk", "l1")), ("receptacleatlocation", ("bed", "l2")),
            ("objecttype", ("thing", f"{o}type")), ("atlocation", ("agent1", "l0"))]
    assert lp(room) == 0.25  # only "the lamp stands in a receptacle" holds
    walked = [f for f in room if f[0] != "atlocation"] + [("atlocation", ("agent1", "l1"))]
    assert lp(walked) == 0.5
    assert lp(walked + [("istoggled", ("lamp",)), ("holds", ("agent1", "thing"))]) == 1.0


def test_expert_solves_one_game_of_each_type(bridge):
    tasks = [f"gen:{t}:11" for t in TASK_TYPES]
    outs = bridge.reset(tasks)
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert all(0.0 <= o.obs.progress < 1.0 and not o.obs.done for o in outs)
    for o in outs:
        play_expert(bridge, o.trial)
        rec = bridge.record(o.trial)
        assert rec.current.won and rec.current.progress == 1.0 and rec.current.score == 100.0
        assert rec.k <= 12
    bridge.release([o.trial for o in outs])


def test_rewind_replays_exactly_and_invalid_actions_are_the_engines_message(bridge):
    (o,) = bridge.reset(["gen:pick_clean_then_place_in_recep:5"])
    t = o.trial
    (adm,) = bridge.admissible([t])
    assert "look" in adm.value["actions"] and any(a.startswith("go to ") for a in adm.value["actions"])
    first = play_expert(bridge, t)
    path, cps = bridge.path(t), list(bridge.record(t).checkpoints)
    (bad,) = bridge.step([t], ["juggle the fridge"])
    assert bad.error == "step after the episode ended"
    # a fresh trial of the same task: the invalid action comes back with the engine's own message
    (o2,) = bridge.reset(["gen:pick_clean_then_place_in_recep:5"])
    (inv,) = bridge.step([o2.trial], ["juggle the fridge"])
    assert inv.ok and not inv.obs.valid and inv.obs.text == "Nothing happens." and inv.k == 0
    (rw,) = bridge.rewind([t], [2])
    assert rw.ok and rw.k == 2 and rw.obs == cps[2] and bridge.path(t) == path[:2]
    again = [bridge.step([t], [a])[0].obs.text for a in path[2:]]
    assert again == first[2:]
    assert bridge.record(t).current.won
    (end,) = bridge.rewind([t], [len(path)])  # a real reset + replay of the whole path
    assert end.ok and end.obs == cps[-1] and bridge.record(t).replayed_actions >= 2 + len(path)
    bridge.release([t, o2.trial])


def test_forced_divergence_is_a_clear_error_for_that_trial_only(bridge):
    outs = bridge.reset(["gen:look_at_obj_in_light:2", "gen:look_at_obj_in_light:2"])
    a, b = (o.trial for o in outs)
    for t in (a, b):
        play_expert(bridge, t, max_steps=2)
    rec = bridge.record(a)
    rec.checkpoints[1] = dataclasses.replace(rec.checkpoints[1], text="a room that never was")
    ra, rb = bridge.rewind([a, b], [1, 1])
    assert not ra.ok and "diverged" in ra.error and "C_1" in ra.error
    assert rb.ok and rb.k == 1
    (later,) = bridge.step([a], ["look"])
    assert later.error == ra.error  # the trial stays failed
    bridge.release([a, b])


def test_killed_worker_is_restarted_and_the_trial_finishes_identically(bridge):
    task = "gen:pick_two_obj_and_place:4"
    (ref,) = bridge.reset([task])
    ref_obs = play_expert(bridge, ref.trial)
    (o,) = bridge.reset([task])
    t = o.trial
    obs = play_expert(bridge, t, max_steps=3)
    before = bridge.pool.restarts
    bridge.pool.kill_worker(bridge.record(t).worker)
    obs += play_expert(bridge, t)
    assert bridge.pool.restarts == before + 1 and bridge.record(t).restarts == 1
    assert obs == ref_obs and bridge.record(t).current.won
    assert bridge.path(t) == bridge.path(ref.trial)
    bridge.release([ref.trial, t])


def test_a_stalled_worker_times_out_and_the_call_is_retried():
    with WorkerPool("alfworld", num_workers=1, timeout_s=20.0) as pool:
        (r,) = pool.run([(0, Call(op="reset", task="gen:pick_and_place_simple:1"))])
        assert r.ok
        pool.timeout_s = 1.5
        pool.stall_worker(0, 30.0)
        (r2,) = pool.run([(0, Call(op="restore", task="gen:pick_and_place_simple:1", expected=r.value.text))])
        pool.timeout_s = 20.0
        assert r2.restarts == 1 and pool.restarts == 1
        assert r2.ok and r2.value.text == r.value.text and r2.replayed == 0


def test_speedups_do_not_change_what_the_engine_says():
    task = "gen:pick_and_place_simple:2"
    runs = []
    for speed in (True, False):
        with TextWorldBridge("alfworld", num_workers=1, world_kwargs={"speedups": speed}) as br:
            (o,) = br.reset([task])
            runs.append([o.obs.text, *play_expert(br, o.trial)])
    assert runs[0] == runs[1]


def test_real_data_layout_is_found_and_played(tmp_path, bridge):
    game = generate_game("pick", 21)
    trial_dir = tmp_path / "valid_unseen" / "pick_and_place_simple-Mug-None-Desk-1" / "trial_T0"
    trial_dir.mkdir(parents=True)
    keys = ("pddl_domain", "grammar", "pddl_problem", "solvable")
    (trial_dir / "game.tw-pddl").write_text(json.dumps({k: game[k] for k in keys}))
    (trial_dir / "traj_data.json").write_text(json.dumps({"task_type": game["task_type"]}))
    unsolvable = tmp_path / "valid_unseen" / "x" / "trial_T1"
    unsolvable.mkdir(parents=True)
    (unsolvable / "game.tw-pddl").write_text(json.dumps({"solvable": False}))
    assert data_tasks(tmp_path, "test") == [str(trial_dir / "game.tw-pddl")]
    assert data_tasks(tmp_path, "train") == [str(trial_dir / "game.tw-pddl")]  # no train folder: all games
    with pytest.raises(FileNotFoundError):
        data_tasks(tmp_path / "missing")
    (o,) = bridge.reset([os.fspath(trial_dir)])
    assert o.ok and game["task_desc"] in o.obs.text
    play_expert(bridge, o.trial)
    assert bridge.record(o.trial).current.won
    (bad,) = bridge.reset([os.fspath(tmp_path / "nowhere")])
    assert not bad.ok and "no ALFWorld game file" in bad.error
