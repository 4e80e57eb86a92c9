"""Split parts are disjoint by room: Sokoban by walls, boxes and targets (not the player's square),
MineSweeper by mine layout (not the first click); test and validation rooms are distinct within a part.

Every registered size is checked with its own seeds, shapes and solution lengths at small counts (in a
temporary cache), so the rule is exercised everywhere without generating the full banks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import envs.minesweeper as ms
import envs.sokoban as sk
from envs.minesweeper import boards
from envs.sokoban import levels
from envs.sokoban.text import BOX, FLOOR, PLAYER, TARGET, WALL


def _assert_disjoint(parts: dict[str, list[bytes]]) -> None:
    for part in ("test", "val"):
        assert len(set(parts[part])) == len(parts[part]), f"{part} repeats a room"
    names = list(parts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not set(parts[a]) & set(parts[b]), f"{a} and {b} share a room"


def _sokoban_rooms(name: str, cache) -> dict[str, list[bytes]]:
    banks = {part: np.asarray(sk.load_split(f"{name}:{part}", cache).boards) for part in levels.PARTS}
    return {part: [levels.canonical_room(b) for b in bank] for part, bank in banks.items()}


@pytest.mark.parametrize("name", sorted(levels.SPLITS))
def test_sokoban_parts_share_no_room(name, tmp_path, monkeypatch):
    spec = dataclasses.replace(levels.SPLITS[name], n_train=5, n_test=3, n_val=2)
    monkeypatch.setitem(levels.SPLITS, name, spec)
    monkeypatch.setattr(levels, "_LOADED", {})
    rooms = _sokoban_rooms(name, tmp_path)
    assert [len(rooms[p]) for p in levels.PARTS] == [5, 3, 2]
    _assert_disjoint(rooms)


def test_sokoban_test_rooms_that_repeat_training_rooms_are_replaced_in_place(tmp_path, monkeypatch):
    """On the 5x5 one-box rooms the exact-board rule repeats training rooms with the player elsewhere (the
    flaw the room rule fixes); the room rule keeps every other test board in its place."""
    name = "sokoban-5x5-1"
    spec = dataclasses.replace(levels.SPLITS[name], n_train=48, n_test=24, n_val=8)
    monkeypatch.setitem(levels.SPLITS, name, spec)
    monkeypatch.setattr(levels, "_LOADED", {})
    train = np.asarray(sk.load_split(f"{name}:train", tmp_path).boards)
    test = np.asarray(sk.load_split(f"{name}:test", tmp_path).boards)
    old = levels.generate_boards(spec.test_seed, spec.n_test, spec.dim, spec.num_boxes, spec.min_solution,
                                 spec.max_solution, exclude={b.tobytes() for b in train})
    train_rooms = {levels.canonical_room(b) for b in train}
    repeats = [i for i, b in enumerate(old) if levels.canonical_room(b) in train_rooms]
    assert repeats, "the exact-board rule should repeat a training room here"
    assert len(test) == spec.n_test and not {levels.canonical_room(b) for b in test} & train_rooms
    seen: set[bytes] = set()
    for i, b in enumerate(old):
        room = levels.canonical_room(b)
        if room not in train_rooms and room not in seen:
            assert np.array_equal(test[i], b), f"test board {i} moved"
        seen.add(room)
    _assert_disjoint(_sokoban_rooms(name, tmp_path))


def test_canonical_room_ignores_only_the_player():
    board = np.full((5, 5), WALL, np.int8)
    board[1:4, 1:4] = FLOOR
    board[1, 1], board[2, 2], board[3, 3] = TARGET, BOX, PLAYER
    moved = board.copy()
    moved[3, 3], moved[3, 2] = FLOOR, PLAYER
    assert levels.canonical_room(board) == levels.canonical_room(moved)
    pushed = board.copy()
    pushed[2, 2], pushed[2, 3] = FLOOR, BOX
    assert levels.canonical_room(board) != levels.canonical_room(pushed)
    on_target = board.copy()
    on_target[3, 3], on_target[1, 1] = FLOOR, levels.PLAYER_T
    assert levels.canonical_room(board) == levels.canonical_room(on_target)


@pytest.mark.parametrize("name", sorted(boards.SPLITS))
def test_minesweeper_parts_share_no_layout(name, tmp_path, monkeypatch):
    spec = dataclasses.replace(boards.SPLITS[name], train_n=5, test_n=3, val_n=2)
    monkeypatch.setitem(boards.SPLITS, name, spec)
    layouts = {part: [boards.layout_key(m) for m in ms.load_split(f"{name}:{part}", tmp_path).mines]
               for part in boards.PARTS}
    assert [len(layouts[p]) for p in boards.PARTS] == [5, 3, 2]
    _assert_disjoint(layouts)


def test_minesweeper_layout_exclusion_keeps_other_boards_in_place():
    """A layout seen under another first click is a seen board: it leaves its place, the rest stay."""
    train = ms.generate(11, 40, size=6, num_mines=3)
    old = ms.generate(12, 24, size=6, num_mines=3, exclude=train)
    taken = {boards.layout_key(m) for m in old.mines[:6]}  # pretend six of them are training layouts
    new = ms.generate(12, 24, size=6, num_mines=3, exclude=train, exclude_layouts=taken, stable_slots=True)
    assert not taken & {boards.layout_key(m) for m in new.mines}
    np.testing.assert_array_equal(new.mines[6:], old.mines[6:])
    np.testing.assert_array_equal(new.first_click[6:], old.first_click[6:])


def test_val_is_a_registered_part():
    assert {"sokoban-5x5-1:val", "sokoban-6x6-2:val"} <= set(levels.split_names())
    assert {"minesweeper-6x6-3:val", "minesweeper-8x8-8:val"} <= set(ms.split_names())
    with pytest.raises(ValueError, match="val"):
        sk.load_split("sokoban-6x6-2:dev")


def test_eval_cli_reads_the_val_part(tmp_path, monkeypatch):
    import json

    from retrojax import cli

    spec = dataclasses.replace(boards.SPLITS["minesweeper-6x6-3"], train_n=4, test_n=2, val_n=2)
    monkeypatch.setitem(boards.SPLITS, "minesweeper-6x6-3", spec)
    monkeypatch.setenv("RETROJAX_CACHE", str(tmp_path))
    out = tmp_path / "eval.json"
    code = cli.main(["eval", "--config", "configs/minesweeper.yaml", "--policy", "oracle:0.3", "--protocol",
                     "T@1", "--split", "minesweeper-6x6-3:val", "--seeds", "1",
                     "--set", "trial.trials_per_task=1", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["split"] == "minesweeper-6x6-3:val"
    assert report["results"]["T@1"]["n"] == 2 and report["results"]["T@1"]["rooms"] == 2


def test_training_evaluates_the_part_env_split_names():
    from retrojax import config
    from retrojax.learn.collect import held_out_part

    for split, part in [("sokoban-5x5-1", "test"), ("sokoban-5x5-1:train", "test"),
                        ("sokoban-5x5-1:val", "val"), ("sokoban-5x5-1:test", "test")]:
        assert held_out_part(config.load(None, [f"env.split={split}"])) == part
