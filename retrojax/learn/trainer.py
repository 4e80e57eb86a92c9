"""The ReTRAIL training loop (``retrojax train`` is :mod:`retrojax.learn.cli`).

One iteration (one "update" in the config's count): take the next tasks from a seeded task stream, run
``trials_per_task`` trials per task with the frozen behaviour policy (a ``collect`` function — by default the
agent runner with a ``ModelPolicy``), compute advantages (host numpy), build bucketed microbatches, check the
sampler's log-probs against a recomputation, take one optimizer step per minibatch (gradients summed over its
microbatches; ``epochs × minibatches`` steps per iteration, the count the learning-rate schedule is sized
in), log, checkpoint, and evaluate every ``eval.every`` iterations.

Everything the next iteration depends on — params, optimizer state, the iteration count, the JAX key, the task
stream position — is in the checkpoint, so ``resume`` continues exactly as an uninterrupted run would.

On a mesh of more than one device (``cfg.mesh``, retrojax.parallel) params and optimizer state live where the
sharding plan puts them, microbatches are global arrays with rows over data × fsdp (padded with zero-weight
rows), the sampler gets the rollout-profile (tp-only) weights, checkpoints restore onto whatever mesh this run
has, and only process 0 writes logs, TensorBoard and exports.

Python API::

    trainer = Trainer(cfg, model, tokenizer)          # or Trainer(cfg, model, collect=my_collect)
    history = trainer.fit()                           # list of per-iteration metric dicts
    trainer.export("runs/x/policy")                   # save_pretrained of the current policy
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from retrojax.agent.archive import Archive
from retrojax.learn.advantages import Advantages, advantages_from_config
from retrojax.learn.batch import Microbatch, plan_batches
from retrojax.learn.checkpoint import TrainCheckpoints
from retrojax.learn.collect import (
    collect_width,
    default_collect,
    default_evaluate,
    eval_widths,
    is_number,
    sampler_bound,
    train_split_size,
)
from retrojax.learn.diagnostics import update_diagnostics
from retrojax.learn.layout import microbatch_shapes
from retrojax.learn.loss import merge_params
from retrojax.learn.pool import BadPool, check_lengths, rl_pool
from retrojax.learn.precision import cast_like, check_master_dtype, dtypes_of, master_copy
from retrojax.learn.update import LogProbs, Update, make_optimizer
from retrojax.model.lora import base_pointer, join_params, lora_plan, split_params
from retrojax.parallel.distributed import is_writer
from retrojax.programs import Bound, Ledger


class Collect(Protocol):
    """Runs trials with the behaviour policy: ``collect(model, tasks, seeds) -> (archive, metrics)``.

    ``tasks`` lists task indices of the training split, one group of ``trial.trials_per_task`` trials each;
    ``seeds`` gives one seed per task. Every random choice of the collection must follow from the seeds
    (that is what makes ``resume`` exact). A collector with a ``release()`` method has it called after each
    collection, before the update: it lets go of the weights it sampled with (``RunnerCollect.release``).
    """

    def __call__(self, model: Any, tasks: Sequence[int], seeds: Sequence[int]) -> tuple[Archive, dict]: ...


Evaluate = Callable[[Any, int], dict]  # (model, iteration) -> metrics
# (archive, learn config) -> advantages; default: ReTRAIL's (advantages_from_config); RIR's reviewer credit is
# retrojax.learn.rir_credit
Credit = Callable[[Archive, Any], Advantages]


@dataclasses.dataclass
class TaskStream:
    """Tasks in seeded random order, epoch after epoch; ``(epoch, offset)`` is the data position."""

    num_tasks: int
    seed: int
    epoch: int = 0
    offset: int = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_tasks)

    def take(self, n: int) -> list[int]:
        if self.num_tasks < 1:
            raise ValueError("the task stream has no tasks")
        out: list[int] = []
        while len(out) < n:
            order = self._order(self.epoch)
            k = min(n - len(out), self.num_tasks - self.offset)
            out.extend(int(t) for t in order[self.offset:self.offset + k])
            self.offset += k
            if self.offset >= self.num_tasks:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


def _to_device(mb: Microbatch, plan: Any = None) -> dict[str, jax.Array]:
    if plan is None:
        return {k: jnp.asarray(v) for k, v in mb.arrays.items()}
    from retrojax.parallel.shard import global_batch, pad_rows

    shards, procs = plan.batch_shards, jax.process_count()
    multiple = shards // procs if shards % procs == 0 else shards
    return global_batch(pad_rows(mb.arrays, multiple), plan)


@jax.jit
def _k3_totals(behaviour: jax.Array, ref: jax.Array, mask: jax.Array) -> jax.Array:
    """(sum, count) of the k3 estimate of KL(behaviour ‖ reference) over the sampled tokens in ``mask``."""
    d = jnp.where(mask, ref - behaviour, 0.0)
    k3 = jnp.exp(d) - d - 1.0
    return jnp.stack([jnp.sum(jnp.where(mask, k3, 0.0)), jnp.sum(mask).astype(jnp.float32)])


def _set_aside_old_log(path: Path) -> None:
    """A run starting at iteration 0 in a used directory keeps the old run's log as ``metrics.jsonl.N``
    (the first free N) instead of appending to it, so one file never mixes two runs' updates."""
    if not path.exists():
        return
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    path.rename(path.with_name(f"{path.name}.{n}"))


def _mean_metrics(items: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in items[0] if items else ():
        out[k] = float(np.mean([float(m[k]) for m in items]))
    return out


def validate_learn_config(lc: Any) -> None:
    """Reject settings the learner cannot run with, before any trial is collected."""
    from retrojax.learn.advantages import ESTIMATORS, REFLECTION_REWARDS

    problems = []
    if lc.estimator not in ESTIMATORS:
        problems.append(f"learn.estimator must be one of {ESTIMATORS}, got {lc.estimator!r}")
    if lc.reflection_reward not in REFLECTION_REWARDS:
        problems.append(f"learn.reflection_reward must be one of {REFLECTION_REWARDS}, "
                        f"got {lc.reflection_reward!r}")
    if lc.old_logprobs not in ("sampler", "recompute"):
        problems.append(f"learn.old_logprobs must be sampler | recompute, got {lc.old_logprobs!r}")
    if lc.layout not in ("rows", "packed", "tree", "tree_long"):
        problems.append(f"learn.layout must be rows | packed | tree | tree_long, got {lc.layout!r}")
    if lc.lr_schedule not in ("constant", "cosine"):
        problems.append(f"learn.lr_schedule must be constant | cosine, got {lc.lr_schedule!r}")
    for name in ("epochs", "minibatches", "tasks_per_update", "max_batch_tokens", "logprob_chunk"):
        if getattr(lc, name) < 1:
            problems.append(f"learn.{name} must be ≥ 1, got {getattr(lc, name)}")
    if lc.train_tasks is not None and lc.train_tasks < 1:
        problems.append(f"learn.train_tasks must be ≥ 1 (null: every training level), got {lc.train_tasks}")
    if getattr(lc, "pool_lengths", None) is not None:
        try:
            check_lengths(lc.pool_lengths)
        except BadPool as e:
            problems.append(str(e))
    if not lc.seq_buckets or min(lc.seq_buckets) < 2:
        problems.append(f"learn.seq_buckets must list lengths ≥ 2, got {lc.seq_buckets}")
    if lc.remat not in (True, False, "auto"):
        problems.append(f"learn.remat must be true | false | auto, got {lc.remat!r}")
    lora = getattr(lc, "lora", None)
    if lora is not None and lora.rank > 0 and lora.dropout > 0:
        problems.append("learn.lora.dropout > 0: the RL update draws no dropout key per step yet; use 0")
    try:
        check_master_dtype(lc.master_dtype)
    except ValueError as e:
        problems.append(str(e))
    if lc.clip_eps <= 0 or (lc.clip_eps_high is not None and lc.clip_eps_high <= 0):
        problems.append("learn.clip_eps (and clip_eps_high) must be > 0")
    if problems:
        raise ValueError("; ".join(problems))


class Trainer:
    """ReTRAIL's learner around one policy model (see the module docstring)."""

    def __init__(self, cfg: Any, model: Any, tokenizer: Any = None, *, collect: Collect | None = None,
                 evaluate: Evaluate | None = None, credit: Credit | None = None, num_tasks: int | None = None,
                 pool: Sequence[int] | None = None,
                 out_dir: str | Path | None = None, tensorboard: bool = True, progress: bool = True,
                 programs: Ledger | None = None):
        validate_learn_config(cfg.learn)
        self.cfg = cfg
        self.learn = cfg.learn
        self.tokenizer = tokenizer
        self.out_dir = Path(out_dir or cfg.run.out_dir)
        self.progress = progress
        self.collect = collect if collect is not None else default_collect(cfg, tokenizer)
        self.evaluate = evaluate if evaluate is not None else default_evaluate(cfg, tokenizer)
        self.credit = credit if credit is not None else advantages_from_config
        # The RL pool (retrojax.learn.pool): task ids, revisited in a seeded order every epoch. Given by
        # the caller, else the first learn.train_tasks levels, or learn.pool_lengths' on the collector's env.
        env = getattr(self.collect, "env", None)
        if pool is None and self.learn.pool_lengths is not None:
            if env is None:
                raise ValueError("learn.pool_lengths needs the training env (a collector with .env)")
            pool = rl_pool(env, self.learn.train_tasks, self.learn.pool_lengths)
        if pool is None:
            if num_tasks is None:
                num_tasks = int(env.num_tasks) if env is not None else train_split_size(cfg)
            cap = self.learn.train_tasks
            pool = range(num_tasks if cap is None else min(num_tasks, cap))
        self.pool = [int(t) for t in pool]
        if not self.pool:
            raise ValueError("the RL pool is empty")
        # With LoRA adapters (retrojax.model.lora) params are the adapters and self.frozen the base
        self.graphdef, self.template, model_params, self.frozen = split_params(model)
        # float32 masters of the trainable weights (retrojax.learn.precision); the loss casts them down
        params = master_copy(model_params, self.learn.master_dtype)
        self._model_shapes = dtypes_of(join_params(model_params, self.frozen))  # what the sampler gets
        # The schedule counts optimizer steps: one per minibatch per epoch of every update.
        self.schedule_steps = max(1, self.learn.updates * self.learn.epochs * self.learn.minibatches)
        self.tx, self.schedule = make_optimizer(self.learn, self.schedule_steps)
        self.plan = _plan(cfg, model, self.tx)
        if self.plan is not None and self.frozen is not None:  # LoRA on a mesh: the base is placed once
            from retrojax.parallel.shard import place_params

            self.plan = lora_plan(self.plan, model, self.tx)
            self.frozen = place_params(self.frozen, self.plan.frozen)
        self.update = Update(self.graphdef, self.template, self.tx, clip_eps=self.learn.clip_eps,
                             clip_eps_high=self.learn.clip_eps_high, kl_coef=self.learn.kl_coef,
                             chunk=self.learn.logprob_chunk, plan=self.plan,
                             temperature=cfg.sampler.temperature,  # rollouts are scored as they were sampled
                             frozen=self.frozen)
        self.logprobs = LogProbs(self.graphdef, self.template, chunk=self.learn.logprob_chunk, plan=self.plan,
                                 temperature=cfg.sampler.temperature, frozen=self.frozen)
        if self.plan is None:
            self.params = params
            self.opt_state = self.tx.init(params)
        else:
            from retrojax.parallel.shard import init_optimizer, place_params

            self.params = place_params(params, self.plan.params)
            self.opt_state = init_optimizer(self.tx, self.params, self.plan)
        # The frozen reference: the KL penalty's anchor, and the diag/kl_ref figure (learn.track_kl_ref).
        keep_ref = self.learn.kl_coef > 0 or getattr(self.learn, "track_kl_ref", False)
        self.ref_params = jax.tree.map(jnp.copy, model_params) if keep_ref else None  # the model's dtype
        self.iteration = 0
        self.optimizer_steps = 0
        self.key = jax.random.PRNGKey(cfg.run.seed)
        self.tasks = TaskStream(len(self.pool), cfg.run.seed)
        self.history: list[dict[str, float]] = []
        self._ckpt: TrainCheckpoints | None = None
        self._writer: Any = None
        self._tensorboard = tensorboard
        self._warned_gap = False
        # compiled programs per stage (collect, update, eval) against their bounds (retrojax.programs); a
        # caller's ledger (the demo's) keeps its own stages and bounds beside these
        self.programs = programs if programs is not None else Ledger()
        self._log_programs = programs is None  # a caller's ledger is the caller's to log
        reference = self.ref_params is not None
        self.programs.bound("update", update_bound(self.learn, jax.process_count(), reference))
        # the sampler stages' bounds come from the policy the default collector and evaluation build, which
        # needs the tokenizer; a trainer given none samples nothing itself
        if collect is None and tokenizer is not None:
            self.programs.bound("collect", sampler_bound(cfg, model, tokenizer, [collect_width(cfg)]))
        if evaluate is None and self.evaluate is not None and tokenizer is not None:
            # eval.num_tasks null (the whole held-out part): its size only moves a paged or row-bucketed
            # sampler's bound, whose rows then follow one task per protocol and seed
            widths = eval_widths(cfg, cfg.eval.num_tasks or 1)
            self.programs.bound("eval", sampler_bound(cfg, model, tokenizer, widths))

    # --- the policy ------------------------------------------------------------------------------
    def model(self) -> Any:
        """The current policy as an nnx module (a fresh merge; safe to hand to a sampler).

        On a mesh: the rollout-profile weights (tp only, so decoding all-gathers no weight per token), on
        this process's own devices — one sampler replica per host, synced here after every update.
        """
        params = cast_like(join_params(self.params, self.frozen), self._model_shapes)
        if self.plan is not None:
            from retrojax.parallel.mesh import local_mesh
            from retrojax.parallel.shard import place_params, to_local

            params = place_params(params, self.plan.rollout_params)
            if jax.process_count() > 1:
                local = local_mesh(self.plan.mesh)
                params = jax.tree.map(lambda x: to_local(x, local), params)
        return self._merge(params)

    def _merge(self, params: Any) -> Any:
        """The nnx module of a pure params dict, in the model's dtype (masters cast down)."""
        return merge_params(self.graphdef, self.template, params)

    def export(self, path: str | Path) -> Path:
        """Write the current policy as a Hugging Face checkpoint directory, or for a LoRA policy a PEFT
        adapter directory (process 0 writes)."""
        from retrojax.model.peft import save_policy

        params = cast_like(join_params(self.params, self.frozen), self._model_shapes)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            params = jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True), params)
        if is_writer():
            save_policy(self._merge(params), path, base=base_pointer(self.cfg.model)["name"])
        return Path(path)

    # --- checkpoints -----------------------------------------------------------------------------
    @property
    def checkpoints(self) -> TrainCheckpoints:
        if self._ckpt is None:
            self._ckpt = TrainCheckpoints(self.out_dir / "checkpoints", keep=self.cfg.run.keep_checkpoints)
        return self._ckpt

    def save(self) -> None:
        meta = {"iteration": self.iteration, "optimizer_steps": self.optimizer_steps,
                "key": np.asarray(jax.random.key_data(self.key)).tolist(), "tasks": self.tasks.position()}
        if self.plan is not None:
            from retrojax.parallel.mesh import describe

            meta["mesh"] = describe(self.plan.mesh)
        if self.frozen is not None:  # LoRA: the checkpoint holds the adapters only; this names their base
            meta["base"] = base_pointer(self.cfg.model)
        self.checkpoints.save(self.iteration, self.params, self.opt_state, meta)

    def restore(self, step: int | None = None) -> bool:
        """Load the latest (or ``step``) checkpoint; False if there is none."""
        if self.checkpoints.latest_step() is None and step is None:
            return False
        self.params, self.opt_state, meta = self.checkpoints.restore(self.params, self.opt_state, step)
        self.iteration = int(meta["iteration"])
        self.optimizer_steps = int(meta["optimizer_steps"])
        self.key = jnp.asarray(np.asarray(meta["key"], np.uint32))
        self.tasks.epoch, self.tasks.offset = int(meta["tasks"]["epoch"]), int(meta["tasks"]["offset"])
        # Iterations logged after this checkpoint will be redone: drop them from the log.
        self.history = [h for h in self._read_log() if h.get("iteration", 0) <= self.iteration]
        path = self.out_dir / "metrics.jsonl"
        if path.exists() and is_writer():
            path.write_text("".join(json.dumps(h) + "\n" for h in self.history))
        return True

    # --- one iteration ---------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Collect trials, compute advantages, run the update(s); returns this iteration's metrics."""
        t0 = time.perf_counter()
        self.key, sub = jax.random.split(self.key)
        tasks = [self.pool[i] for i in self.tasks.take(self.learn.tasks_per_update)]
        seeds = [int(s) for s in np.asarray(jax.random.randint(sub, (len(tasks),), 0, 2**31 - 1))]
        if jax.process_count() > 1:  # this process's block of whole task groups
            from retrojax.parallel.shares import task_share

            tasks, seeds = task_share(tasks, seeds, jax.process_index(), jax.process_count())
        with self.programs.stage("collect"):
            archive, rollout = self.collect(self.model(), tasks, seeds)
        release = getattr(self.collect, "release", None)
        if release is not None:  # the sampler's weights are stale after the update: not held beside it
            release()
        t1 = time.perf_counter()
        with self.programs.stage("update"):
            return self._learn(archive, rollout, tasks, t0, t1)

    def _learn(self, archive: Archive, rollout: dict, tasks: list[int], t0: float, t1: float
               ) -> dict[str, float]:
        """Advantages, microbatches, the log-prob check and the optimizer steps of one iteration."""
        adv = self.credit(archive, self.learn)
        rng = np.random.default_rng([self.cfg.run.seed, self.iteration])
        lc = self.learn
        plan = plan_batches(archive, adv, lambda_ref=lc.lambda_ref, seq_buckets=lc.seq_buckets,
                            max_batch_tokens=max(1, lc.max_batch_tokens // jax.process_count()),
                            minibatches=lc.minibatches,
                            chain=lc.chain_segments, skip_zero=lc.kl_coef == 0.0, rng=rng, layout=lc.layout)
        if jax.process_count() > 1:  # every process: the same steps and microbatch shapes
            from retrojax.parallel.shares import agree

            local = agree(plan.minibatches, int(plan.stats.get("batch/tasks", len(tasks))), lc.layout)
            steps = [[_to_device(Microbatch(a, 0, 0), self.plan) for a in group] for group in local]
        else:
            steps = [[_to_device(mb, self.plan) for mb in group] for group in plan.minibatches]
        check = self._prepare([b for group in steps for b in group])
        step_metrics: list[dict[str, Any]] = []
        for _ in range(self.learn.epochs):
            for group in steps:  # one optimizer step per minibatch, gradients summed over its microbatches
                self.params, self.opt_state, m = self.update(self.params, self.opt_state, group)
                step_metrics.append(m)
                self.optimizer_steps += 1
        jax.block_until_ready((self.params, step_metrics))  # dispatch is async: time/learn_s is the compute
        t2 = time.perf_counter()
        self.iteration += 1
        metrics: dict[str, float] = {"iteration": float(self.iteration),
                                     "lr": float(self.schedule(max(self.optimizer_steps - 1, 0)))}
        metrics.update({f"train/{k}": v for k, v in _mean_metrics(jax.device_get(step_metrics)).items()})
        if step_metrics:
            metrics["train/skipped_steps"] = float(sum(float(m["skipped"]) for m in step_metrics))
        metrics["train/optimizer_steps"] = float(len(step_metrics))
        metrics["train/optimizer_steps_total"] = float(self.optimizer_steps)
        # compiled update programs so far (one per microbatch shape; learn.layout keeps the shapes few)
        metrics["train/update_programs"] = float(self.update.traces)
        metrics.update(adv.stats)
        metrics.update(update_diagnostics(archive, adv))
        metrics.update(plan.stats)
        metrics.update(check)
        metrics.update({f"rollout/{k}": float(v) for k, v in rollout.items() if is_number(v)})
        metrics.update({"time/collect_s": t1 - t0, "time/learn_s": t2 - t1})
        return metrics

    def _prepare(self, batches: list[dict[str, jax.Array]]) -> dict[str, float]:
        """Check sampler log-probs against θ_old; optionally replace them, and add reference log-probs."""
        gaps: list[np.ndarray] = []  # (max, sum, count) per microbatch, reduced on device
        kl_ref: list[jax.Array] = []  # (sum, count) of k3(behaviour ‖ reference) per microbatch
        for b in batches:
            if self.learn.check_logprobs or self.learn.old_logprobs == "recompute":
                lp = self.logprobs(self.params, b)
                mask = b["exec_mask"] | b["ref_mask"]
                gaps.append(np.asarray(self.logprobs.gap(lp, b["old_logprobs"], mask)))
                if self.learn.old_logprobs == "recompute":
                    b["old_logprobs"] = jnp.where(mask, lp, 0.0)
            if self.ref_params is not None:
                ref = self.logprobs(self.ref_params, b)
                kl_ref.append(_k3_totals(b["old_logprobs"], ref, b["exec_mask"] | b["ref_mask"]))  # on device
                if self.learn.kl_coef > 0:
                    b["ref_logprobs"] = ref
        out: dict[str, float] = {}
        if kl_ref:
            k = np.asarray(jnp.stack(kl_ref))  # one host read for the whole update
            out["diag/kl_ref"] = float(k[:, 0].sum() / max(k[:, 1].sum(), 1.0))
        if not gaps:
            return out
        g = np.stack(gaps)
        count = float(g[:, 2].sum())
        if count == 0:
            return out
        gap_max, gap_mean = float(g[:, 0].max()), float(g[:, 1].sum() / count)
        if gap_max > 1e-2 and self.learn.old_logprobs == "sampler" and not self._warned_gap:
            self._warned_gap = True
            print(f"warning: sampler log-probs differ from θ_old's by up to {gap_max:.3g} (top-p/k "
                  "filtering?); the ratio uses the sampler's. Set learn.old_logprobs=recompute to use "
                  "the model's own.", file=sys.stderr)
        return {**out, "check/logprob_gap_mean": gap_mean, "check/logprob_gap_max": gap_max}

    # --- the loop --------------------------------------------------------------------------------
    def fit(self, updates: int | None = None, *, resume: bool = False,
            stop_after: int | None = None) -> list[dict[str, float]]:
        """Run until ``updates`` iterations in total (default ``learn.updates``); returns the history.

        ``resume`` first loads the latest checkpoint. ``stop_after`` ends the call after that many iterations
        of this call (used to simulate a killed run).
        """
        total = self.learn.updates if updates is None else updates
        if resume:
            self.restore()
        if is_writer():
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if self.iteration == 0:
                _set_aside_old_log(self.out_dir / "metrics.jsonl")
            (self.out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(self.cfg), indent=1))
            from retrojax.plan import log_trainer_plan

            log_trainer_plan(self, self.out_dir)
        bar = _progress(total, self.iteration, self.progress and is_writer())
        done = 0
        try:
            while self.iteration < total and (stop_after is None or done < stop_after):
                metrics = self.step()
                every = self.cfg.eval.every
                due = (every > 0 and self.iteration % every == 0) or self.iteration == total
                if self.evaluate is not None and due:
                    with self.programs.stage("eval"):
                        found = self.evaluate(self.model(), self.iteration)
                    metrics.update({f"eval/{k}": float(v) for k, v in found.items() if is_number(v)})
                metrics.update(self.programs.metrics())  # so far this run: programs.<stage>.compiled, …
                self._log(metrics)
                ce = max(1, self.learn.checkpoint_every)
                if self.iteration % ce == 0 or self.iteration == total:
                    self.save()
                done += 1
                if bar is not None:
                    bar.update(1)
                    if "train/loss" in metrics:
                        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
                    else:  # no microbatch: every credit was 0 (skipped) or no trained call had output tokens
                        bar.set_postfix_str("nothing to train in this update (all advantages 0)")
        finally:
            if bar is not None:
                bar.close()
            if self._writer is not None:
                self._writer.flush()
        if is_writer() and self._log_programs:
            self.programs.log()
        return self.history

    def close(self) -> None:
        closer = getattr(self.collect, "close", None)
        if callable(closer):
            closer()
        if self._ckpt is not None:
            self._ckpt.close()
        if self._writer is not None:
            self._writer.close()

    # --- logs ------------------------------------------------------------------------------------
    def _log(self, metrics: dict[str, float]) -> None:
        self.history.append(metrics)
        if not is_writer():
            return
        with (self.out_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._tensorboard:
            if self._writer is None:
                from tensorboardX import SummaryWriter

                self._writer = SummaryWriter(str(self.out_dir / "tb"))
            for k, v in metrics.items():
                if k != "iteration":
                    self._writer.add_scalar(k, v, self.iteration)

    def _read_log(self) -> list[dict[str, float]]:
        path = self.out_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def update_bound(lc: Any, processes: int = 1, reference: bool = False) -> Bound:
    """The most programs one iteration's learner work compiles over a run: per microbatch shape the layout
    allows (``layout.microbatch_shapes`` at this process's share of ``learn.max_batch_tokens``, as ``step``
    plans them) the gradient accumulation, and where they run the log-prob recomputation (the check, the
    recompute, the reference), its gap and the reference's KL totals; then one optimizer apply and one
    accumulator init. Upper bound: shapes the rollouts never fill are counted too."""
    shapes = len(microbatch_shapes(lc.layout, lc.seq_buckets, max(1, lc.max_batch_tokens // processes)))
    check = lc.check_logprobs or lc.old_logprobs == "recompute"
    names = ["_accumulate_step", "_apply_step", "_zero_accumulator"]
    names += ["_run"] if check or reference else []
    names += ["_gap"] if check else []
    names += ["_k3_totals"] if reference else []
    return Bound(shapes * (len(names) - 2) + 2, tuple(names), exact=False,
                 why="every microbatch shape the layout allows, filled or not")


def _plan(cfg: Any, model: Any, tx: Any) -> Any:
    """The sharding plan of ``cfg.mesh`` when it spans more than one device, else None (one device)."""
    if getattr(cfg, "mesh", None) is None:
        return None
    from retrojax.parallel.mesh import mesh_from_config
    from retrojax.parallel.shard import make_plan

    mesh = mesh_from_config(cfg)
    if mesh.devices.size == 1:
        return None
    return make_plan(model, mesh, cfg.mesh.rules, cfg.mesh.strict, tx)


def _progress(total: int, start: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="update")
