"""Continuous batching of trials: at most N trials in flight, queued trials start in freed slots, and the
archive equals the all-at-once run (scripted policies; a tiny Qwen3 with greedy decoding)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from retrojax import config
from retrojax.agent.games import SokobanEnv
from retrojax.agent.policies import ModelPolicy, OraclePolicy, RandomPolicy
from retrojax.agent.runner import Runner, make_specs

CFG = config.load(None, ["trial.max_calls=8", "trial.branch_budget=5"])


def _plain(x):
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.tolist())
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _run(cfg, policy, specs, n, env):
    runner = Runner(cfg, env, policy, max_inflight=n)
    return runner.run(specs), runner


@pytest.mark.parametrize("make_policy", [lambda: OraclePolicy(0.4), lambda: RandomPolicy(0.3)])
def test_scripted_archives_match_all_at_once(make_policy):
    specs = make_specs(range(3), [0], 2, ["P@1", "T@3"])
    with SokobanEnv("sokoban-6x6-2:test") as env:
        ref, ref_runner = _run(CFG, make_policy(), specs, 0, env)
        for n in (1, 3):
            got, runner = _run(CFG, make_policy(), specs, n, env)
            assert env.num_slots == n
            assert _plain(got.trials) == _plain(ref.trials)
            assert _plain(got.calls) == _plain(ref.calls)
            assert _plain(got.segments) == _plain(ref.segments)
            assert _plain(got.recoveries) == _plain(ref.recoveries)
            assert runner.ticks >= ref_runner.ticks


def test_negative_inflight_is_rejected():
    with SokobanEnv("sokoban-6x6-2:test") as env, pytest.raises(ValueError, match="max_inflight"):
        Runner(CFG, env, OraclePolicy(0.1), max_inflight=-1)


def test_model_policy_greedy_matches_with_two_rows(tmp_path):
    from retrojax.agent.prompts import get_prompts
    from retrojax.model.qwen3 import PRESETS, Qwen3
    from retrojax.model.tokenizer import train_sentencepiece

    p = get_prompts("sokoban", "compact")
    texts = [p.system, p.user, p.reflect_known, p.reflect_choose, p.memory, p.rules,
             "<action>up, left</action>", "<remark>the box got stuck</remark>", "rewind to C_1"] * 4
    tok = train_sentencepiece(texts, 400, tmp_path)
    model = Qwen3(dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size))
    cfg = config.load(None, ["trial.max_calls=4", "trial.branch_budget=3", "trial.prompt_style=compact",
                             "sampler.max_len=1024", "sampler.max_new_tokens=12", "sampler.temperature=0.0",
                             "sampler.max_reflection_tokens=12", "sampler.chunk_buckets=[128, 512]"])
    specs = make_specs(range(2), [0], 1, ["P@1", "T@3"])
    with SokobanEnv("sokoban-6x6-2:test") as env:
        ref_policy = ModelPolicy.from_config(cfg, model, tok)
        ref, _ = _run(cfg, ref_policy, specs, 0, env)
        policy = ModelPolicy.from_config(cfg, model, tok)
        got, _ = _run(cfg, policy, specs, 2, env)
    assert policy.sampler.rows == 2 and ref_policy.sampler.rows == len(specs)
    assert len(got.calls) == len(ref.calls) > len(specs)
    for a, b in zip(got.calls, ref.calls, strict=True):
        assert a.trial == b.trial and np.array_equal(a.prompt_ids, b.prompt_ids)
        assert np.array_equal(a.output_ids, b.output_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert [t.end_reason for t in got.trials] == [t.end_reason for t in ref.trials]
