"""``retrojax bench update``: the jitted GRPO update vs a bare forward+backward of the same batch.

A synthetic archive (growing conversations, rewinds, reflections) goes through the real advantage and batch
code; the largest microbatch is then timed (after a compile warm-up, median of several runs) as

- ``update.s``: the whole ``update(params, opt_state, batch)`` step (loss, gradients, non-finite check,
  clipping, AdamW, schedule), with params and optimizer state donated;
- ``fwd_bwd.s``: ``value_and_grad`` of the same loss on the same batch, nothing else.

``update_over_fwd_bwd`` is their ratio (goal ≤ 1.5), on the largest microbatch of the default
``learn.layout``; ``update_over_fwd_bwd.rows`` and ``.tree_long`` (and the default's) the same per layout.

Then the learner layouts (``learn.layout``, see ``retrojax.learn.layout``) on two archives, each timed in one
run with the demo model:

- ``demo``: T@3 trials of the demo's RL batch (``configs/demo.yaml``: 4 pool levels × 8 trials, 8 calls,
  compact prompts, the demo's sentencepiece tokenizer trained as ``retrojax demo`` trains it) recorded by the
  real trial loop with the noisy oracle (ε = ``sft.oracle_epsilon``) standing in for the SFT policy, so the
  archive has the demo's rewinds and reflections; behaviour log-probs are drawn near the model's;
- ``paper``: a synthetic archive at the paper's shape per task (8 trials × 30 execution calls in 3 segments
  separated by rewinds with reflections, ~200-token turns, a 1k-token text-world-like prompt); each rewind
  restores the conversation saved at ``C_j`` (App. D.3, see ``retrojax.learn.synthetic``), so contexts reach
  ~7k tokens and the buckets go to 8192.

For each archive A and layout L ∈ {rows, tree, tree_long} (``learn.layout``):
``update.A.L.positions_per_trained_token`` (token positions the update processes, padding included, per
trained output token), ``update.A.L.unique_token_ratio`` (positions / distinct tokens of the archive's token
tree), ``update.A.L.s`` (one whole update: every
microbatch accumulated, one optimizer step per minibatch; after compiling every program),
``update.A.L.programs`` (update programs compiled, one per microbatch shape),
``update.A.L.attention_pairs_per_trained_token`` (query × key pairs the attention computes, whole blocks,
per trained token: exact, from the shapes), ``update.A.speedup`` (rows s / tree s; ``speedup_long`` for
``tree_long``; ``update.A.L.cpu_s`` and ``update.A.cpu_speedup(_long)`` the same in process CPU seconds, all
threads, which a shared machine disturbs less than wall time) and
``update.A.attention_pairs_ratio`` (rows pairs / tree pairs: where attention dominates the update, as it does
for the small demo model on CPU, the speedup follows this ratio). ``sft.*``:
the same for SFT steps (``sft.batch_size`` examples each) on the demo's demonstrations. Figures go to stdout
(``key: value``) and, with ``--json PATH``, to a JSON file under the same keys. ``--quick`` (smoke test): the
tiny model's shape over the demo tokenizer's vocabulary, smaller archives (demo trials of 2 calls) whose
microbatches are all one row of one 512-token bucket (so archives and layouts share their programs), one timed
run instead of a median, 2 SFT steps of 2 examples; the same keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from retrojax.bench import median_time, run_and_report
from retrojax.bench.lora import lora_figures
from retrojax.config import LearnConfig
from retrojax.learn.advantages import advantages_from_config
from retrojax.learn.batch import plan_batches
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.update import make_update

# --quick: every microbatch of every archive is one row of one bucket, so the runs share their (1, 512)
# programs (through the compile cache) instead of compiling one per archive and layout
QUICK_BUCKETS, QUICK_BATCH_TOKENS = (512,), 512


def quick_model_config() -> Any:
    """--quick's model: the tiny model's shape over the demo tokenizer's vocabulary (the same programs, fewer
    FLOPs), for the overhead, LoRA and layout figures alike."""
    from retrojax.model import PRESETS

    return dataclasses.replace(PRESETS["tiny"], vocab_size=PRESETS["demo"].vocab_size)


def overhead_setup(quick: bool) -> tuple[str, Any, LearnConfig, Any]:
    """(preset, model config, learn config, synthetic archive) of the overhead and LoRA figures."""
    from retrojax.model import PRESETS

    if quick:
        cfg = LearnConfig(seq_buckets=QUICK_BUCKETS, max_batch_tokens=QUICK_BATCH_TOKENS, logprob_chunk=256,
                          learning_rate=1e-5)
        config = quick_model_config()
        sizes = dict(tasks=2, trials=2, prompt_len=24, turn_len=8, output_len=8)
    else:
        cfg = LearnConfig(seq_buckets=(256, 512, 1024), max_batch_tokens=16384, logprob_chunk=256,
                          learning_rate=1e-5)
        config = PRESETS["demo"]
        sizes = dict(tasks=4, trials=8, prompt_len=256, turn_len=48, output_len=48)
    arch = synthetic_archive(np.random.default_rng(0), vocab=config.vocab_size, segments=2, decisions=3,
                             **sizes)
    return ("tiny" if quick else "demo"), config, cfg, arch


def run(quick: bool = False, log=print) -> dict[str, float]:
    from flax import nnx

    from retrojax.model import Qwen3

    preset, config, cfg, arch = overhead_setup(quick)
    adv = advantages_from_config(arch, cfg)
    model = Qwen3(config, rngs=nnx.Rngs(0))
    repeats = 1 if quick else 5
    figures = {}
    for layout in dict.fromkeys((cfg.layout, "rows", "tree_long")):  # the default layout's first
        plan = plan_batches(arch, adv, lambda_ref=cfg.lambda_ref, seq_buckets=cfg.seq_buckets,
                            max_batch_tokens=cfg.max_batch_tokens, layout=layout)
        mb = max(plan.microbatches, key=lambda m: int(np.prod(m.shape)))
        log(f"model {preset}, {layout} microbatch {mb.shape}, {mb.trained_tokens} trained tokens")
        figures[layout] = (mb, *update_overhead(model, cfg, mb, repeats))
    mb, update_s, fwd_bwd_s, compile_update, compile_fb, traces = figures[cfg.layout]
    tokens = float(np.prod(mb.shape))
    layouts = layout_figures(quick, log)
    return {
        "model": preset,
        "batch_rows": float(mb.shape[0]),
        "batch_len": float(mb.shape[1]),
        "trained_tokens": float(mb.trained_tokens),
        "update.s": update_s,
        "fwd_bwd.s": fwd_bwd_s,
        "update_over_fwd_bwd": update_s / fwd_bwd_s,  # on the default learn.layout
        **{f"update_over_fwd_bwd.{lay}": f[1] / f[2] for lay, f in figures.items()},
        "update_tokens_per_s": tokens / update_s,
        "update_compile.s": compile_update,
        "fwd_bwd_compile.s": compile_fb,
        "traces": float(traces),
        "device": jax.devices()[0].platform,
        # update.lora_over_full, update.lora_trainable_fraction
        **lora_figures(overhead_setup(quick), quick, log),
        **layouts,
    }


def update_overhead(model: Any, cfg: LearnConfig, mb: Any, repeats: int
                    ) -> tuple[float, float, float, float, int]:
    """(update s, fwd_bwd s, update compile s, fwd_bwd compile s, traces) on one microbatch (medians)."""
    batch = {k: jax.numpy.asarray(v) for k, v in mb.arrays.items()}
    upd, params, opt_state = make_update(model, cfg, total_steps=100)
    params = jax.tree.map(jax.numpy.copy, params)  # the update donates them; the model keeps its own
    t0 = time.perf_counter()
    jax.block_until_ready(upd.fwd_bwd(params, batch))
    compile_fb = time.perf_counter() - t0
    fwd_bwd_s = median_time(lambda: upd.fwd_bwd(params, batch), repeats)
    state = {"params": params, "opt": opt_state}

    def step():
        state["params"], state["opt"], metrics = upd(state["params"], state["opt"], batch)
        return metrics

    t0 = time.perf_counter()
    jax.block_until_ready(step())
    compile_update = time.perf_counter() - t0
    return median_time(step, repeats), fwd_bwd_s, compile_update, compile_fb, upd.traces


# --------------------------------------------------------------------------------------------------------
# Layouts: rows vs tree on a trial-loop archive at the demo's sizes and a synthetic one at the paper's shape
# --------------------------------------------------------------------------------------------------------


def demo_data(quick: bool, log=print) -> dict[str, Any]:
    """The demo's tokenizer, its demonstrations and one RL batch of T@3 trials, all from the real trial loop.

    As ``retrojax demo``: byte-level oracle demonstrations train a sentencepiece tokenizer, then the same
    demonstrations are replayed with it. The RL batch is ``learn.tasks_per_update`` pool levels ×
    ``trial.trials_per_task`` trials of the noisy oracle (it rewinds and reflects like a trained policy).
    """
    import tempfile

    from retrojax.agent.chat import ByteChatTokenizer
    from retrojax.agent.env_api import make_env
    from retrojax.agent.policies import OraclePolicy
    from retrojax.agent.runner import Runner, make_specs
    from retrojax.config import load
    from retrojax.learn.warm_start import corpus_from_archive, run_demonstrations
    from retrojax.model.tokenizer import train_sentencepiece

    sets = (["sft.num_recovery_episodes=4", "learn.tasks_per_update=1", "trial.trials_per_task=4",
             "trial.max_calls=2", "sft.seq_len=256", "sft.batch_size=2"] if quick else [])
    cfg = load("configs/demo.yaml", sets)
    env = make_env(cfg, f"{cfg.env.split}:train")
    try:
        byte_demos, _ = run_demonstrations(cfg, env, None)
        corpus = corpus_from_archive(byte_demos, ByteChatTokenizer().decode)
        tokenizer = train_sentencepiece(corpus, cfg.sft.vocab_size, tempfile.mkdtemp(prefix="bench-tok-"))
        demos, _ = run_demonstrations(cfg, env, tokenizer)
        pool = cfg.learn.train_tasks or cfg.learn.tasks_per_update
        tasks = [i % pool for i in range(cfg.learn.tasks_per_update)]
        specs = make_specs(tasks, [cfg.run.seed + 1], cfg.trial.trials_per_task, [cfg.trial.protocol])
        rl = Runner(cfg, env, OraclePolicy(cfg.sft.oracle_epsilon), tokenizer=tokenizer).run(specs)
    finally:
        env.close()
    log(f"demo archive: {len(rl.trials)} trials, {len(rl.calls)} calls, {len(rl.recoveries)} recoveries; "
        f"{len(demos.calls)} demonstration calls; tokenizer {tokenizer.vocab_size} ids")
    return {"cfg": cfg, "tokenizer": tokenizer, "demos": demos, "archive": rl}


def paper_archive(quick: bool, vocab: int) -> Any:
    """8 trials × 30 execution calls (3 segments of 10, rewinds + reflections between), ~200-token turns."""
    sizes = (dict(tasks=1, trials=2, segments=2, decisions=3, prompt_len=48, turn_len=16, output_len=16)
             if quick else dict(tasks=1, trials=8, segments=3, decisions=10, prompt_len=1024, turn_len=150,
                                output_len=100))
    return synthetic_archive(np.random.default_rng(7), vocab=vocab, **sizes)


def behaviour_logprobs(archive: Any, vocab: int, seed: int = 0) -> None:
    """Behaviour log-probs near a random model's (-log V), so the clipped ratio is exercised."""
    rng = np.random.default_rng(seed)
    for c in archive.calls:
        c.logprobs = (-np.log(vocab) + rng.normal(0.0, 0.3, len(c.output_ids))).astype(np.float32)


def time_update(model: Any, cfg: LearnConfig, plan: Any) -> tuple[float, int, float]:
    """Wall seconds of one whole update over ``plan`` (after a compile run), the programs it compiled, and the
    process CPU seconds of that update (all threads: steadier than wall time on a shared machine)."""
    upd, params, opt_state = make_update(model, cfg, total_steps=100)
    params = jax.tree.map(jax.numpy.copy, params)  # the update donates them; the model keeps its own
    steps = [[{k: jax.numpy.asarray(v) for k, v in mb.arrays.items()} for mb in group]
             for group in plan.minibatches]

    seen: set[tuple] = set()
    for group in steps:  # compile every program once: one microbatch per shape and one optimizer step
        for b in group:
            shape = tuple(sorted((k, v.shape) for k, v in b.items()))
            if shape not in seen:
                seen.add(shape)
                acc = upd.accumulate(params, None, b)
    copies = jax.tree.map(jax.numpy.copy, (params, opt_state))
    jax.block_until_ready(upd.apply(*copies, acc))
    t0, c0 = time.perf_counter(), time.process_time()
    for group in steps:
        params, opt_state, metrics = upd(params, opt_state, group)
    jax.block_until_ready((params, metrics))
    return time.perf_counter() - t0, upd.traces, time.process_time() - c0


def attention_pairs(arrays: dict[str, np.ndarray]) -> int:
    """Query × key pairs the model's attention computes on one microbatch (whole blocks, padding included).

    ``rows`` and token forests of rows up to ``TREE_SPARSE_FROM``: causal query blocks of ``CAUSAL_Q_BLOCK``
    against every key up to the block's end; longer token-forest rows: the ``TREE_BLOCK`` block pairs the
    block-sparse ``attend_tree`` visits.
    """
    from retrojax.model.qwen3 import CAUSAL_Q_BLOCK, TREE_BLOCK, TREE_SPARSE_FROM

    rows, t = arrays["input_ids"].shape
    if "tree_exit" not in arrays:
        if t <= CAUSAL_Q_BLOCK:
            return rows * t * t
        return rows * sum((min(lo + CAUSAL_Q_BLOCK, t) - lo) * min(lo + CAUSAL_Q_BLOCK, t)
                          for lo in range(0, t, CAUSAL_Q_BLOCK))
    if t <= TREE_SPARSE_FROM:  # dense causal blocks, as rows (see ``attend_tree``)
        return attention_pairs({"input_ids": arrays["input_ids"]})
    nb = -(-t // TREE_BLOCK)
    exits = np.pad(arrays["tree_exit"], ((0, 0), (0, nb * TREE_BLOCK - t)), constant_values=t + 1)
    reach = exits.reshape(rows, nb, TREE_BLOCK).max(axis=(0, 2))  # one cond for the whole microbatch
    qi, ki = np.arange(nb)[:, None], np.arange(nb)[None, :]
    visited = (ki <= qi) & (reach[None, :] > qi * TREE_BLOCK)
    return rows * int(visited.sum()) * TREE_BLOCK * TREE_BLOCK


def archive_figures(name: str, archive: Any, model: Any, cfg: LearnConfig, log=print) -> dict[str, float]:
    """update.<name>.{rows,tree}.* and update.<name>.speedup for one archive."""
    from retrojax.learn.batch import build_sequences
    from retrojax.learn.layout import from_sequence, unique_tokens

    adv = advantages_from_config(archive, cfg)
    skip_zero = cfg.kl_coef == 0.0  # as the trainer: zero-advantage calls are not trained without a KL term
    seqs, _ = build_sequences(archive, adv, lambda_ref=cfg.lambda_ref, max_len=max(cfg.seq_buckets),
                              chain=cfg.chain_segments, skip_zero=skip_zero)
    distinct = unique_tokens([from_sequence(s) for s in seqs])
    out: dict[str, float] = {f"update.{name}.distinct_tokens": float(distinct)}
    for layout in ("rows", "tree", "tree_long"):  # learn.layout values
        plan = plan_batches(archive, adv, lambda_ref=cfg.lambda_ref, seq_buckets=cfg.seq_buckets,
                            max_batch_tokens=cfg.max_batch_tokens, minibatches=cfg.minibatches,
                            chain=cfg.chain_segments, skip_zero=skip_zero, layout=layout)
        positions, trained = plan.stats["batch/padded_tokens"], plan.stats["batch/trained_tokens"]
        pairs = sum(attention_pairs(mb.arrays) for mb in plan.microbatches)
        seconds, programs, cpu = time_update(model, cfg, plan)
        key = f"update.{name}.{layout}"
        out.update({f"{key}.positions_per_trained_token": positions / trained,
                    f"{key}.unique_token_ratio": positions / distinct, f"{key}.s": seconds,
                    f"{key}.cpu_s": cpu,
                    f"{key}.attention_pairs_per_trained_token": pairs / trained,
                    f"{key}.programs": float(programs), f"{key}.microbatches": float(len(plan.microbatches))})
        log(f"{key}: {positions:.0f} positions, {trained:.0f} trained tokens, {pairs:.3g} attention pairs, "
            f"{len(plan.microbatches)} microbatches, {programs} programs, {seconds:.2f} s ({cpu:.1f} CPU s)")
    out[f"update.{name}.speedup"] = out[f"update.{name}.rows.s"] / out[f"update.{name}.tree.s"]
    out[f"update.{name}.speedup_long"] = out[f"update.{name}.rows.s"] / out[f"update.{name}.tree_long.s"]
    for lay, suffix in (("tree", ""), ("tree_long", "_long")):  # the same ratios in process CPU seconds
        out[f"update.{name}.cpu_speedup{suffix}"] = (out[f"update.{name}.rows.cpu_s"]
                                                    / out[f"update.{name}.{lay}.cpu_s"])
    pairs = [out[f"update.{name}.{lay}.attention_pairs_per_trained_token"]
             for lay in ("rows", "tree", "tree_long")]
    out[f"update.{name}.attention_pairs_ratio"] = pairs[0] / pairs[1]
    out[f"update.{name}.attention_pairs_ratio_long"] = pairs[0] / pairs[2]
    return out


def sft_figures(data: dict[str, Any], model: Any, steps: int, log=print) -> dict[str, float]:
    """sft.{rows,tree,tree_long}.positions_per_trained_token, .s (``steps`` SFT steps after a compile pass),
    speedup (rows / tree) and speedup_long (rows / tree_long)."""
    from flax import nnx

    from retrojax.learn import sft
    from retrojax.learn.warm_start import special_ids

    cfg = data["cfg"]
    end_id, pad = special_ids(data["tokenizer"])
    calls = data["demos"].calls
    examples, _ = sft.pack_calls([(c.prompt_ids, c.output_ids) for c in calls], cfg.sft.seq_len,
                                 end_id=end_id, train=[bool(c.teach) for c in calls])
    buckets = sorted({b for b in cfg.learn.seq_buckets if b < cfg.sft.seq_len} | {cfg.sft.seq_len})
    batches = sft.iterate_batches(examples, cfg.sft.batch_size, buckets, np.random.default_rng(0))
    groups = [next(batches) for _ in range(steps)]
    graphdef, params = nnx.split(model)
    optimizer = sft.make_optimizer(1e-4, steps)
    step_fn = sft.make_sft_step(graphdef, optimizer, cfg.learn.logprob_chunk)
    out: dict[str, float] = {}
    for layout in ("rows", "tree", "tree_long"):
        arrays = [sft.make_batch(g, cfg.sft.batch_size, buckets, pad, layout) for g in groups]
        positions = sum(a["input_ids"].size for a in arrays)
        trained = sum(float(a["loss_mask"].sum()) for a in arrays)
        dev = [{k: jax.numpy.asarray(v) for k, v in a.items()} for a in arrays]
        p, o = jax.tree.map(jax.numpy.copy, params), optimizer.init(params)
        seen: set[tuple] = set()
        for b in dev:  # compile every shape once
            shape = tuple(sorted((k, v.shape) for k, v in b.items()))
            if shape not in seen:
                seen.add(shape)
                p, o, m = step_fn(p, o, b)
        jax.block_until_ready(p)
        t0 = time.perf_counter()
        for b in dev:
            p, o, m = step_fn(p, o, b)
        jax.block_until_ready((p, m))
        seconds = time.perf_counter() - t0
        out[f"sft.{layout}.positions_per_trained_token"] = positions / trained
        out[f"sft.{layout}.s"] = seconds
        out[f"sft.{layout}.programs"] = float(len(seen))
        log(f"sft.{layout}: {len(examples)} examples, {steps} steps, {positions} positions, {trained:.0f} "
            f"trained tokens, {len(seen)} programs, {seconds:.2f} s")
    out["sft.speedup"] = out["sft.rows.s"] / out["sft.tree.s"]
    out["sft.speedup_long"] = out["sft.rows.s"] / out["sft.tree_long.s"]
    return out


def layout_figures(quick: bool = False, log=print) -> dict[str, float]:
    """The rows-vs-tree figures of both archives and of SFT (see the module docstring)."""
    from flax import nnx

    from retrojax.model import PRESETS, Qwen3

    config = quick_model_config() if quick else PRESETS["demo"]
    model = Qwen3(config, rngs=nnx.Rngs(0))
    data = demo_data(quick, log)
    dc = data["cfg"].learn
    demo_cfg = LearnConfig(seq_buckets=QUICK_BUCKETS if quick else tuple(dc.seq_buckets),
                           max_batch_tokens=QUICK_BATCH_TOKENS if quick else dc.max_batch_tokens,
                           logprob_chunk=dc.logprob_chunk, learning_rate=1e-5, lambda_ref=dc.lambda_ref)
    behaviour_logprobs(data["archive"], config.vocab_size)
    out = archive_figures("demo", data["archive"], model, demo_cfg, log)
    paper = paper_archive(quick, config.vocab_size)
    behaviour_logprobs(paper, config.vocab_size)
    paper_cfg = LearnConfig(seq_buckets=QUICK_BUCKETS if quick else (1024, 2048, 4096, 8192),
                            max_batch_tokens=QUICK_BATCH_TOKENS if quick else 16384, logprob_chunk=256,
                            learning_rate=1e-5)
    out.update(archive_figures("paper", paper, model, paper_cfg, log))
    out.update(sft_figures(data, model, 2 if quick else 20, log))
    return out


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench update [--quick] [--json PATH]``."""
    return run_and_report(run, args)
