"""Trials over a worker pool: the active path C_0..C_k of each trial, rewound by reset + replay.

The bridge keeps, per trial, the task, the retained action path a_1..a_k and the observation at each
checkpoint C_0..C_k. ``step`` appends a checkpoint when the engine accepted the action (an action the
engine rejects is an invalid turn: its message comes back, nothing is appended); ``rewind(j)`` has a
worker reset and replay a_1..a_j and checks that it sees the observation and the world state recorded
at C_j (in the world's canonical form: ScienceWorld lists objects in a per-reset order) — a mismatch
is a per-trial error, never a silent divergence. Every operation is batched over trials and runs in
parallel across the pool's workers. A trial that hit an error stays failed: its later calls answer
with the same error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from envs.textworlds.base import Observation
from envs.textworlds.pool import RESULT_CACHE_SIZE, Call, Reply, WorkerPool


@dataclasses.dataclass
class TrialRecord:
    """Host bookkeeping of one trial."""

    task: str
    worker: int
    actions: list[str] = dataclasses.field(default_factory=list)  # a_1..a_k on the active path
    checkpoints: list[Observation] = dataclasses.field(default_factory=list)  # C_0..C_k
    error: str | None = None
    error_kind: str | None = None
    restarts: int = 0
    replayed_actions: int = 0

    @property
    def k(self) -> int:
        return len(self.actions)

    @property
    def current(self) -> Observation:
        return self.checkpoints[-1]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The answer for one trial of a batched call; ``obs`` is None exactly when ``error`` is set."""

    trial: int
    obs: Observation | None
    k: int
    error: str | None = None
    value: Any = None  # admissible / expert / goal answers

    @property
    def ok(self) -> bool:
        return self.error is None


class TextWorldBridge:
    """Host-side text worlds for many trials at once (see the module docstring)."""

    def __init__(
        self,
        world: str,
        num_workers: int = 2,
        timeout_s: float = 30.0,
        world_kwargs: dict[str, Any] | None = None,
        pool: WorkerPool | None = None,
        result_cache: int = RESULT_CACHE_SIZE,
    ):
        self.pool = pool or WorkerPool(world, num_workers, timeout_s, world_kwargs, result_cache=result_cache)
        self.world = world
        self.trials: dict[int, TrialRecord] = {}
        self.prefetch_expert = False  # scripted experts: workers precompute the next expert action
        self._next_trial = 0
        self._load = [0] * self.pool.num_workers

    # --- bookkeeping -----------------------------------------------------------------------
    def record(self, trial: int) -> TrialRecord:
        if trial not in self.trials:
            raise KeyError(f"unknown trial id {trial}")
        return self.trials[trial]

    def path(self, trial: int) -> list[str]:
        return list(self.record(trial).actions)

    def release(self, trials: Sequence[int]) -> None:
        """Forget finished trials (frees their worker slot for balancing)."""
        for t in trials:
            rec = self.trials.pop(t, None)
            if rec is not None:
                self._load[rec.worker] -= 1

    def _call(
        self, rec: TrialRecord, op: str, action: str | None = None, j: int | None = None, adm: bool = False
    ) -> Call:
        k = rec.k if j is None else j
        return Call(
            op=op,
            task=rec.task,
            path=tuple(rec.actions[:k]),
            expected=rec.checkpoints[k].text,
            expected_key=rec.checkpoints[k].key or None,
            path_keys=tuple(cp.key for cp in rec.checkpoints[1 : k + 1]),
            action=action,
            admissible=adm,
            prefetch_expert=self.prefetch_expert and op in ("step", "restore"),
        )

    def _dispatch(self, items: list[tuple[int, Call | None]]) -> list[Reply | None]:
        """Run the calls of live trials; None entries (failed trials) stay None."""
        live = [(i, t, c) for i, (t, c) in enumerate(items) if c is not None]
        replies = self.pool.run([(self.trials[t].worker, c) for _, t, c in live])
        out: list[Reply | None] = [None] * len(items)
        for (i, t, _), reply in zip(live, replies, strict=True):
            rec = self.trials[t]
            rec.restarts += reply.restarts
            rec.replayed_actions += reply.replayed
            if not reply.ok:
                rec.error, rec.error_kind = reply.error, reply.kind
            out[i] = reply
        return out

    def _answers(self, items: list[tuple[int, Call | None]], args: Sequence[Any], usage: dict[int, str],
                 accept: Callable[[TrialRecord, Any, Observation], Observation]) -> list[Outcome]:
        """Dispatch ``items`` and turn each reply into an ``Outcome``: a usage error or a failed worker as
        such, else ``accept(record, arg, observation)`` updates the record and gives the observation."""
        out = []
        for i, ((t, _), arg, reply) in enumerate(zip(items, args, self._dispatch(items), strict=True)):
            rec = self.trials[t]
            if i in usage:
                out.append(Outcome(trial=t, obs=None, k=rec.k, error=usage[i]))
            elif reply is None or not reply.ok:
                out.append(self._failed(t))
            else:
                out.append(Outcome(trial=t, obs=accept(rec, arg, reply.value), k=rec.k))
        return out

    def _failed(self, trial: int) -> Outcome:
        rec = self.trials[trial]
        return Outcome(trial=trial, obs=None, k=rec.k, error=rec.error)

    # --- batched operations ------------------------------------------------------------------
    def reset(self, tasks: Sequence[str], admissible: bool = False) -> list[Outcome]:
        """Open one new trial per task at its initial state C_0 (``admissible``: attach them)."""
        ids = []
        for task in tasks:
            worker = min(range(len(self._load)), key=lambda w: self._load[w])
            self._load[worker] += 1
            tid = self._next_trial
            self._next_trial += 1
            self.trials[tid] = TrialRecord(task=task, worker=worker)
            ids.append(tid)
        replies = self._dispatch([(t, Call(op="reset", task=self.trials[t].task, admissible=admissible,
                                              prefetch_expert=self.prefetch_expert))
                                  for t in ids])
        out = []
        for t, reply in zip(ids, replies, strict=True):
            rec = self.trials[t]
            if reply is None or not reply.ok:
                out.append(self._failed(t))
                continue
            rec.checkpoints = [reply.value]
            out.append(Outcome(trial=t, obs=reply.value, k=0))
        return out

    def step(self, trials: Sequence[int], actions: Sequence[str], admissible: bool = False) -> list[Outcome]:
        """One action per trial; accepted actions push checkpoint C_{k+1}.

        Stepping a trial whose episode has ended is answered with an error and changes nothing.
        """
        if len(trials) != len(actions):
            raise ValueError(f"{len(trials)} trials but {len(actions)} actions")
        items: list[tuple[int, Call | None]] = []
        usage: dict[int, str] = {}
        for i, (t, a) in enumerate(zip(trials, actions, strict=True)):
            rec = self.record(t)
            if rec.error is None and rec.current.done:
                usage[i] = "step after the episode ended"
            skip = rec.error or i in usage
            call = None if skip else self._call(rec, "step", action=str(a), adm=admissible)
            items.append((t, call))

        def accept(rec: TrialRecord, a: str, obs: Observation) -> Observation:
            if obs.valid:
                rec.actions.append(str(a))
                rec.checkpoints.append(obs)
            return obs

        return self._answers(items, actions, usage, accept)

    def rewind(
        self, trials: Sequence[int], targets: Sequence[int], admissible: bool = False
    ) -> list[Outcome]:
        """Back to C_j (0 ≤ j ≤ k): reset + replay a_1..a_j, check the observation, truncate.

        A target outside 0..k is answered with an error and changes nothing.
        """
        if len(trials) != len(targets):
            raise ValueError(f"{len(trials)} trials but {len(targets)} targets")
        items: list[tuple[int, Call | None]] = []
        usage: dict[int, str] = {}
        for i, (t, j) in enumerate(zip(trials, targets, strict=True)):
            rec = self.record(t)
            if rec.error is None and not 0 <= int(j) <= rec.k:
                usage[i] = f"rewind target {j} outside 0..{rec.k}"
            call = None
            if rec.error is None and i not in usage:
                call = dataclasses.replace(self._call(rec, "restore", j=int(j), adm=admissible), fresh=True)
            items.append((t, call))

        def accept(rec: TrialRecord, j: int, restored: Observation) -> Observation:
            del rec.actions[int(j):]
            del rec.checkpoints[int(j) + 1:]
            if not admissible:
                return rec.current
            return dataclasses.replace(rec.current, admissible=restored.admissible)

        return self._answers(items, targets, usage, accept)

    def _query(self, trials: Sequence[int], op: str) -> list[Outcome]:
        items = [(t, None if self.record(t).error else self._call(self.record(t), op)) for t in trials]
        out = []
        for (t, _), reply in zip(items, self._dispatch(items), strict=True):
            rec = self.trials[t]
            if reply is None or not reply.ok:
                out.append(self._failed(t))
            else:
                out.append(Outcome(trial=t, obs=rec.current, k=rec.k, value=reply.value))
        return out

    def admissible(self, trials: Sequence[int]) -> list[Outcome]:
        """Admissible actions at each trial's current checkpoint (computed only when asked)."""
        return self._query(trials, "admissible")

    def candidates(self, trials: Sequence[int]) -> list[Outcome]:
        """Concrete actions a random player may choose from, per trial (``value``)."""
        return self._query(trials, "candidates")

    def expert(self, trials: Sequence[int]) -> list[Outcome]:
        """The expert's next action at each trial's current checkpoint (``value``; None if none)."""
        return self._query(trials, "expert")

    def goal(self, trials: Sequence[int]) -> list[Outcome]:
        return self._query(trials, "goal")

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> TextWorldBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
