"""The baselines' auxiliary prompts, reply formats, total parsers and writers (the scripted oracle replies
through the writers, so its text goes through the same parsers as a model's).

- critique (Self-Refine's feedback)::  ``<verdict>keep | revise</verdict>`` ``<feedback>…</feedback>``;
  fallback: keep.
- reflect (Reflexion's and LATS's reflection)::  ``<reflection>…</reflection>``; fallback: a line saying how
  the trial or branch ended.
- value (LATS's evaluation)::  ``<value>0 … 1</value>``; fallback: 0.5.
- assist (GA-Rollback's stepwise check):: ``<verdict>continue | rollback</verdict>``
  ``<restore>C_r</restore>`` ``<feedback>…</feedback>``; fallbacks: continue; with rollback and no admissible
  restore point, the checkpoint before the last action.

Fields are read by :func:`retrojax.agent.rir.replies.field` (tag, unclosed last tag, or ``name: value`` line).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from retrojax.agent.rir import replies

KEEP, REVISE = "keep", "revise"

CRITIQUE_SYSTEM = (
    "You check an agent's proposed next action before it is executed. You see the goal, the agent's path "
    "so far, its current observation and the action it proposes. Decide whether the action should be kept "
    "or revised; if revised, say what is wrong with it.\n\nReply exactly in this form:\n"
    "<verdict>keep or revise</verdict>\n<feedback>what is wrong with the action, or why it is fine</feedback>"
)

REFLEXION_SYSTEM = (
    "An agent's trial at a task ended without success. From its steps, write a short reflection: what went "
    "wrong and what to do differently in the next trial, which starts again from the beginning.\n\n"
    "Reply exactly in this form:\n<reflection>the lesson for the next trial</reflection>"
)

LATS_REFLECT_SYSTEM = (
    "A branch of an agent's search over actions ended in an irreversible failure. From its steps, write a "
    "short reflection: which step was the mistake and what to try instead. The search goes on from other "
    "branches.\n\nReply exactly in this form:\n<reflection>the lesson</reflection>"
)

VALUE_SYSTEM = (
    "Estimate how promising the agent's current state is for reaching the goal, from the path that led to "
    "it and the current observation.\n\nReply exactly in this form:\n"
    "<value>a number from 0 (hopeless) to 1 (the goal is reached or certain)</value>"
)

ASSIST_SYSTEM = (
    "You assist an agent step by step. The agent has just executed an action. Check whether that action, or "
    "an earlier one on its path, was a mistake. If the path went wrong, name the checkpoint to return to "
    "(before the mistake) and give feedback for the retry.\n\nReply exactly in this form:\n"
    "<verdict>continue or rollback</verdict>\n<restore>C_r (with rollback)</restore>\n"
    "<feedback>what was wrong and what to avoid (with rollback)</feedback>"
)


def _first_word(raw: str | None, words: Sequence[str]) -> str | None:
    if raw is None:
        return None
    found = re.findall(r"[a-z]+", raw.lower())
    if not found or sum(w in found for w in words) > 1:
        return None  # no word, or both named (the format's own "keep or revise")
    return found[0] if found[0] in words else None


def parse_critique(text: object) -> tuple[str, str, tuple[str, ...]]:
    """(verdict, feedback, problems): verdict keep | revise; unreadable → keep."""
    verdict = _first_word(replies.field(text, "verdict"), (KEEP, REVISE))
    if verdict is None and isinstance(text, str):
        verdict = _first_word(text, (KEEP, REVISE)) if text.strip().lower() in (KEEP, REVISE) else None
    feedback = replies.field(text, "feedback") or ""
    problems = () if verdict is not None else ("no <verdict>keep|revise</verdict>; the action is kept",)
    return verdict or KEEP, feedback, problems


def parse_reflection(text: object) -> tuple[str, tuple[str, ...]]:
    """(reflection, problems); "" with a problem when the reply has none."""
    body = replies.field(text, "reflection") or ""
    return body, (() if body else ("no <reflection>",))


def parse_value(text: object) -> tuple[float, tuple[str, ...]]:
    """(value in [0, 1], problems); unreadable → 0.5."""
    x = replies._unit(replies.field(text, "value"))
    if x is None or x != x:
        return 0.5, ("no numeric <value>; 0.5 is used",)
    return min(1.0, max(0.0, x)), ()


def parse_assist(
    text: object, candidates: Sequence[int], default: int
) -> tuple[str, int, str, tuple[str, ...]]:
    """(verdict, restore point, feedback, problems): an unreadable verdict → continue; with rollback, a
    restore point that is not a candidate → ``default``."""
    review = replies.parse_review(text)
    problems = [] if review.verdict_read else ["no <verdict>continue|rollback</verdict>; treated as continue"]
    feedback = replies.field(text, "feedback") or ""
    r = default
    if review.verdict == replies.ROLLBACK:
        sel = replies.parse_restore(text, candidates)
        if sel.target is None:
            problems += list(sel.problems)
        else:
            r = sel.target
    return review.verdict, r, feedback, tuple(problems)


def write_critique(verdict: str, feedback: str) -> str:
    return f"<verdict>{verdict}</verdict>\n<feedback>{feedback}</feedback>"


def write_reflection(text: str) -> str:
    return f"<reflection>{text}</reflection>"


def write_value(value: float) -> str:
    return f"<value>{value:.2f}</value>"


def write_assist(verdict: str, restore: int | None = None, feedback: str = "") -> str:
    out = f"<verdict>{verdict}</verdict>"
    if restore is not None:
        out += f"\n<restore>C_{restore}</restore>"
    if feedback:
        out += f"\n<feedback>{feedback}</feedback>"
    return out
