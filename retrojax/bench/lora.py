"""LoRA figures: the update with rank-16 adapters vs full fine-tuning, and merged vs per-step decoding.

``lora_figures`` (part of ``retrojax bench update``): one update at the demo shape on the same microbatch,
full fine-tuning and LoRA rank 16 on every projection, timed in the same run (after a compile run, median of
several) → ``update.lora_over_full`` (LoRA s ÷ full s) and ``update.lora_trainable_fraction`` (adapter
parameters ÷ all parameters).

``retrojax bench lora [--quick] [--json PATH]``: the sampler decoding a LoRA policy from merged weights vs
applying the adapters at every step, at the Qwen3-0.6B shape (``--quick``: the demo shape), one row, greedy →
``decode.merged.tokens_per_s``, ``decode.per_step.tokens_per_s`` and ``decode.merged_over_per_step``
(time ratio; < 1: merged is faster). ``retrojax.model.lora.DECODE_MERGED`` keeps the faster one.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from retrojax.bench import median_time


def lora_figures(setup: tuple, quick: bool = False, log=print, rank: int = 16) -> dict[str, float]:
    """One update, full vs LoRA rank ``rank``, on the largest microbatch of a synthetic archive; ``setup``:
    (preset, model config, learn config, archive) of ``bench update``'s overhead figures
    (``retrojax.bench.update.overhead_setup``), so both compare on the same microbatch."""
    from flax import nnx

    from retrojax.learn.advantages import advantages_from_config
    from retrojax.learn.batch import plan_batches
    from retrojax.learn.update import make_update
    from retrojax.model import Qwen3
    from retrojax.model.lora import apply_lora, trainable_fraction

    preset, config, cfg, arch = setup
    plan = plan_batches(arch, advantages_from_config(arch, cfg), lambda_ref=cfg.lambda_ref,
                        seq_buckets=cfg.seq_buckets, max_batch_tokens=cfg.max_batch_tokens)
    mb = max(plan.microbatches, key=lambda m: int(np.prod(m.shape)))
    batch = {k: jax.numpy.asarray(v) for k, v in mb.arrays.items()}
    repeats = 1 if quick else 5
    out: dict[str, float] = {}
    for route in ("full", "lora"):
        model = Qwen3(config, rngs=nnx.Rngs(0))
        if route == "lora":
            model = apply_lora(model, rank=rank, alpha=2.0 * rank)
            out["update.lora_trainable_fraction"] = trainable_fraction(model)
        upd, params, opt = make_update(model, cfg, total_steps=100)
        state = {"params": params, "opt": opt}

        def step(upd=upd, state=state):
            state["params"], state["opt"], metrics = upd(state["params"], state["opt"], [batch])
            return metrics

        jax.block_until_ready(step())  # compile
        out[f"update.{route}.s"] = median_time(step, repeats)
    out["update.lora_over_full"] = out["update.lora.s"] / out["update.full.s"]
    out["update.lora_rank"] = float(rank)
    log(f"LoRA rank {rank} vs full at {preset}, microbatch {mb.shape}: {out['update.lora.s']:.3f} s vs "
        f"{out['update.full.s']:.3f} s")
    return out


def decode_figures(quick: bool = False, log=print, tokens: int = 32, rank: int = 16) -> dict[str, float]:
    """Greedy decode of ``tokens`` tokens for one row: adapters applied per step vs merged weights."""
    from flax import nnx

    from retrojax.model import PRESETS, Qwen3
    from retrojax.model.lora import apply_lora, merge_lora
    from retrojax.sampler import Sampler

    preset = "demo" if quick else "qwen3-0.6b"
    config = PRESETS[preset]
    model = apply_lora(Qwen3(config, rngs=nnx.Rngs(0)), rank=rank, alpha=2.0 * rank)
    for t in model.layers.targets:  # non-zero adapters, as after training
        var = getattr(model.layers, f"{t}_lora_b")
        var.set_value(0.01 * jax.random.normal(jax.random.PRNGKey(1), var.shape, var.dtype))
    prompt = list(np.random.default_rng(0).integers(0, config.vocab_size, 64))
    out: dict[str, float] = {"decode.tokens": float(tokens)}
    for name, m in (("per_step", model), ("merged", merge_lora(model))):
        sampler = Sampler(m, rows=1, max_len=256, chunk_buckets=(64,))

        def run(sampler=sampler):
            sampler.reset(0)
            sampler.append([0], [prompt])
            return sampler.generate([0], tokens, temperature=0.0, key=jax.random.key(0))[0].ids

        run()  # compile
        secs = median_time(run, 3)
        out[f"decode.{name}.s"] = secs
        out[f"decode.{name}.tokens_per_s"] = tokens / secs
    out["decode.merged_over_per_step"] = out["decode.merged.s"] / out["decode.per_step.s"]
    out["decode.model"] = preset
    log(f"decode at {preset}, rank {rank}: merged {out['decode.merged.tokens_per_s']:.1f} tok/s, per step "
        f"{out['decode.per_step.tokens_per_s']:.1f} tok/s")
    return out


def run(quick: bool = False, log=print) -> dict[str, float | str]:
    out: dict[str, float | str] = dict(decode_figures(quick, log))
    out["device"] = jax.devices()[0].platform
    return out


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench lora [--quick] [--json PATH]``."""
    from retrojax.bench import run_and_report

    return run_and_report(run, args)
