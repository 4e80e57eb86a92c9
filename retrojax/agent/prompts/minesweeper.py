"""MineSweeper templates (full and compact). World fields: ``height``, ``width``, ``mines``."""

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
    "MineSweeper on a {height}x{width} board with {mines} hidden mines. Rows and columns are numbered from "
    "1. Symbols: ? hidden, . open with no mine around it, 1-8 open with that many mines among its eight "
    "neighbours, * a mine that was opened. Revealing a hidden cell opens it; an empty cell also opens its "
    "neighbourhood. Revealing a mine loses the attempt; revealing an open cell wastes the turn."
)

_TRIGGERS = triggers(
    failure="Your last reveal hit a mine.",
    branch_budget="You used the whole branch budget on this path without clearing the board.",
)

_REWIND_ALLOWED = (
    "Checkpoints: C_0 is the start and C_i the board after your i-th executed turn on the current path. "
    "Instead of revealing you may reply <action>rewind to C_j</action> for any earlier checkpoint j listed "
    "as a valid target. The board returns exactly to C_j, but what you learned comes with you: you first "
    "write a short memory of the abandoned branch, and it is shown to you from C_j on. Rewind when the "
    "branch went wrong (a guess you regret, wasted turns); it costs calls, so do not rewind for nothing. "
    "After a mine you may be sent back automatically."
)

_REWIND_FORBIDDEN = (
    "In this game there are no rewinds: every reveal is final, so only open cells you can prove safe."
)

SYSTEM_FULL = (
    "You are an agent playing MineSweeper by choosing cells to reveal.\n\n"
    "Rules. " + _RULES + "\n\n"
    "Goal. Open every cell that is not a mine. The board can be cleared by logic alone, without guessing.\n\n"
    + budgets_full("reveals") +
    "{rewind_rules}\n\n"
    "Reply format. Reason from the numbers first, then end with exactly one action tag naming one cell as "
    "(row, col), for example <action>(2, 3)</action>. Only the last action tag in your reply counts."
)

USER_FULL = user_full("Current board (checkpoint C_{checkpoint})", "Which cell do you reveal?")

REFLECTIONS_FULL = reflections_full(
    attempt="a MineSweeper attempt", world="the board", undone="reveals", view="Board",
    item="action", avoid="which cells to avoid or to trust from C_{target}",
)

SYSTEM_COMPACT = (
    "Play MineSweeper ({height}x{width}, {mines} mines). ? hidden, . empty, 1-8 mine count, * mine. "
    "Rows/cols from 1. A mine loses; logic suffices.\n"
    + COMPACT_BUDGET +
    "End with one tag: <action>(row, col)</action>."
)

register("minesweeper", "full", full_set(
    system=SYSTEM_FULL, user=USER_FULL, reflections=REFLECTIONS_FULL, rules=_RULES,
    rewind_allowed=_REWIND_ALLOWED, rewind_forbidden=_REWIND_FORBIDDEN, triggers=_TRIGGERS,
))
register("minesweeper", "compact", compact_set(
    system=SYSTEM_COMPACT,
    rules="Reveal safe cells; numbers count adjacent mines; a mine loses.",
    rewind_forbidden="No rewinds: every reveal is final.", triggers=_TRIGGERS, target_label="Latest safe",
))
