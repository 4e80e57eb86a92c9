"""Oracle demonstrations and the SFT warm start, shared by ``demo``, ``train`` and the benches.

Demonstrations are trials of the scripted ``OraclePolicy`` through the real trial loop, so every call's
prompt and output ids are exactly what the model must produce:

- solver play (ε = 0), once per (level, protocol) — the expert is deterministic, so repeats would be copies;
- recovery play (ε = ``sft.oracle_epsilon``) under the training protocol, each episode with its own seed: the
  random moves lead to varied states from which the expert's next decisions, rewinds and reflections are
  recorded (states the solver line never visits).

``sft.demo_tasks`` (ours) concentrates the demonstrations on the first N training levels — by default the RL
pool (``learn.train_tasks``) — so the warm start is strongest where RL plays.

The warm start trains the expert decisions and the reflections; the oracle's deliberate random moves
(``CallRecord.teach`` False) stay in the context as what happened, never as targets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from retrojax.agent.archive import Archive
from retrojax.programs import Bound

# The protocol families whose prompts every warm start covers (forward-only, one rewinding attempt), so the
# demonstrations do not change with the evaluation list (a bench that evaluates T@3 only trains as the demo).
BASE_PROTOCOLS = ("P@1", "T@1")


def demo_protocols(cfg: Any) -> list[str]:
    """Protocols whose prompts the solver demonstrations cover: P@1, T@1, the training one, then any other
    evaluation protocol (in that order, so adding an evaluation protocol appends demonstrations)."""
    out: list[str] = []
    for p in (*BASE_PROTOCOLS, cfg.trial.protocol, *cfg.eval.protocols):
        if p not in out:
            out.append(p)
    return out


def demo_task_count(cfg: Any, num_tasks: int) -> int:
    """How many training levels the demonstrations cycle through (``sft.demo_tasks``, else the RL pool)."""
    n = getattr(cfg.sft, "demo_tasks", None)
    if n is None:
        n = cfg.learn.train_tasks
    return num_tasks if n is None else max(1, min(int(n), num_tasks))


def demo_levels(cfg: Any, env: Any) -> list[int]:
    """The training levels the demonstrations cycle through: the first ``sft.demo_tasks``, else the RL
    pool (:func:`retrojax.learn.pool.rl_pool`: ``learn.train_tasks`` and ``learn.pool_lengths``)."""
    if getattr(cfg.sft, "demo_tasks", None) is None and getattr(cfg.learn, "pool_lengths", None) is not None:
        from retrojax.learn.pool import rl_pool

        return rl_pool(env, cfg.learn.train_tasks, cfg.learn.pool_lengths)
    return list(range(demo_task_count(cfg, env.num_tasks)))


def run_demonstrations(cfg: Any, env: Any, tokenizer: Any) -> tuple[Archive, dict[str, Any]]:
    """Oracle trials on training levels: solver play (ε = 0) and recovery play (ε = ``sft.oracle_epsilon``).

    Every trial's randomness follows from ``run.seed`` and its index, so replaying with another tokenizer
    gives the same trials. ``tokenizer`` None records byte-level ids.
    """
    from retrojax.agent.policies import OraclePolicy
    from retrojax.agent.runner import Runner
    from retrojax.agent.trial import TrialSpec, parse_protocol

    s = cfg.sft
    levels = demo_levels(cfg, env)
    n_tasks = len(levels)
    protocols = demo_protocols(cfg)
    archive = Archive()
    stats: dict[str, Any] = {"levels": n_tasks}
    solver = min(s.num_solver_episodes, n_tasks * len(protocols))  # deterministic: no copies
    per_protocol = math.ceil(solver / len(protocols)) if solver else 0
    first = 0
    plays = [("solver", 0.0, [(p, levels[i % n_tasks]) for p in protocols for i in range(per_protocol)]),
             ("recovery", s.oracle_epsilon, [(cfg.trial.protocol, levels[i % n_tasks])
                                            for i in range(s.num_recovery_episodes)])]
    for name, eps, items in plays:
        if not items:
            continue
        # replicate = episode index: the oracle's random stream differs between repeats of a level
        specs = [TrialSpec(trial=first + i, task=int(task), seed=int(cfg.run.seed), replicate=i,
                           protocol=parse_protocol(proto).name) for i, (proto, task) in enumerate(items)]
        first += len(specs)
        runner = Runner(cfg, env, OraclePolicy(eps), tokenizer=tokenizer, record_tokens=True)
        part = runner.run(specs)
        archive.extend(part)
        execs = [c for c in part.calls if c.role == "execution"]
        stats[name] = {"trials": len(part.trials), "calls": len(part.calls),
                       "success": float(np.mean([t.success for t in part.trials])),
                       "recoveries": len(part.recoveries),
                       "model_rewinds": int(sum(t.rewinds_model for t in part.trials)),
                       "forced_rewinds": int(sum(t.rewinds_forced for t in part.trials)),
                       "context_only_moves": int(sum(not c.teach for c in execs)),
                       "distinct_execution_calls": len({(c.prompt_ids.tobytes(), c.output_ids.tobytes())
                                                        for c in execs})}
    return archive, stats


def corpus_from_archive(archive: Archive, decode: Any) -> list[str]:
    """Texts for a tokenizer: every trial's longest context (prompt + output) and every reflection call."""
    longest: dict[int, Any] = {}
    texts: list[str] = []
    for c in archive.calls:
        n = len(c.prompt_ids) + len(c.output_ids)
        if c.trial not in longest or n > len(longest[c.trial].prompt_ids) + len(longest[c.trial].output_ids):
            longest[c.trial] = c
        if c.role == "reflection":
            texts.append(decode(np.concatenate([c.prompt_ids, c.output_ids])))
    texts += [decode(np.concatenate([c.prompt_ids, c.output_ids])) for c in longest.values()]
    return texts


def special_ids(tokenizer: Any) -> tuple[int, int]:
    """(end-of-turn id, padding id) of a model tokenizer, or of the byte-level chat tokenizer (which has
    no padding id: padded positions are masked out, so its end-of-turn id serves)."""
    end = getattr(tokenizer, "im_end_id", None)
    end = int(tokenizer.stop_ids[0]) if end is None else int(end)
    pad = getattr(tokenizer, "pad_token_id", None)
    return end, end if pad is None else int(pad)


def decision_weights(output_ids: np.ndarray, decode: Callable[[Any], str],
                     weight: float) -> np.ndarray | None:
    """Per output token: ``weight`` where the token overlaps the action the parser reads from the reply (the
    decision, ``parse.action_span``), 1 elsewhere; None for a reply without one.

    Token boundaries come from decoding each prefix, so any tokenizer works (a token that straddles the tag
    counts as the decision's)."""
    from retrojax.agent.parse import action_span

    ids = np.asarray(output_ids).reshape(-1)
    span = action_span(decode(ids))
    if span is None:
        return None
    lo, hi = span
    ends = np.maximum.accumulate([len(decode(ids[: k + 1])) for k in range(len(ids))])
    starts = np.concatenate([[0], ends[:-1]])
    inside = (starts < hi) & (ends > lo)
    return np.where(inside, weight, 1.0).astype(np.float32)


def stop_checks(cfg: Any, play_pool: Callable[[], tuple[float, float]] | None) -> range:
    """The step counts at which the stop rule (``sft.stop_at_success``, ``sft.stop_at_levels``) is checked
    (empty without a rule).

    Raises ``ValueError`` for a stop rule the caller cannot measure or a malformed one."""
    s = cfg.sft
    validate_sft_config(s)
    if s.stop_at_success is None and s.stop_at_levels is None:
        return range(0)
    if play_pool is None:
        raise ValueError("sft.stop_at_success / sft.stop_at_levels need the RL pool played during SFT; only "
                         "`retrojax demo` and `retrojax bench learn` do that (set both to null here)")
    return range(s.check_from, s.steps, s.check_every)


def validate_sft_config(s: Any) -> None:
    """Reject ``sft`` settings the warm start cannot run with, all at once, before demonstrations are played
    (the commands call it first, so a typo costs seconds, not an SFT run)."""
    problems = []
    at_least = {"steps": 0, "batch_size": 1, "seq_len": 2, "warmup_steps": 0, "num_solver_episodes": 0,
                "num_recovery_episodes": 0, "check_anneal": 0, "check_every": 1, "check_from": 1}
    for name, low in at_least.items():
        if getattr(s, name) < low:
            problems.append(f"sft.{name} must be ≥ {low}, got {getattr(s, name)}")
    if s.demo_tasks is not None and s.demo_tasks < 1:
        problems.append(f"sft.demo_tasks must be ≥ 1 (null: the RL pool), got {s.demo_tasks}")
    if not (math.isfinite(s.learning_rate) and s.learning_rate > 0):
        problems.append(f"sft.learning_rate must be a positive number, got {s.learning_rate}")
    if not (math.isfinite(s.decision_weight) and s.decision_weight > 0):
        problems.append(f"sft.decision_weight must be a positive number, got {s.decision_weight}")
    if not 0.0 <= s.oracle_epsilon <= 1.0:
        problems.append(f"sft.oracle_epsilon must be in [0, 1], got {s.oracle_epsilon}")
    for name in ("stop_at_success", "stop_at_levels"):
        value = getattr(s, name)
        if value is not None and not 0.0 < float(value) <= 1.0:
            problems.append(f"sft.{name} must be in (0, 1], got {value}")
    if problems:
        raise ValueError("; ".join(problems))



def sft_layout(cfg: Any) -> tuple[list[int], str]:
    """The warm start's length buckets (``learn.seq_buckets`` below ``sft.seq_len``, then ``sft.seq_len``)
    and layout (``sft.layout``, else ``learn.layout``)."""
    s = cfg.sft
    buckets = sorted({b for b in cfg.learn.seq_buckets if b < s.seq_len} | {s.seq_len})
    return buckets, s.layout or cfg.learn.layout


def program_bound(cfg: Any) -> Bound:
    """The most programs the warm start's SFT steps and held-out NLLs compile: one step and one NLL program
    per batch shape (``sft.batch_shapes``). Upper bound: the shapes the demonstrations never fill are
    counted too; the optimizer's (``sft.stop_at_*``: warmup-stable-decay) is one step function either way."""
    from retrojax.learn import sft

    buckets, layout = sft_layout(cfg)
    shapes = len(sft.batch_shapes(cfg.sft.batch_size, buckets, layout))
    return Bound(2 * shapes, ("step", "_nll_totals"), exact=False,
                 why="every batch shape the buckets allow, filled or not")


def warm_start(cfg: Any, model: Any, archive: Archive, tokenizer: Any, *, progress: bool = True,
               play_pool: Callable[[], tuple[float, float]] | None = None) -> dict[str, Any]:
    """SFT of ``model`` in place on the demonstrations: loss on the expert's output tokens (+ end of turn)
    and the reflections, the decisions inside ``<action>`` weighted by ``sft.decision_weight``; the oracle's
    random moves are context only. Returns the figures.

    With a stop rule (ours) the run stops at the first check where ``play_pool()`` — the current policy on
    the RL pool: (share of trials solved, share of levels solved by at least one trial) — reaches
    ``sft.stop_at_success`` and ``sft.stop_at_levels``: the start's strength is set by measurement, not by a
    step count that lands elsewhere on another seed (``sft.steps`` is then the most)."""
    from retrojax.learn import sft

    s = cfg.sft
    checks, checked = stop_checks(cfg, play_pool), []  # checked: [step, success, levels solved] per check

    def reached(steps_done: int) -> bool:
        success, levels = (float(x) for x in play_pool())
        checked.append([steps_done, success, levels])
        print(f"[sft] step {steps_done}: the policy solves {success:.1%} of the RL pool's trials and "
              f"{levels:.0%} of its levels at least once", flush=True)
        return success >= (s.stop_at_success or 0.0) and levels >= (s.stop_at_levels or 0.0)

    end_id, pad = special_ids(tokenizer)
    calls = [(c.prompt_ids, c.output_ids) for c in archive.calls]
    teach = [bool(c.teach) for c in archive.calls]
    weights = None
    if s.decision_weight != 1.0:
        weights = [decision_weights(c.output_ids, tokenizer.decode, s.decision_weight) if t else None
                   for c, t in zip(archive.calls, teach, strict=True)]
    examples, stats = sft.pack_calls(calls, s.seq_len, end_id=end_id, train=teach, weights=weights)
    if not examples:
        raise ValueError(f"no demonstration fits sft.seq_len={s.seq_len} tokens ({stats.dropped} dropped)")
    rng = np.random.default_rng(cfg.run.seed)
    order = rng.permutation(len(examples))
    held = [examples[i] for i in order[: max(1, len(examples) // 10)]]
    train = [examples[i] for i in order[max(1, len(examples) // 10):]] or held
    buckets, layout = sft_layout(cfg)
    chunk = cfg.learn.logprob_chunk
    nll_before = sft.evaluate_nll(model, held, s.batch_size, pad_id=pad, chunk=chunk, buckets=buckets,
                                  layout=layout)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=s.steps, desc="sft", unit="step")

    def advance(step: int, m: dict[str, float]) -> None:
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{m['loss']:.3f}")

    try:
        history = sft.train_sft(model, train, steps=s.steps, batch_size=s.batch_size,
                                learning_rate=s.learning_rate, seed=cfg.run.seed, warmup_steps=s.warmup_steps,
                                max_grad_norm=cfg.learn.max_grad_norm, pad_id=pad, progress=advance,
                                buckets=buckets, chunk=chunk, layout=layout, check_steps=checks,
                                stop_when=reached if len(checks) else None, anneal_steps=s.check_anneal,
                                master_dtype=cfg.learn.master_dtype)
    finally:
        if bar is not None:
            bar.close()
    nll_after = sft.evaluate_nll(model, held, s.batch_size, pad_id=pad, chunk=chunk, buckets=buckets,
                                 layout=layout)
    return {"pack": dataclasses.asdict(stats), "train_examples": len(train), "held_out_examples": len(held),
            "steps": len(history), "pool_checks": checked,
            "context_only_calls": int(sum(not t for t in teach)),
            "held_out_nll_before": nll_before, "held_out_nll_after": nll_after,
            "final_train_loss": float(np.mean([h["loss"] for h in history[-10:]])),
            "skipped_steps": int(sum(h["skipped"] for h in history))}
