"""Demonstrations and the warm start (retrojax.learn.warm_start) through the real trial loop on Sokoban."""

from __future__ import annotations

import numpy as np
import pytest

from retrojax.agent.archive import EXECUTION
from retrojax.agent.env_api import make_env
from retrojax.config import load
from retrojax.learn import sft
from retrojax.learn.warm_start import demo_protocols, demo_task_count, run_demonstrations, special_ids


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
