"""``retrojax bench sampler``: KV-cache sampler speed vs transformers, and cache rewind vs re-prefill.

Figures (stable keys; ``wide.decode_tok_per_s.*`` / ``wide.hf_decode_tok_per_s.*`` repeat the decode
figures for a wider model):

- ``decode_tok_per_s.{1,32}``: new tokens per second for 64 greedy tokens after a 16-token prompt at batch 1
  and 32 (append + generate, compiled beforehand), and ``hf_decode_tok_per_s.{1,32}`` for transformers
  ``generate`` on the same weights (save_pretrained -> ``Qwen3ForCausalLM.from_pretrained``, torch CPU, same
  run; the better of torch's default thread count and one thread).
- ``long_decode_tok_per_s.32``: 64 greedy tokens at batch 32 after a 1024-token prompt, generate only (the
  prompt is prefilled once; each repeat rewinds to it): the context an agent's later turns decode against,
  where reading the cache window dominates a step. Ours only.
- ``multiturn.*``: 32 rows × 20 turns of ~40 observation tokens and 30 sampled tokens; every 5th turn each row
  rewinds 1–3 turns back (staggered by row). ``rewind``: append the new observation, rewind the cache to a
  checkpoint; ``reprefill``: reset the row and prefill the whole conversation every turn (what agent loops
  that re-send the conversation do). ``prefill_tokens`` counts appended tokens; ``wall_s`` is the scenario's
  time; ``prefill_ratio`` and ``wall_ratio`` are reprefill / rewind.

- ``sampler.kv.*``: the paged KV cache against the dense one (:mod:`retrojax.bench.kv_pages`): KV bytes
  held over bytes used on a replayed oracle T@3 archive at configs/sokoban.yaml, the share of a task's prompt
  pages, rows that fit 80 GB at Qwen3-4B each way, and CPU decode tokens/s paged over dense.

The tiny model is the issue's (hidden 64, 2 layers, 4 heads, 2 kv heads, head_dim 16, vocab 1000); the wide
one has hidden 512, 4 layers, 8 heads, 4 kv heads, head_dim 64. ``--quick`` shrinks everything but the
batches (smoke test: 8 new tokens, a 64-token long prompt, a small multi-turn scenario, the "wide" figures
on the tiny model) and writes the same keys.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from retrojax.bench import run_and_report
from retrojax.model.checkpoint import save_pretrained
from retrojax.model.qwen3 import Qwen3, Qwen3Config
from retrojax.sampler import Sampler

MODELS = {
    "": Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    "wide.": Qwen3Config(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=4096),
}

# --quick: the same keys, the "wide" figures on the tiny model again (the code path, not the figures: its
# programs are the tiny model's, already compiled)
QUICK_MODELS = {"": MODELS[""], "wide.": MODELS[""]}


def _timed(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls (the first call of each shape was made before)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_ours(model: Qwen3, batch: int, prompt_len: int, new: int, repeats: int,
                prefill_once: bool = False) -> float:
    """Tokens/s of append + greedy generate on the KV-cache sampler; ``prefill_once``: the prompt is prefilled
    once and each run rewinds to it (generate only)."""
    buckets = (256,) if prefill_once else (prompt_len,)
    sampler = Sampler(model, rows=batch, max_len=prompt_len + new + 1, chunk_buckets=buckets)
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, prompt_len))
    rows = list(range(batch))
    if prefill_once:
        sampler.append(rows, list(prompts))

    def run():
        if prefill_once:  # back to the end of the prompt
            for r in rows:
                sampler.rewind(r, prompt_len)
        else:
            for r in rows:
                sampler.reset(r)
            sampler.append(rows, list(prompts))
        outs = sampler.generate(rows, new, temperature=0.0)
        assert all(o.ids.size == new for o in outs)

    run()
    return batch * new / _timed(run, repeats)


def decode_hf(path: Path, batch: int, prompt_len: int, new: int, repeats: int) -> float:
    """Tokens/s of transformers ``generate`` (greedy, exactly ``new`` tokens) on torch CPU.

    Measured with torch's default thread count and with one thread, and the better figure is kept: on a
    loaded machine torch's threads can oversubscribe the cores and run ~10x slower, which would flatter us.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = torch.as_tensor(np.random.default_rng(0).integers(0, hf.config.vocab_size, (batch, prompt_len)))

    def run():
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert out.shape == (batch, prompt_len + new)

    default_threads = torch.get_num_threads()
    best = 0.0
    try:
        for threads in sorted({default_threads, 1}, reverse=True):
            torch.set_num_threads(threads)
            run()
            best = max(best, batch * new / _timed(run, repeats))
    finally:
        torch.set_num_threads(default_threads)
    return best


def multiturn(model: Qwen3, *, rows: int, turns: int, obs_len: int, gen_len: int, rewind_every: int,
              reprefill: bool) -> tuple[int, float]:
    """One multi-turn scenario; returns (prefill tokens, wall seconds). Shapes are compiled beforehand."""
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    obs = [[rng.integers(0, vocab, obs_len + int(rng.integers(-obs_len // 4, obs_len // 4 + 1)))
            for _ in range(rows)] for _ in range(turns)]
    max_len = 1 << (turns * (obs_len + obs_len // 4 + gen_len)).bit_length()
    sampler = Sampler(model, rows=rows, max_len=max_len, chunk_buckets=(64, 256))
    all_rows = list(range(rows))
    key = jax.random.key(0)

    def scenario() -> None:
        conv = [np.zeros((0,), np.int32) for _ in all_rows]
        marks: list[list[int]] = [[] for _ in all_rows]
        for r in all_rows:
            sampler.reset(r)
        for t in range(turns):
            for r in all_rows:
                marks[r].append(conv[r].size)  # checkpoint C_t: the conversation before turn t
                if t % rewind_every == rewind_every - 1:
                    back = marks[r][max(t - 1 - r % 3, 0)]
                    conv[r] = conv[r][:back]
                    if not reprefill:
                        sampler.rewind(r, back)
                conv[r] = np.concatenate([conv[r], obs[t][r]]).astype(np.int32)
            if reprefill:
                for r in all_rows:
                    sampler.reset(r)
                sampler.append(all_rows, conv)
            else:
                sampler.append(all_rows, [obs[t][r] for r in all_rows])
            outs = sampler.generate(all_rows, gen_len, key=jax.random.fold_in(key, t))
            for r, o in zip(all_rows, outs, strict=True):
                conv[r] = np.concatenate([conv[r], o.ids])
                assert sampler.length(r) == conv[r].size

    scenario()  # compile every shape the scenario uses
    sampler.stats["prefill_tokens"] = 0
    t0 = time.perf_counter()
    scenario()
    return sampler.stats["prefill_tokens"], time.perf_counter() - t0


def run(quick: bool = False, log=print) -> dict[str, float]:
    """All figures, keyed as in the module docstring."""
    figures: dict[str, float] = {}
    batches, long_batch = (1, 32), 32
    prompt_len, new, repeats = (16, 8, 1) if quick else (16, 64, 3)
    long_prompt = 64 if quick else 1024
    scen = (dict(rows=4, turns=5, obs_len=12, gen_len=6, rewind_every=5) if quick
            else dict(rows=32, turns=20, obs_len=40, gen_len=30, rewind_every=5))
    models = QUICK_MODELS if quick else MODELS
    for prefix, config in models.items():
        model = Qwen3(config, rngs=nnx.Rngs(0))
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, tmp)
            for b in batches:
                key = b
                ours = figures[f"{prefix}decode_tok_per_s.{key}"] = decode_ours(model, b, prompt_len, new,
                                                                                 repeats)
                hf = figures[f"{prefix}hf_decode_tok_per_s.{key}"] = decode_hf(Path(tmp), b, prompt_len, new,
                                                                              repeats)
                log(f"{prefix}decode_tok_per_s.{key}: {ours:.1f} (transformers {hf:.1f})")
        long = figures[f"{prefix}long_decode_tok_per_s.{long_batch}"] = decode_ours(
            model, long_batch, long_prompt, new, repeats, prefill_once=True)
        log(f"{prefix}long_decode_tok_per_s.{long_batch}: {long:.1f} ({long_prompt}-token prompts)")
        if prefix:
            continue  # the multi-turn scenario runs on the tiny model only (minutes on 2 CPU cores)
        for mode in ("rewind", "reprefill"):
            tokens, wall = multiturn(model, reprefill=mode == "reprefill", **scen)
            figures[f"{prefix}multiturn.prefill_tokens.{mode}"] = tokens
            figures[f"{prefix}multiturn.wall_s.{mode}"] = wall
            log(f"{prefix}multiturn.{mode}: {tokens} prefill tokens, {wall:.2f} s")
        figures[f"{prefix}multiturn.prefill_ratio"] = (figures[f"{prefix}multiturn.prefill_tokens.reprefill"]
                                                      / figures[f"{prefix}multiturn.prefill_tokens.rewind"])
        figures[f"{prefix}multiturn.wall_ratio"] = (figures[f"{prefix}multiturn.wall_s.reprefill"]
                                                   / figures[f"{prefix}multiturn.wall_s.rewind"])
    from retrojax.bench import kv_pages

    figures.update(kv_pages.run(quick=quick, log=log))
    return figures


def main(args: argparse.Namespace) -> int:
    return run_and_report(run, args)
