"""The paper's §5.1 baselines as RIR variants, through the real runner on the line world: each loop makes
exactly the calls, rollbacks and resets its procedure implies (scripted players whose replies are fixed by
what the prompt or view shows), and each runs on real Sokoban with the oracle and with random replies."""

from __future__ import annotations

import io
import json
from collections import Counter

from rir_line_world import LineWorld

from retrojax import config
from retrojax.agent.policies import TranscriptPolicy
from retrojax.agent.rir.baselines import prompts as B
from retrojax.agent.rir.baselines.self_refine import ROUNDS
from retrojax.agent.rir.controller import EXECUTE
from retrojax.agent.rir.policies import RIROraclePolicy, RIRRandomPolicy
from retrojax.agent.rir.runner import RIRRunner, make_specs, run_rir
from retrojax.agent.rir.settings import Settings
from retrojax.agent.rir.variants import BASELINES, parse_variant
from retrojax.agent.trial import Generation

CFG = config.Config()


class Scripted:
    tokenizer, needs_text = None, False

    def begin(self, *a):
        pass

    def end(self):
        pass

    def generate(self, requests):
        return [Generation(self.reply(r)) for r in requests]


def _run(policy, protocol, *, length=5, settings=None, transcript=None):
    env = LineWorld(length=length, tasks=1)
    s = settings or Settings(agent_budget=30)
    runs = TranscriptPolicy(policy, transcript) if transcript is not None else policy
    batch = RIRRunner(CFG, env, runs, settings=s).run(make_specs([0], [0], 1, [protocol]))
    return batch.records[0], batch.trials[0], env


def test_baselines_are_variants_without_rir_review_or_tool():
    for name in BASELINES:
        v = parse_variant(name.upper())
        assert v.name == name and v.method == name.partition("/")[2]
        assert not (v.reviews or v.agent_trigger or v.scheduled_trigger or v.memory)


class Refiner(Scripted):
    """Drafts 'wait'; the critic asks to revise anything but 'right' (or everything); refines say 'right'."""

    def __init__(self, always_revise=False):
        self.always = always_revise

    def reply(self, r):
        v = r.view
        if v.kind == EXECUTE:
            return "<action>wait</action>"
        if v.kind == "refine":
            return "<action>right</action>"
        revise = self.always or v.proposal != "right"
        return B.write_critique(B.REVISE if revise else B.KEEP, "go right, the goal is to the right")


def test_self_refine_critiques_every_move_and_revises_before_it_runs():
    out = io.StringIO()
    rec, trial, env = _run(Refiner(), "RIR/self-refine", transcript=out)
    assert rec.success and rec.actions == 5 and rec.agent_calls == 5
    assert rec.aux_by_role["critique"] == 10 and rec.aux_by_role["refine"] == 5  # revise, then keep
    assert rec.rollbacks == rec.resets == env.rewinds == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    refine = next(x for x in rows if x["role"] == "refine")["messages"][-1]["content"]
    assert "a critic reviewed your proposed action 'wait'" in refine and "go right" in refine
    context = trial.agent_context_text()
    assert "<action>right</action>" in context and "<action>wait</action>" not in context  # drafts replaced
    capped, _, _ = _run(Refiner(always_revise=True), "RIR/self-refine")
    assert capped.success and capped.agent_calls == 5
    assert capped.aux_by_role["critique"] == capped.aux_by_role["refine"] == 5 * ROUNDS  # the round limit


class Faller(Scripted):
    """Falls at C_2 until a reflection is carried; the reflection says so."""

    def reply(self, r):
        v = r.view
        if v.kind == EXECUTE:
            fall = v.checkpoint == 2 and not v.notes
            return f"<action>{'fall' if fall else 'right'}</action>"
        if v.kind == "reflect":
            return B.write_reflection("falling at position 2 ended the trial; walk on")
        return B.write_value(1.0 if v.path and v.path[-1] == "right" else 0.0)


def test_reflexion_reflects_on_a_failed_trial_and_starts_over_with_it():
    out = io.StringIO()
    rec, trial, env = _run(Faller(), "RIR/reflexion", transcript=out)
    assert rec.success and rec.agent_calls == 3 + 5 and rec.aux_by_role["reflect"] == 1
    assert rec.resets == 1 and rec.rollbacks == 0 and env.rewinds == 1 and rec.restore_ok == [True]
    assert trial.t == 5 and rec.actions == 8  # the second trial's path only; all actions counted
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    after = [x for x in rows if x["role"] == "execution"][3]["messages"]
    assert "falling at position 2 ended the trial" in after[0]["content"] and len(after) == 2  # fresh context


def test_reflexion_trials_end_at_their_call_cap_and_share_the_budget():
    class Waiter(Scripted):
        def reply(self, r):
            return "<action>wait</action>" if r.view.kind == EXECUTE else B.write_reflection("stop waiting")

    rec, _, _ = _run(Waiter(), "RIR/reflexion", settings=Settings(agent_budget=12))
    assert rec.agent_calls == 12 and rec.end_reason == "budget"
    assert rec.resets == 2 and rec.aux_by_role["reflect"] == 2  # trials of 4 calls; none after the third


class Assisted(Scripted):
    """Steps left at C_3 until the assistant's feedback is carried; the assistant undoes any 'left'."""

    def reply(self, r):
        v = r.view
        if v.kind == EXECUTE:
            return f"<action>{'left' if v.checkpoint == 3 and not v.notes else 'right'}</action>"
        if v.path[-1] == "left":
            return B.write_assist("rollback", v.checkpoint - 1, "left undoes progress")
        return B.write_assist("continue")


def test_ga_rollback_checks_every_step_and_rolls_back_with_feedback():
    rec, trial, env = _run(Assisted(), "RIR/ga-rollback")
    assert rec.success and rec.actions == 6 and rec.agent_calls == 6
    assert rec.aux_by_role["assist"] == 5  # every executed step but the solving one
    assert rec.rollbacks == rec.recoveries == env.rewinds == 1 and rec.restore_ok == [True]
    assert rec.restores[0]["r"] == 3 and trial.carried == ["at C_3: left undoes progress"]
    none, _, _ = _run(Assisted(), "RIR/ga-rollback", settings=Settings(agent_budget=30, rollback_budget=0))
    assert none.aux_calls == 0 and none.rollbacks == 0 and none.actions == 7  # no check: the left step stays


class Searcher(Scripted):
    """At each node: first sample 'right', second 'fall'; values 1 for a step right; reflections fixed."""

    def __init__(self):
        self.samples = Counter()

    def reply(self, r):
        v = r.view
        if v.kind == EXECUTE:
            key = (r.trial, v.path)
            self.samples[key] += 1
            return f"<action>{'right' if self.samples[key] == 1 else 'fall'}</action>"
        if v.kind == "reflect":
            return B.write_reflection(f"falling after {len(v.path) - 1} steps ends the task")
        return B.write_value(1.0 if v.path[-1] == "right" else 0.0)


def test_lats_expands_evaluates_and_restores_the_world_through_the_trail():
    out = io.StringIO()
    rec, trial, env = _run(Searcher(), "RIR/lats", length=3, transcript=out)
    # root: right (A), back to the root, fall (failed: reflect); A: replay, right (AA), back to A, fall
    # (failed: reflect); AA: replay, right → solved
    assert rec.success and rec.agent_calls == 5
    assert rec.aux_by_role["value"] == 2 and rec.aux_by_role["reflect"] == 2
    assert rec.rollbacks == env.rewinds == 4 and rec.restore_ok == [True] * 4
    assert rec.actions == 7 and trial.t == 3  # two replayed steps; the final path is the solution
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    last = [x for x in rows if x["role"] == "execution"][-1]["messages"]
    assert "falling after 0 steps ends the task" in last[0]["content"]  # reflections carried
    assert [m["content"] for m in last if m["role"] == "assistant"] == ["<action>right</action>"] * 2


def test_every_baseline_runs_on_sokoban_with_the_oracle_and_with_random_replies():
    cfg = config.load("configs/sokoban_tiny.yaml")
    s = Settings(rollback_budget=3, agent_budget=24)
    for policy in (RIROraclePolicy(0.3), RIRRandomPolicy(rollback_prob=0.1, malformed=0.3)):
        batch = run_rir(
            cfg, policy, task_ids=range(6), seeds=[0], trials_per_task=1, protocols=[*BASELINES, "RIR/react"],
            settings=s, split="sokoban-6x6-2:test",
        )
        by = {p: [r for r in batch.records if r.protocol == p] for p in (*BASELINES, "RIR/react")}
        for p, recs in by.items():
            for r in recs:
                assert r.aux_calls == sum(r.aux_by_role.values()) and r.agent_calls <= s.agent_budget
                assert all(r.restore_ok) and len(r.restore_ok) == r.rollbacks + r.resets
                assert r.rollbacks == 0 or p in ("RIR/lats", "RIR/ga-rollback")
                assert r.recoveries <= s.rollback_budget
        if isinstance(policy, RIROraclePolicy):
            assert sum(r.rollbacks for r in by["RIR/lats"]) > 0
            assert sum(r.aux_by_role["critique"] for r in by["RIR/self-refine"]) > 0


def test_every_baseline_runs_with_the_flax_model_in_its_roles():
    """The oracle plays the agent (so moves run and every auxiliary role is asked); the tiny Flax model
    answers every auxiliary role on its own sampler rows, through the parsers and their fallbacks."""
    import dataclasses

    from retrojax.agent.policies import ModelPolicy
    from retrojax.agent.rir.policies import RIRModelPolicy
    from retrojax.model.qwen3 import PRESETS, Qwen3
    from retrojax.model.tokenizer import train_sentencepiece

    texts = [B.CRITIQUE_SYSTEM, B.REFLEXION_SYSTEM, B.VALUE_SYSTEM, B.ASSIST_SYSTEM, "<value>0.5</value>"] * 4
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tok = train_sentencepiece(texts, 1000, d)
    model = Qwen3(dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size, num_hidden_layers=1))
    inner = ModelPolicy(model, tok, max_len=1024, temperature=1.0, seed=1, chunk_buckets=(128, 512))
    aux, oracle = RIRModelPolicy(inner), RIROraclePolicy(0.5)

    class Mixed:
        tokenizer, needs_text = inner.tokenizer, True

        def begin(self, specs, slots, env):
            oracle.begin(specs, slots, env)
            aux.begin(specs, slots, env)

        def end(self):
            oracle.end()
            aux.end()

        def generate(self, requests):
            mine = [r.view.kind in (EXECUTE, "refine") for r in requests]
            a = iter(oracle.generate([r for r, m in zip(requests, mine, strict=True) if m]))
            b = iter(aux.generate([r for r, m in zip(requests, mine, strict=True) if not m]))
            return [next(a) if m else next(b) for m in mine]

    s = Settings(agent_budget=8, rollback_budget=2, max_new_tokens=8, max_review_tokens=12,
                 max_select_tokens=6, max_patch_tokens=12)
    batch = RIRRunner(CFG, LineWorld(length=8, tasks=2), Mixed(), settings=s).run(
        make_specs(range(2), [0], 1, list(BASELINES))
    )
    asked = Counter(c.role for c in batch.archive.calls if c.role != "execution")
    assert {"critique", "reflect", "value", "assist"} <= set(asked)
    for c in batch.archive.calls:
        if c.role != "execution":
            assert c.prompt_ids.size > 0 and c.output_ids.size == c.logprobs.size > 0
    assert all(r.agent_calls <= 8 for r in batch.records)
