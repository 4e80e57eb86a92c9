"""``retrojax bench parallel``: what sharding costs and saves, from XLA's own analyses (CPU-meaningful).

On 8 simulated CPU devices (the command re-runs itself with ``--xla_force_host_platform_device_count=8`` when
fewer are visible) it compiles, for the same model and microbatch:

- the update unsharded (one device) and on the mesh: per-device FLOPs and bytes from ``cost_analysis`` →
  ``parallel.update_flops_per_device_ratio`` = sharded per-device FLOPs ÷ (unsharded FLOPs ÷ devices)
  (goal ≤ 1.3), the same for bytes accessed;
- per-device memory from the plan's shard shapes (params, optimizer state, KV cache) and ``memory_analysis``
  (activations/temporaries of the update);
- collectives in the compiled HLO (count and bytes) per update and per decode step, for the rollout profile
  and, for contrast, the train profile → ``parallel.decode_weight_allgathers`` (rollout profile; goal 0);
- compile times and trace counts;
- a plan for Qwen3-4B with 8k-token sequences (``plan.*``): per-device bytes from a compile-only analysis over
  abstract shapes — nothing of that size is allocated — and whether it fits ``--device-gb``.

``--quick`` runs every step on the tiny model at small shapes, the plan included (tiny, 256 tokens): a smoke
test of the code path, not figures.

Step time against device count means nothing on simulated CPU devices (they share the same cores); measure it
on a GPU/TPU host with ``retrojax bench update`` under ``--set mesh.*``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time
from typing import Any

DEVICES = 8
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8,
                "s64": 8}


def collectives(hlo: str) -> dict[str, Any]:
    """Count and result bytes of each collective op in compiled HLO text (async starts counted once)."""
    out: dict[str, Any] = {}
    pattern = re.compile(r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")
    for m in pattern.finditer(hlo):
        op = m.group(2)
        shapes = re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1))
        nbytes = sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(x) for x in dims.split(",") if x)
                     for dt, dims in shapes)
        out[f"{op}.count"] = out.get(f"{op}.count", 0) + 1
        out[f"{op}.bytes"] = out.get(f"{op}.bytes", 0) + nbytes
        out.setdefault(f"{op}.shapes", []).append([tuple(int(x) for x in dims.split(",") if x)
                                                   for _, dims in shapes])
    return out


def weight_allgathers(hlo: str, weight_shapes: set[tuple[int, ...]]) -> int:
    """All-gathers whose result is a weight (whole, or one layer's slice of a stacked weight)."""
    found = collectives(hlo).get("all-gather.shapes", [])
    return sum(1 for shapes in found if any(s in weight_shapes for s in shapes))


def _weight_shapes(params: Any, axis_sizes: list[int]) -> set[tuple[int, ...]]:
    """Every shape a (partly) gathered weight matrix can have: whole or one layer's slice, each dimension
    whole or split by a mesh axis size (norms, 1-D, are left out: they are replicated)."""
    import itertools

    import jax

    ks = sorted({k for k in axis_sizes if k > 1} | {math.prod(axis_sizes)})
    out: set[tuple[int, ...]] = set()
    for x in jax.tree.leaves(params):
        for shape in (tuple(x.shape), tuple(x.shape[1:])):
            if len(shape) < 2:
                continue
            options = [[d] + [d // k for k in ks if d % k == 0] for d in shape]
            out.update(itertools.product(*options))
    return out


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def _shard_bytes(tree: Any) -> int:
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _abstract(tree: Any, shardings: Any) -> Any:
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    r = np.random.default_rng(seed)
    mask = np.zeros((rows, length), bool)
    mask[:, length // 4:] = True
    return {"input_ids": r.integers(0, vocab, (rows, length)).astype(np.int32),
            "targets": r.integers(0, vocab, (rows, length)).astype(np.int32),
            "attention_mask": np.ones((rows, length), bool),
            "old_logprobs": np.full((rows, length), -5.0, np.float32),
            "adv": r.normal(size=(rows, length)).astype(np.float32),
            "weight": np.where(mask, 1.0 / mask.sum(), 0.0).astype(np.float32),
            "exec_mask": mask, "ref_mask": np.zeros((rows, length), bool)}


def _abstract_batch(rows: int, length: int, sharding: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    types = {"input_ids": jnp.int32, "targets": jnp.int32, "attention_mask": jnp.bool_,
             "old_logprobs": jnp.float32, "adv": jnp.float32, "weight": jnp.float32, "exec_mask": jnp.bool_,
             "ref_mask": jnp.bool_}
    return {k: jax.ShapeDtypeStruct((rows, length), t, sharding=sharding) for k, t in types.items()}


def _decode_program(model: Any, plan: Any, rows: int, max_len: int, profile: str) -> tuple[str, float]:
    """Compiled HLO of the sampler's one-token step (its real jit) on the mesh, and its compile time."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.model.qwen3 import abstract_cache
    from retrojax.parallel.shard import param_shapes
    from retrojax.sampler import _next_logits

    shardings = plan.rollout_params if profile == "rollout" else plan.params
    graphdef, state = nnx.split(model)
    abstract_state = jax.tree.map(lambda x: x, state)
    pure = _abstract(param_shapes(model), shardings)
    nnx.replace_by_pure_dict(abstract_state, pure)
    cache = abstract_cache(model.config, rows, max_len, model.dtype, plan.cache)
    rows_sh = plan.batch((rows,))
    tok = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rows_sh)
    t0 = time.perf_counter()
    compiled = _next_logits.lower(graphdef, abstract_state, cache, tok, tok,
                                  window=max_len).compile()
    return compiled.as_text(), time.perf_counter() - t0


def run(quick: bool = False, log=print, mesh_shape: tuple[int, int, int] = (1, 4, 2),
        plan_preset: str | None = None, plan_tokens: int | None = None, plan_rows: int | None = None,
        device_gb: float = 80.0, plan: bool = True) -> dict[str, float | str]:
    """Every figure of the module docstring. ``plan_preset``/``plan_tokens``: the compile-only plan's model
    and sequence length (default Qwen3-4B at 8192 tokens; ``quick``: the tiny model at 256 tokens)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.config import LearnConfig
    from retrojax.learn.update import make_update
    from retrojax.model import PRESETS, Qwen3
    from retrojax.model.build import create_sharded
    from retrojax.model.qwen3 import abstract_cache
    from retrojax.parallel.mesh import make_mesh
    from retrojax.parallel.shard import global_batch, param_shapes

    if jax.device_count() < DEVICES:
        raise RuntimeError(f"bench parallel needs {DEVICES} devices, found {jax.device_count()}")
    preset = "tiny" if quick else "demo"
    config = PRESETS[preset]
    rows, length = (8, 128) if quick else (16, 512)
    plan_preset = plan_preset or ("tiny" if quick else "qwen3-4b")
    plan_tokens = plan_tokens or (256 if quick else 8192)
    lc = LearnConfig(learning_rate=1e-5, logprob_chunk=128)
    mesh = make_mesh(*mesh_shape)
    figures: dict[str, float | str] = {"model": preset, "mesh": "x".join(map(str, mesh_shape)),
                                       "devices": float(mesh.devices.size), "batch_rows": float(rows),
                                       "batch_len": float(length)}
    log(f"model {preset}, batch ({rows}, {length}), mesh (data, fsdp, tp) = {mesh_shape}")
    batch = _batch(rows, length, config.vocab_size)

    one = Qwen3(config, rngs=nnx.Rngs(0))
    u1, p1, o1 = make_update(one, lc, 10)
    t0 = time.perf_counter()
    c1 = u1.lower(p1, o1, {k: jnp.asarray(v) for k, v in batch.items()}).compile()
    figures["update_compile_1dev.s"] = time.perf_counter() - t0
    cost1 = _cost(c1)

    many = create_sharded(config, mesh, seed=0)
    um, pm, om = make_update(many, lc, 10, mesh=mesh)
    gb = global_batch(batch, um.plan)
    t0 = time.perf_counter()
    cm = um.lower(pm, om, gb).compile()
    figures["update_compile_mesh.s"] = time.perf_counter() - t0
    costm = _cost(cm)
    n = mesh.devices.size
    figures["parallel.update_flops_per_device_ratio"] = costm["flops"] / (cost1["flops"] / n)
    figures["parallel.update_bytes_per_device_ratio"] = costm["bytes"] / (cost1["bytes"] / n)
    figures["update_flops_1dev"] = cost1["flops"]
    figures["update_flops_per_device"] = costm["flops"]
    coll = collectives(cm.as_text())
    for op in _COLLECTIVES:
        figures[f"update.{op}.count"] = float(coll.get(f"{op}.count", 0))
        figures[f"update.{op}.bytes"] = float(coll.get(f"{op}.bytes", 0))
    mem = cm.memory_analysis()
    figures["update.mem.params_per_device_bytes"] = float(_shard_bytes(pm))
    figures["update.mem.opt_per_device_bytes"] = float(_shard_bytes(om))
    figures["update.mem.temp_per_device_bytes"] = float(getattr(mem, "temp_size_in_bytes", 0))
    figures["update.mem.params_1dev_bytes"] = float(_shard_bytes(p1))

    # three steps over two bucket shapes: one trace per shape
    for r, t in ((rows, length), (rows, length), (rows, length // 2)):
        pm, om, _ = um(pm, om, global_batch(_batch(r, t, config.vocab_size), um.plan))
    figures["update.traces_3_steps_2_buckets"] = float(um.traces)

    weight_shapes = _weight_shapes(param_shapes(many), [int(v) for v in mesh.shape.values()])
    dec_rows, dec_len = (8, 128) if quick else (32, 1024)
    for profile in ("rollout", "train"):
        hlo, secs = _decode_program(many, um.plan, dec_rows, dec_len, profile)
        cd = collectives(hlo)
        key = "decode" if profile == "rollout" else "decode_train_profile"
        figures[f"{key}.compile.s"] = secs
        figures[f"{key}.weight_allgathers"] = float(weight_allgathers(hlo, weight_shapes))
        for op in _COLLECTIVES:
            figures[f"{key}.{op}.count"] = float(cd.get(f"{op}.count", 0))
            figures[f"{key}.{op}.bytes"] = float(cd.get(f"{op}.bytes", 0))
    figures["parallel.decode_weight_allgathers"] = figures["decode.weight_allgathers"]
    cache = abstract_cache(config, dec_rows, dec_len, many.dtype, um.plan.cache)
    figures["decode.kv_cache_per_device_bytes"] = float(sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in (cache.k, cache.v)))
    figures["decode.rollout_params_per_device_bytes"] = float(_shard_bytes(
        _abstract(param_shapes(many), um.plan.rollout_params)))

    if plan:  # the same update with and without layer rematerialization (learn.remat)
        for remat in (False, True):
            found = memory_plan(plan_preset, mesh, tokens=plan_tokens, rows=plan_rows, device_gb=device_gb,
                                remat=remat, log=log)
            figures.update(found if not remat else {k.replace("plan.", "plan_remat.", 1): v
                                                    for k, v in found.items()})
    figures["device"] = jax.devices()[0].platform
    return figures


def memory_plan(preset: str, mesh: Any, *, tokens: int = 8192, rows: int | None = None,
                dtype: str = "bfloat16", device_gb: float = 80.0, remat: bool = False,
                trials_in_flight: int = 128, log=print) -> dict[str, float | str]:
    """Per-device bytes of one update (and the rollout KV cache) for ``preset`` at ``tokens`` per sequence.

    Compile-only: params, optimizer state and the batch are abstract (shape, dtype, sharding); XLA's
    ``memory_analysis`` of the compiled update gives the temporaries (activations, gradients' workspace).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.config import LearnConfig
    from retrojax.learn.update import Update, make_optimizer
    from retrojax.model import PRESETS, Qwen3
    from retrojax.model.qwen3 import abstract_cache
    from retrojax.parallel.shard import make_plan, param_shapes

    config = PRESETS[preset]
    dt = jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: Qwen3(config, dtype=dt, remat=remat))
    lc = LearnConfig(logprob_chunk=512)
    tx, _ = make_optimizer(lc, 100)
    plan = make_plan(model, mesh, tx=tx)
    graphdef, state = nnx.split(model)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    upd = Update(graphdef, template, tx, chunk=lc.logprob_chunk, plan=plan)
    params = _abstract(param_shapes(model), plan.params)
    opt = _abstract(jax.eval_shape(tx.init, param_shapes(model)), plan.opt)
    rows = rows or plan.batch_shards
    batch = _abstract_batch(rows, tokens, plan.batch((rows, tokens)))
    log(f"plan: {preset} ({dtype}, remat={remat}), batch ({rows}, {tokens}) on mesh {dict(mesh.shape)}: "
        "compiling")
    t0 = time.perf_counter()
    compiled = upd.lower(params, opt, batch).compile()
    mem = compiled.memory_analysis()
    cache = abstract_cache(config, trials_in_flight, tokens, dt, plan.cache)  # each leaf by its logical axes
    cache_per_dev = sum(math.prod(x.sharding.shard_shape(x.shape)) * dt.itemsize for x in (cache.k, cache.v))
    cache_total = sum(math.prod(x.shape) * dt.itemsize for x in (cache.k, cache.v))
    out = {
        "plan.model": preset, "plan.dtype": dtype, "plan.remat": str(remat), "plan.batch_rows": float(rows),
        "plan.tokens": float(tokens), "plan.compile.s": time.perf_counter() - t0,
        "plan.params_per_device_bytes": float(_shard_bytes(params)),
        "plan.opt_per_device_bytes": float(_shard_bytes(opt)),
        "plan.activations_per_device_bytes": float(getattr(mem, "temp_size_in_bytes", 0)),
        "plan.update_args_per_device_bytes": float(getattr(mem, "argument_size_in_bytes", 0)),
        "plan.kv_cache_trials": float(trials_in_flight),
        "plan.kv_cache_per_device_bytes": float(cache_per_dev),
        "plan.kv_cache_total_bytes": float(cache_total),
    }
    train_peak = (out["plan.params_per_device_bytes"] * 2 + out["plan.opt_per_device_bytes"]
                  + out["plan.activations_per_device_bytes"])  # params + grads + AdamW + temporaries
    rollout_params = _shard_bytes(_abstract(param_shapes(model), plan.rollout_params))
    out["plan.train_peak_per_device_bytes"] = float(train_peak)
    out["plan.rollout_per_device_bytes"] = float(rollout_params + cache_per_dev)
    budget = device_gb * 1e9
    out["plan.device_bytes"] = budget
    out["plan.fits_train"] = str(bool(train_peak <= budget))
    out["plan.fits_rollout"] = str(bool(rollout_params + cache_per_dev <= budget))
    return out


def _child_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "retrojax.cli", "bench", "parallel"]
    if getattr(args, "json", None):
        argv += ["--json", args.json]
    if getattr(args, "quick", False):
        argv.append("--quick")
    return argv


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench parallel [--quick] [--json PATH]`` (re-runs itself on 8 CPU devices)."""
    import jax

    from retrojax.bench import run_and_report

    if jax.device_count() < DEVICES and not os.environ.get("RETROJAX_BENCH_CHILD"):
        from retrojax.parallel.testing import simulated_env

        env = simulated_env(DEVICES, {"RETROJAX_BENCH_CHILD": "1"})
        return subprocess.call(_child_argv(args), env=env)
    return run_and_report(run, args)
