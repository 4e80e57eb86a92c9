"""Imports point down: no module imports itself back through others, and the lower layers (the worlds, the
model, the planner) reach nothing above them. Every import statement counts, including the ones inside
functions (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    out = {}
    for path in [*ROOT.glob("retrojax/**/*.py"), *ROOT.glob("envs/**/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imported_names(path: Path) -> Iterable[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for name in imported_names(path):
            target = owner(name)
            # a package's __init__ is not a dependency of its own modules
            if target and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


# what each lower layer may not reach (ARCHITECTURE: envs < model < plan; imports point down)
FORBIDDEN = {
    "envs": ("retrojax",),
    "retrojax.model": ("retrojax.plan", "retrojax.learn", "retrojax.agent", "retrojax.eval", "retrojax.bench",
                       "retrojax.serve", "retrojax.demo", "retrojax.cli", "retrojax.sampler"),
    "retrojax.plan": ("retrojax.agent", "retrojax.eval", "retrojax.bench", "retrojax.serve", "retrojax.demo",
                      "retrojax.cli"),
}


def test_lower_layers_import_nothing_above_them():
    bad = []
    for m, targets in import_graph().items():
        for layer, above in FORBIDDEN.items():
            if m == layer or m.startswith(layer + "."):
                bad += [(m, t) for t in targets if any(t == a or t.startswith(a + ".") for a in above)]
    assert bad == []
