"""Supervised warm start: cross-entropy on demonstrations, loss only on the model's own tokens.

A demonstration is a list of model calls (``prompt_ids`` the exact context, ``output_ids`` what the model
should have written), e.g. the calls a scripted policy made through the real trial loop. Calls whose context
extends an earlier call's ``prompt + output`` (a segment's conversation only grows) are packed into one
sequence that carries a loss mask on every output span, so the shared prefix is encoded once.

The step is one pure jitted function over ``(params, opt_state, batch)`` (the model is rebuilt from its
graph definition with ``nnx.merge``); a non-finite loss or gradient skips the step and says so in metrics.
Batches are padded to a few bucketed lengths so the step compiles once per bucket. With ``layout`` packed or
tree (``learn.layout``, default tree) a step's examples are packed several per row and, for tree, the
prefixes they share (system prompts, a trial's earlier turns) are laid out once (``retrojax.learn.layout``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from retrojax.learn.precision import cast_like, dtypes_of, master_copy
from retrojax.model.qwen3 import Qwen3, token_logprobs


@dataclasses.dataclass(frozen=True)
class Example:
    """One training sequence: token ids and, per token, whether it is the model's own (trained) token."""

    ids: np.ndarray  # int32 [L]
    own: np.ndarray  # bool [L]: True where ids[t] is an output token the model must learn
    weight: np.ndarray | None = None  # float32 [L]: each own token's loss weight (None: all 1)

    def loss_weights(self) -> np.ndarray:
        """float32 [L]: the loss weight of each token (0 where it is not the model's own)."""
        w = np.ones(len(self.ids), np.float32) if self.weight is None else self.weight.astype(np.float32)
        return np.where(self.own, w, 0.0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class PackStats:
    calls: int  # calls given
    examples: int  # sequences after packing
    dropped: int  # sequences longer than the maximum length (left out, never truncated)
    own_tokens: int  # trained tokens kept
    total_tokens: int  # all tokens kept


def _has_prefix(seq: np.ndarray, prefix: np.ndarray) -> bool:
    return len(seq) >= len(prefix) and bool(np.array_equal(seq[: len(prefix)], prefix))


def pack_calls(calls: Sequence[tuple[np.ndarray, np.ndarray]], max_len: int, *,
               train: Sequence[bool] | None = None,
               end_id: int | None = None,
               weights: Sequence[np.ndarray | None] | None = None) -> tuple[list[Example], PackStats]:
    """Turn ``(prompt_ids, output_ids)`` pairs into training sequences.

    Consecutive calls where the next prompt starts with the previous ``prompt + output`` are merged into one
    sequence (the last call's full text), with every output span marked as the model's own. ``train[i]``
    False keeps call i as context only (no loss on its output, e.g. a deliberate mistake in a recovery
    demonstration). With ``end_id`` (the end-of-turn token) an output that does not already end with it
    gets it appended and trained, so the model learns to stop. A chain stops growing before it would
    exceed ``max_len`` (the next call starts a new sequence); a single call longer than ``max_len`` is
    dropped rather than truncated (a truncated context would teach a different task). ``weights[i]`` (float
    per output token of call i, or None for all 1) sets the loss weight of call i's output tokens; an
    appended end-of-turn token weighs 1.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if train is not None and len(train) != len(calls):
        raise ValueError(f"train has {len(train)} flags for {len(calls)} calls")
    if weights is not None and len(weights) != len(calls):
        raise ValueError(f"weights has {len(weights)} entries for {len(calls)} calls")
    examples: list[Example] = []
    dropped = 0
    chain_ids: np.ndarray | None = None
    chain_spans: list[tuple[int, int, np.ndarray | None]] = []  # (start, end, weights or None)

    def flush() -> None:
        nonlocal dropped
        if chain_ids is None:
            return
        if len(chain_ids) > max_len:
            dropped += 1
            return
        own = np.zeros(len(chain_ids), bool)
        weight = np.ones(len(chain_ids), np.float32)
        for a, b, w in chain_spans:
            own[a:b] = True
            if w is not None:
                weight[a:a + len(w)] = w
        if own.any():
            examples.append(Example(ids=chain_ids.astype(np.int32), own=own,
                                    weight=None if weights is None else weight))

    for i, (prompt, output) in enumerate(calls):
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        output = np.asarray(output, np.int32).reshape(-1)
        if len(output) == 0:
            continue
        if end_id is not None and int(output[-1]) != end_id:
            output = np.concatenate([output, np.asarray([end_id], np.int32)])
        full = np.concatenate([prompt, output])
        w = None
        if weights is not None and weights[i] is not None:
            w = np.asarray(weights[i], np.float32).reshape(-1)
            if len(w) > len(output) or len(w) < len(output) - 1:
                raise ValueError(f"weights[{i}] has {len(w)} entries for an output of {len(output)} tokens")
            if not np.all(np.isfinite(w)) or np.any(w < 0):
                raise ValueError(f"weights[{i}] must be finite and >= 0")
        span = [(len(prompt), len(full), w)] if (train is None or train[i]) else []
        if chain_ids is not None and len(full) <= max_len and _has_prefix(prompt, chain_ids):
            chain_ids = full
            chain_spans.extend(span)
        else:
            flush()
            chain_ids = full
            chain_spans = span
    flush()
    stats = PackStats(
        calls=len(calls), examples=len(examples), dropped=dropped,
        own_tokens=int(sum(int(e.own.sum()) for e in examples)),
        total_tokens=int(sum(len(e.ids) for e in examples)),
    )
    return examples, stats


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length`` tokens."""
    for b in sorted(buckets):
        if length <= b:
            return int(b)
    raise ValueError(f"sequence of {length} tokens exceeds the largest bucket {max(buckets)}")


def collate(examples: Sequence[Example], batch_size: int, length: int,
            pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-padded next-token batch: ``input_ids``, ``targets``, ``loss_mask``, ``attention_mask`` [B, T].

    Position t predicts ``targets[t] = ids[t + 1]``; the loss mask is on where that target is the model's own
    token. Missing rows (fewer examples than ``batch_size``) are all padding with a zero mask.
    """
    if len(examples) > batch_size:
        raise ValueError(f"{len(examples)} examples do not fit a batch of {batch_size}")
    input_ids = np.full((batch_size, length), pad_id, np.int32)
    targets = np.full((batch_size, length), pad_id, np.int32)
    loss_mask = np.zeros((batch_size, length), np.float32)
    attention_mask = np.zeros((batch_size, length), bool)
    for row, ex in enumerate(examples):
        n = len(ex.ids) - 1
        if n > length:
            raise ValueError(f"example of {len(ex.ids)} tokens does not fit length {length} + 1")
        input_ids[row, :n] = ex.ids[:-1]
        targets[row, :n] = ex.ids[1:]
        loss_mask[row, :n] = ex.loss_weights()[1:]
        attention_mask[row, :n] = True
    return {"input_ids": input_ids, "targets": targets, "loss_mask": loss_mask,
            "attention_mask": attention_mask}


def make_optimizer(learning_rate: float, steps: int, warmup_steps: int = 0, weight_decay: float = 0.0,
                   max_grad_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW after global-norm clipping, with linear warmup then cosine decay to 10% over ``steps``."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    warmup = max(0, min(warmup_steps, steps - 1))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else learning_rate, peak_value=learning_rate, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=0.1 * learning_rate)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.adamw(schedule, weight_decay=weight_decay))


def collate_forest(examples: Sequence[Example], buckets: Sequence[int], layout: str = "tree"
                   ) -> dict[str, np.ndarray]:
    """The same examples as one token-forest batch (``learn.layout`` packed | tree, see
    ``retrojax.learn.layout``): several examples per row, shared prefixes once (tree, tree_long), one
    ``loss_mask`` entry per trained token. Rows: a power of two; length: the smallest bucket that fits."""
    from retrojax.learn.layout import forest_options, from_example, pack

    items = [from_example(e.ids, e.own, e.weight) for e in examples]
    rows = 1 << max(0, math.ceil(math.log2(len(items))))  # room for one row per example: one microbatch
    packing = pack(items, lengths=buckets, max_batch_tokens=rows * max(buckets), **forest_options(layout))
    (batch,) = packing.microbatches
    return batch


def make_batch(examples: Sequence[Example], batch_size: int, buckets: Sequence[int], pad_id: int = 0,
               layout: str = "tree") -> dict[str, np.ndarray]:
    """One step's arrays in ``layout`` (rows: ``collate`` at the smallest bucket that fits)."""
    if layout == "rows":
        length = bucket_for(max(len(e.ids) - 1 for e in examples), buckets)
        return collate(examples, batch_size, length, pad_id)
    if layout not in ("packed", "tree", "tree_long"):
        raise ValueError(f"layout must be rows | packed | tree | tree_long, got {layout!r}")
    return collate_forest(examples, buckets, layout)


def batch_shapes(batch_size: int, buckets: Sequence[int], layout: str = "tree"
                 ) -> tuple[tuple[int, int, int], ...]:
    """Every (rows, length, terms width) ``make_batch`` can return (K 0 in the ``rows`` layout): the SFT
    step and ``evaluate_nll`` compile at most one program each per shape."""
    from retrojax.learn.layout import microbatch_shapes, row_counts

    if layout == "rows":
        return tuple((batch_size, int(b), 0) for b in sorted(set(buckets)))
    top = 1 << max(0, math.ceil(math.log2(max(batch_size, 1))))  # collate_forest's rows for a full batch
    return tuple(sorted({shape for rows in row_counts(top)
                         for shape in microbatch_shapes(layout, buckets, rows * max(buckets))}))


def _logprobs(model: Qwen3, batch: dict[str, jax.Array], chunk: int) -> jax.Array:
    if "tree_exit" in batch:
        return token_logprobs(model, batch["input_ids"], batch["targets"], positions=batch["positions"],
                              tree_exit=batch["tree_exit"], target_nodes=batch["term_node"], chunk=chunk)
    return token_logprobs(model, batch["input_ids"], batch["targets"],
                          attention_mask=batch["attention_mask"], chunk=chunk)


def sft_loss(model: Qwen3, batch: dict[str, jax.Array], chunk: int = 512) -> tuple[jax.Array, jax.Array]:
    """Negative log-likelihood averaged over the trained targets, each weighted by its ``loss_mask`` value
    (1 unless ``Example.weight`` says otherwise); returns (loss, trained token count)."""
    lp = _logprobs(model, batch, chunk)
    weight = batch["loss_mask"].astype(jnp.float32)
    return -(lp * weight).sum() / jnp.maximum(weight.sum(), 1e-6), (weight > 0).sum().astype(jnp.float32)


def make_sft_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                  chunk: int = 512, compute: Any = None
                  ) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """A jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)``.

    ``params`` is the ``nnx.State`` from ``nnx.split(model)``, or its float32 masters with ``compute`` the
    model's own shapes and dtypes (retrojax.learn.precision: the loss casts the masters down). A non-finite
    loss or gradient norm leaves params and optimizer state unchanged (``metrics['skipped'] == 1``).
    """

    def loss_fn(params, batch):
        params = params if compute is None else cast_like(params, compute)
        loss, count = sft_loss(nnx.merge(graphdef, params), batch, chunk)
        return loss, count

    def step(params, opt_state, batch):
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count,
                   "skipped": jnp.logical_not(ok).astype(jnp.int32)}
        return keep(new_params, params), keep(new_opt, opt_state), metrics

    return jax.jit(step, donate_argnums=(0, 1))


def iterate_batches(examples: Sequence[Example], batch_size: int, buckets: Sequence[int],
                    rng: np.random.Generator) -> Iterator[list[Example]]:
    """Endless shuffled batches whose members share a length bucket (so padding stays small)."""
    if not examples:
        raise ValueError("no SFT examples to train on")
    by_bucket: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_bucket.setdefault(bucket_for(len(ex.ids) - 1, buckets), []).append(i)
    keys = sorted(by_bucket)
    weights = np.array([len(by_bucket[k]) for k in keys], float)
    queues: dict[int, list[int]] = {k: [] for k in keys}
    while True:
        k = keys[int(rng.choice(len(keys), p=weights / weights.sum()))]
        members = by_bucket[k]
        if len(members) <= batch_size:  # a small bucket: one padded batch of all its members
            yield [examples[i] for i in rng.permutation(members)]
            continue
        if len(queues[k]) < batch_size:
            queues[k].extend(rng.permutation(members).tolist())
        take, queues[k] = queues[k][:batch_size], queues[k][batch_size:]
        yield [examples[i] for i in take]


def default_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two from 64 up to (and including) ``max_len`` rounded up."""
    top = 1 << max(6, math.ceil(math.log2(max(max_len, 2))))
    out, b = [], 64
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def make_stable_optimizer(weight_decay: float = 0.0,
                          max_grad_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW after global-norm clipping whose learning rate the caller sets before each step
    (``set_learning_rate``): the warmup-stable-decay runs of an SFT stop rule."""
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=weight_decay))


def set_learning_rate(opt_state: Any, value: float) -> None:
    """Set the rate of a ``make_stable_optimizer`` state for its next step."""
    opt_state[1].hyperparams["learning_rate"] = jnp.asarray(value, jnp.float32)


def train_sft(model: Qwen3, examples: Sequence[Example], *, steps: int, batch_size: int, learning_rate: float,
              seed: int = 0, warmup_steps: int = 0, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
              buckets: Sequence[int] | None = None, pad_id: int = 0, chunk: int = 512,
              progress: Callable[[int, dict[str, float]], None] | None = None,
              layout: str = "tree", check_steps: Container[int] = (),
              stop_when: Callable[[int], bool] | None = None,
              anneal_steps: int = 0, master_dtype: str = "float32") -> list[dict[str, float]]:
    """Run up to ``steps`` SFT updates on ``model`` in place; returns per-step metrics (host floats).

    ``progress(step, metrics)`` is called after each step (e.g. to advance a progress bar). ``layout``
    (``learn.layout``) only changes how a step's examples are laid out, not which examples or the loss.

    After a step count in ``check_steps`` (below ``steps``) the model holds the weights to judge and
    ``stop_when(steps_done)`` may end the run there (e.g. once the policy plays well enough). With
    ``anneal_steps == 0`` those are the current weights of the cosine run (sized for ``steps``, so a stop
    leaves the rate mid-way). With ``anneal_steps > 0`` the run is warmup-stable-decay: a constant rate after
    warmup, and each check judges a branch whose rate falls linearly to 10% over ``anneal_steps`` more steps;
    the run ends on the first branch judged good (or on a branch annealed after ``steps``), and the branches
    judged not good are dropped.

    ``master_dtype`` (``learn.master_dtype``): float32 keeps float32 master weights and AdamW moments beside a
    bfloat16 model (retrojax.learn.precision); the model receives its weights in its own dtype.
    """
    if steps <= 0 or batch_size <= 0:
        raise ValueError(f"steps and batch_size must be positive, got {steps}, {batch_size}")
    if anneal_steps < 0:
        raise ValueError(f"anneal_steps must be >= 0, got {anneal_steps}")
    longest = max((len(e.ids) - 1 for e in examples), default=1)
    buckets = tuple(buckets) if buckets else default_buckets(longest)
    stable = stop_when is not None and anneal_steps > 0
    optimizer = (make_stable_optimizer(weight_decay, max_grad_norm) if stable
                 else make_optimizer(learning_rate, steps, warmup_steps, weight_decay, max_grad_norm))
    graphdef, state = nnx.split(model)
    compute = dtypes_of(state)
    params = master_copy(state, master_dtype)
    del state
    opt_state = optimizer.init(params)
    step_fn = make_sft_step(graphdef, optimizer, chunk, compute)

    def publish(p: Any) -> None:  # the model gets the weights in its own dtype
        nnx.update(model, cast_like(p, compute))
    batches = iterate_batches(examples, batch_size, buckets, np.random.default_rng(seed))

    def advance(p: Any, o: Any, i: int, rate: float | None) -> tuple[Any, Any, dict[str, float]]:
        if rate is not None:
            set_learning_rate(o, rate)
        group = next(batches)
        batch = {k: jnp.asarray(v) for k, v in make_batch(group, batch_size, buckets, pad_id, layout).items()}
        p, o, metrics = step_fn(p, o, batch)
        record = {k: float(v) for k, v in metrics.items()}
        record["step"] = float(i)
        if progress is not None:
            progress(i, record)
        return p, o, record

    def annealed(p: Any, o: Any, first: int) -> tuple[Any, list[dict[str, float]]]:
        p, o = jax.tree.map(jnp.copy, (p, o))  # a branch: the stable run's buffers stay (the step donates)
        records = []
        for j in range(anneal_steps):
            p, o, record = advance(p, o, first + j, learning_rate * (1.0 - 0.9 * (j + 1) / anneal_steps))
            records.append(record)
        return p, records

    history: list[dict[str, float]] = []
    for i in range(steps):
        rate = learning_rate * min(1.0, (i + 1) / warmup_steps) if warmup_steps else learning_rate
        params, opt_state, record = advance(params, opt_state, i, rate if stable else None)
        history.append(record)
        if stop_when is None or i + 1 >= steps or i + 1 not in check_steps:
            continue
        if not stable:
            publish(params)
            if stop_when(i + 1):
                break
            continue
        branch, records = annealed(params, opt_state, i + 1)
        publish(branch)
        if stop_when(i + 1 + anneal_steps):
            params, history = branch, history + records
            break
    else:
        if stable:  # no check passed: end on an annealed branch too
            params, records = annealed(params, opt_state, steps)
            history += records
    publish(params)
    return history


def _nll_totals(graphdef: nnx.GraphDef, chunk: int, params: Any,
                batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    lp = _logprobs(nnx.merge(graphdef, params), batch, chunk)
    trained = (batch["loss_mask"] > 0).astype(jnp.float32)  # plain per-token NLL, whatever the weights
    return -(lp * trained).sum(), trained.sum()


_nll_totals_jit = jax.jit(_nll_totals, static_argnums=(0, 1))


def evaluate_nll(model: Qwen3, examples: Sequence[Example], batch_size: int, pad_id: int = 0,
                 chunk: int = 512, buckets: Sequence[int] | None = None, layout: str = "tree") -> float:
    """Mean negative log-likelihood per trained token over ``examples`` (no update; unweighted).

    Compiles once per (model graph, bucket length, batch size), shared across calls.
    """
    if not examples:
        raise ValueError("no examples to evaluate")
    buckets = tuple(buckets) if buckets else default_buckets(max(len(e.ids) - 1 for e in examples))
    graphdef, params = nnx.split(model)
    nll, count = 0.0, 0.0
    ordered = sorted(examples, key=lambda e: len(e.ids))
    for start in range(0, len(ordered), batch_size):
        group = ordered[start:start + batch_size]
        batch = {k: jnp.asarray(v) for k, v in make_batch(group, batch_size, buckets, pad_id, layout).items()}
        a, b = _nll_totals_jit(graphdef, chunk, params, batch)
        nll, count = nll + float(a), count + float(b)
    return nll / max(count, 1.0)
