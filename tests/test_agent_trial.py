"""Algorithm 1 on a tiny host world: restore semantics, memory placement, budgets, protocols, fallbacks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.agent import parse
from retrojax.agent.chat import ByteChatTokenizer
from retrojax.agent.env_api import Action, StepInfo, TrialEnv, text_key
from retrojax.agent.prompts import get_prompts
from retrojax.agent.trial import (
    EXECUTE,
    REFLECT_CHOOSE,
    REFLECT_KNOWN,
    Generation,
    Limits,
    Trial,
    TrialSpec,
    parse_protocol,
)

TOK = ByteChatTokenizer()


class CorridorEnv(TrialEnv):
    """A 1-D corridor: ``right`` +1, ``left`` −1, ``up``/``down`` stay; below 0 is a pit (failure).

    Sokoban's move syntax and prompt family are reused so the real parser and templates run. The goal is
    at ``4 + task % 3``; progress is the position; V = end − anchor position.
    """

    name = "corridor"
    prompt_key = "sokoban"

    def __init__(self, tasks: int = 6):
        self.n = tasks
        self.paths: dict[int, list[int]] = {}
        self.goal: dict[int, int] = {}

    @property
    def num_tasks(self) -> int:
        return self.n

    def open(self, num_slots: int, capacity: int) -> None:
        self.capacity = capacity
        self.paths = {s: [0] for s in range(num_slots)}

    def close(self) -> None:
        self.paths = {}

    def _info(self, slot: int, reward: float = 0.0, moves: int = 0) -> StepInfo:
        p = self.paths[slot][-1]
        return StepInfo(reward=reward, solved=p >= self.goal[slot], failed=p < 0, progress=float(p),
                        state_key=text_key(f"pos{p}"), message=f"now at {p}", moves=moves)

    def reset(self, slots: Sequence[int], tasks: Sequence[int]) -> list[StepInfo]:
        for s, t in zip(slots, tasks, strict=True):
            self.paths[s] = [0]
            self.goal[s] = 4 + t % 3
        return [self._info(s) for s in slots]

    def step(self, slots: Sequence[int], actions: Sequence[Action]) -> list[StepInfo]:
        out = []
        for s, a in zip(slots, actions, strict=True):
            assert a.is_move
            p, reward = self.paths[s][-1], 0.0
            for code in a.code:
                if p < 0 or p >= self.goal[s]:
                    break
                d = {2: -1, 3: 1}.get(code, 0)
                p += d
                reward += d + (10.0 if p >= self.goal[s] else 0.0)
            assert len(self.paths[s]) < self.capacity
            self.paths[s].append(p)
            out.append(self._info(s, reward, len(a.code)))
        return out

    def rewind(self, slots: Sequence[int], targets: Sequence[int]) -> None:
        for s, j in zip(slots, targets, strict=True):
            assert 0 <= j < len(self.paths[s])
            del self.paths[s][j + 1 :]

    def observations(self, slots: Sequence[int]) -> list[str]:
        return [f"position {self.paths[s][-1]} of {self.goal[s]}" for s in slots]

    def parse_action(self, text: str) -> Action:
        return parse.parse_sokoban(text)

    def branch_value(self, progress, solved, failed) -> float:
        return float(progress[-1]) - float(progress[0])

    def expert_actions(self, slots):
        return ["right" for _ in slots]

    def random_actions(self, slots, rng, avoid=()):
        out = []
        for i, _ in enumerate(slots):
            options = [m for m in ("left", "right", "up") if m not in (avoid[i] if i < len(avoid) else ())]
            out.append(options[int(rng.integers(len(options)))])
        return out

    def prompt_fields(self, task: int) -> dict:
        return {"height": 1, "width": 4 + task % 3 + 1, "boxes": 1}


def make_trial(protocol: str = "T@3", tokens: bool = True, **limits) -> tuple[Trial, CorridorEnv]:
    env = CorridorEnv()
    lim = Limits(**limits)
    env.open(1, lim.path_capacity())
    spec = TrialSpec(trial=0, task=2, seed=0, replicate=0, protocol=protocol)  # goal at 6
    trial = Trial(spec, 0, env, lim, get_prompts("sokoban", "full") if tokens else None,
                  TOK if tokens else None)
    trial.start(env.reset([0], [2])[0], env.observations([0])[0])
    return trial, env


def act(trial: Trial, env: CorridorEnv, text: str, finish: str = "stop"):
    """One call: request, reply, and the world operation it asks for. Returns the request."""
    req = trial.request()
    op = trial.on_output(Generation(text, finish_reason=finish))
    if op is not None and op.kind == "step":
        trial.on_step(env.step([0], [op.action])[0], env.observations([0])[0])
    elif op is not None:
        env.rewind([0], [op.target])
        trial.on_rewound()
    return req


def move(reason: str, action: str = "right") -> str:
    return f"{reason}\n<action>{action}</action>"


def decoded(trial: Trial) -> str:
    return TOK.decode(trial.transcript.ids())


def test_restore_semantics_memory_placement_and_replacement():
    t, env = make_trial("T@3")
    for tag in ("step-A", "step-B", "step-C"):
        act(t, env, move(tag))
    assert t.k == 3 and t.path[-1].score == 3 and t.branch_used == 3
    mark1 = t.path[1].mark
    prefix1 = t.transcript.ids()[:mark1].copy()
    key_at_1 = t.path[1].state_key

    act(t, env, move("go back", "rewind to C_1"))
    assert t.phase == REFLECT_KNOWN and t.calls_used == 4
    req = act(t, env, "<remark>m1: stepping right twice was pointless</remark>")
    # the reflection is its own conversation c_ref: the branch history is in it, the execution chat is not
    assert req.view.kind == REFLECT_KNOWN and "step-C" not in TOK.decode(req.prompt_ids)
    assert req.messages == ({"role": "user", "content": req.prompt_text},)
    assert np.array_equal(req.prompt_ids, TOK.encode_turn("user", req.prompt_text) + TOK.generation_prompt())
    assert "C_2 → C_3: right" in req.prompt_text and "position 1 of 6" in req.prompt_text
    # world, conversation, budget and score are back at C_1; calls are not refunded
    assert t.k == 1 and env.paths[0] == [0, 1] and t.branch_used == 1 and t.path[-1].score == 1
    assert t.calls_used == 5 and t.record.rewinds_model == 1 and t.record.macro_attempts == 1
    ids = t.transcript.ids()
    assert np.array_equal(ids[:mark1], prefix1)
    text = TOK.decode(ids[mark1:])
    assert text.count("m1: stepping right") == 1 and "step-B" not in text and "step-C" not in text
    assert "kept at checkpoint C_1" in text
    rec = t.recoveries[0]
    assert (rec.trigger, rec.from_checkpoint, rec.target, rec.reflection_call) == ("model", 3, 1, 4)
    assert rec.abandoned_calls == [1, 2, 3] and rec.v_abandoned == 2.0 and rec.resumed_segment == 1
    assert t.segments[0].end_reason == "rewind" and t.segments[0].score == 3.0

    req = act(t, env, move("step-D"))  # decision at C_1 again: same state and retained path, new memory
    first_at_1 = t.calls[1]
    assert req.view.state_key == key_at_1 == first_at_1.state_key
    assert t.calls[5].history_key == first_at_1.history_key  # D.5.1: memory is not part of the group key
    assert req.view.remarks == ((1, "m1: stepping right twice was pointless"),)

    act(t, env, move("again", "rewind to C_1"))
    req = act(t, env, "<remark>m2</remark>")
    assert "m1: stepping right" in req.prompt_text  # earlier reflections are shown to the next one
    assert rec.v_resumed == 1.0  # σ_1 went C_1 → C_2
    assert [r.status for r in t.remarks] == ["superseded", "in context"]
    text = decoded(t)
    assert "m2" in text and "m1: stepping right" not in text  # replaced, not stacked

    act(t, env, move("step-E"))
    act(t, env, move("to start", "rewind to C_0"))
    req = act(t, env, "<remark>m3</remark>")
    assert "(superseded): m1" in req.prompt_text and "(in context): m2" in req.prompt_text
    assert [r.status for r in t.remarks] == ["superseded", "left with its branch", "in context"]
    assert t.k == 0 and t.branch_used == 0 and "m2" not in decoded(t) and "m3" in decoded(t)

    act(t, env, move("step-F"))
    act(t, env, move("once more", "rewind to C_0"))  # a 4th model rewind is refused
    assert t.phase == EXECUTE and t.calls[-1].invalid_reason == "you already used all 3 rewinds"
    assert t.record.rewinds_model == 3 and t.k == 1
    req = t.request()
    assert "already used all 3 rewinds" in req.prompt_text and req.view.targets == ()


def test_invalid_turns_consume_calls_and_leave_the_world():
    t, env = make_trial("T@3")
    act(t, env, "I think... no tag")
    assert t.k == 0 and t.calls_used == 1 and t.branch_used == 1 and t.record.invalid_turns == 1
    req = t.request()
    assert parse.NO_TAG in req.prompt_text and req.view.last_invalid == parse.NO_TAG
    t.on_output(Generation(move("x", "rewind to C_0")))  # no earlier checkpoint at k = 0
    assert t.calls[-1].invalid_reason == "there is no earlier checkpoint to rewind to yet"
    act(t, env, move("ok"))
    act(t, env, move("bad", "rewind to C_4"))
    assert "not a valid target" in t.calls[-1].invalid_reason and t.k == 1
    assert [c.reward for c in t.calls] == [0.0, 0.0, 1.0, 0.0]


def test_forced_recovery_fallback_and_macro_attempts():
    t, env = make_trial("T@3")
    act(t, env, move("oops", "left"))  # into the pit at C_1
    assert t.phase == REFLECT_CHOOSE and t.segments[0].end_reason == "failure"
    req = act(t, env, "<remark>the pit is left</remark>\n<action>rewind to C_7</action>")
    assert req.view.targets == (0,) and req.view.trigger == "failure"
    rec = t.recoveries[-1]
    assert rec.target == 0 and rec.target_from_fallback and rec.trigger == "failure"
    assert rec.v_abandoned == -1.0 and t.record.macro_attempts == 2 and t.record.rewinds_forced == 1
    act(t, env, move("a"))
    act(t, env, move("oops", "left, left"))
    req = act(t, env, "<remark>again</remark><action>rewind to C_1</action>")
    assert not t.recoveries[-1].target_from_fallback and t.k == 1 and t.record.macro_attempts == 3
    assert t.recoveries[0].v_resumed == -1.0  # σ_1: C_0 → C_1 (pos 1) → C_2 (pos −1)
    act(t, env, move("oops", "left, left"))  # third failure: T@3 allows no 4th macro-attempt
    assert t.done and t.record.end_reason == "failure" and not t.record.success
    assert t.record.calls_reflection == 2 and t.record.rewinds_forced == 2


def test_fallback_end_and_truncation():
    t, env = make_trial("T@3", fallback="end")
    act(t, env, move("a"))
    act(t, env, move("oops", "left, left"))
    act(t, env, "<remark>no target named</remark>")
    assert t.done and t.record.end_reason == "no_recovery" and t.calls[-1].valid is False
    for protocol in ("P@1", "T@3"):  # a cut-off reply is an invalid turn, even at k = 0: never a failure
        t, env = make_trial(protocol)
        act(t, env, "<action>ri", finish="length")
        assert t.phase == EXECUTE and not t.done and t.k == 0 and t.calls_used == 1
        assert t.record.invalid_turns == 1 and t.record.macro_attempts == 1 and not t.recoveries
        req = t.request()
        assert "cut off" in req.prompt_text and "cut off" in req.view.last_invalid
        act(t, env, move("a"))
        act(t, env, move("b", "right, rig"), finish="length")
        assert t.phase == EXECUTE and t.k == 1 and env.paths[0] == [0, 1] and t.record.macro_attempts == 1
    t, env = make_trial("T@3")  # a context that no longer fits ends the trial with its own reason
    act(t, env, move("a"))
    act(t, env, "", finish="context")
    assert t.done and t.record.end_reason == "context" and t.calls_used == 1 and len(t.calls) == 1
    assert t.segments[-1].end_reason == "context"


def test_protocols():
    assert parse_protocol("t@3").name == "T@3" and parse_protocol("T@k").max_macro is None
    assert not parse_protocol("T@1").forced_recovery and not parse_protocol("P@1").model_rewinds
    for bad in ("P@2", "T@0", "X@1", "T@", ""):
        with pytest.raises(ValueError):
            parse_protocol(bad)
    t, env = make_trial("P@1")
    act(t, env, move("a"))
    assert t.request().view.targets == ()
    act(t, env, move("b", "rewind to C_0"))
    assert t.calls[-1].invalid_reason == "rewinds are not allowed in this game"
    act(t, env, move("oops", "left, left"))
    assert t.done and t.record.end_reason == "failure" and t.record.calls_reflection == 0
    t, env = make_trial("T@1")
    act(t, env, move("a"))
    act(t, env, move("b", "rewind to C_0"))
    assert t.phase == REFLECT_KNOWN
    act(t, env, "<remark>r</remark>")
    act(t, env, move("oops", "left"))
    assert t.done and t.record.end_reason == "failure" and t.record.rewinds_model == 1


def test_branch_budget_call_ceiling_and_success():
    t, env = make_trial("P@1", branch_budget=3)  # P@1 has no recovery, so no branch budget (C.4)
    for _ in range(5):
        act(t, env, move("wait", "up"))
    assert not t.done and t.k == 5 and t.request().view.branch_left == 60 - 5
    t, env = make_trial("P@1", branch_budget=3, p1_max_turns=4)  # the optional P@1 turn cap
    for _ in range(4):
        act(t, env, move("wait", "up"))
    assert t.done and t.record.end_reason == "branch_budget"
    t, env = make_trial("T@3", branch_budget=3)
    for _ in range(3):
        act(t, env, move("wait", "up"))
    assert t.phase == REFLECT_CHOOSE and t.recovery["trigger"] == "branch_budget"
    act(t, env, "<remark>waiting wastes turns</remark><action>rewind to C_1</action>")
    assert t.branch_used == 1 and t.record.macro_attempts == 2
    t, env = make_trial("T@3", max_calls=4)
    act(t, env, move("a"))
    act(t, env, move("a"))
    act(t, env, move("b", "rewind to C_0"))  # 1 call would be left: not enough for a recovery
    assert t.calls[-1].invalid_reason == "too few replies are left for a rewind"
    act(t, env, move("a"))
    assert t.done and t.record.end_reason == "calls" and t.calls_used == 4
    t, env = make_trial("T@3")
    act(t, env, move("go", "right, right, right"))
    act(t, env, move("go", "right, right, right"))
    assert t.done and t.record.success and t.record.actions_to_success == 6
    assert t.record.distinct_states == 3 and t.record.final_score == 16.0


def test_without_tokens_prompts_are_skipped():
    t, env = make_trial("T@3", tokens=False)
    req = t.request()
    assert req.prompt_ids.size == 0 and req.prompt_text == ""
    t.on_output(Generation(move("a")))
    assert t.calls[0].output_ids.size == 0


_OUTPUTS = st.sampled_from([
    move("r"), move("l", "left"), move("w", "up"), move("rr", "right, right"), "garbage",
    move("b", "rewind to C_0"), move("b", "rewind to C_1"), move("b", "rewind to C_2"),
    move("b", "rewind to C_9"),
    "<remark>note</remark>", "<remark>x</remark><action>rewind to C_0</action>",
    "<remark>y</remark><action>rewind to C_1</action>",
])


@settings(max_examples=120, deadline=None)
@given(outputs=st.lists(_OUTPUTS, min_size=1, max_size=80),
       protocol=st.sampled_from(["P@1", "T@1", "T@3", "T@k"]), max_calls=st.integers(3, 30),
       budget=st.integers(1, 8))
def test_budget_invariants_on_random_scripts(outputs, protocol, max_calls, budget):
    t, env = make_trial(protocol, tokens=False, max_calls=max_calls, branch_budget=budget)
    branch_at: dict[int, int] = {0: 0}
    for text in outputs:
        if t.done:
            break
        before = t.calls_used
        req = t.request()
        if req.view.kind != EXECUTE:
            assert req.view.calls_left >= 2  # room for the reflection and one continuation
        op = t.on_output(Generation(text))
        assert t.calls_used == before + 1 <= max_calls  # never refunded, never past the ceiling
        if op is not None and op.kind == "step":
            t.on_step(env.step([0], [op.action])[0])
            if not t.done or t.path[-1].solved or t.path[-1].failed:
                branch_at[t.k] = t.path[-1].branch_used
        elif op is not None:
            env.rewind([0], [op.target])
            t.on_rewound()
            assert t.branch_used == branch_at[op.target] == t.path[op.target].branch_used
            assert t.path[-1].score == float(env.paths[0][-1]) and len(env.paths[0]) == t.k + 1
        limit = max_calls if protocol == "P@1" else budget  # P@1: the branch budget does not apply
        assert t.k <= limit and t.branch_used <= limit and t.branch_limit == limit
        assert t.record.rewinds_model <= 3
        assert [c.call_index for c in t.calls] == list(range(t.calls_used))
    r = t.record
    assert r.calls_execution + r.calls_reflection == t.calls_used
    assert r.rewinds_model + r.rewinds_forced == len(t.recoveries) == r.calls_reflection
    if protocol == "P@1":
        assert r.calls_reflection == 0
    if protocol in ("P@1", "T@1"):
        assert r.rewinds_forced == 0 and r.macro_attempts == 1
    if protocol == "T@3":
        assert r.macro_attempts <= 3


def test_oracle_names_and_avoids_its_mistakes():
    from retrojax import config
    from retrojax.agent.policies import OraclePolicy
    from retrojax.agent.runner import run_trials

    cfg = config.load(None, ["trial.max_calls=40", "trial.branch_budget=12"])
    archive, metrics = run_trials(cfg, OraclePolicy(1.0), task_ids=range(6), seeds=[0, 1], trials_per_task=3,
                                  protocols=["T@3", "T@1"], env=CorridorEnv(), record_tokens=False)
    calls = {(c.trial, c.call_index): c for c in archive.calls}
    segments = {(s.trial, s.index): s for s in archive.segments}
    checked = 0
    for r in archive.recoveries:
        assert "avoid '" in r.remark
        resumed = segments.get((r.trial, r.resumed_segment))
        if resumed is None or not resumed.calls:
            continue
        first = calls[(r.trial, resumed.calls[0])]
        avoided = {a for a, key in OraclePolicy.remembered_pairs(r.remark) if key == first.state_key}
        assert first.action not in avoided  # the remembered mistake is not repeated from the same state
        checked += 1
    assert checked >= 5
    assert {"failure", "model"} <= {r.trigger for r in archive.recoveries}
    assert metrics["results"]["T@3"]["success"] >= metrics["results"]["T@1"]["success"]


def transcript_turns(ids: np.ndarray) -> list[dict[str, str]]:
    """The chat turns of a byte-level transcript: ``<start>role\\ncontent<end>\\n`` each."""
    turns, i, ids = [], 0, list(ids)
    while i < len(ids):
        assert ids[i] == TOK.IM_START
        end = ids.index(TOK.IM_END, i)
        role, _, content = TOK.decode(ids[i + 1 : end]).partition("\n")
        turns.append({"role": role, "content": content})
        i = end + 1 + len(TOK.encode("\n"))
    return turns


def test_request_messages_mirror_the_transcript_and_the_rewound_prefix():
    t, env = make_trial("T@3")
    seen = []
    for text in (move("s1"), move("s2"), move("s3"), move("back", "rewind to C_1"), "<remark>mem</remark>",
                 move("s4"), "no tag at all"):
        req = t.request()
        if req.role == "execution":
            # the context ends with the new user turn; its tokens are exactly the transcript's turns
            assert req.messages[-1] == {"role": "user", "content": req.prompt_text}
            ctx = req.prompt_ids[: len(req.prompt_ids) - len(TOK.generation_prompt())]
            assert transcript_turns(ctx) == list(req.messages)
            assert req.messages[0]["role"] == "system"
            seen.append(req.messages)
        else:
            assert req.messages == ({"role": "user", "content": req.prompt_text},)
        act(t, env, text)
    # after rewind to C_1: the C_1 prefix (system, user, assistant s1) + the memory turn + the new user turn
    after = seen[4]
    assert after[:3] == seen[1][:3] and after[2]["content"] == move("s1")
    assert after[3]["role"] == "user" and "mem" in after[3]["content"] and "C_1" in after[3]["content"]
    assert after[4]["role"] == "user" and len(after) == 5
    assert transcript_turns(t.transcript.ids()) == t.messages
