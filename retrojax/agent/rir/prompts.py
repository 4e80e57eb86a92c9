"""Prompts of RIR: the agent's system/user turns and the four single-turn auxiliary prompts.

The agent's system prompt is the world's rules, the goal, the budgets, the rollback tool (when the variant
offers it), the reply format and, last, the ONE rendered reflection-memory block (placed last so that a
memory change leaves the rules prefix of the context untouched). Each auxiliary role (review, coarse,
fine, patch) gets its own system prompt and one user turn with exactly the inputs of its equation; none of
them ever enters the agent's context:

- review (Eq. 4, D_ψ(g, h_t, M, ξ_t)) and coarse (Eq. 6, S_coarse(g, h_t, M, f_t)): the trajectory h_t of the
  current branch — steps before the last review as ``action → outcome; state: σ``, the steps since the last
  review with their observations (σ where an observation is long) — the current observation, M, and ξ_t or
  f_t; within ``rir.prompt_budget`` tokens (:func:`fit` degrades the oldest detail first);
- fine (Eq. 7): the candidates' σ(C_i) with f_t and M;
- patch (Eq. 10): the abandoned suffix τ_{r:t} with its observations; under RIR/no-rollback (k = 0) nothing is
  abandoned, so the patcher gets a prompt of its own (:data:`REFLECT_SYSTEM`) over the steps the reviewer
  reviewed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from retrojax.agent.prompts import COMPACT_BUDGET, get_prompts

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
_EXAMPLE_FORMAT = {"tag": "<action>rollback</action>", "fence": "a fenced ```action block holding rollback"}
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
            "instead of a move, written like any action ("
            + _EXAMPLE_FORMAT.get(style, _EXAMPLE_FORMAT["tag"])
            + "). "
            "It only asks a reviewer to look at your path: the reviewer may return you to an earlier state "
            "(keeping what was learned in the memory below) or let you continue where you are."
        )
    parts.append("Reply format. Think briefly, then act. " + action_format(world, style))
    if memory_block:
        parts.append(memory_block)
    return "\n\n".join(parts)


def agent_system_compact(
    *,
    prompt_key: str,
    fields: dict[str, Any],
    style: str,
    agent_budget: int,
    rollback_tool: bool,
    memory_block: str | None,
) -> str:
    """The agent's system prompt in the compact style (``trial.prompt_style: compact``): the world's compact
    header and reply-format line — what a small policy trained on ReTRAIL's compact prompts knows — around
    RIR's own budget and rollback-tool lines (ReTRAIL's rewind rules do not apply here), then M."""
    template = get_prompts(prompt_key, "compact").system
    head, sep, tail = template.partition(COMPACT_BUDGET)
    if not sep:  # a world whose compact system has no budget paragraph: its whole text, then ours
        head, tail = template, ""
    try:
        head, tail = head.format(**fields), tail.format(**fields)
    except (KeyError, IndexError, ValueError):  # no task fields (scripted runs render no prompt)
        head, tail = head.split("{", 1)[0], tail.split("{", 1)[0]
    lines = [head.rstrip("\n"), f"Budget: {agent_budget} replies in all, executed or not."]
    if rollback_tool:
        lines.append(
            "Reply " + _EXAMPLE_FORMAT.get(style, _EXAMPLE_FORMAT["tag"]) + " if your path went wrong: a "
            "reviewer checks it and may return you to an earlier checkpoint (memory kept)."
        )
    if tail.strip():
        lines.append(tail.strip())
    text = "\n".join(lines)
    return f"{text}\n\n{memory_block}" if memory_block else text


def agent_user_compact(*, observation: str, checkpoint: int, calls_left: int, used: int, note: str) -> str:
    """The compact user turn: the checkpoint and observation, replies used/left, then the one event line."""
    return f"C_{checkpoint}:\n{observation}\nreplies {used}/{calls_left} left\n{note or '(none yet)'}\n"


def agent_user(*, observation: str, checkpoint: int, calls_left: int, note: str) -> str:
    head = f"Note: {note}\n\n" if note else ""
    return (
        f"{head}Current state (checkpoint C_{checkpoint}):\n{observation}\n\n"
        f"Replies left: {calls_left}. Your action?"
    )


@dataclasses.dataclass(frozen=True)
class Step:
    """One executed step of the branch as an auxiliary role reads it (only what the agent saw)."""

    before: int  # the checkpoint the action was taken at (it created C_{before+1})
    action: str
    outcome: str  # the world's one-line reply
    observation: str  # the observation at C_{before+1}
    summary: str  # σ(C_{before+1})


@dataclasses.dataclass(frozen=True)
class Shape:
    """How much of a trajectory a prompt shows: observations of the ``compressed`` oldest detailed steps are
    replaced by σ, the ``dropped`` oldest steps are left out, the current observation is cut to ``clip``."""

    compressed: int = 0
    dropped: int = 0
    clip: int | None = None


def _observation(text: str, summary: str, limit: int, compressed: bool) -> str:
    flat = text.strip()
    if compressed or len(flat) > limit:
        return f"(summary) {summary}"
    return flat.replace("\n", "\n    ")


def trajectory(
    start: str,
    steps: Sequence[Step],
    detailed_from: int,
    *,
    observation_chars: int,
    shape: Shape | None = None,
    current: bool = True,
) -> str:
    """The branch as lines after the line ``start`` (σ of the first checkpoint shown): steps taken at
    checkpoints ``< detailed_from`` as ``action → outcome; state: σ``; later steps (since the last review)
    with their observation (σ where the raw observation is longer than ``observation_chars``). With
    ``current`` the last step's observation is the prompt's "current observation" and is not repeated."""
    shape = shape or Shape()
    shown = list(steps)[shape.dropped :]
    lines = (
        [f"(… {min(shape.dropped, len(steps))} earlier steps left out to fit the prompt)"]
        if shape.dropped
        else [start]
    )
    detailed = [x for x in shown if x.before >= detailed_from]
    squeeze = {id(x) for x in detailed[: shape.compressed]}
    last = steps[-1] if steps and current else None
    for x in shown:
        outcome = x.outcome.strip()
        if x.before >= detailed_from and outcome and outcome.rstrip("…").strip() in x.observation:
            outcome = ""  # a text world's reply is the observation itself
        head = f"C_{x.before} → C_{x.before + 1}: {x.action}" + (f" → {outcome}" if outcome else "")
        if x.before < detailed_from:
            lines.append(f"{head}; state: {x.summary}")
        elif x is last:
            lines.append(f"{head}\n    observation: (the current observation, below)")
        else:
            obs = _observation(x.observation, x.summary, observation_chars, id(x) in squeeze)
            lines.append(f"{head}\n    observation: {obs}")
    return "\n".join(lines)


def current_observation(text: str, clip: int | None) -> str:
    flat = text.strip() or "(empty)"
    if clip is not None and len(flat) > clip:
        return flat[: max(0, clip - 1)] + "…"
    return flat


def fit(
    build: Callable[[Shape], str],
    count: Callable[[str], int],
    budget: int,
    detailed: int,
    total: int,
    clip: int,
) -> str:
    """The first prompt ``build(shape)`` within ``budget`` tokens, degrading in this order: compress the
    detailed steps' observations oldest first, then leave out the oldest steps, then cut the current
    observation to ``clip`` characters. If nothing fits, the most degraded prompt is returned."""
    text = build(Shape())
    if count(text) <= budget:
        return text
    for c in range(1, detailed + 1):
        text = build(Shape(compressed=c))
        if count(text) <= budget:
            return text
    for d in range(1, total + 1):
        text = build(Shape(compressed=detailed, dropped=d))
        if count(text) <= budget:
            return text
    return build(Shape(compressed=detailed, dropped=total, clip=clip))


REVIEW_SYSTEM = (
    "You review an agent's progress on a task. You see its trajectory on the current branch (older steps as "
    "state summaries, the steps since the last review with what the agent observed), its current "
    "observation, the reflection memory and execution signals counted from what the agent saw. Decide "
    "whether the branch is still productive (continue) or has gone wrong in a way worth undoing (rollback). "
    "Also say how urgently the branch needs another look (urgency 0 = healthy, review late; 1 = risky, "
    "review soon) and record new, reusable facts about the environment. Never state facts about the agent's "
    "current position or inventory as knowledge.\n\nReply exactly in this form:\n"
    "<verdict>continue or rollback</verdict>\n<urgency>a number from 0 to 1</urgency>\n"
    "<diagnosis>if rolling back: what failed and why</diagnosis>\n"
    "<knowledge>\nobs: a fact you observed\nelim: an option the evidence rules out\n"
    "aff: what an action does\n</knowledge>\n(any number of obs/elim/aff lines, or none)"
)

COARSE_SYSTEM = (
    "An agent's branch failed. Given the diagnosis, the trajectory and the current observation, name the "
    "stretch of checkpoints that most likely holds the decisive mistake or the unmet precondition. Reply "
    "exactly: <range>C_l - C_u</range> with l ≤ u, both on the path."
)

FINE_SYSTEM = (
    "Choose where the agent resumes. Compare the candidate checkpoints' state summaries with the diagnosis; "
    "drop every candidate that still contains the problem and take the LATEST of the rest, to keep as much "
    "valid progress as possible. Reply exactly:\n<restore>C_r</restore>\n<confidence>0 to 1</confidence>\n"
    "<why>one sentence</why>"
)

_PATCH_FORMAT = (
    "Reply exactly:\n<milestones>\n- milestone\n</milestones>\n<failure>the analysis</failure>\n"
    "<pattern>optional: the failure as a short rule that would hold in another attempt</pattern>"
)

PATCH_SYSTEM = (
    "The agent is about to be returned to an earlier checkpoint; the steps after it will be undone. From the "
    "abandoned steps, list milestones reached (as history: they will NOT hold after the restore) and write "
    "why this attempt failed under its conditions. " + _PATCH_FORMAT
)

REFLECT_SYSTEM = (
    "A reviewer judged that the agent's recent steps went wrong. Nothing will be undone: the agent continues "
    "from its current state, and its proposed next action is dropped. From the reviewed steps, list "
    "milestones the branch reached (kept as history of attempts) and write why these steps failed, so that "
    "the agent does better from here. " + _PATCH_FORMAT
)

_WHY = {
    "agent": "the agent asked for a review with the rollback tool",
    "schedule": "the review horizon was reached",
    "failure": "the world reports an irreversible failure",
}


def review_user(
    *,
    goal: str,
    trajectory: str,
    observation: str,
    memory: str,
    signals: str,
    checkpoint: int,
    since: int,
    trigger: str,
    pending: str,
) -> str:
    return (
        f"Goal: {goal}\n\nWhy this review: {_WHY.get(trigger, trigger)}.\n\n"
        f"Trajectory on the current branch (C_0 … C_{checkpoint}; observations since the last review at "
        f"C_{since}):\n{trajectory}\n\nCurrent observation (C_{checkpoint}):\n{observation}\n\n"
        f"Next action the agent proposed: {pending or '(none)'}\n\n"
        f"Execution signals: {signals}\n\n{memory}"
    )


def coarse_user(
    *, goal: str, trajectory: str, observation: str, memory: str, diagnosis: str, checkpoint: int
) -> str:
    return (
        f"Goal: {goal}\n\nDiagnosis: {diagnosis or '(none given)'}\n\nTrajectory (checkpoints C_0 … "
        f"C_{checkpoint}):\n{trajectory}\n\nCurrent observation (C_{checkpoint}):\n{observation}\n\n{memory}"
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


def reflect_user(
    *, goal: str, diagnosis: str, since: int, checkpoint: int, reviewed: str, memory: str
) -> str:
    return (
        f"Goal: {goal}\n\nDiagnosis: {diagnosis or '(none given)'}\n\n"
        f"Reviewed steps (C_{since} … C_{checkpoint}; the agent stays at C_{checkpoint}):\n{reviewed}\n\n"
        f"{memory}"
    )
