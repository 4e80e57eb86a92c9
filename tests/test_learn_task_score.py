"""``learn.task_score`` on trials run through the real loop (noisy oracle, T@3, Sokoban).

``reward`` takes the macro term's S from the cumulative reward of the retained path; ``progress`` from the
world's endpoint progress, Sokoban's ``d_0 − d_end`` (C.2: 0 for a dead end, ``d_0`` when solved).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from retrojax import config as config_lib
from retrojax.agent.archive import EXECUTION, Archive
from retrojax.agent.policies import OraclePolicy
from retrojax.agent.runner import run_trials
from retrojax.learn.advantages import advantages_from_config, compute_advantages


@pytest.fixture(scope="module")
def archive():
    cfg = config_lib.load("configs/demo.yaml", ["env.push_notes=true"])
    out, _ = run_trials(cfg, OraclePolicy(0.9), task_ids=range(16), seeds=[0], trials_per_task=8,
                        protocols=["T@3"], split="sokoban-5x5-1:train")
    return out


def test_segments_record_the_solver_progress_at_their_end(archive):
    d0 = {t.task: t.d0 for t in archive.trials}
    ends = defaultdict(set)
    for s in archive.segments:
        assert s.progress is not None and s.progress <= d0[s.task]
        ends[s.end_reason].add(s.progress)
        if s.end_reason == "success":
            assert s.progress == d0[s.task]
        if s.end_reason == "failure":  # a dead box: no progress, however far the player walked
            assert s.progress == 0.0
    assert {"success", "failure"} <= set(ends) and len(set().union(*ends.values())) > 3
    for t in archive.trials:
        assert t.final_progress <= t.d0 and (t.final_progress == t.d0) == t.success


def _failed_group_macro(archive: Archive, adv) -> dict[str, float]:
    """Mean macro advantage of moves and rewind requests in groups where no trial succeeded."""
    solved = defaultdict(bool)
    for t in archive.trials:
        solved[t.task] |= t.success
    by = defaultdict(list)
    for c in archive.calls:
        if c.role == EXECUTION and not solved[c.task] and c.valid:
            by["rewind" if c.is_rewind else "move"].append(adv.macro[(c.task, c.trial, c.call_index)])
    return {k: float(np.mean(v)) for k, v in by.items()}


def test_progress_stops_failed_groups_from_crediting_early_endings(archive):
    """Among failed trials the reward ranks segments by how few moves they took, so a rewind request (which
    ends its segment with δ = 0) is credited above the moves; endpoint progress ranks them by how close they
    left the box to its target."""
    reward = _failed_group_macro(archive, compute_advantages(archive, task_score="reward"))
    progress = _failed_group_macro(archive, compute_advantages(archive, task_score="progress"))
    assert {"move", "rewind"} <= set(reward), "the noisy oracle should fail whole groups and rewind in them"
    assert reward["rewind"] > 0 > reward["move"]
    assert progress["move"] > 0 > progress["rewind"]


def test_config_selects_the_score_and_rejects_unknown_values(archive):
    assert config_lib.load(None).learn.task_score == "progress"  # the library: our reading of the paper
    cfg = config_lib.load("configs/demo.yaml")  # the demo keeps the reward (measured, ours)
    assert cfg.learn.task_score == "reward"
    kw = dict(lambda_state=cfg.learn.lambda_state, gamma=cfg.learn.gamma, eps=cfg.learn.norm_eps,
              invalid_penalty=cfg.learn.invalid_penalty)
    assert advantages_from_config(archive, cfg.learn).macro == compute_advantages(
        archive, task_score="reward", **kw).macro != compute_advantages(archive, **kw).macro
    with pytest.raises(config_lib.ConfigError, match="task_score"):
        config_lib.load("configs/demo.yaml", ["learn.task_score=return"])
    with pytest.raises(ValueError, match="task_score"):
        compute_advantages(archive, task_score="return")


def test_archives_without_progress_fall_back_to_the_reward(archive, tmp_path):
    """An archive saved before segments carried progress loads and scores as under ``reward``."""
    path = tmp_path / "old.jsonl"
    archive.save(path)
    old = Archive.load(path)
    for s in old.segments:
        s.progress = None
    for t in old.trials:
        t.final_progress = None
    assert compute_advantages(old, task_score="progress").macro == compute_advantages(
        archive, task_score="reward").macro
    assert Archive.load(path).segments[0].progress == archive.segments[0].progress  # saved and loaded back
