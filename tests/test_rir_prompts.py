"""What reaches RIR's model-facing prompts, read back from the transcripts (``TranscriptPolicy``): no hidden
value (solver distance, ``branch_value``, goal-condition progress) in any prompt; the reviewer and the coarse
selector read the trajectory with its observations within the token budget; RIR/no-rollback's patcher has a
prompt of its own; restores are refused with too few calls left; abandoned facts are marked with the step
they were seen at, and a recurring failure pattern is promoted into E."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
from collections.abc import Sequence

import numpy as np
from rir_line_world import LineWorld

from retrojax import config
from retrojax.agent.chat import ByteChatTokenizer
from retrojax.agent.env_api import StepInfo, TrialEnv
from retrojax.agent.policies import TranscriptPolicy
from retrojax.agent.rir import replies
from retrojax.agent.rir.memory import REVERIFY
from retrojax.agent.rir.prompts import PATCH_SYSTEM, REFLECT_SYSTEM, REVIEW_SYSTEM
from retrojax.agent.rir.runner import RIRRunner, make_specs
from retrojax.agent.rir.schedule import Schedule
from retrojax.agent.rir.settings import Settings
from retrojax.agent.trial import Generation

CFG = config.Config()
ROLES = {"execution", "review", "coarse", "fine", "patch"}
SENTINEL_PROGRESS, SENTINEL_VALUE = 7_300_001.0, 9_100_003.0


class Scrambled(TrialEnv):
    """A world whose hidden figures are replaced: ``StepInfo.progress`` and ``branch_value`` carry sentinel
    numbers (everything the agent can observe is the wrapped world's)."""

    def __init__(self, inner: TrialEnv):
        self.inner = inner
        self.name, self.prompt_key = inner.name, inner.prompt_key
        self.action_style = getattr(inner, "action_style", "tag")

    def _hide(self, info: StepInfo) -> StepInfo:
        progress = SENTINEL_PROGRESS + (3.0 * info.progress if np.isfinite(info.progress) else 17.0)
        return dataclasses.replace(info, progress=progress)

    @property
    def num_tasks(self) -> int:
        return self.inner.num_tasks

    def open(self, num_slots: int, capacity: int) -> None:
        self.inner.open(num_slots, capacity)

    def close(self) -> None:
        self.inner.close()

    def reset(self, slots, tasks):
        return [self._hide(i) for i in self.inner.reset(slots, tasks)]

    def step(self, slots, actions):
        return [self._hide(i) for i in self.inner.step(slots, actions)]

    def rewind(self, slots, targets):
        self.inner.rewind(slots, targets)

    def observations(self, slots):
        return self.inner.observations(slots)

    def parse_action(self, text):
        return self.inner.parse_action(text)

    def branch_value(self, progress, solved, failed):
        return SENTINEL_VALUE + len(progress)

    def expert_actions(self, slots):
        return self.inner.expert_actions(slots)

    def random_actions(self, slots, rng, avoid=()):
        return self.inner.random_actions(slots, rng, avoid)

    def prompt_fields(self, task):
        return self.inner.prompt_fields(task)

    def state_key(self, slot):
        return self.inner.state_key(slot)


def _pick(messages: Sequence[dict[str, str]], n: int, salt: str = "") -> int:
    text = salt + "\x00".join(m["content"] for m in messages)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()) % n


class PromptOnlyPolicy:
    """Answers every role from the prompt text alone (a hash of the messages), so two runs whose prompts are
    identical get identical replies: any hidden value that reached a prompt would make the runs part ways."""

    tokenizer, needs_text = None, True

    def __init__(self, moves: Sequence[str], rollback_share: int = 3):
        self.moves, self.rollback_share = list(moves), rollback_share

    def begin(self, specs, slots, env):
        self.style = getattr(env, "action_style", "tag")

    def end(self):
        pass

    def generate(self, requests):
        return [Generation(self._one(r.role, r.messages)) for r in requests]

    def _one(self, role: str, messages) -> str:
        user = messages[-1]["content"]
        if role == "execution":
            word = (self.moves + ["rollback"])[_pick(messages, len(self.moves) + 1)]
            return f"<action>{word}</action>" if self.style == "tag" else f"```action\n{word}\n```"
        if role == "review":
            verdict = "rollback" if _pick(messages, self.rollback_share) == 0 else "continue"
            return replies.write_review(verdict, _pick(messages, 5) / 4, "went wrong", obs=["a fact"])
        if role == "coarse":
            t = int(re.search(r"C_0 … C_(\d+)\)", user).group(1))
            lo = _pick(messages, t + 1)
            return replies.write_range(lo, t)
        if role == "fine":
            cands = [int(x) for x in re.findall(r"^C_(\d+):", user.split("Candidates:", 1)[1], re.MULTILINE)]
            return replies.write_restore(cands[_pick(messages, len(cands))], 0.5, "hash")
        return replies.write_patch(["got somewhere"], "the steps went wrong", "moving without a plan")


def _transcript(env, policy, settings, protocols, tasks, seeds=(0,), cfg=CFG) -> list[dict]:
    out = io.StringIO()
    runner = RIRRunner(cfg, env, TranscriptPolicy(policy, out), settings=settings)
    runner.run(make_specs(tasks, seeds, 1, protocols))
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _sokoban_plain_and_scrambled(cfg, protocols, n_tasks, *, use_cfg) -> list[list[dict]]:
    """Transcripts of the same Sokoban run on the real world and on one whose hidden values are scrambled."""
    from retrojax.agent.env_api import make_env

    s = Settings(schedule=Schedule(2, 4, 2), rollback_budget=2, agent_budget=10)
    policy = PromptOnlyPolicy(["up", "down", "left", "right"])
    runs = []
    for wrap in (False, True):
        env = make_env(cfg, "sokoban-6x6-2:test")
        try:
            world = Scrambled(env) if wrap else env
            kw = {"cfg": cfg} if use_cfg else {}
            runs.append(_transcript(world, policy, s, protocols, range(n_tasks), **kw))
        finally:
            env.close()
    return runs


def _assert_no_hidden_values(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a == b  # same prompts, same replies, call for call
    assert ROLES <= {x["role"] for x in a}
    text = json.dumps(a)
    for sentinel in ("7300001", "7300002", "7300003", "9100003", "9100004", "9100005"):
        assert sentinel not in text


def test_no_hidden_value_reaches_any_prompt_on_line_world():
    s = Settings(schedule=Schedule(2, 4, 2), rollback_budget=3, agent_budget=16)
    protocols = ["RIR", "RIR/no-rollback", "RIR/restart", "RIR/react"]
    policy = PromptOnlyPolicy(["right", "right", "left", "wait"])
    plain = _transcript(LineWorld(length=5, tasks=3), policy, s, protocols, range(3), seeds=(0, 1))
    hidden = _transcript(
        Scrambled(LineWorld(length=5, tasks=3)), policy, s, protocols, range(3), seeds=(0, 1)
    )
    _assert_no_hidden_values(plain, hidden)
    assert {x["protocol"] for x in plain} == set(protocols)


def test_no_solver_distance_reaches_any_prompt_on_sokoban():
    """Sokoban's progress is the solver's exact distance: scrambling it changes no prompt."""

    runs = _sokoban_plain_and_scrambled(config.load("configs/sokoban_tiny.yaml"), ["RIR", "RIR/restart"], 3,
                                        use_cfg=False)
    _assert_no_hidden_values(*runs)


def test_compact_agent_prompts_follow_trial_prompt_style():
    """trial.prompt_style = compact: the agent sees the world's compact header and reply line around RIR's
    budget and rollback lines, M (its non-empty fields) under RIR only, and compact user turns; still
    nothing hidden."""

    cfg = config.load("configs/sokoban_tiny.yaml", ["trial.prompt_style=compact"])
    runs = _sokoban_plain_and_scrambled(cfg, ["RIR", "RIR/react"], 2, use_cfg=True)
    _assert_no_hidden_values(*runs)
    for protocol in ("RIR", "RIR/react"):
        first = _calls(runs[0], "execution", protocol)[0]["messages"]
        system, user = first[0]["content"], first[-1]["content"]
        assert system.startswith("Solve Sokoban (6x6, 2 boxes).") and "Budget: 10 replies in all" in system
        assert "End with one tag: <action>up, left</action>" in system and "rewind" not in system
        assert ("<action>rollback</action>" in system) == (protocol == "RIR")
        assert "<<reflection memory>>" not in system  # M is empty: no block in the compact style
        later = [x["messages"][0]["content"] for x in _calls(runs[0], "execution", protocol)]
        with_m = [x for x in later if "<<reflection memory>>" in x]
        assert bool(with_m) == (protocol == "RIR")  # once a review added knowledge, RIR's agent sees M
        assert all("seen: a fact" in x and "(none)" not in x for x in with_m)
        assert re.fullmatch(r"C_0:\n[^\n]+(\n[^\n]+)*\nreplies 0/10 left\n\(none yet\)\n", user), user
    review = _calls(runs[0], "review")[0]["messages"]
    assert review[0]["content"] == REVIEW_SYSTEM  # the auxiliary roles keep their one style


def _calls(rows: list[dict], role: str, protocol: str = "RIR") -> list[dict]:
    return [x for x in rows if x["role"] == role and x["protocol"] == protocol]


def test_reviewer_and_coarse_selector_read_the_trajectory_with_observations():
    env = LineWorld(length=30, tasks=2)
    s = Settings(schedule=Schedule(3, 3, 3), rollback_budget=3, agent_budget=20)
    rows = _transcript(env, PromptOnlyPolicy(["right", "left", "wait"], 2), s, ["RIR"], range(2))
    reviews = _calls(rows, "review")
    assert reviews and _calls(rows, "coarse")
    for x in reviews + _calls(rows, "coarse"):
        user = x["messages"][1]["content"]
        traj = user.split("Current observation", 1)[0]
        now = user.split("Current observation", 1)[1]
        assert re.search(r"MK\d+Z", now)  # the current observation, in full
        since = int(re.search(r"last review at C_(\d+)", user).group(1)) if x["role"] == "review" else None
        if since is not None:  # every step since the last review (but the current) shows its observation
            t = int(re.search(r"C_0 … C_(\d+);", user).group(1))
            for i in range(since + 1, t):
                assert re.search(
                    rf"C_{i - 1} → C_{i}: \w+ → at \d+\n    observation: position \d+ of 30 MK\d+Z", traj
                ), (
                    i,
                    user,
                )
        assert "<<reflection memory>>" in user
    assert all("Execution signals:" in x["messages"][1]["content"] for x in reviews)
    # steps before the last review come as action → outcome with the state summary σ
    assert any("; state: " in x["messages"][1]["content"] for x in reviews)
    assert reviews[0]["messages"][0]["content"] == REVIEW_SYSTEM


def test_auxiliary_prompts_stay_within_the_token_budget():
    env = LineWorld(length=60, tasks=2)
    tok = ByteChatTokenizer()  # the runner's tokenizer for scripted policies: one token per byte
    budget = 2400
    s = Settings(
        schedule=Schedule(6, 8, 6),
        rollback_budget=3,
        agent_budget=40,
        prompt_budget=budget,
        observation_chars=12,
    )
    rows = _transcript(
        env, PromptOnlyPolicy(["right", "right", "wait"], 4), s, ["RIR", "RIR/no-rollback"], range(2)
    )
    aux = [x for x in rows if x["role"] in ("review", "coarse", "patch")]
    assert aux
    for x in aux:
        system, user = (m["content"] for m in x["messages"])
        n = (
            len(tok.encode_turn("system", system))
            + len(tok.encode_turn("user", user))
            + len(tok.generation_prompt())
        )
        assert n <= budget, (x["role"], n)
    text = "\n".join(x["messages"][1]["content"] for x in aux)
    assert "(summary)" in text  # observations longer than observation_chars are shown as σ
    assert "earlier steps left out to fit the prompt" in text  # the oldest steps gave way on long paths


def test_no_rollback_patcher_gets_its_own_prompt_over_the_reviewed_steps():
    env = LineWorld(length=30, tasks=2)
    s = Settings(schedule=Schedule(3, 3, 3), rollback_budget=3, agent_budget=20)
    out = io.StringIO()
    runner = RIRRunner(CFG, env, TranscriptPolicy(PromptOnlyPolicy(["right", "left"], 2), out), settings=s)
    batch = runner.run(make_specs(range(2), [0], 1, ["RIR/no-rollback", "RIR"]))
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    reflect = _calls(rows, "patch", "RIR/no-rollback")
    assert reflect and env.rewinds > 0  # RIR restored in the same batch; no-rollback never did
    for x in reflect:
        system, user = (m["content"] for m in x["messages"])
        assert system == REFLECT_SYSTEM and "earlier checkpoint" not in system
        reviewed = user.split("Reviewed steps", 1)[1].split("<<reflection memory>>", 1)[0]
        assert re.search(r"C_\d+ → C_\d+: \w+", reviewed)  # real content, not an empty suffix
        assert re.search(r"MK\d+Z", reviewed)  # with the observations the reviewer saw
    assert all(x["messages"][0]["content"] == PATCH_SYSTEM for x in _calls(rows, "patch", "RIR"))
    for t in batch.trials:
        if t.record.protocol == "RIR/no-rollback" and t.record.recoveries:
            assert t.memory.history and t.memory.failure == "the steps went wrong"
            assert t.record.rollbacks == 0


class AlwaysRollback:
    tokenizer, needs_text = None, False

    def begin(self, *a):
        pass

    def end(self):
        pass

    def generate(self, requests):
        out = []
        for r in requests:
            v = r.view
            if v.kind == "execute":
                out.append(Generation("<action>right</action>"))
            elif v.kind == "review":  # once the branch has two steps, always roll back
                verdict = "rollback" if v.checkpoint >= 2 else "continue"
                out.append(Generation(replies.write_review(verdict, 1.0, "always")))
            elif v.kind == "coarse":
                out.append(Generation(replies.write_range(max(0, v.checkpoint - 1), v.checkpoint)))
            elif v.kind == "fine":
                out.append(Generation(replies.write_restore(min(v.candidates), 1.0, "earliest")))
            else:
                out.append(Generation(replies.write_patch([], "always")))
        return out


def _restores_with_calls_left(min_calls: int, budget: int = 7):
    env = LineWorld(length=50, tasks=1)
    s = Settings(
        schedule=Schedule(1, 1, 1), rollback_budget=50, agent_budget=budget, min_calls_for_restore=min_calls
    )
    trial = RIRRunner(CFG, env, AlwaysRollback(), settings=s).run(make_specs([0], [0], 1, ["RIR"])).trials[0]
    left = []
    for x in trial.record.restores:
        used = sum(1 for c in trial.calls[: x["after_call"]] if c.role == "execution")
        left.append(budget - used)
    return trial.record, left


def test_a_restore_needs_calls_left_and_refusals_are_counted():
    rec, left = _restores_with_calls_left(2)
    assert rec.rollbacks > 0 and min(left) >= 2
    assert rec.restores_refused >= 1  # the reviews on the last calls asked for a rollback and were refused
    old, old_left = _restores_with_calls_left(0)  # without the floor a restore lands on the last call
    assert min(old_left) == 0 and old.restores_refused == 0 and old.end_reason == "budget"


class Teacher:
    """Agent walks right (and once asks for a review); the reviewer adds one entry per channel naming the
    current checkpoint and rolls back at C_4 and later; every patch names the same failure pattern."""

    tokenizer, needs_text = None, False

    def begin(self, *a):
        pass

    def end(self):
        pass

    def generate(self, requests):
        out = []
        for r in requests:
            v = r.view
            if v.kind == "execute":
                out.append(Generation("<action>right</action>"))
            elif v.kind == "review":
                t = v.checkpoint
                verdict = "rollback" if t >= 4 else "continue"
                out.append(
                    Generation(
                        replies.write_review(
                            verdict,
                            0.0,
                            "ran ahead",
                            obs=[f"fact at {t}"],
                            elim=[f"no {t}"],
                            aff=[f"does {t}"],
                        )
                    )
                )
            elif v.kind == "coarse":
                out.append(Generation(replies.write_range(1, 2)))
            elif v.kind == "fine":
                out.append(Generation(replies.write_restore(2, 1.0, "two")))
            else:
                out.append(
                    Generation(replies.write_patch([], f"ran ahead at C_{v.checkpoint}", "Ran ahead."))
                )
        return out


def test_abandoned_facts_are_marked_with_their_step_and_a_recurring_pattern_enters_e():
    env = LineWorld(length=40, tasks=1)
    s = Settings(schedule=Schedule(2, 2, 2), rollback_budget=3, agent_budget=24)
    out = io.StringIO()
    runner = RIRRunner(CFG, env, TranscriptPolicy(Teacher(), out), settings=s)
    trial = runner.run(make_specs([0], [0], 1, ["RIR"])).trials[0]
    rec, m = trial.record, trial.memory
    assert rec.rollbacks >= 2 and rec.patterns_promoted == 1 and rec.marked_to_verify >= 3
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    first_patch = next(i for i, x in enumerate(rows) if x["role"] == "patch")
    after = next(x for x in rows[first_patch:] if x["role"] == "execution")["messages"][0]["content"]
    t = rec.restores[0]["t"]  # the first rollback abandoned C_3 … C_t (restore point C_2)
    assert rec.restores[0]["r"] == 2 and t >= 4
    # reviews ran at C_1, C_3, C_5 (L = 2); the rollback at C_5 restored C_2
    for k in (3, t):
        for entry in (f"fact at {k}", f"no {k}", f"does {k}"):  # one per channel: obs, elim, aff
            assert f"{REVERIFY}: seen at C_{k} on an abandoned branch] {entry}" in after
    for entry in ("fact at 1", "no 1", "does 1"):  # learned on the kept prefix: no mark
        assert f"  - {entry}\n" in after
    # passing C_t again on the live branch re-establishes the facts (the mark goes); nothing learned at or
    # before the restore point was ever marked
    assert all(e.checkpoint > 2 for ch in ("obs", "elim", "aff") for e in getattr(m, ch) if e.reverify)
    # the same pattern in two abandoned attempts is promoted into E, and the agent's prompt carries it
    assert "recurring failure in 2 abandoned attempts: Ran ahead." in m.texts("elim")
    last_agent = [x for x in rows if x["role"] == "execution"][-1]["messages"][0]["content"]
    assert "recurring failure in 2 abandoned attempts: Ran ahead." in last_agent
