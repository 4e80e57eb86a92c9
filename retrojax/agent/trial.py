"""One trial of retrospective exploration (ReTRAIL's Algorithm 1) as a host-side state machine.

A trial alternates between asking for a model call (:meth:`Trial.request`) and consuming its output
(:meth:`Trial.on_output`), which may ask the runner for one environment operation (a step of the parsed
move, or a rewind to ``C_j``); the runner batches those operations over all trials and reports back
(:meth:`Trial.on_step`, :meth:`Trial.on_rewound`). Everything here is plain Python: the trial never touches
the device, so the same machine drives JAX worlds and host text worlds.

Bookkeeping per checkpoint ``C_i`` of the active path: the world's state key and progress figure, the
path score S, the branch-budget consumption, the conversation position (token and message marks) just after
the turn that created it, and its observation text. The rules (the paper's Algorithm 1, C.4, D.2, D.3):

- every call (execution or reflection) counts against ``max_calls`` and is never refunded;
- every execution turn counts against the branch budget, which is a recovery trigger and so applies only
  where the protocol has recovery (T@k); under P@1 a trial may use all ``max_calls`` (or the optional
  ``p1_max_turns`` cap). A restore to ``C_j`` resets the count to its value when ``C_j`` was created (worlds
  whose context is rebuilt after a recovery, ALFWorld, reset it to 0);
- an invalid output (no parseable action, a reply cut off at its token limit, a refused rewind) consumes
  the call, changes nothing, and the next user turn says why; it is not a failure;
- a context that no longer fits the model (``finish_reason == "context"``) ends the trial (``context``);
- a model-initiated rewind (``rewind to C_j``) is granted when the protocol allows it, ``0 ≤ j < k``,
  fewer than ``max_model_rewinds`` were made, the forward-segment cap allows another segment, and at least
  ``min_calls_for_recovery`` calls remain after the request; otherwise it is an invalid turn with the reason;
- a forced recovery follows a failure or an exhausted branch budget when the protocol allows it
  (``T@k``), the macro-attempt count is below ``k``, the segment cap allows it, enough calls remain and
  ``k ≥ 1``; otherwise the trial ends;
- which checkpoint is restored (D.2): games use the known-target reflection for a granted model rewind (the
  requested ``C_j`` is restored) and the choose-a-checkpoint one for a forced recovery (a reply without a
  valid target falls back to ``trial.fallback``: the latest checkpoint, or ending the trial). Text worlds
  (``TrialEnv.reflection_chooses_target``) ask every reflection for the checkpoint: a model rewind gets the
  confirm-or-choose reflection, whose reply may keep ``C_j`` or name another ``0 ≤ j' < k``; a reply without
  a valid target falls back to the requested ``C_j``. A fallback is never a crash: the reflection call is
  recorded invalid with the reason and the recovery as ``target_from_fallback``;
- a recovery makes one reflection call with its own context c_ref (the world's rules, rollback semantics,
  the trigger, the states at ``C_j`` and ``C_k``, the branch history ``C_j → C_k`` and the branch memories),
  never appended to the execution conversation. Its remark (or the whole reflection when it has none,
  tail-clipped to ``remark_max_chars``) becomes branch memory at ``C_j``; how it enters the resumed
  context depends on the world (D.3, ``TrialEnv.recovery_context``): ``memory_turn`` (games) restores the
  ``C_j`` prefix and appends the memory as a user turn (replacing an earlier memory at the same ``C_j``),
  ``observation`` (ScienceWorld) restores the prefix and puts the memory in the next observation turn,
  ``rebuild`` (ALFWorld) starts over from the system message and one turn with the restored observation
  and every branch memory in context. A newer remark at the same ``C_j`` replaces the older one (shown to
  later reflections as superseded); remarks at later checkpoints leave the context with the branch.

``Request.messages`` mirrors the token transcript as chat messages (what a served model is sent).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from retrojax.agent import parse
from retrojax.agent.archive import (
    EXECUTION,
    REFLECTION,
    CallRecord,
    RecoveryRecord,
    SegmentRecord,
    TrialRecord,
)
from retrojax.agent.chat import ChatTokenizer, Transcript
from retrojax.agent.env_api import Action, StepInfo, TrialEnv, text_key
from retrojax.agent.prompts import PromptSet

EXECUTE = "execute"
RECOVERY_CONTEXTS = ("memory_turn", "observation", "rebuild")  # D.3: how memory enters the resumed context
MEMORY_KINDS = ("reflection", "raw_suffix")
AUTO_REWIND = "auto_rewind"  # raw_suffix memory: the rewind needs no model call
REFLECT_KNOWN = "reflect_known"
REFLECT_CHOOSE = "reflect_choose"
_EMPTY_IDS = np.zeros(0, np.int32)
_EMPTY_LP = np.zeros(0, np.float32)


# --------------------------------------------------------------------------------------------------
# Protocols
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Protocol:
    """What recovery a trial may use: ``P@1`` none; ``T@1`` model rewinds; ``T@k`` also forced ones."""

    name: str
    model_rewinds: bool
    forced_recovery: bool
    max_macro: int | None  # macro-attempts allowed (None: as many as the budgets allow)


_PROTOCOL = re.compile(r"^(P|T)@(\d+|k)$", re.IGNORECASE)


def parse_protocol(name: str) -> Protocol:
    """``P@1`` | ``T@1`` | ``T@<k>`` (k ≥ 1) | ``T@k`` (unbounded macro-attempts). Raises ``ValueError``."""
    m = _PROTOCOL.match(name.strip()) if isinstance(name, str) else None
    if not m:
        raise ValueError(f"unknown protocol {name!r}; expected P@1, T@1, T@3, T@<k> or T@k")
    kind, k = m.group(1).upper(), m.group(2).lower()
    if kind == "P":
        if k != "1":
            raise ValueError(f"protocol {name!r}: only P@1 exists (no recovery at all)")
        return Protocol("P@1", model_rewinds=False, forced_recovery=False, max_macro=1)
    if k == "k":
        return Protocol("T@k", model_rewinds=True, forced_recovery=True, max_macro=None)
    n = int(k)
    if n < 1:
        raise ValueError(f"protocol {name!r}: k must be at least 1")
    return Protocol(f"T@{n}", model_rewinds=True, forced_recovery=n > 1, max_macro=n)


# --------------------------------------------------------------------------------------------------
# Trial-side data
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrialSpec:
    """Identity of one trial: ``replicate`` is its index b among the B trials of the same task and seed."""

    trial: int
    task: int
    seed: int
    replicate: int
    protocol: str


@dataclasses.dataclass
class Checkpoint:
    index: int
    state_key: str
    progress: float
    score: float
    branch_used: int
    mark: int
    solved: bool = False
    failed: bool = False
    observation: str = ""
    action: str = ""  # the action that created it ("" for C_0)
    msg_mark: int = 0  # number of chat messages just after the turn that created it


@dataclasses.dataclass
class Remark:
    checkpoint: int
    text: str
    status: str = "in context"  # in context | superseded | left with its branch


@dataclasses.dataclass(frozen=True)
class TrialView:
    """What scripted policies read instead of the prompt text (the same facts the prompt states)."""

    spec: TrialSpec
    slot: int
    kind: str  # EXECUTE | REFLECT_KNOWN | REFLECT_CHOOSE
    checkpoint: int  # k
    targets: tuple[int, ...]  # rewinds the loop would grant now (execution) / may choose (reflection)
    # reflection: the requested target (known; also text worlds' choose after a model rewind, where it is the
    # fallback too) or the fallback (choose after a forced recovery); -1 otherwise
    target: int
    trigger: str  # reflection: model | failure | branch_budget
    progress: tuple[float, ...]  # progress figure at C_0 … C_k
    keys: tuple[str, ...]  # state keys of C_0 … C_k
    path: tuple[str, ...]  # actions that created C_1 … C_k
    state_key: str
    remarks: tuple[tuple[int, str], ...]  # remarks in context: (checkpoint, text)
    calls_left: int
    branch_left: int
    last_invalid: str  # reason the previous execution turn was invalid ("" if it was not)


@dataclasses.dataclass
class Request:
    """One pending model call. ``prompt_ids`` is the whole context (empty when tokens are not kept).

    ``messages`` is the same context as chat messages (``{"role": "system"|"user"|"assistant",
    "content": str}``, in order, ending with the new user turn; empty when prompts are not rendered): the
    execution conversation for an execution call, the separate c_ref conversation for a reflection.
    """

    trial: int
    slot: int
    role: str  # EXECUTION | REFLECTION
    kind: str
    prompt_ids: np.ndarray
    prompt_text: str  # the new user turn ("" when prompts are not rendered)
    max_new_tokens: int
    view: TrialView
    messages: tuple[dict[str, str], ...] = ()


@dataclasses.dataclass
class Generation:
    """A policy's reply; ids and log-probs may be None (the trial then tokenizes the text itself)."""

    text: str
    output_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    finish_reason: str = "stop"  # stop | length (cut off: an invalid turn) | context (no room: trial ends)
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens a server reported; None if local
    error: str = ""  # why a served request failed ("" if it did not): the turn is invalid with this reason
    teach: bool = True  # for demonstrations: False marks a deliberate random move (context, never a target)


@dataclasses.dataclass(frozen=True)
class EnvOp:
    kind: str  # "step" | "rewind"
    action: Action | None = None
    target: int = -1


@dataclasses.dataclass(frozen=True)
class Limits:
    """Budgets and switches of a trial (from ``TrialConfig`` and ``SamplerConfig``)."""

    max_calls: int = 60
    branch_budget: int = 20
    max_model_rewinds: int = 3
    min_calls_for_recovery: int = 2
    fallback: str = "latest"  # latest | end
    remark_max_chars: int = 4800
    history_events: int = 4
    max_new_tokens: int = 256
    max_reflection_tokens: int = 384
    p1_max_turns: int = 0  # P@1 only: cap on execution turns (0: none, the call ceiling alone)
    max_segments: int = 0  # forward-segment cap, counting both recovery types (0: none)
    memory: str = "reflection"  # reflection | raw_suffix (ablation: the abandoned suffix, no reflection call)

    @classmethod
    def from_config(cls, cfg: Any) -> Limits:
        t, s = cfg.trial, cfg.sampler
        if t.fallback not in ("latest", "end"):
            raise ValueError(f"trial.fallback must be 'latest' or 'end', got {t.fallback!r}")
        if t.max_calls < 1 or t.branch_budget < 1:
            raise ValueError("trial.max_calls and trial.branch_budget must be at least 1")
        at_least = {"trial.max_model_rewinds": (t.max_model_rewinds, 0),
                    "trial.min_calls_for_recovery": (t.min_calls_for_recovery, 0),
                    "trial.history_events": (t.history_events, 0),
                    "trial.remark_max_chars": (t.remark_max_chars, 0),
                    "sampler.max_new_tokens": (s.max_new_tokens, 1),
                    "sampler.max_reflection_tokens": (s.max_reflection_tokens, 1)}
        low = [f"{name} must be at least {floor}, got {value}" for name, (value, floor) in at_least.items()
               if value < floor]
        if low:
            raise ValueError("; ".join(low))
        p1_cap, seg_cap = int(getattr(t, "p1_max_turns", 0) or 0), int(getattr(t, "max_segments", 0) or 0)
        if p1_cap < 0 or seg_cap < 0:
            raise ValueError("trial.p1_max_turns and trial.max_segments must be 0 (off) or positive")
        memory = getattr(t, "memory", "reflection")
        if memory not in MEMORY_KINDS:
            raise ValueError(f"trial.memory must be one of {MEMORY_KINDS}, got {memory!r}")
        return cls(max_calls=t.max_calls, branch_budget=t.branch_budget,
                   max_model_rewinds=t.max_model_rewinds,
                   min_calls_for_recovery=t.min_calls_for_recovery, fallback=t.fallback,
                   remark_max_chars=t.remark_max_chars, history_events=t.history_events,
                   max_new_tokens=s.max_new_tokens, max_reflection_tokens=s.max_reflection_tokens,
                   p1_max_turns=p1_cap, max_segments=seg_cap, memory=memory)

    def path_capacity(self) -> int:
        """Checkpoints a trail must hold (``C_0`` plus one per execution turn that can stay on the path)."""
        return self.max_calls + 1


# --------------------------------------------------------------------------------------------------
# The state machine
# --------------------------------------------------------------------------------------------------


class Trial:
    """Algorithm 1 for one trial; see the module docstring. Phases: execute, reflect, env, done."""

    def __init__(self, spec: TrialSpec, slot: int, env: TrialEnv, limits: Limits, prompts: PromptSet | None,
                 tokenizer: ChatTokenizer | None, action_style: str = "tag"):
        self.spec, self.slot, self.env, self.limits = spec, slot, env, limits
        self.protocol = parse_protocol(spec.protocol)
        self.prompts, self.tok, self.action_style = prompts, tokenizer, action_style
        self.render = prompts is not None
        self.fields = env.prompt_fields(spec.task) if self.render else {}
        self.transcript = Transcript() if tokenizer is not None else None
        self.messages: list[dict[str, str]] = []  # the execution conversation as chat messages
        self.context_style = getattr(env, "recovery_context", "memory_turn")
        if self.context_style not in RECOVERY_CONTEXTS:
            raise ValueError(f"{type(env).__name__}.recovery_context must be one of {RECOVERY_CONTEXTS}, "
                             f"got {self.context_style!r}")
        self.value_from_initial = bool(getattr(env, "value_from_initial", False))
        # D.2: text worlds ask every reflection for the checkpoint to restore, whoever started the recovery
        self.reflection_chooses = bool(getattr(env, "reflection_chooses_target", False))
        if self.protocol.model_rewinds or self.protocol.forced_recovery:
            self.branch_limit = limits.branch_budget
        else:  # P@1: no recovery, so the branch budget (a recovery trigger) does not apply
            self.branch_limit = limits.p1_max_turns or limits.max_calls
        self.memory_note = ""  # branch memory the next user turn carries (observation / rebuild styles)

        self.phase = "new"
        self.path: list[Checkpoint] = []
        self.path_calls: list[tuple[int, int]] = []  # (checkpoint at the decision, call_index), retained
        self.events: list[tuple[int, str]] = []  # (checkpoint at the decision, text), retained
        self.remarks: list[Remark] = []  # every remark written, in order
        self.calls_used = 0
        self.branch_used = 0
        self.note = ""
        self.pending: Request | None = None
        self.pending_call: CallRecord | None = None
        self.recovery: dict[str, Any] | None = None  # the recovery in progress
        self.open_recovery: RecoveryRecord | None = None  # waiting for its resumed segment to end
        self.states_seen: set[str] = set()
        self.moves = 0

        self.calls: list[CallRecord] = []
        self.segments: list[SegmentRecord] = []
        self.recoveries: list[RecoveryRecord] = []
        self.record = TrialRecord(trial=spec.trial, task=spec.task, seed=spec.seed,
                                  protocol=self.protocol.name)
        self.segment = SegmentRecord(trial=spec.trial, task=spec.task, index=0, start_checkpoint=0, calls=[])

    # -- derived -------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def k(self) -> int:
        return len(self.path) - 1

    @property
    def calls_left(self) -> int:
        return self.limits.max_calls - self.calls_used

    def context_remarks(self) -> list[Remark]:
        return sorted((r for r in self.remarks if r.status == "in context"), key=lambda r: r.checkpoint)

    def history_key(self) -> str:
        """The logical retained history h: the actions of the retained path only (D.5.1: decisions at the
        same state and prefix share a group even when their branch memories differ)."""
        return text_key(*(c.action for c in self.path[1:]))

    def segment_allowed(self) -> bool:
        """Whether the forward-segment cap leaves room for one more segment (a recovery)."""
        cap = self.limits.max_segments
        return cap <= 0 or self.segment.index + 1 < cap

    def rewind_targets(self) -> tuple[int, ...]:
        """Rewinds the loop would grant for the next execution call."""
        lim = self.limits
        ok = (self.protocol.model_rewinds and self.record.rewinds_model < lim.max_model_rewinds
              and self.calls_left - 1 >= lim.min_calls_for_recovery and self.segment_allowed())
        return tuple(range(self.k)) if ok else ()

    # -- start ---------------------------------------------------------------------------------------
    def start(self, info: StepInfo, observation: str = "") -> None:
        """Take ``C_0`` from the world's reset and open the conversation."""
        if self.phase != "new":
            raise RuntimeError("trial already started")
        scale = getattr(self.env, "task_scale", None)
        d0 = scale(self.spec.task) if scale is not None else info.progress
        self.record.d0 = float(d0) if d0 is not None and math.isfinite(d0) else None
        score = info.score if info.score is not None else 0.0
        if self.render:
            self._add_turn("system", self._system_text())
        self.path.append(Checkpoint(0, info.state_key, info.progress, score, 0, self._mark(),
                                    info.solved, info.failed, observation, msg_mark=len(self.messages)))
        self.states_seen.add(info.state_key)
        self.phase = EXECUTE
        if info.solved:
            self._end("success")

    # -- requests ------------------------------------------------------------------------------------
    def request(self) -> Request:
        """The pending call (built once per call; the user turn enters the conversation here)."""
        if self.pending is not None:
            return self.pending
        if self.phase not in (EXECUTE, REFLECT_KNOWN, REFLECT_CHOOSE):
            raise RuntimeError(f"trial {self.spec.trial} has no pending call (phase {self.phase})")
        kind = self.phase
        if kind == EXECUTE:
            text = self._user_text() if self.render else ""
            role, max_new = EXECUTION, self.limits.max_new_tokens
            targets, target, trigger = self.rewind_targets(), -1, ""
            if self.render:
                self._add_turn("user", text)
                self.memory_note = ""
            messages = tuple(dict(m) for m in self.messages)
            prompt_ids = self._prompt_ids()
        else:
            rec = self.recovery
            text = self._reflection_text(kind) if self.render else ""
            role, max_new = REFLECTION, self.limits.max_reflection_tokens
            targets = tuple(range(self.k)) if kind == REFLECT_CHOOSE else (rec["target"],)
            target, trigger = rec["target"], rec["trigger"]
            # c_ref: the reflection's own conversation, never part of the execution context
            messages = ({"role": "user", "content": text},) if self.render else ()
            prompt_ids = (np.asarray([*self.tok.encode_turn("user", text), *self.tok.generation_prompt()],
                                     np.int32) if self.tok is not None else _EMPTY_IDS)
        view = TrialView(
            spec=self.spec, slot=self.slot, kind=kind, checkpoint=self.k, targets=targets, target=target,
            trigger=trigger, progress=tuple(c.progress for c in self.path),
            keys=tuple(c.state_key for c in self.path),
            path=tuple(c.action for c in self.path[1:]), state_key=self.path[-1].state_key,
            remarks=tuple((r.checkpoint, r.text) for r in self.context_remarks()), calls_left=self.calls_left,
            branch_left=self.branch_limit - self.branch_used, last_invalid=self.note,
        )
        self.pending = Request(trial=self.spec.trial, slot=self.slot, role=role, kind=kind,
                               prompt_ids=prompt_ids, prompt_text=text, max_new_tokens=max_new, view=view,
                               messages=messages)
        return self.pending

    def _add_turn(self, role: str, text: str) -> None:
        """One system / user turn into the execution conversation (messages and, when kept, tokens)."""
        self.messages.append({"role": role, "content": text})
        if self.transcript is not None:
            self.transcript.append(self.tok.encode_turn(role, text))

    def _prompt_ids(self) -> np.ndarray:
        """The execution context's ids with the assistant turn opened (empty when tokens are not kept)."""
        if self.transcript is None:
            return _EMPTY_IDS
        return np.concatenate([self.transcript.ids(), np.asarray(self.tok.generation_prompt(), np.int32)])

    def _mark(self) -> int:
        return len(self.transcript) if self.transcript is not None else 0

    # -- outputs -------------------------------------------------------------------------------------
    def on_output(self, gen: Generation) -> EnvOp | None:
        """Consume the reply to the pending call; returns the world operation it needs, if any."""
        req = self.pending
        if req is None:
            raise RuntimeError(f"trial {self.spec.trial}: output without a pending call")
        self.pending = None
        if gen.finish_reason == "context":  # the context no longer fits the model: nothing was generated
            self._close_segment("context")
            self._end("context")
            return None
        out_ids, logprobs = self._output_tokens(gen)
        call = CallRecord(
            trial=self.spec.trial, task=self.spec.task, call_index=self.calls_used, role=req.role,
            segment=self.segment.index, position=len(self.segment.calls) if req.role == EXECUTION else -1,
            checkpoint=self.k, state_key=self.path[-1].state_key, history_key=self.history_key(),
            prompt_ids=req.prompt_ids, output_ids=out_ids, logprobs=logprobs, output_text=gen.text,
            finish_reason=gen.finish_reason, teach=gen.teach,
        )
        if gen.usage is not None:
            call.prompt_tokens, call.completion_tokens = int(gen.usage[0]), int(gen.usage[1])
            self.record.prompt_tokens += call.prompt_tokens
            self.record.completion_tokens += call.completion_tokens
        self.calls.append(call)
        self.calls_used += 1
        if req.role == EXECUTION:
            if self.render:
                self.messages.append({"role": "assistant", "content": gen.text})
            if self.transcript is not None:
                self.transcript.append(self.tok.generation_prompt())
                self.transcript.append(out_ids)
                self.transcript.append(self.tok.close_turn(out_ids))
            return self._on_execution(call, gen)
        return self._on_reflection(call, gen, req.kind)

    def _on_execution(self, call: CallRecord, gen: Generation) -> EnvOp | None:
        self.record.calls_execution += 1
        self.branch_used += 1
        self.segment.calls.append(call.call_index)
        self.path_calls.append((self.k, call.call_index))
        self.note = ""
        if gen.error:
            self._invalid(call, f"api request failed: {gen.error}", "")
            return None
        if gen.finish_reason == "length":
            self._invalid(call, "the reply was cut off at its token limit before it finished", "")
            return None
        action = parse.parse_output(gen.text, self.env.parse_action, self.action_style)
        call.action = action.text
        if action.is_invalid:
            self._invalid(call, action.reason, action.text)
            return None
        if action.is_rewind:
            reason = self._rewind_refusal(action.target)
            if reason:
                self._invalid(call, reason, action.text)
                return None
            call.is_rewind, call.rewind_target = True, action.target
            self._event(f"at C_{self.k}: asked to rewind to C_{action.target}")
            self._close_segment("rewind")
            self.recovery = {"trigger": "model", "target": action.target, "from": self.k}
            self._reflect_or_skip(REFLECT_CHOOSE if self.reflection_chooses else REFLECT_KNOWN)
            return None
        self.phase = "env"
        self.pending_call = call
        return EnvOp("step", action=action)

    def _rewind_refusal(self, j: int) -> str:
        lim = self.limits
        if not self.protocol.model_rewinds:
            return "rewinds are not allowed in this game"
        if self.record.rewinds_model >= lim.max_model_rewinds:
            return f"you already used all {lim.max_model_rewinds} rewinds"
        if self.calls_left < lim.min_calls_for_recovery:
            return "too few replies are left for a rewind"
        if not self.segment_allowed():
            return f"no more rewinds: the limit of {lim.max_segments} path segments is reached"
        if not 0 <= j < self.k:
            return (f"C_{j} is not a valid target; choose one of C_0 … C_{self.k - 1}" if self.k
                    else "there is no earlier checkpoint to rewind to yet")
        return ""

    def _invalid(self, call: CallRecord, reason: str, text: str) -> None:
        call.valid, call.invalid_reason = False, reason
        self.record.invalid_turns += 1
        self.note = reason
        shown = text if len(text) <= 40 else text[:40] + "…"
        self._event(f"at C_{self.k}: invalid reply '{shown}': {reason}" if shown else
                    f"at C_{self.k}: invalid reply: {reason}")
        self._after_turn()

    def on_step(self, info: StepInfo, observation: str = "") -> None:
        """The world executed the pending move (or rejected it: ``info.valid`` False)."""
        call, self.pending_call = self.pending_call, None
        if self.phase != "env" or call is None:
            raise RuntimeError(f"trial {self.spec.trial}: step result without a pending move")
        self.phase = EXECUTE
        if not info.valid:
            self._invalid(call, info.message or "the world rejected the action", call.action)
            return
        prev = self.path[-1]
        score = info.score if info.score is not None else prev.score + info.reward
        self.path.append(Checkpoint(
            self.k + 1, info.state_key, info.progress, score, self.branch_used, self._mark(), info.solved,
            info.failed, observation, call.action, msg_mark=len(self.messages),
        ))
        self.states_seen.add(info.state_key)
        self.moves += info.moves
        call.reward, call.solved, call.failed = float(info.reward), bool(info.solved), bool(info.failed)
        outcome = f" → {info.message}" if info.message else ""
        self._event(f"C_{self.k - 1} → C_{self.k}: {call.action}{outcome} (reward {info.reward:+.2f})",
                    at=self.k - 1)  # the decision was taken at C_{k-1}
        self._after_turn()

    def _after_turn(self) -> None:
        """Checks after an execution turn that did not start a recovery."""
        last = self.path[-1]
        if last.solved:
            self._close_segment("success")
            self._end("success")
        elif last.failed:
            self._trigger("failure")
        elif self.calls_left <= 0:
            self._close_segment("calls")
            self._end("calls")
        elif self.branch_used >= self.branch_limit:
            self._trigger("branch_budget")

    def _trigger(self, trigger: str) -> None:
        """A forced recovery is due: start it, or end the trial when it is not allowed."""
        self._close_segment(trigger)
        proto, lim = self.protocol, self.limits
        if not proto.forced_recovery:
            self._end(trigger)
        elif proto.max_macro is not None and self.record.macro_attempts >= proto.max_macro:
            self._end(trigger)
        elif self.calls_left < lim.min_calls_for_recovery:
            self._end("calls" if self.calls_left <= 0 else "no_recovery")
        elif self.k < 1 or not self.segment_allowed():
            self._end("no_recovery")
        else:
            self.recovery = {"trigger": trigger, "target": self.k - 1, "from": self.k}
            self._reflect_or_skip(REFLECT_CHOOSE)

    def _reflect_or_skip(self, kind: str) -> None:
        """Ask for the reflection call, or (raw_suffix ablation) keep the abandoned suffix as the memory and
        rewind to the requested target (model) or the latest checkpoint (forced) without a call."""
        if self.limits.memory == "reflection":
            self.phase = kind
            return
        rec = self.recovery
        j = rec["target"]
        suffix = "\n".join(e for kd, e in self.events if kd >= j) or "(no turns)"
        rec.update(call=-1, fallback=False,
                   remark=parse.clip_remark(f"Abandoned branch C_{j} → C_{self.k}:\n{suffix}",
                                            self.limits.remark_max_chars))
        self.phase = AUTO_REWIND

    def auto_op(self) -> EnvOp | None:
        """A world operation the trial needs before its next call (the raw_suffix ablation's rewind)."""
        if self.phase != AUTO_REWIND:
            return None
        self.phase = "env"
        return EnvOp("rewind", target=self.recovery["target"])

    def _on_reflection(self, call: CallRecord, gen: Generation, kind: str) -> EnvOp | None:
        self.record.calls_reflection += 1
        rec = self.recovery
        rec["call"] = call.call_index
        rec["remark"] = parse.memory_from_reflection(gen.text, self.limits.remark_max_chars)
        rec["fallback"] = False
        if gen.error:
            call.valid, call.invalid_reason = False, f"api request failed: {gen.error}"
        if kind == REFLECT_CHOOSE:
            action = parse.parse_output(gen.text, _rewind_only, self.action_style)
            if gen.error:
                action = parse.invalid(call.invalid_reason, gen.text)
            if action.is_rewind and 0 <= action.target < self.k:
                rec["target"] = action.target
            elif rec["trigger"] == "model":  # text worlds: the agent's own request stands
                call.valid = False
                call.invalid_reason = (f"{action.reason or f'C_{action.target} is not a valid target'}; "
                                       f"restoring the requested C_{rec['target']}")
                rec["fallback"] = True
            elif self.limits.fallback == "end":
                call.valid = False
                call.invalid_reason = action.reason or f"C_{action.target} is not a valid target"
                self.recovery = None
                self._end("no_recovery")
                return None
            else:
                call.valid = False
                call.invalid_reason = action.reason or f"C_{action.target} is not a valid target"
                rec["fallback"] = True
        call.is_rewind, call.rewind_target = True, rec["target"]
        call.action = f"rewind to C_{rec['target']}"
        self.phase = "env"
        return EnvOp("rewind", target=rec["target"])

    def on_rewound(self) -> None:
        """The world is back at ``C_j``: restore the conversation, budgets and score; place the remark."""
        rec, self.recovery = self.recovery, None
        if self.phase != "env" or rec is None:
            raise RuntimeError(f"trial {self.spec.trial}: rewind result without a recovery")
        j, k = rec["target"], self.k
        branch = self.path[j:]
        abandoned = [c for (kd, c) in self.path_calls if kd >= j]
        v_abandoned = self._branch_value(branch)
        recovery = RecoveryRecord(
            trial=self.spec.trial, task=self.spec.task, index=self.segment.index, trigger=rec["trigger"],
            from_checkpoint=k, target=j, reflection_call=rec["call"], remark=rec["remark"],
            abandoned_calls=abandoned, resumed_segment=self.segment.index + 1, v_abandoned=v_abandoned,
            target_from_fallback=rec["fallback"],
        )
        self.recoveries.append(recovery)
        self.open_recovery = recovery
        # restore
        del self.path[j + 1 :]
        self.path_calls = [(kd, c) for (kd, c) in self.path_calls if kd < j]
        self.events = [(kd, e) for (kd, e) in self.events if kd < j]
        ck = self.path[j]
        self.branch_used = 0 if self.context_style == "rebuild" else ck.branch_used
        for r in self.remarks:
            if r.status == "in context" and r.checkpoint >= j:
                r.status = "superseded" if r.checkpoint == j else "left with its branch"
        if rec["remark"]:
            self.remarks.append(Remark(j, rec["remark"]))
        if self.render:
            self._restore_context(ck, rec["remark"])
        if rec["trigger"] == "model":
            self.record.rewinds_model += 1
        else:
            self.record.rewinds_forced += 1
            self.record.macro_attempts += 1
        self.note = ""
        self.segment = SegmentRecord(trial=self.spec.trial, task=self.spec.task, index=self.segment.index + 1,
                                     start_checkpoint=j, calls=[])
        self.phase = EXECUTE

    # -- segments and the end ------------------------------------------------------------------------
    def _restore_context(self, ck: Checkpoint, remark: str) -> None:
        """The resumed execution context after a restore to ``ck`` (D.3; see the module docstring)."""
        j = ck.index
        if self.context_style == "rebuild":  # system message + one turn with the restored state and memories
            del self.messages[1:]
            if self.transcript is not None:
                self.transcript.truncate(self.path[0].mark)
            self.memory_note = "\n\n".join(self.prompts.memory.format(checkpoint=r.checkpoint, remark=r.text)
                                           for r in self.context_remarks())
            return
        del self.messages[ck.msg_mark :]
        if self.transcript is not None:
            self.transcript.truncate(ck.mark)
        if not remark:
            return
        memory = self.prompts.memory.format(checkpoint=j, remark=remark)
        if self.context_style == "observation":
            self.memory_note = memory
        else:
            self._add_turn("user", memory)

    def _branch_value(self, branch: list[Checkpoint]) -> float:
        """V of a branch anchored at ``branch[0]``; Sokoban measures from the initial state (C.2)."""
        progress = [c.progress for c in branch]
        if self.value_from_initial:
            progress = [self.path[0].progress, *progress]
        return float(self.env.branch_value(progress, branch[-1].solved, branch[-1].failed))

    def _endpoint_progress(self) -> float:
        """The world's task progress at the end of the retained path (``TrialEnv.endpoint_progress``)."""
        last = self.path[-1]
        return float(self.env.endpoint_progress([c.progress for c in self.path], last.score, last.solved,
                                                last.failed))

    def _close_segment(self, reason: str) -> None:
        seg = self.segment
        if seg.end_reason:
            return
        last = self.path[-1]
        seg.end_reason, seg.end_checkpoint, seg.score = reason, self.k, float(last.score)
        seg.progress = self._endpoint_progress()
        self.segments.append(seg)
        open_rec = self.open_recovery
        if open_rec is not None and open_rec.resumed_segment == seg.index:
            open_rec.v_resumed = self._branch_value(self.path[open_rec.target :])
            self.open_recovery = None

    def _end(self, reason: str) -> None:
        self._close_segment(reason)
        self.phase = "done"
        self.pending = None
        r = self.record
        r.end_reason = reason
        r.success = reason == "success"
        r.final_score = float(self.path[-1].score)
        r.final_progress = self._endpoint_progress()
        r.distinct_states = len(self.states_seen)
        r.actions_to_success = self.moves if r.success else None

    def _event(self, text: str, at: int | None = None) -> None:
        self.events.append((self.k if at is None else at, text))

    # -- tokens and text -----------------------------------------------------------------------------
    def _output_tokens(self, gen: Generation) -> tuple[np.ndarray, np.ndarray]:
        if gen.output_ids is not None:
            ids = np.asarray(gen.output_ids, np.int32)
            lp = (np.asarray(gen.logprobs, np.float32) if gen.logprobs is not None
                  else np.zeros(ids.size, np.float32))
            if lp.shape != ids.shape:
                raise ValueError(f"logprobs shape {lp.shape} does not match output ids {ids.shape}")
            return ids, lp
        if self.tok is None:
            return _EMPTY_IDS, _EMPTY_LP
        ids = np.asarray(self.tok.encode(gen.text), np.int32)
        return ids, np.zeros(ids.size, np.float32)

    def _targets_text(self, targets: tuple[int, ...] | range) -> str:
        targets = list(targets)
        if not targets:
            return "none"
        if len(targets) > 5:
            return f"C_{targets[0]} to C_{targets[-1]}"
        return ", ".join(f"C_{t}" for t in targets)

    def _system_text(self) -> str:
        p = self.prompts
        allowed = self.protocol.model_rewinds and self.limits.max_model_rewinds > 0
        rules = p.rewind_allowed if allowed else p.rewind_forbidden
        return p.system.format(max_calls=self.limits.max_calls, branch_budget=self.branch_limit,
                               rewind_rules=rules, **self.fields)

    def _user_text(self) -> str:
        n = self.limits.history_events
        events = [e for _, e in self.events[-n:]] if n > 0 else []
        note = f"Note: your previous reply was not executed: {self.note}.\n" if self.note else ""
        observation = self.path[-1].observation
        if self.memory_note:  # ScienceWorld / ALFWorld: branch memory travels with the observation
            observation = f"{self.memory_note}\n\n{observation}"
        return self.prompts.user.format(
            observation=observation, calls_used=self.calls_used, calls_left=self.calls_left,
            branch_used=self.branch_used, branch_left=self.branch_limit - self.branch_used,
            checkpoint=self.k, targets=self._targets_text(self.rewind_targets()),
            events="\n".join(events) if events else "(none yet)", note=note,
        )

    def _reflection_text(self, kind: str) -> str:
        p, rec = self.prompts, self.recovery
        j = rec["target"]
        trigger = p.triggers[rec["trigger"]].format(target=j)
        history = [e for kd, e in self.events if kd >= j]
        earlier = [f"- at C_{r.checkpoint} ({r.status}): {r.text}" for r in self.remarks]
        template = p.reflect_choose if kind == REFLECT_CHOOSE else p.reflect_known
        if kind == REFLECT_CHOOSE and rec["trigger"] == "model":  # confirm the request or choose another
            template = p.reflect_confirm or p.reflect_choose
        fields = dict(
            rules=p.rules.format(**self.fields), trigger=trigger, target=j, checkpoint=self.k,
            state_target=self.path[j].observation, state_current=self.path[-1].observation,
            history="\n".join(history) if history else "(no turns)",
            earlier="\n".join(earlier) if earlier else "(none)",
        )
        if kind == REFLECT_CHOOSE:
            fields["targets"] = self._targets_text(range(self.k))
        return template.format(**fields)


def _rewind_only(content: str) -> Action:
    """Reflection action parser: only ``rewind to C_j`` is meaningful."""
    rewind = parse.parse_rewind(content)
    if rewind is not None:
        return rewind
    return parse.invalid("expected 'rewind to C_j'", content)
