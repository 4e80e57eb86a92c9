"""``retrojax play sokoban``: a person plays a registered level in the terminal.

Each line is one turn of up to 3 moves (``up,left,left``; also ``u l l`` or ``1 3 3``), ``rewind to C_j``
to restore checkpoint ``C_j`` (``C_0`` is the start; every accepted turn adds one), ``hint`` for the
solver's best next moves, or ``quit``. After each turn the board, reward, path score, checkpoints and the
exact solver distance are shown. Bad input gets a message; end of input ends the game cleanly.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import envs.sokoban as sk
from retrojax.play.session import PlaySession

CAPACITY = 256
MOVES_PER_TURN = 3
_NAMES = {"up": 1, "u": 1, "1": 1, "down": 2, "d": 2, "2": 2, "left": 3, "l": 3, "3": 3,
          "right": 4, "r": 4, "4": 4}
HELP = "moves: up/down/left/right (u/d/l/r), up to 3 per turn, e.g. 'up,left,left'; " \
       "'rewind to C_j'; 'hint'; 'quit'"


def parse_moves(text: str) -> list[int]:
    """Move codes from ``up,left,left``-style text; raises ``ValueError`` with a reason."""
    words = [w for w in re.split(r"[\s,;]+", text.strip().lower()) if w]
    if not words:
        raise ValueError("no moves given")
    bad = [w for w in words if w not in _NAMES]
    if bad:
        raise ValueError(f"unknown move(s) {', '.join(bad)}")
    if len(words) > MOVES_PER_TURN:
        raise ValueError(f"at most {MOVES_PER_TURN} moves per turn, got {len(words)}")
    return [_NAMES[w] for w in words]


def _distance_text(d: int) -> str:
    return "solved" if d == 0 else ("dead (no solution from here)" if d < 0 else f"{d} moves to solve")


def _show(state: sk.State, scores: list[float], out) -> None:
    print(sk.render(state), file=out)
    k = len(scores) - 1
    solver = _distance_text(int(state.distance))
    print(f"checkpoints: C_0 … C_{k}   score S = {scores[-1]:+.1f}   solver: {solver}", file=out)


def main(args: argparse.Namespace, stdin=None, out=None) -> int:
    """Interactive loop; returns 0 on quit or end of input, 2 when the split or index is invalid."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    try:
        bank = sk.load_split(args.split)
        state = sk.init(bank, args.index)
    except (ValueError, KeyError, IndexError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    step = jax.jit(sk.step)
    best = jax.jit(sk.optimal_moves)
    print(f"Sokoban {args.split} #{args.index}: shortest solution {int(state.distance)} moves.", file=out)
    print(HELP, file=out)
    game = PlaySession(state, CAPACITY, _show, out)

    def handle(cmd: str, line: str) -> None:
        state = game.state
        if cmd in ("help", "?"):
            game.say(HELP)
            return
        if cmd == "hint":
            options = np.flatnonzero(np.asarray(best(state))) + 1
            names = [sk.MOVE_NAMES[m] for m in options]
            game.say(f"best next move(s): {', '.join(names) or 'none (solved or dead)'}")
            return
        try:
            moves = parse_moves(cmd)
        except ValueError as err:
            game.say(f"could not read {line!r}: {err}. {HELP}")
            return
        if bool(state.solved) or bool(state.dead):
            game.say("this branch is over: 'rewind to C_j' or 'quit'")
            return
        padded = jnp.asarray(moves + [0] * (MOVES_PER_TURN - len(moves)), jnp.int32)
        new, outcome = step(state, padded)
        if not game.advance(new, float(outcome.reward)):
            return
        game.say(f"reward {float(outcome.reward):+.1f}, {int(outcome.moves_applied)}/{len(moves)} move(s) "
                 f"changed the room, boxes on target {int(outcome.boxes_on_target)}")
        if bool(outcome.solved):
            game.say("all boxes are on targets: solved!")
        elif bool(outcome.dead):
            game.say("dead end: no sequence of moves can solve this any more. 'rewind to C_j' to recover.")
        _show(game.state, game.scores, out)

    return game.run(stdin, handle)
