"""The review schedule (Eqs. 3 and 5): when a scheduled review is due and how the horizon L moves.

A review is due when the agent replies since the last review reach L. After a Continue verdict with urgency
ρ the next horizon is ``L = L_min + (1 − ρ)(L_max − L_min)`` (adaptive mode); after a rollback L returns to
``L_0``. ρ is clamped to [0, 1] (``+inf`` → 1, ``−inf`` → 0); a missing or malformed ρ (NaN, not a number)
takes ``default_urgency`` (0.5: the middle of the range). The fixed mode never changes L (it stays ``L_0``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

DEFAULT_URGENCY = 0.5


def clamp_urgency(rho: Any, default: float = DEFAULT_URGENCY) -> float:
    """ρ as a float in [0, 1]; anything that is not a number (or NaN) gives ``default``."""
    try:
        value = float(rho)
    except (TypeError, ValueError, OverflowError):
        return default
    if math.isnan(value):
        return default
    return min(1.0, max(0.0, value))


def horizon(rho: Any, l_min: float, l_max: float, default: float = DEFAULT_URGENCY) -> float:
    """Eq. 5: the next review horizon after a Continue verdict with urgency ``rho``."""
    r = clamp_urgency(rho, default)
    value = l_min + (1.0 - r) * (l_max - l_min)
    return min(l_max, max(l_min, value))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Horizon bounds and mode. ``l_0`` is the horizon at the start and after every rollback."""

    l_min: float = 4.0
    l_max: float = 8.0
    l_0: float = 4.0
    adaptive: bool = True
    default_urgency: float = DEFAULT_URGENCY

    def __post_init__(self) -> None:
        if not (1 <= self.l_min <= self.l_max):
            raise ValueError(f"need 1 ≤ L_min ≤ L_max, got ({self.l_min}, {self.l_max})")
        if not self.l_min <= self.l_0 <= self.l_max:
            raise ValueError(f"L_0 = {self.l_0} must lie in [L_min, L_max] = [{self.l_min}, {self.l_max}]")
        if not 0.0 <= self.default_urgency <= 1.0:
            raise ValueError(f"default urgency must lie in [0, 1], got {self.default_urgency}")

    def due(self, since_review: int, current: float) -> bool:
        """Eq. 3's scheduled part: ``t − t_rev ≥ L_t``."""
        return since_review >= current

    def after_continue(self, current: float, rho: Any) -> float:
        if not self.adaptive:
            return current
        return horizon(rho, self.l_min, self.l_max, self.default_urgency)

    def after_rollback(self) -> float:
        return self.l_0
