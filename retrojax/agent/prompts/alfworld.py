"""ALFWorld templates (full and compact). World field: ``goal`` ("Your task is to: …").

The agent answers with a fenced block::

    ```action
    go to countertop 1
    ```

The observation block of each user turn carries the engine's text and the admissible commands.
"""

from __future__ import annotations

from retrojax.agent.prompts import MEMORY, PromptSet, compact_set, register

_COMMANDS = (
    "go to <receptacle>; open <receptacle>; close <receptacle>; take <object> from <receptacle>; "
    "move <object> to <receptacle>; heat <object> with microwave; cool <object> with fridge; "
    "clean <object> with sinkbasin; use <lamp>; examine <object or receptacle>; look; inventory"
)

_RULES = (
    "ALFWorld is a text household: a room with numbered receptacles (cabinet 1, countertop 2, fridge 1, "
    "…) holding numbered objects. You carry at most one object. Household commands: " + _COMMANDS + ". "
    "Closed receptacles must be opened to see or take what is inside. Only the commands listed as "
    "admissible in the observation do something; anything else answers 'Nothing happens.'. "
    "{goal}"
)

_TRIGGERS = {
    "model": "You asked to go back to checkpoint C_{target}.",
    "failure": "The episode ended on this path without the task done.",
    "branch_budget": "You used the whole branch budget on this path without finishing the task.",
    "truncated": "Your last reply was cut off at the length limit before it finished.",
}

_REWIND_ALLOWED = (
    "Checkpoints: C_0 is the start and C_i the state after your i-th executed command on the current "
    "path. Instead of a command you may answer with the block\n```action\nrewind to C_j\n```\nfor an "
    "earlier checkpoint j listed as a valid target. The household is put back exactly as it was at C_j; "
    "what you learned stays with you, because you first write a short memory of the abandoned branch "
    "that you will see from C_j on. Rewind when the path went wrong (searched the wrong places, took the "
    "wrong object, wasted turns); it costs replies, so do not rewind without a reason."
)

_REWIND_FORBIDDEN = "There are no rewinds here: every command is final, so check before you act."

SYSTEM_FULL = (
    "You are an agent doing a household task in ALFWorld by typing commands.\n\n"
    "Rules. " + _RULES + "\n\n"
    "Goal. {goal} The task can be completed from the start.\n\n"
    "Budgets. You have {max_calls} replies in total (commands, rewinds and memory reflections all count; "
    "they are never given back). On the current path you may take at most {branch_budget} turns; going "
    "back to a checkpoint gives back the turns taken after it.\n\n"
    "{rewind_rules}\n\n"
    "Reply format. Reason briefly about where the needed objects may be, then end with exactly one "
    "fenced block holding one admissible command, for example\n```action\ngo to countertop 1\n```\n"
    "Only the last such block in your reply counts."
)

USER_FULL = (
    "Observation at checkpoint C_{checkpoint}:\n{observation}\n\n"
    "Replies used {calls_used}, left {calls_left}. "
    "Turns on this path used {branch_used}, left {branch_left}.\n"
    "Valid rewind targets: {targets}.\n"
    "Recent turns on this path:\n{events}\n"
    "{note}"
    "Your command?"
)


_REFLECT_BODY = (
    "You are reviewing an ALFWorld attempt before going back.\n\nRules. {rules}\n\n"
    "How going back works: the household returns to checkpoint C_{target} exactly as it was; every "
    "command after it is undone. What you write now is all you keep from the abandoned branch.\n\n"
    "Why: {trigger}\n\n"
    "Observation at C_{target}:\n{state_target}\n\nObservation now (C_{checkpoint}):\n{state_current}\n\n"
    "Branch from C_{target} to C_{checkpoint} (command → outcome):\n{history}\n\n"
    "Earlier memories:\n{earlier}\n\n"
)

REFLECT_KNOWN_FULL = _REFLECT_BODY + (
    "Write a compact memory inside <remark>…</remark>: what you did, what went wrong, which commands to "
    "avoid from C_{target}, where things are, and your plan from C_{target}."
)

REFLECT_CHOOSE_FULL = _REFLECT_BODY.replace(
    "the household returns to checkpoint C_{target}", "the household returns to the checkpoint you choose"
).replace(
    "Observation at C_{target}", "Observation at C_{target} (the latest checkpoint before the trigger)"
) + (
    "Choose where to go back to among {targets}. Write a compact memory inside <remark>…</remark> (what "
    "you did, what went wrong, where things are, your plan from the chosen checkpoint), then end with "
    "the block\n```action\nrewind to C_j\n```\nfor your chosen j."
)

SYSTEM_COMPACT = (
    "ALFWorld household task. {goal}\nCommands: " + _COMMANDS + ". Only admissible commands work. "
    "Carry one object at a time.\n"
    "Budget: {max_calls} replies total, never refunded; {branch_budget} turns per path, refunded by "
    "rewinds.\n{rewind_rules}\n"
    "End with one block:\n```action\ngo to countertop 1\n```"
)

register("alfworld", "full", PromptSet(
    system=SYSTEM_FULL, user=USER_FULL, memory=MEMORY, reflect_known=REFLECT_KNOWN_FULL,
    reflect_choose=REFLECT_CHOOSE_FULL, rules=_RULES, rewind_allowed=_REWIND_ALLOWED,
    rewind_forbidden=_REWIND_FORBIDDEN, triggers=_TRIGGERS,
))
register("alfworld", "compact", compact_set(
    system=SYSTEM_COMPACT,
    rules="Household commands on numbered receptacles and objects; only admissible commands work. {goal}",
    rewind_forbidden="No rewinds: every command is final.", triggers=_TRIGGERS, action_style="fence",
))
