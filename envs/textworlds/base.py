"""The host-side text-world interface shared by ScienceWorld and ALFWorld.

Text engines run outside jit and cannot snapshot their state, so a world only has to offer
``reset(task)``, ``step(action)`` and a few on-demand queries (admissible actions, an expert's next
action). Everything about checkpoints and rewinds (reset + replay of the retained path) lives in
``bridge.py``; everything about processes lives in ``pool.py``.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from typing import Any


def digest(*parts: str) -> str:
    """A stable 16-hex-digit hash of strings (engine state keys)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


class TextWorldError(RuntimeError):
    """A per-trial failure of the bridge (engine error, dead worker twice, replay divergence)."""


class ReplayDivergence(TextWorldError):
    """Reset + replay of the retained path did not reproduce the observation recorded at C_j."""

    def __init__(self, message: str, replayed: int = 0, at_order_dependent: bool = False):
        super().__init__(message)
        self.replayed = replayed  # actions the failed replay ran (counted like any replayed action)
        self.at_order_dependent = at_order_dependent  # found right after an order-dependent action


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a text world reports after a reset or a step.

    ``score`` is the world's own scale (ScienceWorld 0–100; ALFWorld 100 × progress), ``progress`` is
    in [0, 1] (ScienceWorld score/100 clipped at 0; ALFWorld the fraction of goal conditions that
    hold). ``valid`` is False when the engine did not recognise the action (the observation is then
    the engine's own message). ``changed`` says whether the engine state may have moved — an invalid
    action that did not change it keeps the retained path exact without a replay. ``key`` is a digest of
    the engine state (ALFWorld: its PDDL facts; ScienceWorld: the room, inventory and score, in their
    order-free canonical form), so equal states reached by different paths share it; a replay checks it.
    ``admissible`` is filled only when a call asks for it.
    """

    text: str
    score: float
    progress: float
    done: bool
    won: bool
    reward: float = 0.0
    valid: bool = True
    changed: bool = True
    moves: int = 0
    key: str = ""
    admissible: dict[str, list[str]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TextWorld(abc.ABC):
    """One engine instance (lives inside one worker process). Tasks are plain strings."""

    name: str = "textworld"

    @abc.abstractmethod
    def reset(self, task: str) -> Observation:
        """Start ``task`` from its initial state."""

    @abc.abstractmethod
    def step(self, action: str, full: bool = True) -> Observation:
        """Apply one action; an unknown action returns the engine's message with ``valid=False``.

        ``full=False`` (intermediate steps of a replay) may skip the state key and progress figures.
        """

    @abc.abstractmethod
    def admissible(self) -> dict[str, list[str]]:
        """Actions a prompt may list, computed on demand (e.g. ``{"actions": [...]}``)."""

    @abc.abstractmethod
    def candidates(self) -> list[str]:
        """Concrete actions a random player may pick from (valid or admissible commands)."""

    @abc.abstractmethod
    def expert_action(self) -> str | None:
        """The expert's next action from the current state (gold path / planner); None when none."""

    @abc.abstractmethod
    def goal(self) -> str:
        """The current task's goal text."""

    def canonical(self, text: str) -> str:
        """The form in which a replayed observation must equal the recorded one (default: exact text).

        A world whose engine lists objects in a per-reset order overrides this with an order-free form.
        """
        return text

    # replays from a fresh reset a restore may take to reproduce the recorded state (see pool._reach):
    # in all, and when the mismatch shows right after an order-dependent action (a cheap prefix replay)
    replay_attempts: int = 1
    order_attempts: int = 1

    def order_dependent(self, action: str) -> bool:
        """Whether ``action``'s effect may depend on the per-reset listing order (a replay then checks
        the state key right after it, so a wrong outcome is retried at once). Default: never."""
        return False

    def child_pids(self) -> list[int]:
        """Processes the engine started (e.g. a JVM), so the pool can check a clean shutdown."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (stop its JVM, close its game)."""
