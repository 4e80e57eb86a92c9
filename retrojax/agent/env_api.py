"""The environment interface of the trial loop: one API for functional JAX worlds and host text worlds.

The trial loop (``trial.py``) is a host-side state machine per trial; the runner (``runner.py``) advances
all live trials together in *ticks*. Every environment call therefore takes a **batch of slots**: a slot
is one trial's private copy of the world, i.e. its active path ``C_0 … C_k`` (the trail). Slots are
integers ``0 … num_slots-1`` fixed when the env is opened; the runner maps trial → slot.

Two kinds of world fit the same interface:

- **Functional JAX worlds** (Sokoban, MineSweeper): all slots' trails live on device as one batched
  ``envs.trail.Trail`` (leading axes ``[num_slots, capacity, ...]``). ``step`` is ONE vmapped, jitted call
  over all slots with a mask for the slots that act this tick (static shapes, one compile); it applies the
  primitive moves and pushes the new checkpoint. ``rewind`` is one vmapped ``trail_rewind``. Rendering,
  state keys and progress lookups read the current states back to the host once per call.
- **Host text worlds** (ScienceWorld, ALFWorld): each slot is an engine in a worker pool; ``step`` sends
  one batch of host calls to the pool; ``rewind`` resets the engine and replays the retained action path
  (the adapter keeps each slot's path; it sees every ``step`` and ``rewind``).

Contract of the methods (``slots`` and the per-slot argument lists have equal length; a slot appears at
most once per call):

- ``open(num_slots, capacity)`` allocates storage; ``capacity`` is the most checkpoints one active path
  can hold (branch budget + 1, since every checkpoint costs at least one branch turn).
- ``reset(slots, tasks)`` starts each slot at ``C_0`` of task ``tasks[i]`` (an index into the env's
  loaded split, ``0 … num_tasks-1``) and returns a :class:`StepInfo` for ``C_0`` (reward 0).
- ``step(slots, actions)`` executes each :class:`Action` (kind ``MOVE``; the loop never sends rewinds
  or invalid actions here) from the slot's newest checkpoint ``C_k`` and, when the world accepts it,
  pushes ``C_{k+1}``. A world may reject an action it cannot judge at parse time (a text engine's
  "I don't understand"): ``StepInfo.valid=False``, nothing changes, no checkpoint is pushed, and the
  loop counts an invalid turn with ``message`` as the reason.
- ``rewind(slots, targets)`` truncates each slot's active path to ``C_0 … C_j`` (``0 ≤ j ≤ k``, checked
  by the loop); the current state becomes ``C_j``.
- ``observations(slots)`` renders the current state of each slot as the text the agent sees.
- ``parse_action(text)`` turns the *content* of the final action tag (already extracted by
  ``parse.extract_action``) into an :class:`Action`: a world move, a rewind request, or an invalid
  action with a short reason. It never raises. Whether a rewind is allowed (``0 ≤ j < k``, protocol,
  budgets) is the loop's business, not the env's.
- ``branch_value(progress, solved, failed)`` is V(branch | s_j): the progress of a branch from its anchor
  state. ``progress`` lists ``StepInfo.progress`` along the branch, anchor first (``C_j, …, end``);
  ``solved``/``failed`` describe the branch's end. Sokoban: ``d0 − d_end`` (exact solver distances;
  ``d_end = 0`` when solved, ``= d0`` when dead); MineSweeper: the sum of rewards after the anchor;
  text worlds: the maximum score along the branch including its start.
- ``expert_actions(slots)`` / ``random_actions(slots, rng, avoid)``: action *texts* for scripted policies
  (the solver's or planner's best next action; a well-formed random action not in ``avoid``).
- ``recovery_context`` says how branch memory enters the resumed context (D.3): ``memory_turn`` (the
  games: the ``C_j`` prefix plus a memory user turn), ``observation`` (ScienceWorld: the prefix, memory in
  the next observation), ``rebuild`` (ALFWorld: system message + restored observation + memories, and the
  branch allowance starts again). ``value_from_initial`` makes the loop pass ``C_0``'s progress figure
  first to ``branch_value`` (Sokoban: V = d_0 − d_end with d_0 of the initial state).
- ``task_scale(task)`` (optional) gives a task's progress scale for ``TrialRecord.d0`` (Sokoban: the
  shortest solution length); without it ``d0`` is the progress figure at ``C_0`` when finite.
- ``action_style`` says how outputs mark their action (``tag`` or ``fence``, see ``parse.extract_action``).
- ``prompt_key`` and ``prompt_fields(task)`` select and fill the prompt templates
  (``retrojax.agent.prompts``): the key names the template family, the fields carry task facts such as
  the board size or a text world's goal.

Scores: the loop keeps the path score S per checkpoint. When ``StepInfo.score`` is None (the games) S is
the cumulative reward along the retained path from ``s_0``; a world with its own score (text worlds)
reports it and the loop uses it as S.

Worlds are created by name through :func:`make_env`; built-in factories are registered below as
``module:function`` strings (imported lazily) and others can be added with :func:`register_env`.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MOVE = "move"  # an action the world executes (one or more primitive moves, a reveal, a command)
REWIND = "rewind"  # "rewind to C_j"
INVALID = "invalid"  # anything else; ``reason`` says why


@dataclasses.dataclass(frozen=True)
class Action:
    """A parsed action.

    ``text`` is the canonical form ("up, left", "(2, 3)", "rewind to C_1", a text command). ``code`` is
    the world's encoding of a ``MOVE`` for a functional env (Sokoban: move ids; MineSweeper: 0-indexed
    ``(row, col)``); text worlds leave it empty and use ``text`` as the command. ``target`` is the
    checkpoint index of a ``REWIND``; ``reason`` explains an ``INVALID`` action.
    """

    kind: str
    text: str = ""
    code: tuple[int, ...] = ()
    target: int = -1
    reason: str = ""

    @property
    def is_move(self) -> bool:
        return self.kind == MOVE

    @property
    def is_rewind(self) -> bool:
        return self.kind == REWIND

    @property
    def is_invalid(self) -> bool:
        return self.kind == INVALID


def invalid(reason: str, text: str = "") -> Action:
    """An invalid action with its reason (shown to the agent in the next user turn)."""
    return Action(kind=INVALID, text=text, reason=reason)


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the loop learns about a slot after ``reset`` or ``step``.

    ``reward`` is δ, the sum of the rewards of the primitive moves of this decision. ``solved``/``failed``
    are the world's terminal flags at the new state (failure = irreversible: Sokoban dead state,
    MineSweeper mine, a text world done without a win). ``progress`` is the figure ``branch_value`` reads
    (Sokoban: exact solver distance, ``inf`` when dead; MineSweeper: cumulative reward; text worlds:
    score). ``state_key`` is a hash of the world state (``state_key_of_arrays`` for array states).
    ``message`` is a one-line outcome for the branch history ("pushed a box onto a target",
    "opened 5 cells", an engine's reply) or, when ``valid`` is False, why the world rejected the action.
    ``moves`` counts the primitive moves executed (actions to success).
    """

    reward: float = 0.0
    solved: bool = False
    failed: bool = False
    progress: float = 0.0
    state_key: str = ""
    message: str = ""
    valid: bool = True
    moves: int = 0
    score: float | None = None


class TrialEnv(abc.ABC):
    """A batch of trial slots over one world and one split. See the module docstring for the contract."""

    name: str = "env"
    prompt_key: str = "env"  # template family in retrojax.agent.prompts
    action_style: str = "tag"  # "tag": <action>…</action>; "fence": a fenced ```action block (parse.py)
    recovery_context: str = "memory_turn"  # D.3: memory_turn | observation | rebuild (see agent/trial.py)
    value_from_initial: bool = False  # branch_value's progress starts with C_0's figure (Sokoban, C.2)

    @property
    @abc.abstractmethod
    def num_tasks(self) -> int:
        """Tasks in the loaded split; task ids are ``0 … num_tasks-1``."""

    @abc.abstractmethod
    def open(self, num_slots: int, capacity: int) -> None:
        """Allocate ``num_slots`` slots, each holding up to ``capacity`` checkpoints."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources (worker processes, device buffers). Safe to call twice."""

    @abc.abstractmethod
    def reset(self, slots: Sequence[int], tasks: Sequence[int]) -> list[StepInfo]:
        """Start each slot at ``C_0`` of its task."""

    @abc.abstractmethod
    def step(self, slots: Sequence[int], actions: Sequence[Action]) -> list[StepInfo]:
        """Execute one ``MOVE`` per slot from its newest checkpoint and push the new checkpoint."""

    @abc.abstractmethod
    def rewind(self, slots: Sequence[int], targets: Sequence[int]) -> None:
        """Truncate each slot's active path to ``C_0 … C_j``."""

    @abc.abstractmethod
    def observations(self, slots: Sequence[int]) -> list[str]:
        """The text the agent sees for each slot's current state."""

    @abc.abstractmethod
    def parse_action(self, text: str) -> Action:
        """The content of the final action tag → ``Action`` (never raises)."""

    @abc.abstractmethod
    def branch_value(self, progress: Sequence[float], solved: bool, failed: bool) -> float:
        """V(branch | anchor) from the progress figures along the branch (anchor first)."""

    def endpoint_progress(self, progress: Sequence[float], score: float, solved: bool, failed: bool) -> float:
        """Task progress at the end of a retained path ``C_0 … C_k`` (from its progress figures and cumulative
        reward): the endpoint score S that ``learn.task_score=progress`` normalizes. Default: the cumulative
        reward (C.2 for MineSweeper, "S accumulates rewards along the retained path"; the text worlds'
        endpoint score)."""
        return float(score)

    @abc.abstractmethod
    def expert_actions(self, slots: Sequence[int]) -> list[str | None]:
        """The best next action text per slot (None when the world knows none, e.g. a dead state)."""

    #: ``optimal_actions`` lists every best action and is cheap enough to ask at each decision (the runner's
    #: ``record_best``); worlds with one expert action, or an expensive one, leave it False
    lists_best_actions: bool = False

    def optimal_actions(self, slots: Sequence[int]) -> list[list[str]]:
        """Every best next action per slot, where a world knows more than one (default: the expert's)."""
        return [[] if a is None else [a] for a in self.expert_actions(slots)]

    @abc.abstractmethod
    def random_actions(
        self, slots: Sequence[int], rng: np.random.Generator, avoid: Sequence[frozenset[str]] = ()
    ) -> list[str]:
        """A well-formed random action text per slot, avoiding the given texts when possible."""

    def prompt_fields(self, task: int) -> dict[str, Any]:
        """Task facts for the prompt templates (board size, mine count, goal, …)."""
        return {}

    def __enter__(self) -> TrialEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Functions shared by adapters
# --------------------------------------------------------------------------------------------------


def state_key_of_arrays(*arrays: np.ndarray) -> str:
    """A stable 16-hex-digit hash of arrays' dtypes, shapes and bytes (the state key)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def text_key(*parts: str) -> str:
    """A stable 16-hex-digit hash of strings (history keys, text-world state keys)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------

EnvFactory = Callable[..., TrialEnv]

# name → "module:function"; the function is called as factory(cfg, split=...) and returns a TrialEnv.
_FACTORIES: dict[str, str | EnvFactory] = {
    "sokoban": "retrojax.agent.games:make_sokoban",
    "minesweeper": "retrojax.agent.games:make_minesweeper",
    "scienceworld": "retrojax.agent.textworld_env:make_scienceworld",
    "alfworld": "retrojax.agent.textworld_env:make_alfworld",
}


def register_env(name: str, factory: str | EnvFactory) -> None:
    """Register a world: ``factory`` is a callable or a ``module:function`` string imported lazily."""
    _FACTORIES[name] = factory


def registered_envs() -> list[str]:
    return sorted(_FACTORIES)


def check_env_config(cfg: Any) -> None:
    """Raise ``ValueError`` for an unknown world name, an empty task selection or an observation option the
    world does not have (cheap: commands call it before their first stage)."""
    name = cfg.env.name
    if name not in _FACTORIES:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(registered_envs())}")
    if cfg.env.num_tasks is not None and cfg.env.num_tasks < 1:
        raise ValueError(f"env.num_tasks must be ≥ 1 (null: every task of the split), "
                         f"got {cfg.env.num_tasks}")
    for option in ("board_notes", "push_notes"):
        if getattr(cfg.env, option, False) and name != "sokoban":
            raise ValueError(f"env.{option} is a Sokoban observation option; {name!r} has none")


def make_env(cfg: Any, split: str | None = None) -> TrialEnv:
    """The world named by ``cfg.env.name`` over ``split`` (``NAME:train|test|val``; default: the config's).

    Raises ``ValueError`` for a setting ``check_env_config`` refuses.
    """
    check_env_config(cfg)
    factory = _FACTORIES[cfg.env.name]
    if isinstance(factory, str):
        module, func = factory.split(":")
        factory = getattr(importlib.import_module(module), func)
    return factory(cfg, split=split)
