"""Order-free canonical form of a text world's listings, for replay checks.

ScienceWorld keeps a container's objects in a hash set, so the order in which a room, a container or
the inventory lists them changes from one reset to the next (three identically named paint cups of the
art studio come out in any order). A replay that reaches the same world then prints the same lines in
another order. ``listing_canonical`` forgets exactly that order and nothing else:

- each line is cut at depth 0 (outside parentheses) on list separators (``,`` ``;`` ``:`` and a period
  that ends a sentence) into pieces; a leading ``and`` is dropped, a list's head word (``containing``)
  becomes a piece of its own, whitespace is collapsed;
- a parenthesised group (``(containing a, b)``) is canonicalised recursively and stays attached to
  the piece it belongs to, so *what contains what* is kept;
- the pieces of a line are sorted, then the lines are sorted.

So two texts are equal under this form exactly when they list the same items with the same contents
on the same lines; a different item, content, count or an item moved to another container's line
still differs.
"""

from __future__ import annotations

SEPARATORS = ",;:"
HEADS = frozenset({"containing"})


def _pieces(text: str) -> list[str]:
    """Split ``text`` at depth 0 into canonical pieces (parenthesised groups canonicalised inside)."""
    pieces: list[str] = []
    current: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "(":
            depth, j = 1, i + 1
            while j < n and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            inner = text[i + 1 : j - 1] if depth == 0 else text[i + 1 :]
            current.append("(" + "|".join(sorted(_pieces(inner))) + (")" if depth == 0 else ""))
            i = j
            continue
        end_of_sentence = ch == "." and (i + 1 == n or text[i + 1].isspace())
        if ch in SEPARATORS or end_of_sentence:
            pieces.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    pieces.append("".join(current))
    out = []
    for p in pieces:
        words = p.split()
        if words and words[0] == "and":
            words = words[1:]
        if len(words) > 1 and words[0] in HEADS:  # a list's head word stays with the list, not its first item
            out.append(words[0])
            words = words[1:]
        if words:
            out.append(" ".join(words))
    return out


def listing_canonical(text: str) -> str:
    """The canonical form of ``text`` (see the module docstring); equal texts give equal forms."""
    lines = ["|".join(sorted(_pieces(line))) for line in str(text).splitlines()]
    return "\n".join(sorted(line for line in lines if line))
