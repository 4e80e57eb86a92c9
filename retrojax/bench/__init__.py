"""Speed figures under stable keys: ``retrojax bench <target>``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, each waited for (async dispatch)."""
    import time

    import jax
    import numpy as np

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


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
