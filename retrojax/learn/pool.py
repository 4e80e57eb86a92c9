"""The RL pool: which training levels RL plays (``learn.train_tasks``, ``learn.pool_lengths``).

By default RL draws from the first ``learn.train_tasks`` training levels (all of them when that is None).
``learn.pool_lengths = [lo, hi]`` (ours) keeps only levels whose reference solution length — the world's
``task_scale``: Sokoban's exact shortest solution, MineSweeper's reveals — lies in ``[lo, hi]``, then takes
the first ``train_tasks`` of those. Why: a GRPO group carries a success signal only when it holds both a
success and a failure. From the decision-weighted warm start the policy solved 88% of unseen 2-move rooms and
0-7% of longer ones, so most groups on the whole split were all solved or all failed (28% mixed over 30
updates). Measured (docs/findings.md; 2026-12-05, commit 533b79b): a pool of 3-4-move levels raised the
mixed share to 47%, and held-out success moved as much as with every level (+4.7 vs +5.4 points of 128
rooms), so this stays off by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class BadPool(ValueError):
    """A pool that cannot be built: a malformed range, a world without solution lengths, no level in range."""


def check_lengths(lengths: Sequence[int]) -> tuple[int, int]:
    """``(lo, hi)`` of a ``learn.pool_lengths`` value; :class:`BadPool` unless ``0 <= lo <= hi``."""
    if len(lengths) != 2 or not 0 <= int(lengths[0]) <= int(lengths[1]):
        raise BadPool(f"learn.pool_lengths must be [lo, hi] with 0 <= lo <= hi, got {list(lengths)}")
    return int(lengths[0]), int(lengths[1])


def rl_pool(env: Any, train_tasks: int | None = None, lengths: Sequence[int] | None = None) -> list[int]:
    """Task ids RL plays on ``env`` (a training split), in level order.

    Raises :class:`BadPool` (a ValueError) for a malformed range, a world without solution lengths, or a
    range no level meets.
    """
    n = int(env.num_tasks)
    if lengths is None:
        return list(range(n if train_tasks is None else min(n, int(train_tasks))))
    lo, hi = check_lengths(lengths)
    scale = getattr(env, "task_scale", None)
    if scale is None:
        raise BadPool(f"learn.pool_lengths needs a world with solution lengths (task_scale); "
                      f"{type(env).__name__} has none")
    found = [float(scale(t)) for t in range(n)]
    pool = [t for t, d in enumerate(found) if lo <= d <= hi]
    if not pool:
        seen = sorted({int(d) for d in found if d == d and d != float("inf")})
        raise BadPool(f"learn.pool_lengths [{lo}, {hi}] selects no training level; "
                         f"the split's solution lengths are {seen}")
    return pool if train_tasks is None else pool[:int(train_tasks)]
