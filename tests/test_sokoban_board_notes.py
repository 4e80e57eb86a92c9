"""env.board_notes (ours): the line under the grid names each box's place from you and its nearest target."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.sokoban.text import BOX, FLOOR, PLAYER, TARGET, WALL, board_notes, parse_board
from retrojax import config
from retrojax.agent.env_api import make_env


def test_notes_of_a_known_room():
    board = parse_board("#####\n#O__#\n#_XP#\n#___#\n#####")
    assert board_notes(board) == "box r2 c2: left of you; nearest target r1 c1: up-left of the box"
    solved = parse_board("#####\n#√_P#\n#___#\n#####")
    assert board_notes(solved) == "every box is on a target"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_directions_follow_the_coordinates(data):
    h, w = 6, 6
    cells = [(r, c) for r in range(1, h - 1) for c in range(1, w - 1)]
    picks = data.draw(st.lists(st.sampled_from(cells), min_size=3, max_size=3, unique=True))
    board = np.full((h, w), WALL, np.int8)
    board[1:-1, 1:-1] = FLOOR
    (pr, pc), (br, bc), (tr, tc) = picks
    board[pr, pc], board[br, bc], board[tr, tc] = PLAYER, BOX, TARGET
    m = re.fullmatch(r"box r(\d) c(\d): ([a-z-]+) of you; nearest target r(\d) c(\d): ([a-z-]+) of the box",
                     board_notes(board))
    assert m is not None
    assert (int(m[1]), int(m[2]), int(m[4]), int(m[5])) == (br, bc, tr, tc)
    for word, dr, dc in ((m[3], br - pr, bc - pc), (m[6], tr - br, tc - bc)):
        assert ("up" in word) == (dr < 0) and ("down" in word) == (dr > 0)
        assert ("left" in word) == (dc < 0) and ("right" in word) == (dc > 0)


def test_the_env_adds_the_notes_only_when_asked():
    for notes in (False, True):
        cfg = config.load("configs/demo.yaml", [f"env.board_notes={str(notes).lower()}"])
        env = make_env(cfg, "sokoban-5x5-1:train")
        try:
            env.open(1, 2)
            env.reset([0], [0])
            text = env.observations([0])[0]
        finally:
            env.close()
        assert text.startswith("0: # # # # #") and ("box r2 c2: left of you" in text) == notes


def test_other_worlds_reject_the_option():
    cfg = config.load(None, ["env.name=minesweeper", "env.board_notes=true"])
    with pytest.raises(ValueError, match="board_notes"):
        make_env(cfg)


def test_only_the_tiny_demo_model_reads_notes():
    """The notes are ours, for the demo's 2-layer model; every config for a real model keeps the paper's
    prompt (no notes), and the demo's config turns them on."""
    from pathlib import Path

    assert config.load("configs/demo.yaml").env.board_notes
    for path in sorted(Path("configs").rglob("*.yaml")):
        if path.name == "demo.yaml":
            continue
        cfg = config.load(str(path))
        assert not cfg.env.board_notes, path
