"""Sokoban templates (full and compact). World fields: ``height``, ``width``, ``boxes``."""

from __future__ import annotations

from retrojax.agent.prompts import MEMORY, PromptSet, compact_set, register

_RULES = (
    "Sokoban on a {height}x{width} grid, rows numbered from 0 at the top. Symbols: # wall, _ floor, "
    "O target, X box, √ box on a target, P you, S you standing on a target. A move (up, down, left, right) "
    "walks one cell; walking into a box pushes it one cell if the cell behind it is free; walls and a "
    "second box block. You cannot pull boxes. The puzzle is solved when all {boxes} boxes are on targets. "
    "A box pushed into a corner or against a wall with no target along it can never be moved back: such a "
    "state is dead and the attempt is lost."
)

_TRIGGERS = {
    "model": "You asked to go back to checkpoint C_{target}.",
    "failure": "Your last turn left the puzzle unsolvable (a box can no longer reach a target).",
    "branch_budget": "You used the whole branch budget on this path without solving the puzzle.",
    "truncated": "Your last reply was cut off at the length limit before it finished.",
}

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
    "Budgets. You have {max_calls} replies in total (moves, rewinds and memory reflections all count; "
    "they are never given back). On the current path you may take at most {branch_budget} turns; going "
    "back to a checkpoint gives back the turns taken after it.\n\n"
    "{rewind_rules}\n\n"
    "Reply format. Think briefly about the board, then end with exactly one action tag, for example "
    "<action>up, up, left</action>: one to three moves separated by commas, executed in order. Only the "
    "last action tag in your reply counts."
)

USER_FULL = (
    "Current board (checkpoint C_{checkpoint}):\n{observation}\n\n"
    "Replies used {calls_used}, left {calls_left}. "
    "Turns on this path used {branch_used}, left {branch_left}.\n"
    "Valid rewind targets: {targets}.\n"
    "Recent turns on this path:\n{events}\n"
    "{note}"
    "Your move?"
)


_REFLECT_BODY = (
    "You are reviewing a Sokoban attempt before going back.\n\nRules. {rules}\n\n"
    "How going back works: the board returns to checkpoint C_{target}, exactly as it was; the moves after "
    "it are undone. What you write now is the only thing you keep from the abandoned branch.\n\n"
    "Why: {trigger}\n\n"
    "Board at C_{target}:\n{state_target}\n\nBoard now (C_{checkpoint}):\n{state_current}\n\n"
    "Branch from C_{target} to C_{checkpoint} (action → outcome):\n{history}\n\n"
    "Earlier memories:\n{earlier}\n\n"
)

REFLECT_KNOWN_FULL = _REFLECT_BODY + (
    "Write a compact memory inside <remark>…</remark>: what you did, what went wrong, which moves to avoid "
    "from C_{target}, and your plan from C_{target}."
)

REFLECT_CHOOSE_FULL = _REFLECT_BODY.replace(
    "the board returns to checkpoint C_{target}", "the board returns to the checkpoint you choose"
).replace("Board at C_{target}", "Board at C_{target} (the latest checkpoint before the failure)") + (
    "Choose where to go back to among {targets}. Write a compact memory inside <remark>…</remark> (what "
    "you did, what went wrong, what to avoid, your plan from the chosen checkpoint), then end with "
    "<action>rewind to C_j</action> for your chosen j."
)

SYSTEM_COMPACT = (
    "Solve Sokoban ({height}x{width}, {boxes} boxes). # wall, _ floor, O target, X box, √ box on target, "
    "P you, S you on target. Moves up/down/left/right push boxes; no pulling; a stuck box loses. Solvable.\n"
    "Budget: {max_calls} replies total, never refunded; "
    "{branch_budget} turns per path, refunded by rewinds.\n"
    "{rewind_rules}\n"
    "End with one tag: <action>up, left</action> (1-3 moves)."
)

register("sokoban", "full", PromptSet(
    system=SYSTEM_FULL, user=USER_FULL, memory=MEMORY, reflect_known=REFLECT_KNOWN_FULL,
    reflect_choose=REFLECT_CHOOSE_FULL, rules=_RULES, rewind_allowed=_REWIND_ALLOWED,
    rewind_forbidden=_REWIND_FORBIDDEN, triggers=_TRIGGERS,
))
register("sokoban", "compact", compact_set(
    system=SYSTEM_COMPACT,
    rules="Moves push boxes; no pulling; all boxes on targets wins; a stuck box loses.",
    rewind_forbidden="No rewinds: every move is final.", triggers=_TRIGGERS, target_label="Latest safe",
))
