"""``--policy notes``: Sokoban's push notes followed to the letter, through the real trial loop."""

from __future__ import annotations

import pytest

from retrojax import config as config_lib
from retrojax.eval.protocol import evaluate, make_policy


def _cfg(notes: bool):
    return config_lib.load("configs/demo.yaml", [f"env.push_notes={str(notes).lower()}"])


def test_the_notes_policy_solves_rooms_the_random_policy_does_not():
    """The baseline a notes-reading model must beat: far above random play on the same rooms and seeds."""
    cfg = _cfg(True)
    split = "sokoban-5x5-1:test"
    notes = evaluate(cfg, make_policy("notes", cfg), split, ["T@3"], seeds=1, tasks=16, trials_per_task=1)
    rand = evaluate(cfg, make_policy("random", cfg), split, ["T@3"], seeds=1, tasks=16, trials_per_task=1)
    ok, chance = notes["results"]["T@3"], rand["results"]["T@3"]
    assert ok["invalid_turns"] == 0.0  # every reply is a well-formed move the world accepts
    assert ok["success"] >= 0.5, ok["success"]
    assert ok["success"] > chance["success"] + 0.25, (ok["success"], chance["success"])


def test_the_notes_policy_needs_the_notes():
    cfg = _cfg(False)
    with pytest.raises(ValueError, match="env.push_notes=true"):
        evaluate(cfg, make_policy("notes", cfg), "sokoban-5x5-1:test", ["T@3"], seeds=1, tasks=2,
                 trials_per_task=1)
