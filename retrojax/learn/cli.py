"""``retrojax train``: load the config, build model and tokenizer, fit, export the policy."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from retrojax.learn.trainer import Trainer, validate_learn_config
from retrojax.model.build import build_model, build_tokenizer


def main(args: argparse.Namespace) -> int:
    """``retrojax train --config FILE [--set k=v ...] [--resume]``."""
    from retrojax.config import ConfigError, load

    try:
        cfg = load(args.config, args.overrides)
        validate_learn_config(cfg.learn)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from retrojax.parallel.distributed import setup

    setup(cfg)  # jax.distributed (multi-process runs) and the compile cache, before any device work
    model = build_model(cfg)
    tokenizer = build_tokenizer(cfg)
    trainer = Trainer(cfg, model, tokenizer)
    try:
        history = trainer.fit(resume=bool(getattr(args, "resume", False)))
        out = trainer.export(Path(trainer.out_dir) / "policy")
    finally:
        trainer.close()
    last = history[-1] if history else {}
    shown = {k: v for k, v in last.items() if k.startswith(("train/loss", "rollout/", "eval/"))}
    print(json.dumps({"iterations": trainer.iteration, "policy": str(out), "last": shown}))
    return 0
