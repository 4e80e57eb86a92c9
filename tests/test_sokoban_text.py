"""parse/render: accepted forms, round trips and clear errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs.sokoban as sk
from envs.sokoban.text import SYMBOLS

PREFIXED = """
0: # # # # #
1: # P X O #
2: # _ √ O #
3: # # # # #
"""
COMPACT = "#####\n#PXO#\n#_√O#\n#####"


def test_parse_accepts_prefixes_spaces_or_neither():
    a, b = sk.parse(PREFIXED), sk.parse(COMPACT)
    assert a == b and a.shape == (4, 5) and a.num_boxes == 2
    assert sk.parse("  1:#  P X O #\n\n  2: # # # # #") == sk.parse("#PXO#\n#####")


def test_render_format():
    text = sk.render(sk.parse(COMPACT))
    assert text.splitlines()[1] == "1: # P X O #"
    assert all(re.fullmatch(r"\d+: (\S )*\S", line) for line in text.splitlines())


def test_round_trip_through_init_and_bank():
    level = sk.parse(PREFIXED)
    assert sk.parse(sk.render(sk.init(level))) == level
    bank = sk.bank_from_boards([level.board])
    assert sk.parse(sk.render(sk.init(bank, 0))) == level == bank.level(0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 6), st.data())
def test_render_parse_round_trip_on_random_rooms(h, w, data):
    cells = data.draw(st.lists(st.sampled_from("#_O"), min_size=h * w, max_size=h * w))
    spot = st.integers(0, h * w - 1)
    spots = data.draw(st.lists(spot, min_size=2, max_size=min(4, h * w), unique=True))
    for i in spots[1:]:
        cells[i] = data.draw(st.sampled_from("X√"))
    cells[spots[0]] = data.draw(st.sampled_from("PS"))
    text = "\n".join(" ".join(cells[r * w:(r + 1) * w]) for r in range(h))
    level = sk.parse(text)
    assert sk.render(level) == "\n".join(f"{r}: {line}" for r, line in enumerate(text.splitlines()))
    assert sk.parse(sk.render(level)) == level
    assert np.array_equal(level.board.reshape(-1), [SYMBOLS.index(c) for c in cells])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("#P#\n#X?", "unknown symbol"),
        ("#P#\n#X", "different lengths"),
        ("#X#\n#O#", "exactly one player"),
        ("#PS\n#XO", "exactly one player"),
        ("#P#\n#O#", "at least one box"),
        ("\n  \n", "empty room"),
        ("\n".join(["P" + "X" * 5 + "_" * 94] + ["_" * 100] * 99), "too large"),
        ("P" + "X" * 30 + "O" * 30 + "_" * 39, "too large"),  # 100 cells, 30 boxes: key overflows int32
    ],
)
def test_bad_text_gets_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        sk.parse(text)


def test_wrong_types_are_clear_errors():
    with pytest.raises(TypeError):
        sk.parse(123)
    with pytest.raises(TypeError):
        sk.render("not a state")
