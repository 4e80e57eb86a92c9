"""``retrojax bench update``: the jitted GRPO update vs a bare forward+backward of the same batch.

A synthetic archive (growing conversations, rewinds, reflections) goes through the real advantage and batch
code; the largest microbatch is then timed (after a compile warm-up, median of several runs) as

- ``update.s``: the whole ``update(params, opt_state, batch)`` step (loss, gradients, non-finite check,
  clipping, AdamW, schedule), with params and optimizer state donated;
- ``fwd_bwd.s``: ``value_and_grad`` of the same loss on the same batch, nothing else.

``update_over_fwd_bwd`` is their ratio (goal ≤ 1.5). Figures go to stdout (``key: value``) and, with
``--json PATH``, to a JSON file under the same keys.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from retrojax.bench import run_and_report
from retrojax.bench.lora import lora_figures
from retrojax.config import LearnConfig
from retrojax.learn.advantages import advantages_from_config
from retrojax.learn.batch import plan_batches
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.update import make_update


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(quick: bool = False, log=print) -> dict[str, float]:
    from flax import nnx

    from retrojax.model import PRESETS, Qwen3

    preset = "tiny" if quick else "demo"
    config = PRESETS[preset]
    sizes = (dict(tasks=2, trials=4, prompt_len=96, turn_len=24, output_len=24) if quick
             else dict(tasks=4, trials=8, prompt_len=256, turn_len=48, output_len=48))
    cfg = LearnConfig(seq_buckets=(256, 512, 1024), max_batch_tokens=8192 if quick else 16384,
                      logprob_chunk=256, learning_rate=1e-5)
    arch = synthetic_archive(np.random.default_rng(0), vocab=config.vocab_size, segments=2, decisions=3,
                             **sizes)
    adv = advantages_from_config(arch, cfg)
    plan = plan_batches(arch, adv, lambda_ref=cfg.lambda_ref, seq_buckets=cfg.seq_buckets,
                        max_batch_tokens=cfg.max_batch_tokens)
    mb = max(plan.microbatches, key=lambda m: int(np.prod(m.shape)))
    batch = {k: jax.numpy.asarray(v) for k, v in mb.arrays.items()}
    log(f"model {preset}, microbatch {mb.shape}, {mb.trained_tokens} trained tokens")

    model = Qwen3(config, rngs=nnx.Rngs(0))
    upd, params, opt_state = make_update(model, cfg, total_steps=100)
    repeats = 3 if quick else 5

    t0 = time.perf_counter()
    jax.block_until_ready(upd.fwd_bwd(params, batch))
    compile_fb = time.perf_counter() - t0
    fwd_bwd_s = _median_time(lambda: upd.fwd_bwd(params, batch), repeats)

    state = {"params": params, "opt": opt_state}

    def step():
        state["params"], state["opt"], metrics = upd(state["params"], state["opt"], batch)
        return metrics

    t0 = time.perf_counter()
    jax.block_until_ready(step())
    compile_update = time.perf_counter() - t0
    update_s = _median_time(step, repeats)
    tokens = float(np.prod(mb.shape))
    return {
        "model": preset,
        "batch_rows": float(mb.shape[0]),
        "batch_len": float(mb.shape[1]),
        "trained_tokens": float(mb.trained_tokens),
        "update.s": update_s,
        "fwd_bwd.s": fwd_bwd_s,
        "update_over_fwd_bwd": update_s / fwd_bwd_s,
        "update_tokens_per_s": tokens / update_s,
        "update_compile.s": compile_update,
        "fwd_bwd_compile.s": compile_fb,
        "traces": float(upd.traces),
        "device": jax.devices()[0].platform,
        **lora_figures(quick, log),  # update.lora_over_full, update.lora_trainable_fraction
    }


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench update [--quick] [--json PATH]``."""
    return run_and_report(run, args)
