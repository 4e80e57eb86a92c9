"""``retrojax train``: load the config, build model and tokenizer, optionally warm-start, fit, export.

With ``sft.warm_start: true`` the policy is first fine-tuned on the scripted oracle's demonstrations
(retrojax.learn.warm_start: solver and recovery play through the real trial loop, loss on expert tokens),
so that RL starts from a policy that writes parseable actions and sometimes succeeds: from a random tiny
model every trial fails alike and every advantage is zero. A resumed run with a checkpoint skips it (the
checkpoint already holds the warm-started and trained weights).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from retrojax.agent.env_api import check_env_config
from retrojax.agent.trial import Limits
from retrojax.learn.pool import BadPool
from retrojax.learn.trainer import Trainer, validate_learn_config
from retrojax.learn.warm_start import program_bound as sft_program_bound
from retrojax.model.build import build_model, build_tokenizer
from retrojax.programs import Ledger


def warm_start(cfg: Any, model: Any, tokenizer: Any, resume: bool) -> dict[str, Any] | None:
    """SFT of ``model`` in place on oracle demonstrations of the training split when the config asks.

    Returns the SFT figures (demonstrations, held-out NLL before/after), or None when skipped.
    """
    if not cfg.sft.warm_start:
        return None
    from retrojax.agent.env_api import make_env
    from retrojax.learn import warm_start as demos_lib
    from retrojax.learn.checkpoint import TrainCheckpoints

    ckpt_dir = Path(cfg.run.out_dir) / "checkpoints"
    if resume and ckpt_dir.exists() and TrainCheckpoints(ckpt_dir).latest_step() is not None:
        print("[train] resuming from a checkpoint: no warm start", file=sys.stderr)
        return None
    env = make_env(cfg, f"{cfg.env.split.split(':')[0]}:train")
    try:
        demos, demo_stats = demos_lib.run_demonstrations(cfg, env, tokenizer)
    finally:
        env.close()
    stats = demos_lib.warm_start(cfg, model, demos, tokenizer)
    out = {"demonstrations": demo_stats, "steps": cfg.sft.steps,
           "held_out_nll_before": stats["held_out_nll_before"],
           "held_out_nll_after": stats["held_out_nll_after"],
           "final_train_loss": stats["final_train_loss"], "trained_tokens": stats["pack"]["own_tokens"]}
    print("[train] warm start: " + json.dumps(out), file=sys.stderr)
    return out


def plan_run(cfg: Any, device_memory: str | None = None) -> tuple[Any, Any, bool]:
    """Plan before anything is allocated (retrojax.plan): ``sampler.max_inflight`` (auto: the most rows that
    fit; an explicit value that does not fit raises ``DoesNotFit``) and ``learn.remat`` (auto: on when the
    update would not fit without it). Returns (the config with max_inflight resolved, the admission,
    remat)."""
    import jax

    from retrojax.plan.admission import admit_train, check_certain, device_budget, resolve, summary
    from retrojax.plan.runtime import resolve_remat

    log = lambda line: print(line, file=sys.stderr)
    budget = device_budget(device_memory)
    check_certain(cfg, budget)  # hopeless sizes stop here, before any compile-only plan
    remat = resolve_remat(cfg, log=log, budget=budget)
    # a run on this CPU is planned with XLA:CPU's own programs (bf16 upcasts included); --device-memory on
    # a CPU host plans for an accelerator, whose bf16 the float16 stand-in models
    here = device_memory is None and jax.default_backend() == "cpu"
    admission = admit_train(cfg, budget, remat, log=log, standin=False if here else None)
    log(summary(admission))
    return resolve(cfg, admission), admission, remat


def main(args: argparse.Namespace) -> int:
    """``retrojax train --config FILE [--set k=v ...] [--resume] [--device-memory 80GB]``."""
    from retrojax.config import ConfigError, load

    try:
        cfg = load(args.config, args.overrides)
        check_env_config(cfg)
        Limits.from_config(cfg)  # the trial's budgets and reply sizes
        validate_learn_config(cfg.learn)
        if cfg.sft.warm_start:
            from retrojax.learn.warm_start import stop_checks, validate_sft_config

            validate_sft_config(cfg.sft)
            if cfg.sft.steps < 1:
                raise ValueError(f"sft.warm_start needs sft.steps >= 1, got {cfg.sft.steps}")
            if cfg.sft.stop_at_success is not None or cfg.sft.stop_at_levels is not None:
                stop_checks(cfg, None)  # raises: `retrojax train` plays no pool during SFT
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from retrojax.parallel.distributed import setup

    setup(cfg)  # jax.distributed (multi-process runs) and the compile cache, before any device work
    try:
        cfg, admission, remat = plan_run(cfg, getattr(args, "device_memory", None))
    except ValueError as e:  # DoesNotFit included: the plan's figures and what to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    resume = bool(getattr(args, "resume", False))
    model = build_model(cfg, remat)
    tokenizer = build_tokenizer(cfg)
    programs = Ledger()  # compiled programs per stage against their bounds (retrojax.programs)
    if cfg.sft.warm_start:
        programs.bound("sft", sft_program_bound(cfg))
    with programs.stage("sft"):
        sft_figures = warm_start(cfg, model, tokenizer, resume)
    try:  # after the warm start: the trainer copies the weights it starts from
        trainer = Trainer(cfg, model, tokenizer, programs=programs)
    except BadPool as e:  # learn.pool_lengths that select no level (a malformed range failed above)
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        history = trainer.fit(resume=resume)
        out = trainer.export(Path(trainer.out_dir) / "policy")
    finally:
        trainer.close()
    last = history[-1] if history else {}
    shown = {k: v for k, v in last.items() if k.startswith(("train/loss", "rollout/", "eval/"))}
    summary: dict[str, Any] = {"iterations": trainer.iteration, "policy": str(out), "last": shown,
                               "plan": {k.removeprefix("plan."): v for k, v in admission.figures.items()}}
    if sft_figures is not None:
        keys = ("steps", "held_out_nll_before", "held_out_nll_after")
        summary["warm_start"] = {k: sft_figures[k] for k in keys}
    programs.log()
    summary.update(programs.metrics())  # programs.<stage>.compiled, .cached, .compile_s, .other, .bound
    print(json.dumps(summary))
    return 0
