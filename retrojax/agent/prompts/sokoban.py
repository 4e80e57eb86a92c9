"""Sokoban templates (full and compact). World fields: ``height``, ``width``, ``boxes``."""

from __future__ import annotations

from retrojax.agent.prompts import (
    COMPACT_BUDGET,
    budgets_full,
    compact_set,
    full_set,
    reflections_full,
    register,
    triggers,
    user_full,
)

_RULES = (
    "Sokoban on a {height}x{width} grid, rows numbered from 0 at the top. Symbols: # wall, _ floor, "
    "O target, X box, √ box on a target, P you, S you standing on a target. A move (up, down, left, right) "
    "walks one cell; walking into a box pushes it one cell if the cell behind it is free; walls and a "
    "second box block. You cannot pull boxes. The puzzle is solved when all {boxes} boxes are on targets. "
    "A box pushed into a corner or against a wall with no target along it can never be moved back: such a "
    "state is dead and the attempt is lost."
)

_TRIGGERS = triggers(
    failure="Your last turn left the puzzle unsolvable (a box can no longer reach a target).",
    branch_budget="You used the whole branch budget on this path without solving the puzzle.",
)

_REWIND_ALLOWED = (
    "Checkpoints: C_0 is the start and C_i the state after your i-th executed turn on the current path. "
    "Instead of moving you may reply <action>rewind to C_j</action> for any earlier checkpoint j listed "
    "as a valid target. The world returns exactly to C_j, but what you learned comes with you: you first "
    "write a short memory of the abandoned branch, and it is shown to you from C_j on. Rewind when the "
    "path has gone wrong (a box stuck, moves wasted walking away from the plan); it costs calls, so do "
    "not rewind for nothing. You may also be sent back automatically after a dead state."
)

_REWIND_FORBIDDEN = "In this game there are no rewinds: every move is final, so think before you push."

SYSTEM_FULL = (
    "You are an agent solving a Sokoban puzzle by choosing moves.\n\n"
    "Rules. " + _RULES + "\n\n"
    "Goal. Put every box on a target. The puzzle is solvable from the start.\n\n"
    + budgets_full("moves") +
    "{rewind_rules}\n\n"
    "Reply format. Think briefly about the board, then end with exactly one action tag, for example "
    "<action>up, up, left</action>: one to three moves separated by commas, executed in order. Only the "
    "last action tag in your reply counts."
)

USER_FULL = user_full("Current board (checkpoint C_{checkpoint})", "Your move?")

REFLECTIONS_FULL = reflections_full(
    attempt="a Sokoban attempt", world="the board", undone="moves", view="Board",
    item="action", avoid="which moves to avoid from C_{target}",
)

SYSTEM_COMPACT = (
    "Solve Sokoban ({height}x{width}, {boxes} boxes). # wall, _ floor, O target, X box, √ box on target, "
    "P you, S you on target. Moves up/down/left/right push boxes; no pulling; a stuck box loses. Solvable.\n"
    + COMPACT_BUDGET +
    "End with one tag: <action>up, left</action> (1-3 moves)."
)

register("sokoban", "full", full_set(
    system=SYSTEM_FULL, user=USER_FULL, reflections=REFLECTIONS_FULL, rules=_RULES,
    rewind_allowed=_REWIND_ALLOWED, rewind_forbidden=_REWIND_FORBIDDEN, triggers=_TRIGGERS,
))
register("sokoban", "compact", compact_set(
    system=SYSTEM_COMPACT,
    rules="Moves push boxes; no pulling; all boxes on targets wins; a stuck box loses.",
    rewind_forbidden="No rewinds: every move is final.", triggers=_TRIGGERS, target_label="Latest safe",
))
