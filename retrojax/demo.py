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
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrojax.agent.archive import Archive
from retrojax.eval import report


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
# Demonstrations and tokenizer
# ---------------------------------------------------------------------------------------------------


def demo_protocols(cfg: Any) -> list[str]:
    """Protocols whose prompts the solver demonstrations cover: the evaluation ones and the training one."""
    out = list(cfg.eval.protocols)
    if cfg.trial.protocol not in out:
        out.append(cfg.trial.protocol)
    return out


def run_demonstrations(cfg: Any, env: Any, tokenizer: Any) -> tuple[Archive, dict[str, Any]]:
    """Oracle trials on training levels: solver play (ε = 0) and recovery play (ε = ``sft.oracle_epsilon``).

    Both use the same level indices (cycling through the split) and fixed seeds, so replaying them with
    another tokenizer gives the same trials. ``tokenizer`` None records byte-level ids.
    """
    from retrojax.agent.policies import OraclePolicy
    from retrojax.agent.runner import Runner, make_specs

    s = cfg.sft
    n_tasks = env.num_tasks
    protocols = demo_protocols(cfg)
    per_protocol = math.ceil(s.num_solver_episodes / len(protocols))
    archive = Archive()
    stats: dict[str, Any] = {}
    first = 0
    plays = [("solver", 0.0, per_protocol, protocols), ("recovery", s.oracle_epsilon, s.num_recovery_episodes,
                                                         [cfg.trial.protocol])]
    for name, eps, count, protos in plays:
        if count <= 0:
            continue
        tasks = [i % n_tasks for i in range(count)]
        specs = make_specs(tasks, [cfg.run.seed], 1, protos, first_trial=first)
        first += len(specs)
        runner = Runner(cfg, env, OraclePolicy(eps), tokenizer=tokenizer, record_tokens=True)
        part = runner.run(specs)
        archive.extend(part)
        stats[name] = {"trials": len(part.trials), "calls": len(part.calls),
                       "success": float(np.mean([t.success for t in part.trials])),
                       "recoveries": len(part.recoveries),
                       "model_rewinds": int(sum(t.rewinds_model for t in part.trials)),
                       "forced_rewinds": int(sum(t.rewinds_forced for t in part.trials))}
    return archive, stats


def corpus_from_archive(archive: Archive, decode: Any) -> list[str]:
    """Texts for the tokenizer: every trial's longest context (prompt + output) and every reflection call."""
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
    return Qwen3(config, dtype=jnp.dtype(cfg.model.dtype), rngs=nnx.Rngs(cfg.model.seed),
                 remat=cfg.learn.remat)


def load_checkpoint(cfg: Any) -> tuple[Any, Any]:
    """``model.path`` (and ``model.tokenizer``, default the same directory) as (model, tokenizer)."""
    import jax.numpy as jnp

    from retrojax.model.checkpoint import from_pretrained
    from retrojax.model.tokenizer import load_tokenizer

    model = from_pretrained(cfg.model.path, dtype=jnp.dtype(cfg.model.dtype))
    return model, load_tokenizer(cfg.model.tokenizer or cfg.model.path)


# ---------------------------------------------------------------------------------------------------
# Warm start
# ---------------------------------------------------------------------------------------------------


def special_ids(tokenizer: Any) -> tuple[int, int]:
    """(end-of-turn id, padding id) of a model tokenizer, or of the byte-level chat tokenizer (which has
    no padding id: padded positions are masked out, so its end-of-turn id serves)."""
    end = getattr(tokenizer, "im_end_id", None)
    end = int(tokenizer.stop_ids[0]) if end is None else int(end)
    pad = getattr(tokenizer, "pad_token_id", None)
    return end, end if pad is None else int(pad)


def warm_start(cfg: Any, model: Any, archive: Archive, tokenizer: Any) -> dict[str, Any]:
    """SFT on every demonstration call (execution and reflection), loss on output tokens + end of turn."""
    from tqdm import tqdm

    from retrojax.learn import sft

    s = cfg.sft
    end_id, pad = special_ids(tokenizer)
    calls = [(c.prompt_ids, c.output_ids) for c in archive.calls]
    examples, stats = sft.pack_calls(calls, s.seq_len, end_id=end_id)
    if not examples:
        raise ValueError(f"no demonstration fits sft.seq_len={s.seq_len} tokens ({stats.dropped} dropped)")
    rng = np.random.default_rng(cfg.run.seed)
    order = rng.permutation(len(examples))
    held = [examples[i] for i in order[: max(1, len(examples) // 10)]]
    train = [examples[i] for i in order[max(1, len(examples) // 10):]] or held
    buckets = sorted({b for b in cfg.learn.seq_buckets if b < s.seq_len} | {s.seq_len})
    chunk = cfg.learn.logprob_chunk
    nll_before = sft.evaluate_nll(model, held, s.batch_size, pad_id=pad, chunk=chunk, buckets=buckets)
    bar = tqdm(total=s.steps, desc="sft", unit="step")

    def progress(step: int, m: dict[str, float]) -> None:
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{m['loss']:.3f}")

    try:
        history = sft.train_sft(model, train, steps=s.steps, batch_size=s.batch_size,
                                learning_rate=s.learning_rate, seed=cfg.run.seed, warmup_steps=s.warmup_steps,
                                max_grad_norm=cfg.learn.max_grad_norm, pad_id=pad, progress=progress,
                                buckets=buckets, chunk=chunk)
    finally:
        bar.close()
    nll_after = sft.evaluate_nll(model, held, s.batch_size, pad_id=pad, chunk=chunk, buckets=buckets)
    return {"pack": dataclasses.asdict(stats), "train_examples": len(train), "held_out_examples": len(held),
            "held_out_nll_before": nll_before, "held_out_nll_after": nll_after,
            "final_train_loss": float(np.mean([h["loss"] for h in history[-10:]])),
            "skipped_steps": int(sum(h["skipped"] for h in history))}


# ---------------------------------------------------------------------------------------------------
# Trials with the model
# ---------------------------------------------------------------------------------------------------


class ModelTrials:
    """Runs model trials on several worlds through one ``ModelPolicy`` (one sampler, one RNG stream).

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

    def run(self, env: Any, specs: Sequence[Any]) -> Archive:
        from retrojax.agent.runner import Runner

        return Runner(self.cfg, env, self.policy).run(specs)


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

    archive = trials.run(env, make_specs(range(n), range(cfg.eval.seeds), 1, cfg.eval.protocols))
    return summarize(archive.trials), archive


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


def run(cfg: Any) -> Path:
    """Run every stage; returns the report's path."""
    from retrojax import config
    from retrojax.agent.env_api import make_env
    from retrojax.agent.runner import make_specs
    from retrojax.agent.trial import TrialSpec
    from retrojax.learn.trainer import Trainer
    from retrojax.model import count_params
    from retrojax.model.tokenizer import train_sentencepiece

    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages()
    facts: dict[str, Any] = {}

    stages.begin("levels")
    train_env = make_env(cfg, f"{cfg.env.split}:train")
    test_env = make_env(cfg, f"{cfg.env.split}:test")
    n_eval = min(cfg.eval.num_tasks or test_env.num_tasks, test_env.num_tasks)
    facts["levels"] = (f"`{cfg.env.split}`: {train_env.num_tasks} training, {test_env.num_tasks} test levels "
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
        for k, v in demo_stats.items())

    sft_stats: dict[str, Any] = {}
    if cfg.sft.steps > 0:
        stages.begin("warm start (SFT)")
        sft_stats = warm_start(cfg, model, demos, tokenizer)
        pack = sft_stats["pack"]
        facts["SFT"] = (f"{cfg.sft.steps} steps x {cfg.sft.batch_size} sequences on {pack['examples']} "
                        f"packed sequences ({pack['own_tokens']} trained tokens, {pack['dropped']} "
                        f"longer than {cfg.sft.seq_len} dropped); held-out NLL/token "
                        f"{sft_stats['held_out_nll_before']:.3f} → {sft_stats['held_out_nll_after']:.3f}")
    stages.begin("evaluate SFT policy")
    trials = ModelTrials(cfg, tokenizer, model)
    sft_summary, sft_archive = evaluate(cfg, trials, test_env, "SFT policy")

    stages.begin("ReTRAIL RL")

    def collect(policy_model: Any, tasks: Sequence[int], seeds: Sequence[int]) -> tuple[Archive, dict]:
        """B trials per task, all tasks in one batch; trial randomness from each task's seed."""
        trials.set_model(policy_model)
        b = cfg.trial.trials_per_task
        specs = [TrialSpec(trial=i * b + r, task=int(task), seed=int(seed), replicate=r,
                           protocol=cfg.trial.protocol)
                 for i, (task, seed) in enumerate(zip(tasks, seeds, strict=True)) for r in range(b)]
        archive = trials.run(train_env, specs)
        return archive, rollout_metrics(archive)

    def periodic_eval(policy_model: Any, iteration: int) -> dict:
        """Success on the held-out levels under the training protocol (learning-curve points)."""
        trials.set_model(policy_model)
        n = min(cfg.eval.num_tasks or test_env.num_tasks, test_env.num_tasks)
        arch = trials.run(test_env, make_specs(range(n), [cfg.run.seed], 1, [cfg.trial.protocol]))
        return {"success": float(np.mean([t.success for t in arch.trials]))}

    trainer_cfg = cfg if cfg.eval.every > 0 else config.replace(cfg, eval={"every": -1})
    trainer = Trainer(trainer_cfg, model, tokenizer, collect=collect,
                      evaluate=periodic_eval if cfg.eval.every > 0 else None,
                      num_tasks=train_env.num_tasks, out_dir=out / "rl", tensorboard=True, progress=True)
    try:
        history = trainer.fit(cfg.learn.updates) if cfg.learn.updates > 0 else []
        rl_model = trainer.model()
        policy_dir = trainer.export(out / "policy")
    finally:
        trainer.close()
    tokenizer.save(policy_dir)

    stages.begin("evaluate RL policy")
    trials.set_model(rl_model)
    rl_summary, rl_archive = evaluate(cfg, trials, test_env, "RL policy")

    stages.begin("report")
    results = {"SFT": sft_summary["results"], "RL": rl_summary["results"]}
    curve = learning_curve(history)
    attempts = {}
    for label, arch in (("SFT", sft_archive), ("RL", rl_archive)):
        k_proto = next((p for p in cfg.eval.protocols if attempts_curve(arch, p) is not None), None)
        if k_proto is not None:
            attempts[f"{label} ({k_proto})"] = attempts_curve(arch, k_proto)
    lc = cfg.learn
    pool = (f" drawn from the first {trainer.tasks.num_tasks} training levels" if lc.train_tasks is not None
            else "")
    facts["RL"] = (f"{len(history)} updates x {lc.tasks_per_update} tasks{pool} x "
                   f"{cfg.trial.trials_per_task} trials ({cfg.trial.protocol}), estimator {lc.estimator}, "
                   f"reflection reward {lc.reflection_reward}, λ_ref {lc.lambda_ref}, lr {lc.learning_rate}"
                   + (f", invalid-turn penalty {lc.invalid_penalty} (ours, not the paper's: C.2 gives δ = 0)"
                      if lc.invalid_penalty else ""))
    facts["budgets"] = (f"{cfg.trial.max_calls} calls per trial, branch budget {cfg.trial.branch_budget}, "
                        f"{cfg.trial.prompt_style} prompts, temperature {cfg.sampler.temperature}")
    notes = closing_notes(results, history, cfg)
    stages.end()
    path = report.write_report(
        out, title="retrojax demo: a small Qwen3 agent learns Sokoban with ReTRAIL", results=results,
        curve=curve, attempts=attempts, facts=facts, stages=stages.times,
        comparisons=[("SFT", "RL", p) for p in cfg.eval.protocols], notes=notes)
    summary = {"results": results, "deltas": {k: report.deltas(v) for k, v in results.items()},
               "sft": sft_stats, "demonstrations": demo_stats, "curve": curve, "attempts": attempts,
               "stages": dict(stages.times), "total_s": stages.total, "policy": str(policy_dir),
               "checkpoints": str(out / "rl" / "checkpoints"), "report": str(path),
               "train_tasks": trainer.tasks.num_tasks}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    return path


def learning_curve(history: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per update: training-batch success and trials, reward, held-out success, and cumulative wall time."""
    curve, wall = [], 0.0
    for h in history:
        wall += float(h.get("time/collect_s", 0.0)) + float(h.get("time/learn_s", 0.0))
        curve.append({"update": int(h["iteration"]), "success": h.get("rollout/success", float("nan")),
                      "trials": int(h.get("rollout/trials", 0)), "reward": h.get("rollout/return"),
                      "eval_success": h.get("eval/success"), "wall_s": wall})
    return curve


def batch_success_change(curve: Sequence[dict[str, Any]], window: int = 2) -> dict[str, Any] | None:
    """Training-batch success of the first vs the last ``window`` updates (fewer when the run is short, so
    the two windows never share an update), pooled over their trials, with Wilson 95% intervals."""
    from retrojax.eval.metrics import wilson

    n = len(curve)
    w = min(window, n // 2)
    if w < 1:
        return None

    def pooled(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
        trials = sum(int(p["trials"]) for p in points)
        wins = int(round(sum(float(p["success"]) * int(p["trials"]) for p in points)))
        rate = wins / trials if trials else float("nan")
        return {"success": rate, "trials": trials, "ci95": list(wilson(wins, trials)),
                "updates": [int(p["update"]) for p in points]}

    first, last = pooled(curve[:w]), pooled(curve[-w:])
    return {"first": first, "last": last, "change": last["success"] - first["success"],
            "overlap": report.intervals_overlap(first["ci95"], last["ci95"])}


def _updates_text(updates: Sequence[int]) -> str:
    return f"update {updates[0]}" if len(updates) == 1 else f"updates {updates[0]}-{updates[-1]}"


def batch_success_note(change: dict[str, Any] | None) -> str:
    """One sentence: did training-batch success rise, with intervals."""
    if change is None:
        return "Training-batch success: too few updates to compare a first and a last window."
    f, la = change["first"], change["last"]
    verdict = "rose" if change["change"] > 0 else ("did not change" if change["change"] == 0 else "fell")
    support = ("the 95% intervals overlap, so the change is not statistically supported"
               if change["overlap"] else "the 95% intervals do not overlap")
    return (f"Training-batch success {verdict}: {f['success']:.1%} {report.fmt_ci(f['ci95'])} over "
            f"{_updates_text(f['updates'])} ({f['trials']} trials) → {la['success']:.1%} "
            f"{report.fmt_ci(la['ci95'])} over {_updates_text(la['updates'])} ({la['trials']} trials); "
            f"{support}.")


def closing_notes(results: dict[str, Any], history: list[dict[str, float]], cfg: Any) -> list[str]:
    """What the numbers say, without spin."""
    notes = []
    if history:
        notes.append(batch_success_note(batch_success_change(learning_curve(history))))
    for p in cfg.eval.protocols:
        if p in results.get("SFT", {}) and p in results.get("RL", {}):
            notes.append("Held-out: " + report.compare_sentence(results, "SFT", "RL", p))
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
    notes.append("Numbers are from one run with the seeds in the config; the 95% intervals are Wilson "
                 "intervals over trials.")
    return notes


def main(args: argparse.Namespace) -> int:
    """``retrojax demo [--config configs/demo.yaml] [--set key=value ...]``."""
    from retrojax.config import ConfigError, load

    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}")
        return 2
    t0 = time.perf_counter()
    path = run(cfg)
    print(f"[demo] done in {time.perf_counter() - t0:.0f}s")
    print(f"[demo] report: {path}")
    print(f"[demo] plots, checkpoints and the exported policy are in {path.parent}/")
    return 0
