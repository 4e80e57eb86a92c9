"""D.3, context after recovery, per world, on real trials through the runner: the games restore the C_j
prefix and append the memory as a user turn; ScienceWorld restores the prefix and puts the memory in the
next observation; ALFWorld rebuilds the conversation (system message, restored observation with its
admissible commands, branch memories) and gives the branch allowance back in full."""

from __future__ import annotations

import pytest

from retrojax import config
from retrojax.agent.policies import OraclePolicy
from retrojax.agent.runner import run_trials
from retrojax.agent.trial import EXECUTE, Generation

SOKOBAN = "sokoban-6x6-2:test"


class Recorder:
    """Wraps a policy and keeps every request it answered (in order, per trial)."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.needs_text = inner, inner.tokenizer, True
        self.requests: dict[int, list] = {}

    def begin(self, specs, slots, env):
        self.inner.begin(specs, slots, env)

    def end(self):
        self.inner.end()

    def generate(self, requests):
        for r in requests:
            self.requests.setdefault(r.trial, []).append(r)
        return self.inner.generate(requests)


def resumed_requests(rec: Recorder, archive):
    """(recovery, its reflection request, the first execution request after it, the requests before it)."""
    out = []
    for recovery in archive.recoveries:
        reqs = rec.requests[recovery.trial]
        i = recovery.reflection_call  # one request per call, in order
        assert reqs[i].role == "reflection"
        after = next((r for r in reqs[i + 1 :] if r.view.kind == EXECUTE), None)
        out.append((recovery, reqs[i], after, reqs[:i]))
    return out


def test_games_restore_the_prefix_and_append_the_memory_turn():
    cfg = config.load("configs/sokoban.yaml", ["trial.prompt_style=compact"])
    rec = Recorder(OraclePolicy(0.4))
    archive, _ = run_trials(cfg, rec, task_ids=range(6), trials_per_task=2, protocols=["T@3"], split=SOKOBAN)
    checked = 0
    for recovery, refl, after, before in resumed_requests(rec, archive):
        assert refl.messages == ({"role": "user", "content": refl.prompt_text},)  # c_ref is its own context
        if after is None or not recovery.remark:
            continue
        abandoned = [r for r in before if r.view.kind == EXECUTE][-1].messages
        prefix, memory, user = after.messages[:-2], after.messages[-2], after.messages[-1]
        assert abandoned[: len(prefix)] == prefix  # the C_j prefix of the abandoned conversation
        assert prefix[-1]["role"] == ("system" if recovery.target == 0 else "assistant")
        assert memory["role"] == "user" and recovery.remark in memory["content"]
        assert user["role"] == "user" and recovery.remark not in user["content"]
        checked += 1
    assert checked >= 5


@pytest.mark.textworlds
def test_alfworld_rebuilds_the_context_and_resets_the_allowance(tmp_path):
    from retrojax.agent.textworld_env import TextOraclePolicy, TextWorldEnv

    cfg = config.load(None, ["env.name=alfworld", f"env.cache_dir={tmp_path}", "trial.max_calls=24",
                             "trial.branch_budget=5", "trial.prompt_style=compact"])
    env = TextWorldEnv("alfworld", ["gen:pick_and_place_simple:31", "gen:pick_clean_then_place_in_recep:31"],
                       num_workers=2, timeout_s=120.0)
    rec = Recorder(TextOraclePolicy(0.6))
    try:
        archive, _ = run_trials(cfg, rec, task_ids=[0, 1], seeds=[3], trials_per_task=1, protocols=["T@3"],
                                env=env)
    finally:
        env.close()
    checked = 0
    for recovery, _, after, before in resumed_requests(rec, archive):
        if after is None:
            continue
        system = before[0].messages[0]
        assert after.messages[0] == system and len(after.messages) == 2  # rebuilt: system + one turn
        turn = after.messages[1]["content"]
        if recovery.remark:
            assert recovery.remark in turn
        assert after.view.branch_left == 5  # the segment allowance starts again (C.4)
        checked += 1
    assert checked >= 1


class FocusOnAirFirst:
    """ScienceWorld: fails on purpose at C_0 until a remark is in context, then plays the oracle."""

    def __init__(self):
        from retrojax.agent.textworld_env import TextOraclePolicy

        self.inner = TextOraclePolicy(0.0)
        self.tokenizer, self.needs_text = None, True

    def begin(self, specs, slots, env):
        self.inner.begin(specs, slots, env)

    def end(self):
        self.inner.end()

    def generate(self, requests):
        out = self.inner.generate(requests)
        for i, r in enumerate(requests):
            if r.view.kind == EXECUTE and r.view.checkpoint == 0 and not r.view.remarks:
                out[i] = Generation("Let me focus on the air.\n<action>focus on air</action>")
                self.inner.last_random[r.trial] = (0, r.view.state_key, "focus on air")
        return out


@pytest.mark.textworlds
def test_scienceworld_puts_the_memory_in_the_next_observation(tmp_path):
    from retrojax.agent.textworld_env import TextWorldEnv

    cfg = config.load(None, ["env.name=scienceworld", f"env.cache_dir={tmp_path}", "trial.max_calls=20",
                             "trial.branch_budget=10"])
    env = TextWorldEnv("scienceworld", ["find-living-thing:3"], num_workers=2, timeout_s=120.0,
                       world_kwargs={"cache_dir": str(tmp_path)})
    rec = Recorder(FocusOnAirFirst())
    try:
        archive, _ = run_trials(cfg, rec, task_ids=[0], trials_per_task=1, protocols=["T@3"], env=env)
    finally:
        env.close()
    (recovery,) = archive.recoveries
    _, _, after, before = resumed_requests(rec, archive)[0]
    first = before[0]
    # the C_0 prefix (the system message) is restored; the memory is inside the next observation turn
    assert after.messages[:1] == first.messages[:1] and len(after.messages) == 2
    turn = after.messages[1]["content"]
    assert recovery.remark in turn and "focus on air" in turn
    assert turn.index(recovery.remark) < turn.index("Score so far")
    assert archive.trials[0].success


@pytest.mark.textworlds
def test_alfworld_test_partition_is_valid_seen(tmp_path):
    """Table 5: ALFWorld's test partition is valid_seen (valid_unseen is dev here)."""
    from retrojax.agent.textworld_env import make_alfworld

    for folder in ("train", "valid_seen", "valid_unseen"):
        game = tmp_path / folder / f"pick_{folder}" / "trial_0" / "game.tw-pddl"
        game.parent.mkdir(parents=True)
        game.write_text('{"solvable": true}')
    cfg = config.load("configs/alfworld_data.yaml", [f"env.data_dir={tmp_path}"])
    for part, folder in (("test", "valid_seen"), ("dev", "valid_unseen"), ("train", "train")):
        env = make_alfworld(cfg, f"alfworld-data:{part}")
        try:
            assert len(env.tasks) == 1 and f"pick_{folder}" in env.tasks[0], env.tasks
        finally:
            env.close()
