"""Parsing model outputs: the final action tag, rewind requests, game moves and reflection remarks.

Every function here is total: any string gives either a valid ``Action`` or an ``INVALID`` one with a
short reason that the next user turn shows to the agent. Only the *last* action tag of an output counts
(a model may think aloud with example tags before its decision).

Formats:
- execution outputs end with ``<action>…</action>`` (or, for worlds whose prompts ask for it, a fenced
  ``` ```action … ``` ``` block);
- ``rewind to C_j`` / ``rewind to j`` (case-insensitive, ``C_j`` or ``Cj``) requests a rewind;
- Sokoban: one to three comma-separated moves from ``up, down, left, right``;
- MineSweeper: ``(row, col)``, 1-indexed, inside the board;
- reflections put their memory in ``<remark>…</remark>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from retrojax.agent.env_api import MOVE, REWIND, Action, invalid

OPEN_TAG = "<action>"
CLOSE_TAG = "</action>"
NO_TAG = "no <action>…</action> tag found; end your reply with exactly one action tag"
TRUNCATED_MARK = "[truncated] "

SOKOBAN_MOVES = ("up", "down", "left", "right")
MAX_SOKOBAN_MOVES = 3

_REWIND = re.compile(r"^\s*rewind\s+to\s+(?:c\s*_?\s*)?(\d{1,9})\s*\.?\s*$", re.IGNORECASE)
_REWIND_PREFIX = re.compile(r"^\s*rewind\b", re.IGNORECASE)
_CELL = re.compile(r"^\s*\(?\s*(\d{1,9})\s*,\s*(\d{1,9})\s*\)?\s*\.?\s*$")
_FENCE = re.compile(r"```[ \t]*action[ \t]*\r?\n(.*?)```", re.IGNORECASE | re.DOTALL)


def format_action(action: str, style: str = "tag") -> str:
    """``action`` marked the way a world's prompts ask for it: ``<action>…</action>`` or a fenced
    ```action block; the inverse of :func:`extract_action` (scripted players write through it)."""
    if style == "fence":
        return f"```action\n{action}\n```"
    return f"{OPEN_TAG}{action}{CLOSE_TAG}"


def extract_action(text: str, style: str = "tag") -> str | None:
    """The content of the last complete action tag (``style="tag"``) or fenced block (``"fence"``).

    Returns None when there is none. For tags, the content is what lies between the last ``</action>``
    and the last ``<action>`` before it, so stray or nested opening tags never leak into the action.
    """
    if style == "fence":
        matches = _FENCE.findall(text)
        return matches[-1].strip() if matches else None
    span = action_span(text)
    return None if span is None else text[span[0] : span[1]].strip()


def action_span(text: str) -> tuple[int, int] | None:
    """Where :func:`extract_action` reads a tag's content: ``(start, end)`` character offsets between the
    last ``</action>`` and the last ``<action>`` before it (unstripped), or None without a complete tag."""
    lower = text.lower()
    end = lower.rfind(CLOSE_TAG)
    if end < 0:
        return None
    start = lower.rfind(OPEN_TAG, 0, end)
    return None if start < 0 else (start + len(OPEN_TAG), end)


def parse_rewind(content: str) -> Action | None:
    """``rewind to C_j`` → a ``REWIND`` action; another rewind phrase → invalid; anything else → None."""
    m = _REWIND.match(content)
    if m:
        j = int(m.group(1))
        return Action(kind=REWIND, text=f"rewind to C_{j}", target=j)
    if _REWIND_PREFIX.match(content):
        return invalid("malformed rewind; write exactly 'rewind to C_j' with a checkpoint number j", content)
    return None


def parse_with(content: str, parse_move: Callable[[str], Action]) -> Action:
    """A rewind request if ``content`` is one, else the world's move parser."""
    if not isinstance(content, str):
        return invalid(f"expected action text, got {type(content).__name__}")
    rewind = parse_rewind(content)
    return rewind if rewind is not None else parse_move(content)


def parse_output(text: str, parse_action: Callable[[str], Action], style: str = "tag") -> Action:
    """A whole model output → ``Action`` through the final action tag and the world's ``parse_action``."""
    content = extract_action(text, style)
    if content is None:
        return invalid(NO_TAG)
    if not content:
        return invalid("the action tag is empty")
    return parse_action(content)


def parse_sokoban_move(content: str) -> Action:
    """One to three comma-separated moves (``up, left, left``); codes are indices into SOKOBAN_MOVES."""
    words = [w.strip().lower() for w in content.split(",")]
    if any(not w for w in words):
        return invalid("empty move in the list; write moves like 'up, left'", content)
    if len(words) > MAX_SOKOBAN_MOVES:
        return invalid(f"too many moves ({len(words)}); at most {MAX_SOKOBAN_MOVES} per turn", content)
    unknown = [w for w in words if w not in SOKOBAN_MOVES]
    if unknown:
        shown = unknown[0] if len(unknown[0]) <= 40 else unknown[0][:40] + "…"
        return invalid(f"unknown move '{shown}'; use up, down, left or right", content)
    return Action(kind=MOVE, text=", ".join(words), code=tuple(SOKOBAN_MOVES.index(w) for w in words))


def parse_sokoban(content: str) -> Action:
    """Sokoban action content: a rewind request or up to three moves."""
    return parse_with(content, parse_sokoban_move)


def parse_cell(content: str, height: int, width: int) -> Action:
    """``(row, col)`` 1-indexed inside a ``height × width`` board; the code is 0-indexed ``(r, c)``."""
    m = _CELL.match(content)
    if not m:
        return invalid("expected a cell as (row, col), e.g. (2, 3)", content)
    r, c = int(m.group(1)), int(m.group(2))
    if not (1 <= r <= height and 1 <= c <= width):
        return invalid(f"cell ({r}, {c}) is outside the board (rows 1-{height}, columns 1-{width})", content)
    return Action(kind=MOVE, text=f"({r}, {c})", code=(r - 1, c - 1))


def parse_minesweeper(content: str, height: int, width: int) -> Action:
    """MineSweeper action content: a rewind request or a cell to reveal."""
    return parse_with(content, lambda s: parse_cell(s, height, width))


def extract_remark(text: str) -> str:
    """The content of the last ``<remark>…</remark>`` (an unclosed final tag runs to the end); "" if none."""
    lower = text.lower()
    start = lower.rfind("<remark>")
    if start < 0:
        return ""
    end = lower.find("</remark>", start)
    body = text[start + len("<remark>") : end if end >= 0 else len(text)]
    return body.strip()


def clip_remark(remark: str, max_chars: int) -> str:
    """Keep the tail of a remark longer than ``max_chars``, prefixed ``[truncated]``."""
    if len(remark) <= max_chars:
        return remark
    keep = max(0, max_chars - len(TRUNCATED_MARK))
    return TRUNCATED_MARK + (remark[len(remark) - keep :] if keep else "")


def memory_from_reflection(text: str, max_chars: int) -> str:
    """The remark kept in context: the remark, or the whole reflection when the remark is empty."""
    remark = extract_remark(text)
    if not remark:
        remark = text.strip()
    return clip_remark(remark, max_chars)
