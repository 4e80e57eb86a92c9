"""``retrojax bench envs``: speed figures of the functional environments under stable keys.

Runs ``envs.sokoban.bench`` and, when importable, ``envs.minesweeper.bench`` (each module's ``measure``
times our environment and, when jumanji is installed, its Jumanji anchor in alternation). Prints
``key value`` lines sorted by key, then one ``note:`` line per speed goal, and writes the figures as JSON
with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from retrojax.bench import write_figures

GOALS = (
    # (numerator key, denominator key, goal ratio, what)
    ("sokoban.steps_per_s.1024", "jumanji.sokoban.steps_per_s.1024", 2.0, "Sokoban vs Jumanji, B=1024"),
    ("sokoban.deepcopy_rewind_us_per_trial", "sokoban.rewind_us_per_trial", 1000.0, "rewind vs deepcopy"),
    ("minesweeper.steps_per_s.1024", "jumanji.minesweeper.steps_per_s.1024", 2.0,
     "MineSweeper (with cascade) vs Jumanji, B=1024"),
)


def _env_modules() -> list:
    mods = [importlib.import_module("envs.sokoban.bench")]
    try:
        mods.append(importlib.import_module("envs.minesweeper.bench"))
    except ImportError as err:
        print(f"note: minesweeper not benchmarked ({err})", file=sys.stderr)
    return mods


def collect(quick: bool) -> dict[str, float]:
    figures: dict[str, float] = {}
    for mod in _env_modules():
        figures.update(mod.measure(quick))
    return figures


def main(args: argparse.Namespace) -> int:
    figures = collect(bool(getattr(args, "quick", False)))
    for key in sorted(figures):
        print(f"{key} {figures[key]:.6g}")
    for num, den, goal, what in GOALS:
        if num in figures and den in figures and figures[den] > 0:
            ratio = figures[num] / figures[den]
            verdict = "meets" if ratio >= goal else "misses"
            print(f"note: {what}: {ratio:.3g}x ({verdict} the {goal:g}x goal)")
    write_figures(figures, getattr(args, "json", None))
    return 0
