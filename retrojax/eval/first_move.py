"""Does a policy read the board? The share of trials whose first move is one of the expert's best at ``C_0``.

A policy that ignores the board samples the same first moves on every level: on a pool whose levels want
different first moves its agreement with the expert stays near the pool's marginal, however well it scores by
luck and rewinds. That is what stalled ReTRAIL's RL on the demo's 4-level pool (docs/findings.md), so
the demo and ``retrojax bench learn`` report this figure beside success.

A trial's first decision counts as agreeing when its first primitive move (Sokoban: the first move of
``up, left``; MineSweeper: the cell) is one of the world's optimal actions at the level's start
(``TrialEnv.optimal_actions``); an invalid reply or a rewind disagrees. Worlds that name no expert action
give ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from retrojax.agent.archive import EXECUTION, Archive


def _primitive(action: Any, width: int) -> tuple:
    """The first ``width`` codes of a parsed move (its first primitive), or its text for text worlds."""
    return tuple(action.code[:width]) if action.code else (action.text,)


class FirstMoveProbe:
    """The expert's best first moves per task (looked up once, in a world of its own) and agreement rates.

    ``make_env`` builds a fresh world over the split (so a runner's open world is never disturbed); it is
    opened only for tasks not seen before and closed straight away.
    """

    def __init__(self, make_env: Callable[[], Any]):
        self.make_env = make_env
        self.best: dict[int, set[tuple]] = {}
        self.parse: Callable[[str], Any] | None = None

    def _lookup(self, tasks: Iterable[int]) -> None:
        missing = sorted({int(t) for t in tasks} - set(self.best))
        if not missing:
            return
        env = self.make_env()
        try:
            env.open(len(missing), 2)
            slots = list(range(len(missing)))
            env.reset(slots, missing)
            for task, options in zip(missing, env.optimal_actions(slots), strict=True):
                parsed = [env.parse_action(text) for text in options]
                self.best[task] = {_primitive(a, len(a.code)) for a in parsed if a.is_move}
            self.parse = env.parse_action
        finally:
            env.close()

    def agreement(self, archive: Archive) -> float | None:
        """Share of ``archive``'s trials whose first decision starts with an expert move (None: no expert)."""
        firsts: dict[int, Any] = {}
        for c in archive.calls:
            if c.role == EXECUTION and (c.trial not in firsts or c.call_index < firsts[c.trial].call_index):
                firsts[c.trial] = c
        if not firsts:
            return None
        self._lookup(c.task for c in firsts.values())
        hits, counted = 0, 0
        for c in firsts.values():
            best = self.best.get(c.task)
            if not best:
                continue  # the world names no expert action here
            counted += 1
            if c.valid and not c.is_rewind and c.action and self.parse is not None:
                width = len(next(iter(best)))
                hits += _primitive(self.parse(c.action), width) in best
        return hits / counted if counted else None
