"""ScienceWorld templates (full and compact). World field: ``goal`` (the task description).

The agent answers with ``<action>…</action>``; the observation block of each user turn carries the
engine's text, the score so far and the admissible action templates and objects.
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

_RULES = (
    "ScienceWorld is a text simulation of a house with rooms (kitchen, workshop, greenhouse, outside, …) "
    "and working physics, chemistry and biology. You act with one typed command per turn built from the "
    "action templates listed in each observation, with OBJ replaced by an object name, e.g. 'open door to "
    "kitchen', 'go to kitchen', 'pick up thermometer', 'focus on water', 'wait1'. Doors must be opened "
    "before walking through them. 'focus on X' tells the simulator which object the task is about: focus "
    "only on the object the task names, because focusing on a wrong object can fail the task. When a "
    "command is ambiguous the simulator lists numbered options; answer with the number. The task: {goal} "
    "The score (0 to 100) rises as you complete parts of the task; 100 means done. A negative score "
    "means the task has failed and this path is lost."
)

_TRIGGERS = triggers(
    failure="The task failed on this path (the score went negative).",
    branch_budget="You used the whole branch budget on this path without finishing the task.",
)

_REWIND_ALLOWED = (
    "Checkpoints: C_0 is the start and C_i the state after your i-th executed command on the current "
    "path. Instead of a command you may reply <action>rewind to C_j</action> for an earlier checkpoint j "
    "listed as a valid target. The simulation is put back exactly as it was at C_j; what you learned "
    "stays with you, because you first write a short memory of the abandoned branch that you will see "
    "from C_j on. Rewind when the path went wrong (a wrong focus, an object used up or broken, many turns "
    "without score); it costs replies, so do not rewind without a reason. After a failed task you may "
    "also be sent back automatically."
)

_REWIND_FORBIDDEN = "There are no rewinds here: every command is final, so check before you act."

SYSTEM_FULL = (
    "You are an agent carrying out a science task in ScienceWorld by typing commands.\n\n"
    "Rules. " + _RULES + "\n\n"
    "Goal. {goal} The task can be completed from the start.\n\n"
    + budgets_full("commands") +
    "{rewind_rules}\n\n"
    "Reply format. Reason briefly about what the task still needs, then end with exactly one action tag "
    "holding one command, for example <action>open door to kitchen</action>. Only the last action tag "
    "in your reply counts."
)

USER_FULL = user_full("Observation at checkpoint C_{checkpoint}", "Your command?")

REFLECTIONS_FULL = reflections_full(
    attempt="a ScienceWorld attempt", world="the simulation", undone="commands", view="Observation",
    item="command", avoid="which commands to avoid from C_{target}",
)

SYSTEM_COMPACT = (
    "ScienceWorld task: {goal}\nOne command per turn from the listed templates (OBJ = object name); open "
    "doors before going through; focus only on the object the task names; answer numbered choices with "
    "the number. Score 0-100, 100 = done, negative = failed.\n"
    + COMPACT_BUDGET +
    "End with one tag: <action>go to kitchen</action>."
)

register("scienceworld", "full", full_set(
    system=SYSTEM_FULL, user=USER_FULL, reflections=REFLECTIONS_FULL, rules=_RULES,
    rewind_allowed=_REWIND_ALLOWED, rewind_forbidden=_REWIND_FORBIDDEN, triggers=_TRIGGERS,
))
register("scienceworld", "compact", compact_set(
    system=SYSTEM_COMPACT,
    rules="Task: {goal} One command per turn; score 100 = done, negative = failed.",
    rewind_forbidden="No rewinds: every command is final.", triggers=_TRIGGERS,
))
