"""ScienceWorld for real (Java) through the replay bridge: fast path, rewinds, kills, shutdown."""

from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest

from envs.textworlds import TextWorldBridge
from envs.textworlds.canonical import listing_canonical
from envs.textworlds.scienceworld import UNKNOWN_ACTION, parse_task, split_tasks

pytestmark = pytest.mark.textworlds

TASK = "find-living-thing:3"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture(scope="module")
def local_world(tmp_path_factory):
    """An in-process engine (its PyPI wrapper object is ``._env``) shared by the in-process checks."""
    from envs.textworlds.scienceworld import ScienceWorld

    w = ScienceWorld(cache_dir=str(tmp_path_factory.mktemp("sw-local")))
    yield w
    w.close()


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("sw-cache"))
    br = TextWorldBridge("scienceworld", num_workers=2, timeout_s=120.0, world_kwargs={"cache_dir": cache})
    yield br
    br.close()


def play_gold(br: TextWorldBridge, trial: int, max_steps: int = 40) -> list[str]:
    seen = []
    for _ in range(max_steps):
        if br.record(trial).current.done:
            break
        (ex,) = br.expert([trial])
        assert ex.ok and ex.value is not None, (ex.error, br.path(trial))
        (out,) = br.step([trial], [ex.value])
        assert out.ok and out.obs.valid, out.error
        seen.append(out.obs.text)
    return seen


def test_task_names_are_checked():
    assert parse_task("boil:3") == ("boil", 3)
    for bad in ("boil", "boil:x", ":3", ""):
        with pytest.raises(ValueError, match="task-name:variation"):
            parse_task(bad)


def test_gold_path_solves_and_fast_path_matches_the_wrapper(bridge, local_world):
    (o,) = bridge.reset([TASK])
    assert o.ok and o.obs.score == 0.0 and not o.obs.done and "is called the" in o.obs.text
    (g,) = bridge.goal([o.trial])
    assert "living thing" in g.value
    seen = play_gold(bridge, o.trial)
    rec = bridge.record(o.trial)
    assert rec.current.won and rec.current.score == 100.0 and rec.current.progress == 1.0
    scores = [c.score for c in rec.checkpoints]
    assert scores == sorted(scores) and 0 < len(seen) <= 10
    # the PyPI wrapper's slow env.step sees the same observations and scores along the same path
    env = local_world._env
    name, var = parse_task(TASK)
    env.load(name, var, "")
    first, _ = env.reset()
    assert first == rec.checkpoints[0].text
    for action, cp in zip(rec.actions, rec.checkpoints[1:], strict=True):
        text, _, done, info = env.step(action)
        assert (text, float(info["score"])) == (cp.text, cp.score)
    assert done
    bridge.release([o.trial])


def test_rewind_replay_invalid_and_divergence(bridge):
    outs = bridge.reset([TASK, TASK])
    a, b = (o.trial for o in outs)
    first = play_gold(bridge, a)
    path, cps = bridge.path(a), list(bridge.record(a).checkpoints)
    (rw,) = bridge.rewind([a], [1])
    assert rw.ok and rw.k == 1 and rw.obs == cps[1] and not rw.obs.done
    assert bridge.record(a).replayed_actions >= 1
    (inv,) = bridge.step([a], ["fly to the moon"])
    assert inv.ok and not inv.obs.valid and inv.obs.text == UNKNOWN_ACTION and inv.k == 1
    (adm,) = bridge.admissible([a])
    assert "look around" in adm.value["templates"] and "agent" in adm.value["objects"]
    again = [bridge.step([a], [x])[0].obs.text for x in path[1:]]
    assert again == first[1:] and bridge.record(a).current.won
    (end,) = bridge.rewind([a], [len(path)])  # a real reset + replay of the whole path
    assert end.ok and end.obs == cps[-1] and bridge.record(a).replayed_actions >= 1 + len(path)
    assert bridge.rewind([a], [len(path) + 1])[0].error.startswith("rewind target")
    # forced divergence: the record at C_2 no longer matches what the engine shows there
    play_gold(bridge, b, max_steps=3)
    rec = bridge.record(b)
    rec.checkpoints[2] = dataclasses.replace(rec.checkpoints[2], text="a different world")
    (bad,) = bridge.rewind([b], [2])
    assert not bad.ok and "diverged" in bad.error and rec.error_kind == "divergence"
    bridge.release([a, b])


def test_killed_worker_and_its_jvm_are_replaced_and_the_trial_finishes_identically(bridge):
    (ref,) = bridge.reset([TASK])
    ref_obs = play_gold(bridge, ref.trial)
    (o,) = bridge.reset([TASK])
    t = o.trial
    obs = play_gold(bridge, t, max_steps=2)
    w = bridge.record(t).worker
    old = bridge.pool._workers[w]
    bridge.pool.kill_worker(w)
    obs += play_gold(bridge, t)
    assert obs == ref_obs and bridge.record(t).current.won and bridge.record(t).restarts == 1
    assert not any(alive(p) for p in [old.pid, *old.child_pids])
    bridge.release([ref.trial, t])


def test_split_uses_scienceworlds_variations_and_caches_them(tmp_path, local_world):
    test = split_tasks(["find-living-thing"], "test", cache_dir=str(tmp_path), world=local_world)
    train = split_tasks(["find-living-thing"], "train", cache_dir=str(tmp_path))  # from the cache
    assert test and train and not set(test) & set(train)
    assert (tmp_path / "retrojax" / "scienceworld_variations.json").exists()
    with pytest.raises(ValueError, match="unknown ScienceWorld task"):
        split_tasks(["juggling"], "test", cache_dir=str(tmp_path))


def test_close_leaves_no_stray_processes():
    br = TextWorldBridge("scienceworld", num_workers=2, timeout_s=60.0)
    pids = br.pool.pids()
    assert len(pids) == 4 and all(alive(p) for p in pids)  # two workers, two JVMs
    br.close()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
    with pytest.raises(Exception, match="closed"):
        br.reset([TASK])
    assert os.getpid() not in pids



ART_STUDIO = "find-living-thing:225"  # starts in the art studio: three wood cups, listed in a per-reset order
PICK = ["pick up wood cup", "0", "inventory", "look around"]


def test_reordered_listings_and_numbered_picks_restore_exactly(bridge):
    """Measured: each reset lists the art studio's three wood cups in a new order, and '0' after 'pick up
    wood cup' takes whichever cup comes first. Restores compare listings as multisets and the world's
    state key, and retry a pick that took another cup — so the restored world holds the same cup."""
    (o,) = bridge.reset([ART_STUDIO])
    t = o.trial
    for action in PICK:
        (out,) = bridge.step([t], [action])
        assert out.ok and out.obs.valid, out.error
    cps = list(bridge.record(t).checkpoints)
    held = cps[3].text
    paint = re.search(r"wood cup \(containing (\w+) paint\)", held).group(1)
    for _ in range(4):
        (rw,) = bridge.rewind([t], [4])  # reset + replay of the pick, the inventory and the look
        assert rw.ok and rw.obs == cps[4], rw.error
        (inv,) = bridge.step([t], ["inventory"])  # the engine itself: the very cup that was picked
        assert inv.ok and listing_canonical(inv.obs.text) == listing_canonical(held), (inv.obs.text, held)
    (b,) = bridge.reset([ART_STUDIO])
    for _ in range(4):
        (back,) = bridge.rewind([b.trial], [0])
        assert back.ok and back.obs == b.obs, back.error
    # a recorded inventory with another cup in it is a true divergence: a clear error, never a wrong state
    other = next(p for p in ("red", "blue", "yellow") if p != paint)
    rec = bridge.record(t)
    rec.checkpoints[3] = dataclasses.replace(cps[3], text=held.replace(f"{paint} paint", f"{other} paint"))
    (bad,) = bridge.rewind([t], [3])
    assert not bad.ok and "diverged" in bad.error and f"{other} paint" in bad.error and "replays" in bad.error
    assert rec.error_kind == "divergence"
    bridge.release([t, b.trial])
