"""The RIR controller through the real loop: run invariants over random runs, restore targets, variants,
memory replacement and the agent's context after rollbacks."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rir_line_world import LineWorld

from retrojax import config
from retrojax.agent.rir import replies
from retrojax.agent.rir.controller import EXECUTE, REVIEW, RIRView
from retrojax.agent.rir.memory import BLOCK_START, REVERIFY
from retrojax.agent.rir.policies import RIROraclePolicy, RIRRandomPolicy
from retrojax.agent.rir.runner import RIRRunner, make_specs, run_rir
from retrojax.agent.rir.schedule import Schedule
from retrojax.agent.rir.settings import Settings
from retrojax.agent.rir.variants import ALL_VARIANTS, parse_variant
from retrojax.agent.trial import Generation

CFG = config.Config()
SCHEDULED = {
    "RIR",
    "RIR/scheduled-only",
    "RIR/hybrid-fixed",
    "RIR/no-rollback",
    "RIR/restart",
    "RIR/direct",
    "RIR/rollback-only",
}


def check_invariants(batch, s: Settings) -> None:
    for rec, trial in zip(batch.records, batch.trials, strict=True):
        v = parse_variant(rec.protocol)
        sched = s.for_variant(v).schedule
        assert all(sched.l_min <= h <= sched.l_max for h in rec.horizons), rec.horizons
        if v.scheduled_trigger:
            assert rec.max_unreviewed <= math.ceil(sched.l_max), (rec.protocol, rec.max_unreviewed)
        assert rec.rollbacks <= rec.recoveries <= s.rollback_budget
        assert rec.agent_calls <= s.agent_budget
        assert rec.aux_calls == sum(rec.aux_by_role.values())
        assert rec.verdict_fallbacks <= rec.parse_problems_by_role["review"] <= rec.aux_by_role["review"]
        assert all(rec.parse_problems_by_role[k] <= rec.aux_by_role[k] for k in rec.aux_by_role)
        assert len([c for c in trial.calls if c.role == "execution"]) == rec.agent_calls
        assert len([c for c in trial.calls if c.role != "execution"]) == rec.aux_calls
        for x in rec.restores:
            assert 0 <= x["lo"] <= x["r"] <= x["hi"] <= x["t"], x
            if v.restore == "restart":
                assert x["r"] == 0
        assert all(rec.restore_ok) and len(rec.restore_ok) == rec.rollbacks
        if not v.reviews:
            assert rec.reviews == rec.aux_calls == 0
        if v.restore == "none":
            assert rec.rollbacks == rec.rewind_calls == 0
        assert rec.end_reason in ("success", "failure", "budget")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lo=st.integers(1, 6),
    width=st.integers(0, 6),
    b_rb=st.integers(0, 4),
    b_agent=st.integers(1, 30),
    seed=st.integers(0, 10**6),
    malformed=st.floats(0.0, 1.0),
)
def test_run_invariants_over_random_runs(lo, width, b_rb, b_agent, seed, malformed):
    s = Settings(schedule=Schedule(lo, lo + width, lo), rollback_budget=b_rb, agent_budget=b_agent)
    env = LineWorld(length=5, tasks=2)
    runner = RIRRunner(CFG, env, RIRRandomPolicy(rollback_prob=0.2, malformed=malformed), settings=s)
    protocols = list(ALL_VARIANTS) + ["RIR/range-1-3", "RIR/range-2-8"]  # 11 variants x 2 tasks = 22 runs
    batch = runner.run(make_specs(range(2), [seed], 1, protocols))
    assert len(batch.records) == 22
    check_invariants(batch, s)


def test_invariants_on_sokoban_random_runs():
    """200 random runs on the real Sokoban world (vmapped steps and rewinds), every variant."""
    cfg = config.load("configs/sokoban_tiny.yaml")
    s = Settings(rollback_budget=3, agent_budget=24)
    batch = run_rir(
        cfg,
        RIRRandomPolicy(rollback_prob=0.2, malformed=0.3),
        task_ids=range(10),
        seeds=[0, 1],
        trials_per_task=1,
        protocols=[*ALL_VARIANTS, "RIR/range-2-6"],
        settings=s,
        split="sokoban-6x6-2:test",
    )
    assert len(batch.records) == 200
    check_invariants(batch, s)
    assert sum(r.rollbacks for r in batch.records) > 20  # the restores were exercised
    assert sum(r.parse_problems for r in batch.records) > 20  # and so were the fallbacks
    assert sum(r.verdict_fallbacks for r in batch.records) > 0  # counted apart: reviews with no verdict


def test_restore_target_is_the_localized_state_and_restart_goes_to_c0():
    env = LineWorld(length=6, tasks=3)
    s = Settings(rollback_budget=4, agent_budget=30)
    runner = RIRRunner(CFG, env, RIRRandomPolicy(rollback_prob=0.3, malformed=0.0), settings=s)
    batch = runner.run(make_specs(range(3), [0, 1, 2], 2, ["RIR", "RIR/restart", "RIR/direct"]))
    restores = [(r.protocol, x) for r in batch.records for x in r.restores]
    assert sum(r.rollbacks for r in batch.records) >= 10
    assert all(all(r.restore_ok) and len(r.restore_ok) == r.rollbacks for r in batch.records)
    assert all(x["r"] == 0 for p, x in restores if p == "RIR/restart")
    assert any(x["r"] > 0 for p, x in restores if p == "RIR")


def test_no_rollback_never_rewinds_while_memory_changes():
    env = LineWorld(length=6, tasks=3)
    runner = RIRRunner(
        CFG,
        env,
        RIRRandomPolicy(rollback_prob=0.3, malformed=0.0),
        settings=Settings(rollback_budget=4, agent_budget=30),
    )
    batch = runner.run(make_specs(range(3), [0, 1, 2], 2, ["RIR/no-rollback"]))
    assert env.rewinds == 0
    assert sum(r.recoveries for r in batch.records) > 0 and sum(r.memory_changes for r in batch.records) > 0
    assert all(r.rollbacks == 0 for r in batch.records)


class MarkerPolicy:
    """Agent: right/left/wait, sometimes 'rollback'. Reviewer: copies the current observation's marker into
    E.obs and says rollback half the time. Patcher: a numbered failure analysis (no markers)."""

    tokenizer = None
    needs_text = False

    def __init__(self, env: LineWorld):
        self.env = env
        self.rng = np.random.default_rng(0)
        self.analyses = 0
        self.last_analysis: dict[int, str] = {}

    def begin(self, specs, slots, env):
        pass

    def end(self):
        pass

    def generate(self, requests):
        out = []
        for req in requests:
            v: RIRView = req.view
            if v.kind == EXECUTE:
                word = str(self.rng.choice(["right", "right", "left", "wait", "rollback"]))
                out.append(Generation(f"<action>{word}</action>"))
            elif v.kind == REVIEW:
                marker = re.search(r"MK\d+Z", self.env.paths[v.slot][-1][2]).group(0)
                verdict = "rollback" if self.rng.random() < 0.5 else "continue"
                out.append(Generation(replies.write_review(verdict, 0.5, "stuck", obs=[f"saw {marker}"])))
            elif v.kind == "coarse":
                out.append(Generation(replies.write_range(0, v.checkpoint)))
            elif v.kind == "fine":
                out.append(Generation(replies.write_restore(min(v.candidates), 0.5, "first")))
            else:
                self.analyses += 1
                text = f"analysis number {self.analyses}"
                self.last_analysis[req.trial] = text
                out.append(Generation(replies.write_patch([f"milestone {self.analyses}"], text)))
        return out


def test_memory_is_replaced_not_appended_and_abandoned_markers_stay_out():
    env = LineWorld(length=30, tasks=2)
    policy = MarkerPolicy(env)
    s = Settings(rollback_budget=6, agent_budget=40, schedule=Schedule(2, 3, 2))
    runner = RIRRunner(CFG, env, policy, settings=s)  # byte tokenizer: prompts are rendered and tokenized
    specs = make_specs(range(2), [0, 1, 2], 1, ["RIR"])
    # run by hand to look at every agent context after each restore
    trials_seen = {}
    original = runner._tick

    def tick(live):
        for t in live:
            trials_seen[t.spec.trial] = t
        original(live)
        for t in live:
            if t.phase == EXECUTE and t.pending is None:
                check_context(t)

    abandoned: dict[int, set[str]] = {}

    def check_context(t):
        ctx = t.agent_context_text()
        assert ctx.count(BLOCK_START) == 1
        assert t.memory.render() in ctx
        assert t.memory.goal == t.goal
        gone = abandoned.get(t.spec.trial, set())
        for line in ctx.splitlines():
            for m in re.findall(r"MK\d+Z", line):
                if m in gone:
                    assert REVERIFY in line, line

    runner._tick = tick
    from retrojax.agent.rir import controller as ctl

    original_rewound = ctl.RIRTrial.on_rewound

    def on_rewound(self, state_key=None, observation=None):
        r = self.rec["r"]
        for node in self.path[r + 1 :]:
            abandoned.setdefault(self.spec.trial, set()).update(re.findall(r"MK\d+Z", node.observation))
        original_rewound(self, state_key, observation)
        check_context(self)

    ctl.RIRTrial.on_rewound = on_rewound
    try:
        batch = runner.run(specs)
    finally:
        ctl.RIRTrial.on_rewound = original_rewound
    assert sum(r.rollbacks for r in batch.records) >= 6
    assert any(len(r.restores) >= 2 for r in batch.records)
    for t in batch.trials:
        if t.record.recoveries:
            assert t.memory.failure == policy.last_analysis[t.spec.trial]  # F = the last analysis only
            block = t.memory.render()
            assert block.count(f"failed: {t.memory.failure}\n") == 1  # one F line: the last analysis
            if t.record.recoveries >= 2:  # "analysis number N" recurs (numbers aside): promoted into E once
                assert sum("recurring failure" in e for e in t.memory.texts("elim")) == 1
    assert any(REVERIFY in t.memory.render() for t in batch.trials)


def test_agent_request_with_continue_changes_nothing_but_costs_calls():
    env = LineWorld(length=6, tasks=1)

    class Asker:
        tokenizer, needs_text = None, False
        asked = False

        def begin(self, *a):
            pass

        def end(self):
            pass

        def generate(self, requests):
            out = []
            for r in requests:
                if r.view.kind == EXECUTE:
                    ask = r.view.checkpoint == 2 and not self.asked
                    self.asked = self.asked or ask
                    word = "rollback" if ask else "right"
                    out.append(Generation(f"<action>{word}</action>"))
                else:
                    out.append(Generation(replies.write_review("continue", 0.0)))
            return out

    s = Settings(schedule=Schedule(4, 8, 8), rollback_budget=3, agent_budget=20)
    batch = RIRRunner(CFG, env, Asker(), settings=s).run(make_specs([0], [0], 1, ["RIR/agent-only"]))
    rec = batch.records[0]
    assert rec.success and rec.reviews == 1 and rec.reviews_by_trigger["agent"] == 1
    assert rec.actions == 6 and rec.agent_calls == 7 and rec.aux_calls == 1 and rec.rollbacks == 0


def test_oracle_recovers_where_react_cannot_on_line_world():
    env = LineWorld(length=8, tasks=4)
    batch = RIRRunner(CFG, env, RIROraclePolicy(0.4), settings=Settings(agent_budget=30)).run(
        make_specs(range(4), [0, 1, 2, 3], 2, ["RIR", "RIR/react", "RIR/no-rollback"])
    )
    rate = {
        p: np.mean([r.success for r in batch.records if r.protocol == p])
        for p in ("RIR", "RIR/react", "RIR/no-rollback")
    }
    assert rate["RIR"] > rate["RIR/react"] and rate["RIR"] > rate["RIR/no-rollback"]
    # a failure review eliminates the move taken at the restore point (E.elim), and the oracle agent reads
    # it back from M: it never takes that move from that state again
    checked = 0
    for t in batch.trials:
        if t.record.protocol != "RIR":
            continue
        for x in t.record.restores:
            entries = [e for e in t.memory.texts("elim") if e.startswith("avoid '")]
            later = [c for c in t.calls[x["after_call"] :] if c.role == "execution"]
            for e in entries:
                action, key = re.match(r"avoid '([^']*)' at state (\w+)", e).groups()
                assert not any(
                    c.action == action and c.state_key == key
                    for c in later
                    if c.call_index > x["after_call"] and _named_before(t, e, c.call_index)
                )
                checked += 1
    assert checked > 0


def _named_before(trial, entry: str, call_index: int) -> bool:
    """The elimination ``entry`` was in M when call ``call_index`` was made (reviews add it)."""
    for c in trial.calls[:call_index]:
        if c.role == "review" and entry in c.output_text:
            return True
    return False


def test_a_memory_change_leaves_the_context_prefix_before_the_memory_block():
    """The memory block closes the system prompt, so consecutive agent contexts share every token before it
    (a model row re-encodes only from the first differing token, inside or after the block)."""
    env = LineWorld(length=30, tasks=2)
    s = Settings(rollback_budget=4, agent_budget=25, schedule=Schedule(2, 3, 2))
    batch = RIRRunner(CFG, env, MarkerPolicy(env), settings=s).run(make_specs(range(2), [0], 1, ["RIR"]))
    changed = 0
    for t in batch.trials:
        system, _ = t._system_ids()
        head = len(("system\n" + system[: system.index(BLOCK_START)]).encode()) + 1
        calls = [c for c in t.calls if c.role == "execution"]
        for a, b in zip(calls, calls[1:], strict=False):
            n = min(a.prompt_ids.size, b.prompt_ids.size)
            diff = np.nonzero(a.prompt_ids[:n] != b.prompt_ids[:n])[0]
            if diff.size:
                changed += 1
                assert diff[0] >= head
    assert changed > 0


def test_rollback_verdict_with_the_budget_spent_acts_as_continue():
    env = LineWorld(length=5, tasks=1)

    class AlwaysRollback:
        tokenizer, needs_text = None, False

        def begin(self, *a):
            pass

        def end(self):
            pass

        def generate(self, requests):
            return [Generation("<action>right</action>" if r.view.kind == EXECUTE
                               else replies.write_review("rollback", 1.0, "always")) for r in requests]

    s = Settings(schedule=Schedule(1, 2, 1), rollback_budget=0, agent_budget=10)
    rec = RIRRunner(CFG, env, AlwaysRollback(), settings=s).run(make_specs([0], [0], 1, ["RIR"])).records[0]
    assert rec.success and rec.actions == 5 and rec.reviews == 5 and rec.recoveries == rec.rollbacks == 0
    assert rec.aux_calls == 5 and rec.horizons == [1.0]  # ρ = 1: L = L_min, unchanged


def test_grouped_runs_match_one_batch_and_time_each_group():
    """sampler.max_inflight bounds the trials run together; scripted draws are per (seed, task, replicate,
    role), so groups give the records of one batch, and each group's protocols and wall time are kept."""
    s = Settings(schedule=Schedule(2, 4, 2), rollback_budget=2, agent_budget=12)
    kw = dict(task_ids=range(3), seeds=[0], trials_per_task=1, protocols=["RIR", "RIR/react"], settings=s)
    one = run_rir(CFG, RIRRandomPolicy(rollback_prob=0.3), env=LineWorld(length=5, tasks=3), **kw)
    grouped = run_rir(
        CFG, RIRRandomPolicy(rollback_prob=0.3), env=LineWorld(length=5, tasks=3), batch_size=3, **kw
    )
    assert [g["protocols"] for g in grouped.groups] == [["RIR"], ["RIR/react"]]
    assert [g["trials"] for g in grouped.groups] == [3, 3] and all(g["seconds"] > 0 for g in grouped.groups)
    assert len(one.groups) == 1 and one.groups[0]["trials"] == 6
    assert [dataclasses.asdict(r) for r in grouped.records] == [dataclasses.asdict(r) for r in one.records]
