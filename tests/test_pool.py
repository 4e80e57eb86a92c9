"""The RL pool (retrojax.learn.pool): the first N training levels, or those at chosen solution lengths."""

from __future__ import annotations

import numpy as np
import pytest

from retrojax.agent.env_api import make_env
from retrojax.config import from_dict
from retrojax.learn.pool import rl_pool
from retrojax.learn.warm_start import demo_levels


@pytest.fixture(scope="module")
def train_env():
    env = make_env(from_dict({"env": {"name": "sokoban", "split": "sokoban-5x5-1"}}), "sokoban-5x5-1:train")
    yield env
    env.close()


class Lengths:
    """A world of ``len(d0)`` tasks with the given solution lengths."""

    def __init__(self, d0):
        self.d0 = list(d0)
        self.num_tasks = len(self.d0)

    def task_scale(self, task: int) -> float:
        return float(self.d0[task])


def test_pool_at_solution_lengths_reads_the_solver(train_env):
    d0 = np.asarray(train_env.bank.d0)
    pool = rl_pool(train_env, None, [3, 4])
    assert pool == [t for t in range(train_env.num_tasks) if 3 <= d0[t] <= 4]  # level order, all of them
    assert 0 < len(pool) < train_env.num_tasks
    assert rl_pool(train_env, 5, [3, 4]) == pool[:5]  # train_tasks caps the filtered pool
    assert rl_pool(train_env, 4) == [0, 1, 2, 3]  # no lengths: the first N levels, as before
    assert rl_pool(train_env) == list(range(train_env.num_tasks))


def test_bad_pools_get_clear_errors():
    with pytest.raises(ValueError, match=r"\[lo, hi\]"):
        rl_pool(Lengths([2, 3]), None, [4, 3])
    with pytest.raises(ValueError, match=r"\[lo, hi\]"):
        rl_pool(Lengths([2, 3]), None, [3])
    with pytest.raises(ValueError, match=r"selects no training level.*\[2, 3\]"):
        rl_pool(Lengths([2, 3, float("inf")]), None, [5, 9])

    class NoLengths:
        num_tasks = 3

    with pytest.raises(ValueError, match="task_scale"):
        rl_pool(NoLengths(), None, [1, 2])


def test_demonstrations_follow_the_pool_unless_demo_tasks_is_set():
    env = Lengths([2, 5, 3, 3, 7, 4])
    cfg = from_dict({"learn": {"pool_lengths": [3, 4]}})
    assert demo_levels(cfg, env) == [2, 3, 5]
    cfg = from_dict({"learn": {"pool_lengths": [3, 4], "train_tasks": 2}})
    assert demo_levels(cfg, env) == [2, 3]
    cfg = from_dict({"learn": {"pool_lengths": [3, 4]}, "sft": {"demo_tasks": 4}})
    assert demo_levels(cfg, env) == [0, 1, 2, 3]  # sft.demo_tasks: the first N levels, whatever their length
    assert demo_levels(from_dict({"learn": {"train_tasks": 2}}), env) == [0, 1]


def test_demo_refuses_a_pool_no_level_meets_before_any_work(tmp_path, capsys):
    import argparse

    from retrojax import demo

    args = argparse.Namespace(config="configs/demo.yaml",
                              overrides=["learn.pool_lengths=[20, 30]", f"run.out_dir={tmp_path}"])
    assert demo.main(args) == 2
    out = capsys.readouterr().err
    assert "selects no training level" in out and "[2, 3, 4" in out
    assert not (tmp_path / "demonstrations.jsonl").exists()  # refused at the levels stage
