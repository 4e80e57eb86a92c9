"""Execution signals ξ_t: cheap facts about the current branch that the reviewer reads (Eq. 4).

Computed by the controller, never by a model, and only from what the agent itself could observe: the
actions it sent, the observations the world showed (compared as text: a repeat is the same visible
observation), the score the world shows (:func:`retrojax.agent.rir.summaries.visible_score`: boxes on
targets, open cells, ScienceWorld's score; none for ALFWorld), its own invalid replies, and the world's
terminal flag (the game ends on a dead Sokoban state, a mine, a failed text task, and says so). Hidden
figures — a solver's distance, ``branch_value``, a goal-condition fraction — never enter ξ_t.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Signals:
    repeated_actions: int = 0  # times the newest action repeats the one before it, consecutively
    no_effect_steps: int = 0  # executed steps whose observation equals the one before them
    state_cycles: int = 0  # checkpoints whose observation already appeared earlier on the path
    steps_since_gain: int | None = (
        None  # steps since the visible score last rose (None: the world shows none)
    )
    invalid_replies: int = 0  # invalid agent replies since the last review
    failed: bool = False  # the world reports an irreversible failure at the current checkpoint
    current_revisits: bool = False  # the current observation appeared earlier on the path (a cycle closes)

    def render(self) -> str:
        gain = (
            ""
            if self.steps_since_gain is None
            else f"steps since the visible score last rose: {self.steps_since_gain}; "
        )
        return (
            f"repeated actions: {self.repeated_actions}; no-effect steps: {self.no_effect_steps}; "
            f"repeated observations: {self.state_cycles}"
            f"{' (the current observation was seen before on this path)' if self.current_revisits else ''}; "
            f"{gain}invalid replies since the last review: {self.invalid_replies}; "
            f"irreversible failure: {'yes' if self.failed else 'no'}"
        )


def compute(
    observed: Sequence[str],
    actions: Sequence[str],
    scores: Sequence[float | None],
    failed: bool,
    invalid_replies: int = 0,
) -> Signals:
    """ξ_t for a path ``C_0 … C_t``: ``observed`` is a key of each checkpoint's visible observation,
    ``scores`` the score the world shows there (None where it shows none); ``actions`` create
    ``C_1 … C_t``."""
    repeated = 0
    for i in range(len(actions) - 1, 0, -1):
        if actions[i] != actions[i - 1]:
            break
        repeated += 1
    no_effect = sum(1 for i in range(1, len(observed)) if observed[i] == observed[i - 1])
    seen: set[str] = set()
    cycles = 0
    for key in observed:
        if key in seen:
            cycles += 1
        seen.add(key)
    since: int | None = None
    shown = [(i, s) for i, s in enumerate(scores) if s is not None]
    if shown:
        last_best, best = 0, float("-inf")
        for i, s in shown:
            if s > best:
                best, last_best = s, i
        since = len(scores) - 1 - last_best
    revisits = bool(observed) and observed[-1] in observed[:-1]
    return Signals(repeated, no_effect, cycles, since, int(invalid_replies), bool(failed), revisits)
