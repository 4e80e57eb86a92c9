"""ALFWorld templates (full and compact). World field: ``goal`` ("Your task is to: …").

The agent answers with a fenced block::

    ```action
    go to countertop 1
    ```

The observation block of each user turn carries the engine's text and the admissible commands.
"""

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

_TRIGGERS = triggers(
    failure="The episode ended on this path without the task done.",
    branch_budget="You used the whole branch budget on this path without finishing the task.",
)

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
    + budgets_full("commands") +
    "{rewind_rules}\n\n"
    "Reply format. Reason briefly about where the needed objects may be, then end with exactly one "
    "fenced block holding one admissible command, for example\n```action\ngo to countertop 1\n```\n"
    "Only the last such block in your reply counts."
)

USER_FULL = user_full("Observation at checkpoint C_{checkpoint}", "Your command?")

REFLECTIONS_FULL = reflections_full(
    attempt="an ALFWorld attempt", world="the household", undone="commands", view="Observation",
    item="command", avoid="which commands to avoid from C_{target}, where things are",
    choose_keep="where things are",
    rewind_block="the block\n```action\nrewind to C_j\n```\n",
)

SYSTEM_COMPACT = (
    "ALFWorld household task. {goal}\nCommands: " + _COMMANDS + ". Only admissible commands work. "
    "Carry one object at a time.\n"
    + COMPACT_BUDGET +
    "End with one block:\n```action\ngo to countertop 1\n```"
)

register("alfworld", "full", full_set(
    system=SYSTEM_FULL, user=USER_FULL, reflections=REFLECTIONS_FULL, rules=_RULES,
    rewind_allowed=_REWIND_ALLOWED, rewind_forbidden=_REWIND_FORBIDDEN, triggers=_TRIGGERS,
))
register("alfworld", "compact", compact_set(
    system=SYSTEM_COMPACT,
    rules="Household commands on numbered receptacles and objects; only admissible commands work. {goal}",
    rewind_forbidden="No rewinds: every command is final.", triggers=_TRIGGERS, action_style="fence",
))
