"""Parser: final action tag, rewinds, Sokoban moves, MineSweeper cells, remarks — examples and fuzzing."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.agent import parse
from retrojax.agent.env_api import INVALID, MOVE, REWIND


def sok(text: str):
    return parse.parse_output(text, parse.parse_sokoban)


def ms(text: str, h: int = 6, w: int = 6):
    return parse.parse_output(text, lambda c: parse.parse_minesweeper(c, h, w))


def test_last_action_tag_counts():
    a = sok("maybe <action>down</action> ... no, better: <action>up, left, left</action>")
    assert a.kind == MOVE and a.text == "up, left, left" and a.code == (0, 2, 2)
    assert sok("<action>left</action> then <action>up").text == "left"  # an unclosed last tag is ignored
    assert sok("<ACTION> Right </Action>").code == (3,)
    assert sok("<action><action>down</action>").text == "down"


def test_sokoban_moves():
    assert sok("<action>up,down , right</action>").code == (0, 1, 3)
    assert sok("<action>up, up, up, up</action>").kind == INVALID
    assert "too many" in sok("<action>up, up, up, up</action>").reason
    assert "unknown move 'jump'" in sok("<action>up, jump</action>").reason
    assert sok("<action>up,,down</action>").kind == INVALID
    assert sok("no tag at all").reason == parse.NO_TAG
    assert sok("<action>   </action>").reason == "the action tag is empty"


def test_rewind_forms():
    for text in ("rewind to C_2", "Rewind to c2", "rewind to 2", "REWIND TO C_ 2.", " rewind  to C_2 "):
        a = sok(f"<action>{text}</action>")
        assert a.kind == REWIND and a.target == 2 and a.text == "rewind to C_2", text
    bad = sok("<action>rewind to the start</action>")
    assert bad.kind == INVALID and "malformed rewind" in bad.reason
    assert ms("<action>rewind to C_0</action>").target == 0


def test_minesweeper_cells():
    a = ms("<action>(2, 3)</action>")
    assert a.kind == MOVE and a.code == (1, 2) and a.text == "(2, 3)"
    assert ms("<action>6,6</action>").code == (5, 5)
    out = ms("<action>(7, 1)</action>")
    assert out.kind == INVALID and "outside the board" in out.reason
    assert ms("<action>(0, 1)</action>").kind == INVALID
    assert ms("<action>(a, 1)</action>").kind == INVALID
    assert ms("<action>(1, 2, 3)</action>").kind == INVALID
    assert ms("<action>(8, 8)</action>", 8, 8).code == (7, 7)


def test_fenced_style():
    text = "I go.\n```action\ntake apple\n```\nthen\n```action\nopen door\n```"
    content = parse.extract_action(text, "fence")
    assert content == "open door"
    assert parse.extract_action("no fence", "fence") is None


def test_remarks_and_clipping():
    assert parse.extract_remark("x <remark> keep this </remark> y") == "keep this"
    assert parse.extract_remark("<remark>a</remark><remark>b") == "b"
    assert parse.extract_remark("nothing") == ""
    assert parse.memory_from_reflection("  no tags here ", 100) == "no tags here"
    assert parse.memory_from_reflection("<remark></remark> whole text", 100) == "<remark></remark> whole text"
    long = "a" * 50 + "TAIL"
    clipped = parse.clip_remark(long, 20)
    assert clipped.startswith(parse.TRUNCATED_MARK) and clipped.endswith("TAIL") and len(clipped) == 20
    assert parse.clip_remark("short", 20) == "short"
    assert len(parse.memory_from_reflection("<remark>" + "z" * 6000 + "</remark>", 4800)) == 4800


# ---- fuzzing: never an exception, every output valid or counted invalid --------------------------

_WORDS = ["up", "down", "left", "right", "UP", "Left", "rewind", "to", "C_", "C", "(", ")", ",", " ", "\n",
          "<action>", "</action>", "<remark>", "</remark>", "0", "1", "2", "3", "6", "7", "99", "-1", "jump",
          "```action\n", "```", "é", "\x00"]
_structured = st.lists(st.sampled_from(_WORDS), max_size=25).map("".join)
_anything = st.text(alphabet=st.characters(codec="utf-8"), max_size=120) | st.text(
    alphabet=string.printable, max_size=120)


def _check(action, h: int, w: int) -> None:
    assert action.kind in (MOVE, REWIND, INVALID)
    if action.kind == INVALID:
        assert action.reason
    elif action.kind == REWIND:
        assert action.target >= 0 and action.text == f"rewind to C_{action.target}"
    else:
        assert action.text and action.code


# Each example carries a batch of texts so that ≥10k cases run with little per-example overhead:
# 800 × 8 structured + 450 × 8 × 2 arbitrary = 13,600 parsed outputs.
@settings(max_examples=800, deadline=None)
@given(texts=st.lists(_structured, min_size=8, max_size=8))
def test_fuzz_structured(texts):
    for text in texts:
        _fuzz_one(text)


def _fuzz_one(text: str) -> None:
    for parser, h, w in ((parse.parse_sokoban, 6, 6), (lambda c: parse.parse_minesweeper(c, 6, 8), 6, 8)):
        a = parse.parse_output(text, parser)
        _check(a, h, w)
        if a.kind == MOVE and parser is parse.parse_sokoban:
            assert 1 <= len(a.code) <= 3 and all(0 <= c < 4 for c in a.code)
            assert sok(f"<action>{a.text}</action>") == a  # canonical text re-parses to the same action
        if a.kind == MOVE and parser is not parse.parse_sokoban:
            assert 0 <= a.code[0] < h and 0 <= a.code[1] < w
    parse.extract_action(text, "fence")
    assert isinstance(parse.memory_from_reflection(text, 40), str)
    assert len(parse.memory_from_reflection(text, 40)) <= 40


@settings(max_examples=450, deadline=None)
@given(texts=st.lists(_anything, min_size=8, max_size=8))
def test_fuzz_arbitrary_text(texts):
    for text in texts:
        for wrapped in (text, f"<action>{text}</action>"):
            _check(sok(wrapped), 6, 6)
            _check(ms(wrapped), 6, 6)


@pytest.mark.parametrize("style", ["tag", "fence"])
def test_format_action_round_trips_and_policies_write_the_worlds_format(style):
    from types import SimpleNamespace

    from retrojax.agent.policies import RandomPolicy

    written = "I think.\n" + parse.format_action("go to desk 1", style)
    assert parse.extract_action(written, style) == "go to desk 1"
    policy = RandomPolicy()
    policy.env = SimpleNamespace(action_style=style)
    assert parse.extract_action(policy.act("rewind to C_0"), style) == "rewind to C_0"
