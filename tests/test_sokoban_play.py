"""``retrojax play sokoban`` driven through stdin: moves, rewinds, hints, bad input, EOF."""

from __future__ import annotations

import argparse
import io

import pytest

from envs.sokoban import levels
from retrojax.play import sokoban as play


@pytest.fixture()
def tiny_split(tmp_path, monkeypatch):
    monkeypatch.setitem(levels.SPLITS, "sokoban-play-tiny", levels.SplitSpec((5, 5), 1, 2, 12, 31, 32, 3, 2))
    monkeypatch.setenv("RETROJAX_CACHE", str(tmp_path))
    return "sokoban-play-tiny:test"


def run(split: str, text: str, index: int = 0) -> tuple[int, str]:
    out = io.StringIO()
    code = play.main(argparse.Namespace(split=split, index=index), stdin=io.StringIO(text), out=out)
    return code, out.getvalue()


def test_session_with_moves_rewind_hint_and_bad_input(tiny_split):
    code, text = run(tiny_split, "hint\nup, left , 9\nleft\nrewind to C_7\nrewind to C_0\n\nsideways\nquit\n")
    assert code == 0
    assert "best next move(s):" in text
    assert "unknown move(s) 9" in text and "unknown move(s) sideways" in text
    assert "reward -0.1" in text and "checkpoints: C_0 … C_1" in text
    assert "cannot rewind" in text and "rewound to C_0" in text
    assert text.rstrip().endswith("bye")


def test_eof_ends_cleanly_and_bad_split_is_an_error(tiny_split):
    code, text = run(tiny_split, "up,down,up,down\n")
    assert code == 0 and "at most 3 moves" in text and text.rstrip().endswith("bye")
    assert run(tiny_split, "", index=99)[0] == 2
    assert run("no-such-split:test", "")[0] == 2


def test_parse_moves():
    assert play.parse_moves("up,left,left") == [1, 3, 3]
    assert play.parse_moves("u r 2") == [1, 4, 2]
    with pytest.raises(ValueError):
        play.parse_moves("")
