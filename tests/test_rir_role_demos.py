"""Role demonstrations: the visible oracle plays every RIR role through the real controller; each recorded
call's prompt is exactly what the controller sends that role, its labels follow from the prompt alone, and
the warm start's packing trains every role's reply."""

from __future__ import annotations

import io
import json

from rir_line_world import LineWorld
from test_rir_prompts import Scrambled, _transcript

from retrojax import config
from retrojax.agent.chat import ByteChatTokenizer
from retrojax.agent.policies import TranscriptPolicy
from retrojax.agent.rir.policies import RANDOM_MOVE, RIROraclePolicy, RIRVisibleOracle
from retrojax.agent.rir.runner import RIRRunner
from retrojax.agent.rir.settings import Settings
from retrojax.agent.trial import TrialSpec
from retrojax.learn.role_demos import ROLES, run_role_demonstrations
from retrojax.learn.sft import pack_calls

CFG = config.Config()


def _chat(tok, messages) -> list[int]:
    ids = [i for m in messages for i in tok.encode_turn(m["role"], m["content"])]
    return ids + tok.generation_prompt()


def test_role_demonstrations_are_the_prompts_the_controller_sends():
    tok = ByteChatTokenizer()
    archive, stats = run_role_demonstrations(CFG, LineWorld(length=6, tasks=3), None, episodes=9, epsilon=0.4)
    assert set(stats["calls"]) == set(ROLES) and stats["review_verdicts"].get("rollback", 0) > 0
    # the same trials through the controller, read back from its transcript (what a served model is sent)
    out = io.StringIO()
    specs = [TrialSpec(trial=i, task=i % 3, seed=CFG.run.seed, replicate=i, protocol="RIR") for i in range(9)]
    runner = RIRRunner(CFG, LineWorld(length=6, tasks=3), TranscriptPolicy(RIRVisibleOracle(0.4), out))
    runner.run(specs)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    calls = sorted(archive.calls, key=lambda c: (c.trial, c.call_index))
    rows = sorted(rows, key=lambda x: (x["trial"], x["call"]))
    assert len(calls) == len(rows) > 0
    for c, x in zip(calls, rows, strict=True):
        assert c.role == x["role"] and c.prompt_ids.tolist() == _chat(tok, x["messages"])
        assert tok.decode(c.output_ids) == x["reply"]
        assert c.teach == (not x["reply"].startswith(RANDOM_MOVE))  # random moves are context only
    assert any(not c.teach for c in calls) and all(c.teach for c in calls if c.role != "execution")


def test_visible_oracle_labels_follow_from_the_prompt_alone():
    """The same run with the world's hidden figures scrambled gives the same transcript, call for call, for
    the visible oracle (line world and Sokoban); the exact-value oracle's would not."""
    s = Settings(agent_budget=16)
    protocols = ["RIR", "RIR/restart"]
    plain = _transcript(LineWorld(length=5, tasks=3), RIRVisibleOracle(0.4), s, protocols, range(3), (0, 1))
    hidden = _transcript(
        Scrambled(LineWorld(length=5, tasks=3)), RIRVisibleOracle(0.4), s, protocols, range(3), (0, 1)
    )
    assert plain == hidden and {"review", "coarse", "fine", "patch"} <= {x["role"] for x in plain}
    exact = [
        _transcript(w, RIROraclePolicy(0.4), s, protocols, range(3), (0, 1))
        for w in (LineWorld(length=5, tasks=3), Scrambled(LineWorld(length=5, tasks=3)))
    ]
    assert exact[0] != exact[1]
    from retrojax.agent.env_api import make_env

    cfg = config.load("configs/sokoban_tiny.yaml")
    runs = []
    for wrap in (False, True):
        env = make_env(cfg, "sokoban-6x6-2:test")
        try:
            world = Scrambled(env) if wrap else env
            runs.append(_transcript(world, RIRVisibleOracle(0.5), s, ["RIR"], range(3), cfg=cfg))
        finally:
            env.close()
    assert runs[0] == runs[1] and any(x["role"] == "review" for x in runs[0])


BASELINES = ["RIR/self-refine", "RIR/reflexion", "RIR/lats", "RIR/ga-rollback"]


def test_visible_oracle_labels_the_baselines_roles_from_the_prompt_alone():
    """Every baseline's roles (critique, reflect, value, assist) labelled by the visible oracle: the same
    transcript with the world's hidden figures scrambled, and role demonstrations of each baseline."""
    s = Settings(agent_budget=16)
    world = lambda: LineWorld(length=5, tasks=3)  # noqa: E731
    plain = _transcript(world(), RIRVisibleOracle(0.4), s, BASELINES, range(3), (0, 1))
    hidden = _transcript(Scrambled(world()), RIRVisibleOracle(0.4), s, BASELINES, range(3), (0, 1))
    assert plain == hidden
    assert {"critique", "reflect", "value", "assist"} <= {x["role"] for x in plain}
    archive, stats = run_role_demonstrations(CFG, world(), None, episodes={p: 3 for p in BASELINES},
                                             epsilon=0.4, protocols=BASELINES)
    assert {"critique", "reflect", "value", "assist"} <= set(stats["calls"])
    assert stats["trials"] == 12 and len({c.trial for c in archive.calls}) == 12


def test_the_warm_start_packing_trains_every_role_reply():
    tok = ByteChatTokenizer()
    archive, _ = run_role_demonstrations(CFG, LineWorld(length=6, tasks=3), None, episodes=6, epsilon=0.4)
    calls = [(c.prompt_ids, c.output_ids) for c in archive.calls]
    examples, stats = pack_calls(calls, 8192, end_id=tok.IM_END, train=[c.teach for c in archive.calls])
    assert stats.dropped == 0
    trained = []
    for e in examples:
        own = e.own.nonzero()[0]
        runs = [[own[0]]]
        for i in own[1:]:
            (runs[-1].append(i) if i == runs[-1][-1] + 1 else runs.append([i]))
        trained += [tok.decode([int(t) for t in e.ids[r] if t != tok.IM_END]) for r in runs]
    for c in archive.calls:
        reply = tok.decode(c.output_ids)
        assert (reply in trained) == c.teach, (c.role, reply)
    assert {c.role for c in archive.calls if c.teach} == set(ROLES)
