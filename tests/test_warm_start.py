"""Demonstrations and the warm start (retrojax.learn.warm_start) through the real trial loop on Sokoban."""

from __future__ import annotations

import numpy as np
import pytest

from retrojax.agent.archive import EXECUTION
from retrojax.agent.env_api import make_env
from retrojax.config import load
from retrojax.learn import sft
from retrojax.learn.warm_start import demo_protocols, demo_task_count, run_demonstrations, special_ids

# packed demonstrations of the fixture below are at most 1,695 tokens; 1,024 keeps the first calls of every
# trial (the longer chains are dropped, as sft.seq_len does in the configs) at half the cost of each step
SEQ_LEN = 1024
ALL_FIT = 2048  # where a test reads every taught call in the packed examples (packing only: no step compiles)
# The SFT runs below step at this one length (learn.seq_buckets) in token-tree rows: each SFT run compiles its
# step for every (rows, length) its batches take, and these tests check the stop rule, the schedule and the
# layouts, not the bucketing (tests/test_sft.py covers bucket_for and default_buckets)
ONE_BUCKET = {"seq_buckets": (SEQ_LEN,)}


@pytest.fixture(scope="module")
def demos():
    cfg = load("configs/sokoban_tiny.yaml", ["sft.num_solver_episodes=4", "sft.num_recovery_episodes=12",
                                             "sft.oracle_epsilon=0.5", "learn.train_tasks=3"])
    env = make_env(cfg, f"{cfg.env.split}:train")
    try:
        archive, stats = run_demonstrations(cfg, env, None)
    finally:
        env.close()
    return cfg, archive, stats


def test_demonstrations_play_the_rl_pool_and_differ(demos):
    cfg, archive, stats = demos
    assert stats["levels"] == demo_task_count(cfg, 32) == 3
    assert {t.task for t in archive.trials} == {0, 1, 2}
    rec = [t for t in archive.trials if t.trial >= stats["solver"]["trials"]]
    # repeats of a level are different episodes (each has its own random stream)
    by_task: dict[int, set[tuple[str, ...]]] = {}
    for t in rec:
        calls = [c for c in archive.calls if c.trial == t.trial and c.role == EXECUTION]
        by_task.setdefault(t.task, set()).add(tuple(c.action for c in calls))
    assert all(len(v) >= 2 for v in by_task.values())
    assert stats["recovery"]["distinct_execution_calls"] > stats["solver"]["distinct_execution_calls"]


def test_random_moves_are_context_not_targets(demos):
    cfg, archive, stats = demos
    noisy = [c for c in archive.calls if not c.teach]
    assert noisy and len(noisy) == stats["recovery"]["context_only_moves"]
    assert all(c.role == EXECUTION and "Trying something" in c.output_text for c in noisy)
    assert all(c.teach for c in archive.calls if c.trial < stats["solver"]["trials"])  # solver: all expert
    end_id, _ = special_ids(type("T", (), {"stop_ids": [1]})())
    calls = [(c.prompt_ids, c.output_ids) for c in archive.calls]
    examples, _ = sft.pack_calls(calls, 4096, end_id=end_id, train=[c.teach for c in archive.calls])
    # wherever a noisy reply sits in a packed sequence (as context before later expert decisions), none of
    # its tokens is trained (a chain of noisy replies only is left out: nothing to train)
    total_hits = 0
    for c in noisy:
        out = np.asarray(c.output_ids)
        hits = 0
        for ex in examples:
            n = len(c.prompt_ids)
            if len(ex.ids) >= n + len(out) and np.array_equal(ex.ids[:n + len(out)],
                                                              np.concatenate([c.prompt_ids, out])):
                hits += 1
                assert not ex.own[n:n + len(out)].any()
        total_hits += hits
    assert total_hits >= len(noisy) // 2


def test_evaluation_list_does_not_change_the_demonstrations():
    """`bench learn` evaluates T@3 only; its warm start must train on the demo's demonstrations."""
    sets = ["sft.num_solver_episodes=6", "sft.num_recovery_episodes=4", "sft.oracle_epsilon=0.5",
            "learn.train_tasks=2"]
    digests = []
    for protocols in ("[P@1,T@1,T@3]", "[T@3]"):
        cfg = load("configs/sokoban_tiny.yaml", [*sets, "trial.protocol=T@3", f"eval.protocols={protocols}"])
        assert demo_protocols(cfg) == ["P@1", "T@1", "T@3"]
        env = make_env(cfg, f"{cfg.env.split}:train")
        try:
            archive, _ = run_demonstrations(cfg, env, None)
        finally:
            env.close()
        digests.append([(c.trial, c.prompt_ids.tobytes(), c.output_ids.tobytes()) for c in archive.calls])
    assert digests[0] == digests[1]


def _tiny_model():
    """A one-layer Qwen3 over the byte tokenizer's 258 ids: what these tests check (stop rules, schedules,
    layouts, weights) does not depend on its size, and its programs compile in half the time of two layers."""
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.model import Qwen3, Qwen3Config

    micro = Qwen3Config(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        max_position_embeddings=SEQ_LEN)
    return Qwen3(micro, dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_warm_start_stops_at_the_first_check_that_reaches_the_target(demos):
    """The SFT stop rule (ours): each check sees the current weights; the run stops at the first step whose
    pool play reaches both targets (share of trials solved, share of levels solved at least once)."""
    import jax

    from retrojax.agent.chat import ByteChatTokenizer
    from retrojax.config import replace
    from retrojax.learn.warm_start import warm_start

    cfg, archive, _ = demos
    cfg = replace(cfg, sft={"steps": 8, "batch_size": 2, "seq_len": SEQ_LEN, "stop_at_success": 0.25,
                            "stop_at_levels": 1.0, "check_from": 2, "check_every": 2, "layout": "tree"},
                  learn=ONE_BUCKET)
    model = _tiny_model()
    # step 2: too few trials; step 4: enough trials but one level never solved; step 6: both reached
    scripted, seen = iter([(0.125, 0.5), (0.5, 0.75), (0.25, 1.0)]), []

    def play_pool() -> tuple[float, float]:
        seen.append(np.asarray(jax.device_get(model.embed[...])).copy())
        return next(scripted)

    stats = warm_start(cfg, model, archive, ByteChatTokenizer(), progress=False, play_pool=play_pool)
    assert stats["steps"] == 6
    assert stats["pool_checks"] == [[2, 0.125, 0.5], [4, 0.5, 0.75], [6, 0.25, 1.0]]
    assert not np.array_equal(seen[0], seen[1])  # each check plays the weights of its step
    np.testing.assert_array_equal(seen[-1], np.asarray(model.embed[...]))  # the start is the stop's


def test_warm_start_without_a_stop_rule_runs_every_step_and_rejects_bad_rules(demos):
    from retrojax.agent.chat import ByteChatTokenizer
    from retrojax.config import replace
    from retrojax.learn.warm_start import warm_start

    cfg, archive, _ = demos
    cfg = replace(cfg, sft={"steps": 3, "batch_size": 2, "seq_len": SEQ_LEN, "layout": "tree"},
                  learn=ONE_BUCKET)
    stats = warm_start(cfg, _tiny_model(), archive, ByteChatTokenizer(), progress=False,
                       play_pool=lambda: (1.0, 1.0))
    assert stats["steps"] == 3 and stats["pool_checks"] == []
    bad = (({"stop_at_success": 0.0}, "stop_at_success must be in \\(0, 1\\]"),
           ({"stop_at_levels": 1.5}, "stop_at_levels must be in"),
           ({"stop_at_success": 0.5, "check_every": 0}, "check_every"))
    for rule, match in bad:
        with pytest.raises(ValueError, match=match):
            warm_start(replace(cfg, sft=rule), _tiny_model(), archive, ByteChatTokenizer(), progress=False,
                       play_pool=lambda: (1.0, 1.0))
    with pytest.raises(ValueError, match="RL pool"):  # `retrojax train` has no pool check
        warm_start(replace(cfg, sft={"stop_at_levels": 0.5}), _tiny_model(), archive, ByteChatTokenizer(),
                   progress=False)


def test_train_cli_refuses_a_stop_rule_it_cannot_measure(capsys):
    from retrojax import cli

    args = ["train", "--config", "configs/sokoban_tiny.yaml", "--set", "sft.warm_start=true",
            "--set", "sft.stop_at_success=0.5"]
    assert cli.main(args) == 2
    assert "need the RL pool played during SFT" in capsys.readouterr().err


def test_a_warmup_stable_decay_stop_judges_annealed_branches(demos, monkeypatch):
    """sft.check_anneal (ours): a constant rate after warmup; each check judges a branch whose rate falls to
    10% over the anneal steps; a branch judged not good is dropped and the stable run goes on from where it
    branched; the run ends on the first good branch, or on a branch annealed after the last step."""
    import jax

    _, archive, _ = demos
    examples, _ = sft.pack_calls([(c.prompt_ids, c.output_ids) for c in archive.calls], SEQ_LEN, end_id=1,
                                 train=[c.teach for c in archive.calls])
    rates: list[float] = []
    real_set = sft.set_learning_rate
    monkeypatch.setattr(sft, "set_learning_rate",
                        lambda o, v: (rates.append(round(v / 1e-3, 6)), real_set(o, v)))
    for verdicts, steps, expect_history, expect_rates in (
            ([False, True], 8, 6, [1, 1, .55, .1, 1, 1, .55, .1]),  # stop on the second check's branch
            ([False], 4, 6, [1, 1, .55, .1, 1, 1, .55, .1])):  # no good branch: anneal after the last step
        model, judged, verdict = _tiny_model(), [], iter(verdicts)

        def stop_when(k: int, model=model, judged=judged, verdict=verdict) -> bool:
            judged.append((k, np.asarray(jax.device_get(model.embed[...])).copy()))
            return next(verdict)

        rates.clear()
        history = sft.train_sft(model, examples, steps=steps, batch_size=2, learning_rate=1e-3, seed=0,
                                check_steps={2, 4}, stop_when=stop_when, anneal_steps=2,
                                buckets=ONE_BUCKET["seq_buckets"])
        assert len(history) == expect_history and rates == expect_rates
        assert [k for k, _ in judged] == [4, 6][:len(verdicts)]  # a check's step counts its branch's anneal
        if verdicts[-1]:
            np.testing.assert_array_equal(judged[-1][1], np.asarray(model.embed[...]))
        assert not np.array_equal(judged[0][1], np.asarray(model.embed[...]))


def test_warm_start_weights_the_decisions_of_the_taught_calls(demos, monkeypatch):
    """``sft.decision_weight`` through the real demonstrations: in the packed examples exactly the contents
    of the taught replies' ``<action>`` tags carry the weight (random moves stay context); 0 is refused."""
    import re

    from retrojax.agent.chat import ByteChatTokenizer
    from retrojax.config import replace
    from retrojax.learn.warm_start import warm_start

    cfg, archive, _ = demos
    packed = []

    class Packed(Exception):
        """Stops the warm start once its examples are packed: the training itself is tested elsewhere."""

    def pack_and_stop(*args, **kwargs):
        packed.append(real_pack(*args, **kwargs))
        raise Packed

    real_pack = sft.pack_calls
    monkeypatch.setattr(sft, "pack_calls", pack_and_stop)
    tok = ByteChatTokenizer()
    cfg = replace(cfg, sft={"steps": 1, "batch_size": 2, "seq_len": ALL_FIT, "decision_weight": 5.0})
    with pytest.raises(Packed):
        warm_start(cfg, _tiny_model(), archive, tok, progress=False)
    (examples, _), = packed
    weighted = "".join(tok.decode(e.ids[e.loss_weights() == 5.0]) for e in examples)
    taught = [c for c in archive.calls if c.teach]
    tags = [re.findall(r"<action>(.*?)</action>", tok.decode(c.output_ids)) for c in taught]
    actions = "".join(found[-1] for found in tags if found)  # a remark-only reflection has no decision
    assert weighted == actions and len(actions) > 0 and any(not found for found in tags)
    assert any(not c.teach for c in archive.calls)  # there were context-only moves to leave out
    with pytest.raises(ValueError, match="decision_weight"):
        warm_start(replace(cfg, sft={"decision_weight": 0.0}), _tiny_model(), archive, tok, progress=False)


def test_sft_layout_changes_how_steps_are_laid_out_not_what_they_learn(demos, monkeypatch):
    """``sft.layout`` (null: ``learn.layout``) reaches every SFT batch, and the held-out NLL before and after
    a step does not depend on it: a layout is arithmetic on the same examples, not another objective."""
    from retrojax.agent.chat import ByteChatTokenizer
    from retrojax.config import ConfigError, replace
    from retrojax.learn.warm_start import warm_start

    cfg, archive, _ = demos
    used: list[str] = []
    real_make_batch = sft.make_batch

    def spy(examples, batch_size, buckets, pad_id=0, layout="tree"):
        used.append(layout)
        return real_make_batch(examples, batch_size, buckets, pad_id, layout)

    monkeypatch.setattr(sft, "make_batch", spy)
    nll = {}
    assert cfg.learn.layout != "tree"
    for layout in (None, "tree"):
        used.clear()
        run = replace(cfg, sft={"steps": 1, "batch_size": 2, "seq_len": SEQ_LEN, "layout": layout},
                      learn=ONE_BUCKET)
        stats = warm_start(run, _tiny_model(), archive, ByteChatTokenizer(), progress=False,
                           play_pool=lambda: (1.0, 1.0))
        assert set(used) == {layout or cfg.learn.layout} and len(used) >= 2
        nll[layout] = (stats["held_out_nll_before"], stats["held_out_nll_after"])
    np.testing.assert_allclose(nll["tree"], nll[None], rtol=1e-4)
    assert nll[None][1] < nll[None][0]  # the step learned something
    with pytest.raises(ConfigError, match="sft.layout"):
        load("configs/sokoban_tiny.yaml", ["sft.layout=flat"])
