"""What a run holds per device, from XLA's compile-only analyses: nothing of the planned size is allocated.

For the configured model shape (preset, or a checkpoint's ``config.json``), dtype, LoRA or full
fine-tuning, mesh and batch shapes, :func:`plan_memory` compiles over abstract ``ShapeDtypeStruct``
arguments (with their shardings):

- the update's gradient step (one microbatch of ``rows × length``) and its optimizer step, with and
  without layer rematerialization → activations (``memory_analysis().temp_size_in_bytes``);
- the log-prob pass (old/reference log-probs) at the same shape;
- the sampler's two programs as the trainer runs them: a prefill of every row by the largest chunk
  bucket against the whole cache, and the whole-reply decode loop over per-layer weight copies.

Parameters, gradients (the accumulator), AdamW state, the KV cache and the sampler's weight copies are
counted from their per-device shard shapes. A phase's total is what lives on a device while it runs; the
trainer keeps its sampler between rollouts, so the sampler's KV cache and weight copies (its held state)
count in every phase: the update = params + AdamW + gradients + max(gradient-step, optimizer-step
temporaries) + held; the log-prob pass = params + AdamW + its temporaries + held; rollouts = params + AdamW
+ held + max(prefill, decode temporaries). The largest ``sampler.max_inflight`` is extrapolated in rows and
checked by a second compile; the microbatch token budget is extrapolated in rows.

The KV cache: with ``sampler.kv: paged`` (the default) the pool of pages admission sizes (:func:`kv_pages`:
``sampler.kv_pages``, or for ``auto`` what admission's bound leaves on the device, at most every row at
``max_len``), the sampler's programs compiled over the pool and page tables; the pool is held whatever the
row count, so rows cost only their temporaries (a row that outgrows the pool is evicted and recomputed).
With ``dense``, ``rows × max_len`` slots, which scale with the rows.

On XLA:CPU a bf16 model is compiled as float16 (same bytes per element): XLA:CPU rewrites bf16 ops to
float32 and so reports float32 copies of the weights and of the KV cache that no bf16-native accelerator
makes; the float32 copies it still makes of whole 16-bit weights for its matmuls are subtracted from the
sampler's figures (:func:`hoisted_upcasts`). docs/lora-and-memory.md shows where the bytes went.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from retrojax.plan.bound import GB, KVShape, lora_settings, model_shape, train_resident_bytes


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


def shapes_from_config(cfg: Any, batch_shards: int = 1) -> Shapes:
    """Microbatch: the longest sequence bucket that fits the sampler's context, rows from
    ``learn.max_batch_tokens`` (rounded up to the row shards); sampler rows: ``sampler.max_inflight``
    (0: every trial of an update)."""
    lc, sc = cfg.learn, cfg.sampler
    buckets = sorted(b for b in lc.seq_buckets if b <= sc.max_len) or [min(lc.seq_buckets)]
    length = buckets[-1]
    rows = max(1, lc.max_batch_tokens // length)
    rows = -(-rows // batch_shards) * batch_shards
    inflight = sc.inflight_rows() or lc.tasks_per_update * cfg.trial.trials_per_task
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

    from retrojax.learn.precision import master_copy
    from retrojax.learn.update import LogProbs, Update, make_optimizer
    from retrojax.model.lora import lora_plan, split_params
    from retrojax.parallel.rules import activation_sharding
    from retrojax.parallel.shard import make_plan

    model = abstract_model(shapes, remat, lora)
    tx, _ = make_optimizer(cfg.learn, 100)
    graphdef, template, compute, frozen = split_params(model)
    # the learner's float32 masters (learn.master_dtype; retrojax.learn.precision) and the optimizer over them
    params = master_copy(compute, getattr(cfg.learn, "master_dtype", "float32"))
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
    compute_bytes = shard_bytes(_with_shardings(compute, None if plan is None else plan.params))
    masters = shard_bytes(params) - compute_bytes
    out = {
        "params": float(shard_bytes(params) + (0 if frozen is None else shard_bytes(frozen))),
        "trainable": float(shard_bytes(params)),
        # with masters wider than the model: the model-dtype copy the sampler decodes with, beside them
        "compute_copy": float(compute_bytes if masters > 0 else 0),
        "opt": float(shard_bytes(opt)),
        "grads": float(shard_bytes(acc["grads"])),
        "act": float(_temp(grad_step)),
        "opt_step_temp": float(_temp(opt_step)),
        "rows": float(rows),
    }
    out["params"] += out["compute_copy"]
    out["update"] = out["params"] + out["opt"] + out["grads"] + max(out["act"], out["opt_step_temp"])
    if logprobs:
        lp = LogProbs(graphdef, template, chunk=cfg.learn.logprob_chunk, plan=plan, frozen=frozen)
        inputs = {k: batch[k] for k in ("input_ids", "targets", "attention_mask")}
        with activation_sharding(None if plan is None else plan.mesh, None if plan is None else plan.rules):
            compiled = lp._jitted.lower(params, inputs, frozen).compile()
        out["logprob_act"] = float(_temp(compiled))
        out["logprob"] = out["params"] + out["opt"] + out["logprob_act"]
    return out


def kv_pages(cfg: Any, shapes: Shapes, budget: float | None = None, remat: bool = False) -> int | None:
    """Pages of the sampler's pool as admission sizes it (None: ``sampler.kv: dense``).

    ``sampler.kv_pages`` N: N. ``auto``: what admission's closed-form bound leaves for the pool on a device
    of ``budget`` bytes beside the run's resident parts (``train_resident_bytes`` with ``remat``) and the
    rows' decode temporaries (``KVShape.pool``: at least one row at ``max_len`` and the null page, at most
    every row at ``max_len``); without a budget, every row at ``max_len``."""
    kv = KVShape(shapes.config, shapes.max_len, shapes.dtype, getattr(cfg.sampler, "kv", "dense") == "paged")
    if not kv.paged:
        return None
    setting = getattr(cfg.sampler, "kv_pages", "auto")
    if setting != "auto":
        return int(setting)
    if budget is None:
        return shapes.inflight * kv.row_pages() + 1
    parts, _ = kv.split(train_resident_bytes(cfg, remat))
    return kv.pool(budget, parts, shapes.inflight)


def _abstract_kv(shapes: Shapes, rows: int, pages: int | None, sharding: Any) -> tuple[Any, Any]:
    """The sampler's cache as abstract arrays and, for a pool of ``pages`` pages, the rows' page tables'
    shape (rows, pages of max_len); ``sharding``: the plan's cache sharding (kv heads over tp)."""
    import jax
    import jax.numpy as jnp

    from retrojax.model.qwen3 import PAGE_K_AXES, PAGE_V_AXES, PagedKVCache, abstract_cache
    from retrojax.sampling.pages import PAGE_SIZE, pages_for

    if pages is None:
        return abstract_cache(shapes.config, rows, shapes.max_len, shapes.dtype, sharding), None
    c, dt = shapes.config, jnp.dtype(shapes.dtype)

    def leaf(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> Any:
        extra = {} if sharding is None else {"sharding": sharding(shape, axes)}
        return jax.ShapeDtypeStruct(shape, dt, **extra)

    kvh, d = c.num_key_value_heads, c.head_dim
    pool = PagedKVCache(k=leaf((c.num_hidden_layers, pages, kvh, d, PAGE_SIZE), PAGE_K_AXES),
                        v=leaf((c.num_hidden_layers, pages, kvh, PAGE_SIZE, d), PAGE_V_AXES))
    return pool, (rows, pages_for(shapes.max_len, PAGE_SIZE))


def sampler_held_bytes(cfg: Any, shapes: Shapes, mesh: Any, lora: Any = None,
                       budget: float | None = None) -> float:
    """Per-device bytes the trainer's sampler keeps between rollouts, from shapes alone (no compile): its
    KV cache (a paged pool: :func:`kv_pages` for a device of ``budget`` bytes), its per-layer decode copies
    of the weights and, on a mesh, the rollout-profile weights. The trainer's collect keeps the sampler (and
    these) alive through the update and the log-prob pass."""
    from retrojax.parallel.shard import make_plan, param_shapes

    model = abstract_model(shapes, False, lora)
    multi = mesh is not None and mesh.devices.size > 1
    plan = make_plan(model, mesh, cfg.mesh.rules, cfg.mesh.strict) if multi else None
    pure = _with_shardings(param_shapes(model), None if plan is None else plan.rollout_params)
    cache, _ = _abstract_kv(shapes, shapes.inflight, kv_pages(cfg, shapes, budget), None if plan is None
                            else plan.cache)
    return float(shard_bytes([cache.k, cache.v]) + shard_bytes(pure["layers"])
                 + (shard_bytes(pure) if multi else 0))


def _layer_sharding(sharding: Any) -> Any:
    """A stacked weight's sharding without its leading ``layers`` axis (one layer's copy)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if not isinstance(sharding, NamedSharding):
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


def plan_sampler(cfg: Any, shapes: Shapes, mesh: Any, lora: Any, rows: int | None = None,
                 net: bool = True, pages: int | None = None) -> dict[str, float]:
    """Per-device bytes of rollouts as the trainer's sampler runs them (compile-only): the weights it holds
    besides the training state (the rollout-profile copy on a mesh, the per-layer decode copies of
    ``Qwen3.layer_weights``, where ``sampler.layer_copies`` keeps them), the KV cache (``pages``: a pool of
    that many pages, every row's page table ``max_len`` long; None: dense rows), and the temporaries
    of its two programs at their largest shapes: a prefill of every row by the largest chunk bucket against
    the whole cache, and the whole-reply decode loop (``sampler._decode``) over the per-layer copies (or,
    without them, a layer scan over the stacked weights).

    A LoRA policy decodes with its adapters applied per step (the trainer's sampler never merges them).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.model.qwen3 import use_layer_copies
    from retrojax.parallel.shard import make_plan, param_shapes
    from retrojax.sampler import _decode, _prefill
    from retrojax.sampling.stops import pow2_at_least

    model = abstract_model(shapes, False, lora)
    rows = rows or shapes.inflight
    c, sc = shapes.config, cfg.sampler
    multi = mesh is not None and mesh.devices.size > 1
    plan = make_plan(model, mesh, cfg.mesh.rules, cfg.mesh.strict) if multi else None
    graphdef, state = nnx.split(model)
    pure = _with_shardings(param_shapes(model), None if plan is None else plan.rollout_params)
    abstract_state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(abstract_state, pure)
    copies = use_layer_copies(getattr(sc, "layer_copies", "auto"))
    layers = jax.eval_shape(lambda s: nnx.merge(graphdef, s).layer_weights(), abstract_state) if copies \
        else None
    if plan is not None and layers is not None:
        stacked = pure["layers"]
        layers = [{k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=_layer_sharding(stacked[k].sharding))
                   for k, v in layer.items()} for layer in layers]

    def arg(shape, dtype, sharding=None):
        return jax.ShapeDtypeStruct(shape, dtype, **({} if sharding is None else {"sharding": sharding}))

    cache, table = _abstract_kv(shapes, rows, pages, None if plan is None else plan.cache)

    def per_row(shape, dtype):
        return arg(shape, dtype, None if plan is None else plan.batch(shape))

    tables = () if table is None else (per_row(table, jnp.int32),)

    width = max([b for b in sc.chunk_buckets if b <= shapes.max_len] or [min(sc.chunk_buckets)])
    prefill = _prefill.lower(graphdef, abstract_state, cache, per_row((rows, width), jnp.int32),
                             per_row((rows,), jnp.int32), *tables, window=shapes.max_len).compile()
    n_strings, vocab = 2, c.vocab_size  # e.g. </action> and </remark>: automaton tables [strings, 16, V]
    out_len = pow2_at_least(max(sc.max_new_tokens, getattr(sc, "max_reflection_tokens", 0)), 16)
    key = jax.eval_shape(lambda: jax.random.key(0))
    decode = _decode.lower(
        graphdef, abstract_state, layers, cache, per_row((rows,), jnp.int32), per_row((rows,), jnp.int32),
        per_row((rows,), jnp.int32), arg((2,), jnp.int32), arg((n_strings, 16, vocab), jnp.int16),
        arg((n_strings,), jnp.int32), per_row((rows, n_strings), jnp.bool_), per_row((rows,), jnp.float32),
        per_row((rows,), jnp.float32), per_row((rows,), jnp.int32), key, *tables, out_len=out_len,
        window=shapes.max_len).compile()
    up_prefill = hoisted_upcasts(prefill.as_text()) if net else 0
    up_decode = hoisted_upcasts(decode.as_text()) if net else 0
    return {
        "kv": float(shard_bytes([cache.k, cache.v])),
        "prefill_temp": float(_temp(prefill) - up_prefill),
        "decode_temp": float(_temp(decode) - up_decode),
        "prefill_upcast": float(up_prefill),
        "decode_upcast": float(up_decode),
        # a separate copy of the whole model: the rollout profile on a mesh
        "rollout_params": float(shard_bytes(pure)) if multi else 0.0,
        "layer_copy": float(shard_bytes(pure["layers"])) if copies else 0.0,
        "rows": float(rows),
        "pages": float(pages or 0),
    }


_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(([^)]*)\)")
_ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4}


def hoisted_upcasts(hlo_text: str) -> int:
    """Bytes of the float32 copies of whole 16-bit float parameters that the entry computation makes.

    XLA:CPU of jaxlib 0.10 has no 16-bit float matmul for these shapes: it converts the operands to float32,
    and since a weight is loop-invariant the convert is hoisted out of the decode / layer loop, so a float32
    shadow of every weight (and of the LM head) is live for the whole loop. A bf16/f16-native device (GPU,
    TPU) makes none of them, nor does XLA:CPU of jaxlib 0.12 for bf16 (its dot runs bf16 natively).
    Counted: a convert (or a fusion of one operand: convert, bitcast, transpose) in
    the ENTRY computation whose output is f32 with the element count of its 16-bit float parameter.
    """
    start = hlo_text.find("\nENTRY")
    if start < 0:
        return 0
    params: dict[str, int] = {}
    total = 0
    for line in hlo_text[start:].splitlines()[1:]:
        m = _HLO_LINE.match(line)
        if m is None:
            continue
        name, dtype, dims, op, operands = m.groups()
        count = math.prod(int(d) for d in dims.split(",") if d)
        if op == "parameter" and dtype in ("f16", "bf16"):
            params[name] = count
        elif op in ("fusion", "convert", "copy") and dtype == "f32":
            src = operands.strip().removeprefix("%")
            if "," not in operands and params.get(src) == count:
                total += count * _ITEMSIZE["f32"]
    return total


def _compile_shapes(shapes: Shapes, standin: bool) -> Shapes:
    """The shapes to compile: bf16 as float16 (same bytes per element) when ``standin``."""
    return dataclasses.replace(shapes, dtype="float16") if standin and shapes.dtype == "bfloat16" else shapes


def _fit_rows(device_bytes: float, fixed: float, per_row: float, shards: int) -> int:
    return int(max(0.0, device_bytes - fixed) // max(per_row, 1.0)) // shards * shards


def plan_memory(cfg: Any, device_bytes: float, *, mesh: Any = None, log=print, compare: bool = True,
                standin: bool | None = None) -> dict[str, Any]:
    """The memory plan of ``cfg`` for a device of ``device_bytes`` (see the module docstring).

    ``learn.remat`` true/false plans that setting (the other is shown for contrast); ``auto`` picks remat
    off when the update fits without it, else on. ``compare`` also plans the other route (full vs LoRA)
    and, under the float16 stand-in, XLA:CPU's own bf16 figures. ``standin`` (default: on when compiling
    on CPU for a bf16 model) compiles bf16 as float16: XLA:CPU upcasts every bf16 op to float32 (see
    :func:`hoisted_upcasts` and docs/lora-and-memory.md), which no bf16-native accelerator does.
    Returns flat ``plan.*`` figures; ``plan.fits`` false comes with ``plan.reason``.
    """
    import jax

    shards = 1
    if mesh is not None and mesh.devices.size > 1:
        from retrojax.parallel.rules import _axes, rules_for

        rules = rules_for("train", cfg.mesh.rules)
        shards = math.prod(mesh.shape[a] for a in _axes(rules.get("batch")) if a in mesh.shape)
    shapes = shapes_from_config(cfg, shards)
    if standin is None:
        standin = jax.devices()[0].platform == "cpu"
    standin = standin and shapes.dtype == "bfloat16"
    cshapes = _compile_shapes(shapes, standin)
    lora = shapes.lora
    route = "lora" if lora is not None else "full"
    c = shapes.config
    log(f"plan: {c.num_hidden_layers} layers × hidden {c.hidden_size} ({shapes.dtype}"
        f"{', compiled as float16' if standin else ''}, {route}"
        f"{'' if lora is None else f' rank {lora.rank}'}), microbatch ({shapes.rows}, {shapes.length}), "
        f"sampler {shapes.inflight} rows × {shapes.max_len} slots, mesh "
        f"{'1 device' if mesh is None else dict(mesh.shape)}, device {device_bytes / GB:.1f} GB")
    pages = kv_pages(cfg, shapes, device_bytes, remat=cfg.learn.remat is True)
    if pages is not None:
        from retrojax.sampling.pages import PAGE_SIZE

        log(f"plan: the KV cache is a pool of {pages} pages of {PAGE_SIZE} slots (sampler.kv_pages "
            f"{getattr(cfg.sampler, 'kv_pages', 'auto')})")
    log("plan: compiling the sampler's prefill and decode")
    samp = plan_sampler(cfg, cshapes, mesh, lora, pages=pages)
    # what the trainer's sampler keeps between rollouts (its KV cache, per-layer decode copies and, on a
    # mesh, the rollout-profile weights): resident through the update and the log-prob pass too
    held = samp["kv"] + samp["layer_copy"] + samp["rollout_params"]
    remat_cfg = cfg.learn.remat
    variants: dict[bool, dict[str, float]] = {}
    for remat in (False, True):
        log(f"plan: compiling the update ({route}, remat {'on' if remat else 'off'})")
        variants[remat] = plan_update(cfg, cshapes, mesh, remat=remat, lora=lora, logprobs=not remat)
    if remat_cfg == "auto":
        chosen = not variants[False]["update"] + held <= device_bytes
    else:
        chosen = bool(remat_cfg)
    upd = variants[chosen]
    update = upd["update"] + held
    logprob = variants[False]["logprob"] + held
    resident = upd["params"] + upd["opt"]
    sampler_temp = max(samp["prefill_temp"], samp["decode_temp"])
    rollout = resident + held + sampler_temp
    total = max(update, rollout, logprob)
    # the largest sampler.max_inflight: linear in rows from this compile, then checked by compiling there
    # (a page pool is held whatever the row count: there rows cost only their temporaries)
    kv_rows = 0.0 if pages is not None else samp["kv"]
    fixed_roll = rollout - kv_rows - sampler_temp
    fixed_upd = max(update, logprob) - kv_rows

    def rows_that_fit(s: dict[str, float]) -> int:
        per_kv = 0.0 if pages is not None else s["kv"] / s["rows"]
        return min(_fit_rows(device_bytes, fixed_roll, per_kv + max(s["prefill_temp"], s["decode_temp"])
                             / s["rows"], shards), _fit_rows(device_bytes, fixed_upd, per_kv, shards))

    inflight_fit, checked = rows_that_fit(samp), samp
    for _ in range(3):
        if inflight_fit < shards or inflight_fit == checked["rows"]:
            break
        log(f"plan: checking sampler.max_inflight {inflight_fit}")
        checked = plan_sampler(cfg, cshapes, mesh, lora, rows=inflight_fit, pages=pages)
        kv_at = 0.0 if pages is not None else checked["kv"]
        roll_at = fixed_roll + kv_at + max(checked["prefill_temp"], checked["decode_temp"])
        if roll_at <= device_bytes and fixed_upd + kv_at <= device_bytes:
            break
        inflight_fit = min(inflight_fit - shards, rows_that_fit(checked))
    per_row_upd = max(upd["act"], upd["opt_step_temp"]) / upd["rows"]
    fixed_act = update - max(upd["act"], upd["opt_step_temp"])
    rows_fit = _fit_rows(device_bytes, fixed_act, per_row_upd, shards)
    out: dict[str, Any] = {
        "plan.route": route,
        "plan.device_gb": device_bytes / GB,
        "plan.compiled_dtype": cshapes.dtype,
        "plan.remat": chosen,
        "plan.remat_setting": str(remat_cfg),
        "plan.params_gb": upd["params"] / GB,
        "plan.trainable_gb": upd["trainable"] / GB,
        "plan.opt_gb": upd["opt"] / GB,
        "plan.grads_gb": upd["grads"] / GB,
        "plan.act_gb": upd["act"] / GB,
        "plan.opt_step_temp_gb": upd["opt_step_temp"] / GB,
        "plan.sampler_held_gb": held / GB,
        "plan.update_gb": update / GB,
        "plan.logprob_act_gb": variants[False]["logprob_act"] / GB,
        "plan.logprob_gb": logprob / GB,
        "plan.kv": "dense" if pages is None else "paged",
        "plan.kv_gb": samp["kv"] / GB,
        "plan.prefill_temp_gb": samp["prefill_temp"] / GB,
        "plan.decode_temp_gb": samp["decode_temp"] / GB,
        "plan.xla_cpu_upcast_gb": max(samp["prefill_upcast"], samp["decode_upcast"]) / GB,
        "plan.sampler_weights_gb": (samp["rollout_params"] + samp["layer_copy"]) / GB,
        "plan.rollout_gb": rollout / GB,
        "plan.total_gb": total / GB,
        "plan.microbatch_rows": shapes.rows,
        "plan.microbatch_len": shapes.length,
        "plan.max_inflight": shapes.inflight,
        "plan.max_inflight_fit": inflight_fit,
        "plan.max_batch_tokens_fit": rows_fit * shapes.length,
        **({} if pages is None else {"plan.kv_pages": pages}),
        "plan.no_remat.act_gb": variants[False]["act"] / GB,
        "plan.no_remat.update_gb": (variants[False]["update"] + held) / GB,
        "plan.remat_on.act_gb": variants[True]["act"] / GB,
        "plan.remat_on.update_gb": (variants[True]["update"] + held) / GB,
    }
    if compare:
        other = _other_route(cfg, lora)
        log(f"plan: compiling the update for the other route ({'full' if lora is not None else 'lora'}, "
            f"remat {'on' if chosen else 'off'})")
        alt = plan_update(cfg, cshapes, mesh, remat=chosen, lora=other)
        name = "full" if lora is not None else "lora"
        out.update({f"plan.{name}.params_gb": alt["params"] / GB, f"plan.{name}.opt_gb": alt["opt"] / GB,
                    f"plan.{name}.grads_gb": alt["grads"] / GB, f"plan.{name}.act_gb": alt["act"] / GB,
                    f"plan.{name}.update_gb": (alt["update"] + held) / GB})
        if standin:
            log("plan: compiling the update and the sampler as bf16 too (XLA:CPU's own figures)")
            raw_u = plan_update(cfg, shapes, mesh, remat=chosen, lora=lora, logprobs=True)
            raw_s = plan_sampler(cfg, shapes, mesh, lora, net=False, pages=pages)
            out.update({"plan.xla_cpu_bf16.act_gb": raw_u["act"] / GB,
                        "plan.xla_cpu_bf16.logprob_act_gb": raw_u["logprob_act"] / GB,
                        "plan.xla_cpu_bf16.prefill_temp_gb": raw_s["prefill_temp"] / GB,
                        "plan.xla_cpu_bf16.decode_temp_gb": raw_s["decode_temp"] / GB})
    reasons = []
    if update > device_bytes:
        reasons.append(f"the update needs {update / GB:.1f} GB per device (params "
                       f"{upd['params'] / GB:.1f} + AdamW {upd['opt'] / GB:.1f} + gradients "
                       f"{upd['grads'] / GB:.1f} + activations "
                       f"{max(upd['act'], upd['opt_step_temp']) / GB:.1f} + the sampler's held state "
                       f"{held / GB:.1f}) with remat {'on' if chosen else 'off'}"
                       + ("" if chosen else f" (on: {(variants[True]['update'] + held) / GB:.1f} GB)")
                       + (f"; microbatches of at most {rows_fit * shapes.length} tokens would fit"
                          if rows_fit else ""))
    if logprob > device_bytes:
        reasons.append(f"the log-prob pass needs {logprob / GB:.1f} GB per device")
    if rollout > device_bytes or update > device_bytes and inflight_fit < shapes.inflight:
        held_kv = (f"{shapes.inflight} rows × {shapes.max_len} slots" if pages is None
                   else f"a pool of {pages} pages for {shapes.inflight} rows")
        reasons.append(f"rollouts need {rollout / GB:.1f} GB per device (KV cache {samp['kv'] / GB:.1f} "
                       f"GB: {held_kv}); at most {inflight_fit} rows (sampler.max_inflight) fit")
    out["plan.fits"] = not reasons
    if reasons:
        out["plan.reason"] = "; ".join(reasons)
    return out


def _other_route(cfg: Any, lora: Any) -> Any:
    """The route the config does not take: full fine-tuning for a LoRA config, rank-16 LoRA for a full one."""
    if lora is not None:
        return None
    return dataclasses.replace(cfg.learn.lora, rank=16)
