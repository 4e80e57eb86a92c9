"""``retrojax bench device``: the fused attention and the model on an accelerator, against its peaks.

The device command (one GPU or TPU host, about 8 minutes)::

    retrojax bench device --json device.json

At Qwen3-0.6B and Qwen3-1.7B shapes (``qwen3-0.6b``, ``qwen3-1.7b``; random bfloat16 weights), in this
order per shape (``S`` is the shape's name):

- ``device.update.S.{rows,tree_long}.s``: one learner update (loss, gradients, AdamW; ``Update.__call__``)
  on the largest microbatch of a synthetic archive at the paper's shape (8 trials × 3 segments, 1k-token
  prompt, 16k-token microbatches), per layout; ``.tokens`` (positions, padding included), ``.model_flops``
  (6 × linear weights × positions + 12 × layers × heads × head_dim × visible query–key pairs + 6 × vocab ×
  hidden × trained tokens) and ``.mfu`` (model FLOPs / s / the device's peak; null where the table below
  lacks the device); ``device.update.S.tree_long_speedup`` = rows s / tree_long s;
  ``device.update.S.attention`` and ``.attention_rows`` = the attention ``model.attention: auto`` picked
  for token forests (pallas or xla) and for the rows layout (fused or xla; ``attention_kind``).
- ``device.memory.S.plan_bytes``: ``retrojax plan``'s bytes of that rows update (``plan_update``,
  compile-only) and ``device.memory.S.peak_bytes_in_use``: the device's own peak after running it (null
  where the device reports no ``memory_stats``, as XLA:CPU).
- ``device.forest.S.{kernel,xla_loop,dense}_s``: attention forward + backward on one 16k-token forest row
  (two task trees: a 1k-token prompt, 8 trials of chained turns below it, rewinds branching inside them) at
  the shape's heads: the Pallas kernel (``retrojax.kernels.forest_attention``), the XLA block-sparse loop
  (``attend_tree`` with its block of 64) and dense causal blocks (``attend`` with the [T, T] mask);
  ``.kernel_over_xla_loop`` and ``.kernel_over_dense`` are time ratios (other / kernel).
- ``device.rows_fused.S.{fused,xla}_s``: attention forward + backward on one causal row of as many tokens
  (the ``rows`` layout's mask) through ``jax.nn.dot_product_attention`` (``attend_fused``, ``model.attention``
  kind fused; ``.implementation`` says whether cuDNN flash attention ran or XLA's) and the einsum causal
  blocks (``attend``, kind xla); ``.xla_over_fused`` = xla s / fused s.
- ``device.prefill.S.tok_per_s.B`` and ``.mfu.B``: a 512-token prompt per row through ``Sampler.append``;
  ``device.decode.S.tok_per_s.B`` and ``.hbm_roofline_fraction.B``: 128 greedy tokens per row through
  ``Sampler.generate``, against the roofline rows / ((weight bytes + the KV bytes a step reads) / HBM
  bandwidth), at B = 1, 8, 32.

``device.forest.max_abs_err`` (and ``.out``, ``.dq``, ``.dk``, ``.dv``): the kernel against the dense
reference (``retrojax.kernels.reference``) in float32 on a 512-token forest at the first shape's heads (on the
device: the compiled kernel; goal ≤ 1e-5). ``device.backend``, ``device.kind``,
``device.peak_bf16_flops`` and ``device.hbm_bytes_per_s`` name the device and the peaks used (null if not in
the table: H100 SXM/PCIe/NVL, H200, A100 40/80 GB, TPU v4, v5e, v5p).

``--quick`` runs the same code at tiny shapes on a CPU (shape ``tiny``, the kernel in interpret mode,
128-token forests and microbatches, one timed call each, B = 8 only at a 32-token prompt and 8 new tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from retrojax.bench import median_time, run_and_report

BATCHES = (1, 8, 32)
# (device_kind substring, dense bf16 FLOP/s, HBM bytes/s), first match wins: vendor datasheet peaks
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100", 989e12, 3.35e12),
    ("A100-SXM4-40GB", 312e12, 1.555e12),
    ("A100-PCIE-40GB", 312e12, 1.555e12),
    ("A100", 312e12, 2.039e12),
    ("TPU v4", 275e12, 1.2e12),
    ("TPU v5 lite", 197e12, 0.819e12),
    ("TPU v5e", 197e12, 0.819e12),
    ("TPU v5p", 459e12, 2.765e12),
    ("TPU v5", 459e12, 2.765e12),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    shapes: tuple[str, ...]
    dtype: Any
    forest_tokens: int
    check_tokens: int
    update_tokens: int
    prompt: int
    new: int
    repeats: int
    batches: tuple[int, ...] = BATCHES  # sampler rows per prefill/decode figure


# --quick checks that every figure is computed (the test reads its keys), not speed: one timed call, and one
# sampler batch of several rows (each batch compiles a prefill and a decode of its own)
QUICK = Sizes(("tiny",), jnp.float32, 128, 128, 128, 32, 8, 1, (8,))
FULL = Sizes(("qwen3-0.6b", "qwen3-1.7b"), jnp.bfloat16, 16384, 512, 16384, 512, 128, 3)


def peaks(kind: str) -> tuple[float | None, float | None]:
    """(peak dense bf16 FLOP/s, HBM bytes/s) of a ``device_kind``; (None, None) when not in ``PEAKS``."""
    for name, flops, bandwidth in PEAKS:
        if name.lower() in kind.lower():
            return flops, bandwidth
    return None, None


def forest_row(tokens: int, rng: np.random.Generator) -> np.ndarray:
    """tree_exit [1, tokens] of a trial forest: task trees of a prompt (1/8 of a tree) and 8 trials of
    chained turns under it, each trial branching once (a rewind) halfway; the rest of the row is padding."""
    exits = np.arange(1, tokens + 1, dtype=np.int32)
    per_tree = max(tokens // 2, 16)
    start = 0
    while start + per_tree <= tokens:
        end = start + per_tree
        prompt = max(per_tree // 8, 1)
        exits[start:start + prompt] = end
        trial = (per_tree - prompt) // 8
        for t in range(8):
            lo = start + prompt + t * trial
            hi = end if t == 7 else lo + trial
            cut = lo + max((hi - lo) // 2 + int(rng.integers(-2, 3)), 1)
            exits[lo:cut] = hi  # the trial's shared first half
            mid = cut + (hi - cut) // 2
            exits[cut:mid] = mid  # the abandoned branch
            exits[mid:hi] = hi  # the resumed branch
        start = end
    return exits[None]


def visible_pairs(exits: np.ndarray) -> int:
    """Query-key pairs the forest mask allows: key j is seen by the queries [j, exit[j])."""
    idx = np.arange(exits.shape[-1])
    return int(np.maximum(exits - idx, 0).sum())


def _attention_inputs(config: Any, tokens: int, dtype: Any, seed: int):
    keys = jax.random.split(jax.random.key(seed), 4)
    n, kvh, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = jax.random.normal(keys[0], (1, tokens, n, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (1, tokens, kvh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (1, tokens, kvh, d), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[3], (1, tokens, n, d), jnp.float32).astype(dtype)
    return q, k, v, w


def _fwd_bwd(attend: Callable[..., jax.Array]):
    """jit of (out, dq, dk, dv) of ``attend(q, k, v, exits)`` for the cotangent w."""

    def run(q, k, v, exits, w):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, exits), q, k, v)
        return (out, *vjp(w))

    return jax.jit(run)


def forest_error(config: Any, tokens: int) -> dict[str, float]:
    """Kernel vs dense reference, float32, on one forest row: max |difference| per output."""
    from retrojax.kernels import forest_attention
    from retrojax.kernels.reference import forest_attention_reference

    exits = jnp.asarray(forest_row(tokens, np.random.default_rng(1)))
    q, k, v, w = _attention_inputs(config, tokens, jnp.float32, 1)
    got = _fwd_bwd(forest_attention)(q, k, v, exits, w)
    want = _fwd_bwd(forest_attention_reference)(q, k, v, exits, w)
    errs = {name: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)}
    out = {f"device.forest.max_abs_err.{name}": e for name, e in errs.items()}
    out["device.forest.max_abs_err"] = max(errs.values())
    return out


def forest_times(name: str, config: Any, sizes: Sizes, log) -> dict[str, float]:
    """Forward + backward of the kernel, the XLA loop and dense blocks on one forest row."""
    from retrojax.kernels import forest_attention
    from retrojax.model.qwen3 import TREE_BLOCK, attend, attend_tree, tree_attention_mask

    t = sizes.forest_tokens
    exits = jnp.asarray(forest_row(t, np.random.default_rng(0)))
    q, k, v, w = _attention_inputs(config, t, sizes.dtype, 0)
    impls = {
        "kernel": forest_attention,
        "xla_loop": lambda q, k, v, e: attend_tree(q, k, v, e, block=min(TREE_BLOCK, t // 2)),
        "dense": lambda q, k, v, e: attend(q, k, v, tree_attention_mask(e), causal=True),
    }
    out: dict[str, float] = {f"device.forest.{name}.tokens": float(t),
                             f"device.forest.{name}.visible_pairs": float(visible_pairs(np.asarray(exits)))}
    for impl, attend_fn in impls.items():
        fn = _fwd_bwd(attend_fn)
        jax.block_until_ready(fn(q, k, v, exits, w))  # compile
        seconds = median_time(lambda fn=fn: fn(q, k, v, exits, w), sizes.repeats)
        out[f"device.forest.{name}.{impl}_s"] = seconds
        log(f"forest {name} {impl}: {out[f'device.forest.{name}.{impl}_s']:.4f} s")
    kernel_s = out[f"device.forest.{name}.kernel_s"]
    out[f"device.forest.{name}.kernel_over_xla_loop"] = out[f"device.forest.{name}.xla_loop_s"] / kernel_s
    out[f"device.forest.{name}.kernel_over_dense"] = out[f"device.forest.{name}.dense_s"] / kernel_s
    return out


def rows_times(name: str, config: Any, sizes: Sizes, log) -> dict[str, Any]:
    """Forward + backward of one causal row: fused (``jax.nn.dot_product_attention``) vs the einsum blocks."""
    from retrojax.model.qwen3 import attend, attend_fused, fused_implementation

    t = sizes.forest_tokens
    q, k, v, w = _attention_inputs(config, t, sizes.dtype, 2)
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    impls = {"fused": lambda q, k, v, m: attend_fused(q, k, v, lambda lo, hi, s: None, causal=True),
             "xla": lambda q, k, v, m: attend(q, k, v, m, causal=True)}
    key = f"device.rows_fused.{name}"
    out: dict[str, Any] = {f"{key}.tokens": float(t),
                           f"{key}.implementation": fused_implementation(q, t, False)}
    for impl, attend_fn in impls.items():
        fn = _fwd_bwd(attend_fn)
        jax.block_until_ready(fn(q, k, v, causal, w))  # compile
        out[f"{key}.{impl}_s"] = median_time(lambda fn=fn: fn(q, k, v, causal, w), sizes.repeats)
        log(f"rows {name} {impl}: {out[f'{key}.{impl}_s']:.4f} s")
    out[f"{key}.xla_over_fused"] = out[f"{key}.xla_s"] / out[f"{key}.fused_s"]
    return out


def _linear_params(c: Any) -> int:
    """Weights of the per-token matrix products of all layers (the LM head counted apart)."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    return c.num_hidden_layers * (attn + 3 * c.hidden_size * c.intermediate_size)


def update_flops(c: Any, arrays: dict[str, np.ndarray], trained: int) -> tuple[float, float]:
    """(positions, model FLOPs) of one update's forward + backward on a microbatch (docstring formula)."""
    positions = float(np.prod(arrays["input_ids"].shape))
    if "tree_exit" in arrays:
        pairs = sum(visible_pairs(row) for row in arrays["tree_exit"])
    else:
        lengths = arrays["attention_mask"].sum(axis=1).astype(np.int64)
        pairs = int((lengths * (lengths + 1) // 2).sum())
    attention = 12.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs
    head = 6.0 * c.vocab_size * c.hidden_size * trained
    return positions, 6.0 * _linear_params(c) * positions + attention + head


def update_figures(name: str, model: Any, sizes: Sizes, peak: float | None, log) -> dict[str, Any]:
    """One learner update per layout on the largest microbatch; MFU; plan bytes vs the device's peak."""
    from retrojax.config import LearnConfig
    from retrojax.learn.advantages import advantages_from_config
    from retrojax.learn.batch import plan_batches
    from retrojax.learn.synthetic import synthetic_archive
    from retrojax.learn.update import make_update
    from retrojax.model.qwen3 import attention_kind

    c = model.config
    budget = sizes.update_tokens
    buckets = tuple(b for b in (64, 128, 512, 2048, 4096, 8192, 16384) if b <= budget)
    lc = LearnConfig(seq_buckets=buckets, max_batch_tokens=budget, logprob_chunk=min(1024, budget),
                     learning_rate=1e-5)
    shape = (dict(prompt_len=24, turn_len=6, output_len=6) if budget <= 512
             else dict(prompt_len=1024, turn_len=200, output_len=200))
    arch = synthetic_archive(np.random.default_rng(0), tasks=2, trials=8, vocab=c.vocab_size, segments=3,
                             decisions=3, **shape)
    adv = advantages_from_config(arch, lc)
    out: dict[str, Any] = {f"device.update.{name}.attention": attention_kind(model.attention, "forest"),
                           f"device.update.{name}.attention_rows": attention_kind(model.attention, "rows")}
    for layout in ("rows", "tree_long"):
        plan = plan_batches(arch, adv, lambda_ref=lc.lambda_ref, seq_buckets=lc.seq_buckets,
                            max_batch_tokens=lc.max_batch_tokens, layout=layout)
        mb = max(plan.microbatches, key=lambda m: int(np.prod(m.shape)))
        batch = {k: jnp.asarray(v) for k, v in mb.arrays.items()}
        upd, params, opt = make_update(model, lc, total_steps=100)
        state = {"params": jax.tree.map(jnp.copy, params), "opt": opt}

        def step(upd=upd, state=state, batch=batch):
            state["params"], state["opt"], metrics = upd(state["params"], state["opt"], batch)
            return metrics

        jax.block_until_ready(step())  # compile
        seconds = median_time(step, sizes.repeats)
        positions, flops = update_flops(c, mb.arrays, mb.trained_tokens)
        key = f"device.update.{name}.{layout}"
        out.update({f"{key}.s": seconds, f"{key}.tokens": positions, f"{key}.model_flops": flops,
                    f"{key}.mfu": None if peak is None else flops / seconds / peak})
        log(f"update {name} {layout} {mb.shape}: {seconds:.3f} s")
        if layout == "rows":
            out.update(memory_figures(name, model, lc, mb.shape, log))
        del upd, params, opt, state
    out[f"device.update.{name}.tree_long_speedup"] = (out[f"device.update.{name}.rows.s"]
                                                      / out[f"device.update.{name}.tree_long.s"])
    return out


def memory_figures(name: str, model: Any, lc: Any, shape: tuple[int, int], log) -> dict[str, Any]:
    """``retrojax plan``'s bytes of the rows update just run, and the device's peak bytes in use."""
    from retrojax import config as config_mod
    from retrojax.plan.memory import plan_update, shapes_from_config

    cfg = config_mod.load(None, [f"model.dtype={jnp.dtype(model.dtype).name}", "learn.lora.rank=0",
                                 f"learn.seq_buckets=[{shape[1]}]", f"sampler.max_len={shape[1]}",
                                 f"learn.max_batch_tokens={shape[0] * shape[1]}",
                                 f"learn.logprob_chunk={lc.logprob_chunk}"])
    shapes = dataclasses.replace(shapes_from_config(cfg), config=model.config)
    planned = plan_update(cfg, shapes, None, remat=bool(model.remat), lora=None, rows=shape[0])
    stats = jax.devices()[0].memory_stats()
    peak = None if not stats else stats.get("peak_bytes_in_use")
    log(f"memory {name}: plan {planned['update'] / 2**30:.2f} GiB, device peak "
        f"{'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}")
    return {f"device.memory.{name}.plan_bytes": planned["update"],
            f"device.memory.{name}.peak_bytes_in_use": None if peak is None else float(peak)}


def sampler_figures(name: str, model: Any, sizes: Sizes, peak: float | None, bandwidth: float | None,
                    log) -> dict[str, Any]:
    """Prefill and decode tokens/s through the sampler at each batch; prefill MFU, decode vs the HBM
    roofline."""
    from retrojax.sampler import Sampler

    c = model.config
    itemsize = jnp.dtype(model.dtype).itemsize
    weight_bytes = (_linear_params(c) + c.vocab_size * c.hidden_size) * itemsize
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * itemsize
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    p, new = sizes.prompt, sizes.new
    for b in sizes.batches:
        sampler = Sampler(model, rows=b, max_len=p + new + 1, chunk_buckets=(p,), min_out_len=new)
        rows = list(range(b))
        prompts = [rng.integers(0, c.vocab_size, p).tolist() for _ in rows]

        def prefill(sampler=sampler, rows=rows, prompts=prompts):
            for r in rows:
                sampler.reset(r)
            sampler.append(rows, prompts)
            return sampler.cache.k

        def decode(sampler=sampler, rows=rows):
            for r in rows:
                sampler.rewind(r, p)
            sampler.generate(rows, new, temperature=0.0, stop_token_ids=())
            return sampler.cache.k

        jax.block_until_ready(prefill())
        prefill_s = median_time(prefill, sizes.repeats)
        jax.block_until_ready(decode())
        decode_s = median_time(decode, sizes.repeats)
        pairs = p * (p + 1) / 2
        prefill_flops = b * (2.0 * _linear_params(c) * p
                             + 4.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs)
        step_bytes = weight_bytes + b * (p + new / 2) * kv_per_token
        roofline = None if bandwidth is None else b * bandwidth / step_bytes
        decode_rate = b * new / decode_s
        out.update({
            f"device.prefill.{name}.tok_per_s.{b}": b * p / prefill_s,
            f"device.prefill.{name}.mfu.{b}": None if peak is None else prefill_flops / prefill_s / peak,
            f"device.decode.{name}.tok_per_s.{b}": decode_rate,
            f"device.decode.{name}.hbm_roofline_fraction.{b}":
                None if roofline is None else decode_rate / roofline,
        })
        log(f"sampler {name} B={b}: prefill {b * p / prefill_s:.0f} tok/s, decode {decode_rate:.0f} tok/s")
        del sampler
    return out


def run(quick: bool = False, log=print) -> dict[str, Any]:
    from flax import nnx

    from retrojax.model import PRESETS, Qwen3

    sizes = QUICK if quick else FULL
    device = jax.devices()[0]
    peak, bandwidth = peaks(device.device_kind)
    figures: dict[str, Any] = {"device.backend": jax.default_backend(), "device.kind": device.device_kind,
                               "device.peak_bf16_flops": peak, "device.hbm_bytes_per_s": bandwidth}
    log(f"device: {device.device_kind} ({jax.default_backend()}), peaks {peak} FLOP/s, {bandwidth} B/s")
    figures.update(forest_error(PRESETS[sizes.shapes[0]], sizes.check_tokens))
    log(f"forest kernel vs reference (float32): max |error| {figures['device.forest.max_abs_err']:.3g}")
    for name in sizes.shapes:
        t0 = time.perf_counter()
        model = Qwen3(PRESETS[name], dtype=sizes.dtype, rngs=nnx.Rngs(0))
        figures.update(update_figures(name, model, sizes, peak, log))
        figures.update(forest_times(name, model.config, sizes, log))
        figures.update(rows_times(name, model.config, sizes, log))
        figures.update(sampler_figures(name, model, sizes, peak, bandwidth, log))
        log(f"{name}: {time.perf_counter() - t0:.0f} s")
        del model
    return figures


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench device [--quick] [--json PATH]``."""
    return run_and_report(run, args)
