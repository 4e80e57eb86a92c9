"""env.board_notes (ours): the line under the grid names each box's place from you and its nearest target;
both notes options (board, push) reach the observation only when asked, and only in Sokoban."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from sokoban_rooms import one_box_rooms

from envs.sokoban.text import board_notes, parse_board
from retrojax import config
from retrojax.agent.env_api import make_env


def test_notes_of_a_known_room():
    board = parse_board("#####\n#O__#\n#_XP#\n#___#\n#####")
    assert board_notes(board) == "box r2 c2: left of you; nearest target r1 c1: up-left of the box"
    solved = parse_board("#####\n#√_P#\n#___#\n#####")
    assert board_notes(solved) == "every box is on a target"


@settings(max_examples=60, deadline=None)
@given(one_box_rooms())
def test_directions_follow_the_coordinates(room):
    board, ((pr, pc), (br, bc), (tr, tc)) = room
    m = re.fullmatch(r"box r(\d) c(\d): ([a-z-]+) of you; nearest target r(\d) c(\d): ([a-z-]+) of the box",
                     board_notes(board))
    assert m is not None
    assert (int(m[1]), int(m[2]), int(m[4]), int(m[5])) == (br, bc, tr, tc)
    for word, dr, dc in ((m[3], br - pr, bc - pc), (m[6], tr - br, tc - bc)):
        assert ("up" in word) == (dr < 0) and ("down" in word) == (dr > 0)
        assert ("left" in word) == (dc < 0) and ("right" in word) == (dc > 0)


# each notes option (ours) and a line only it writes under the demo split's first training room
OPTIONS = [("board_notes", "box r2 c2: left of you"), ("push_notes", "free moves: ")]


@pytest.mark.parametrize("option,line", OPTIONS)
def test_the_env_adds_the_notes_only_when_asked(option, line):
    for on in (False, True):
        cfg = config.load("configs/demo.yaml", ["env.board_notes=false", f"env.{option}={str(on).lower()}"])
        env = make_env(cfg, "sokoban-5x5-1:train")
        try:
            env.open(1, 2)
            env.reset([0], [0])
            text = env.observations([0])[0]
        finally:
            env.close()
        assert text.startswith("0: # # # # #") and (line in text) == on


@pytest.mark.parametrize("option", [o for o, _ in OPTIONS])
def test_other_worlds_reject_the_option(option):
    cfg = config.load(None, ["env.name=minesweeper", f"env.{option}=true"])
    with pytest.raises(ValueError, match=option):
        make_env(cfg)


def test_only_the_tiny_demo_model_reads_notes():
    """The notes are ours, for the demo's 2-layer model; every config for a real model keeps the paper's
    prompt (no notes), and the demo's config (and configs built on it for the same model, like
    configs/rir_reviewer.yaml) turns them on."""
    from pathlib import Path

    assert config.load("configs/demo.yaml").env.board_notes
    for path in sorted(Path("configs").rglob("*.yaml")):
        cfg = config.load(str(path))
        if cfg.model.preset == "demo" and cfg.model.path is None:
            continue  # the demo's own 2-layer model
        assert not cfg.env.board_notes, path
