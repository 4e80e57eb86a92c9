"""Protocol runs: ``retrojax eval`` — success rates of a policy under P@1 / T@1 / T@k.

All protocols, seeds and tasks run together in one batched runner call (trials of different protocols share
their random draws per (seed, task, replicate), so protocol differences are paired). The report gives per
protocol the success rate with a 95% interval clustered by task (``eval.metrics``), the mean ± std of the
per-seed success rates, calls, rewinds, distinct states visited and actions to success, plus
``Δpro = T@1 − P@1`` and ``Δref = T@3 − T@1`` when those protocols are present. ``--json PATH`` writes the
same figures with stable keys ``results.<protocol>.{success, ci95, calls, rewinds, …}``.
``--transcripts FILE`` writes one JSON line per model call, agent and auxiliary, ReTRAIL and RIR alike
(:class:`~retrojax.agent.policies.TranscriptPolicy`: protocol, task, seed, trial, call, role, messages,
reply).

Imports run one way: this module → ``eval.rir.run`` (RIR protocol names) → ``eval.rir.metrics``;
``eval.rir.report`` (``retrojax rir``) builds on this module, never the reverse.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from retrojax import config as config_lib
from retrojax.agent.env_api import make_env
from retrojax.agent.policies import (
    ModelPolicy,
    NotesPolicy,
    OraclePolicy,
    Policy,
    RandomPolicy,
    TranscriptPolicy,
)
from retrojax.agent.rir.variants import is_rir, parse_variant
from retrojax.agent.runner import run_trials
from retrojax.agent.trial import parse_protocol
from retrojax.eval.rir.run import evaluate_rir, format_eval


def make_policy(spec: str, cfg: Any) -> Policy:
    """``random`` | ``notes`` | ``oracle:EPS`` | ``model:DIR`` | ``api:MODEL`` → a policy. Raises
    ``ValueError`` on a bad spec. ``api:MODEL`` is a served model behind the ``api:`` section's
    OpenAI-compatible endpoint; ``notes`` follows Sokoban's push notes (``env.push_notes``)."""
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "random" and not arg:
        return RandomPolicy()
    if kind == "notes" and not arg:
        return NotesPolicy()  # Sokoban with env.push_notes: the notes followed, no model
    if kind == "oracle":
        try:
            eps = float(arg) if arg else 0.0
        except ValueError as e:
            raise ValueError(f"--policy oracle:EPS needs a number EPS in [0, 1], got {arg!r}") from e
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"--policy oracle:EPS needs EPS in [0, 1], got {eps}")
        if cfg.env.name in ("scienceworld", "alfworld"):
            from retrojax.agent.textworld_env import TextOraclePolicy

            return TextOraclePolicy(eps)  # asks the workers to precompute the expert's next command
        return OraclePolicy(eps)
    if kind == "model" and arg:
        import jax.numpy as jnp

        from retrojax.model.checkpoint import from_pretrained
        from retrojax.model.tokenizer import load_tokenizer

        model = from_pretrained(arg, dtype=jnp.dtype(cfg.model.dtype))
        tokenizer = load_tokenizer(cfg.model.tokenizer or arg)
        return ModelPolicy.from_config(cfg, model, tokenizer)
    if kind == "api":
        from retrojax.agent.api_policy import ApiPolicy

        return ApiPolicy.from_config(cfg, model=arg.strip() or None)
    raise ValueError(f"unknown policy {spec!r}; use random, notes, oracle:EPS, model:DIR or api:MODEL")


def plan_policy_rows(cfg: Any, spec: str, device_memory: str | None = None) -> Any:
    """``cfg`` with ``sampler.max_inflight`` planned for the policy before anything is allocated
    (retrojax.plan.admission): a ``model:DIR`` policy holds weights and a KV cache row per trial in flight, so
    ``auto`` takes the most rows that fit and an explicit value that does not fit raises ``DoesNotFit``;
    other policies hold no device memory and keep the setting (``auto`` = every trial at once)."""
    kind, _, arg = spec.partition(":")
    if kind.strip().lower() != "model" or not arg:
        return cfg
    from retrojax.model.qwen3 import Qwen3Config
    from retrojax.plan.admission import admit_decoding, device_budget, resolve, summary

    admission = admit_decoding(cfg, device_budget(device_memory), Qwen3Config.from_json(arg.strip()))
    print(summary(admission), file=sys.stderr)
    return resolve(cfg, admission)


def _protocols(args: argparse.Namespace, cfg: Any) -> list[str]:
    raw = args.protocol or list(cfg.eval.protocols)
    names = [p.strip() for item in raw for p in item.split(",") if p.strip()]
    out = []
    for n in names:
        name = parse_variant(n).name if is_rir(n) else parse_protocol(n).name  # RIR/…: retrojax.agent.rir
        if name not in out:
            out.append(name)
    return out


def _split(args: argparse.Namespace, cfg: Any) -> str:
    if args.split:
        return args.split
    base = cfg.env.split
    return base if ":" in base else f"{base}:test"


def evaluate(cfg: Any, policy: Policy, split: str, protocols: list[str], seeds: int,
             tasks: int | None = None, trials_per_task: int | None = None,
             transcripts: Any = None) -> dict[str, Any]:
    """Run the protocols and return the report dict (see the module docstring). ``transcripts``: an open
    text file that receives one JSON line per model call."""
    rir = [p for p in protocols if is_rir(p)]  # RIR variants run as their own paired batch
    env = make_env(cfg, split)
    try:
        n = env.num_tasks if tasks is None else min(tasks, env.num_tasks)
        start = time.perf_counter()
        metrics: dict[str, Any] = {"results": {}}
        if len(rir) < len(protocols):
            runs = TranscriptPolicy(policy, transcripts) if transcripts is not None else policy
            _, metrics = run_trials(cfg, runs, task_ids=range(n), seeds=range(seeds),
                                    trials_per_task=trials_per_task,
                                    protocols=[p for p in protocols if not is_rir(p)], env=env,
                                    record_tokens=False)
        if rir:
            part, _ = evaluate_rir(cfg, policy, split, rir, seeds, n, trials_per_task, env=env,
                                   transcripts=transcripts)
            metrics["results"].update(part["results"])
            metrics["rir"] = part["rir"]
        elapsed = time.perf_counter() - start
    finally:
        env.close()
    b = cfg.trial.trials_per_task if trials_per_task is None else trials_per_task
    served = getattr(policy, "report", None)
    if callable(served):  # a served model (api:MODEL): tokens from the records, retries/failures: client
        metrics["api"] = served()
        for name, use in metrics["api"]["protocols"].items():
            if name in metrics["results"]:
                metrics["results"][name]["usage"] = {**use, **metrics["results"][name]["tokens"]}
        metrics["api"]["usage"].update(
            {k: sum(r["tokens"][k] for r in metrics["results"].values()) for k in ("prompt_tokens",
                                                                                   "completion_tokens")})
    return {**metrics, "split": split, "tasks": n, "seeds": seeds, "trials_per_task": b,
            "protocols": protocols, "seconds": elapsed}


def format_report(report: dict[str, Any], policy: str) -> str:
    lines = [f"policy {policy} on {report['split']}: {report['tasks']} tasks × {report['seeds']} seeds × "
             f"{report['trials_per_task']} trials per protocol ({report['seconds']:.1f} s)",
             f"{'protocol':<9}{'success':>9}{'95% CI':>17}{'seeds mean±std':>18}{'calls':>8}{'rewinds':>9}"
             f"{'states':>8}{'actions→✓':>11}"]
    for name in report["protocols"]:
        r = report["results"][name]
        acts = "-" if r["actions_to_success"] is None else f"{r['actions_to_success']:.1f}"
        ci = f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
        spread = f"{r['seed_mean']:.3f} ± {r['seed_std']:.3f}"
        lines.append(f"{name:<9}{r['success']:>9.3f}{ci:>17}{spread:>18}{r['calls']:>8.1f}"
                     f"{r['rewinds']:>9.2f}{r['distinct_states']:>8.1f}{acts:>11}")
    for name in report["protocols"]:
        ends = report["results"][name].get("end_reasons")
        if ends:
            lines.append(f"{name} ends: " + ", ".join(f"{k} {v:.3f}" for k, v in ends.items()))
    if "api" in report:
        u = report["api"]["usage"]
        lines.append(f"served model {report['api']['model']}: {u['requests']} requests, {u['prompt_tokens']} "
                     f"prompt + {u['completion_tokens']} completion tokens, {u['retries']} retries, "
                     f"{u['failed']} failed (invalid turns)")
    if "delta_pro" in report:
        lines.append(f"Δpro = T@1 − P@1 = {report['delta_pro']:+.3f}")
    if "delta_ref" in report:
        lines.append(f"Δref = T@3 − T@1 = {report['delta_ref']:+.3f}")
    return "\n".join(lines)


def benchmark_mean(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """C.5's equal-benchmark aggregate per protocol: M_s = mean over worlds of each seed's success, then the
    mean and standard deviation of M_s over seeds (every world weighs 1, whatever its task count)."""
    out: dict[str, Any] = {}
    protocols = set.intersection(*(set(r["results"]) for r in reports.values())) if reports else set()
    for name in sorted(protocols):
        per_world = [r["results"][name]["seed_success"] for r in reports.values()]
        seeds = sorted(set.intersection(*(set(s) for s in per_world)), key=int)
        per_seed = {s: sum(w[s] for w in per_world) / len(per_world) for s in seeds}
        vals = list(per_seed.values())
        mean = sum(vals) / len(vals) if vals else 0.0
        std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
        out[name] = {"mean": mean, "seed_std": std, "per_seed": per_seed, "worlds": len(per_world)}
    return out


def open_transcripts(path: str | None) -> Any:
    """``--transcripts FILE``: a context manager giving the open file (truncated), or None without a path."""
    import contextlib

    if not path:
        return contextlib.nullcontext(None)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.open("w", encoding="utf-8")


def _transcripts(args: argparse.Namespace) -> Any:
    return open_transcripts(getattr(args, "transcripts", None))


def _main_worlds(args: argparse.Namespace, paths: list[str]) -> int:
    """``retrojax eval --config a.yaml,b.yaml``: each world's report, then the equal-benchmark mean (C.5)."""
    reports: dict[str, dict[str, Any]] = {}
    with _transcripts(args) as out:  # one file for every world
        for path in paths:
            cfg = config_lib.load(path, args.overrides)
            protocols = _protocols(args, cfg)
            cfg = plan_policy_rows(cfg, args.policy, getattr(args, "device_memory", None))
            policy = make_policy(args.policy, cfg)
            tasks = args.tasks if args.tasks is not None else cfg.eval.num_tasks
            report = evaluate(cfg, policy, _split(args, cfg), protocols, args.seeds, tasks, transcripts=out)
            report["policy"], report["config"] = args.policy, path
            print(format_report(report, args.policy))
            reports[report["split"]] = report
    agg = benchmark_mean(reports)
    print("equal-benchmark mean over " + ", ".join(reports) + " (C.5: each world weighs 1):")
    for name, a in agg.items():
        print(f"  {name:<6} {a['mean']:.3f} ± {a['seed_std']:.3f} (std over {len(a['per_seed'])} seeds)")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"worlds": reports, "benchmark_mean": agg}, indent=2, sort_keys=True))
        print(f"wrote {path}")
    return 0


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax eval`` (flags in ``retrojax/cli.py``)."""
    paths = [p.strip() for p in (args.config or "").split(",") if p.strip()]
    if len(paths) > 1:
        try:
            if args.seeds < 1:
                raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
            return _main_worlds(args, paths)
        except (ValueError, KeyError, FileNotFoundError, config_lib.ConfigError) as e:
            print(f"retrojax eval: {e}", file=sys.stderr)
            return 2
    try:
        cfg = config_lib.load(args.config, args.overrides)
        protocols = _protocols(args, cfg)
        if args.seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
        if args.tasks is not None and args.tasks < 1:
            raise ValueError(f"--tasks must be at least 1, got {args.tasks}")
        cfg = plan_policy_rows(cfg, args.policy, getattr(args, "device_memory", None))
        policy = make_policy(args.policy, cfg)
        tasks = args.tasks if args.tasks is not None else cfg.eval.num_tasks
        with _transcripts(args) as out:
            report = evaluate(cfg, policy, _split(args, cfg), protocols, args.seeds, tasks, transcripts=out)
    except (ValueError, KeyError, FileNotFoundError, config_lib.ConfigError) as e:
        print(f"retrojax eval: {e}", file=sys.stderr)
        return 2
    report["policy"] = args.policy
    report["config"] = args.config
    print(format_report(report, args.policy))
    if "rir" in report:
        print(format_eval(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, sort_keys=True))
        print(f"wrote {path}")
    return 0
