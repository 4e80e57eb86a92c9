"""FirstMoveProbe: the share of trials whose first move is one of the expert's best at C_0, on trials from
the real trial loop (scripted policies whose answer is known)."""

from __future__ import annotations

from collections.abc import Sequence

from retrojax import config
from retrojax.agent.env_api import make_env
from retrojax.agent.policies import OraclePolicy, Policy
from retrojax.agent.runner import run_trials
from retrojax.agent.trial import Generation, Request
from retrojax.eval.first_move import FirstMoveProbe

SPLIT = "sokoban-5x5-1:train"


class Always(Policy):
    """Replies with one fixed text every turn (a policy that ignores the board)."""

    def __init__(self, text: str):
        self.text = text

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        return [Generation(self.text) for _ in requests]


def _cfg():
    return config.load("configs/demo.yaml", ["trial.max_calls=4", "trial.branch_budget=3"])


def _trials(policy: Policy, tasks=range(8)):
    cfg = _cfg()
    env = make_env(cfg, SPLIT)
    try:
        archive, _ = run_trials(cfg, policy, task_ids=tasks, seeds=[0], trials_per_task=2, protocols=["T@1"],
                                env=env, record_tokens=False)
    finally:
        env.close()
    return archive


def _probe() -> FirstMoveProbe:
    return FirstMoveProbe(lambda: make_env(_cfg(), SPLIT))


def _optimal_first_moves(tasks) -> list[list[str]]:
    env = make_env(_cfg(), SPLIT)
    try:
        env.open(len(tasks), 2)
        env.reset(list(range(len(tasks))), list(tasks))
        return env.optimal_actions(list(range(len(tasks))))
    finally:
        env.close()


def test_sokoban_optimal_actions_start_shortest_solutions():
    best = _optimal_first_moves(range(4))
    # the demo pool's first four levels (docs/benchmarks.md#learn): left, down, right, right
    assert [b[0] for b in best] == ["left", "down", "right", "right"]
    env = make_env(_cfg(), SPLIT)
    try:
        env.open(4, 2)
        env.reset([0, 1, 2, 3], [0, 1, 2, 3])
        assert env.expert_actions([0, 1, 2, 3]) == [b[0] for b in best]
    finally:
        env.close()


def test_the_solver_always_agrees():
    assert _probe().agreement(_trials(OraclePolicy(0.0))) == 1.0


def test_a_board_blind_policy_scores_the_share_of_levels_its_move_suits():
    tasks = range(8)
    best = _optimal_first_moves(tasks)
    probe = _probe()
    for move in ("up", "down", "left", "right"):
        expected = sum(move in b for b in best) / len(best)
        archive = _trials(Always(f"<action>{move}, {move}</action>"), tasks)
        assert probe.agreement(archive) == expected


def test_invalid_replies_and_rewinds_disagree():
    probe = _probe()
    assert probe.agreement(_trials(Always("no tag at all"))) == 0.0
    assert probe.agreement(_trials(Always("<action>rewind to C_0</action>"))) == 0.0


def test_an_empty_archive_has_no_figure():
    from retrojax.agent.archive import Archive

    assert _probe().agreement(Archive()) is None
