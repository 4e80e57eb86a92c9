"""The trainer's default wiring to the agent runner: collect trials, evaluate on the test split.

``RunnerCollect`` runs the training split's trials through :class:`~retrojax.agent.runner.Runner` with a
``ModelPolicy``; ``default_evaluate`` runs ``cfg.eval``'s protocols on the test split. Both return flat
``a/b/c`` metric dicts of numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from retrojax.agent.archive import Archive
from retrojax.programs import Bound


def is_number(v: Any) -> bool:
    """A plain int/float (numpy included), not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)




def train_split_size(cfg: Any) -> int:
    """Number of tasks in the training split of ``cfg.env`` (capped by ``env.num_tasks``)."""
    from retrojax.agent.env_api import make_env

    env = make_env(cfg, _split(cfg, "train"))
    try:
        return int(env.num_tasks)
    finally:
        env.close()


def _split(cfg: Any, part: str) -> str:
    return f"{cfg.env.split.split(':')[0]}:{part}"


def held_out_part(cfg: Any) -> str:
    """The part periodic evaluation reads: the one ``env.split`` names when it is not ``train`` (``:val``
    while a recipe is tuned), else ``test``. Training always plays ``:train``."""
    _, sep, part = cfg.env.split.partition(":")
    return part if sep and part != "train" else "test"


class RunnerCollect:
    """The default ``collect``: trials of the training split through the agent runner with a ``ModelPolicy``.

    The world and the policy's sampler are built once and reused; each call points the policy at the new
    weights and restarts its sampling key from ``seed``.
    """

    def __init__(self, cfg: Any, tokenizer: Any):
        from retrojax.agent.env_api import make_env

        self.cfg, self.tokenizer = cfg, tokenizer
        self.env = make_env(cfg, _split(cfg, "train"))
        self.policy: Any = None
        self.runner: Any = None

    def __call__(self, model: Any, tasks: Sequence[int], seeds: Sequence[int]) -> tuple[Archive, dict]:
        from retrojax.agent.policies import ModelPolicy
        from retrojax.agent.runner import Runner
        from retrojax.agent.trial import TrialSpec
        from retrojax.eval.metrics import summarize

        if len(tasks) != len(seeds):
            raise ValueError(f"collect needs one seed per task, got {len(tasks)} tasks, {len(seeds)} seeds")
        if self.policy is None:
            self.policy = ModelPolicy.from_config(self.cfg, model, self.tokenizer)
            self.runner = Runner(self.cfg, self.env, self.policy, record_best=True)
        else:
            self.policy.model = model
            if self.policy.sampler is not None:
                self.policy.sampler.update_model(model)
        self.policy.seed, self.policy.ticks = int(seeds[0]) if seeds else 0, 0
        b = self.cfg.trial.trials_per_task
        specs = [TrialSpec(trial=i * b + r, task=int(task), seed=int(seed), replicate=r,
                           protocol=self.cfg.trial.protocol)
                 for i, (task, seed) in enumerate(zip(tasks, seeds, strict=True)) for r in range(b)]
        archive = self.runner.run(specs)
        return archive, _flatten(summarize(archive.trials))

    def release(self) -> None:
        """Drop the policy's weights and its sampler's (the learner update that follows replaces them and
        should not hold them beside its own); the next call brings the new ones."""
        if self.policy is not None:
            self.policy.model = None
            if self.policy.sampler is not None:
                self.policy.sampler.release_weights()

    def close(self) -> None:
        self.env.close()


def _flatten(d: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested report dict as ``a/b/c`` keys."""
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
    elif is_number(d) and "seed_success/" not in prefix:  # per-seed entries would vary run to run
        out[prefix[:-1]] = float(d)
    return out


def collect_width(cfg: Any, trials: int | None = None) -> int:
    """Sampler rows of a batch of ``trials`` trials (default: one update's, ``tasks_per_update`` ×
    ``trials_per_task``) through the runner: all of them, or ``sampler.max_inflight`` when set."""
    n = cfg.learn.tasks_per_update * cfg.trial.trials_per_task if trials is None else int(trials)
    limit = cfg.sampler.inflight_rows()
    return max(1, n if limit <= 0 else min(n, limit))


def eval_widths(cfg: Any, num_tasks: int) -> list[int]:
    """Sampler rows of the evaluation batches (``retrojax.eval.protocol.evaluate``): every (task, seed,
    protocol) trial of ``eval`` at once (or ``sampler.max_inflight``), the RIR protocols in a batch of
    their own."""
    from retrojax.agent.rir.variants import is_rir

    n = max(1, num_tasks if cfg.eval.num_tasks is None else min(num_tasks, cfg.eval.num_tasks))
    rir = sum(1 for p in cfg.eval.protocols if is_rir(p))
    plain = len(cfg.eval.protocols) - rir
    return [collect_width(cfg, n * cfg.eval.seeds * k) for k in (plain, rir) if k]


def sampler_bound(cfg: Any, model: Any, tokenizer: Any, widths: Sequence[int]) -> Bound:
    """The most programs ``ModelPolicy`` samplers of ``widths`` rows compile
    (``ModelPolicy.program_bounds``, summed over the distinct widths: each width is a sampler of its own).
    Upper bound: every (window, chunk bucket) pair and next-logits program is counted, used or not."""
    from retrojax.agent.policies import ModelPolicy

    policy = ModelPolicy.from_config(cfg, model, tokenizer)
    per = [policy.program_bounds(w) for w in sorted(set(widths))]
    return Bound(sum(sum(p.values()) for p in per), tuple(sorted({k for p in per for k in p})), exact=False,
                 why="every window × chunk bucket, used or not")


def default_collect(cfg: Any, tokenizer: Any) -> RunnerCollect:
    return RunnerCollect(cfg, tokenizer)


def default_evaluate(cfg: Any, tokenizer: Any) -> Callable[[Any, int], dict] | None:
    """Success per protocol of ``cfg.eval`` on the held-out part (``held_out_part``: ``:test`` unless
    ``env.split`` names another; ``eval.every < 0`` turns evaluation off)."""
    if cfg.eval.every < 0:
        return None

    def evaluate(model: Any, iteration: int) -> dict:
        from retrojax.agent.policies import ModelPolicy
        from retrojax.eval.protocol import evaluate as run_eval

        policy = ModelPolicy.from_config(cfg, model, tokenizer)
        split = _split(cfg, held_out_part(cfg))
        report = run_eval(cfg, policy, split, list(cfg.eval.protocols), cfg.eval.seeds,
                          tasks=cfg.eval.num_tasks)
        return {f"{name}/{k}": v for name, r in report["results"].items() for k, v in _flatten(r).items()}

    return evaluate
