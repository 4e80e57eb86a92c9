"""Speed figures under stable keys: ``retrojax bench <target>``."""

from __future__ import annotations

import json
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
