"""ALFWorld through the alfworld TextWorld wrappers (PDDL engine, demangled names, expert planner).

A task is either ``"gen:<task_type>:<seed>"`` — a game generated from the wheel's PDDL domain and
grammar (``alfworld_gen``) — or the path of a real ALFWorld ``game.tw-pddl`` (or its folder).
Progress is the fraction of the goal's state conditions that hold, maximised over the goal's
bindings (static facts such as object types only restrict the bindings); ``score`` = 100 × progress.
The expert's next action comes from ALFWorld's planner, computed only when asked.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from envs.textworlds.alfworld_gen import generate_game
from envs.textworlds.base import Observation, TextWorld, digest

NOTHING_HAPPENS = "Nothing happens."
STATIC_PREDICATES = frozenset({
    "objecttype", "receptacletype", "cancontain", "openable", "pickupable", "cleanable", "heatable",
    "coolable", "toggleable", "sliceable", "isreceptacleobject", "receptacleatlocation", "moveable",
})
SPLIT_FOLDERS = {"train": ("train",), "dev": ("valid_seen",), "test": ("valid_unseen",)}


# ------------------------------------------------------------------------------------------------
# Goal progress
# ------------------------------------------------------------------------------------------------


def _first_sexpr(text: str) -> Any:
    """The first complete s-expression of ``text`` (lower-cased atoms); what follows is ignored."""
    tokens = re.findall(r"\(|\)|[^\s()]+", re.sub(r";[^\n]*", "", text))
    stack: list[list[Any]] = [[]]
    for tok in tokens:
        if tok == "(":
            stack.append([])
        elif tok == ")":
            if len(stack) < 2:
                raise ValueError("unbalanced parentheses in PDDL goal")
            done = stack.pop()
            stack[-1].append(done)
            if len(stack) == 1:
                return done
        else:
            stack[-1].append(tok.lower())
    raise ValueError("unbalanced parentheses in PDDL goal")


class GoalProgress:
    """A conjunctive existential PDDL goal, flattened to variables, literals and ``≠`` constraints."""

    def __init__(self, pddl_problem: str):
        start = pddl_problem.find("(:goal")
        if start < 0:
            raise ValueError("PDDL problem has no (:goal ...) section")
        tree = _first_sexpr(pddl_problem[start:])
        self.variables: dict[str, str] = {}
        self.literals: list[tuple[str, tuple[str, ...]]] = []
        self.distinct: list[tuple[str, str]] = []
        self._flatten(tree[1])
        self.entities: dict[str, set[str]] = {}
        objects = pddl_problem.find("(:objects")
        if objects >= 0:
            decl = _first_sexpr(pddl_problem[objects:])[1:]
            names: list[str] = []
            for i, tok in enumerate(decl):
                if tok == "-" or (i > 0 and decl[i - 1] == "-"):
                    if tok != "-":
                        self.entities.setdefault(tok, set()).update(names)
                        names = []
                    continue
                names.append(tok)
        self.fluents = [lit for lit in self.literals if lit[0] not in STATIC_PREDICATES]
        self.statics = [lit for lit in self.literals if lit[0] in STATIC_PREDICATES]

    def _flatten(self, node: Any) -> None:
        head = node[0]
        if head == "and":
            for child in node[1:]:
                self._flatten(child)
        elif head == "exists":
            decl = node[1]
            i = 0
            while i < len(decl):
                names = []
                while i < len(decl) and decl[i] != "-":
                    names.append(decl[i])
                    i += 1
                kind = decl[i + 1] if i + 1 < len(decl) else "object"
                for n in names:
                    self.variables[n] = kind
                i += 2
            self._flatten(node[2])
        elif head == "not" and isinstance(node[1], list) and node[1][0] == "=":
            self.distinct.append((node[1][1], node[1][2]))
        elif head == "not":
            raise ValueError("negated goal literals other than (not (= a b)) are not supported")
        else:
            self.literals.append((head, tuple(node[1:])))

    def __call__(self, facts: Iterable[tuple[str, tuple[str, ...]]], limit: int = 20_000) -> float:
        """Best fraction of fluent literals satisfied over bindings that satisfy the static ones.

        Each variable ranges over the entities its static literals allow (else over the problem's
        entities of its declared type); bindings are built variable by variable, pruned as soon as a
        fully bound static literal or ``≠`` constraint fails; at most ``limit`` complete bindings.
        """
        if not self.fluents:
            return 1.0
        fact_set = {(n.lower(), tuple(a.lower() for a in args)) for n, args in facts}
        by_pred: dict[str, list[tuple[str, ...]]] = {}
        for n, args in fact_set:
            by_pred.setdefault(n, []).append(args)
        candidates: dict[str, set[str] | None] = {v: None for v in self.variables}
        for pred, args in self.statics:  # narrow each variable by the static literals it appears in
            rows = by_pred.get(pred, [])
            for pos, arg in enumerate(args):
                if arg in candidates:
                    ok = {r[pos] for r in rows
                          if all(a in candidates or r[i] == a for i, a in enumerate(args))}
                    candidates[arg] = ok if candidates[arg] is None else candidates[arg] & ok
        present = {x for _, args in fact_set for x in args}
        domains = {}
        for v, kind in self.variables.items():
            if candidates[v] is not None:
                domains[v] = sorted(candidates[v])
            else:
                typed = self.entities.get(kind)
                domains[v] = sorted(present & typed if typed else present)
        order = sorted(self.variables, key=lambda v: len(domains[v]))
        depth_of = {v: i for i, v in enumerate(order)}

        def ready_at(args: tuple[str, ...]) -> int:
            return max((depth_of[a] for a in args if a in depth_of), default=-1)

        statics_at: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
        for lit in self.statics:
            statics_at.setdefault(ready_at(lit[1]), []).append(lit)
        distinct_at: dict[int, list[tuple[str, str]]] = {}
        for pair in self.distinct:
            distinct_at.setdefault(ready_at(pair), []).append(pair)
        bind: dict[str, str] = {}

        def holds(pred: str, args: tuple[str, ...]) -> bool:
            return (pred, tuple(bind.get(a, a) for a in args)) in fact_set

        if any(not holds(p, a) for p, a in statics_at.get(-1, [])):
            return 0.0
        best, leaves, total = 0, 0, len(self.fluents)

        def search(depth: int) -> bool:  # True: stop (perfect binding or limit reached)
            nonlocal best, leaves
            if depth == len(order):
                leaves += 1
                best = max(best, sum(holds(p, a) for p, a in self.fluents))
                return best == total or leaves >= limit
            var = order[depth]
            for value in domains[var]:
                bind[var] = value
                if all(bind[a] != bind[b] for a, b in distinct_at.get(depth, [])) and all(
                    holds(p, a) for p, a in statics_at.get(depth, [])
                ):
                    if search(depth + 1):
                        return True
            bind.pop(var, None)
            return False

        search(0)
        return best / total


# ------------------------------------------------------------------------------------------------
# The world
# ------------------------------------------------------------------------------------------------


_SPEEDUPS_INSTALLED = False


def install_speedups() -> None:
    """Process-local speed-ups of pure, slow steps of the TextWorld PDDL engine.

    A rewind is reset + replay, and every reset re-translates the same PDDL problem to SAS (seconds)
    while every step re-parses the same grammar templates and queries with tatsu and deep-copies
    entity records for each derivation (most of a step's time). Translations and parses are pure
    functions of their text, so they are cached (grammar templates are deep-copied on the way out
    because derivation mutates them; parsed queries are only read); derivation contexts get fresh
    dicts over the same, never-mutated entity records. Tests check that observations are identical
    with and without these. Installed once per worker process.
    """
    global _SPEEDUPS_INSTALLED
    if _SPEEDUPS_INSTALLED:
        return
    import copy

    import fast_downward
    from textworld.envs.pddl import textgen

    translate = fast_downward.pddl2sas
    translated: dict[tuple[str, str, bool], Any] = {}

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        key = (domain, problem, bool(optimize))
        if key not in translated:
            if len(translated) > 16:
                translated.clear()
            translated[key] = translate(domain, problem, verbose=verbose, optimize=optimize)
        return translated[key]

    parse = textgen._parse_and_convert
    parsed: dict[tuple[Any, ...], Any] = {}

    def parse_and_convert(text: str, **kwargs: Any) -> Any:
        key = (text, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = parse(text, **kwargs)
        return copy.deepcopy(parsed[key])

    query_cache: dict[str, Any] = {}
    parse_query = textgen.Rule.parse_conjunctive_query

    def parse_conjunctive_query(expr: str) -> Any:
        if expr not in query_cache:
            query_cache[expr] = parse_query(expr)
        return query_cache[expr]

    def copy_context(context: dict[str, Any]) -> dict[str, Any]:
        return {
            "state": context["state"],
            "facts": context["facts"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"],
        }

    fast_downward.pddl2sas = pddl2sas
    textgen._parse_and_convert = parse_and_convert
    textgen.Rule.parse_conjunctive_query = staticmethod(parse_conjunctive_query)
    textgen.copy_context = copy_context
    _SPEEDUPS_INSTALLED = True


def find_game_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "game.tw-pddl"
    if not p.is_file():
        raise FileNotFoundError(f"no ALFWorld game file at {path}")
    return p


class ALFWorld(TextWorld):
    """One ALFWorld PDDL engine (TextWorld + fast-downward: one per process)."""

    name = "alfworld"

    def __init__(self, game_dir: str | None = None, speedups: bool = True):
        import textworld  # noqa: F401  (fail early when alfworld/textworld are missing)

        if speedups:
            install_speedups()
        self._own_dir = game_dir is None
        self._dir = Path(game_dir or tempfile.mkdtemp(prefix="retrojax-alfworld-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self._env: Any = None
        self._task: str | None = None
        self._goal_text = ""
        self._progress: GoalProgress | None = None
        self._admissible: list[str] = []
        self._moves = 0
        self._last_score = 0.0

    def _game_path(self, task: str) -> Path:
        if task.startswith("gen:"):
            parts = task.split(":")
            if len(parts) != 3 or not parts[2].isdigit():
                raise ValueError(f"generated ALFWorld task must be 'gen:<task_type>:<seed>', got {task!r}")
            path = self._dir / f"{parts[1]}-{parts[2]}.tw-pddl"
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(generate_game(parts[1], int(parts[2]))))
                tmp.replace(path)
            return path
        return find_game_file(task)

    def _load(self, task: str) -> None:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        path = self._game_path(task)
        data = json.loads(path.read_text())
        if self._env is not None:
            self._env.close()
            self._env = None
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        self._env = textworld.start(str(path), request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])
        self._progress = GoalProgress(data["pddl_problem"])
        self._task = task

    @property
    def _pddl(self) -> Any:
        return self._env.unwrapped

    def _facts(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(f.name, tuple(v.name for v in f.arguments)) for f in self._pddl._pddl_state.facts]

    def _observe(self, state: Any, valid: bool, changed: bool, full: bool = True) -> Observation:
        self._admissible = list(state["admissible_commands"])
        won = bool(state["won"])
        if not full:  # an intermediate replay step: only the text and flags matter
            return Observation(text=str(state["feedback"]).strip(), score=self._last_score,
                               progress=self._last_score / 100.0, done=won, won=won, valid=valid,
                               changed=changed, moves=self._moves)
        facts = self._facts()
        progress = 1.0 if won else self._progress(facts)
        score = 100.0 * progress
        reward = score - self._last_score
        self._last_score = score
        return Observation(
            text=str(state["feedback"]).strip(),
            score=score,
            progress=progress,
            done=won,
            won=won,
            reward=reward,
            valid=valid,
            changed=changed,
            moves=self._moves,
            key=digest(str(self._task), *sorted(f"{n}({','.join(a)})" for n, a in facts)),
        )

    def reset(self, task: str) -> Observation:
        if task != self._task or self._env is None:
            self._load(task)
        state = self._env.reset()
        self._moves = 0
        self._last_score = 0.0
        text = str(state["feedback"])
        marker = "Your task is to:"
        self._goal_text = text[text.find(marker):].strip() if marker in text else ""
        return self._observe(state, True, True)

    def step(self, action: str, full: bool = True) -> Observation:
        if self._env is None:
            raise RuntimeError("step before reset")
        command = " ".join(str(action).strip().split())
        valid = command in self._admissible
        state, _, _ = self._env.step(command)
        if valid:
            self._moves += 1
        return self._observe(state, valid, valid, full)

    def admissible(self) -> dict[str, list[str]]:
        return {"actions": list(self._admissible)}

    def candidates(self) -> list[str]:
        return list(self._admissible)

    def expert_action(self) -> str | None:
        """The next action of ALFWorld's planner from the current state (None when no plan)."""
        if self._env is None:
            raise RuntimeError("expert_action before reset")
        plan = self._pddl._pddl_state.replan(self._pddl._entity_infos)
        for action in plan:
            if action in ("look", "inventory"):  # the planner's no-op observations
                continue
            return action if action in self._admissible else None
        return None

    def goal(self) -> str:
        return self._goal_text

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._own_dir:
            for p in self._dir.glob("*"):
                p.unlink(missing_ok=True)
            self._dir.rmdir()


def data_tasks(data_dir: str | os.PathLike, part: str | None = None) -> list[str]:
    """Real ALFWorld games under ``data_dir`` (standard layout: ``train``, ``valid_seen``,
    ``valid_unseen`` folders of ``<task>/<trial>/game.tw-pddl``; any folder of games also works).

    As ALFWorld does, games marked unsolvable and movable/sliced variants are skipped.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"ALFWorld data directory not found: {data_dir}")
    roots = [root]
    if part is not None:
        if part not in SPLIT_FOLDERS:
            raise ValueError(f"ALFWorld split part must be one of {tuple(SPLIT_FOLDERS)}, got {part!r}")
        sub = [root / f for f in SPLIT_FOLDERS[part] if (root / f).is_dir()]
        roots = sub or [root]
    games = []
    for r in roots:
        for game in sorted(r.rglob("game.tw-pddl")):
            rel = str(game.relative_to(root))
            if "movable" in rel or "Sliced" in rel:
                continue
            try:
                solvable = json.loads(game.read_text()).get("solvable", True)
            except (OSError, json.JSONDecodeError):
                continue
            if solvable:
                games.append(str(game))
    return games
