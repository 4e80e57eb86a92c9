"""RIR with the Flax Qwen3 policy: auxiliary calls use their own sampler rows, so the agent row's cache is
unchanged across an auxiliary call, and every role is answered by the model through the parsers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from retrojax import config
from retrojax.agent.policies import ModelPolicy
from retrojax.agent.rir.controller import EXECUTE
from retrojax.agent.rir.policies import RIRModelPolicy
from retrojax.agent.rir.prompts import COARSE_SYSTEM, FINE_SYSTEM, PATCH_SYSTEM, REVIEW_SYSTEM
from retrojax.agent.rir.runner import RIRRunner, make_specs
from retrojax.agent.rir.schedule import Schedule
from retrojax.agent.rir.settings import Settings
from retrojax.model.qwen3 import PRESETS, Qwen3
from retrojax.model.tokenizer import train_sentencepiece


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    texts = [
        REVIEW_SYSTEM,
        COARSE_SYSTEM,
        FINE_SYSTEM,
        PATCH_SYSTEM,
        "<verdict>rollback</verdict>",
        "0: # # # # # #\n1: # _ X O _ #\n2: # _ P _ _ #\n",
        "<action>up, left</action>",
        "rollback",
    ] * 4
    tok = train_sentencepiece(texts, 400, tmp_path_factory.mktemp("spm"))
    model = Qwen3(dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size))
    return model, tok


def test_agent_cache_unchanged_across_auxiliary_calls(tiny):
    model, tok = tiny
    cfg = config.load("configs/sokoban_tiny.yaml")
    inner = ModelPolicy(model, tok, max_len=4096, temperature=1.0, seed=1, chunk_buckets=(128, 512, 2048))
    policy = RIRModelPolicy(inner)
    checked = {"aux": 0, "agent": 0}
    generate = policy.generate

    def snapshot(row: int):
        s = inner.sampler
        n = s.length(row)
        return s.tokens(row), np.asarray(s.cache.k[:, row, ..., :n]), np.asarray(s.cache.v[:, row, :, :n])

    def watched(requests):
        aux = [r for r in requests if r.view.kind != EXECUTE]
        before = {r.slot: snapshot(r.slot) for r in aux if inner.sampler.length(r.slot) > 0}
        out = generate(requests)
        for r in requests:
            if r.view.kind == EXECUTE:
                checked["agent"] += 1
                continue
            row = policy.aux_row(r.slot)
            assert np.array_equal(inner.sampler.tokens(row)[: r.prompt_ids.size], r.prompt_ids)
            assert r.messages[0]["role"] == "system" and len(r.messages) == 2  # single-turn prompt
            if r.slot in before:
                after = snapshot(r.slot)
                for a, b in zip(before[r.slot], after, strict=True):
                    assert np.array_equal(a, b)  # the agent row: same tokens, same keys and values
                checked["aux"] += 1
        return out

    policy.generate = watched
    s = Settings(
        schedule=Schedule(1, 1, 1),
        rollback_budget=2,
        agent_budget=3,
        max_new_tokens=8,
        max_review_tokens=12,
        max_select_tokens=6,
        max_patch_tokens=12,
    )
    runner = RIRRunner(cfg, _env(cfg), policy, settings=s)
    batch = runner.run(make_specs([0, 1], [0], 1, ["RIR"]))
    assert checked["aux"] >= 2 and checked["agent"] >= 2
    assert all(r.reviews >= 1 for r in batch.records)
    roles = {c.role for c in batch.archive.calls}
    assert {"execution", "review"} <= roles
    for c in batch.archive.calls:  # every call's exact ids and the sampler's log-probs are archived
        assert c.output_ids.size == c.logprobs.size and c.prompt_ids.size > 0


def _env(cfg):
    from retrojax.agent.env_api import make_env

    return make_env(cfg, "sokoban-6x6-2:test")


def test_aux_temperature_zero_makes_auxiliary_replies_greedy(tiny):
    """``rir.aux_temperature`` = 0: every auxiliary reply is the model's argmax continuation of its prompt
    (the agent keeps ``sampler.temperature``); a negative temperature is refused."""
    model, tok = tiny
    cfg = config.load("configs/sokoban_tiny.yaml")
    inner = ModelPolicy(model, tok, max_len=4096, temperature=1.0, seed=3, chunk_buckets=(128, 512, 2048))
    s = Settings(schedule=Schedule(1, 1, 1), rollback_budget=2, agent_budget=3, max_new_tokens=8,
                 max_review_tokens=6, max_select_tokens=4, max_patch_tokens=6)
    batch = RIRRunner(cfg, _env(cfg), RIRModelPolicy(inner, aux_temperature=0.0), settings=s).run(
        make_specs([0, 1], [0], 1, ["RIR"]))
    aux = [c for c in batch.archive.calls if c.role != "execution" and c.output_ids.size]
    assert aux and inner.aux_temperature == 0.0 and inner.temperature == 1.0
    for c in aux[:3]:
        ids = np.concatenate([c.prompt_ids, c.output_ids])
        logits = np.asarray(model(ids[None, :-1]))[0, c.prompt_ids.size - 1:]
        assert np.array_equal(logits.argmax(-1), c.output_ids)
    with pytest.raises(ValueError, match="aux_temperature"):
        RIRModelPolicy(ModelPolicy(model, tok, max_len=64), aux_temperature=-1.0)
