"""Prompt templates: every family and style carries the required fields and formats cleanly."""

from __future__ import annotations

import pytest

from retrojax.agent import prompts as P

WORLD_FIELDS = {"sokoban": {"height": 6, "width": 6, "boxes": 2}, "minesweeper": {"height": 6, "width": 6,
                                                                                  "mines": 3}}


@pytest.mark.parametrize("key,style", [(k, s) for k in ("sokoban", "minesweeper") for s in P.STYLES])
def test_required_fields(key, style):
    p = P.get_prompts(key, style)
    world = set(WORLD_FIELDS[key])
    assert set(P.SYSTEM_FIELDS) <= p.fields("system") <= set(P.SYSTEM_FIELDS) | world
    assert p.fields("user") == set(P.USER_FIELDS)
    assert p.fields("memory") == set(P.MEMORY_FIELDS)
    assert p.fields("reflect_known") == set(P.REFLECT_FIELDS)
    assert p.fields("reflect_choose") == set(P.REFLECT_CHOOSE_FIELDS)
    assert set(p.triggers) == set(P.TRIGGERS)
    assert p.fields("rules") <= world

    system = p.system.format(max_calls=60, branch_budget=20, rewind_rules=p.rewind_allowed,
                             **WORLD_FIELDS[key])
    assert "60" in system and "20" in system  # both budgets are stated
    assert "<action>" in system and "rewind to C_j" in system
    assert "rewind" in p.rewind_forbidden.lower()
    user = p.user.format(observation="OBS", calls_used=3, calls_left=57, branch_used=2, branch_left=18,
                         checkpoint=2, targets="C_0, C_1", events="E1", note="NOTE ")
    for piece in ("OBS", "57", "18", "C_0, C_1", "E1", "NOTE"):
        assert piece in user
    fields = dict(rules="R", trigger="T", target=1, checkpoint=4, state_target="ST", state_current="SC",
                  history="H", earlier="EA")
    known = p.reflect_known.format(**fields)
    choose = p.reflect_choose.format(**fields, targets="C_0 to C_3")
    for text in (known, choose):
        assert "<remark>" in text and all(x in text for x in ("ST", "SC", "H", "EA", "T"))
    assert "rewind to C_j" in choose and "C_0 to C_3" in choose
    assert "superseded" not in p.memory  # placement text is neutral; status is shown to reflections
    for trig in p.triggers.values():
        trig.format(target=2)


def test_full_mentions_paper_structure():
    p = P.get_prompts("sokoban", "full")
    text = p.system.lower()
    for needle in ("solvable", "never given back", "gives back", "checkpoint", "only the", "think"):
        assert needle in text, needle


def test_unknown_family_or_style():
    with pytest.raises(ValueError, match="no prompt templates"):
        P.get_prompts("chess")
    with pytest.raises(ValueError, match="style"):
        P.register("x", "verbose", P.get_prompts("sokoban"))
    assert ("sokoban", "compact") in P.registered()
