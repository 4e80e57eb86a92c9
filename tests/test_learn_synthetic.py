"""The synthetic archive builds the context after a recovery as App. D.3 (and the trial loop) does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.agent.archive import EXECUTION, REFLECTION
from retrojax.learn.layout import common_prefix
from retrojax.learn.synthetic import synthetic_archive

TURN = 5


def _archive(seed: int, rewind: str = "path", **sizes):
    kw = dict(tasks=2, trials=3, vocab=50, segments=3, decisions=4, prompt_len=16, turn_len=TURN,
              output_len=6)
    return synthetic_archive(np.random.default_rng(seed), rewind=rewind, **{**kw, **sizes})


def _move_into(calls, ck: int, before: int):
    """The decision of the active path at ``C_ck`` when call ``before`` was made: the latest move there."""
    found = [c for c in calls if c.role == EXECUTION and c.checkpoint == ck and not c.is_rewind
             and c.call_index < before]
    return found[-1]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), decisions=st.integers(1, 5))
def test_resumed_branch_shares_the_context_up_to_the_restored_checkpoint(seed, decisions):
    arch = _archive(seed, decisions=decisions)
    assert arch.recoveries
    for rec in arch.recoveries:
        calls = [c for c in arch.calls if c.trial == rec.trial]
        first = calls[0]
        resumed = next(c for c in calls if c.segment == rec.resumed_segment and c.position == 0)
        j = rec.target
        assert 0 <= j < rec.from_checkpoint and resumed.checkpoint == j
        if j == 0:  # the conversation at C_0: the system prompt alone
            saved = first.prompt_ids[:16]
        else:  # the conversation just after the turn that reached C_j, on the abandoned branch
            into = _move_into(calls, j - 1, rec.reflection_call)
            saved = np.concatenate([into.prompt_ids, into.output_ids])
        assert common_prefix(saved, resumed.prompt_ids) == saved.size  # restored up to C_j ...
        memory = TURN if rec.remark else 0  # ... then the memory turn and the next observation
        assert resumed.prompt_ids.size == saved.size + memory + TURN
        # the abandoned decision at C_j: same state and retained history, so one state-anchored group
        anchor = _move_into(calls, j, rec.reflection_call)
        assert (anchor.state_key, anchor.history_key) == (resumed.state_key, resumed.history_key)
        assert set(rec.abandoned_calls) <= {c.call_index for c in calls if c.checkpoint >= j}
        assert anchor.call_index in rec.abandoned_calls
        # the reflection is its own conversation: no shared prefix with the execution context
        refl = next(c for c in calls if c.call_index == rec.reflection_call)
        assert refl.role == REFLECTION and refl.checkpoint == rec.from_checkpoint


def test_model_rewinds_end_with_the_request_and_forced_ones_after_a_move():
    arch = _archive(3, tasks=3, trials=4)
    triggers = {r.trigger for r in arch.recoveries}
    assert triggers == {"model", "failure"}
    for rec in arch.recoveries:
        seg = next(s for s in arch.segments if s.trial == rec.trial and s.index == rec.index)
        last = next(c for c in arch.calls if c.trial == rec.trial and c.call_index == seg.calls[-1])
        assert seg.end_checkpoint == rec.from_checkpoint
        if rec.trigger == "model":
            assert seg.end_reason == "rewind" and last.is_rewind and last.rewind_target == rec.target
            assert last.reward == 0.0 and seg.end_checkpoint == seg.start_checkpoint + len(seg.calls) - 1
        else:
            assert seg.end_reason == "failure" and not last.is_rewind
            assert seg.end_checkpoint == seg.start_checkpoint + len(seg.calls)


def test_rewind_targets():
    starts = _archive(5, rewind="start")
    for rec in starts.recoveries:
        seg = next(s for s in starts.segments if s.trial == rec.trial and s.index == rec.index)
        assert rec.target == seg.start_checkpoint
    deep = _archive(5, trials=8)
    assert len({r.target for r in deep.recoveries}) > 2  # every checkpoint of the active path is a target
    with pytest.raises(ValueError, match="rewind must be one of"):
        _archive(0, rewind="segment")


def test_a_trial_tree_shares_more_than_the_prompt():
    """Under D.3 the branches of a trial share the C_j prefixes, so the trial's token tree is much smaller
    than its sequences laid end to end (with rewinds to the segment start they would share the prompt)."""
    from retrojax.learn.layout import Trained, unique_tokens

    arch = _archive(11, tasks=1, trials=1, segments=4, decisions=6)
    ends = [c for c in arch.calls if c.role == EXECUTION
            and c.position == max(x.position for x in arch.calls if x.segment == c.segment)]
    items = [Trained(np.concatenate([c.prompt_ids, c.output_ids]), np.array([c.prompt_ids.size]), {})
             for c in ends]  # each segment's last call: its whole context
    total = sum(it.inputs.size for it in items)
    shared_prompt_only = total - (len(items) - 1) * 16
    assert unique_tokens(items) < shared_prompt_only
