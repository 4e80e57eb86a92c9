"""Jittable MineSweeper: cascade reveal, no-guess boards, exact deduction.

- ``rules``: ``State``/``Outcome``/``Board``, ``init``, ``step`` (rewards, cascade by table or flood fill).
- ``boards``: ``generate``, ``BoardBank``, ``init_batch(bank, indices)``,
  ``load_split('NAME:train|test|val')``.
- ``deduce``: ``deduce(state) -> (safe, mine)`` masks, ``solve_plan`` (reference solution length),
  ``safe_reveal`` (a provably-safe cell for the oracle policy). Host-side numpy.
- ``text``: ``render(state)`` / ``parse(text, mines)``.

``init`` and ``step`` are exported already wrapped in ``jax.jit`` (so host-side calls compile once per
board shape, and once per bank for bank states, whose cascade table is static); they compose with
``vmap``, ``scan`` and an outer ``jit`` like the plain functions in ``rules``. Progress for the learner
uses the rewards directly: a branch's score ``V`` from checkpoint ``C_j`` is the sum of its rewards after
``C_j``, and the endpoint score ``S`` is the sum of rewards along the retained path from ``C_0``
(restoring a checkpoint restores it).
"""

import jax

from envs.minesweeper import rules as _rules
from envs.minesweeper.boards import SPLITS, BoardBank, generate, init_batch, load_split, split_names
from envs.minesweeper.deduce import (
    InconsistentBoardError,
    deduce,
    deduce_visible,
    safe_reveal,
    solve_plan,
)
from envs.minesweeper.rules import Board, Outcome, State, is_lost, is_won
from envs.minesweeper.text import parse, render

init = jax.jit(_rules.init)
step = jax.jit(_rules.step)

__all__ = [
    "SPLITS",
    "Board",
    "BoardBank",
    "InconsistentBoardError",
    "Outcome",
    "State",
    "deduce",
    "deduce_visible",
    "generate",
    "init",
    "init_batch",
    "is_lost",
    "is_won",
    "load_split",
    "parse",
    "render",
    "safe_reveal",
    "solve_plan",
    "split_names",
    "step",
]
