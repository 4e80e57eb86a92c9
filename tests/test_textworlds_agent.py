"""Text worlds in the trial loop: the adapter, prompts, scripted oracle, forced recovery."""

from __future__ import annotations

import numpy as np
import pytest

from retrojax import config
from retrojax.agent.env_api import make_env
from retrojax.agent.prompts import (
    MEMORY_FIELDS,
    REFLECT_CHOOSE_FIELDS,
    REFLECT_FIELDS,
    SYSTEM_FIELDS,
    TRIGGERS,
    USER_FIELDS,
    get_prompts,
)
from retrojax.agent.runner import run_trials
from retrojax.agent.textworld_env import TextOraclePolicy, TextWorldEnv, format_action, make_alfworld
from retrojax.agent.trial import EXECUTE, REFLECT_CHOOSE, Generation

pytestmark = pytest.mark.textworlds


def cfg_for(name: str, tmp_path, *extra: str):
    return config.load(None, [f"env.name={name}", f"env.cache_dir={tmp_path}", "env.text_workers=2",
                              "env.step_timeout_s=120", *extra])


@pytest.mark.parametrize("world", ["scienceworld", "alfworld"])
@pytest.mark.parametrize("style", ["full", "compact"])
def test_prompt_templates_have_the_required_fields(world, style):
    p = get_prompts(world, style)
    assert p.fields("system") == {*SYSTEM_FIELDS, "goal"}
    assert p.fields("user") == set(USER_FIELDS)
    assert p.fields("memory") == set(MEMORY_FIELDS)
    assert p.fields("reflect_known") == set(REFLECT_FIELDS)
    assert p.fields("reflect_choose") == set(REFLECT_CHOOSE_FIELDS)
    assert p.fields("reflect_confirm") == set(REFLECT_CHOOSE_FIELDS)  # D.2: a model rewind names a checkpoint
    assert set(p.triggers) == set(TRIGGERS)
    assert all("<remark>" in t for t in (p.reflect_known, p.reflect_choose, p.reflect_confirm))
    marker = "```action" if world == "alfworld" else "<action>"
    assert marker in p.system and marker in p.reflect_choose and marker in p.reflect_confirm


def test_splits_and_action_parsing(tmp_path):
    cfg = cfg_for("alfworld", tmp_path, "env.split=alfworld-gen-heat,cool", "env.num_tasks=5")
    env = make_env(cfg, "alfworld-gen-heat,cool:test")
    assert env.num_tasks == 5 and env.action_style == "fence"
    assert {t.split(":")[1] for t in env.tasks} == {"pick_heat_then_place_in_recep",
                                                     "pick_cool_then_place_in_recep"}
    for bad in ("alfworld-gen:exam", "sokoban-6x6-2:test", "alfworld-genx:test"):
        with pytest.raises(ValueError):
            make_alfworld(cfg, bad)
    with pytest.raises(ValueError, match="data_dir"):
        make_alfworld(cfg, "alfworld-data:test")
    a = env.parse_action("  go to   countertop 1 ")
    assert a.is_move and a.text == "go to countertop 1"
    assert env.parse_action("rewind to C_2").target == 2
    assert env.parse_action("rewind please").is_invalid
    assert env.parse_action("x" * 300).is_invalid and env.parse_action("   ").is_invalid
    assert env.parse_action("take apple\nput apple").is_invalid
    assert format_action("look", "fence") == "```action\nlook\n```"
    assert env.branch_value([0.0, 50.0, 25.0], False, False) == 50.0
    env.close()


def test_registered_configs_load():
    for name in ("scienceworld", "scienceworld_tiny", "alfworld", "alfworld_tiny", "alfworld_data"):
        cfg = config.load(f"configs/{name}.yaml")
        assert cfg.env.name in ("scienceworld", "alfworld") and cfg.trial.max_calls >= 1
    env = make_env(config.load("configs/alfworld_tiny.yaml"))
    assert env.num_tasks == 6 and env.split == "alfworld-gen:train"
    assert env.format_action("look").startswith("```action")
    with pytest.raises(ValueError, match="data_dir"):
        make_env(config.load("configs/alfworld_data.yaml"), "alfworld-data:test")


class NonsenseFirst(TextOraclePolicy):
    """Sends one command the engine does not know at C_0, then plays the oracle."""

    def generate(self, requests):
        out = super().generate(requests)
        for i, r in enumerate(requests):
            if r.view.kind == EXECUTE and r.view.checkpoint == 0 and not r.view.last_invalid:
                out[i] = Generation("Let me try.\n```action\njuggle the fridge\n```")
        return out


def test_alfworld_oracle_solves_with_fenced_actions_and_recovers(tmp_path):
    cfg = cfg_for("alfworld", tmp_path, "trial.max_calls=24", "trial.branch_budget=12")
    tight = cfg_for("alfworld", tmp_path, "trial.max_calls=24", "trial.branch_budget=5")
    env = TextWorldEnv("alfworld", ["gen:pick_and_place_simple:31", "gen:pick_clean_then_place_in_recep:31"],
                       num_workers=2, timeout_s=120.0)
    try:
        archive, _ = run_trials(cfg, NonsenseFirst(0.0), task_ids=[0, 1], trials_per_task=1,
                                protocols=["P@1"], env=env)
        assert [t.success for t in archive.trials] == [True, True]
        assert [t.invalid_turns for t in archive.trials] == [1, 1]
        bad = [c for c in archive.calls if not c.valid]
        assert len(bad) == 2 and all("Nothing happens." in c.invalid_reason for c in bad)
        execs = [c for c in archive.calls if c.role == "execution"]
        assert all(c.output_text.rstrip().endswith("```") and "```action\n" in c.output_text for c in execs)
        # a noisy oracle under T@3 with a short branch budget: recoveries replay through the bridge
        archive, _ = run_trials(tight, TextOraclePolicy(0.6), task_ids=[0, 1], seeds=[3], trials_per_task=1,
                                protocols=["T@3"], env=env)
        assert archive.recoveries, "expected at least one recovery"
        assert all(r.remark for r in archive.recoveries)
        assert env.errors() == {}
    finally:
        env.close()


class FocusOnAirFirst(TextOraclePolicy):
    """Fails ScienceWorld's task on purpose at C_0 until a remark says to avoid it."""

    def generate(self, requests):
        out = super().generate(requests)
        for i, r in enumerate(requests):
            if r.view.kind == EXECUTE and r.view.checkpoint == 0 and not r.view.remarks:
                out[i] = Generation("Let me focus on the air.\n<action>focus on air</action>")
                self.last_random[r.trial] = (0, r.view.state_key, "focus on air")
        return out


def test_scienceworld_failure_triggers_forced_recovery_then_the_oracle_solves(tmp_path):
    cfg = cfg_for("scienceworld", tmp_path, "trial.max_calls=20", "trial.branch_budget=10")
    env = TextWorldEnv("scienceworld", ["find-living-thing:3"], num_workers=2, timeout_s=120.0,
                       world_kwargs={"cache_dir": str(tmp_path)})
    try:
        archive, _ = run_trials(cfg, FocusOnAirFirst(0.0), task_ids=[0], trials_per_task=1,
                                protocols=["P@1", "T@3"], env=env)
        p1, t3 = [[t for t in archive.trials if t.protocol == p] for p in ("P@1", "T@3")]
        assert not any(t.success for t in p1) and all(t.end_reason == "failure" for t in p1)
        assert all(t.success and t.macro_attempts == 2 and t.rewinds_forced == 1 for t in t3)
        recs = [r for r in archive.recoveries if r.trigger == "failure"]
        assert len(recs) == 1 and all(r.target == 0 and "focus on air" in r.remark for r in recs)
        assert env.errors() == {}
        obs = env.observations([1])[0]  # slot 1 holds the T@3 trial
        assert "Score so far: 100 / 100." in obs and "Action templates" in obs
        (exp,) = env.expert_actions([1])
        assert exp is None  # the gold path is used up in a solved trial
        rnd = env.random_actions([0, 1], np.random.default_rng(0))
        assert all(isinstance(a, str) and a for a in rnd)
    finally:
        env.close()


class AskBackThenAnswer(TextOraclePolicy):
    """Oracle play that asks for ``rewind to C_2`` once at C_3; its reflection then names C_1 (replicate 0),
    an out-of-range C_7 (replicate 1) or no checkpoint at all (replicate 2). Keeps every request it saw."""

    def __init__(self):
        super().__init__(0.0)
        self.seen: list = []
        self.asked: set[int] = set()

    def generate(self, requests):
        self.seen += requests
        out = super().generate(requests)
        for i, r in enumerate(requests):
            v = r.view
            if v.kind == EXECUTE and v.checkpoint == 3 and r.trial not in self.asked:
                self.asked.add(r.trial)
                out[i] = Generation("This line looks wrong; going back.\n" + self.act("rewind to C_2"))
            elif v.kind != EXECUTE:
                remark = "<remark>Took the gold line to C_3; try again from an earlier point.</remark>\n"
                answers = {0: self.act("rewind to C_1"), 1: self.act("rewind to C_7")}
                answer = answers.get(v.spec.replicate, "")
                out[i] = Generation(remark + answer)
        return out


@pytest.mark.parametrize("world, task", [("scienceworld", "find-living-thing:3"),
                                         ("alfworld", "gen:pick_and_place_simple:31")])
def test_text_world_reflection_on_a_model_rewind_names_the_checkpoint_to_restore(world, task, tmp_path):
    """D.2: ScienceWorld and ALFWorld reflections always ask for a checkpoint. On the agent's own
    ``rewind to C_2`` the reflection may keep C_2 or name another target, and the world is restored there;
    a reply without a valid target restores the requested C_2 and is recorded as a fallback."""
    cfg = cfg_for(world, tmp_path, "trial.max_calls=40", "trial.branch_budget=30")
    kwargs = {"cache_dir": str(tmp_path)} if world == "scienceworld" else {}
    env = TextWorldEnv(world, [task], num_workers=2, timeout_s=120.0, world_kwargs=kwargs)
    policy = AskBackThenAnswer()
    try:
        archive, _ = run_trials(cfg, policy, task_ids=[0], trials_per_task=3, protocols=["T@1"], env=env)
        assert env.errors() == {}
    finally:
        env.close()
    block = "```action\nrewind to C_j\n```" if world == "alfworld" else "<action>rewind to C_j</action>"
    calls = {(c.trial, c.call_index): c for c in archive.calls}
    assert len(archive.trials) == 3
    for trial in archive.trials:
        (rec,) = [r for r in archive.recoveries if r.trial == trial.trial]
        (ask,) = [r for r in policy.seen if r.trial == trial.trial and r.view.kind != EXECUTE]
        rep = ask.view.spec.replicate
        at_c3 = [r for r in policy.seen if r.trial == trial.trial and r.view.kind == EXECUTE
                 and r.view.checkpoint == 3][0].view
        # the reflection is the choose-a-checkpoint kind, opened by the agent's request for C_2
        assert ask.view.kind == REFLECT_CHOOSE and ask.view.trigger == "model" and ask.view.target == 2
        assert ask.view.targets == (0, 1, 2)
        assert "You asked to go back to C_2" in ask.prompt_text and block in ask.prompt_text
        assert "C_0, C_1, C_2" in ask.prompt_text and len(ask.messages) == 1  # c_ref: one user turn
        want = 1 if rep == 0 else 2
        assert (rec.trigger, rec.target, rec.target_from_fallback) == ("model", want, rep != 0)
        reflection = calls[(trial.trial, rec.reflection_call)]
        assert reflection.rewind_target == want and reflection.valid == (rep == 0)
        if rep:
            assert "restoring the requested C_2" in reflection.invalid_reason
        # the world was restored at the named checkpoint: the next decision sees C_want's state
        resumed = sorted((c for c in archive.calls if c.trial == trial.trial and c.role == "execution"
                          and c.segment == rec.resumed_segment), key=lambda c: c.position)
        assert resumed[0].checkpoint == want and resumed[0].state_key == at_c3.keys[want]
        assert trial.rewinds_model == 1 and trial.success  # the oracle finishes from there
