"""Execution signals ξ_t: cheap facts about the current branch that the reviewer reads (Eq. 4).

Computed by the controller from the checkpoint path (state keys, actions, values) and the world's replies,
never by a model: repeated actions, no-effect steps, state cycles, steps since progress last rose, invalid
replies since the last review, and whether the world reports an irreversible failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Signals:
    repeated_actions: int = 0  # times the newest action repeats the one before it, consecutively
    no_effect_steps: int = 0  # executed steps on the path that left the state key unchanged
    state_cycles: int = 0  # checkpoints on the path whose state already appeared earlier on it
    steps_since_progress: int = 0  # steps since the branch value last reached a new best
    invalid_replies: int = 0  # invalid agent replies since the last review
    failed: bool = False  # the world reports an irreversible failure at the current checkpoint
    current_revisits: bool = False  # the current state appeared earlier on the path (a cycle closes here)

    def render(self) -> str:
        return (
            f"repeated actions: {self.repeated_actions}; no-effect steps: {self.no_effect_steps}; "
            f"state cycles: {self.state_cycles}"
            f"{' (the current state was visited before)' if self.current_revisits else ''}; "
            f"steps since progress last rose: {self.steps_since_progress}; "
            f"invalid replies since the last review: {self.invalid_replies}; "
            f"irreversible failure: {'yes' if self.failed else 'no'}"
        )


def compute(
    keys: Sequence[str],
    actions: Sequence[str],
    values: Sequence[float],
    failed: bool,
    invalid_replies: int = 0,
) -> Signals:
    """ξ_t for a path ``C_0 … C_t``: ``keys``/``values`` per checkpoint, ``actions`` create ``C_1 … C_t``."""
    repeated = 0
    for i in range(len(actions) - 1, 0, -1):
        if actions[i] != actions[i - 1]:
            break
        repeated += 1
    no_effect = sum(1 for i in range(1, len(keys)) if keys[i] == keys[i - 1])
    seen: set[str] = set()
    cycles = 0
    for key in keys:
        if key in seen:
            cycles += 1
        seen.add(key)
    last_best, best = 0, float("-inf")
    for i, v in enumerate(values):
        if v > best:
            best, last_best = v, i
    since = (len(values) - 1 - last_best) if values else 0
    revisits = bool(keys) and keys[-1] in keys[:-1]
    return Signals(repeated, no_effect, cycles, since, int(invalid_replies), bool(failed), revisits)
