"""``retrojax play minesweeper``: a person plays a registered board in the terminal.

Type a cell as ``(row,col)`` or ``row,col`` (1-indexed, as in the rendered rows), ``rewind to C_j`` to
restore checkpoint ``C_j`` (``C_0`` is the first observation; every reveal adds one), or ``quit``.
The score ``S`` is the sum of rewards along the retained path; a rewind restores it with the state.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from envs.minesweeper import deduce, init, is_lost, is_won, load_split, render, step
from retrojax.play.session import PlaySession

CAPACITY = 128
_CELL = re.compile(r"^\(?\s*(-?\d+)\s*[, ]\s*(-?\d+)\s*\)?$")


def _show(state, scores: list[float], out) -> None:
    print(render(state), file=out)
    k = len(scores) - 1
    print(f"checkpoints: C_0 … C_{k}   score S = {scores[-1]:+.1f}", file=out)


def main(args: argparse.Namespace, stdin=None, out=None) -> int:
    """Interactive loop; returns 0 on quit or end of input, 2 when the split or index is invalid."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    try:
        bank = load_split(args.split)
        board = bank[args.index]
    except (ValueError, IndexError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = init(board)
    h, w = state.board.shape
    num_mines = int(jnp.sum(board.mines))
    step_fn = jax.jit(step)
    print(f"MineSweeper {args.split} #{args.index}: {h}x{w}, {num_mines} mines, "
          f"reference solution {int(board.solution_length)} reveals.", file=out)
    print("Reveal with (row,col), 1-indexed; 'rewind to C_j'; 'hint'; 'quit'.", file=out)
    game = PlaySession(state, CAPACITY, _show, out)

    def handle(cmd: str, line: str) -> None:
        state = game.state
        if cmd == "hint":
            safe, mine = deduce(state)
            cells = [f"({r + 1},{c + 1})" for r, c in zip(*safe.nonzero(), strict=True)]
            hidden_mines = mine & ~np.asarray(state.revealed)
            mines = [f"({r + 1},{c + 1})" for r, c in zip(*hidden_mines.nonzero(), strict=True)]
            game.say(f"provably safe: {' '.join(cells) or 'none'}; "
                     f"provably mines: {' '.join(mines) or 'none'}")
            return
        m = _CELL.match(cmd)
        if not m:
            game.say(f"could not read {line!r}: type (row,col), 'rewind to C_j', 'hint' or 'quit'")
            return
        row, col = int(m.group(1)), int(m.group(2))
        if bool(is_lost(state) | is_won(state)):
            game.say("this branch is over: 'rewind to C_j' or 'quit'")
            return
        if not (1 <= row <= h and 1 <= col <= w):
            game.say(f"({row},{col}) is off the board (rows 1-{h}, columns 1-{w}): "
                     "counted as a wasted reveal")
        new, outcome = step_fn(state, jnp.array([row - 1, col - 1], jnp.int32))
        if not game.advance(new, float(outcome.reward)):
            return
        game.say(f"reward {float(outcome.reward):+.1f}, opened {int(outcome.cells_opened)} cell(s)")
        if bool(outcome.won):
            game.say("all safe cells are open: you won!")
        elif bool(outcome.lost):
            game.say("that was a mine: this branch failed. 'rewind to C_j' to try again.")
        _show(game.state, game.scores, out)

    return game.run(stdin, handle)
