"""``retrojax demo``: the built-in default — a small Qwen3 agent learns Sokoban end to end on a CPU.

Stages (all sizes in ``configs/demo.yaml``; ``--set`` changes any of them):

1. levels: the train and test splits of ``env.split``;
2. demonstrations: the scripted ``OraclePolicy`` plays training levels through the real trial loop —
   solver play (ε = 0, under every evaluation protocol's prompt) and recovery play (ε > 0 under the
   training protocol: random moves, dead states, forced reflections with remarks that name the mistake,
   rewinds, corrected continuations, model-initiated rewinds). A sentencepiece tokenizer with Qwen3's chat
   tokens is trained on that text, then the same trials are replayed with it, so every call's exact prompt
   and output ids are what the model must learn (with a real checkpoint its own tokenizer is used);
3. warm start: supervised fine-tuning of a small Qwen3 on those calls (loss on the model's own tokens);
4. RL: ReTRAIL (State-Anchored GRPO + branch-advancement reflection reward) through the trainer API, the
   trial loop and the sampler, from the SFT policy;
5. evaluation on the held-out test split under ``eval.protocols`` for the SFT and the RL policy;
6. output under ``run.out_dir``: ``report.md`` + PNG plots, orbax checkpoints, the policy exported with
   ``save_pretrained`` (and its tokenizer), the demonstration archive and ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrojax.agent.archive import Archive
from retrojax.eval import report
from retrojax.eval.first_move import FirstMoveProbe
from retrojax.learn.curves import (
    batch_success_change,
    batch_success_note,
    diagnostics_table,
    learning_curve,
    pool_window,
    replay_change,
    replay_note,
)
from retrojax.learn.pool import BadPool, rl_pool
from retrojax.learn.warm_start import corpus_from_archive, run_demonstrations, warm_start
from retrojax.programs import Ledger


class Stages:
    """Wall time per stage, printed as it goes."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []
        self._start = time.perf_counter()
        self._name: str | None = None
        self._t0 = 0.0

    def begin(self, name: str) -> None:
        self.end()
        self._name, self._t0 = name, time.perf_counter()
        print(f"[demo] {name} …", flush=True)

    def end(self) -> None:
        if self._name is not None:
            dt = time.perf_counter() - self._t0
            self.times.append((self._name, dt))
            print(f"[demo] {self._name}: {dt:.1f}s", flush=True)
            self._name = None

    @property
    def total(self) -> float:
        return time.perf_counter() - self._start


# ---------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------


def build_policy_model(cfg: Any, tokenizer: Any) -> Any:
    """A fresh Qwen3 of ``model.preset`` whose vocabulary fits the tokenizer (rounded up to 64 ids)."""
    import jax.numpy as jnp
    from flax import nnx

    from retrojax.model import PRESETS, Qwen3

    if cfg.model.preset not in PRESETS:
        raise ValueError(f"model.preset {cfg.model.preset!r} is not one of {sorted(PRESETS)}")
    vocab = 64 * math.ceil(tokenizer.vocab_size / 64)
    config = dataclasses.replace(PRESETS[cfg.model.preset], vocab_size=vocab,
                                 eos_token_id=tokenizer.im_end_id)
    from retrojax.plan.runtime import resolve_remat

    return Qwen3(config, dtype=jnp.dtype(cfg.model.dtype), rngs=nnx.Rngs(cfg.model.seed),
                 remat=resolve_remat(cfg))  # learn.remat auto: on only when the update would not fit


def load_checkpoint(cfg: Any) -> tuple[Any, Any]:
    """``model.path`` (and ``model.tokenizer``, default the same directory) as (model, tokenizer)."""
    import jax.numpy as jnp

    from retrojax.model.checkpoint import from_pretrained
    from retrojax.model.tokenizer import load_tokenizer

    model = from_pretrained(cfg.model.path, dtype=jnp.dtype(cfg.model.dtype))
    return model, load_tokenizer(cfg.model.tokenizer or cfg.model.path)


# ---------------------------------------------------------------------------------------------------
# Trials with the model
# ---------------------------------------------------------------------------------------------------


# Offsets from run.seed of the sampling streams (ModelTrials.sampling_stream): each stage draws its own.
RL_STREAM = 7_919        # the RL trials
POOL_STREAM = 104_729    # the SFT stop rule's checks on the RL pool
CHECK_STREAM = 15_485_863  # the held-out checks during RL (eval.every); the final evaluations use run.seed
REPLAY_STREAM = 32_452_843  # the final policy replaying the first window's training trials


class ModelTrials:
    """Runs model trials on several worlds through one ``ModelPolicy`` (one sampler; each stage samples from
    a stream of its own, :meth:`sampling_stream`).

    Sharing the policy keeps one KV cache and one set of compiled sampler functions for training and
    evaluation batches (size them equally: ``tasks_per_update x trials_per_task`` and
    ``eval.num_tasks x len(eval.protocols) x eval.seeds``).
    """

    def __init__(self, cfg: Any, tokenizer: Any, model: Any):
        from retrojax.agent.policies import ModelPolicy

        self.cfg = cfg
        self.policy = ModelPolicy.from_config(cfg, model, tokenizer)

    def set_model(self, model: Any) -> None:
        self.policy.model = model
        if self.policy.sampler is not None:
            self.policy.sampler.update_model(model)

    def restart_sampling(self, seed: int) -> None:
        """Restart the sampling key stream at ``seed``: two evaluations that restart alike draw the same
        random numbers, so the SFT-vs-RL comparison is paired in its randomness too (common random numbers)
        and one policy evaluated twice scores the same."""
        self.policy.seed, self.policy.ticks = int(seed), 0

    @contextlib.contextmanager
    def sampling_stream(self, seed: int) -> Iterator[None]:
        """Sample from the stream that starts at ``seed`` inside the block, then resume the stream that was
        running: evaluations and pool checks draw their own numbers and never move the RL trials' (so
        ``eval.seeds`` or ``eval.every`` leave the training run as it was)."""
        saved = (self.policy.seed, self.policy.ticks)
        self.restart_sampling(seed)
        try:
            yield
        finally:
            self.policy.seed, self.policy.ticks = saved

    def run(self, env: Any, specs: Sequence[Any]) -> Archive:
        from retrojax.agent.runner import Runner

        return Runner(self.cfg, env, self.policy, record_best=True).run(specs)


class GreedyEvaluation:
    """``eval.greedy``: policies on the held-out levels with greedy decoding (one seed, the evaluation
    protocols), through a sampler of its own at temperature 0 so the run's sampling streams are untouched.
    Call it while the model's weights are alive (the RL update donates the start's buffers)."""

    def __init__(self, cfg: Any, tokenizer: Any, model: Any):
        from retrojax import config

        self.cfg = config.replace(cfg, sampler={"temperature": 0.0}, eval={"seeds": 1})
        self.trials = ModelTrials(self.cfg, tokenizer, model)

    def __call__(self, env: Any, model: Any, label: str) -> dict[str, Any]:
        self.trials.set_model(model)
        return evaluate(self.cfg, self.trials, env, f"{label} policy (greedy)")[0]["results"]


def rollout_metrics(archive: Archive) -> dict[str, float]:
    """Training-batch summary for the learning curve."""
    trials = archive.trials
    if not trials:
        return {}
    return {"success": float(np.mean([t.success for t in trials])),
            "trials": float(len(trials)),
            "return": float(np.mean([t.final_score for t in trials])),
            "calls": float(np.mean([t.calls_execution + t.calls_reflection for t in trials])),
            "rewinds": float(np.mean([t.rewinds_model + t.rewinds_forced for t in trials])),
            "invalid": float(np.mean([t.invalid_turns for t in trials]))}


def evaluate(cfg: Any, trials: ModelTrials, env: Any, label: str) -> tuple[dict[str, Any], Archive]:
    """Every evaluation protocol on the first ``eval.num_tasks`` test levels x ``eval.seeds``, one batch."""
    from retrojax.eval.metrics import summarize

    n = env.num_tasks if cfg.eval.num_tasks is None else min(cfg.eval.num_tasks, env.num_tasks)
    print(f"[demo] evaluating {label}: {n} test levels x {len(cfg.eval.protocols)} protocols "
          f"x {cfg.eval.seeds} seed(s)", flush=True)
    from retrojax.agent.runner import make_specs

    with trials.sampling_stream(cfg.run.seed):
        archive = trials.run(env, make_specs(range(n), range(cfg.eval.seeds), 1, cfg.eval.protocols))
    return summarize(archive.trials), archive


def play_pool(cfg: Any, trials: ModelTrials, env: Any, model: Any,
              pool: Sequence[int]) -> tuple[float, float]:
    """``model`` on the RL pool (its first ``learn.train_tasks`` levels, else one update's worth) under the
    training protocol, ``trial.trials_per_task`` trials each: (share of trials solved, share of levels solved
    by at least one trial) — what the SFT stop rule reads. The sampling stream restarts at a seed of its own
    (evaluation restarts its own afterwards)."""
    from retrojax.agent.trial import TrialSpec

    levels = list(pool)[:cfg.learn.train_tasks or cfg.learn.tasks_per_update]
    b = cfg.trial.trials_per_task
    trials.set_model(model)
    specs = [TrialSpec(trial=i * b + r, task=task, seed=cfg.run.seed, replicate=r,
                       protocol=cfg.trial.protocol) for i, task in enumerate(levels) for r in range(b)]
    with trials.sampling_stream(cfg.run.seed + POOL_STREAM):
        done = trials.run(env, specs).trials
    solved = {int(t.task) for t in done if t.success}
    return float(np.mean([t.success for t in done])), len(solved) / len(levels)


def replay_window(cfg: Any, trials: ModelTrials, env: Any, model: Any,
                  played: Sequence[tuple[list[Any], dict[int, bool]]]) -> dict[str, Any] | None:
    """``model`` replays the trials of the given updates (each update's specs and their outcomes in training),
    one update's batch at a time (the RL batch's shape), from a sampling stream of its own; returns
    :func:`retrojax.learn.curves.replay_change` of the pairs."""
    trials.set_model(model)
    before: list[bool] = []
    after: list[bool] = []
    with trials.sampling_stream(cfg.run.seed + REPLAY_STREAM):
        for specs, solved in played:
            again = {int(t.trial): bool(t.success) for t in trials.run(env, specs).trials}
            before += [solved[int(s.trial)] for s in specs]
            after += [again[int(s.trial)] for s in specs]
    return replay_change(before, after)


def attempts_curve(archive: Archive, protocol: str) -> list[float] | None:
    """Success within k macro-attempts from the trials of a ``T@K`` protocol."""
    from retrojax.agent.trial import parse_protocol

    p = parse_protocol(protocol)
    trials = [t for t in archive.trials if t.protocol == p.name]
    if not trials or not p.forced_recovery or p.max_macro is None:
        return None
    return report.success_within_attempts(trials, p.max_macro)


# ---------------------------------------------------------------------------------------------------
# The whole run
# ---------------------------------------------------------------------------------------------------


def check_config(cfg: Any) -> None:
    """Raise ``ValueError`` naming every ``env``, ``trial``, ``learn``, ``sft`` and ``eval`` setting the run
    could not use, before any stage starts (a bad value would otherwise surface after minutes of
    demonstrations and SFT)."""
    from retrojax.agent.env_api import check_env_config
    from retrojax.agent.trial import Limits
    from retrojax.learn.trainer import validate_learn_config
    from retrojax.learn.warm_start import validate_sft_config

    problems = []
    for check, section in ((check_env_config, cfg), (Limits.from_config, cfg),
                           (validate_learn_config, cfg.learn), (validate_sft_config, cfg.sft)):
        try:
            check(section)
        except ValueError as e:
            problems.append(str(e))
    if cfg.eval.seeds < 1 or (cfg.eval.num_tasks is not None and cfg.eval.num_tasks < 1):
        problems.append(f"eval.seeds and eval.num_tasks must be ≥ 1 (num_tasks null: every test level), got "
                        f"{cfg.eval.seeds} and {cfg.eval.num_tasks}")
    if problems:
        raise ValueError("; ".join(problems))


def run(cfg: Any) -> Path:
    """Run every stage; returns the report's path."""
    from retrojax import config
    from retrojax.agent.env_api import make_env
    from retrojax.agent.runner import make_specs
    from retrojax.agent.trial import TrialSpec
    from retrojax.learn.trainer import Trainer
    from retrojax.model import count_params
    from retrojax.model.tokenizer import train_sentencepiece

    check_config(cfg)
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages()
    programs = Ledger()  # compiled programs per stage (sft, eval; the trainer's collect, update) vs bounds
    facts: dict[str, Any] = {}

    stages.begin("levels")
    train_env = make_env(cfg, f"{cfg.env.split}:train")
    test_env = make_env(cfg, f"{cfg.env.split}:{cfg.eval.held_out}")  # held out: test, or val to tune
    n_eval = min(cfg.eval.num_tasks or test_env.num_tasks, test_env.num_tasks)
    # does the policy read the board? (first moves vs the expert's, on the training batch and held out)
    train_probe = FirstMoveProbe(lambda: make_env(cfg, f"{cfg.env.split}:train"))
    test_probe = FirstMoveProbe(lambda: make_env(cfg, f"{cfg.env.split}:{cfg.eval.held_out}"))
    rl_levels = rl_pool(train_env, cfg.learn.train_tasks, cfg.learn.pool_lengths)  # what RL plays
    facts["levels"] = (f"`{cfg.env.split}`: {train_env.num_tasks} training, {test_env.num_tasks} "
                       f"{cfg.eval.held_out} levels "
                       f"(evaluation uses the first {n_eval})")

    if cfg.model.path:
        stages.begin("load checkpoint")
        model, tokenizer = load_checkpoint(cfg)
        stages.begin("demonstrations")
        demos, demo_stats = run_demonstrations(cfg, train_env, tokenizer)
        facts["tokenizer"] = f"the checkpoint's own ({tokenizer.vocab_size} ids)"
    else:
        stages.begin("demonstrations + tokenizer")
        byte_demos, _ = run_demonstrations(cfg, train_env, None)
        from retrojax.agent.chat import ByteChatTokenizer

        corpus = corpus_from_archive(byte_demos, ByteChatTokenizer().decode)
        tokenizer = train_sentencepiece(corpus, cfg.sft.vocab_size, out / "tokenizer")
        demos, demo_stats = run_demonstrations(cfg, train_env, tokenizer)
        facts["tokenizer"] = (f"sentencepiece BPE trained on {len(corpus)} demonstration texts, "
                              f"{tokenizer.vocab_size} ids incl. Qwen3's chat special tokens")
        model = build_policy_model(cfg, tokenizer)
    demos.save(out / "demonstrations.jsonl")
    n_params = count_params(model.config)
    mc = model.config
    facts["policy"] = (f"Qwen3 architecture, {n_params / 1e6:.2f}M parameters ({mc.num_hidden_layers} "
                       f"layers, hidden {mc.hidden_size}, vocab {mc.vocab_size})")
    facts["demonstrations"] = "; ".join(
        f"{k}: {v['trials']} trials, {v['calls']} calls, success {v['success']:.0%}, "
        f"{v['recoveries']} recoveries ({v['forced_rewinds']} forced, {v['model_rewinds']} model-initiated)"
        for k, v in demo_stats.items() if isinstance(v, dict))
    facts["demonstrations"] += (f" (on the first {demo_stats['levels']} training levels; the oracle's "
                                f"random moves are context only, never SFT targets)")

    trials = ModelTrials(cfg, tokenizer, model)
    program_bounds(cfg, programs, model, tokenizer, n_eval)
    sft_stats: dict[str, Any] = {}
    if cfg.sft.steps > 0:
        stages.begin("warm start (SFT)")
        with programs.stage("sft"):
            sft_stats = warm_start(cfg, model, demos, tokenizer,
                                   play_pool=lambda: play_pool(cfg, trials, train_env, model, rl_levels))
        pack = sft_stats["pack"]
        facts["SFT"] = (f"{sft_stats['steps']} steps x {cfg.sft.batch_size} sequences on {pack['examples']} "
                        f"packed sequences ({pack['own_tokens']} trained tokens, {pack['dropped']} "
                        f"longer than {cfg.sft.seq_len} dropped); held-out NLL/token "
                        f"{sft_stats['held_out_nll_before']:.3f} → {sft_stats['held_out_nll_after']:.3f}")
        if sft_stats["pool_checks"]:
            s, log = cfg.sft, sft_stats["pool_checks"]
            facts["SFT"] += ("; stopped at the first check where the policy solved ≥ "
                             f"{s.stop_at_success or 0:.0%} of the RL pool's trials and ≥ "
                             f"{s.stop_at_levels or 0:.0%} of its levels at least once (ours; at most "
                             f"{s.steps} steps): "
                             + ", ".join(f"step {k} {v:.0%} / {n:.0%}" for k, v, n in log))
    stages.begin("evaluate SFT policy")
    with programs.stage("eval"):
        sft_summary, sft_archive = evaluate(cfg, trials, test_env, "SFT policy")
        greedy: dict[str, Any] = {}
        if cfg.eval.greedy:
            evaluate_greedy = GreedyEvaluation(cfg, tokenizer, model)
            greedy["SFT"] = evaluate_greedy(test_env, model, "SFT")

    stages.begin("ReTRAIL RL")
    played: list[tuple[list[Any], dict[int, bool]]] = []  # each update's trial specs and their outcomes

    def collect(policy_model: Any, tasks: Sequence[int], seeds: Sequence[int]) -> tuple[Archive, dict]:
        """B trials per task, all tasks in one batch; trial randomness from each task's seed."""
        trials.set_model(policy_model)
        b = cfg.trial.trials_per_task
        specs = [TrialSpec(trial=i * b + r, task=int(task), seed=int(seed), replicate=r,
                           protocol=cfg.trial.protocol)
                 for i, (task, seed) in enumerate(zip(tasks, seeds, strict=True)) for r in range(b)]
        archive = trials.run(train_env, specs)
        played.append((specs, {int(t.trial): bool(t.success) for t in archive.trials}))
        metrics = rollout_metrics(archive)
        agree = train_probe.agreement(archive)
        if agree is not None:
            metrics["expert_first_move"] = agree
        return archive, metrics

    def periodic_eval(policy_model: Any, iteration: int) -> dict:
        """Success on the held-out levels under the training protocol (learning-curve points)."""
        trials.set_model(policy_model)
        n = n_eval
        with trials.sampling_stream(cfg.run.seed + CHECK_STREAM):  # every check draws the same numbers
            arch = trials.run(test_env, make_specs(range(n), [cfg.run.seed], 1, [cfg.trial.protocol]))
        return {"success": float(np.mean([t.success for t in arch.trials]))}

    trainer_cfg = cfg if cfg.eval.every > 0 else config.replace(cfg, eval={"every": -1})
    trainer = Trainer(trainer_cfg, model, tokenizer, collect=collect, pool=rl_levels,
                      evaluate=periodic_eval if cfg.eval.every > 0 else None,
                      num_tasks=train_env.num_tasks, out_dir=out / "rl", tensorboard=True, progress=True,
                      programs=programs)
    trials.restart_sampling(cfg.run.seed + RL_STREAM)  # the RL trials' own stream, whatever was evaluated
    try:
        history = trainer.fit(cfg.learn.updates) if cfg.learn.updates > 0 else []
        rl_model = trainer.model()
        policy_dir = trainer.export(out / "policy")
    finally:
        trainer.close()
    tokenizer.save(policy_dir)

    stages.begin("evaluate RL policy")
    trials.set_model(rl_model)
    with programs.stage("eval"):
        rl_summary, rl_archive = evaluate(cfg, trials, test_env, "RL policy")
        if cfg.eval.greedy:
            greedy["RL"] = evaluate_greedy(test_env, rl_model, "RL")
    # first/last windows: one pass over the pool the trainer plays (capped to the split), 2 without one;
    # the first window's trials are replayed by the final policy: the training-batch change with levels fixed
    lc = cfg.learn
    window = pool_window(trainer.tasks.num_tasks if lc.train_tasks is not None else None, lc.tasks_per_update)
    w = min(window, max(1, len(history) // 2))  # as batch_success_change's first window; 1 for a 1-update run
    replay = None
    if history and len(played) >= w:
        stages.begin("replay first window")
        replay = replay_window(cfg, trials, train_env, rl_model, played[:w])

    stages.begin("report")
    results = {"SFT": sft_summary["results"], "RL": rl_summary["results"]}
    if greedy:
        facts["greedy"] = ("held-out success with greedy decoding (temperature 0, one seed; ours: "
                           "eval.greedy): " + "; ".join(
                               f"{label} " + ", ".join(f"{p} {r['success']:.1%}" for p, r in res.items())
                               for label, res in greedy.items())
                           + " (a gain at temperature 1 that vanishes here is sharpening)")
    first_moves = {label: test_probe.agreement(arch) for label, arch in (("SFT", sft_archive),
                                                                          ("RL", rl_archive))}
    if first_moves["SFT"] is not None:
        facts["first moves"] = ("share of held-out trials whose first move is one of the expert's best at "
                                f"C_0: SFT {first_moves['SFT']:.0%}, RL {first_moves['RL']:.0%} "
                                "(a policy that ignores the board stays near the split's marginal)")
    curve = learning_curve(history)
    attempts = {}
    for label, arch in (("SFT", sft_archive), ("RL", rl_archive)):
        k_proto = next((p for p in cfg.eval.protocols if attempts_curve(arch, p) is not None), None)
        if k_proto is not None:
            attempts[f"{label} ({k_proto})"] = attempts_curve(arch, k_proto)
    pool = (f" drawn from the first {trainer.tasks.num_tasks} training levels" if lc.train_tasks is not None
            else "")
    if lc.pool_lengths is not None:
        lo, hi = lc.pool_lengths
        pool = (f" drawn from {trainer.tasks.num_tasks} training levels whose shortest solution takes "
                f"{lo}-{hi} moves (ours: learn.pool_lengths)")
    facts["RL"] = (f"{len(history)} updates x {lc.tasks_per_update} tasks{pool} x "
                   f"{cfg.trial.trials_per_task} trials ({cfg.trial.protocol}), estimator {lc.estimator}, "
                   f"reflection reward {lc.reflection_reward}, λ_ref {lc.lambda_ref}, lr {lc.learning_rate}"
                   + (f" after a linear warmup over {lc.warmup_steps} optimizer steps"
                      if lc.warmup_steps else "")
                   + f" ({lc.epochs} epochs x {lc.minibatches} minibatches per update)"
                   + (f", invalid-turn penalty {lc.invalid_penalty} (ours, not the paper's: C.2 gives δ = 0)"
                      if lc.invalid_penalty else "")
                   + (f", KL penalty to the SFT policy {lc.kl_coef} (ours: the paper names none)"
                      if lc.kl_coef else "")
                   + (f", rewind return `{lc.rewind_return}` (ours)"
                      if lc.rewind_return != "segment" else ""))
    facts["budgets"] = (f"{cfg.trial.max_calls} calls per trial, branch budget {cfg.trial.branch_budget}, "
                        f"{cfg.trial.prompt_style} prompts, temperature {cfg.sampler.temperature}")
    paired = heldout_pairs(sft_archive, rl_archive, cfg.eval.protocols)
    notes = closing_notes(results, history, cfg, window=window, replay=replay, paired=paired)
    stages.end()
    path = report.write_report(
        out, title="retrojax demo: a small Qwen3 agent learns Sokoban with ReTRAIL", results=results,
        curve=curve, attempts=attempts, facts=facts, stages=stages.times,
        comparisons=[("SFT", "RL", p) for p in cfg.eval.protocols], notes=notes, paired=paired)
    if curve:
        with path.open("a") as f:
            f.write("\n## Per-update diagnostics\n\nMean advantage (A) by decision kind over the update's "
                    "trained calls; best moves: the share of moves that start a shortest solution, with "
                    "their A and the other moves' (over all trials, and over failed trials); KL estimates "
                    "per sampled token; entropy is the mean −log π of the sampled tokens.\n\n"
                    + diagnostics_table(curve) + "\n")
    summary = {"results": results, "deltas": {k: report.deltas(v) for k, v in results.items()},
               "sft": sft_stats, "demonstrations": demo_stats, "curve": curve, "attempts": attempts,
               "stages": dict(stages.times), "total_s": stages.total, "policy": str(policy_dir),
               "checkpoints": str(out / "rl" / "checkpoints"), "report": str(path),
               "train_tasks": trainer.tasks.num_tasks, "tasks_per_update": cfg.learn.tasks_per_update,
               "window_updates": window, "replay_first_window": replay,
               "heldout_expert_first_move": first_moves,
               "results_greedy": greedy,
               "heldout_trials": {label: [[t.protocol, int(t.task), int(t.seed), bool(t.success)]
                                          for t in arch.trials]
                                  for label, arch in (("SFT", sft_archive), ("RL", rl_archive))}}
    programs.log()
    summary.update(programs.metrics())  # programs.<stage>.compiled, .cached, .compile_s, .other, .bound
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    return path


def program_bounds(cfg: Any, programs: Ledger, model: Any, tokenizer: Any, n_eval: int) -> None:
    """Each stage's bound on compiled programs: the warm start's SFT shapes, and the sampler programs of
    the trials' one policy, one sampler per distinct batch width (an update's trials, an evaluation of
    every protocol, a periodic check of the training protocol; the greedy evaluation's own policy)."""
    from retrojax import config
    from retrojax.learn.collect import collect_width, eval_widths, sampler_bound
    from retrojax.learn.warm_start import program_bound

    if cfg.sft.steps > 0:
        programs.bound("sft", program_bound(cfg))
    programs.bound("collect", sampler_bound(cfg, model, tokenizer, [collect_width(cfg)]))
    widths = eval_widths(cfg, n_eval)
    if cfg.eval.every > 0:
        widths.append(collect_width(cfg, n_eval))
    bound = sampler_bound(cfg, model, tokenizer, widths)
    if cfg.eval.greedy:
        greedy = config.replace(cfg, eval={"seeds": 1})  # GreedyEvaluation's policy: a sampler of its own
        bound = bound + sampler_bound(greedy, model, tokenizer, eval_widths(greedy, n_eval))
    programs.bound("eval", bound)


def heldout_pairs(sft: Archive, rl: Archive, protocols: Sequence[str]) -> dict[tuple[str, str, str], Any]:
    """RL − SFT per protocol over the held-out trials both played (same level, seed and protocol), with
    95% intervals: the comparison the report's held-out sentences judge by."""
    from retrojax.eval.metrics import paired_outcomes

    def outcomes(archive: Archive) -> dict[tuple[str, int, int], bool]:
        return {(t.protocol, int(t.task), int(t.seed)): bool(t.success) for t in archive.trials}

    pairs = {("SFT", "RL", p): paired_outcomes(outcomes(rl), outcomes(sft), p) for p in protocols}
    return {k: v for k, v in pairs.items() if v is not None}


def closing_notes(results: dict[str, Any], history: list[dict[str, float]], cfg: Any,
                  window: int = 2, replay: dict[str, Any] | None = None,
                  paired: dict[tuple[str, str, str], Any] | None = None) -> list[str]:
    """What the numbers say, without spin (``window``: updates per first/last training-batch window;
    ``replay``: the final policy on the first window's trials, :func:`replay_window`; ``paired``: the
    held-out RL − SFT differences of :func:`heldout_pairs`)."""
    notes = []
    if history:
        notes.append(batch_success_note(batch_success_change(learning_curve(history), window=window)))
    if replay is not None:
        notes.append(replay_note(replay))
    for p in cfg.eval.protocols:
        if p in results.get("SFT", {}) and p in results.get("RL", {}):
            notes.append("Held-out: " + report.compare_sentence(results, "SFT", "RL", p,
                                                                 paired=(paired or {}).get(("SFT", "RL", p))))
    main_proto = cfg.trial.protocol if cfg.trial.protocol in results["RL"] else cfg.eval.protocols[-1]
    sft_s = results["SFT"][main_proto]["success"]
    rl_s = results["RL"][main_proto]["success"]
    if not history:
        notes.append("No RL updates were run (learn.updates = 0): the RL policy is the SFT policy.")
    elif rl_s > sft_s:
        notes.append(f"RL raised {main_proto} success from {sft_s:.1%} to {rl_s:.1%} at this scale; check "
                     "the intervals above before reading much into it.")
    else:
        notes.append(f"RL did not beat SFT on {main_proto} at this scale ({rl_s:.1%} vs {sft_s:.1%}). "
                     f"The demo runs only {len(history)} updates of {cfg.learn.tasks_per_update} tasks x "
                     f"{cfg.trial.trials_per_task} trials on a CPU budget; more updates "
                     "(`--set learn.updates=…`), more trials per task, or a larger model are the levers.")
    invalid = [h["rollout/invalid"] for h in history if "rollout/invalid" in h]
    if len(invalid) >= 2:
        notes.append(f"Invalid turns per training trial went from {invalid[0]:.2f} (update 1) to "
                     f"{invalid[-1]:.2f} (update {len(invalid)}).")
    notes.append("Numbers are from one run with the seeds in the config; the 95% intervals count held-out "
                 "rooms, not trials (Wilson at the room-clustered effective trial count; differences paired "
                 "per room and clustered by room).")
    return notes


def main(args: argparse.Namespace) -> int:
    """``retrojax demo [--config configs/demo.yaml] [--set key=value ...]``."""
    from retrojax.config import ConfigError, load

    try:
        cfg = load(args.config, args.overrides)
        check_config(cfg)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        path = run(cfg)
    except BadPool as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[demo] done in {time.perf_counter() - t0:.0f}s")
    print(f"[demo] report: {path}")
    print(f"[demo] plots, checkpoints and the exported policy are in {path.parent}/")
    return 0
