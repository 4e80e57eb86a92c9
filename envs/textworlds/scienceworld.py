"""ScienceWorld through its fast server path.

The PyPI wrapper's ``env.step`` recomputes every valid action-object combination after each step
(hundreds of ms); here a step is the Java server's own ``step`` plus the score, and admissible actions
are computed only when asked. A task is ``"<task-name>:<variation>"``; task splits follow
ScienceWorld's own train/dev/test variation split. Score is ScienceWorld's 0–100 (negative = failed).
ScienceWorld's gold-path generator picks among equivalent solutions at random, so the first gold
path generated for a task is stored on disk (first writer wins) and every worker — a restarted one
included — follows that same path. The engine is kept loaded without gold-path generation so that
resets stay cheap.

Partitions L0, L1, L2 (:func:`level_tasks`). ReTRAIL's Table 5 says only "ScienceWorld uses the L0
partition"; the names come from RLVMR (built on verl-agent), which ships each partition as lists of
``[task_index, variation]`` pairs under the keys ``train`` and ``test``, ``task_index`` into the engine's
``get_task_names()`` (alphabetical order). We derived the rules from RLVMR's ``L0_idx.json``,
``L1_idx.json`` and ``L2_idx.json`` by comparing their pairs with this engine's own variation lists:

- L0 (3322 train / 1661 test pairs): 29 task types, every one except ``use-thermometer``; train = each
  type's ScienceWorld *train* variations, test = each type's ScienceWorld *dev* variations. Seen types,
  unseen variations; no (type, variation) pair is shared.
- L1 (3322 / 1684): the same 29 types; train = their *train* variations (as L0), test = their ScienceWorld
  *test* variations.
- L2 (2242 / 549): unseen types. Test = the ScienceWorld *test* variations of the 10 types in
  :data:`L2_HELD_OUT`; train = the *train* variations of the other 19 (``use-thermometer`` again left out).
  The held-out list is RLVMR's choice (mostly the last variant of each topic); we take it as given.

Evidence: every pair of L0 and L2 was compared (no pair missing, extra or repeated); for L1 the first and
last pages were compared pair by pair and the file's size (262579 characters) equals, to the character,
that of the rule's pairs written the way the files are (``json.dump`` with ``indent=4``), as it also does for
L0 (260892) and L2 (146103). The files order pairs by type with variations shuffled (their sampler draws
pairs at random); ours interleaves the types (variation 1 of every type, then variation 2, …) so that the
first N tasks of a part, which ``env.num_tasks`` / ``--tasks`` keep, cover many types; the pair sets are the
same. Why RLVMR leaves out ``use-thermometer`` is not stated there; we follow the files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from envs.textworlds.base import Observation, TextWorld, digest
from envs.textworlds.canonical import listing_canonical

UNKNOWN_ACTION = "No known action matches that input."
SPLIT_PARTS = ("train", "dev", "test")
LEVELS = ("L0", "L1", "L2")  # partitions by generalization level (see the module docstring)
L0_EXCLUDED = ("use-thermometer",)  # the one task type RLVMR's partitions leave out
L2_HELD_OUT = (  # L2's test types, never trained on
    "change-the-state-of-matter-of", "chemistry-mix-paint-tertiary-color", "find-plant", "grow-plant",
    "identify-life-stages-2", "inclined-plane-friction-unnamed-surfaces",
    "lifespan-longest-lived-then-shortest-lived", "measure-melting-point-unknown-substance",
    "mendelian-genetics-unknown-plant", "test-conductivity-of-unknown-substances",
)
LEVEL_PARTS = {  # level -> part -> the ScienceWorld variation list it uses
    "L0": {"train": "train", "test": "dev"},
    "L1": {"train": "train", "test": "test"},
    "L2": {"train": "train", "test": "test"},
}


def parse_task(task: str) -> tuple[str, int]:
    """``"boil:3"`` → ``("boil", 3)`` with a clear error for anything else."""
    name, sep, var = str(task).rpartition(":")
    if not sep or not name or not var.strip().lstrip("-").isdigit():
        raise ValueError(f"ScienceWorld task must look like 'task-name:variation', got {task!r}")
    return name.strip(), int(var)


def task_names() -> list[str]:
    """ScienceWorld's 30 task names, read from the package's own task table (no JVM needed)."""
    from scienceworld.constants import TASKS

    return [t["task_name"] for t in TASKS]


class ScienceWorld(TextWorld):
    """One ScienceWorld JVM. ``step_limit`` ends an episode after that many moves (as the wrapper)."""

    name = "scienceworld"
    # a container's objects come out in a new order at each reset (a hash set in the engine), so a
    # numbered answer to "Ambiguous request" can pick another identically named object on replay: the
    # pool checks the state right after it and replays again from a fresh reset (measured: the order
    # comes in streaks, up to 15 resets before a given cup of three came first); other mismatches
    # (e.g. the engine's order-dependent heat transfer) get a few fresh replays, then are an error
    replay_attempts = 3
    order_attempts = 64

    def __init__(self, step_limit: int = 100, simplifications: str = "", cache_dir: str | None = None):
        from scienceworld import ScienceWorldEnv

        self.step_limit = int(step_limit)
        self.simplifications = simplifications
        self._env = ScienceWorldEnv("", envStepLimit=self.step_limit)
        self._server = self._env.server
        self._loaded: tuple[str, int] | None = None
        self._gold: dict[tuple[str, int], list[str]] = {}
        self._gold_dir = _cache_root(cache_dir) / "scienceworld_gold"
        self._history: list[str] = []
        self._last_score = 0.0
        self._task: tuple[str, int] | None = None

    # --- engine -----------------------------------------------------------------------------
    def _load(self, name: str, variation: int, gold: bool = False) -> None:
        names = set(task_names())
        if name not in names:
            raise ValueError(f"unknown ScienceWorld task '{name}' (known: {', '.join(sorted(names))})")
        limit = int(self._server.getTaskMaxVariations(name))
        if not 0 <= variation < limit:
            raise ValueError(f"ScienceWorld task '{name}' has variations 0..{limit - 1}, got {variation}")
        self._server.load(name, variation, self.simplifications, gold)
        self._loaded = None if gold else (name, variation)

    def _observe(self, text: str, valid: bool, changed: bool, full: bool = True) -> Observation:
        score = float(round(100 * float(self._server.getScore())))
        moves = int(self._server.getNumMoves())
        completed = bool(self._server.getCompleted())
        done = completed or score < 0 or moves > self.step_limit
        reward = score - self._last_score
        self._last_score = score
        key = digest(f"{self._task}", self.canonical(str(self._server.freeActionLook())),
                     self.canonical(str(self._server.freeActionInventory())), f"{score}") if full else ""
        return Observation(
            text=str(text),
            score=score,
            progress=min(1.0, max(0.0, score / 100.0)),
            done=done,
            won=score >= 100.0,
            reward=reward,
            valid=valid,
            changed=changed,
            moves=moves,
            key=key,
        )

    def reset(self, task: str) -> Observation:
        name, variation = parse_task(task)
        if self._loaded != (name, variation):
            self._load(name, variation)
        else:
            self._server.reset()
        self._history = []
        self._last_score = 0.0
        self._task = (name, variation)
        return self._observe(self._server.step("look around"), True, True)

    def step(self, action: str, full: bool = True) -> Observation:
        action = str(action).strip()
        before = int(self._server.getNumMoves())
        text = str(self._server.step(action))
        valid = text.strip() != UNKNOWN_ACTION
        if valid:
            self._history.append(action)
        changed = valid or int(self._server.getNumMoves()) != before
        return self._observe(text, valid, changed, full)

    # --- on-demand queries ------------------------------------------------------------------
    def admissible(self) -> dict[str, list[str]]:
        """Action templates and visible objects (cheap; what the prompt lists)."""
        return {
            "templates": sorted(str(a) for a in self._server.getPossibleActions()),
            "objects": sorted(str(o) for o in self._server.getPossibleObjects()),
        }

    def candidates(self) -> list[str]:
        """Every valid action-object combination (slow: about a second; only for random players)."""
        return sorted(str(a) for a in self._server.getValidActionObjectCombinations())

    def gold_path(self, task: str) -> list[str]:
        """ScienceWorld's gold path for ``task`` (cached; costs one gold-path load the first time)."""
        key = parse_task(task)
        if key in self._gold:
            return list(self._gold[key])
        path = self._gold_dir / f"{key[0]}-{key[1]}{self.simplifications and '-' + self.simplifications}.json"
        if not path.exists():
            self._load(*key, gold=True)
            gold = [str(a) for a in self._server.getGoldActionSequence()]
            self._gold_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(gold))
            try:
                os.link(tmp, path)  # atomic, and the first writer wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        self._gold[key] = json.loads(path.read_text())
        return list(self._gold[key])

    def expert_action(self) -> str | None:
        """The next gold-path action not yet taken since reset (None once the gold path is used up).

        Actions off the gold path are skipped over: the gold path's actions are matched in order
        against the history, so a harmless detour leaves the expert where it was.
        """
        if self._task is None:
            raise RuntimeError("expert_action before any reset")
        name, variation = self._task
        history = list(self._history)
        gold = self.gold_path(f"{name}:{variation}")
        if self._loaded != (name, variation):  # a gold-path load replaced the engine's state
            self.reset(f"{name}:{variation}")
            for action in history:
                self.step(action)
        if gold and gold[0] == "look around":  # the reset's own first action
            gold = gold[1:]
        matched = 0
        for action in history:
            if matched < len(gold) and action == gold[matched]:
                matched += 1
        return gold[matched] if matched < len(gold) else None

    def goal(self) -> str:
        return str(self._server.getTaskDescription())

    def canonical(self, text: str) -> str:
        """Listings in an order-free form: the engine orders a container's objects anew at each reset."""
        return listing_canonical(text)

    def order_dependent(self, action: str) -> bool:
        """A bare number answers an "Ambiguous request" by position in the current (per-reset) order."""
        return str(action).strip().isdigit()

    def variations(self, name: str) -> dict[str, list[int]]:
        """ScienceWorld's own train/dev/test variation split of one task."""
        self._load(name, 0)
        return {
            "train": [int(v) for v in self._server.getVariationsTrain()],
            "dev": [int(v) for v in self._server.getVariationsDev()],
            "test": [int(v) for v in self._server.getVariationsTest()],
        }

    def child_pids(self) -> list[int]:
        proc = getattr(self._env._gateway, "java_process", None)
        return [int(proc.pid)] if proc is not None else []

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is None:
            return
        proc = getattr(env._gateway, "java_process", None)
        try:
            env.close()
        except Exception:  # the JVM may already be gone; it is killed below either way
            pass
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except Exception:
                proc.kill()
                proc.wait(timeout=5)


def _cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "retrojax"


def _cache_path(cache_dir: str | None) -> Path:
    return _cache_root(cache_dir) / "scienceworld_variations.json"


def split_tasks(
    names: Sequence[str] | None, part: str, cache_dir: str | None = None, world: ScienceWorld | None = None
) -> list[str]:
    """Tasks ``"name:variation"`` of ScienceWorld's ``part`` (train|dev|test) split for ``names``.

    The variation split is read from the engine once per task name and cached as JSON.
    """
    if part not in SPLIT_PARTS:
        raise ValueError(f"ScienceWorld split part must be one of {SPLIT_PARTS}, got {part!r}")
    names = list(names) if names else task_names()
    known = set(task_names())
    for n in names:
        if n not in known:
            raise ValueError(f"unknown ScienceWorld task '{n}' (known: {', '.join(sorted(known))})")
    path = _cache_path(cache_dir)
    table: dict[str, dict[str, list[int]]] = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            table = {}
    missing = [n for n in names if n not in table]
    if missing:
        own = world is None
        w = world or ScienceWorld(cache_dir=cache_dir)
        try:
            for n in missing:
                table[n] = w.variations(n)
        finally:
            if own:
                w.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, sort_keys=True))
        tmp.replace(path)
    return [f"{n}:{v}" for n in names for v in table[n][part]]


def level_tasks(level: str, part: str, cache_dir: str | None = None,
                world: ScienceWorld | None = None) -> list[str]:
    """Tasks ``"name:variation"`` of partition ``level`` (L0 | L1 | L2), part ``train`` or ``test``.

    The rules are in the module docstring. Types are interleaved: variation i of every type (in the engine's
    task order), then variation i + 1.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown ScienceWorld partition {level!r}; known: {', '.join(LEVELS)}")
    parts = LEVEL_PARTS[level]
    if part not in parts:
        raise ValueError(f"ScienceWorld partition {level} has the parts {tuple(parts)}, got {part!r}")
    names = level_types(level, part)
    by_name: dict[str, list[str]] = {n: [] for n in names}
    for task in split_tasks(names, parts[part], cache_dir=cache_dir, world=world):
        by_name[parse_task(task)[0]].append(task)
    return interleave(list(by_name.values()))


def level_types(level: str, part: str) -> list[str]:
    """The task types of one part of a partition, in the engine's task order."""
    seen = [n for n in sorted(task_names()) if n not in L0_EXCLUDED]
    if level != "L2":
        return seen
    held_out = set(L2_HELD_OUT)
    return [n for n in seen if (n in held_out) == (part == "test")]


def interleave(groups: Sequence[Sequence[str]]) -> list[str]:
    """Round robin over ``groups``: the first item of each, then the second of each, … (all items kept)."""
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]
