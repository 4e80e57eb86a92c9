"""σ(C_i): a short state summary per checkpoint, computed when the checkpoint is created (Eq. 7).

The fine selector compares these summaries against the failure diagnosis. They are derived from what the
world shows (the rendered observation and the world's one-line reply) plus its terminal flags, never from
hidden solver values, so a model selector sees exactly what the oracle's summary text says:

- Sokoban: boxes on targets and the player's cell; MineSweeper: open cells (and whether a mine was hit);
- ScienceWorld: room, last inventory seen, the score it prints; ALFWorld: location and held object (its
  goal-condition score is hidden from the agent and never kept here).

Text worlds need the previous summary (location and inventory persist until a reply changes them), so a
summary is a small dict updated step by step; :func:`render` gives its text.
"""

from __future__ import annotations

import re
from typing import Any

_ROOM = re.compile(
    r"(?:this room is called the|you move to the|you go to the|you are in the)\s+([a-z0-9 \-]+?)[.\n,]",
    re.IGNORECASE,
)
_INVENTORY = re.compile(r"in your inventory, you see:\s*(.*)", re.IGNORECASE | re.DOTALL)
_ARRIVE = re.compile(r"you arrive at (?:loc \d+\. )?(?:the )?([a-z0-9 ]+?)[.,]", re.IGNORECASE)
_PICK = re.compile(r"you pick up the ([a-z0-9 ]+?) from", re.IGNORECASE)
_PUT = re.compile(r"you (?:put|move) the ([a-z0-9 ]+?) (?:in|on|to)", re.IGNORECASE)


def start(world: str, observation: str, info: Any) -> dict[str, Any]:
    """σ(C_0)."""
    return update(world, {}, observation, info)


def update(world: str, prev: dict[str, Any], observation: str, info: Any) -> dict[str, Any]:
    """σ of the new checkpoint from the previous summary, the rendered observation and the ``StepInfo``."""
    s: dict[str, Any] = {
        "failed": bool(getattr(info, "failed", False)),
        "solved": bool(getattr(info, "solved", False)),
    }
    text = observation or ""
    if world == "sokoban":
        cells = [row.split(":", 1)[1].split() for row in text.splitlines() if ":" in row]
        s["on_target"] = sum(row.count("√") for row in cells)
        s["boxes"] = s["on_target"] + sum(row.count("X") for row in cells)
        s["player"] = next(
            ((r, c) for r, row in enumerate(cells) for c, x in enumerate(row) if x in "PS"), None
        )
    elif world == "minesweeper":
        cells = [row.split(":", 1)[1].split() for row in text.splitlines() if ":" in row]
        flat = [x for row in cells for x in row]
        s["open"] = sum(1 for x in flat if x == "." or x.isdigit())
        s["hidden"] = sum(1 for x in flat if x == "?")
        s["mine"] = any(x == "*" for x in flat)
    else:
        reply = str(getattr(info, "message", "") or "") + "\n" + text
        s["place"] = prev.get("place", "unknown")
        s["holding"] = prev.get("holding", "nothing")
        s["inventory"] = prev.get("inventory", "unknown")
        m = _ROOM.findall(reply) or _ARRIVE.findall(reply)
        if m:
            s["place"] = m[-1].strip()
        inv = _INVENTORY.search(reply)
        if inv:
            s["inventory"] = " ".join(inv.group(1).split())[:120]
        pick, put = _PICK.findall(reply), _PUT.findall(reply)
        if pick:
            s["holding"] = pick[-1].strip()
        elif put:
            s["holding"] = "nothing"
        if world == "scienceworld":  # its score is printed in every observation; ALFWorld shows none
            score = getattr(info, "score", None)
            s["score"] = float(score) if score is not None else prev.get("score", 0.0)
    return s


def visible_score(world: str, s: dict[str, Any]) -> float | None:
    """The score the world SHOWS the agent at this checkpoint (ξ_t's "visible score"), or None: Sokoban's
    boxes on targets, MineSweeper's open cells, ScienceWorld's printed score. ALFWorld prints none (its
    goal-condition fraction is hidden), and neither do worlds this module does not know."""
    key = {"sokoban": "on_target", "minesweeper": "open", "scienceworld": "score"}.get(world)
    if key is None or key not in s:
        return None
    return float(s[key])


def render(world: str, s: dict[str, Any]) -> str:
    end = "; FAILED (irreversible)" if s.get("failed") else "; solved" if s.get("solved") else ""
    if world == "sokoban":
        player = s.get("player")
        where = f"row {player[0]}, column {player[1]}" if player else "unknown"
        return f"{s.get('on_target', 0)} of {s.get('boxes', 0)} boxes on targets; player at {where}{end}"
    if world == "minesweeper":
        mine = "; a mine was opened" if s.get("mine") else ""
        return f"{s.get('open', 0)} cells open, {s.get('hidden', 0)} hidden{mine}{end}"
    if world == "alfworld":
        return f"at {s.get('place')}; holding {s.get('holding')}{end}"
    return f"in the {s.get('place')}; inventory: {s.get('inventory')}; score {s.get('score', 0.0):g}{end}"
