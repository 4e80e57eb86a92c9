"""Batched RIR runs: every live trial makes one call per tick (agent or auxiliary), world steps and rewinds
are batched over all trials, exactly as ReTRAIL's runner does for its trials (same ``TrialEnv`` worlds).

Paired batches: all variants, seeds and tasks run together in one batch; scripted policies draw their
randomness per (seed, task, replicate, role), so variants share their random draws until their paths
differ. :func:`run_rir` is the entry point the eval and the report use.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

from retrojax.agent.archive import Archive
from retrojax.agent.chat import ByteChatTokenizer, ChatTokenizer, wrap_tokenizer
from retrojax.agent.env_api import TrialEnv, make_env
from retrojax.agent.rir.baselines import trial_class
from retrojax.agent.rir.controller import RIRRecord, RIRTrial
from retrojax.agent.rir.settings import Settings
from retrojax.agent.rir.variants import parse_variant
from retrojax.agent.runner import ask, checked_task_ids
from retrojax.agent.trial import TrialSpec


@dataclasses.dataclass
class RIRBatch:
    archive: Archive  # every call (agent and auxiliary, each with its role)
    records: list[RIRRecord]
    trials: list[RIRTrial]
    # one entry per consecutive group of specs run together: protocols, trials, wall seconds
    groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class RIRRunner:
    def __init__(
        self,
        cfg: Any,
        env: TrialEnv,
        policy: Any,
        *,
        settings: Settings | None = None,
        tokenizer: Any = None,
        record_tokens: bool = True,
    ):
        self.cfg, self.env, self.policy = cfg, env, policy
        self.base = settings if settings is not None else Settings.from_config(cfg)
        tok: ChatTokenizer | None = getattr(policy, "tokenizer", None)
        if tok is None and record_tokens:
            tok = wrap_tokenizer(tokenizer) if tokenizer is not None else ByteChatTokenizer()
        self.tokenizer = tok
        self.render = tok is not None or bool(getattr(policy, "needs_text", False))
        self.action_style = getattr(env, "action_style", "tag")
        trial_cfg = getattr(cfg, "trial", None)
        self.prompt_style = str(getattr(trial_cfg, "prompt_style", "full"))  # the agent's prompts
        self.ticks = 0
        self._opened: tuple[int, int] | None = None

    def run(self, specs: Sequence[TrialSpec]) -> RIRBatch:
        if not specs:
            return RIRBatch(Archive(), [], [])
        variants = {s.protocol: parse_variant(s.protocol) for s in specs}
        settings = {name: self.base.for_variant(v) for name, v in variants.items()}
        n = len(specs)
        shape = (n, max(s.agent_budget for s in settings.values()) + 1)
        if self._opened != shape:
            self.env.open(*shape)
            self._opened = shape
        slots = list(range(n))
        trials = [
            trial_class(variants[spec.protocol])(
                spec,
                slot,
                self.env,
                variants[spec.protocol],
                settings[spec.protocol],
                self.tokenizer,
                self.render,
                self.action_style,
                self.prompt_style,
            )
            for spec, slot in zip(specs, slots, strict=True)
        ]
        infos = self.env.reset(slots, [s.task for s in specs])
        obs = self.env.observations(slots)
        for t, info, o in zip(trials, infos, obs, strict=True):
            t.start(info, o)
        self.policy.begin(specs, slots, self.env)
        try:
            live = [t for t in trials if not t.done]
            while live:
                self._tick(live)
                live = [t for t in live if not t.done]
        finally:
            self.policy.end()
        archive = Archive()
        for t in trials:
            archive.calls.extend(t.calls)
        return RIRBatch(archive, [t.record for t in trials], trials)

    def _tick(self, live: list[RIRTrial]) -> None:
        requests = [t.request() for t in live]
        gens = ask(self.policy, requests)
        ops = []
        for t, g in zip(live, gens, strict=True):
            op = t.on_output(g)
            if op is not None:
                ops.append((t, op))
        while ops:  # a world operation may ask for more before the next call (a search replaying its way)
            self._world(ops)
            ops = [(t, op) for t, _ in ops if (op := t.take_op()) is not None]
        self.ticks += 1

    def _world(self, ops: list[tuple[RIRTrial, Any]]) -> None:
        """One batched round of world operations: every step together, then every rewind together."""
        steps = [(t, op) for t, op in ops if op.kind == "step"]
        rewinds = [(t, op) for t, op in ops if op.kind != "step"]
        if steps:
            slots = [t.slot for t, _ in steps]
            infos = self.env.step(slots, [op.action for _, op in steps])
            obs = self.env.observations(slots)
            for (t, _), info, o in zip(steps, infos, obs, strict=True):
                t.on_step(info, o)
        if rewinds:
            self.env.rewind([t.slot for t, _ in rewinds], [op.target for _, op in rewinds])
            slots = [t.slot for t, _ in rewinds]
            key_of = getattr(self.env, "state_key", None)
            obs = [None] * len(slots) if callable(key_of) else self.env.observations(slots)
            for (t, _), o in zip(rewinds, obs, strict=True):
                t.on_rewound(key_of(t.slot) if callable(key_of) else None, o)


def make_specs(
    task_ids: Iterable[int],
    seeds: Iterable[int],
    trials_per_task: int,
    protocols: Sequence[str],
    first_trial: int = 0,
) -> list[TrialSpec]:
    """Specs ordered by seed, protocol, task, replicate (protocol names canonicalized)."""
    if trials_per_task < 1:
        raise ValueError(f"trials_per_task must be at least 1, got {trials_per_task}")
    tasks, out, tid = list(task_ids), [], first_trial
    for seed in seeds:
        for proto in protocols:
            name = parse_variant(proto).name
            for task in tasks:
                for b in range(trials_per_task):
                    out.append(
                        TrialSpec(trial=tid, task=int(task), seed=int(seed), replicate=b, protocol=name)
                    )
                    tid += 1
    return out


def run_rir(
    cfg: Any,
    policy: Any,
    task_ids: Iterable[int] | None = None,
    seeds: Iterable[int] = (0,),
    trials_per_task: int | None = None,
    protocols: Sequence[str] = ("RIR",),
    *,
    env: TrialEnv | None = None,
    split: str | None = None,
    tokenizer: Any = None,
    record_tokens: bool = False,
    settings: Settings | None = None,
    batch_size: int | None = None,
) -> RIRBatch:
    """Run RIR variants in paired batches and return every call and record. Specs (ordered by seed,
    protocol, task, replicate) run in consecutive groups of ``batch_size`` trials (default
    ``sampler.max_inflight``; 0 = all at once), which bounds a model policy's sampler rows and memory; each
    group's protocols and wall time are in ``groups`` (a group of one protocol times that protocol)."""
    own = env is None
    env = make_env(cfg, split) if env is None else env
    try:
        tasks = checked_task_ids(env, task_ids)
        b = cfg.trial.trials_per_task if trials_per_task is None else trials_per_task
        specs = make_specs(tasks, list(seeds), b, list(protocols))
        runner = RIRRunner(
            cfg, env, policy, settings=settings, tokenizer=tokenizer, record_tokens=record_tokens
        )
        if batch_size is None:
            batch_size = cfg.sampler.inflight_rows()
        size = batch_size if batch_size > 0 else max(1, len(specs))
        out = RIRBatch(Archive(), [], [])
        for i in range(0, len(specs), size):
            group = specs[i : i + size]
            start = time.perf_counter()
            part = runner.run(group)
            seconds = time.perf_counter() - start
            out.archive.extend(part.archive)
            out.records.extend(part.records)
            out.trials.extend(part.trials)
            protocols_in = sorted({x.protocol for x in group})
            out.groups.append({"protocols": protocols_in, "trials": len(group), "seconds": seconds})
    finally:
        if own:
            env.close()
    return out
