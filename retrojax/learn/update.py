"""The pure, jitted policy update: ``update(params, opt_state, microbatches) -> (params, opt_state, metrics)``
(one optimizer step).

One call is one optimizer step over one minibatch: the gradients of its microbatches are summed on device
(microbatches are a memory device; the step does not depend on how the minibatch was cut), then AdamW steps
once. The model is split once with ``nnx.split``; params travel as a pure dict (easy to checkpoint and
donate) and are merged back into the module inside the traced function. The optimizer is optax AdamW behind
clipping by global norm, with a warmup + constant/cosine schedule counted in optimizer steps. A non-finite
loss or gradient skips the step (params and optimizer state pass through unchanged; ``metrics['skipped'] ==
1``). The gradient step compiles once per microbatch shape; ``Update.traces`` counts its traces so tests can
check there is no retracing.

With a ``ShardingPlan`` (retrojax.parallel.shard) the update and log-prob functions are jitted with explicit
in/out shardings: params and optimizer state where the plan puts them, batches with rows over data × fsdp,
metrics replicated scalars (so any process can read them); activations are pinned by the plan's rules while
tracing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from retrojax.learn.loss import model_logprobs, surrogate_loss
from retrojax.model.lora import join_params
from retrojax.parallel.rules import activation_sharding

Params = dict[str, Any]


def split_model(model: nnx.Module) -> tuple[Any, Any, Params]:
    """(graphdef, abstract state template, params as a pure dict) of an nnx module."""
    graphdef, state = nnx.split(model)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    return graphdef, template, nnx.to_pure_dict(state)


def make_schedule(learning_rate: float, warmup_steps: int = 0, total_steps: int = 1,
                  kind: str = "constant") -> optax.Schedule:
    """Linear warmup from 0, then constant or cosine decay to 0 at ``total_steps``."""
    if kind not in ("constant", "cosine"):
        raise ValueError(f"unknown lr_schedule {kind!r}; expected constant | cosine")
    if kind == "constant":
        main = optax.constant_schedule(learning_rate)
    else:
        main = optax.cosine_decay_schedule(learning_rate, max(1, total_steps - warmup_steps))
    if warmup_steps <= 0:
        return main
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


def make_optimizer(learn_cfg: Any, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW + clip-by-global-norm from a ``LearnConfig``."""
    schedule = make_schedule(learn_cfg.learning_rate, learn_cfg.warmup_steps, total_steps,
                             getattr(learn_cfg, "lr_schedule", "constant"))
    parts = []
    if learn_cfg.max_grad_norm and learn_cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(learn_cfg.max_grad_norm))
    parts.append(optax.adamw(schedule, weight_decay=learn_cfg.weight_decay))
    return optax.chain(*parts), schedule


# Per-token means the loss reports; the accumulator carries them as token-weighted sums across microbatches.
_MEAN_METRICS = ("clip_frac", "approx_kl", "ratio_mean", "entropy_est", "adv_token_mean")
_SUM_METRICS = ("loss", "loss_exec", "loss_ref", "loss_kl", "trained_tokens")


class Update:
    """One optimizer step per minibatch: gradients summed over its microbatches, then AdamW (jitted).

    ``update(params, opt_state, microbatches)`` runs the jitted ``accumulate`` once per microbatch (compiled
    once per microbatch shape; ``traces`` counts those traces) into a gradient accumulator, then the jitted
    ``apply`` (compiled once) clips, checks finiteness and steps. The loss is a weighted token sum, so the
    summed gradient is the minibatch's gradient however the minibatch was cut into microbatches.
    """

    def __init__(self, graphdef: Any, template: Any, tx: optax.GradientTransformation, *,
                 clip_eps: float = 0.2, clip_eps_high: float | None = None, kl_coef: float = 0.0,
                 chunk: int = 512, plan: Any = None, temperature: float = 1.0, frozen: Params | None = None):
        self.traces = 0  # traces of the per-microbatch accumulate step (one per microbatch shape)
        # LoRA: ``params`` are the adapters, ``frozen`` the base (an argument of every step, never trained)
        self.frozen = frozen
        self.apply_traces = 0
        self.temperature = policy_temperature(temperature)
        self.graphdef, self.template, self.tx = graphdef, template, tx
        self.loss_kwargs = dict(clip_eps=clip_eps, clip_eps_high=clip_eps_high, kl_coef=kl_coef)
        self.chunk = chunk
        self.plan = plan
        if plan is None:
            self._accumulate = jax.jit(self._accumulate_step, donate_argnums=(1,))
            self._apply = jax.jit(self._apply_step, donate_argnums=(0, 1))
            self._zeros = jax.jit(self._zero_accumulator)
            self._fwd_bwd = jax.jit(self._grads)
        else:
            if plan.opt is None:
                raise ValueError("the sharding plan has no optimizer shardings (make_plan(..., tx=tx))")
            batch, rep, fsh = plan.batch_prefix, plan.replicated, getattr(plan, "frozen", None)
            acc = {"grads": plan.params, "stats": rep}
            self._accumulate = jax.jit(self._accumulate_step, donate_argnums=(1,),
                                       in_shardings=(plan.params, acc, batch, fsh), out_shardings=acc)
            self._apply = jax.jit(self._apply_step, donate_argnums=(0, 1),
                                  in_shardings=(plan.params, plan.opt, acc),
                                  out_shardings=(plan.params, plan.opt, rep))
            self._zeros = jax.jit(self._zero_accumulator, in_shardings=(plan.params,), out_shardings=acc)
            self._fwd_bwd = jax.jit(self._grads, in_shardings=(plan.params, batch, fsh),
                                    out_shardings=((rep, rep), plan.params))

    def _context(self):
        plan = self.plan
        return activation_sharding(None if plan is None else plan.mesh,
                                   None if plan is None else plan.rules,
                                   False if plan is None else plan.strict)

    def loss(self, params: Params, batch: dict[str, jax.Array],
             frozen: Params | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        new_lp = model_logprobs(self.graphdef, self.template, join_params(params, frozen), batch, self.chunk,
                                self.temperature)
        return surrogate_loss(new_lp, batch, **self.loss_kwargs)

    def _grads(self, params: Params, batch: dict[str, jax.Array], frozen: Params | None = None):
        return jax.value_and_grad(self.loss, has_aux=True)(params, batch, frozen)

    def _stat_names(self) -> tuple[str, ...]:
        sums = tuple(k for k in _SUM_METRICS if k != "loss_kl" or self.loss_kwargs["kl_coef"] > 0.0)
        return sums + _MEAN_METRICS + ("adv_token_sq",)

    def _zero_accumulator(self, params: Params) -> dict[str, Any]:
        stats = {k: jnp.zeros((), jnp.float32) for k in self._stat_names()}
        return {"grads": jax.tree.map(jnp.zeros_like, params), "stats": stats}

    def _accumulate_step(self, params: Params, acc: dict[str, Any], batch: dict[str, jax.Array],
                         frozen: Params | None = None):
        self.traces += 1
        (_, m), grads = self._grads(params, batch, frozen)
        n = m["trained_tokens"]
        m = dict(m, adv_token_sq=jnp.square(m["adv_token_std"]) + jnp.square(m["adv_token_mean"]))
        stats = {k: acc["stats"][k] + (m[k] if k in _SUM_METRICS else m[k] * n) for k in acc["stats"]}
        return {"grads": jax.tree.map(jnp.add, acc["grads"], grads), "stats": stats}

    def _apply_step(self, params: Params, opt_state: Any, acc: dict[str, Any]):
        self.apply_traces += 1
        grads, st = acc["grads"], acc["stats"]
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(st["loss"]) & jnp.isfinite(grad_norm)

        def apply(_):
            updates, new_opt = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        def skip(_):
            return params, opt_state

        params, opt_state = jax.lax.cond(finite, apply, skip, None)
        n = jnp.maximum(st["trained_tokens"], 1.0)
        metrics = {k: st[k] for k in _SUM_METRICS if k in st}
        metrics.update({k: st[k] / n for k in _MEAN_METRICS})
        mean = st["adv_token_mean"] / n
        metrics["adv_token_std"] = jnp.sqrt(jnp.maximum(st["adv_token_sq"] / n - mean ** 2, 0.0))
        metrics.update(grad_norm=grad_norm, skipped=(~finite).astype(jnp.float32))
        return params, opt_state, metrics

    def accumulate(self, params: Params, acc: dict[str, Any] | None, batch: dict[str, Any]) -> dict[str, Any]:
        """Add one microbatch's loss statistics and gradients to ``acc`` (None: start a fresh one)."""
        with self._context():
            if acc is None:
                acc = self._zeros(params)
            return self._accumulate(params, acc, batch, self.frozen)

    def apply(self, params: Params, opt_state: Any, acc: dict[str, Any]):
        """One optimizer step with the accumulated gradients: (params, opt_state, metrics)."""
        with self._context():
            return self._apply(params, opt_state, acc)

    def __call__(self, params: Params, opt_state: Any,
                 microbatches: dict[str, Any] | Sequence[dict[str, Any]]):
        """One optimizer step over a minibatch given as its microbatches (or a single batch dict)."""
        if isinstance(microbatches, dict):
            microbatches = [microbatches]
        if not microbatches:
            raise ValueError("an optimizer step needs at least one microbatch")
        acc = None
        for b in microbatches:
            acc = self.accumulate(params, acc, b)
        return self.apply(params, opt_state, acc)

    def fwd_bwd(self, params: Params, batch: dict[str, Any]):
        """Loss and gradients only (the bench's baseline for the cost of a step)."""
        with self._context():
            return self._fwd_bwd(params, batch, self.frozen)

    def _single_step(self, params: Params, opt_state: Any, batch: dict[str, jax.Array],
                     frozen: Params | None = None):
        acc = self._accumulate_step(params, self._zero_accumulator(params), batch, frozen)
        return self._apply_step(params, opt_state, acc)

    def lower(self, params: Any, opt_state: Any, batch: dict[str, Any]) -> Any:
        """A one-microbatch step (gradients + optimizer) lowered for (possibly abstract) arguments:
        compile-only analysis of what a step holds at once, no allocation."""
        plan = self.plan
        if plan is None:
            fn = jax.jit(self._single_step, donate_argnums=(0, 1))
        else:
            fn = jax.jit(self._single_step, donate_argnums=(0, 1),
                         in_shardings=(plan.params, plan.opt, plan.batch_prefix,
                                       getattr(plan, "frozen", None)),
                         out_shardings=(plan.params, plan.opt, plan.replicated))
        with self._context():
            lowered = fn.lower(params, opt_state, batch, self.frozen)
        self.traces -= 1  # an analysis trace, not a training program
        self.apply_traces -= 1
        return lowered


# What the log-prob pass reads from a batch: rows layout, or a token forest (retrojax.learn.layout)
_MODEL_INPUTS = ("input_ids", "targets", "attention_mask", "positions", "tree_exit", "term_node")


class LogProbs:
    """Jitted per-token log-probs of a batch under given params (old-logprob check, frozen reference)."""

    def __init__(self, graphdef: Any, template: Any, chunk: int = 512, plan: Any = None,
                 temperature: float = 1.0, frozen: Params | None = None):
        self.graphdef, self.template, self.chunk, self.plan = graphdef, template, chunk, plan
        self.frozen = frozen  # LoRA: the frozen base (params are then the adapters)
        self.temperature = policy_temperature(temperature)
        if plan is None:
            self._jitted = jax.jit(self._run)
            self._gap = jax.jit(_gap)
        else:
            b = plan.batch_prefix
            fsh = getattr(plan, "frozen", None)
            self._jitted = jax.jit(self._run, in_shardings=(plan.params, b, fsh), out_shardings=b)
            self._gap = jax.jit(_gap, in_shardings=(b, b, b), out_shardings=plan.replicated)

    def _run(self, params: Params, inputs: dict[str, jax.Array], frozen: Params | None = None):
        return model_logprobs(self.graphdef, self.template, join_params(params, frozen), inputs, self.chunk,
                              self.temperature)

    def __call__(self, params: Params, batch: dict[str, Any]) -> jax.Array:
        """Log-probs of the batch's targets: [rows, length] (rows layout) or [rows, terms] (packed | tree)."""
        plan = self.plan
        inputs = {k: batch[k] for k in _MODEL_INPUTS if k in batch}
        with activation_sharding(None if plan is None else plan.mesh, None if plan is None else plan.rules):
            return self._jitted(params, inputs, self.frozen)

    def gap(self, logprobs: jax.Array, old: jax.Array, mask: jax.Array) -> jax.Array:
        """(max, sum, count) of |logprobs − old| over ``mask``, as one replicated device array."""
        return self._gap(logprobs, old, mask)


def policy_temperature(sampling_temperature: float) -> float:
    """The temperature the learner scores tokens at: the rollouts' own (their log-probs are of softmax(z/T)),
    or 1 for greedy rollouts (temperature 0), whose recorded log-probs are the model's own."""
    t = float(sampling_temperature)
    if not t >= 0:
        raise ValueError(f"sampling temperature must be >= 0, got {sampling_temperature}")
    return t if t > 0 else 1.0


def _gap(lp: jax.Array, old: jax.Array, mask: jax.Array) -> jax.Array:
    d = jnp.where(mask, jnp.abs(lp - old), 0.0)
    return jnp.stack([jnp.max(d, initial=0.0), jnp.sum(d), jnp.sum(mask).astype(jnp.float32)])


def make_update(model: nnx.Module, learn_cfg: Any, total_steps: int, mesh: Any = None, overrides: Any = (),
                strict: bool = False, temperature: float = 1.0) -> tuple[Update, Params, Any]:
    """(update, params, opt_state) for ``model`` under a ``LearnConfig``; on ``mesh``, placed by its plan.

    A model with LoRA adapters (retrojax.model.lora) trains only them: ``params`` are the adapters and the
    update holds the frozen base. ``params`` are float32 masters unless ``learn_cfg.master_dtype`` is
    ``model`` (retrojax.learn.precision).
    """
    from retrojax.learn.precision import master_copy
    from retrojax.model.lora import lora_plan, split_params

    graphdef, template, params, frozen = split_params(model)
    params = master_copy(params, getattr(learn_cfg, "master_dtype", "float32"))  # the loss casts them down
    tx, _ = make_optimizer(learn_cfg, total_steps)
    plan = None
    if mesh is not None:
        from retrojax.parallel.shard import init_optimizer, make_plan, place_params

        plan = lora_plan(make_plan(model, mesh, overrides, strict, tx), model, tx)
        params = place_params(params, plan.params)
        if frozen is not None:
            frozen = place_params(frozen, plan.frozen)
    upd = Update(graphdef, template, tx, clip_eps=learn_cfg.clip_eps, clip_eps_high=learn_cfg.clip_eps_high,
                 kl_coef=learn_cfg.kl_coef, chunk=learn_cfg.logprob_chunk, plan=plan,
                 temperature=temperature, frozen=frozen)
    opt_state = tx.init(params) if plan is None else init_optimizer(tx, params, plan)
    return upd, params, opt_state
