"""MineSweeper templates (full and compact). World fields: ``height``, ``width``, ``mines``."""

from __future__ import annotations

from retrojax.agent.prompts import MEMORY, PromptSet, compact_set, register

_RULES = (
    "MineSweeper on a {height}x{width} board with {mines} hidden mines. Rows and columns are numbered from "
    "1. Symbols: ? hidden, . open with no mine around it, 1-8 open with that many mines among its eight "
    "neighbours, * a mine that was opened. Revealing a hidden cell opens it; an empty cell also opens its "
    "neighbourhood. Revealing a mine loses the attempt; revealing an open cell wastes the turn."
)

_TRIGGERS = {
    "model": "You asked to go back to checkpoint C_{target}.",
    "failure": "Your last reveal hit a mine.",
    "branch_budget": "You used the whole branch budget on this path without clearing the board.",
    "truncated": "Your last reply was cut off at the length limit before it finished.",
}

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
    "Budgets. You have {max_calls} replies in total (reveals, rewinds and memory reflections all count; "
    "they are never given back). On the current path you may take at most {branch_budget} turns; going "
    "back to a checkpoint gives back the turns taken after it.\n\n"
    "{rewind_rules}\n\n"
    "Reply format. Reason from the numbers first, then end with exactly one action tag naming one cell as "
    "(row, col), for example <action>(2, 3)</action>. Only the last action tag in your reply counts."
)

USER_FULL = (
    "Current board (checkpoint C_{checkpoint}):\n{observation}\n\n"
    "Replies used {calls_used}, left {calls_left}. "
    "Turns on this path used {branch_used}, left {branch_left}.\n"
    "Valid rewind targets: {targets}.\n"
    "Recent turns on this path:\n{events}\n"
    "{note}"
    "Which cell do you reveal?"
)


_REFLECT_BODY = (
    "You are reviewing a MineSweeper attempt before going back.\n\nRules. {rules}\n\n"
    "How going back works: the board returns to checkpoint C_{target}, exactly as it was; the reveals after "
    "it are undone. What you write now is the only thing you keep from the abandoned branch.\n\n"
    "Why: {trigger}\n\n"
    "Board at C_{target}:\n{state_target}\n\nBoard now (C_{checkpoint}):\n{state_current}\n\n"
    "Branch from C_{target} to C_{checkpoint} (action → outcome):\n{history}\n\n"
    "Earlier memories:\n{earlier}\n\n"
)

REFLECT_KNOWN_FULL = _REFLECT_BODY + (
    "Write a compact memory inside <remark>…</remark>: what you did, what went wrong, which cells to avoid "
    "or to trust from C_{target}, and your plan from C_{target}."
)

REFLECT_CHOOSE_FULL = _REFLECT_BODY.replace(
    "the board returns to checkpoint C_{target}", "the board returns to the checkpoint you choose"
).replace("Board at C_{target}", "Board at C_{target} (the latest checkpoint before the failure)") + (
    "Choose where to go back to among {targets}. Write a compact memory inside <remark>…</remark> (what "
    "you did, what went wrong, what to avoid, your plan from the chosen checkpoint), then end with "
    "<action>rewind to C_j</action> for your chosen j."
)

SYSTEM_COMPACT = (
    "Play MineSweeper ({height}x{width}, {mines} mines). ? hidden, . empty, 1-8 mine count, * mine. "
    "Rows/cols from 1. A mine loses; logic suffices.\n"
    "Budget: {max_calls} replies total, never refunded; "
    "{branch_budget} turns per path, refunded by rewinds.\n"
    "{rewind_rules}\n"
    "End with one tag: <action>(row, col)</action>."
)

register("minesweeper", "full", PromptSet(
    system=SYSTEM_FULL, user=USER_FULL, memory=MEMORY, reflect_known=REFLECT_KNOWN_FULL,
    reflect_choose=REFLECT_CHOOSE_FULL, rules=_RULES, rewind_allowed=_REWIND_ALLOWED,
    rewind_forbidden=_REWIND_FORBIDDEN, triggers=_TRIGGERS,
))
register("minesweeper", "compact", compact_set(
    system=SYSTEM_COMPACT,
    rules="Reveal safe cells; numbers count adjacent mines; a mine loses.",
    rewind_forbidden="No rewinds: every reveal is final.", triggers=_TRIGGERS, target_label="Latest safe",
))
