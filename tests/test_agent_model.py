"""ModelPolicy: sampler rows mirror the trials' conversations (rewinds included); a tiny random Qwen3
completes trials within budgets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from retrojax import config
from retrojax.agent.archive import EXECUTION
from retrojax.agent.games import SokobanEnv
from retrojax.agent.policies import ModelPolicy
from retrojax.agent.prompts import get_prompts
from retrojax.agent.runner import run_trials
from retrojax.agent.trial import EXECUTE, Request, TrialSpec, TrialView
from retrojax.model.qwen3 import PRESETS, Qwen3
from retrojax.model.tokenizer import train_sentencepiece

# One sampler shape for the whole module (rows, cache length, chunk buckets, decode buffer, trail capacity)
# and a one-layer model: every test runs the programs the first one compiled. Two rows take the runner's
# trials in turn (continuous batching); the compact prompts of a ~950-piece tokenizer start near 200 tokens
# and stay under 1,024 within four calls.
ROWS = 2
BASE = ["trial.max_calls=4", "trial.branch_budget=2", "trial.prompt_style=compact", "sampler.max_len=1024",
        "sampler.max_new_tokens=12", "sampler.max_reflection_tokens=16", "sampler.chunk_buckets=[128, 512]",
        f"sampler.max_inflight={ROWS}"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = get_prompts("sokoban", "compact")
    texts = [p.system, p.user, p.reflect_known, p.reflect_choose, p.memory, p.rules,
             "0: # # # # # #\n1: # _ X O _ #\n2: # _ P _ _ #\n", "<action>up, left</action>",
             "<remark>the box got stuck</remark>", "rewind to C_1"] * 4
    tok = train_sentencepiece(texts, 1000, tmp_path_factory.mktemp("spm"))
    model = Qwen3(dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size, num_hidden_layers=1))
    return model, tok


@pytest.fixture(scope="module")
def env():
    world = SokobanEnv("sokoban-6x6-2:test")
    yield world
    world.close()


def _request(slot: int, ids) -> Request:
    spec = TrialSpec(trial=slot, task=0, seed=0, replicate=0, protocol="T@3")
    view = TrialView(spec=spec, slot=slot, kind=EXECUTE, checkpoint=0, targets=(), target=-1, trigger="",
                     progress=(0.0,), keys=("k",), path=(), state_key="k", remarks=(), calls_left=10,
                     branch_left=5, last_invalid="")
    return Request(trial=slot, slot=slot, role=EXECUTION, kind=EXECUTE, prompt_ids=np.asarray(ids, np.int32),
                   prompt_text="", max_new_tokens=6, view=view)


def test_rows_follow_rewound_conversations(tiny):
    model, tok = tiny
    policy = ModelPolicy.from_config(config.load(None, [*BASE, "run.seed=3"]), model, tok)
    policy.begin([], list(range(ROWS)), env=None)
    a = tok.encode_turn("system", "rules") + tok.encode_turn("user", "board one") + tok.generation_prompt()
    b = tok.encode_turn("system", "rules") + tok.encode_turn("user", "board two") + tok.generation_prompt()
    g1, g2 = policy.generate([_request(0, a), _request(1, b)])
    for row, prompt, g in ((0, a, g1), (1, b, g2)):
        assert np.array_equal(policy.sampler.tokens(row), np.concatenate([prompt, g.output_ids]))
        assert g.logprobs.shape == g.output_ids.shape and np.all(g.logprobs <= 0)
    # the trial goes on: close the turn, add a user turn
    a2 = np.concatenate([a, g1.output_ids, tok.end_of_turn(list(g1.output_ids)),
                         tok.encode_turn("user", "next"), tok.generation_prompt()])
    (g3,) = policy.generate([_request(0, a2)])
    assert np.array_equal(policy.sampler.tokens(0)[: a2.size], a2)
    # a rewind: the conversation returns to the system prompt plus a memory turn
    cut = len(tok.encode_turn("system", "rules"))
    a3 = np.concatenate([a[:cut], tok.encode_turn("user", "memory"), tok.generation_prompt()])
    (g4,) = policy.generate([_request(0, a3)])
    assert np.array_equal(policy.sampler.tokens(0), np.concatenate([a3, g4.output_ids]))
    assert np.array_equal(policy.sampler.tokens(1)[: len(b)], b)  # the other row is untouched
    (g5,) = policy.generate([_request(1, np.arange(policy.max_len + 10) % 50)])  # no room: the trial must end
    assert g5.finish_reason == "context" and g5.output_ids.size == 0


def test_model_policy_smoke_run(tiny, env):
    """Six trials of three protocols through two cache rows (queued trials take freed rows) end within their
    call and token budgets with valid log-probs."""
    model, tok = tiny
    cfg = config.load(None, BASE)
    policy = ModelPolicy.from_config(cfg, model, tok)
    archive, metrics = run_trials(cfg, policy, task_ids=range(2), seeds=[0], trials_per_task=1,
                                  protocols=["P@1", "T@1", "T@3"], env=env)
    assert policy.sampler.rows == ROWS
    assert len(archive.trials) == 6 and all(t.end_reason for t in archive.trials)
    for t in archive.trials:
        calls = [c for c in archive.calls if c.trial == t.trial]
        assert 1 <= len(calls) == t.calls_execution + t.calls_reflection <= 4
        for c in calls:
            assert c.output_ids.size <= (12 if c.role == EXECUTION else 16)
            assert c.logprobs.shape == c.output_ids.shape
            assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
            assert c.prompt_ids.size > 0 and c.finish_reason in ("stop", "length")
    assert set(metrics["results"]) == {"P@1", "T@1", "T@3"}


def test_row_buckets_give_the_same_greedy_trials(tiny, env):
    """sampler.row_buckets: each call decodes only its rows; greedy trials through the runner are the same."""
    model, tok = tiny
    archives = []
    for buckets in (False, True):
        flags = ["sampler.temperature=0", f"sampler.row_buckets={str(buckets).lower()}"]
        cfg = config.load(None, [*BASE, *flags])
        policy = ModelPolicy.from_config(cfg, model, tok)
        archive, _ = run_trials(cfg, policy, task_ids=range(3), seeds=[0], trials_per_task=1,
                                protocols=["T@3"], env=env)
        assert type(policy.sampler).__name__ == ("RowBucketSampler" if buckets else "Sampler")
        assert policy.sampler.min_out_len == 16  # moves (12) and reflections (16) share decode programs
        archives.append(archive)
    plain, bucketed = archives
    assert len(plain.calls) == len(bucketed.calls) > len(plain.trials)
    for a, b in zip(plain.calls, bucketed.calls, strict=True):
        assert (a.trial, a.role) == (b.trial, b.role)
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_demo_evaluations_draw_common_random_numbers(tiny, env):
    """The demo scores SFT and RL on the same levels with the same sampling stream: one policy evaluated
    twice (with training batches sampled in between) gives the same replies, so a held-out difference is the
    policies', not the dice's."""
    from retrojax.demo import ModelTrials, evaluate

    model, tok = tiny
    cfg = config.load(None, [*BASE, "sampler.temperature=1.0", "eval.num_tasks=3", "eval.seeds=1",
                             "eval.protocols=[T@1]"])
    trials = ModelTrials(cfg, tok, model)
    _, first = evaluate(cfg, trials, env, "first")
    trials.run(env, [TrialSpec(trial=r, task=5, seed=9, replicate=r, protocol="T@1")  # the stream moves on
                     for r in range(ROWS)])
    _, second = evaluate(cfg, trials, env, "second")
    replies = [[(c.trial, c.output_ids.tobytes()) for c in a.calls] for a in (first, second)]
    assert replies[0] and replies[0] == replies[1]


def test_demo_evaluations_leave_the_training_stream_where_it_was(tiny, env):
    """An evaluation samples from a stream of its own and resumes the one that was running: the training
    trials after it draw what they would have drawn without it, however many evaluation seeds it used (so
    ``eval.seeds`` never changes an RL run)."""
    from retrojax.demo import ModelTrials, evaluate

    model, tok = tiny
    base = [*BASE, "sampler.temperature=1.0", "eval.num_tasks=2", "eval.protocols=[T@1]"]
    spec = [TrialSpec(trial=r, task=5, seed=9, replicate=r, protocol="T@1") for r in range(ROWS)]
    runs = []
    for seeds in (0, 1, 2):  # 0: no evaluation in between
        cfg = config.load(None, [*base, f"eval.seeds={max(seeds, 1)}"])
        trials = ModelTrials(cfg, tok, model)
        trials.restart_sampling(123)
        first = trials.run(env, spec)
        if seeds:
            evaluate(cfg, trials, env, "in between")
        second = trials.run(env, spec)
        runs.append([[c.output_ids.tobytes() for c in a.calls] for a in (first, second)])
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] != runs[0][1]  # the stream moved on between the two batches (it was not restarted)
