"""Reply formats of the auxiliary roles and their parsers. Every parser is total: any input (even a
non-string) gives a result whose ``problems`` list says what was wrong; the controller then applies the
documented fallback. Only the *last* occurrence of a tag counts.

- review (D_ψ, Eq. 4)::

      <verdict>continue | rollback</verdict>
      <urgency>0.0 … 1.0</urgency>
      <diagnosis>why the branch fails (used when rolling back)</diagnosis>
      <knowledge>
      obs: an observed fact
      elim: an option ruled out by evidence
      aff: what an action or tool does
      </knowledge>

  fallbacks: a missing/unknown verdict → continue; a malformed urgency → the schedule's default.
- coarse (Eq. 6): ``<range>C_l - C_u</range>`` (also ``l, u`` or ``C_l to C_u``) with ``0 ≤ l ≤ u ≤ t``;
  fallback: the whole path ``[0, t]``.
- fine (Eqs. 7-8): ``<restore>C_r</restore>``, ``<confidence>0..1</confidence>``, ``<why>…</why>`` with
  ``r`` an admissible candidate; fallback: the latest admissible checkpoint in ``[l, u]``.
- patch (Eq. 10): ``<milestones>`` lines ``- …`` ``</milestones>``, ``<failure>…</failure>`` and an
  optional ``<pattern>`` (the failure as a reusable rule, §4.4's promotion to E); fallback: no milestones,
  F = the reviewer's diagnosis; no pattern: the failure analysis stands for it.
- the agent's rollback tool: the action ``rollback`` (optionally ``rollback: reason``) in the world's
  action format.

Every field is read by :func:`field`, which accepts the forms a model that follows the instruction loosely
writes: the tag (last complete one), an unclosed last tag (``<verdict>rollback`` with no closing tag), or a
``name: value`` line (markdown emphasis, bullets or a heading around the name allowed, e.g.
``**Verdict:** Rollback``). A value is then read leniently but never guessed: a verdict is its first word
(``roll back`` and case allowed; a value naming both verdicts, such as the format's own ``continue or
rollback``, is no verdict), and a whole reply of one verdict word counts; an urgency or confidence must
START with a number (``0.7 (high)``, ``70%``), so the template's ``a number from 0 to 1`` is none; a range
or restore point is found inside its value (``C_2 - C_5 (before the push)``, ``[2, 5]``, ``C_3, since …``).
Text outside any field — prose, another role's tags — is never searched for a verdict.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from retrojax.agent.rir.memory import CHANNELS, Knowledge
from retrojax.agent.rir.schedule import clamp_urgency

CONTINUE = "continue"
ROLLBACK = "rollback"
MAX_FIELD_CHARS = 2000

_ROLLBACK_TOOL = re.compile(r"^\s*rollback\s*(?:[:\-—]|$)", re.IGNORECASE)
_INDEX = re.compile(r"(?:c\s*_?\s*)?(\d{1,9})", re.IGNORECASE)
_RANGE = re.compile(
    r"(?<![\w.])(?:c\s*_?\s*)?(\d{1,9})\s*(?:-|–|—|,|to|\.\.)\s*(?:c\s*_?\s*)?(\d{1,9})(?![\w.]*\d)",
    re.IGNORECASE,
)
_SINGLE = re.compile(r"(?<![\w.])(?:c\s*_?\s*)?(\d{1,9})(?![\w.]*\d)", re.IGNORECASE)
_CHECKPOINT = re.compile(r"(?<![a-z])c\s*_?\s*(\d{1,9})\b", re.IGNORECASE)
_NUMBER = re.compile(r"^[\s*_`\[(]*([-+]?(?:\d+\.?\d*|\.\d+))\s*(%?)")
_MARKS = " \t*_`#>•-"
_CHANNEL_LINE = re.compile(r"^\s*[-*]?\s*(obs|elim|aff)\s*:\s*(.*)$", re.IGNORECASE)


def _text(x: object) -> str:
    return x if isinstance(x, str) else ""


def last_tag(text: object, tag: str) -> str | None:
    """The content of the last complete ``<tag>…</tag>`` (case-insensitive), stripped; None if absent."""
    s = _text(text)
    lower = s.lower()
    close = f"</{tag}>"
    end = lower.rfind(close)
    if end < 0:
        return None
    start = lower.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None
    return s[start + len(tag) + 2 : end].strip()[:MAX_FIELD_CHARS]


def _unclosed_tag(s: str, tag: str) -> str | None:
    """The text after the last ``<tag>`` that has no closing tag, up to the next tag or the end."""
    lower = s.lower()
    start = lower.rfind(f"<{tag}>")
    if start < 0:
        return None
    rest = s[start + len(tag) + 2 :]
    cut = rest.find("<")
    value = (rest if cut < 0 else rest[:cut]).strip()
    return value[:MAX_FIELD_CHARS] or None


def _key_line(s: str, name: str) -> str | None:
    """The value of the last line ``name: value`` (or ``name = value``); a name alone on its line takes
    the lines below it up to a blank line."""
    pattern = re.compile(
        rf"^[{re.escape(_MARKS)}]*{re.escape(name)}[ \t*_`]*[:=][ \t*_`]*(.*)$", re.IGNORECASE | re.MULTILINE
    )
    matches = list(pattern.finditer(s))
    if not matches:
        return None
    m = matches[-1]
    value = m.group(1).strip()
    if not value:
        below = s[m.end() :].lstrip("\n").split("\n\n", 1)[0]
        value = below.strip()
    return value[:MAX_FIELD_CHARS] or None


def field(text: object, name: str) -> str | None:
    """A reply field in any accepted form (see the module docstring): the last complete ``<name>…</name>``,
    else an unclosed last ``<name>``, else the last ``name: value`` line; None if the reply has none."""
    s = _text(text)
    if not s:
        return None
    value = last_tag(s, name)
    if value is not None:
        return value
    value = _unclosed_tag(s, name)
    if value is not None:
        return value
    return _key_line(s, name)


def _verdict(text: object) -> str | None:
    raw = field(text, "verdict")
    if raw is None:  # only a reply that is one verdict word and nothing else
        words = re.findall(r"[a-z]+", _text(text).lower())
        return {"continue": CONTINUE, "rollback": ROLLBACK, "roll back": ROLLBACK}.get(" ".join(words))
    words = re.findall(r"[a-z]+", raw.lower())
    joined = " ".join(words)
    if not words or ("continue" in joined and "roll" in joined):
        return None  # no verdict, or both named (the format's own "continue or rollback")
    if words[0] == CONTINUE:
        return CONTINUE
    if words[0] == ROLLBACK or words[:2] == ["roll", "back"]:
        return ROLLBACK
    return None


def is_rollback_request(content: object) -> bool:
    """The agent's action content calls the rollback tool."""
    return isinstance(content, str) and _ROLLBACK_TOOL.match(content) is not None


def _unit(text: str | None) -> float | None:
    """A number at the START of a field value (``0.7``, ``0.7 (high)``, ``70%`` = 0.7); None otherwise."""
    if text is None:
        return None
    m = _NUMBER.match(text)
    if not m:
        return None
    try:
        x = float(m.group(1))
    except (ValueError, OverflowError):
        return None
    return x / 100 if m.group(2) else x


@dataclasses.dataclass(frozen=True)
class Review:
    verdict: str  # CONTINUE | ROLLBACK (after the fallback)
    urgency: float | None  # as written (None: missing or not a number); clamp with the schedule
    diagnosis: str
    knowledge: Knowledge
    problems: tuple[str, ...] = ()
    verdict_read: bool = True  # False: no verdict could be read and CONTINUE is the fallback

    def rho(self, default: float) -> float:
        return clamp_urgency(self.urgency, default)


def parse_review(text: object) -> Review:
    problems = []
    read = _verdict(text)
    if read is None:
        problems.append("no <verdict>continue|rollback</verdict>; treated as continue")
    verdict = read or CONTINUE
    urgency = _unit(field(text, "urgency"))
    if urgency is None:
        problems.append("no numeric <urgency>; the schedule's default is used")
    diagnosis = field(text, "diagnosis") or ""
    body = field(text, "knowledge")
    if body is None:  # channel lines written without a <knowledge> block
        body = _text(text) if read is not None else ""
    found: dict[str, list[str]] = {c: [] for c in CHANNELS}
    for line in body.splitlines():
        m = _CHANNEL_LINE.match(line)
        if m and m.group(2).strip():
            found[m.group(1).lower()].append(m.group(2).strip())
    knowledge = Knowledge(**{c: tuple(v) for c, v in found.items()})
    return Review(verdict, urgency, diagnosis, knowledge, tuple(problems), read is not None)


@dataclasses.dataclass(frozen=True)
class Interval:
    lo: int | None
    hi: int | None
    problems: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        return self.lo is not None and self.hi is not None


def parse_range(text: object, t: int) -> Interval:
    """``[l, u]`` with ``0 ≤ l ≤ u ≤ t``; otherwise an invalid interval with the reason."""
    raw = field(text, "range")
    if raw is None:
        return Interval(None, None, ("no <range>C_l - C_u</range>",))
    m = _RANGE.search(raw)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
    else:
        one = _CHECKPOINT.search(raw) or _SINGLE.search(raw)
        if not one:
            return Interval(None, None, (f"unreadable range {raw[:40]!r}",))
        lo = hi = int(one.group(1))
    if not 0 <= lo <= hi <= t:
        return Interval(None, None, (f"range C_{lo} - C_{hi} is not inside C_0 … C_{t} with l ≤ u",))
    return Interval(lo, hi)


@dataclasses.dataclass(frozen=True)
class Selection:
    target: int | None
    confidence: float | None
    justification: str
    problems: tuple[str, ...] = ()


def parse_restore(text: object, candidates: Sequence[int]) -> Selection:
    """The restore point ``r`` among ``candidates`` (the admissible checkpoints in ``[l, u]``)."""
    why = field(text, "why") or ""
    conf = _unit(field(text, "confidence"))
    conf = None if conf is None else clamp_urgency(conf, 0.0)
    raw = field(text, "restore")
    if raw is None:
        return Selection(None, conf, why, ("no <restore>C_r</restore>",))
    m = _CHECKPOINT.search(raw) or _SINGLE.search(raw)
    if not m:
        return Selection(None, conf, why, (f"unreadable restore point {raw[:40]!r}",))
    r = int(m.group(1))
    if r not in set(candidates):
        return Selection(None, conf, why, (f"C_{r} is not one of the candidates",))
    return Selection(r, conf, why)


@dataclasses.dataclass(frozen=True)
class Patch:
    milestones: tuple[str, ...]
    failure: str
    problems: tuple[str, ...] = ()
    pattern: str = ""  # optional: the failure as a reusable rule ("" when absent)


def parse_patch(text: object) -> Patch:
    problems = []
    body = field(text, "milestones")
    milestones: list[str] = []
    if body is None:
        problems.append("no <milestones> block")
    else:
        for line in body.splitlines():
            item = line.strip().lstrip("-*•").strip()
            if item and item.lower() != "none":
                milestones.append(item)
    failure = field(text, "failure")
    if not failure:
        problems.append("no <failure> analysis; the reviewer's diagnosis is used")
        failure = ""
    return Patch(tuple(milestones), failure, tuple(problems), field(text, "pattern") or "")


# -- writers (scripted players reply through these, so their text goes through the same parsers) -----


def write_review(
    verdict: str,
    urgency: float,
    diagnosis: str = "",
    obs: Sequence[str] = (),
    elim: Sequence[str] = (),
    aff: Sequence[str] = (),
) -> str:
    lines = [f"obs: {x}" for x in obs] + [f"elim: {x}" for x in elim] + [f"aff: {x}" for x in aff]
    return (
        f"<verdict>{verdict}</verdict>\n<urgency>{urgency:.2f}</urgency>\n"
        f"<diagnosis>{diagnosis}</diagnosis>\n<knowledge>\n" + "\n".join(lines) + "\n</knowledge>"
    )


def write_range(lo: int, hi: int) -> str:
    return f"<range>C_{lo} - C_{hi}</range>"


def write_restore(r: int, confidence: float, why: str) -> str:
    return f"<restore>C_{r}</restore>\n<confidence>{confidence:.2f}</confidence>\n<why>{why}</why>"


def write_patch(milestones: Sequence[str], failure: str, pattern: str = "") -> str:
    items = "\n".join(f"- {m}" for m in milestones) or "none"
    tail = f"\n<pattern>{pattern}</pattern>" if pattern else ""
    return f"<milestones>\n{items}\n</milestones>\n<failure>{failure}</failure>{tail}"
