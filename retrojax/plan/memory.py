"""What a run holds per device, from XLA's compile-only analyses: nothing of the planned size is allocated.

For the configured model shape (preset, or a checkpoint's ``config.json``), dtype, LoRA or full
fine-tuning, mesh and batch shapes, :func:`plan_memory` compiles over abstract ``ShapeDtypeStruct``
arguments (with their shardings):

- the update's gradient step (one microbatch of ``rows × length``) and its optimizer step, with and
  without layer rematerialization → activations (``memory_analysis().temp_size_in_bytes``);
- the log-prob pass (old/reference log-probs) at the same shape;
- the sampler's one-token decode step at ``sampler.max_inflight`` rows of ``sampler.max_len`` slots.

Parameters, gradients (the accumulator), AdamW state and the KV cache are counted from their per-device
shard shapes. A phase's total is what lives on a device while it runs: the update = params + AdamW +
gradients + max(gradient-step, optimizer-step temporaries); the log-prob pass = params + AdamW + its
temporaries; rollouts = params + AdamW (still resident) + the sampler's copy of each layer's weights (and
on a mesh the rollout-profile copy) + KV cache + decode temporaries. The largest ``sampler.max_inflight``
and microbatch token budget that fit are extrapolated linearly in rows from the compiled figures.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Everything the plan compiles for, resolved from a config."""

    config: Any  # Qwen3Config
    dtype: str
    lora: Any  # LoraConfig-like (rank, alpha, targets, dtype) or None: full fine-tuning
    rows: int  # microbatch rows
    length: int  # microbatch sequence length
    inflight: int  # sampler rows
    max_len: int  # sampler slots per row


def model_shape(cfg: Any) -> Any:
    """The Qwen3Config of ``cfg.model``: a checkpoint's config.json (no weights read) or the preset."""
    from retrojax.model.qwen3 import PRESETS, Qwen3Config

    if cfg.model.path:
        return Qwen3Config.from_json(cfg.model.path)
    if cfg.model.preset not in PRESETS:
        raise ValueError(f"model.preset {cfg.model.preset!r} is not one of {sorted(PRESETS)}")
    return PRESETS[cfg.model.preset]


def lora_settings(cfg: Any) -> Any:
    """The LoRA the run trains (learn.lora with rank > 0, or the rank of ``model.adapter``), else None."""
    lora = getattr(cfg.learn, "lora", None)
    adapter = getattr(cfg.model, "adapter", None)
    if adapter:
        from retrojax.model.peft import read_adapter_config

        a = read_adapter_config(adapter)
        targets = [t for t in ("q", "k", "v", "o", "gate", "up", "down")
                   if f"{t}_proj" in (a.get("target_modules") or [])] or list(lora.targets)
        return dataclasses.replace(lora, rank=int(a["r"]), alpha=float(a["lora_alpha"]),
                                   targets=tuple(targets))
    return lora if lora is not None and lora.rank > 0 else None


def shapes_from_config(cfg: Any, batch_shards: int = 1) -> Shapes:
    """Microbatch: the longest sequence bucket that fits the sampler's context, rows from
    ``learn.max_batch_tokens`` (rounded up to the row shards); sampler rows: ``sampler.max_inflight``
    (0: every trial of an update)."""
    lc, sc = cfg.learn, cfg.sampler
    buckets = sorted(b for b in lc.seq_buckets if b <= sc.max_len) or [min(lc.seq_buckets)]
    length = buckets[-1]
    rows = max(1, lc.max_batch_tokens // length)
    rows = -(-rows // batch_shards) * batch_shards
    inflight = sc.max_inflight or lc.tasks_per_update * cfg.trial.trials_per_task
    inflight = -(-inflight // batch_shards) * batch_shards
    return Shapes(model_shape(cfg), cfg.model.dtype, lora_settings(cfg), rows, length, inflight, sc.max_len)


def abstract_model(shapes: Shapes, remat: bool, lora: Any) -> Any:
    """The policy (with adapters when ``lora``) as an abstract nnx module: shapes only."""
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.model.lora import apply_lora
    from retrojax.model.qwen3 import Qwen3

    def build():
        model = Qwen3(shapes.config, dtype=jnp.dtype(shapes.dtype), remat=remat)
        if lora is not None:
            apply_lora(model, rank=lora.rank, alpha=lora.alpha, targets=lora.targets, dtype=lora.dtype)
        return model

    return nnx.eval_shape(build)


def shard_bytes(tree: Any) -> int:
    """Per-device bytes of a tree of (abstract) arrays: each leaf's shard shape under its sharding."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _with_shardings(tree: Any, shardings: Any) -> Any:
    import jax

    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _batch(rows: int, length: int, sharding: Any, kl: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    types = {"input_ids": jnp.int32, "targets": jnp.int32, "attention_mask": jnp.bool_,
             "old_logprobs": jnp.float32, "adv": jnp.float32, "weight": jnp.float32, "exec_mask": jnp.bool_,
             "ref_mask": jnp.bool_}
    if kl:
        types["ref_logprobs"] = jnp.float32
    kw = {} if sharding is None else {"sharding": sharding}
    return {k: jax.ShapeDtypeStruct((rows, length), t, **kw) for k, t in types.items()}


def _temp(compiled: Any) -> int:
    return int(getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0))


def plan_update(cfg: Any, shapes: Shapes, mesh: Any, *, remat: bool, lora: Any, rows: int | None = None,
                logprobs: bool = False) -> dict[str, float]:
    """Per-device bytes of the update (and optionally the log-prob pass) for one variant (compile-only)."""
    import jax

    from retrojax.learn.update import LogProbs, Update, make_optimizer
    from retrojax.model.lora import lora_plan, split_params
    from retrojax.parallel.rules import activation_sharding
    from retrojax.parallel.shard import make_plan

    model = abstract_model(shapes, remat, lora)
    tx, _ = make_optimizer(cfg.learn, 100)
    graphdef, template, params, frozen = split_params(model)
    plan = None
    if mesh is not None and mesh.devices.size > 1:
        plan = lora_plan(make_plan(model, mesh, cfg.mesh.rules, cfg.mesh.strict, tx), model, tx)
    opt_abstract = jax.eval_shape(tx.init, params)
    params = _with_shardings(params, None if plan is None else plan.params)
    frozen = None if frozen is None else _with_shardings(frozen, None if plan is None else plan.frozen)
    opt = _with_shardings(opt_abstract, None if plan is None else plan.opt)
    upd = Update(graphdef, template, tx, chunk=cfg.learn.logprob_chunk, plan=plan, kl_coef=cfg.learn.kl_coef,
                 frozen=frozen)
    rows = rows or shapes.rows
    batch = _batch(rows, shapes.length, None if plan is None else plan.batch_prefix, cfg.learn.kl_coef > 0)
    acc = jax.eval_shape(upd._zero_accumulator, params)
    if plan is not None:
        acc = {"grads": _with_shardings(acc["grads"], plan.params),
               "stats": _with_shardings(acc["stats"], jax.tree.map(lambda _: plan.replicated, acc["stats"]))}
    with upd._context():
        grad_step = upd._accumulate.lower(params, acc, batch, frozen).compile()
        opt_step = upd._apply.lower(params, opt, acc).compile()
    out = {
        "params": float(shard_bytes(params) + (0 if frozen is None else shard_bytes(frozen))),
        "trainable": float(shard_bytes(params)),
        "opt": float(shard_bytes(opt)),
        "grads": float(shard_bytes(acc["grads"])),
        "act": float(_temp(grad_step)),
        "opt_step_temp": float(_temp(opt_step)),
        "rows": float(rows),
    }
    out["update"] = out["params"] + out["opt"] + out["grads"] + max(out["act"], out["opt_step_temp"])
    if logprobs:
        lp = LogProbs(graphdef, template, chunk=cfg.learn.logprob_chunk, plan=plan, frozen=frozen)
        inputs = {k: batch[k] for k in ("input_ids", "targets", "attention_mask")}
        with activation_sharding(None if plan is None else plan.mesh, None if plan is None else plan.rules):
            compiled = lp._jitted.lower(params, inputs, frozen).compile()
        out["logprob_act"] = float(_temp(compiled))
        out["logprob"] = out["params"] + out["opt"] + out["logprob_act"]
    return out


def plan_sampler(cfg: Any, shapes: Shapes, mesh: Any, lora: Any, rows: int | None = None) -> dict[str, float]:
    """Per-device bytes of rollouts: the sampler's weight copies, KV cache and decode-step temporaries."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.model.qwen3 import KVCache
    from retrojax.parallel.shard import make_plan, param_shapes
    from retrojax.sampler import _next_logits

    # the trainer's sampler decodes a LoRA policy with the adapters applied per step (no merged copy of the
    # base next to the training state); generate / serve decode merged weights (DECODE_MERGED)
    model = abstract_model(shapes, False, lora)
    rows = rows or shapes.inflight
    c, dt = shapes.config, jnp.dtype(shapes.dtype)
    cache_shape = (c.num_hidden_layers, rows, shapes.max_len, c.num_key_value_heads, c.head_dim)
    multi = mesh is not None and mesh.devices.size > 1
    plan = make_plan(model, mesh, cfg.mesh.rules, cfg.mesh.strict) if multi else None
    graphdef, state = nnx.split(model)
    pure = _with_shardings(param_shapes(model), None if plan is None else plan.rollout_params)
    abstract_state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(abstract_state, pure)
    kw = {} if plan is None else {"sharding": plan.cache(cache_shape)}
    leaf = jax.ShapeDtypeStruct(cache_shape, dt, **kw)
    tok_kw = {} if plan is None else {"sharding": plan.batch((rows,))}
    tok = jax.ShapeDtypeStruct((rows,), jnp.int32, **tok_kw)
    compiled = _next_logits.lower(graphdef, abstract_state, KVCache(k=leaf, v=leaf), tok, tok,
                                  window=shapes.max_len).compile()
    layer_bytes = shard_bytes({k: v for k, v in pure["layers"].items()})
    return {
        "kv": float(2 * shard_bytes([leaf])),
        "decode_temp": float(_temp(compiled)),
        # a separate copy of the whole model: the rollout profile on a mesh
        "rollout_params": float(shard_bytes(pure)) if multi else 0.0,
        "layer_copy": float(layer_bytes),
        "rows": float(rows),
    }


def plan_memory(cfg: Any, device_bytes: float, *, mesh: Any = None, log=print,
                compare: bool = True) -> dict[str, Any]:
    """The memory plan of ``cfg`` for a device of ``device_bytes`` (see the module docstring).

    ``learn.remat`` true/false plans that setting (the other is shown for contrast); ``auto`` picks remat
    off when the update fits without it, else on. ``compare`` also plans the other route (full vs LoRA).
    Returns flat ``plan.*`` figures; ``plan.fits`` false comes with ``plan.reason``.
    """
    from retrojax.parallel.shard import ShardingPlan  # noqa: F401  (import check: the parallel package)

    shards = 1
    if mesh is not None and mesh.devices.size > 1:
        from retrojax.parallel.rules import _axes, rules_for

        rules = rules_for("train", cfg.mesh.rules)
        shards = math.prod(mesh.shape[a] for a in _axes(rules.get("batch")) if a in mesh.shape)
    shapes = shapes_from_config(cfg, shards)
    lora = shapes.lora
    route = "lora" if lora is not None else "full"
    c = shapes.config
    log(f"plan: {c.num_hidden_layers} layers × hidden {c.hidden_size} ({shapes.dtype}, {route}"
        f"{'' if lora is None else f' rank {lora.rank}'}), microbatch ({shapes.rows}, {shapes.length}), "
        f"sampler {shapes.inflight} rows × {shapes.max_len} slots, mesh "
        f"{'1 device' if mesh is None else dict(mesh.shape)}, device {device_bytes / GB:.1f} GB")
    remat_cfg = cfg.learn.remat
    variants: dict[bool, dict[str, float]] = {}
    for remat in (False, True):
        log(f"plan: compiling the update ({route}, remat {'on' if remat else 'off'})")
        variants[remat] = plan_update(cfg, shapes, mesh, remat=remat, lora=lora, logprobs=not remat)
    if remat_cfg == "auto":
        chosen = not variants[False]["update"] <= device_bytes
    else:
        chosen = bool(remat_cfg)
    upd = variants[chosen]
    log("plan: compiling the sampler's decode step")
    samp = plan_sampler(cfg, shapes, mesh, lora)
    resident = upd["params"] + upd["opt"]
    rollout = resident + samp["rollout_params"] + samp["layer_copy"] + samp["kv"] + samp["decode_temp"]
    logprob = variants[False]["logprob"]
    total = max(upd["update"], rollout, logprob)
    per_row_roll = (samp["kv"] + samp["decode_temp"]) / samp["rows"]
    fixed_roll = rollout - samp["kv"] - samp["decode_temp"]
    inflight_fit = int(max(0.0, device_bytes - fixed_roll) // per_row_roll) // shards * shards
    per_row_upd = max(upd["act"], upd["opt_step_temp"]) / upd["rows"]
    fixed_upd = upd["update"] - max(upd["act"], upd["opt_step_temp"])
    rows_fit = int(max(0.0, device_bytes - fixed_upd) // per_row_upd) // shards * shards
    out: dict[str, Any] = {
        "plan.route": route,
        "plan.device_gb": device_bytes / GB,
        "plan.remat": chosen,
        "plan.remat_setting": str(remat_cfg),
        "plan.params_gb": upd["params"] / GB,
        "plan.trainable_gb": upd["trainable"] / GB,
        "plan.opt_gb": upd["opt"] / GB,
        "plan.grads_gb": upd["grads"] / GB,
        "plan.act_gb": upd["act"] / GB,
        "plan.opt_step_temp_gb": upd["opt_step_temp"] / GB,
        "plan.update_gb": upd["update"] / GB,
        "plan.logprob_act_gb": variants[False]["logprob_act"] / GB,
        "plan.logprob_gb": logprob / GB,
        "plan.kv_gb": samp["kv"] / GB,
        "plan.decode_temp_gb": samp["decode_temp"] / GB,
        "plan.sampler_weights_gb": (samp["rollout_params"] + samp["layer_copy"]) / GB,
        "plan.rollout_gb": rollout / GB,
        "plan.total_gb": total / GB,
        "plan.microbatch_rows": shapes.rows,
        "plan.microbatch_len": shapes.length,
        "plan.max_inflight": shapes.inflight,
        "plan.max_inflight_fit": inflight_fit,
        "plan.max_batch_tokens_fit": rows_fit * shapes.length,
        "plan.no_remat.act_gb": variants[False]["act"] / GB,
        "plan.no_remat.update_gb": variants[False]["update"] / GB,
        "plan.remat_on.act_gb": variants[True]["act"] / GB,
        "plan.remat_on.update_gb": variants[True]["update"] / GB,
    }
    if compare:
        other = _other_route(cfg, lora)
        log(f"plan: compiling the update for the other route ({'full' if lora is not None else 'lora'}, "
            f"remat {'on' if chosen else 'off'})")
        alt = plan_update(cfg, shapes, mesh, remat=chosen, lora=other)
        name = "full" if lora is not None else "lora"
        out.update({f"plan.{name}.params_gb": alt["params"] / GB, f"plan.{name}.opt_gb": alt["opt"] / GB,
                    f"plan.{name}.grads_gb": alt["grads"] / GB, f"plan.{name}.act_gb": alt["act"] / GB,
                    f"plan.{name}.update_gb": alt["update"] / GB})
    reasons = []
    if upd["update"] > device_bytes:
        reasons.append(f"the update needs {upd['update'] / GB:.1f} GB per device (params "
                       f"{upd['params'] / GB:.1f} + AdamW {upd['opt'] / GB:.1f} + gradients "
                       f"{upd['grads'] / GB:.1f} + activations "
                       f"{max(upd['act'], upd['opt_step_temp']) / GB:.1f}) with remat "
                       f"{'on' if chosen else 'off'}"
                       + ("" if chosen else f" (on: {variants[True]['update'] / GB:.1f} GB)")
                       + (f"; microbatches of at most {rows_fit * shapes.length} tokens would fit"
                          if rows_fit else ""))
    if logprob > device_bytes:
        reasons.append(f"the log-prob pass needs {logprob / GB:.1f} GB per device")
    if rollout > device_bytes:
        reasons.append(f"rollouts need {rollout / GB:.1f} GB per device (KV cache {samp['kv'] / GB:.1f} "
                       f"GB for {shapes.inflight} rows × {shapes.max_len} slots); at most "
                       f"{inflight_fit} rows (sampler.max_inflight) fit")
    out["plan.fits"] = not reasons
    if reasons:
        out["plan.reason"] = "; ".join(reasons)
    return out


def _other_route(cfg: Any, lora: Any) -> Any:
    """The route the config does not take: full fine-tuning for a LoRA config, rank-16 LoRA for a full one."""
    if lora is not None:
        return None
    return dataclasses.replace(cfg.learn.lora, rank=16)
