"""The archive Γ: everything the learner needs from a batch of trials, in chronological order.

The trial loop appends records as they happen; the learner reads them (host-side numpy) to build
advantages and training sequences. Three record kinds:

- ``CallRecord``: one model call (execution or reflection) with its exact input and output token ids, the
  sampler's per-token log-probs, and the decision's bookkeeping (segment, checkpoint, state/history keys,
  environment reward δ, outcome flags).
- ``SegmentRecord``: one forward segment of a trial (from a start checkpoint until it ends by success,
  failure, a rewind, a budget, or the end of the trial) with its endpoint score S.
- ``RecoveryRecord``: one recovery (model-initiated or forced rewind) linking the reflection call, the
  abandoned suffix β (the active-path decisions from C_j to C_k) and the resumed segment, with the branch
  values V used by the reflection reward.

Everything is plain Python / numpy so an archive can be written as JSON lines (+ an ``.npz`` of token
arrays) and inspected.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

EXECUTION = "execution"
REFLECTION = "reflection"

# How a segment ended.
SEGMENT_END_REASONS = (
    "success",  # the task was solved on this segment
    "failure",  # irreversible failure (Sokoban dead state, MineSweeper mine, text world done-without-win)
    "rewind",  # the model asked to rewind (model-initiated recovery)
    "branch_budget",  # branch (task-solve) budget exhausted (or P@1's optional turn cap)
    "context",  # the conversation no longer fits the model's context
    "calls",  # the global call ceiling was reached
    "no_recovery",  # a recovery was due but not allowed (protocol, budgets, no valid target)
)


@dataclasses.dataclass
class CallRecord:
    """One model call.

    ``prompt_ids`` is the exact context the model saw (the whole conversation prefix, including the new
    user turn and the generation prefix); ``output_ids``/``logprobs`` are what it generated and the
    behaviour policy's log-probabilities of those tokens. For execution calls ``position`` is the decision's
    index t within its segment; ``reward`` is δ, the environment reward of the decision (sum over primitive
    moves; 0 for rewinds and invalid turns).
    """

    trial: int
    task: int
    call_index: int  # 0-based index among this trial's calls (execution and reflection)
    role: str  # EXECUTION | REFLECTION
    segment: int  # index m of the segment this call belongs to (reflections: the segment they close)
    position: int  # t within the segment (execution); -1 for reflections
    checkpoint: int  # k: index of the current checkpoint C_k when the call was made
    state_key: str  # hash of the environment state at the decision
    history_key: str  # hash of the logical retained history h (the retained path's actions, no memory)
    prompt_ids: np.ndarray  # int32 [P]
    output_ids: np.ndarray  # int32 [O]
    logprobs: np.ndarray  # float32 [O]
    output_text: str = ""
    finish_reason: str = "stop"  # stop | length (a cut-off reply: an invalid turn)
    prompt_tokens: int = 0  # tokens a served model reported for this call (0 for local models)
    completion_tokens: int = 0
    action: str = ""  # the parsed action as text ("up, left", "(2, 3)", "rewind to C_1", a command)
    valid: bool = True
    invalid_reason: str = ""
    is_rewind: bool = False
    rewind_target: int = -1
    reward: float = 0.0  # δ
    solved: bool = False
    failed: bool = False
    teach: bool = True  # a demonstration label to imitate (False: a scripted policy's deliberate random move)
    # the world's best next actions at the decision's state (every move that starts a shortest solution),
    # recorded by a runner with ``record_best`` in a world that lists them; None when not recorded
    best_actions: list[str] | None = None


@dataclasses.dataclass
class SegmentRecord:
    """A forward segment σ_m of a trial: decisions from its start checkpoint until it ended."""

    trial: int
    task: int
    index: int  # m
    start_checkpoint: int  # j the segment started from (0 for the first segment)
    calls: list[int]  # call_index of its execution decisions, in order
    end_reason: str = ""  # one of SEGMENT_END_REASONS
    end_checkpoint: int = 0  # k at the segment's end
    score: float = 0.0  # S: cumulative reward along the retained path from s_0 at the segment's end
    progress: float | None = None  # the world's task progress at its end (TrialEnv.endpoint_progress)


@dataclasses.dataclass
class RecoveryRecord:
    """One recovery: reflection on the abandoned branch, then restore to C_j and resume."""

    trial: int
    task: int
    index: int  # m: the segment that was abandoned
    trigger: str  # model | failure | branch_budget | truncated
    from_checkpoint: int  # k
    target: int  # j
    reflection_call: int  # call_index of the reflection call (-1 if none was made)
    remark: str  # the memory kept in context ("" if the reflection was empty)
    abandoned_calls: list[int]  # β: call_index of the active-path decisions from C_j to C_k
    resumed_segment: int  # index of the segment that starts at C_j (m + 1)
    v_abandoned: float | None = None  # V(β_m | s_j)
    v_resumed: float | None = None  # V(σ_{m+1} | s_j), filled when the resumed segment ends
    target_from_fallback: bool = False  # the reflection named no valid target


@dataclasses.dataclass
class TrialRecord:
    """Per-trial summary and metrics."""

    trial: int
    task: int
    seed: int
    protocol: str
    success: bool = False
    calls_execution: int = 0
    calls_reflection: int = 0
    invalid_turns: int = 0
    prompt_tokens: int = 0  # sums over the trial's calls of a served model's reported usage
    completion_tokens: int = 0
    rewinds_model: int = 0
    rewinds_forced: int = 0
    macro_attempts: int = 1
    distinct_states: int = 0
    actions_to_success: int | None = None
    end_reason: str = ""
    final_score: float = 0.0
    final_progress: float | None = None  # the world's task progress at the trial's end (endpoint_progress)
    d0: float | None = None  # progress scale of the task (e.g. Sokoban initial solver distance)


@dataclasses.dataclass
class Archive:
    """Γ for one batch of trials."""

    calls: list[CallRecord] = dataclasses.field(default_factory=list)
    segments: list[SegmentRecord] = dataclasses.field(default_factory=list)
    recoveries: list[RecoveryRecord] = dataclasses.field(default_factory=list)
    trials: list[TrialRecord] = dataclasses.field(default_factory=list)

    def extend(self, other: Archive) -> None:
        self.calls.extend(other.calls)
        self.segments.extend(other.segments)
        self.recoveries.extend(other.recoveries)
        self.trials.extend(other.trials)

    def calls_of(self, trial: int) -> list[CallRecord]:
        return [c for c in self.calls if c.trial == trial]

    def call(self, trial: int, call_index: int) -> CallRecord:
        for c in self.calls:
            if c.trial == trial and c.call_index == call_index:
                return c
        raise KeyError(f"no call {call_index} in trial {trial}")

    def tasks(self) -> list[int]:
        return sorted({t.task for t in self.trials} | {c.task for c in self.calls})

    # -- serialization -----------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write ``path`` (JSON lines, one record a line) and ``path.npz`` (token arrays per call)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {}
        with path.open("w") as f:
            for i, c in enumerate(self.calls):
                d = {k: v for k, v in dataclasses.asdict(c).items()
                     if k not in ("prompt_ids", "output_ids", "logprobs")}
                arrays[f"{i}.prompt_ids"] = np.asarray(c.prompt_ids, np.int32)
                arrays[f"{i}.output_ids"] = np.asarray(c.output_ids, np.int32)
                arrays[f"{i}.logprobs"] = np.asarray(c.logprobs, np.float32)
                f.write(json.dumps({"kind": "call", **d}) + "\n")
            for kind, records in (("segment", self.segments), ("recovery", self.recoveries),
                                  ("trial", self.trials)):
                for r in records:
                    f.write(json.dumps({"kind": kind, **dataclasses.asdict(r)}) + "\n")
        np.savez_compressed(str(path) + ".npz", **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Archive:
        path = Path(path)
        arrays = np.load(str(path) + ".npz")
        out = cls()
        kinds = {"segment": (SegmentRecord, out.segments), "recovery": (RecoveryRecord, out.recoveries),
                 "trial": (TrialRecord, out.trials)}
        n_calls = 0
        for line in _lines(path):
            d: dict[str, Any] = json.loads(line)
            kind = d.pop("kind")
            if kind == "call":
                i = n_calls
                n_calls += 1
                out.calls.append(CallRecord(
                    prompt_ids=arrays[f"{i}.prompt_ids"], output_ids=arrays[f"{i}.output_ids"],
                    logprobs=arrays[f"{i}.logprobs"], **d))
            elif kind in kinds:
                record_cls, target = kinds[kind]
                target.append(record_cls(**d))
            else:
                raise ValueError(f"{path}: unknown record kind {kind!r}")
        return out


def _lines(path: Path) -> Iterator[str]:
    with path.open() as f:
        for line in f:
            if line.strip():
                yield line


def merge(archives: Iterable[Archive]) -> Archive:
    out = Archive()
    for a in archives:
        out.extend(a)
    return out
