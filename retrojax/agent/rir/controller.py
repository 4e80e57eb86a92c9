"""One RIR trial as a host-side state machine (the paper's Algorithm 1), driven by :mod:`.runner`.

Like ReTRAIL's ``Trial`` it alternates between asking for one model call (:meth:`RIRTrial.request`) and
consuming its reply (:meth:`RIRTrial.on_output`), which may ask the runner for one world operation (a step
of the agent's move, or a rewind to ``C_r``), reported back through :meth:`on_step` / :meth:`on_rewound`.

Order of one decision (Alg. 1): the agent replies ``a_t`` from ``C_t``; if ``a_t`` is the rollback tool or
the horizon is reached (replies since the last review ≥ L), the reviewer runs BEFORE ``a_t`` is executed.
Continue → L adapts (Eq. 5), ΔE is merged, ``a_t`` is executed (a rollback request executes nothing).
Rollback (with ``N_rb < B_rb`` and at least ``min_calls_for_restore`` agent calls left) → coarse range
[l, u] → fine restore point r → patch (ΔH, F_new) → memory update → rewind to ``C_r`` (``a_t`` dropped),
L = L_0. With B_rb spent, or too few calls left (counted in ``restores_refused``), a Rollback verdict acts
as Continue. An irreversible failure reported by the world is reviewed at once (trigger ``failure``); if it is
not rolled back the trial ends.

Fallbacks (parsers never raise): unknown verdict → continue; bad urgency → the default; bad range → the
whole path [0, t]; bad/inadmissible restore point → the latest admissible (non-failed) checkpoint in [l, u]
(when [l, u] holds none, l widens to 0); bad patch → no milestones and F = the reviewer's diagnosis.

What a model is shown comes only from what the agent could observe: observations, the world's one-line
replies, σ (built from those) and ξ_t (:mod:`.signals`). The world's hidden figures (``StepInfo.progress``,
``branch_value``) are kept per checkpoint for the scripted oracle's view and never rendered.

After a restore the agent's context is exactly: the system prompt with the CURRENT memory block, then the
turns made at ``C_0 … C_{r-1}`` (those that built ``C_r``), then the new user turn at ``C_r``. Auxiliary calls
are single-turn prompts of their own and never enter it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from retrojax.agent import parse
from retrojax.agent.archive import CallRecord
from retrojax.agent.chat import ChatTokenizer
from retrojax.agent.env_api import StepInfo, TrialEnv, text_key
from retrojax.agent.rir import prompts as P
from retrojax.agent.rir import replies, signals, summaries
from retrojax.agent.rir.memory import Memory
from retrojax.agent.rir.settings import Settings
from retrojax.agent.rir.variants import LOCALIZE, NO_RESTORE, RESTART, Variant
from retrojax.agent.trial import EnvOp, Generation, Request, TrialSpec

EXECUTE = "execute"  # the agent's call (the name ReTRAIL's policies group execution calls by)
REVIEW, COARSE, FINE, PATCH = "review", "coarse", "fine", "patch"
RIR_ROLES = (REVIEW, COARSE, FINE, PATCH)  # RIR's own auxiliary roles
# the baselines' auxiliary roles (``retrojax.agent.rir.baselines``): Self-Refine's critique and refined
# action, Reflexion's and LATS's reflections, LATS's value estimate, GA-Rollback's stepwise assistant
CRITIQUE, REFINE, REFLECT, VALUE, ASSIST = "critique", "refine", "reflect", "value", "assist"
BASELINE_ROLES = (CRITIQUE, REFINE, REFLECT, VALUE, ASSIST)
AUX_ROLES = (*RIR_ROLES, *BASELINE_ROLES)
ENV, DONE = "env", "done"
_EMPTY_IDS = np.zeros(0, np.int32)
_EMPTY_LP = np.zeros(0, np.float32)


@dataclasses.dataclass
class Node:
    """Checkpoint ``C_i`` of the active path (what the controller keeps about it)."""

    index: int
    state_key: str
    progress: float
    value: float  # the world's hidden branch_value over (C_0, C_i): the scripted oracle's view only
    solved: bool
    failed: bool
    observation: str
    action: str  # the action that created it ("" for C_0)
    message: str  # the world's one-line outcome of that action
    sigma: dict[str, Any]
    score: float
    seen: str = ""  # key of the visible observation (ξ_t compares these)
    shown: float | None = None  # the score the world shows here (None: it shows none)


@dataclasses.dataclass
class Turn:
    """One agent turn kept in the agent's context: made at ``C_checkpoint``."""

    checkpoint: int
    user: str
    reply: str
    ids: np.ndarray


@dataclasses.dataclass(frozen=True)
class RIRView:
    """What scripted RIR policies read instead of the prompt (the same facts the prompts state)."""

    spec: TrialSpec
    slot: int
    kind: str  # EXECUTE | REVIEW | COARSE | FINE | PATCH
    checkpoint: int  # t
    keys: tuple[str, ...]
    progress: tuple[float, ...]
    values: tuple[float, ...]
    failed: tuple[bool, ...]
    path: tuple[str, ...]  # actions that created C_1 … C_t
    summaries: tuple[str, ...]  # σ(C_0) … σ(C_t)
    state_key: str
    memory: Memory
    signals: signals.Signals
    rollback_tool: bool
    trigger: str = ""  # review: agent | schedule | failure
    pending: str = ""  # review: the proposed action ("rollback" for a request)
    diagnosis: str = ""
    lo: int = -1
    hi: int = -1
    candidates: tuple[int, ...] = ()
    restore: int = -1  # patch: r
    calls_left: int = 0
    last_invalid: str = ""
    horizon: float = 0.0
    since_review: int = 0
    # what the agent could see, per checkpoint C_0 … C_t: a key of the visible observation and the score the
    # world shows (None: none); a prompt-only player (the role demonstrations' labeller) reads only these,
    # ``path``, ``failed`` (the world's terminal flag is shown), ``signals`` and ``trigger``
    seen: tuple[str, ...] = ()
    shown: tuple[float | None, ...] = ()
    notes: tuple[str, ...] = ()  # a baseline's carried texts (reflections, feedback) the agent is shown
    proposal: str = ""  # Self-Refine's critique: the action under critique


@dataclasses.dataclass
class RIRRecord:
    """Per-trial outcome and costs (the eval and the invariant tests read these)."""

    trial: int
    task: int
    seed: int
    replicate: int
    protocol: str
    success: bool = False
    end_reason: str = ""
    agent_calls: int = 0
    aux_calls: int = 0
    aux_by_role: dict[str, int] = dataclasses.field(default_factory=lambda: {r: 0 for r in AUX_ROLES})
    reviews: int = 0
    reviews_by_trigger: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"agent": 0, "schedule": 0, "failure": 0}
    )
    rollbacks: int = 0  # executed restores (the world was rewound)
    resets: int = 0  # Reflexion: new trials from the start (an episode reset, not a rollback)
    recoveries: int = 0  # Rollback verdicts acted on (restores + no-rollback reflections)
    rewind_calls: int = 0  # env.rewind operations requested
    actions: int = 0  # environment actions executed, abandoned ones included
    invalid_turns: int = 0
    steps: int = 0  # length t of the final path
    final_score: float = 0.0
    final_value: float = 0.0  # the world's branch value of the final path from C_0 (training credit only)
    dense_reward: float = 0.0
    distinct_states: int = 0
    horizons: list[float] = dataclasses.field(default_factory=list)  # L after every change
    max_unreviewed: int = 0  # most agent replies in a row without a review (scheduled variants)
    # per restore: t, l, u, r, trigger, after_call (calls made before it), v_abandoned / v_resumed (the
    # world's branch value from C_r of the abandoned branch and of the one resumed there: reviewer credit)
    restores: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    restore_ok: list[bool] = dataclasses.field(default_factory=list)  # world state == C_r's recorded state
    memory_changes: int = 0
    restores_refused: int = 0  # Rollback verdicts not acted on: fewer than min_calls_for_restore calls left
    marked_to_verify: int = 0  # memory entries marked to re-verify by rollbacks
    patterns_promoted: int = 0  # recurring failure patterns promoted into E
    parse_problems: int = 0  # auxiliary replies with any fallback (per role below)
    verdict_fallbacks: int = 0  # reviews whose verdict could not be read (acted on as Continue)
    parse_problems_by_role: dict[str, int] = dataclasses.field(
        default_factory=lambda: {r: 0 for r in AUX_ROLES}
    )
    prompt_tokens: int = 0  # sums over every call (agent and auxiliary) of a served model's reported usage
    completion_tokens: int = 0
    api_failures: int = 0  # calls whose served request failed (each is an invalid turn or a parse fallback)


class RIRTrial:
    """Algorithm 1 for one trial (see the module docstring)."""

    def __init__(
        self,
        spec: TrialSpec,
        slot: int,
        env: TrialEnv,
        variant: Variant,
        settings: Settings,
        tokenizer: ChatTokenizer | None,
        render: bool,
        action_style: str = "tag",
        prompt_style: str = "full",
    ):
        self.spec, self.slot, self.env, self.variant, self.cfg = spec, slot, env, variant, settings
        self.compact = prompt_style == "compact"  # the agent's prompts (trial.prompt_style); aux: one style
        self.sched = settings.schedule
        self.tok, self.render, self.style = tokenizer, render or tokenizer is not None, action_style
        self.world = getattr(env, "name", "env")
        self.fields = env.prompt_fields(spec.task) if self.render else {}
        if not self.render and self.world in ("scienceworld", "alfworld"):
            self.fields = {}
        self.goal = P.goal_of(self.world, self.fields) if self.render else P.goal_of(self.world, {})
        self.prompt_key = getattr(env, "prompt_key", self.world)
        self.rules = P.world_rules(self.prompt_key, self.fields) if self.render else ""
        self.memory = Memory(self.goal)
        self.path: list[Node] = []
        self.turns: list[Turn] = []
        self.phase = "new"
        self.horizon = self.sched.l_0
        self.since_review = 0
        self.review_from = 0  # the checkpoint of the last review (after a restore: C_r)
        self.invalid_since_review = 0
        self.note = ""
        self.pending: Request | None = None
        self.proposal: dict[str, Any] | None = None  # the agent's reply awaiting review / execution
        self.rec: dict[str, Any] | None = None  # the review / recovery in progress
        self.states_seen: set[str] = set()
        self.calls: list[CallRecord] = []
        self._reply: tuple[Request, str, np.ndarray, str] | None = None
        self._system_cache: tuple[int, str, np.ndarray] | None = None
        self.record = RIRRecord(
            trial=spec.trial, task=spec.task, seed=spec.seed, replicate=spec.replicate, protocol=variant.name
        )
        self.record.horizons.append(self.horizon)

    # -- derived -------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.phase == DONE

    @property
    def t(self) -> int:
        return len(self.path) - 1

    @property
    def used(self) -> int:
        r = self.record
        return r.agent_calls + (r.aux_calls if self.cfg.aux_counts_against_agent else 0)

    @property
    def calls_left(self) -> int:
        return self.cfg.agent_budget - self.used

    def admissible(self, i: int) -> bool:
        return 0 <= i <= self.t and not self.path[i].failed

    def current_signals(self) -> signals.Signals:
        """ξ_t from what the agent saw (visible observations, actions, shown scores, its invalid replies)."""
        return signals.compute(
            [n.seen for n in self.path],
            [n.action for n in self.path[1:]],
            [n.shown for n in self.path],
            self.path[-1].failed,
            self.invalid_since_review,
        )

    def _node(
        self,
        index: int,
        info: StepInfo,
        value: float,
        observation: str,
        action: str,
        message: str,
        sigma: dict[str, Any],
        score: float,
    ) -> Node:
        return Node(
            index,
            info.state_key,
            info.progress,
            value,
            info.solved,
            info.failed,
            observation,
            action,
            message,
            sigma,
            score,
            text_key(observation),
            summaries.visible_score(self.world, sigma),
        )

    # -- start ---------------------------------------------------------------------------------------
    def start(self, info: StepInfo, observation: str = "") -> None:
        if self.phase != "new":
            raise RuntimeError("trial already started")
        value = float(self.env.branch_value([info.progress], info.solved, info.failed))
        score = float(info.score) if info.score is not None else 0.0
        self.path.append(
            self._node(
                0,
                info,
                value,
                observation,
                "",
                "start",
                summaries.start(self.world, observation, info),
                score,
            )
        )
        self.states_seen.add(info.state_key)
        self.phase = EXECUTE
        if info.solved:
            self._end("success")
        elif info.failed:
            self._end("failure")

    # -- requests ------------------------------------------------------------------------------------
    def request(self) -> Request:
        if self.pending is not None:
            return self.pending
        kind = self.phase
        if kind not in (EXECUTE, *AUX_ROLES):
            raise RuntimeError(f"trial {self.spec.trial} has no pending call (phase {self.phase})")
        view = self._view(kind)
        if kind in (EXECUTE, REFINE):  # a refined action is asked in the agent's own context
            text, messages, ids = self._agent_context()
            max_new = self.cfg.max_new_tokens
        else:
            system, user = self._aux_prompt(kind) if self.render else ("", "")
            messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
            ids = (
                np.asarray(
                    [
                        *self.tok.encode_turn("system", system),
                        *self.tok.encode_turn("user", user),
                        *self.tok.generation_prompt(),
                    ],
                    np.int32,
                )
                if self.tok is not None
                else _EMPTY_IDS
            )
            text = user
            long = {REVIEW, PATCH, CRITIQUE, REFLECT, ASSIST}
            max_new = (
                self.cfg.max_patch_tokens
                if kind in (PATCH, REFLECT)
                else self.cfg.max_review_tokens
                if kind in long
                else self.cfg.max_select_tokens
            )
        req = Request(
            trial=self.spec.trial,
            slot=self.slot,
            role=kind if kind != EXECUTE else "execution",
            kind=kind,
            prompt_ids=ids,
            prompt_text=text,
            max_new_tokens=max_new,
            view=view,
        )
        req.messages = tuple(messages) if self.render else ()  # the chat context for served-model policies
        self.pending = req
        return req

    def _view(self, kind: str) -> RIRView:
        rec = self.rec or {}
        return RIRView(
            spec=self.spec,
            slot=self.slot,
            kind=kind,
            checkpoint=self.t,
            keys=tuple(n.state_key for n in self.path),
            progress=tuple(n.progress for n in self.path),
            values=tuple(n.value for n in self.path),
            failed=tuple(n.failed for n in self.path),
            path=tuple(n.action for n in self.path[1:]),
            summaries=tuple(summaries.render(self.world, n.sigma) for n in self.path),
            state_key=self.path[-1].state_key,
            memory=self.memory,
            signals=self.current_signals(),
            rollback_tool=self.variant.agent_trigger,
            trigger=rec.get("trigger", ""),
            pending=(self.proposal or {}).get("shown", ""),
            diagnosis=rec.get("diagnosis", ""),
            lo=rec.get("lo", -1),
            hi=rec.get("hi", -1),
            candidates=tuple(rec.get("candidates", ())),
            restore=rec.get("r", -1),
            calls_left=self.calls_left,
            last_invalid=self.note,
            horizon=self.horizon,
            since_review=self.since_review,
            seen=tuple(n.seen for n in self.path),
            shown=tuple(n.shown for n in self.path),
            notes=self._notes(),
            proposal=(self.proposal or {}).get("shown", ""),
        )

    def _notes(self) -> tuple[str, ...]:
        """A baseline's carried texts (none for RIR: its carried knowledge is M)."""
        return ()

    def _memory_block(self) -> str | None:
        """The block that closes the agent's system prompt: RIR's M (a baseline shows its own)."""
        if not self.variant.shows_memory:
            return None
        return self.memory.render_compact() if self.compact else self.memory.render()

    def _system_ids(self) -> tuple[str, np.ndarray]:
        version = self._version()
        if self._system_cache is None or self._system_cache[0] != version:
            memory_block = self._memory_block()
            if self.compact:
                text = P.agent_system_compact(
                    prompt_key=self.prompt_key,
                    fields=self.fields,
                    style=self.style,
                    agent_budget=self.cfg.agent_budget,
                    rollback_tool=self.variant.agent_trigger,
                    memory_block=memory_block,
                )
            else:
                text = P.agent_system(
                    world=self.world,
                    style=self.style,
                    rules=self.rules,
                    goal=self.goal,
                    agent_budget=self.cfg.agent_budget,
                    rollback_tool=self.variant.agent_trigger,
                    memory_block=memory_block,
                )
            ids = (
                np.asarray(self.tok.encode_turn("system", text), np.int32)
                if self.tok is not None
                else _EMPTY_IDS
            )
            self._system_cache = (version, text, ids)
        return self._system_cache[1], self._system_cache[2]

    def _version(self) -> int:
        """Bumped whenever the memory block changes (the system prompt is rebuilt only then)."""
        return self.memory.version

    def _agent_context(self) -> tuple[str, list[dict[str, str]], np.ndarray]:
        if not self.render:
            return "", [], _EMPTY_IDS
        node = self.path[-1]
        if self.compact:
            user = P.agent_user_compact(
                observation=node.observation,
                checkpoint=self.t,
                calls_left=self.calls_left,
                used=self.used,
                note=self.note,
            )
        else:
            user = P.agent_user(
                observation=node.observation, checkpoint=self.t, calls_left=self.calls_left, note=self.note
            )
        system, sys_ids = self._system_ids()
        messages = [{"role": "system", "content": system}]
        for turn in self.turns:
            messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.reply}]
        messages.append({"role": "user", "content": user})
        ids = _EMPTY_IDS
        if self.tok is not None:
            tail = np.asarray([*self.tok.encode_turn("user", user), *self.tok.generation_prompt()], np.int32)
            ids = np.concatenate([sys_ids, *(t.ids for t in self.turns), tail]).astype(np.int32)
        return user, messages, ids

    def agent_context_text(self) -> str:
        """The agent's whole current context as text (system, kept turns, current user turn): for tests."""
        _, messages, _ = self._agent_context()
        return "\n".join(m["content"] for m in messages)

    def _count(self, system: str, user: str) -> int:
        """Tokens of an auxiliary prompt: exact with the run's tokenizer, else ⌈UTF-8 bytes / 3⌉ (a served
        model's tokenizer is not known here; English BPE averages about 4 bytes a token)."""
        if self.tok is not None:
            return (
                len(self.tok.encode_turn("system", system))
                + len(self.tok.encode_turn("user", user))
                + len(self.tok.generation_prompt())
            )
        return -(-len((system + user).encode("utf-8", "surrogatepass")) // 3)

    def _steps(self, first: int = 0) -> list[P.Step]:
        """The executed steps taken at ``C_first`` and later, as the auxiliary prompts show them."""
        return [
            P.Step(n.index - 1, n.action, n.message, n.observation, summaries.render(self.world, n.sigma))
            for n in self.path[1:]
            if n.index - 1 >= first
        ]

    def _fit(self, system: str, build: Any, detailed: int, total: int) -> str:
        return P.fit(
            build,
            lambda user: self._count(system, user),
            self.cfg.prompt_budget,
            detailed,
            total,
            self.cfg.observation_chars,
        )

    def _aux_prompt(self, kind: str) -> tuple[str, str]:
        rec, mem, t = self.rec or {}, self.memory.render(), self.t
        chars = self.cfg.observation_chars
        if kind == FINE:
            cands = [(i, summaries.render(self.world, self.path[i].sigma)) for i in rec.get("candidates", ())]
            return P.FINE_SYSTEM, P.fine_user(
                goal=self.goal, diagnosis=rec.get("diagnosis", ""), memory=mem, candidates=cands
            )
        if kind == PATCH:
            reflect = self.variant.restore == NO_RESTORE
            first = rec.get("window", self.review_from) if reflect else rec.get("r", t)
            steps = self._steps(first)
            head = f"C_{first}: {summaries.render(self.world, self.path[first].sigma)}"
            system = P.REFLECT_SYSTEM if reflect else P.PATCH_SYSTEM

            def build_patch(shape: P.Shape) -> str:
                body = P.trajectory(head, steps, first, observation_chars=chars, shape=shape, current=False)
                if reflect:
                    return P.reflect_user(
                        goal=self.goal,
                        diagnosis=rec.get("diagnosis", ""),
                        since=first,
                        checkpoint=t,
                        reviewed=body,
                        memory=mem,
                    )
                return P.patch_user(
                    goal=self.goal,
                    diagnosis=rec.get("diagnosis", ""),
                    restore=first,
                    checkpoint=t,
                    abandoned=body,
                    memory=mem,
                )

            return system, self._fit(system, build_patch, len(steps), len(steps))
        since = rec.get("window", self.review_from)
        steps = self._steps()
        detailed = sum(1 for x in steps if x.before >= since)
        head = f"C_0 (start): {summaries.render(self.world, self.path[0].sigma)}"
        now = self.path[-1].observation
        if kind == REVIEW:
            sig = self.current_signals().render()

            def build_review(shape: P.Shape) -> str:
                return P.review_user(
                    goal=self.goal,
                    trajectory=P.trajectory(head, steps, since, observation_chars=chars, shape=shape),
                    observation=P.current_observation(now, shape.clip),
                    memory=mem,
                    signals=sig,
                    checkpoint=t,
                    since=since,
                    trigger=rec.get("trigger", ""),
                    pending=(self.proposal or {}).get("shown", ""),
                )

            return P.REVIEW_SYSTEM, self._fit(P.REVIEW_SYSTEM, build_review, detailed, len(steps))

        def build_coarse(shape: P.Shape) -> str:
            return P.coarse_user(
                goal=self.goal,
                trajectory=P.trajectory(head, steps, since, observation_chars=chars, shape=shape),
                observation=P.current_observation(now, shape.clip),
                memory=mem,
                diagnosis=rec.get("diagnosis", ""),
                checkpoint=t,
            )

        return P.COARSE_SYSTEM, self._fit(P.COARSE_SYSTEM, build_coarse, detailed, len(steps))

    # -- replies -------------------------------------------------------------------------------------
    def on_output(self, gen: Generation) -> EnvOp | None:
        req = self.pending
        if req is None:
            raise RuntimeError(f"trial {self.spec.trial}: output without a pending call")
        self.pending = None
        out_ids, logprobs = self._output_tokens(gen)
        text = gen.text if isinstance(gen.text, str) else ""
        call = CallRecord(
            trial=self.spec.trial,
            task=self.spec.task,
            call_index=len(self.calls),
            role=req.role,
            segment=self.record.recoveries,
            position=self.t if req.kind == EXECUTE else -1,
            checkpoint=self.t,
            state_key=self.path[-1].state_key,
            history_key=text_key(*(n.action for n in self.path[1:]), f"|m{self.memory.version}"),
            prompt_ids=req.prompt_ids,
            output_ids=out_ids,
            logprobs=logprobs,
            output_text=text,
            finish_reason=gen.finish_reason,
            teach=bool(gen.teach),
        )
        if gen.usage is not None:
            call.prompt_tokens, call.completion_tokens = int(gen.usage[0]), int(gen.usage[1])
            self.record.prompt_tokens += call.prompt_tokens
            self.record.completion_tokens += call.completion_tokens
        if gen.error:
            self.record.api_failures += 1
        self.calls.append(call)
        self._reply = (req, gen.finish_reason, out_ids, gen.error)  # a refined action is read like a move
        if gen.finish_reason == "context":  # the context no longer fits the model: the trial ends
            call.valid, call.invalid_reason = False, "the context no longer fits the model"
            self._end("context")
            return None
        if req.kind == EXECUTE:
            return self._on_agent(call, req, text, gen.finish_reason, out_ids, gen.error)
        self.record.aux_calls += 1
        self.record.aux_by_role[req.kind] += 1
        return self._handlers()[req.kind](call, text)

    def _handlers(self) -> dict[str, Any]:
        """The reply handler of each auxiliary role this trial asks for."""
        return {REVIEW: self._on_review, COARSE: self._on_coarse, FINE: self._on_fine, PATCH: self._on_patch}

    def _on_agent(
        self, call: CallRecord, req: Request, text: str, finish: str, out_ids: np.ndarray, error: str = ""
    ) -> EnvOp | None:
        self.record.agent_calls += 1
        self.since_review += 1
        self.record.max_unreviewed = max(self.record.max_unreviewed, self.since_review)
        proposal = self._read_action(call, req, text, finish, out_ids, error)
        requested = proposal["kind"] == "rollback"
        scheduled = self.variant.scheduled_trigger and self.sched.due(self.since_review, self.horizon)
        if requested or scheduled:
            self._start_review("agent" if requested else "schedule")
            return None
        return self._commit()

    def _read_action(
        self, call: CallRecord, req: Request, text: str, finish: str, out_ids: np.ndarray, error: str = ""
    ) -> dict[str, Any]:
        """The agent's reply as the pending proposal (a move, the rollback tool, or an invalid turn)."""
        turn_ids = _EMPTY_IDS
        if self.tok is not None:
            user_ids = np.asarray(
                [*self.tok.encode_turn("user", req.prompt_text), *self.tok.generation_prompt()], np.int32
            )
            turn_ids = np.concatenate([user_ids, out_ids, np.asarray(self.tok.close_turn(out_ids), np.int32)])
        proposal: dict[str, Any] = {"call": call, "turn": Turn(self.t, req.prompt_text, text, turn_ids)}
        content = parse.extract_action(text, self.style) if finish != "length" and not error else None
        if error:  # a served request that still failed after its retries: an invalid turn that says why
            proposal.update(kind="invalid", reason=f"api request failed: {error}", shown="(no reply)")
        elif finish == "length":
            proposal.update(
                kind="invalid", reason="the reply was cut off at its token limit", shown="(cut off)"
            )
        elif content is None:
            proposal.update(kind="invalid", reason=parse.NO_TAG, shown="(no action)")
        elif replies.is_rollback_request(content):
            if self.variant.agent_trigger:
                proposal.update(kind="rollback", shown="rollback")
            else:
                proposal.update(
                    kind="invalid", reason="the rollback tool is not available here", shown="rollback"
                )
        else:
            action = self.env.parse_action(content)
            if action.is_rewind:
                proposal.update(
                    kind="invalid",
                    shown=action.text,
                    reason="'rewind to C_j' is not available here"
                    + (
                        "; use the action 'rollback' to ask for a review"
                        if self.variant.agent_trigger
                        else ""
                    ),
                )
            elif action.is_invalid:
                proposal.update(kind="invalid", reason=action.reason, shown=action.text or content[:60])
            else:
                proposal.update(kind="move", action=action, shown=action.text)
        call.action = proposal.get("shown", "")
        self.proposal = proposal
        return proposal

    def _commit(self) -> EnvOp | None:
        """Execute the agent's pending proposal (after a Continue verdict or when no review was due)."""
        prop, self.proposal = self.proposal, None
        assert prop is not None
        call: CallRecord = prop["call"]
        if prop["kind"] == "move":
            self.proposal = prop  # kept until the world answers
            self.phase = ENV
            return EnvOp("step", action=prop["action"])
        if prop["kind"] == "rollback":
            call.valid, call.invalid_reason = True, ""
            self.note = "the reviewer looked at your path and decided that you continue from here"
        else:
            call.valid, call.invalid_reason = False, prop["reason"]
            self.record.invalid_turns += 1
            self.invalid_since_review += 1
            self.note = f"your previous reply was not executed: {prop['reason']}"
        self.turns.append(prop["turn"])
        self._next_turn()
        return None

    def on_step(self, info: StepInfo, observation: str = "") -> None:
        prop, self.proposal = self.proposal, None
        if self.phase != ENV or prop is None or prop.get("kind") != "move":
            raise RuntimeError(f"trial {self.spec.trial}: step result without a pending move")
        call: CallRecord = prop["call"]
        if not info.valid:
            call.valid, call.invalid_reason = False, info.message or "the world rejected the action"
            self.record.invalid_turns += 1
            self.invalid_since_review += 1
            self.note = f"your previous reply was not executed: {call.invalid_reason}"
            self.turns.append(prop["turn"])
            self.phase = EXECUTE
            self._next_turn()
            return
        self.record.actions += 1
        self._append(info, observation, prop["action"].text)
        call.reward, call.solved, call.failed = float(info.reward), bool(info.solved), bool(info.failed)
        self.note = ""
        self.turns.append(prop["turn"])
        self.phase = EXECUTE
        self._after_step(info)

    def _append(self, info: StepInfo, observation: str, action: str) -> Node:
        """Push ``C_{t+1}``, the checkpoint an executed action created, onto the active path."""
        prev = self.path[-1]
        # V(C_0 → C_i) from the two ends only: a value per state (text worlds' branch value is a running max)
        value = float(self.env.branch_value([self.path[0].progress, info.progress], info.solved, info.failed))
        score = float(info.score) if info.score is not None else prev.score + float(info.reward)
        sigma = summaries.update(self.world, prev.sigma, observation, info)
        node = self._node(self.t + 1, info, value, observation, action, info.message, sigma, score)
        self.path.append(node)
        self.states_seen.add(info.state_key)
        return node

    def take_op(self) -> EnvOp | None:
        """A further world operation this trial needs before its next model call (a search replaying its
        way to a node); the runner asks after every step and rewind. RIR itself never needs one."""
        return None

    def _after_step(self, info: StepInfo) -> None:
        """What follows an executed move: the end, a failure review, or the next agent call."""
        if info.solved:
            self._end("success")
        elif info.failed:
            if self.variant.reviews and self.cfg.review_on_failure:
                self._start_review("failure")
            else:
                self._end("failure")
        else:
            self._next_turn()

    def _next_turn(self) -> None:
        if self.calls_left <= 0:
            self._end("budget")
        else:
            self.phase = EXECUTE

    # -- review and recovery -------------------------------------------------------------------------
    def _start_review(self, trigger: str) -> None:
        self.rec = {"trigger": trigger, "window": self.review_from}
        self.phase = REVIEW

    def _on_review(self, call: CallRecord, text: str) -> EnvOp | None:
        rec = self.rec
        assert rec is not None
        review = replies.parse_review(text)
        self._problems(call, review.problems)
        r = self.record
        r.verdict_fallbacks += not review.verdict_read
        r.reviews += 1
        r.reviews_by_trigger[rec["trigger"]] += 1
        self.since_review = 0
        self.review_from = self.t
        self.invalid_since_review = 0
        if self.variant.memory:
            r.memory_changes += self.memory.merge(review.knowledge, self.t) > 0
        rho = review.rho(self.sched.default_urgency)
        rec.update(diagnosis=review.diagnosis, rho=rho, verdict=review.verdict)
        call.action = f"{review.verdict} (urgency {rho:.2f})"
        if review.verdict == replies.ROLLBACK and r.recoveries < self.cfg.rollback_budget:
            if self.calls_left < self.cfg.min_calls_for_restore:  # the resumed branch could not act
                r.restores_refused += 1
                call.action += f"; refused: {self.calls_left} agent calls left"
                return self._continue(rho)
            return self._localize()
        return self._continue(rho)

    def _continue(self, rho: float) -> EnvOp | None:
        trigger = self.rec["trigger"] if self.rec else ""
        self.rec = None
        new = self.sched.after_continue(self.horizon, rho)
        if new != self.horizon:
            self.horizon = new
            self.record.horizons.append(new)
        if trigger == "failure":
            self._end("failure")
            return None
        self.phase = EXECUTE
        return self._commit()

    def _localize(self) -> EnvOp | None:
        rec, t, v = self.rec, self.t, self.variant
        if v.restore == NO_RESTORE:
            rec.update(lo=t, hi=t, r=t)
            return self._after_selection()
        if v.restore == RESTART:
            rec.update(lo=0, hi=0, r=0)
            return self._after_selection()
        if v.coarse:
            self.phase = COARSE
            return None
        self._set_range(0, t)
        self.phase = FINE
        return None

    def _set_range(self, lo: int, hi: int) -> None:
        cands = [i for i in range(lo, hi + 1) if self.admissible(i)]
        if not cands:  # nothing admissible in [l, u]: widen to [0, u]
            lo = 0
            cands = [i for i in range(0, hi + 1) if self.admissible(i)]
            self.rec["widened"] = True
        self.rec.update(lo=lo, hi=hi, candidates=cands)

    def _on_coarse(self, call: CallRecord, text: str) -> EnvOp | None:
        interval = replies.parse_range(text, self.t)
        self._problems(call, interval.problems)
        if interval.valid:
            self._set_range(interval.lo, interval.hi)
        else:
            self.rec["range_fallback"] = True
            self._set_range(0, self.t)
        call.action = f"range C_{self.rec['lo']} - C_{self.rec['hi']}"
        self.phase = FINE
        return None

    def _on_fine(self, call: CallRecord, text: str) -> EnvOp | None:
        rec = self.rec
        cands = rec["candidates"]
        sel = replies.parse_restore(text, cands)
        self._problems(call, sel.problems)
        if sel.target is not None:
            r = sel.target
        else:
            rec["restore_fallback"] = True
            r = max(cands) if cands else 0
        rec.update(r=r, confidence=sel.confidence, justification=sel.justification)
        call.action, call.is_rewind, call.rewind_target = f"restore C_{r}", True, r
        return self._after_selection()

    def _after_selection(self) -> EnvOp | None:
        if self.variant.memory:
            self.phase = PATCH
            return None
        return self._restore()

    def _on_patch(self, call: CallRecord, text: str) -> EnvOp | None:
        rec = self.rec
        patch = replies.parse_patch(text)
        self._problems(call, patch.problems)
        m = self.memory
        before = m.version
        m.add_history(patch.milestones)
        failure = patch.failure or rec.get("diagnosis", "") or "the branch was abandoned"
        m.replace_failure(failure)
        self.record.marked_to_verify += m.abandon_after(rec["r"])  # nothing is abandoned when r = t
        self.record.patterns_promoted += m.note_pattern(patch.pattern or failure, rec["r"])
        self.record.memory_changes += m.version != before
        return self._restore()

    def _branch_value(self, start: int) -> float:
        """V(branch | C_start) of the current path from ``C_start`` to its end: the world's hidden progress
        measure, for training credit only (never shown to a role)."""
        nodes = self.path[start:]
        return float(self.env.branch_value([n.progress for n in nodes], nodes[-1].solved, nodes[-1].failed))

    def _close_resumed(self) -> None:
        """Record what the branch resumed at the latest restore reached (its end is now: the next restore or
        the trial's end), beside what the abandoned branch had reached (``v_abandoned``)."""
        last = self.record.restores[-1] if self.record.restores else None
        if last is not None and "v_resumed" not in last and last["r"] < len(self.path):
            last["v_resumed"] = self._branch_value(last["r"])

    def _restore(self) -> EnvOp | None:
        """Apply the recovery: rewind the world to C_r (r < t) or only drop the pending action (k = 0)."""
        rec, r, t = self.rec, self.rec["r"], self.t
        self.record.recoveries += 1
        self._close_resumed()
        self.record.restores.append(
            {
                "v_abandoned": self._branch_value(r),
                "t": t,
                "lo": rec.get("lo", r),
                "hi": rec.get("hi", r),
                "r": r,
                "trigger": rec["trigger"],
                "fallback": bool(rec.get("restore_fallback")),
                "range_fallback": bool(rec.get("range_fallback")),
                "after_call": len(self.calls),
            }
        )
        self.proposal = None  # the pending action a_t is dropped
        if r < t and self.variant.restore != NO_RESTORE:
            self.record.rewind_calls += 1
            self.phase = ENV
            return EnvOp("rewind", target=r)
        self._resume(rolled_back=False)
        return None

    def on_rewound(self, state_key: str | None = None, observation: str | None = None) -> None:
        """The world is back at ``C_r``: truncate the path and the agent's turns; resume there. The world's
        state key (or, for worlds without one, its observation) is checked against ``C_r``'s record."""
        rec = self.rec
        if self.phase != ENV or rec is None:
            raise RuntimeError(f"trial {self.spec.trial}: rewind result without a recovery")
        r = rec["r"]
        del self.path[r + 1 :]
        self.turns = [tr for tr in self.turns if tr.checkpoint < r]
        self.review_from = min(self.review_from, r)
        if state_key is not None:
            self.record.restore_ok.append(state_key == self.path[r].state_key)
        elif observation is not None:
            self.record.restore_ok.append(observation == self.path[r].observation)
        self.record.rollbacks += 1
        self._resume(rolled_back=True)

    def _resume(self, rolled_back: bool) -> None:
        trigger = self.rec["trigger"] if self.rec else ""
        self.rec = None
        self.horizon = self.sched.after_rollback()
        self.record.horizons.append(self.horizon)
        self.since_review = 0
        self.note = (
            "you were returned to an earlier checkpoint; the reflection memory holds what was learned"
            if rolled_back
            else "your last proposal was dropped after a review; see the reflection memory"
        )
        if self.path[-1].failed or (trigger == "failure" and not rolled_back):
            self._end("failure")
        else:
            self._next_turn()

    def _problems(self, call: CallRecord, problems: tuple[str, ...]) -> None:
        if problems:
            call.valid, call.invalid_reason = False, "; ".join(problems)
            self.record.parse_problems += 1
            if call.role in self.record.parse_problems_by_role:
                self.record.parse_problems_by_role[call.role] += 1

    # -- the end -------------------------------------------------------------------------------------
    def _end(self, reason: str) -> None:
        self.phase = DONE
        self.pending = None
        self._close_resumed()
        r = self.record
        last = self.path[-1]
        r.end_reason = reason
        r.success = reason == "success"
        r.steps = self.t
        r.final_score = float(last.score)
        r.final_value = self._branch_value(0)
        r.distinct_states = len(self.states_seen)
        if (
            self.world in ("scienceworld", "alfworld")
            and last.score is not None
            and self.world == "scienceworld"
        ):
            r.dense_reward = float(min(1.0, max(0.0, max(last.score, 0.0) / 100.0)))
        else:
            r.dense_reward = 1.0 if r.success else 0.0

    def _output_tokens(self, gen: Generation) -> tuple[np.ndarray, np.ndarray]:
        if gen.output_ids is not None:
            ids = np.asarray(gen.output_ids, np.int32)
            lp = (
                np.asarray(gen.logprobs, np.float32)
                if gen.logprobs is not None
                else np.zeros(ids.size, np.float32)
            )
            return ids, lp
        if self.tok is None:
            return _EMPTY_IDS, _EMPTY_LP
        ids = np.asarray(self.tok.encode(gen.text if isinstance(gen.text, str) else ""), np.int32)
        return ids, np.zeros(ids.size, np.float32)


__all__ = [
    "AUX_ROLES",
    "COARSE",
    "EXECUTE",
    "FINE",
    "LOCALIZE",
    "PATCH",
    "REVIEW",
    "RIRRecord",
    "RIRTrial",
    "RIRView",
]
