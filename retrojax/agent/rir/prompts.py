"""Prompts of RIR: the agent's system/user turns and the four single-turn auxiliary prompts.

The agent's system prompt is the world's rules, the goal, the budgets, the rollback tool (when the variant
offers it), the reply format and, last, the ONE rendered reflection-memory block (placed last so that a
memory change leaves the rules prefix of the context untouched). Each auxiliary role (review, coarse,
fine, patch) gets its own system prompt and one user turn with exactly the inputs of its equation; none of
them ever enters the agent's context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retrojax.agent.prompts import get_prompts

_GOALS = {
    "sokoban": "Push every box onto a target (all {boxes} boxes on targets).",
    "minesweeper": "Open every cell that is not a mine ({mines} mines on a {height}x{width} board).",
}
_FORMAT = {
    "tag": "End your reply with exactly one action tag, e.g. <action>{example}</action>; "
    "only the last one counts.",
    "fence": "End your reply with exactly one fenced block:\n```action\n{example}\n```\n"
    "Only the last one counts.",
}
_EXAMPLE = {"sokoban": "up, left", "minesweeper": "(2, 3)", "scienceworld": "look around", "alfworld": "look"}


def goal_of(world: str, fields: dict[str, Any]) -> str:
    """G: the task objective in one sentence (a text world's own goal; a game's win condition)."""
    if fields.get("goal"):
        return str(fields["goal"])
    template = _GOALS.get(world, "Complete the task.")
    try:
        return template.format(**fields)
    except (KeyError, IndexError, ValueError):  # no task fields (scripted runs render no prompt)
        return template.split(" (", 1)[0].rstrip(".") + "."


def world_rules(prompt_key: str, fields: dict[str, Any]) -> str:
    try:
        return get_prompts(prompt_key, "full").rules.format(**fields)
    except (KeyError, ValueError, IndexError):
        return ""


def action_format(world: str, style: str, action: str | None = None) -> str:
    return _FORMAT.get(style, _FORMAT["tag"]).format(example=action or _EXAMPLE.get(world, "look"))


def agent_system(
    *,
    world: str,
    style: str,
    rules: str,
    goal: str,
    agent_budget: int,
    rollback_tool: bool,
    memory_block: str | None,
) -> str:
    parts = [
        f"You act in a world step by step until the goal is reached.\n\nRules. {rules}".rstrip(),
        f"Goal. {goal}",
        f"Budget. You have {agent_budget} replies in all; every reply counts, executed or not.",
    ]
    if rollback_tool:
        parts.append(
            "Recovery tool. If you believe the current path went wrong, reply with the action 'rollback' "
            "(written like any action, e.g. "
            + action_format(world, style, "rollback")
            + ") instead of a move. "
            "It only asks a reviewer to look at your path: the reviewer may return you to an earlier state "
            "(keeping what was learned in the memory below) or let you continue where you are."
        )
    parts.append("Reply format. Think briefly, then act. " + action_format(world, style))
    if memory_block:
        parts.append(memory_block)
    return "\n\n".join(parts)


def agent_user(*, observation: str, checkpoint: int, calls_left: int, note: str) -> str:
    head = f"Note: {note}\n\n" if note else ""
    return (
        f"{head}Current state (checkpoint C_{checkpoint}):\n{observation}\n\n"
        f"Replies left: {calls_left}. Your action?"
    )


def history_lines(steps: Sequence[tuple[int, str, str]], limit: int) -> str:
    """``(checkpoint before, action, outcome)`` lines of the path, the last ``limit``."""
    shown = list(steps)[-limit:] if limit > 0 else list(steps)
    skipped = len(steps) - len(shown)
    lines = [f"(… {skipped} earlier steps)"] if skipped > 0 else []
    lines += [f"C_{i} → C_{i + 1}: {a} → {o}" for i, a, o in shown]
    return "\n".join(lines) if lines else "(no steps yet)"


REVIEW_SYSTEM = (
    "You review an agent's progress on a task. Decide whether its current branch is still productive "
    "(continue) or has gone wrong in a way worth undoing (rollback). Also say how urgently the branch needs "
    "another look (urgency 0 = healthy, review late; 1 = risky, review soon) and record new, reusable facts "
    "about the environment. Never state facts about the agent's current position or inventory as "
    "knowledge.\n\nReply exactly in this form:\n<verdict>continue or rollback</verdict>\n"
    "<urgency>a number from 0 to 1</urgency>\n<diagnosis>if rolling back: what failed and why</diagnosis>\n"
    "<knowledge>\nobs: a fact you observed\nelim: an option the evidence rules out\n"
    "aff: what an action does\n"
    "</knowledge>\n(any number of obs/elim/aff lines, or none)"
)

COARSE_SYSTEM = (
    "An agent's branch failed. Given the diagnosis and the path, name the stretch of checkpoints that most "
    "likely holds the decisive mistake or the unmet precondition. Reply exactly: <range>C_l - C_u</range> "
    "with l ≤ u, both on the path."
)

FINE_SYSTEM = (
    "Choose where the agent resumes. Compare the candidate checkpoints' state summaries with the diagnosis; "
    "drop every candidate that still contains the problem and take the LATEST of the rest, to keep as much "
    "valid progress as possible. Reply exactly:\n<restore>C_r</restore>\n<confidence>0 to 1</confidence>\n"
    "<why>one sentence</why>"
)

PATCH_SYSTEM = (
    "The agent is about to be returned to an earlier checkpoint; the steps after it will be undone. From the "
    "abandoned steps, list milestones reached (as history: they will NOT hold after the restore) and write "
    "why this attempt failed under its conditions. Reply exactly:\n<milestones>\n- milestone\n</milestones>\n"
    "<failure>the analysis</failure>"
)


def review_user(
    *, goal: str, history: str, memory: str, signals: str, checkpoint: int, trigger: str, pending: str
) -> str:
    why = {
        "agent": "the agent asked for a review with the rollback tool",
        "schedule": "the review horizon was reached",
        "failure": "the world reports an irreversible failure",
    }.get(trigger, trigger)
    return (
        f"Goal: {goal}\n\nWhy this review: {why}.\n\nPath so far (current checkpoint C_{checkpoint}):\n"
        f"{history}\n\nNext action the agent proposed: {pending or '(none)'}\n\n"
        f"Execution signals: {signals}\n\n{memory}"
    )


def coarse_user(*, goal: str, history: str, memory: str, diagnosis: str, checkpoint: int) -> str:
    return (
        f"Goal: {goal}\n\nDiagnosis: {diagnosis or '(none given)'}\n\nPath (checkpoints C_0 … "
        f"C_{checkpoint}):\n{history}\n\n{memory}"
    )


def fine_user(*, goal: str, diagnosis: str, memory: str, candidates: Sequence[tuple[int, str]]) -> str:
    rows = "\n".join(f"C_{i}: {s}" for i, s in candidates) or "(none)"
    return f"Goal: {goal}\n\nDiagnosis: {diagnosis or '(none given)'}\n\nCandidates:\n{rows}\n\n{memory}"


def patch_user(
    *, goal: str, diagnosis: str, restore: int, checkpoint: int, abandoned: str, memory: str
) -> str:
    return (
        f"Goal: {goal}\n\nDiagnosis: {diagnosis or '(none given)'}\n\nRestore point: C_{restore}. "
        f"Abandoned steps (C_{restore} … C_{checkpoint}):\n{abandoned}\n\n{memory}"
    )
