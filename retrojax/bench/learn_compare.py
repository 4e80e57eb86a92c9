"""``retrojax bench learn --compare``: the paper's central claim at CPU scale, from one SFT start.

Arms, all from the same exported SFT policy and evaluated on the same held-out levels and seeds:

- ``retrail``: T@3 training trials, State-Anchored GRPO + the branch-advancement reflection reward;
- ``grpo``: forward-only P@1 training trials, trajectory-level GRPO, no reflection term (same updates, tasks
  and trials per update);
- ``sft_more``: no RL; the RL arm's wall minutes spent on more SFT steps on the same demonstrations.

Figures: ``compare.<arm>.<protocol>`` (held-out success) with ``.ci95_lo/hi`` for the start (``sft``) and
every arm, and paired differences ``compare.<a>_minus_<b>.<protocol>`` with their 95% intervals (trials
paired by level and seed); every interval is clustered by level.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retrojax.bench.learn_summary import heldout_outcomes, require_updates

PROTOCOLS = ("P@1", "T@1", "T@3")
GRPO_ARM = ["trial.protocol=P@1", "learn.estimator=grpo", "learn.lambda_ref=0.0"]
PAIRS = (("retrail", "sft"), ("grpo", "sft"), ("sft_more", "sft"), ("retrail", "grpo"),
         ("retrail", "sft_more"))


def compare_figures(outcomes: dict[str, dict[tuple[str, int, int], bool]]) -> dict[str, Any]:
    """Held-out success per arm and protocol and paired differences between arms, intervals clustered by
    level (``eval.metrics``: a level's seeds are not independent trials)."""
    from retrojax.eval.metrics import paired_outcomes, room_success_interval

    out: dict[str, Any] = {}
    for arm, trials in outcomes.items():
        for p in PROTOCOLS:
            xs = [(level, ok) for (proto, level, _), ok in trials.items() if proto == p]
            if not xs:
                continue
            out[f"compare.{arm}.{p}"] = sum(ok for _, ok in xs) / len(xs)
            out[f"compare.{arm}.{p}.ci95_lo"], out[f"compare.{arm}.{p}.ci95_hi"] = room_success_interval(xs)
    for a, b in PAIRS:
        if a not in outcomes or b not in outcomes:
            continue
        for p in PROTOCOLS:
            diff = paired_outcomes(outcomes[a], outcomes[b], p)
            if diff is not None:
                name = f"compare.{a}_minus_{b}.{p}"
                out[name], out[f"{name}.ci95_lo"], out[f"{name}.ci95_hi"] = diff
    return out


def run_compare(base_sets: Sequence[str], out: Path, log: Callable[[str], None] = print,
                config: str = "configs/demo.yaml") -> dict[str, Any]:
    """The start, the three arms and the figures (see the module docstring)."""
    from retrojax import config as config_lib
    from retrojax import demo

    require_updates(config_lib.load(config, list(base_sets)))
    evals = f"eval.protocols=[{','.join(PROTOCOLS)}]"

    def run_one(name: str, sets: Sequence[str]) -> tuple[dict[str, Any], float]:
        cfg = config_lib.load(config, [*base_sets, evals, *sets, f"run.out_dir={out / name}"])
        log(f"[bench learn --compare] {name}: {cfg.learn.updates} updates, protocol {cfg.trial.protocol}, "
            f"estimator {cfg.learn.estimator}, sft.steps {cfg.sft.steps}")
        t0 = time.perf_counter()
        demo.run(cfg)
        return json.loads((out / name / "summary.json").read_text()), time.perf_counter() - t0

    start, _ = run_one("sft", ["learn.updates=0"])
    policy = start["policy"]
    sft_steps = int(config_lib.load(config, list(base_sets)).sft.steps)
    sft_s_per_step = float(start["stages"]["warm start (SFT)"]) / max(1, sft_steps)
    from_start = [f"model.path={policy}", "sft.steps=0"]
    retrail, _ = run_one("retrail", from_start)
    grpo, _ = run_one("grpo", [*from_start, *GRPO_ARM])
    rl_minutes = float(retrail["curve"][-1]["wall_s"]) / 60.0 if retrail["curve"] else 0.0
    extra = max(1, math.ceil(rl_minutes * 60.0 / max(sft_s_per_step, 1e-6)))
    more, _ = run_one("sft_more", [f"model.path={policy}", f"sft.steps={extra}", "learn.updates=0"])
    outcomes = {"sft": heldout_outcomes(start, "SFT"), "retrail": heldout_outcomes(retrail, "RL"),
                "grpo": heldout_outcomes(grpo, "RL"), "sft_more": heldout_outcomes(more, "RL")}
    figures = compare_figures(outcomes)
    figures.update({"compare.rl_minutes": rl_minutes, "compare.sft_more.steps": float(extra),
                    "compare.sft_s_per_step": sft_s_per_step})
    return figures
