"""``learn.rewind_return`` on trials run through the real loop (noisy oracle, T@3, model rewinds).

``segment`` is the paper's rule (D.5.2: a rewind request has δ = 0 and ends its segment, so its return is 0);
``resumed`` (ours) continues a model rewind's return into the branch it resumes. Moves keep their returns.
"""

from __future__ import annotations

import pytest

from retrojax import config as config_lib
from retrojax.agent.archive import EXECUTION
from retrojax.agent.policies import OraclePolicy
from retrojax.agent.runner import run_trials
from retrojax.learn.advantages import advantages_from_config, compute_advantages


@pytest.fixture(scope="module")
def archive():
    cfg = config_lib.load("configs/sokoban.yaml", ["trial.prompt_style=compact"])
    out, _ = run_trials(cfg, OraclePolicy(0.5), task_ids=range(8), seeds=[3], trials_per_task=4,
                        protocols=["T@3"], split="sokoban-6x6-2:test")
    return out


def _model_rewinds(archive):
    """(rewind call, first decision of the resumed segment) for every model rewind with a resumed decision."""
    decisions = {}
    for c in archive.calls:
        if c.role == EXECUTION:
            decisions.setdefault((c.task, c.trial, c.segment), []).append(c)
    pairs = []
    for rec in archive.recoveries:
        old, new = decisions.get((rec.task, rec.trial, rec.index)), decisions.get(
            (rec.task, rec.trial, rec.resumed_segment))
        if rec.trigger == "model" and old and new:
            old.sort(key=lambda c: (c.position, c.call_index))
            new.sort(key=lambda c: (c.position, c.call_index))
            if old[-1].is_rewind:
                pairs.append((old[-1], new[0]))
    return pairs


def test_a_rewind_is_credited_with_the_branch_it_resumes(archive):
    pairs = _model_rewinds(archive)
    assert len(pairs) >= 5, "the noisy oracle should rewind on its own several times"
    paper = compute_advantages(archive, gamma=0.9)
    ours = compute_advantages(archive, gamma=0.9, rewind_return="resumed")
    for rewind, first in pairs:
        key, nxt = (rewind.task, rewind.trial, rewind.call_index), (first.task, first.trial, first.call_index)
        assert paper.returns[key] == pytest.approx(0.0)
        assert ours.returns[key] == pytest.approx(0.9 * paper.returns[nxt])
    rewinds = {(r.task, r.trial, r.call_index) for r, _ in pairs}
    for key, g in paper.returns.items():
        if key not in rewinds:
            assert ours.returns[key] == g, "only rewinds change"
    # the credit a rewind gets now follows what it led to: a resumed branch that solved beats one that did not
    changed = [k for k in rewinds if ours.returns[k] != paper.returns[k]]
    assert changed and any(ours.of(*k) != paper.of(*k) for k in changed)


def test_config_selects_the_rule_and_rejects_unknown_values(archive):
    cfg = config_lib.load("configs/sokoban.yaml", ["learn.rewind_return=resumed"])
    assert advantages_from_config(archive, cfg.learn).returns == compute_advantages(
        archive, gamma=cfg.learn.gamma, rewind_return="resumed").returns
    with pytest.raises(config_lib.ConfigError, match="rewind_return"):
        config_lib.load("configs/sokoban.yaml", ["learn.rewind_return=bootstrap"])
    with pytest.raises(ValueError, match="rewind_return"):
        compute_advantages(archive, rewind_return="bootstrap")
