"""A tiny pure-Python ``TrialEnv`` for RIR tests: a walk along a line to a goal cell.

Actions: ``right`` (+1), ``left`` (−1, not below 0), ``wait`` (no effect), ``fall`` (an irreversible
failure). The goal is cell ``length``. Every pushed checkpoint's observation carries a unique marker
``MK<n>`` so tests can tell which observations were abandoned by a rollback. ``rewinds`` counts rewind calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from retrojax.agent.env_api import MOVE, Action, StepInfo, TrialEnv, invalid, text_key

ACTIONS = ("right", "left", "wait", "fall")


class LineWorld(TrialEnv):
    name = "line"
    prompt_key = "line"

    def __init__(self, length: int = 6, tasks: int = 4):
        self.length, self._tasks = length, tasks
        self.paths: list[list[tuple[int, bool, str]]] = []
        self.counter = 0
        self.rewinds = 0

    @property
    def num_tasks(self) -> int:
        return self._tasks

    def open(self, num_slots: int, capacity: int) -> None:
        self.paths = [[] for _ in range(num_slots)]
        self.capacity = capacity

    def close(self) -> None:
        pass

    def _obs(self, pos: int, failed: bool) -> str:
        self.counter += 1
        return f"position {pos} of {self.length}{' (fallen)' if failed else ''} MK{self.counter}Z"

    def _info(self, slot: int, reward: float = 0.0) -> StepInfo:
        pos, failed, _ = self.paths[slot][-1]
        return StepInfo(
            reward=reward,
            solved=pos == self.length and not failed,
            failed=failed,
            progress=float(pos),
            state_key=self.key(pos, failed),
            message=f"at {pos}",
            moves=1,
        )

    @staticmethod
    def key(pos: int, failed: bool) -> str:
        return text_key(str(pos), str(failed))

    def state_key(self, slot: int) -> str:
        pos, failed, _ = self.paths[slot][-1]
        return self.key(pos, failed)

    def reset(self, slots: Sequence[int], tasks: Sequence[int]) -> list[StepInfo]:
        for s in slots:
            self.paths[s] = [(0, False, self._obs(0, False))]
        return [self._info(s) for s in slots]

    def step(self, slots: Sequence[int], actions: Sequence[Action]) -> list[StepInfo]:
        out = []
        for s, a in zip(slots, actions, strict=True):
            assert a.kind == MOVE
            pos, _, _ = self.paths[s][-1]
            if len(self.paths[s]) >= self.capacity:
                out.append(StepInfo(valid=False, message="full"))
                continue
            failed = a.text == "fall"
            new = (
                min(self.length, pos + 1)
                if a.text == "right"
                else max(0, pos - 1)
                if a.text == "left"
                else pos
            )
            self.paths[s].append((new, failed, self._obs(new, failed)))
            out.append(self._info(s, float(new - pos)))
        return out

    def rewind(self, slots: Sequence[int], targets: Sequence[int]) -> None:
        self.rewinds += 1
        for s, j in zip(slots, targets, strict=True):
            assert 0 <= j < len(self.paths[s])
            del self.paths[s][j + 1 :]

    def observations(self, slots: Sequence[int]) -> list[str]:
        return [self.paths[s][-1][2] for s in slots]

    def parse_action(self, text: str) -> Action:
        word = text.strip().lower()
        if word in ACTIONS:
            return Action(kind=MOVE, text=word)
        return invalid("unknown action", text)

    def branch_value(self, progress: Sequence[float], solved: bool, failed: bool) -> float:
        return -1.0 if failed else float(progress[-1]) - float(progress[0])

    def expert_actions(self, slots: Sequence[int]) -> list[str | None]:
        return [None if self.paths[s][-1][1] else "right" for s in slots]

    def random_actions(
        self, slots: Sequence[int], rng: np.random.Generator, avoid: Sequence[frozenset[str]] = ()
    ) -> list[str]:
        out = []
        for i, _ in enumerate(slots):
            banned = avoid[i] if i < len(avoid) else frozenset()
            options = [a for a in ACTIONS if a not in banned] or list(ACTIONS)
            out.append(options[int(rng.integers(len(options)))])
        return out
