"""``retrojax bench reviewer``: one small policy trained to act AND to fill every RIR role, then RIR against
ReAct with that policy in the loop (issue 53's measurement; figures, not a timed test).

The run, from a fresh start at the demo's model size (``configs/rir_reviewer.yaml``: the demo's 2-layer
Qwen3 and SFT warm start, RIR's limits for it):

1. role demonstrations (:mod:`retrojax.learn.role_demos`): the visible oracle plays RIR and its ablations
   through the real controller on the training levels, so every role — agent, reviewer, coarse and fine
   selectors, patcher — is recorded with exactly the prompt the controller sends it, labelled from what that
   prompt shows; the ReAct episodes are the execution demonstrations of ReAct's prompt. RIR itself gets 800
   episodes, the others 80 each: only RIR makes coarse and fine calls;
2. a tokenizer trained on that text (as the demo trains its own), then the same trials replayed with it;
3. the demo's SFT warm start (:func:`retrojax.learn.warm_start.warm_start`) on those calls;
4. RIR, ReAct (``RIR/react``), RIR/no-rollback and RIR/restart with the trained policy through the real
   controller on the same 64 held-out levels and seeds (one paired batch; ``--quick``: 2 levels, 2 variants);
5. ``--baselines``: the RIR paper's baselines (Self-Refine, Reflexion, LATS, GA-Rollback) demonstrated by the
   visible oracle in their roles too (critique, reflect, value, assist) and evaluated in the same batch;
6. ``--credit N``: reviewer credit (:mod:`retrojax.learn.rir_credit`) — N learner updates on RIR trials of
   the training levels from the trained policy with ``learn.lambda_ref`` and, as the control, with 0; RIR vs
   ReAct on the held-out levels every N // 2 updates.

Figures (stable keys):

- ``reviewer.parse.{review,coarse,fine,patch}``: fraction of the model's replies of that role that parse with
  no fallback, pooled over the variants that call the role (goal ≥ 0.9 each); ``reviewer.calls.<role>`` the
  number of such replies; ``reviewer.problems.<role>`` the most frequent reasons a reply fell back;
  ``reviewer.verdict_read``: reviews whose verdict could be read; with ``--baselines`` also
  ``reviewer.parse.{critique,reflect,value,assist}``;
- ``reviewer.rollbacks_per_trial`` (RIR), ``reviewer.success.<variant>`` (+ ``.ci95_lo/hi``, Wilson),
  ``reviewer.{aux_calls,rollbacks,invalid}_per_trial.<variant>``;
- ``reviewer.rir_minus_react`` (+ ``.ci95_lo/hi``): RIR − ReAct success, paired by (level, seed, replicate),
  the interval clustered by level (per-level mean differences; normal approximation); also
  ``reviewer.rir_minus_<variant>`` for every other variant run;
- ``reviewer.review_agreement``: reviews whose verdict equals the visible oracle's on the same state;
  ``reviewer.restore_precision``: executed restores (RIR) at the visible oracle's restore point on the same
  path (:func:`retrojax.agent.rir.policies.visible_restore`), with ``reviewer.restores`` their number;
- ``reviewer.tokens_per_trial.<variant>``: prompt + reply tokens over a trial's calls (the cost of reviewing),
  ``reviewer.seconds_per_trial.<variant>``: wall time per trial (the batch's groups hold one variant each);
- ``reviewer.demo.*`` and ``reviewer.sft.*``: the demonstrations (calls per role, dropped as longer than
  ``sft.seq_len``) and the warm start (steps, held-out NLL); ``reviewer.longest.<role>`` the longest
  demonstration prompt and reply in tokens beside the limits they must fit (``rir.prompt_budget``,
  ``rir.max_*_tokens``, ``sft.seq_len``);
- ``reviewer.wall_s`` (training and evaluation) and ``reviewer.{demos,sft,eval}_s``; ``reviewer.policy``: the
  trained policy exported with its tokenizer (for ``--policy model:DIR`` or ``retrojax serve``);
- ``--credit``: ``reviewer.credit.<arm>.*`` (arm ``credit`` or ``control``) — RIR − ReAct with its interval,
  success of each, RIR's rollbacks and review parse rate at the end and at each check (``.at_<update>.``),
  the training batches' first and last success, the recoveries credited, the arm's seconds; and
  ``reviewer.credit.gain_over_control`` (+ ``.ci95_lo/hi``): the credit arm's RIR − ReAct minus the
  control's, paired by level.

Goal (issue 53): every parse rate ≥ 0.9 within 20 minutes on the 2-core CPU (steps 1–4). No threshold on
RIR's gain: the bench reports what it measures.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrojax.eval.metrics import Z95

AUX = ("review", "coarse", "fine", "patch")
BASELINE_AUX = ("critique", "reflect", "value", "assist")  # the baselines' roles (Self-Refine's refine is the
BASELINES = ("RIR/self-refine", "RIR/reflexion", "RIR/lats", "RIR/ga-rollback")  # agent's own reply)

# --quick: the whole path at tiny sizes (one SFT bucket, one prefill bucket, short replies, 4 agent replies,
# a review after the first 2)
QUICK = [
    "model.preset=tiny", "sft.steps=2", "sft.batch_size=2", "learn.seq_buckets=[1024]",
    "sampler.chunk_buckets=[256]", "sampler.max_inflight=4", "rir.agent_budget=4", "rir.l_min=2", "rir.l_0=2",
    "sampler.max_new_tokens=8",
    "rir.max_review_tokens=16", "rir.max_select_tokens=8", "rir.max_patch_tokens=16",
    "sampler.max_reflection_tokens=16",
]


class Sizes:
    """The bench's counts (not config fields): role-demonstration episodes per protocol, the random-move
    rate of the visible oracle, held-out levels, seeds and the evaluated variants. With ``baselines`` the
    RIR paper's baselines are demonstrated (their roles: critique, reflect, value, assist) and evaluated
    too."""

    def __init__(self, quick: bool, baselines: bool = False):
        self.demo_protocols = ("RIR", "RIR/react") if quick else (
            "RIR", "RIR/react", "RIR/no-rollback", "RIR/restart")
        # per protocol; RIR weighed up: only its trials make coarse and fine calls (one of each per rollback)
        self.episodes = dict.fromkeys(self.demo_protocols, 4) if quick else {
            "RIR": 800, "RIR/react": 80, "RIR/no-rollback": 80, "RIR/restart": 80}
        self.corpus_episodes = 4 if quick else 48  # byte-level pass whose text trains the tokenizer
        self.epsilon = 0.4
        self.levels = 2 if quick else 64
        self.seeds = 1
        full = ("RIR/react", "RIR", "RIR/no-rollback", "RIR/restart")
        self.protocols = full[:2] if quick else full
        if baselines:
            # sized for a few hundred calls of each baseline role (per 32 episodes on sokoban-5x5-1: 135
            # critiques, 28 reflections, 166 values, 113 checks)
            extra = dict.fromkeys(BASELINES, 2) if quick else {
                "RIR/self-refine": 64, "RIR/reflexion": 128, "RIR/lats": 48, "RIR/ga-rollback": 96}
            self.demo_protocols += BASELINES
            self.episodes |= extra
            self.protocols += BASELINES


class OracleCheck:
    """Wraps the RIR policy and, on each review and fine-selection request, notes what the visible oracle
    would answer on the same view (the verdict; the restore point), beside the model's reply, so the bench
    can say how often the model's review agrees and how often its restores land on the oracle's checkpoint."""

    def __init__(self, inner: Any):
        self.inner = inner
        # per review: (the oracle says rollback, the model says rollback; None when its verdict is unread)
        self.reviews: list[tuple[bool, bool | None]] = []
        self.fine: dict[int, list[int]] = defaultdict(list)  # trial → the oracle's restore points
        self.problems: dict[str, Counter[str]] = defaultdict(Counter)  # role → why its replies fell back

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, specs: Sequence[Any], slots: Sequence[int], env: Any) -> None:
        self.inner.begin(specs, slots, env)

    def end(self) -> None:
        self.inner.end()

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        from retrojax.agent.rir import replies
        from retrojax.agent.rir.controller import COARSE, FINE, PATCH, REVIEW
        from retrojax.agent.rir.policies import visible_restore, visible_trouble

        gens = self.inner.generate(requests)
        for req, gen in zip(requests, gens, strict=True):
            v = req.view
            if v.kind == REVIEW:
                review = replies.parse_review(gen.text)
                said = review.verdict == replies.ROLLBACK if review.verdict_read else None
                self.reviews.append((bool(visible_trouble(v)), said))
                self._tally(v.kind, review.problems)
            elif v.kind == COARSE:
                self._tally(v.kind, replies.parse_range(gen.text, v.checkpoint).problems)
            elif v.kind == FINE:
                self.fine[req.trial].append(visible_restore(v))
                self._tally(v.kind, replies.parse_restore(gen.text, v.candidates).problems)
            elif v.kind == PATCH:
                self._tally(v.kind, replies.parse_patch(gen.text).problems)
        return gens

    def _tally(self, role: str, problems: Sequence[str]) -> None:
        # the reason without the reply's own text or numbers, so like failures count together
        for why in problems:
            self.problems[role][re.sub(r"\d+|'.*'|\".*\"", "#", why.split(";")[0])] += 1

    def problem_summary(self, role: str, top: int = 3) -> str:
        """The most frequent reasons ``role``'s replies fell back, with counts ("" when none did)."""
        return "; ".join(f"{why} ×{n}" for why, n in self.problems[role].most_common(top))


def clustered_difference(a: dict[tuple[int, int, int], float], b: dict[tuple[int, int, int], float],
                         z: float = Z95) -> tuple[float, float, float, int]:
    """Mean of ``a − b`` over the (seed, level, replicate) runs both hold, with a 95% interval clustered by
    level (the per-level mean differences as the sample); returns (mean, lo, hi, levels)."""
    keys = sorted(set(a) & set(b))
    if not keys:
        raise ValueError("no paired runs")
    per_level: dict[int, list[float]] = defaultdict(list)
    for k in keys:
        per_level[k[1]].append(a[k] - b[k])
    means = np.array([np.mean(v) for v in per_level.values()])
    weights = np.array([len(v) for v in per_level.values()], dtype=float)
    m = float(np.sum(means * weights) / weights.sum())
    n = len(means)
    se = float(np.sqrt(np.sum((weights * (means - m)) ** 2)) / weights.sum()) if n > 1 else 0.0
    return m, m - z * se * math.sqrt(n / max(n - 1, 1)), m + z * se * math.sqrt(n / max(n - 1, 1)), n


def _outcomes(records: Sequence[Any], protocol: str) -> dict[tuple[int, int, int], float]:
    return {(r.seed, r.task, r.replicate): float(r.success) for r in records if r.protocol == protocol}


def _byte_text(ids: Any) -> str:
    """The text of byte-level ids (what ``tokenizer`` None records; chat markers dropped)."""
    return bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256).decode("utf-8", "replace")


def train_policy(cfg: Any, sizes: Sizes, out: Path, log: Callable[[str], None]) -> tuple[Any, Any, dict]:
    """Role demonstrations → tokenizer → the demo's model → the demo's SFT warm start; returns (model,
    tokenizer, figures)."""
    from retrojax import config as config_lib
    from retrojax.agent.env_api import make_env
    from retrojax.demo import build_policy_model
    from retrojax.learn.role_demos import role_corpus, run_role_demonstrations
    from retrojax.learn.warm_start import warm_start
    from retrojax.model.tokenizer import train_sentencepiece

    figures: dict[str, Any] = {}
    env = make_env(cfg, f"{cfg.env.split}:train")
    try:
        t0 = time.perf_counter()
        # the byte-level pass only feeds the tokenizer's corpus: prompts are counted in bytes there, so the
        # budget is lifted to keep the text whole
        wide = config_lib.replace(cfg, rir={"prompt_budget": 1 << 20})
        raw, _ = run_role_demonstrations(wide, env, None, episodes=sizes.corpus_episodes,
                                         epsilon=sizes.epsilon, protocols=sizes.demo_protocols)
        corpus = role_corpus(raw, _byte_text)
        tokenizer = train_sentencepiece(corpus, cfg.sft.vocab_size, out / "tokenizer")
        demos, stats = run_role_demonstrations(cfg, env, tokenizer, episodes=sizes.episodes,
                                               epsilon=sizes.epsilon, protocols=sizes.demo_protocols)
        figures["reviewer.demos_s"] = time.perf_counter() - t0
    finally:
        env.close()
    figures["reviewer.demo.trials"] = int(stats.get("trials", 0))
    figures["reviewer.demo.oracle_success"] = float(stats.get("success", 0.0))
    for role, n in stats["targets"].items():
        figures[f"reviewer.demo.targets.{role}"] = int(n)
    for role in ("execution", *AUX, *BASELINE_AUX):
        calls = [c for c in demos.calls if c.role == role]
        if calls:
            figures[f"reviewer.longest.{role}.prompt"] = max(len(c.prompt_ids) for c in calls)
            figures[f"reviewer.longest.{role}.reply"] = max(len(c.output_ids) for c in calls)
    log(f"[bench reviewer] {len(demos.calls)} demonstration calls ({stats['targets']}), tokenizer of "
        f"{tokenizer.vocab_size} ids, {figures['reviewer.demos_s']:.0f}s")
    model = build_policy_model(cfg, tokenizer)
    t0 = time.perf_counter()
    sft = warm_start(cfg, model, demos, tokenizer)  # progress bar on stderr
    figures["reviewer.sft_s"] = time.perf_counter() - t0
    figures["reviewer.sft.steps"] = int(sft["steps"])
    figures["reviewer.sft.examples"] = int(sft["pack"]["examples"])
    figures["reviewer.sft.dropped"] = int(sft["pack"]["dropped"])
    figures["reviewer.sft.held_out_nll_before"] = float(sft["held_out_nll_before"])
    figures["reviewer.sft.held_out_nll_after"] = float(sft["held_out_nll_after"])
    from retrojax.model.checkpoint import save_pretrained

    policy_dir = save_pretrained(model, out / "policy")  # for `retrojax serve` / `--policy model:DIR`
    tokenizer.save(policy_dir)
    figures["reviewer.policy"] = str(policy_dir)
    log(f"[bench reviewer] SFT {sft['steps']} steps, held-out NLL {sft['held_out_nll_before']:.3f} → "
        f"{sft['held_out_nll_after']:.3f}, {sft['pack']['dropped']} sequences dropped, "
        f"{figures['reviewer.sft_s']:.0f}s")
    return model, tokenizer, figures


def evaluate(cfg: Any, model: Any, tokenizer: Any, sizes: Sizes, log: Callable[[str], None]) -> dict:
    """The trained policy in every role on the held-out levels: the variants as one paired batch."""
    from retrojax.agent.env_api import make_env
    from retrojax.agent.policies import ModelPolicy
    from retrojax.agent.rir.policies import RIRModelPolicy
    from retrojax.agent.rir.runner import run_rir
    from retrojax.eval.rir.metrics import summarize

    env = make_env(cfg, f"{cfg.env.split}:test")
    inner = ModelPolicy.from_config(cfg, model, tokenizer)
    policy = OracleCheck(RIRModelPolicy(inner, cfg.rir.aux_temperature))
    t0 = time.perf_counter()
    try:
        levels = range(min(sizes.levels, env.num_tasks))
        # groups of one variant each (the largest divisor of a variant's trials within the sampler's rows),
        # so each group's wall time is one variant's
        per_variant = len(levels) * sizes.seeds
        rows = min(per_variant, cfg.sampler.inflight_rows() or per_variant)
        group = max(d for d in range(1, rows + 1) if per_variant % d == 0)
        batch = run_rir(cfg, policy, task_ids=levels, seeds=range(sizes.seeds), trials_per_task=1,
                        protocols=list(sizes.protocols), env=env, batch_size=group)
    finally:
        env.close()
    figures: dict[str, Any] = {"reviewer.eval_s": time.perf_counter() - t0,
                               "reviewer.levels": len(levels), "reviewer.seeds": sizes.seeds}
    results = summarize(batch.records)
    roles = AUX + (BASELINE_AUX if any(p in BASELINES for p in sizes.protocols) else ())
    calls = {r: sum(res["aux_calls_by_role_total"][r] for res in results.values()) for r in roles}
    failed = {r: sum(res["parse_failures_by_role"][r] for res in results.values()) for r in roles}
    for r in roles:
        figures[f"reviewer.parse.{r}"] = 1.0 - failed[r] / calls[r] if calls[r] else 0.0
        figures[f"reviewer.calls.{r}"] = int(calls[r])
    for r in AUX:
        if policy.problems[r]:
            figures[f"reviewer.problems.{r}"] = policy.problem_summary(r)
    fallbacks = sum(res["verdict_fallbacks_total"] for res in results.values())
    figures["reviewer.verdict_read"] = 1.0 - fallbacks / calls["review"] if calls["review"] else 0.0
    rir = [r for r in batch.records if r.protocol == "RIR"]
    figures["reviewer.rollbacks_per_trial"] = float(np.mean([r.rollbacks for r in rir])) if rir else 0.0
    figures["reviewer.reviews_per_trial"] = float(np.mean([r.reviews for r in rir])) if rir else 0.0
    for name, res in results.items():
        key = name.replace("RIR/", "")
        figures[f"reviewer.success.{key}"] = float(res["success"])
        figures[f"reviewer.success.{key}.ci95_lo"], figures[f"reviewer.success.{key}.ci95_hi"] = res["ci95"]
        figures[f"reviewer.invalid_per_trial.{key}"] = float(res["invalid_turns"])
        figures[f"reviewer.aux_calls_per_trial.{key}"] = float(res["aux_calls"])
        figures[f"reviewer.rollbacks_per_trial.{key}"] = float(res["rollbacks"])
    for other in sizes.protocols:
        if other == "RIR":
            continue
        key = "rir_minus_" + other.replace("RIR/", "")
        m, lo, hi, _ = clustered_difference(_outcomes(batch.records, "RIR"), _outcomes(batch.records, other))
        figures[f"reviewer.{key}"], figures[f"reviewer.{key}.ci95_lo"], figures[f"reviewer.{key}.ci95_hi"] = (
            m, lo, hi)
    agree = [o == m for o, m in policy.reviews if m is not None]
    figures["reviewer.review_agreement"] = float(np.mean(agree)) if agree else 0.0
    hits = []
    by_trial = {r.trial: r for r in rir}
    for trial, oracle in policy.fine.items():
        rec = by_trial.get(trial)
        if rec is None:
            continue
        hits += [res["r"] == o for res, o in zip(rec.restores, oracle, strict=False)]
    figures["reviewer.restore_precision"] = float(np.mean(hits)) if hits else 0.0
    figures["reviewer.restores"] = len(hits)
    tokens: dict[str, list[int]] = defaultdict(list)
    per_trial: dict[int, int] = defaultdict(int)
    for c in batch.archive.calls:
        per_trial[c.trial] += len(c.prompt_ids) + len(c.output_ids)
    for rec in batch.records:
        tokens[rec.protocol].append(per_trial[rec.trial])
    for name, xs in tokens.items():
        figures[f"reviewer.tokens_per_trial.{name.replace('RIR/', '')}"] = float(np.mean(xs))
    # wall time per trial of each variant: the batch runs in groups of one protocol each (specs are ordered
    # by protocol), so a group's seconds are its protocol's
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for g in batch.groups:
        if len(g["protocols"]) == 1:
            spent[g["protocols"][0]][0] += g["seconds"]
            spent[g["protocols"][0]][1] += g["trials"]
    for name, (sec, n) in spent.items():
        figures[f"reviewer.seconds_per_trial.{name.replace('RIR/', '')}"] = sec / n
    log(f"[bench reviewer] {len(batch.records)} trials in {figures['reviewer.eval_s']:.0f}s")
    return figures


def rir_vs_react(cfg: Any, model: Any, tokenizer: Any, levels: int, seeds: int = 1) -> dict[str, float]:
    """RIR and ReAct with ``model`` in every role on the first ``levels`` held-out levels (one paired
    batch): success of each, RIR − ReAct with its level-clustered interval, RIR's rollbacks and review
    parse rate; ``_runs`` holds RIR − ReAct per (seed, level, replicate) for differences between runs."""
    from retrojax.agent.env_api import make_env
    from retrojax.agent.policies import ModelPolicy
    from retrojax.agent.rir.policies import RIRModelPolicy
    from retrojax.agent.rir.runner import run_rir

    env = make_env(cfg, f"{cfg.env.split.split(':')[0]}:test")
    try:
        policy = RIRModelPolicy(ModelPolicy.from_config(cfg, model, tokenizer), cfg.rir.aux_temperature)
        batch = run_rir(cfg, policy, task_ids=range(min(levels, env.num_tasks)), seeds=range(seeds),
                        trials_per_task=1, protocols=["RIR/react", "RIR"], env=env)
    finally:
        env.close()
    rir, react = _outcomes(batch.records, "RIR"), _outcomes(batch.records, "RIR/react")
    m, lo, hi, _ = clustered_difference(rir, react)
    recs = [r for r in batch.records if r.protocol == "RIR"]
    reviews = sum(r.aux_by_role["review"] for r in recs)
    unread = sum(r.parse_problems_by_role["review"] for r in recs)
    return {"success.RIR": float(np.mean(list(rir.values()))),
            "success.react": float(np.mean(list(react.values()))),
            "rir_minus_react": m, "rir_minus_react.ci95_lo": lo, "rir_minus_react.ci95_hi": hi,
            "rollbacks_per_trial": float(np.mean([r.rollbacks for r in recs])),
            "parse.review": 1.0 - unread / reviews if reviews else 0.0,
            "_runs": {k: rir[k] - react[k] for k in rir.keys() & react.keys()}}


def _checker(arm: str, cfg: Any, tokenizer: Any, sizes: Sizes, curve: list[dict],
             log: Callable[[str], None]) -> Callable[[Any, int], dict]:
    """The learner's ``evaluate`` for one arm: RIR vs ReAct on the held-out levels, kept in ``curve``."""

    def check(model: Any, iteration: int) -> dict:
        found = rir_vs_react(cfg, model, tokenizer, sizes.levels, sizes.seeds)
        curve.append({"update": iteration, **found})
        log(f"[bench reviewer] {arm} update {iteration}: RIR − ReAct {found['rir_minus_react']:+.3f} "
            f"[{found['rir_minus_react.ci95_lo']:+.3f}, {found['rir_minus_react.ci95_hi']:+.3f}]")
        return {k: v for k, v in found.items() if not k.startswith("_")}

    return check


def credit_arms(cfg: Any, policy_dir: Path, tokenizer: Any, sizes: Sizes, updates: int, out: Path,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Reviewer credit (:mod:`retrojax.learn.rir_credit`) against its control from the same trained start:
    ``updates`` learner updates on RIR trials of the training levels with ``learn.lambda_ref`` (the credit
    arm) and with 0 (the agent's outcome term only), RIR vs ReAct on the held-out levels every
    ``updates // 2`` updates and at the end; the difference of the arms' RIR − ReAct, paired by level."""
    import jax.numpy as jnp

    from retrojax import config as config_lib
    from retrojax.learn.rir_credit import RIRCollect
    from retrojax.learn.trainer import Trainer
    from retrojax.model.checkpoint import from_pretrained

    figures: dict[str, Any] = {}
    lam = float(cfg.learn.lambda_ref) or 1.0
    final: dict[str, dict] = {}
    for arm, lam_arm in (("credit", lam), ("control", 0.0)):
        learn = {"lambda_ref": lam_arm, "updates": updates, "train_tasks": None, "checkpoint_every": updates}
        arm_cfg = config_lib.replace(cfg, learn=learn, eval={"every": max(1, updates // 2)},
                                     run={"out_dir": str(out / arm)})
        model = from_pretrained(str(policy_dir), dtype=jnp.dtype(cfg.model.dtype))  # the same start
        curve: list[dict] = []
        collect = RIRCollect(arm_cfg, tokenizer)
        t0 = time.perf_counter()
        try:
            trainer = Trainer(arm_cfg, model, tokenizer, collect=collect, credit=collect.credit,
                              evaluate=_checker(arm, arm_cfg, tokenizer, sizes, curve, log),
                              tensorboard=False, progress=False)
            history = trainer.fit()
        finally:
            collect.close()
        key = f"reviewer.credit.{arm}"
        figures[f"{key}.s"] = time.perf_counter() - t0
        figures[f"{key}.lambda_ref"] = lam_arm
        figures[f"{key}.train_success_first"] = float(history[0].get("rollout/success", 0.0))
        figures[f"{key}.train_success_last"] = float(history[-1].get("rollout/success", 0.0))
        figures[f"{key}.recoveries_credited"] = float(sum(h.get("credit/recoveries", 0.0) for h in history))
        for point in curve:
            for k, v in point.items():
                if k not in ("update", "_runs"):
                    figures[f"{key}.at_{point['update']}.{k}"] = v
        final[arm] = curve[-1]
        for k, v in curve[-1].items():
            if k not in ("update", "_runs"):
                figures[f"{key}.{k}"] = v
    m, lo, hi, _ = clustered_difference(final["credit"]["_runs"], final["control"]["_runs"])
    figures["reviewer.credit.gain_over_control"] = m
    figures["reviewer.credit.gain_over_control.ci95_lo"] = lo
    figures["reviewer.credit.gain_over_control.ci95_hi"] = hi
    figures["reviewer.credit.updates"] = updates
    return figures


def run(quick: bool = False, log: Callable[[str], None] = print, config: str = "configs/rir_reviewer.yaml",
        overrides: Sequence[str] = (), sizes: Sizes | None = None, baselines: bool = False,
        credit: int = 0) -> dict[str, Any]:
    """Train the policy and evaluate it; returns the figures (see the module docstring)."""
    from retrojax import config as config_lib

    sizes = sizes or Sizes(quick, baselines)
    out = Path(tempfile.mkdtemp(prefix="retrojax-bench-reviewer-"))
    cfg = config_lib.load(config, [*(QUICK if quick else []), *overrides, f"run.out_dir={out}"])
    t0 = time.perf_counter()
    model, tokenizer, figures = train_policy(cfg, sizes, out, log)
    figures.update(evaluate(cfg, model, tokenizer, sizes, log))
    figures["reviewer.wall_s"] = time.perf_counter() - t0  # the trained policy and its evaluation
    if credit > 0:
        figures.update(credit_arms(cfg, Path(figures["reviewer.policy"]), tokenizer, sizes, credit, out, log))
    for protocol, n in sizes.episodes.items():
        figures[f"reviewer.demo_episodes.{protocol.replace('RIR/', '')}"] = int(n)
    figures["reviewer.protocols"] = ",".join(sizes.protocols)
    return figures


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench reviewer``."""
    from retrojax.bench import print_figures, write_figures
    from retrojax.config import ConfigError

    try:
        figures = run(quick=bool(args.quick), log=lambda line: print(line, file=sys.stderr),
                      overrides=list(getattr(args, "overrides", None) or []),
                      baselines=bool(getattr(args, "baselines", False)),
                      credit=int(getattr(args, "credit", 0) or 0))
    except (ConfigError, ValueError) as e:
        print(f"retrojax bench reviewer: {e}", file=sys.stderr)
        return 2
    print_figures(figures)
    write_figures(figures, args.json)
    return 0
