"""The batched trial runner: all live trials advance together, one model call each per tick.

A tick: gather every live trial's pending request (execution or reflection), make one batched policy call,
parse all outputs, apply all world steps as one batched ``env.step`` and all rewinds as one batched
``env.rewind``, and repeat until every trial has ended (each tick uses one call of every live trial, so
a batch ends within ``max_calls`` ticks).

Tokens: with ``record_tokens`` (the default) every call's exact input ids and output ids go to the
archive. The tokenizer is the policy's (``ModelPolicy``), else the one given, else a byte-level fallback
(``chat.ByteChatTokenizer``), so scripted runs also give complete archives. Evaluation turns recording
off: then scripted policies run without rendering prompts at all.

``record_best`` (RL collection turns it on): in a world that lists its best actions
(``TrialEnv.lists_best_actions``, Sokoban) each execution call records them (``CallRecord.best_actions``), so
the learner's diagnostics can say whether the advantages favour the moves that start a shortest solution.

The simple entry point is :func:`run_trials`::

    archive, metrics = run_trials(cfg, OraclePolicy(0.3), task_ids=range(16), seeds=[0, 1],
                                  trials_per_task=8, protocols=["P@1", "T@1", "T@3"])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from retrojax.agent.archive import EXECUTION, Archive
from retrojax.agent.chat import ByteChatTokenizer, ChatTokenizer, wrap_tokenizer
from retrojax.agent.env_api import TrialEnv, make_env
from retrojax.agent.policies import Policy
from retrojax.agent.prompts import get_prompts
from retrojax.agent.trial import Generation, Limits, Request, Trial, TrialSpec, parse_protocol


class Runner:
    """Runs batches of trials of one world with one policy (see the module docstring)."""

    def __init__(self, cfg: Any, env: TrialEnv, policy: Policy, *, tokenizer: Any = None,
                 record_tokens: bool = True, prompt_style: str | None = None,
                 max_inflight: int | None = None, record_best: bool = False):
        self.cfg, self.env, self.policy = cfg, env, policy
        self.record_best = bool(record_best) and bool(getattr(env, "lists_best_actions", False))
        limit = cfg.sampler.inflight_rows() if max_inflight is None else max_inflight
        if limit < 0:
            raise ValueError(f"max_inflight must be >= 0 (0 = all at once), got {limit}")
        self.max_inflight = int(limit)
        self.limits = Limits.from_config(cfg)
        tok: ChatTokenizer | None = policy.tokenizer
        if tok is None and record_tokens:
            tok = wrap_tokenizer(tokenizer) if tokenizer is not None else ByteChatTokenizer()
        self.tokenizer = tok
        style = prompt_style or cfg.trial.prompt_style
        render = tok is not None or policy.needs_text
        self.prompts = get_prompts(env.prompt_key, style) if render else None
        self.action_style = getattr(env, "action_style", "tag")
        self.ticks = 0
        self._opened: tuple[int, int] | None = None

    def run(self, specs: Sequence[TrialSpec]) -> Archive:
        """Run ``specs`` to the end; returns their archive (records in the order of ``specs``).

        At most ``max_inflight`` trials are live at once (0: all of them); each one holds an env slot and
        a policy slot (a model's KV-cache row). When a trial ends its slot is released and the next
        queued spec starts there (continuous batching). Per-trial randomness is keyed by the spec, so the
        records do not depend on the slot or on which trials share a tick.
        """
        if not specs:
            return Archive()
        for s in specs:
            parse_protocol(s.protocol)
        n = len(specs)
        width = n if self.max_inflight <= 0 else min(n, self.max_inflight)
        shape = (width, self.limits.path_capacity())
        if self._opened != shape:
            self.env.open(*shape)
            self._opened = shape
        trials: list[Trial | None] = [None] * n
        active: dict[int, int] = {}  # slot -> index into specs
        free = list(range(width))
        queued = 0
        begun = False
        try:
            while True:
                for slot in [s for s, i in active.items() if trials[i].done]:
                    release = getattr(self.policy, "release", None)  # optional for duck-typed policies
                    if release is not None:
                        release(specs[active[slot]], slot)
                    del active[slot]
                    free.append(slot)
                if free and queued < n:
                    free.sort()
                    take = min(len(free), n - queued)
                    slots, free = free[:take], free[take:]
                    idx = list(range(queued, queued + take))
                    queued += take
                    self._start(specs, trials, idx, slots)
                    if begun:
                        if not hasattr(self.policy, "assign"):
                            raise TypeError(f"{type(self.policy).__name__} has no assign(spec, slot): it "
                                            "cannot run with max_inflight below the batch size")
                        for i, slot in zip(idx, slots, strict=True):
                            self.policy.assign(specs[i], slot)
                    else:
                        self.policy.begin([specs[i] for i in idx], slots, self.env)
                        begun = True
                    active.update(zip(slots, idx, strict=True))
                    continue  # a trial may end at its start
                if not active:
                    break
                self._tick([trials[i] for i in sorted(active.values())])
        finally:
            if begun:
                self.policy.end()
        return _collect([t for t in trials if t is not None])

    def _start(self, specs: Sequence[TrialSpec], trials: list[Trial | None], idx: list[int],
               slots: list[int]) -> None:
        """Reset ``slots`` of the env to the tasks of ``specs[idx]`` and start those trials there."""
        new = [Trial(specs[i], slot, self.env, self.limits, self.prompts, self.tokenizer, self.action_style)
               for i, slot in zip(idx, slots, strict=True)]
        infos = self.env.reset(slots, [specs[i].task for i in idx])
        obs = self.env.observations(slots) if self.prompts is not None else [""] * len(slots)
        for i, t, info, o in zip(idx, new, infos, obs, strict=True):
            t.start(info, o)
            trials[i] = t

    def _tick(self, live: list[Trial]) -> None:
        auto = [(t, op) for t in live if (op := t.auto_op()) is not None]  # rewinds without a model call
        if auto:
            self.env.rewind([t.slot for t, _ in auto], [op.target for _, op in auto])
            for t, _ in auto:
                t.on_rewound()
        requests = [t.request() for t in live]
        best = self._best_actions(requests)
        gens = ask(self.policy, requests)
        steps, rewinds = [], []
        for t, g in zip(live, gens, strict=True):
            n_calls = len(t.calls)
            op = t.on_output(g)
            if t.slot in best and len(t.calls) > n_calls:
                t.calls[-1].best_actions = best[t.slot]
            if op is None:
                continue
            (steps if op.kind == "step" else rewinds).append((t, op))
        if steps:
            slots = [t.slot for t, _ in steps]
            infos = self.env.step(slots, [op.action for _, op in steps])
            obs = self.env.observations(slots) if self.prompts is not None else [""] * len(slots)
            for (t, _), info, o in zip(steps, infos, obs, strict=True):
                t.on_step(info, o)
        if rewinds:
            self.env.rewind([t.slot for t, _ in rewinds], [op.target for _, op in rewinds])
            for t, _ in rewinds:
                t.on_rewound()
        self.ticks += 1

    def _best_actions(self, requests: Sequence[Request]) -> dict[int, list[str]]:
        """slot → the world's best actions, for the execution requests (only with ``record_best``)."""
        if not self.record_best:
            return {}
        slots = [r.slot for r in requests if r.role == EXECUTION]
        return dict(zip(slots, self.env.optimal_actions(slots), strict=True)) if slots else {}


def _collect(trials: Sequence[Trial]) -> Archive:
    out = Archive()
    for t in trials:
        out.calls.extend(t.calls)
        out.segments.extend(t.segments)
        out.recoveries.extend(t.recoveries)
        out.trials.append(t.record)
    return out


def ask(policy: Policy, requests: list[Request]) -> list[Generation]:
    """One batched ``policy.generate``; a policy that answers a different number of requests is a bug."""
    gens = policy.generate(requests)
    if len(gens) != len(requests):
        raise RuntimeError(f"policy returned {len(gens)} replies for {len(requests)} requests")
    return gens


def checked_task_ids(env: TrialEnv, task_ids: Iterable[int] | None) -> list[int]:
    """Every task of ``env`` when ``task_ids`` is None, else ``task_ids`` checked against its range."""
    tasks = list(range(env.num_tasks)) if task_ids is None else [int(t) for t in task_ids]
    bad = [t for t in tasks if not 0 <= t < env.num_tasks]
    if bad:
        raise ValueError(f"task ids {bad[:5]} outside [0, {env.num_tasks})")
    return tasks


def make_specs(task_ids: Iterable[int], seeds: Iterable[int], trials_per_task: int,
               protocols: Sequence[str], first_trial: int = 0) -> list[TrialSpec]:
    """Trial specs ordered by seed, protocol, task, replicate; trial ids count up from ``first_trial``."""
    if trials_per_task < 1:
        raise ValueError(f"trials_per_task must be at least 1, got {trials_per_task}")
    tasks = list(task_ids)
    specs = []
    tid = first_trial
    for seed in seeds:
        for proto in protocols:
            name = parse_protocol(proto).name
            for task in tasks:
                for b in range(trials_per_task):
                    specs.append(TrialSpec(trial=tid, task=int(task), seed=int(seed), replicate=b,
                                           protocol=name))
                    tid += 1
    return specs


def run_trials(cfg: Any, policy: Policy, task_ids: Iterable[int] | None = None, seeds: Iterable[int] = (0,),
               trials_per_task: int | None = None, protocols: Sequence[str] | None = None, *,
               env: TrialEnv | None = None, split: str | None = None, tokenizer: Any = None,
               record_tokens: bool = True, batch_size: int = 8192,
               record_best: bool = False) -> tuple[Archive, dict[str, Any]]:
    """Run trials and return ``(archive, metrics)``.

    ``task_ids`` default to every task of the split; ``trials_per_task`` to ``cfg.trial.trials_per_task``;
    ``protocols`` to ``[cfg.trial.protocol]``. The world is ``env`` or ``make_env(cfg, split)``. Trials
    run in batches of at most ``batch_size`` (a batch keeps whole task groups together when it can).
    ``metrics`` is :func:`retrojax.eval.metrics.summarize` of the trial records. ``record_best``: see the
    module docstring.
    """
    from retrojax.eval.metrics import summarize

    own_env = env is None
    env = make_env(cfg, split) if env is None else env
    try:
        tasks = checked_task_ids(env, task_ids)
        b = cfg.trial.trials_per_task if trials_per_task is None else trials_per_task
        specs = make_specs(tasks, list(seeds), b, list(protocols or [cfg.trial.protocol]))
        runner = Runner(cfg, env, policy, tokenizer=tokenizer, record_tokens=record_tokens,
                        record_best=record_best)
        size = max(b, (batch_size // b) * b)
        archive = Archive()
        for i in range(0, len(specs), size):
            archive.extend(runner.run(specs[i : i + size]))
    finally:
        if own_env:
            env.close()
    return archive, summarize(archive.trials)
