"""Rollback-consistent reflection memory M = (G, E{obs, elim, aff}, H, F) (Eqs. 9-10).

- G: the task objective, set once and never changed.
- E: reusable environment knowledge in three channels (observed facts, evidence-supported eliminations,
  affordances), merged without duplicates (case and spacing do not make a new entry). Every entry keeps its
  provenance (the checkpoint of the review that established it); when a rollback abandons
  ``C_{r+1} … C_t``, entries of EVERY channel established only there are *marked to be re-verified*, tagged
  with the checkpoint where they were seen (kept, but rendered as unverified: the paper asks this of
  observations whose truth may depend on an undone action; we apply it to all three channels, since an
  elimination or affordance read off an abandoned branch rests on the same undone steps). Seeing the same
  fact again on the live branch clears the mark.
- Failure patterns (§4.4: "failure patterns that become supported across attempts are promoted to the
  Environment Model"): every recovery names one (the patcher's ``<pattern>``, else its failure analysis);
  one that recurs in ``PROMOTE_AFTER`` abandoned attempts (compared without case, spacing and numbers) is
  added to E.elim as a verified entry.
- H: milestones of past attempts (historical facts, not claims about the current state), appended without
  duplicates when an attempt is abandoned.
- F: the failure analysis of the most recently abandoned attempt, **replaced** at every recovery.

M never describes the agent's current state. The agent sees it as ONE rendered block (:meth:`Memory.render`)
that replaces the previous block; entries are single lines, clipped, and cannot contain the block's markers.
"""

from __future__ import annotations

import dataclasses
import re

CHANNELS = ("obs", "elim", "aff")
BLOCK_START = "<<reflection memory>>"
BLOCK_END = "<<end of reflection memory>>"
REVERIFY = "[re-verify"
PROMOTE_AFTER = 2  # abandoned attempts that must share a failure pattern before it enters E (ours)
MAX_ENTRY_CHARS = 240
_SPACE = re.compile(r"\s+")
_BLOCK_MARK = re.compile(r"<<\s*(?:end of\s+)?reflection memory\s*>>", re.IGNORECASE)
_NUMBER = re.compile(r"\d+")


def clean_entry(text: object, max_chars: int = MAX_ENTRY_CHARS) -> str:
    """One line of at most ``max_chars`` characters, without memory-block markers ("" for non-text)."""
    if not isinstance(text, str):
        return ""
    flat = _SPACE.sub(" ", _BLOCK_MARK.sub("", text)).strip()
    return flat if len(flat) <= max_chars else flat[: max_chars - 1] + "…"


def _norm(text: str) -> str:
    return text.casefold()


def pattern_key(text: str) -> str:
    """A failure pattern compared without case, spacing, punctuation at the ends and numbers (checkpoint
    indices and counts differ between attempts that fail the same way)."""
    return _SPACE.sub(" ", _NUMBER.sub("#", text.casefold())).strip(" .;:,")


@dataclasses.dataclass
class Entry:
    text: str
    checkpoint: int = -1  # where it was established (-1: not tied to a checkpoint)
    reverify: bool = False  # established only on an abandoned branch: check it again before relying on it


@dataclasses.dataclass(frozen=True)
class Knowledge:
    """ΔE: new entries per channel (what a review adds)."""

    obs: tuple[str, ...] = ()
    elim: tuple[str, ...] = ()
    aff: tuple[str, ...] = ()

    def channel(self, name: str) -> tuple[str, ...]:
        return getattr(self, name)


@dataclasses.dataclass
class Memory:
    goal: str
    obs: list[Entry] = dataclasses.field(default_factory=list)
    elim: list[Entry] = dataclasses.field(default_factory=list)
    aff: list[Entry] = dataclasses.field(default_factory=list)
    history: list[str] = dataclasses.field(default_factory=list)
    failure: str = ""
    version: int = 0  # bumped on every change (the agent's prompt is rebuilt only then)
    patterns: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # pattern → restore points
    promoted: int = 0  # failure patterns promoted into E

    def __post_init__(self) -> None:
        self.goal = clean_entry(self.goal, 1000) or "complete the task"

    # -- updates ---------------------------------------------------------------------------------------
    def merge(self, delta: Knowledge, checkpoint: int) -> int:
        """E⁺ = E ∪ ΔE; returns how many entries were added or re-verified."""
        changed = 0
        for name in CHANNELS:
            entries: list[Entry] = getattr(self, name)
            index = {_norm(e.text): e for e in entries}
            for raw in delta.channel(name):
                text = clean_entry(raw)
                if not text:
                    continue
                old = index.get(_norm(text))
                if old is None:
                    entry = Entry(text, checkpoint)
                    entries.append(entry)
                    index[_norm(text)] = entry
                    changed += 1
                elif old.reverify:
                    old.reverify, old.checkpoint = False, checkpoint
                    changed += 1
        if changed:
            self.version += 1
        return changed

    def add_history(self, milestones: tuple[str, ...] | list[str]) -> int:
        """H⁺ = H ∪ ΔH."""
        known = {_norm(h) for h in self.history}
        added = 0
        for raw in milestones:
            text = clean_entry(raw)
            if text and _norm(text) not in known:
                self.history.append(text)
                known.add(_norm(text))
                added += 1
        if added:
            self.version += 1
        return added

    def replace_failure(self, analysis: str) -> None:
        """F⁺ = F_new (replaced, never appended)."""
        text = clean_entry(analysis, 4 * MAX_ENTRY_CHARS)
        if text != self.failure:
            self.failure = text
            self.version += 1

    def abandon_after(self, r: int) -> int:
        """Entries of every channel established after ``C_r`` (on the abandoned suffix) are marked to be
        re-verified; they keep the checkpoint where they were seen."""
        marked = 0
        for name in CHANNELS:
            for e in getattr(self, name):
                if e.checkpoint > r and not e.reverify:
                    e.reverify = True
                    marked += 1
        if marked:
            self.version += 1
        return marked

    def note_pattern(self, pattern: str, restore: int) -> bool:
        """Record the failure pattern of one abandoned attempt; the ``PROMOTE_AFTER``-th attempt with the same
        pattern promotes it into E.elim (verified: it is supported across attempts). True when promoted."""
        text = clean_entry(pattern)
        key = pattern_key(text)
        if not key:
            return False
        seen = self.patterns.setdefault(key, [])
        seen.append(int(restore))
        if len(seen) != PROMOTE_AFTER:
            return False
        entry = f"recurring failure in {len(seen)} abandoned attempts: {text}"
        if _norm(entry) in {_norm(e.text) for e in self.elim}:
            return False
        self.elim.append(Entry(clean_entry(entry), -1))
        self.promoted += 1
        self.version += 1
        return True

    # -- reading ---------------------------------------------------------------------------------------
    def texts(self, channel: str) -> list[str]:
        return [e.text for e in getattr(self, channel)]

    @property
    def empty(self) -> bool:
        """Nothing learned yet: no E entry, no H milestone, no F."""
        return not (any(getattr(self, c) for c in CHANNELS) or self.history or self.failure)

    def render_compact(self) -> str:
        """The agent's block in the compact prompt style: only the fields that hold something, between the
        same markers; "" while M is empty (G is already in the compact header)."""
        if self.empty:
            return ""
        titles = {"obs": "seen", "elim": "ruled out", "aff": "works"}
        lines = [BLOCK_START + " (kept across rollbacks; not your current state)"]
        for name in CHANNELS:
            for e in getattr(self, name):
                mark = f"{REVERIFY}: seen at C_{e.checkpoint} on an abandoned branch] " if e.reverify else ""
                lines.append(f"{titles[name]}: {mark}{e.text}")
        lines += [f"tried before: {h}" for h in self.history]
        if self.failure:
            lines.append(f"last failure: {self.failure}")
        lines.append(BLOCK_END)
        return "\n".join(lines)

    def render(self) -> str:
        """The one block the agent (and the auxiliary roles) see."""
        lines = [
            BLOCK_START,
            "(Knowledge kept across rollbacks. It says nothing about your current state: "
            "trust the current observation for that.)",
            f"Goal: {self.goal}",
            "Environment knowledge:",
        ]
        titles = {"obs": "observed facts", "elim": "eliminated options", "aff": "affordances"}
        for name in CHANNELS:
            entries = getattr(self, name)
            lines.append(f"  {titles[name]}:" + ("" if entries else " (none)"))
            for e in entries:
                mark = f"{REVERIFY}: seen at C_{e.checkpoint} on an abandoned branch] " if e.reverify else ""
                lines.append(f"  - {mark}{e.text}")
        lines.append("Earlier attempts (history, not the present):" + ("" if self.history else " (none)"))
        lines += [f"  - {h}" for h in self.history]
        lines.append(f"Why the last abandoned attempt failed: {self.failure or '(no attempt abandoned yet)'}")
        lines.append(BLOCK_END)
        return "\n".join(lines)
