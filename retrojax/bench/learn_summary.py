"""What ``bench learn`` and ``bench learn --compare`` share: the config check before a run and the held-out
outcomes read back from a demo ``summary.json``.

Both bench modules import this one (``learn`` also imports ``learn_compare`` for ``--compare``), so the
imports between them point one way.
"""

from __future__ import annotations

from typing import Any


def require_updates(cfg: Any) -> None:
    """The bench measures RL: refuse a run without updates (an SFT-only run is ``retrojax demo --set
    learn.updates=0``) and any setting the demo would refuse, before the first stage."""
    from retrojax import demo
    from retrojax.config import ConfigError

    if cfg.learn.updates < 1:
        raise ConfigError(f"learn.updates must be ≥ 1 for the bench, got {cfg.learn.updates}")
    demo.check_config(cfg)


def heldout_outcomes(summary: dict[str, Any], label: str) -> dict[tuple[str, int, int], bool]:
    """A demo summary's held-out outcomes of one policy (``SFT`` / ``RL``) by (protocol, level, seed)."""
    return {(p, int(t), int(s)): bool(ok) for p, t, s, ok in summary["heldout_trials"][label]}
