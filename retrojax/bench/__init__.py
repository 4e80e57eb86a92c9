"""Speed figures under stable keys: ``retrojax bench <target>``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path


def print_figures(figures: dict[str, float | str]) -> None:
    """One ``key: value`` line per figure, in the order measured."""
    for k, v in figures.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")


def write_figures(figures: dict[str, float | str], path: str | None) -> None:
    """Write the figures as sorted JSON to ``path`` (creating its folder); nothing when ``path`` is None."""
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2, sort_keys=True))


def run_and_report(run: Callable[..., dict[str, float | str]], args: argparse.Namespace) -> int:
    """Shared CLI handler body: ``run(quick=..., log=...)`` with progress on stderr, then print the
    figures and write them to ``--json``."""
    figures = run(quick=bool(getattr(args, "quick", False)), log=lambda line: print(line, file=sys.stderr))
    print_figures(figures)
    write_figures(figures, getattr(args, "json", None))
    return 0
