"""The batched loop on the real games: adapters, archive completeness, links, invariants, serialization."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from retrojax import config
from retrojax.agent.archive import EXECUTION, REFLECTION, Archive
from retrojax.agent.chat import ByteChatTokenizer
from retrojax.agent.games import MineSweeperEnv, SokobanEnv
from retrojax.agent.policies import OraclePolicy, RandomPolicy
from retrojax.agent.runner import run_trials

TOK = ByteChatTokenizer()
CFG = config.load(None, [])
SPLITS = {"sokoban": "sokoban-6x6-2:test", "minesweeper": "minesweeper-6x6-3:test"}
PROTOCOLS = ["P@1", "T@1", "T@3"]


@pytest.fixture(scope="module", params=["sokoban", "minesweeper"])
def env(request):
    cls = SokobanEnv if request.param == "sokoban" else MineSweeperEnv
    e = cls(SPLITS[request.param])
    yield e
    e.close()


def run(env, policy, tokens=True):
    # 4 tasks × 2 trials × 3 protocols = 24 slots in every test here (one compilation per world)
    return run_trials(CFG, policy, task_ids=range(4), seeds=[0], trials_per_task=2, protocols=PROTOCOLS,
                      env=env, record_tokens=tokens)


def test_adapter_step_rewind_restores_state(env):
    env.open(24, 21)
    lengths = env.bank.d0 if env.name == "sokoban" else env.bank.solution_length
    task = int(np.argmax(np.asarray(lengths)[: env.num_tasks]))  # a task that needs several moves
    assert env.parse_action(None).is_invalid
    infos = env.reset([0, 1], [task, 1])
    start_obs = env.observations([0, 1])
    assert all(i.reward == 0 and not i.solved and not i.failed for i in infos)
    keys = [infos[0].state_key]
    obs = [start_obs[0]]
    for _ in range(3):
        action = env.parse_action(env.expert_actions([0])[0])
        assert action.is_move
        info = env.step([0], [action])[0]
        keys.append(info.state_key)
        obs.append(env.observations([0])[0])
    assert len(set(keys)) == 4 and env.trail_length(0) == 4 and env.trail_length(1) == 1
    env.rewind([0], [1])
    assert env.observations([0])[0] == obs[1] and env.state_key(0) == keys[1] and env.trail_length(0) == 2
    assert env.observations([1]) == start_obs[1:]  # other slots untouched
    again = env.step([0], [env.parse_action(env.expert_actions([0])[0])])[0]
    assert again.state_key == keys[2]  # the same move from the restored state reaches the same state
    assert env.parse_action("rewind to C_3").is_rewind and env.parse_action("fly").is_invalid
    v = env.branch_value([4.0, 2.0], False, False)
    assert v == (2.0 if env.name == "sokoban" else -2.0)
    with pytest.raises(IndexError):
        env.rewind([0], [7])
    with pytest.raises(ValueError):
        env.step([0, 0], [again and env.parse_action(env.expert_actions([0])[0])] * 2)


def _check_archive(archive: Archive, max_calls: int) -> None:
    by_trial = defaultdict(list)
    for c in archive.calls:
        by_trial[c.trial].append(c)
    segs = defaultdict(list)
    for s in archive.segments:
        segs[s.trial].append(s)
    recs = defaultdict(list)
    for r in archive.recoveries:
        recs[r.trial].append(r)
    assert sorted(by_trial) == sorted(t.trial for t in archive.trials)
    for tr in archive.trials:
        calls = by_trial[tr.trial]
        n = len(calls)
        assert [c.call_index for c in calls] == list(range(n))  # every call once, in order
        assert n == tr.calls_execution + tr.calls_reflection <= max_calls
        assert tr.rewinds_model <= 3 and tr.macro_attempts <= 3
        if tr.protocol == "P@1":
            assert tr.calls_reflection == 0 and not recs[tr.trial]
        for c in calls:
            assert c.output_ids.size and c.logprobs.shape == c.output_ids.shape
            assert TOK.decode(c.output_ids) == c.output_text
            assert list(c.prompt_ids[-len(TOK.generation_prompt()):]) == TOK.generation_prompt()
            assert c.state_key and c.history_key
        # segments: consecutive, cover every execution call exactly once, positions in order
        seen = []
        for m, s in enumerate(segs[tr.trial]):
            assert s.index == m and s.end_reason
            for t, ci in enumerate(s.calls):
                c = calls[ci]
                assert c.role == EXECUTION and c.segment == m and c.position == t
            for a, b in zip(s.calls, s.calls[1:], strict=False):  # within a segment the context only grows
                ca, cb = calls[a], calls[b]
                grown = np.concatenate([ca.prompt_ids, ca.output_ids])
                assert np.array_equal(cb.prompt_ids[: grown.size], grown)
            seen += s.calls
        assert sorted(seen) == [c.call_index for c in calls if c.role == EXECUTION]
        # recoveries link the reflection, the abandoned suffix and the resumed segment
        refl = [c.call_index for c in calls if c.role == REFLECTION]
        assert [r.reflection_call for r in recs[tr.trial]] == refl
        for r in recs[tr.trial]:
            assert calls[r.reflection_call].segment == r.index
            assert segs[tr.trial][r.index].end_checkpoint == r.from_checkpoint
            resumed = segs[tr.trial][r.resumed_segment]
            assert resumed.start_checkpoint == r.target and r.resumed_segment == r.index + 1
            assert r.abandoned_calls and all(calls[i].role == EXECUTION and calls[i].checkpoint >= r.target
                                             for i in r.abandoned_calls)
            assert r.abandoned_calls[-1] < r.reflection_call
            assert r.v_abandoned is not None and r.v_resumed is not None
            if resumed.calls:  # the remark sits in the resumed segment's context
                first = calls[resumed.calls[0]]
                assert (not r.remark) or r.remark in TOK.decode(first.prompt_ids)
        if tr.success:
            assert calls[-1].solved and tr.end_reason == "success"


def test_random_policy_archive_is_complete(env, tmp_path):
    archive, metrics = run(env, RandomPolicy(rewind_prob=0.2))
    _check_archive(archive, CFG.trial.max_calls)
    assert sum(t.invalid_turns for t in archive.trials) > 0  # refused rewinds are counted, not crashes
    assert set(metrics["results"]) == set(PROTOCOLS)
    archive.save(tmp_path / "gamma.jsonl")
    loaded = Archive.load(tmp_path / "gamma.jsonl")
    assert len(loaded.calls) == len(archive.calls) and loaded.trials == archive.trials
    assert loaded.recoveries == archive.recoveries and loaded.segments == archive.segments
    for a, b in zip(archive.calls, loaded.calls, strict=True):
        assert np.array_equal(a.prompt_ids, b.prompt_ids) and a.output_text == b.output_text


def test_oracle_recovers_and_remembers(env):
    archive, metrics = run(env, OraclePolicy(0.4))
    _check_archive(archive, CFG.trial.max_calls)
    triggers = {r.trigger for r in archive.recoveries}
    assert "failure" in triggers or "model" in triggers
    assert all("avoid '" in r.remark or "none identified" in r.remark for r in archive.recoveries)
    assert metrics["results"]["P@1"]["rewinds"] == 0 and metrics["results"]["T@1"]["rewinds_forced"] == 0
    # evaluation mode: no tokens, same decisions (policy randomness is per trial, not per run)
    _, plain = run(env, OraclePolicy(0.4), tokens=False)
    assert plain["results"] == metrics["results"]
