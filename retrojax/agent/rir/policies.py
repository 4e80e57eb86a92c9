"""Policies for RIR: scripted players that answer EVERY role in text through the same parsers as a model,
and the wrapper that gives a Flax model's auxiliary calls their own sampler rows.

- :class:`RIROraclePolicy` — agent: the world's expert action with probability ``1 − ε``, a random one
  otherwise, never an action its memory eliminated at the current state (``E.elim`` entries written as
  ``avoid '<action>' at state <key>``); it calls ``rollback`` when its own random move lost progress.
  Reviewer (reads the exact hidden values in its view, never the prompt: it is an oracle): Rollback on an
  irreversible failure, or when the exact values show an earlier, better checkpoint (lost progress) together
  with a state cycle closing at the current state, stalled progress (``stall`` steps without a new best
  value) or an agent request; Continue otherwise (a rollback with nothing better to
  return to would only be k = 0) with urgency = stalled steps / ``stall``. ``noise`` flips each verdict
  with that probability. Selectors use the world's exact values (Eq. 8: the latest best-valued
  admissible checkpoint). Patcher: milestones and the failure analysis of the abandoned suffix.
- :class:`RIRRandomPolicy` — fuzzing: random moves, random rollback requests, and auxiliary replies that
  are malformed with probability ``malformed`` (garbage, wrong tags, NaN/inf urgencies, out-of-range
  checkpoints) and otherwise random but well-formed.
- :class:`RIRModelPolicy` — wraps ``ModelPolicy``: agent calls use row ``slot``; auxiliary calls use row
  ``slot + n`` (n = the batch's slot count), so an auxiliary prompt never evicts the agent's KV cache; the
  wrapped policy's prefix sync re-encodes a changed memory block only from its first differing token.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from retrojax.agent import parse
from retrojax.agent.env_api import TrialEnv
from retrojax.agent.rir import replies
from retrojax.agent.rir.baselines import prompts as B
from retrojax.agent.rir.controller import (
    ASSIST,
    COARSE,
    CRITIQUE,
    EXECUTE,
    FINE,
    PATCH,
    REFINE,
    REFLECT,
    REVIEW,
    VALUE,
    RIRView,
)
from retrojax.agent.trial import Generation, Request, TrialSpec

_AVOID = re.compile(r"avoid '([^']*)' at state ([0-9a-zA-Z_\-]+)")
_AVOID_AT = re.compile(r"avoid '([^']*)' at (C_\d+)\b")  # the visible form: at a checkpoint of the path
_SALTS = {
    EXECUTE: 21, REVIEW: 22, COARSE: 23, FINE: 24, PATCH: 25,
    CRITIQUE: 26, REFINE: 27, REFLECT: 28, VALUE: 29, ASSIST: 30,
}


def eliminated(view: RIRView) -> dict[str, set[str]]:
    """Eliminations the agent is shown — ``E.elim`` entries of M, a baseline's carried texts and the note of
    its user turn (Self-Refine's feedback) — as: state key → actions to avoid there."""
    out: dict[str, set[str]] = {}
    for text in (*view.memory.texts("elim"), *view.notes, view.last_invalid):
        for action, key in (*_AVOID.findall(text), *_AVOID_AT.findall(text)):
            out.setdefault(key, set()).add(action)
    return out


def stalled_steps(view: RIRView) -> int:
    """Steps since the exact (hidden) branch value last reached a new best: the oracle's own stall count."""
    last_best, best = 0, float("-inf")
    for i, v in enumerate(view.values):
        if v > best:
            best, last_best = v, i
    return len(view.values) - 1 - last_best if view.values else 0


def best_restore(view: RIRView, candidates: Sequence[int] | None = None) -> int:
    """Eq. 8 with exact values: the latest admissible checkpoint of the highest branch value."""
    cands = [
        i
        for i in (candidates if candidates is not None else range(view.checkpoint + 1))
        if not view.failed[i]
    ]
    if not cands:
        return 0
    best = max(view.values[i] for i in cands)
    return max(i for i in cands if view.values[i] == best)


class _Scripted:
    tokenizer = None
    needs_text = False

    def __init__(self) -> None:
        self.env: TrialEnv | None = None
        self.rngs: dict[tuple[int, str], np.random.Generator] = {}
        self.specs: dict[int, TrialSpec] = {}

    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: TrialEnv) -> None:
        self.env, self.specs, self.rngs = env, {s.trial: s for s in specs}, {}

    def end(self) -> None:
        self.rngs, self.specs = {}, {}

    def rng(self, trial: int, role: str) -> np.random.Generator:
        key = (trial, role)
        if key not in self.rngs:
            s = self.specs[trial]
            self.rngs[key] = np.random.default_rng([s.seed, s.task, s.replicate, _SALTS[role]])
        return self.rngs[key]

    def act(self, action: str) -> str:
        return parse.format_action(action, getattr(self.env, "action_style", "tag"))


RANDOM_MOVE = "Trying something."  # how the oracle agent opens a deliberate random move (never a target)


class RIROraclePolicy(_Scripted):
    def __init__(self, epsilon: float = 0.3, noise: float = 0.0, stall: int = 4):
        super().__init__()
        if not 0.0 <= epsilon <= 1.0 or not 0.0 <= noise <= 1.0:
            raise ValueError(f"epsilon and noise must lie in [0, 1], got {epsilon}, {noise}")
        if stall < 1:
            raise ValueError(f"stall must be at least 1, got {stall}")
        self.epsilon, self.noise, self.stall = epsilon, noise, stall
        self.last_random: dict[int, tuple[int, str]] = {}
        self.patterns: dict[int, str] = {}  # trial → the failure pattern of its latest review

    def begin(self, specs, slots, env) -> None:
        super().begin(specs, slots, env)
        self.last_random, self.patterns = {}, {}
        if hasattr(env, "prefetch_expert"):
            env.prefetch_expert = True

    def _expert_moves(self, requests: Sequence[Request]) -> dict[int, str]:
        """The expert's next move for each trial whose request plays or judges a move (one env call)."""
        agents = [r for r in requests if r.view.kind in (EXECUTE, REFINE, CRITIQUE)]
        moves = self.env.expert_actions([r.slot for r in agents]) if agents else []
        return dict(zip((r.trial for r in agents), moves, strict=True))

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        expert = self._expert_moves(requests)
        out = []
        for req in requests:
            v: RIRView = req.view
            if v.kind in (EXECUTE, REFINE):
                text = self._agent(req.trial, v, expert[req.trial])
                out.append(Generation(text, teach=not text.startswith(RANDOM_MOVE)))
            elif v.kind in (CRITIQUE, REFLECT, VALUE, ASSIST):
                out.append(Generation(self._baseline(req.trial, v, expert.get(req.trial))))
            elif v.kind == REVIEW:
                out.append(Generation(self._review(req.trial, v)))
            elif v.kind == COARSE:
                r = best_restore(v)
                first = min(i for i in range(v.checkpoint + 1) if v.values[i] == v.values[r])
                out.append(Generation(replies.write_range(min(first, r), v.checkpoint)))
            elif v.kind == FINE:
                r = best_restore(v, v.candidates)
                out.append(
                    Generation(
                        replies.write_restore(
                            r, 1.0, f"C_{r} is the latest candidate with the best progress and no failure"
                        )
                    )
                )
            else:
                out.append(Generation(self._patch(req.trial, v)))
        return out

    def _agent(self, trial: int, v: RIRView, expert: str | None) -> str:
        rng = self.rng(trial, EXECUTE)
        t = v.checkpoint
        last = self.last_random.pop(trial, None)
        if (
            v.rollback_tool
            and last is not None
            and last[0] + 1 == t
            and v.path
            and v.path[-1] == last[1]
            and self._regret(v)
        ):
            return f"My random move '{last[1]}' {self._regret(v)}.\n{self.act('rollback')}"
        avoid = self._avoid(v)
        if expert is None or expert in avoid or rng.random() < self.epsilon:
            action = self.env.random_actions([v.slot], rng, [avoid])[0]
            self.last_random[trial] = (t, action)
            return f"{RANDOM_MOVE}\n{self.act(action)}"
        return f"Following the plan.\n{self.act(expert)}"

    def _regret(self, v: RIRView) -> str:
        """Why the agent's own last (random) move is worth a rollback request ("" if it is not)."""
        return "lost progress" if v.values[-1] < v.values[-2] else ""

    def _avoid(self, v: RIRView) -> frozenset[str]:
        """The moves the agent's eliminations rule out at its current state."""
        return frozenset(eliminated(v).get(v.state_key, set()))

    def _baseline(self, trial: int, v: RIRView, expert: str | None) -> str:
        """The baselines' auxiliary roles with the same exact values as RIR's oracle roles (its view, never
        the prompt): the critic knows the expert move as the oracle agent does and, as noisy as the agent,
        misses an off-plan move with probability ε; values compare a step's
        branch value with its parent's; reflections and feedback name the move taken at the latest
        best-valued checkpoint, as RIR's oracle reviewer eliminates it."""
        rng = self.rng(trial, v.kind)
        flip = self.noise > 0 and rng.random() < self.noise
        t = v.checkpoint
        if v.kind == CRITIQUE:  # the same noisy expert as the agent: an off-plan move is seen w.p. 1 − ε
            on_plan = expert is None or self.env.parse_action(expert).text == v.proposal
            missed = not on_plan and rng.random() < self.epsilon
            if (on_plan or missed) != flip:
                return B.write_critique(B.KEEP, "the action follows the plan")
            return B.write_critique(
                B.REVISE, f"avoid '{v.proposal}' at state {v.state_key}: it does not lead toward the goal"
            )
        if v.kind == VALUE:
            step = v.values[-1] - v.values[-2] if t > 0 else 0.0
            return B.write_value(0.5 + 0.5 * float(np.sign(step)))
        r = best_restore(v, range(t)) if t > 0 else 0
        lesson = f"avoid '{v.path[r]}' at state {v.keys[r]}" if r < t else ""
        if v.kind == REFLECT:
            return B.write_reflection(lesson or "the attempt ran out of replies; keep to the plan")
        worse = v.failed[-1] or (t > 0 and v.values[-1] < v.values[-2])
        if worse != flip and r < t:
            return B.write_assist(replies.ROLLBACK, r, lesson + ": it lost progress")
        return B.write_assist(replies.CONTINUE)

    def _review(self, trial: int, v: RIRView) -> str:
        rng = self.rng(trial, REVIEW)
        s, t = v.signals, v.checkpoint
        lost = v.values[-1] < max(v.values)
        stalled = stalled_steps(v)
        reasons, patterns = [], []
        if s.failed:
            reasons.append(f"the world reports an irreversible failure at C_{t}")
            patterns.append("irreversible failure")
        elif lost:  # an earlier checkpoint is better: a cycle, a stall or a request is worth undoing
            if v.keys[-1] in v.keys[:-1]:
                reasons.append("the current state was already visited on this path (a cycle)")
                patterns.append("state cycle")
            if stalled >= self.stall:
                reasons.append(f"no progress for {stalled} steps")
                patterns.append("stall")
            if v.trigger == "agent":
                reasons.append("the last moves lost progress")
                patterns.append("lost progress")
        self.patterns[trial] = "the branch ended in: " + ", ".join(patterns) if patterns else ""
        verdict = replies.ROLLBACK if reasons else replies.CONTINUE
        if self.noise > 0 and rng.random() < self.noise:
            verdict = replies.CONTINUE if verdict == replies.ROLLBACK else replies.ROLLBACK
        urgency = min(1.0, stalled / self.stall)
        elim = []
        if verdict == replies.ROLLBACK:
            r = best_restore(v)
            if r < t:
                elim.append(f"avoid '{v.path[r]}' at state {v.keys[r]}")
        diagnosis = "; ".join(reasons) or "no clear failure (verdict flipped by noise)"
        return replies.write_review(
            verdict, urgency, diagnosis if verdict == replies.ROLLBACK else "", elim=elim
        )

    def _patch(self, trial: int, v: RIRView) -> str:
        r, t = v.restore, v.checkpoint
        best = max(range(t + 1), key=lambda i: (v.values[i], i))
        milestones = [f"an earlier attempt reached: {v.summaries[best]}"] if best > r else []
        actions = ", ".join(v.path[r:]) or "none"
        return replies.write_patch(
            milestones,
            f"{v.diagnosis or 'the branch stalled'}; the abandoned actions from C_{r} were: {actions}",
            self.patterns.get(trial, ""),
        )


class RIRVisibleOracle(RIROraclePolicy):
    """The oracle whose every label is a function of what the role's prompt shows: the labeller of the role
    demonstrations (:mod:`retrojax.learn.role_demos`), so a model can learn each reply from its prompt.

    The agent's moves are the solver's (w.p. 1 − ε; its random moves are never targets), as in ReTRAIL's
    demonstrations: the board it is shown determines them. Everything else reads only the visible path —
    the actions, each checkpoint's observation (compared as text), the score the world shows, the world's
    terminal flag, ξ_t and the review's trigger — never the solver's distance, ``branch_value`` or state keys:

    - the agent asks for a review after its own random move when the visible outcome got worse (see
      :func:`visible_trouble`);
    - the reviewer says Rollback exactly when :func:`visible_trouble` names a problem at ``C_t``: the world's
      failure flag, the current observation seen earlier on the path (a cycle), or the visible score below
      its best on the path; urgency = steps since the visible score rose / (2 · stall), capped at 1 (0 where
      the world shows no score); the elimination it adds is ``avoid '<move>' at C_r`` for the move taken at
      the restore point;
    - the restore point (:func:`visible_restore`): after a failure the latest checkpoint not marked failed;
      for a cycle the first checkpoint with the current observation (the loop is cut at its start); for a
      lost score the latest checkpoint with the best visible score; the coarse range is ``[r, t]`` and the
      fine choice ``r`` (the latest admissible candidate when ``r`` is not among them);
    - the patcher: the best visible checkpoint past ``r`` as a milestone, the diagnosis and the abandoned
      moves as the failure, the kind of trouble as the pattern;
    - the baselines' roles (Self-Refine's critic, Reflexion's and LATS's reflections, LATS's values,
      GA-Rollback's stepwise check) by the same rules: see :meth:`_visible_baseline`.
    """

    def _regret(self, v: RIRView) -> str:
        return visible_trouble(v)

    def _avoid(self, v: RIRView) -> frozenset[str]:
        return frozenset(eliminated(v).get(f"C_{v.checkpoint}", set()))

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        expert = self._expert_moves(requests)
        out = []
        for req in requests:
            v: RIRView = req.view
            if v.kind in (EXECUTE, REFINE):
                text = self._agent(req.trial, v, expert[req.trial])
                out.append(Generation(text, teach=not text.startswith(RANDOM_MOVE)))
            elif v.kind == REVIEW:
                out.append(Generation(self._visible_review(v)))
            elif v.kind == COARSE:
                out.append(Generation(replies.write_range(visible_restore(v), v.checkpoint)))
            elif v.kind == FINE:
                r = visible_restore(v)
                r = r if r in v.candidates else max(v.candidates, default=r)
                out.append(Generation(replies.write_restore(r, 1.0, _WHY.get(_kind(v), _WHY[""]))))
            elif v.kind == PATCH:
                out.append(Generation(self._visible_patch(v)))
            elif v.kind in (CRITIQUE, REFLECT, VALUE, ASSIST):
                out.append(Generation(self._visible_baseline(v, expert.get(req.trial))))
            else:
                raise ValueError(f"the visible oracle has no label for the role {v.kind!r}")
        return out

    def _visible_baseline(self, v: RIRView, expert: str | None) -> str:
        """The baselines' roles from what their prompts show: the critic keeps the proposal exactly when it
        is the move the board shows (the agent's own rule); a value is 0 after a failure, 0.25 in a cycle,
        else 0.5 moved by the sign of the last change of the visible score; a reflection or a rollback
        check names the visible trouble and the move to avoid at its restore point."""
        t = v.checkpoint
        if v.kind == CRITIQUE:
            if expert is None or self.env.parse_action(expert).text == v.proposal:
                return B.write_critique(B.KEEP, "the action follows the plan")
            return B.write_critique(B.REVISE, f"avoid '{v.proposal}' at C_{t}: it does not follow the plan")
        kind = _kind(v)
        if v.kind == VALUE:
            if kind in ("failure", "cycle"):
                return B.write_value(0.0 if kind == "failure" else 0.25)
            last = v.shown[-2:] if t > 0 else ()
            step = last[1] - last[0] if len(last) == 2 and None not in last else 0.0
            return B.write_value(0.5 + 0.5 * float(np.sign(step)))
        trouble, r = visible_trouble(v), visible_restore(v)
        lesson = f"avoid '{v.path[r]}' at C_{r}" if trouble and r < t else ""
        if v.kind == REFLECT:
            return B.write_reflection(f"{lesson}: {trouble}" if lesson else
                                      "the attempt ran out of replies; keep to the plan")
        if lesson:
            return B.write_assist(replies.ROLLBACK, r, f"{lesson}: {trouble}")
        return B.write_assist(replies.CONTINUE)

    def _visible_review(self, v: RIRView) -> str:
        trouble = visible_trouble(v)
        gain = v.signals.steps_since_gain
        urgency = 0.0 if gain is None else min(1.0, gain / (2 * self.stall))
        if not trouble:
            return replies.write_review(replies.CONTINUE, urgency)
        r = visible_restore(v)
        elim = [f"avoid '{v.path[r]}' at C_{r}"] if r < v.checkpoint else []
        return replies.write_review(replies.ROLLBACK, urgency, f"at C_{v.checkpoint} {trouble}", elim=elim)

    def _visible_patch(self, v: RIRView) -> str:
        r, t = v.restore, v.checkpoint
        scores = [x if x is not None else float("-inf") for x in v.shown]
        best = max(range(t + 1), key=lambda i: (scores[i], i))
        milestones = [f"an earlier attempt reached: {v.summaries[best]}"] if best > r else []
        moves = ", ".join(v.path[r:]) or "none"
        return replies.write_patch(
            milestones,
            f"{v.diagnosis or 'the branch went wrong'}; the abandoned moves from C_{r} were: {moves}",
            _PATTERN.get(_kind(v), ""),
        )


_WHY = {
    "failure": "the latest checkpoint before the failure",
    "cycle": "the first checkpoint of the loop",
    "score": "the latest checkpoint with the best visible score",
    "": "the latest candidate",
}
_PATTERN = {
    "failure": "a move ended the game",
    "cycle": "moves that lead back to an earlier observation",
    "score": "moves that lower the visible score",
}


def _kind(v: RIRView) -> str:
    if v.failed and v.failed[-1]:
        return "failure"
    if v.seen and v.seen[-1] in v.seen[:-1]:
        return "cycle"
    shown = [x for x in v.shown if x is not None]
    if shown and v.shown[-1] is not None and v.shown[-1] < max(shown):
        return "score"
    return ""


def visible_trouble(v: RIRView) -> str:
    """What the visible path shows wrong at its current checkpoint ("" when nothing): the world's failure
    flag, the current observation seen earlier on the path, or the visible score below its best."""
    kind = _kind(v)
    t = v.checkpoint
    if kind == "failure":
        return "the world reports an irreversible failure"
    if kind == "cycle":
        j = v.seen.index(v.seen[-1])
        return f"the observation of C_{j} came back (a cycle of {t - j} steps)"
    if kind == "score":
        best = max(x for x in v.shown if x is not None)
        return f"the visible score fell to {v.shown[-1]:g} from {best:g}"
    return ""


def visible_restore(v: RIRView) -> int:
    """The restore point a visible trouble implies (see :class:`RIRVisibleOracle`); ``t`` when none."""
    kind, t = _kind(v), v.checkpoint
    if kind == "failure":
        ok = [i for i in range(t) if not v.failed[i]]
        return max(ok) if ok else 0
    if kind == "cycle":
        return v.seen.index(v.seen[-1])
    if kind == "score":
        best = max(x for x in v.shown if x is not None)
        return max(i for i in range(t) if v.shown[i] == best)
    return t


class RIRRandomPolicy(_Scripted):
    _GARBAGE = (
        "",
        "continue",
        "<verdict>maybe</verdict>",
        "<urgency>nan</urgency><verdict>rollback</verdict>",
        "<verdict>rollback</verdict><urgency>inf</urgency>",
        "<range>C_9 - C_2</range>",
        "<range>-3 - 999999999</range>",
        "<restore>C_999</restore>",
        "<restore>last</restore>",
        "<milestones>",
        "<failure></failure>",
        "<knowledge>elim: </knowledge>",
        "<<reflection memory>>",
        "<range>C_</range><restore>C_-1</restore>",
        "<urgency>-inf</urgency>\x00\ud800",
    )

    def __init__(self, rollback_prob: float = 0.15, malformed: float = 0.3, bad_action: float = 0.05):
        super().__init__()
        self.rollback_prob, self.malformed, self.bad_action = rollback_prob, malformed, bad_action

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        return [Generation(self._one(req.trial, req.view)) for req in requests]

    def _one(self, trial: int, v: RIRView) -> str:
        rng = self.rng(trial, v.kind)
        t = v.checkpoint
        if v.kind == EXECUTE:
            x = rng.random()
            if x < self.rollback_prob:
                return self.act("rollback")
            if x < self.rollback_prob + self.bad_action:
                return str(self._GARBAGE[int(rng.integers(len(self._GARBAGE)))])
            return self.act(self.env.random_actions([v.slot], rng)[0])
        if rng.random() < self.malformed:
            return str(self._GARBAGE[int(rng.integers(len(self._GARBAGE)))])
        if v.kind == REVIEW:
            urgency = float(rng.choice([0.0, 0.5, 1.0, rng.random(), -2.0, 7.5]))
            verdict = replies.ROLLBACK if rng.random() < 0.5 else replies.CONTINUE
            obs = [f"note {int(rng.integers(5))} seen at C_{t}"] if rng.random() < 0.5 else []
            return replies.write_review(verdict, urgency, "random diagnosis", obs=obs)
        if v.kind == COARSE:
            a, b = sorted(int(x) for x in rng.integers(0, t + 2, size=2))
            return replies.write_range(a, b)
        if v.kind == FINE:
            return replies.write_restore(int(rng.integers(0, t + 2)), float(rng.random()), "random")
        return replies.write_patch([f"milestone {int(rng.integers(3))}"], "random failure analysis")


class RIRModelPolicy:
    """Agent calls on row ``slot``, auxiliary calls on row ``slot + n`` of the wrapped ``ModelPolicy``.

    :meth:`sync_stats` counts, per kind of row, the prompt tokens of every call and how many of them had to
    be encoded (the rest were already in the row's KV cache): the agent rows' figures after an auxiliary
    call show that the auxiliary prompt left the agent's cache in place."""

    needs_text = True
    _KEYS = (
        "agent_calls",
        "agent_prompt_tokens",
        "agent_encoded_tokens",
        "agent_after_aux_calls",
        "agent_after_aux_prompt_tokens",
        "agent_after_aux_encoded_tokens",
        "aux_calls",
        "aux_prompt_tokens",
        "aux_encoded_tokens",
    )

    def __init__(self, inner: Any, aux_temperature: float | None = None):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        if aux_temperature is not None:  # the auxiliary roles' sampling temperature (rir.aux_temperature)
            if not aux_temperature >= 0.0:
                raise ValueError(f"rir.aux_temperature must be >= 0, got {aux_temperature}")
            inner.aux_temperature = float(aux_temperature)
        self.offset = 0
        self.counts = dict.fromkeys(self._KEYS, 0)
        self.last_kind: dict[int, str] = {}

    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: TrialEnv) -> None:
        self.offset = (max(slots) + 1) if len(slots) else 1
        self.last_kind = {}
        self.inner.begin(specs, list(slots) + [s + self.offset for s in slots], env)

    def aux_row(self, slot: int) -> int:
        return slot + self.offset

    def sync_stats(self) -> dict[str, int]:
        """Cumulative counters (see the class docstring)."""
        return dict(self.counts)

    def _count(self, requests: Sequence[Request]) -> None:
        sampler = getattr(self.inner, "sampler", None)
        if sampler is None:
            return
        for r in requests:
            want = r.prompt_ids
            if want.size + 1 >= self.inner.max_len:  # answered "context" without touching the row
                continue
            cached = sampler.tokens(r.slot)
            n = min(cached.size, want.size)
            diff = np.nonzero(cached[:n] != want[:n])[0]
            encoded = int(want.size - (int(diff[0]) if diff.size else n))
            kind = "agent" if r.view.kind in (EXECUTE, REFINE) else "aux"
            c = self.counts
            c[f"{kind}_calls"] += 1
            c[f"{kind}_prompt_tokens"] += int(want.size)
            c[f"{kind}_encoded_tokens"] += encoded
            if kind == "agent" and self.last_kind.get(r.trial) == "aux":
                c["agent_after_aux_calls"] += 1
                c["agent_after_aux_prompt_tokens"] += int(want.size)
                c["agent_after_aux_encoded_tokens"] += encoded
            self.last_kind[r.trial] = kind

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        mapped = [  # a refined action (Self-Refine) extends the agent's own context: the agent row
            r if r.view.kind in (EXECUTE, REFINE) else dataclasses.replace(r, slot=self.aux_row(r.slot))
            for r in requests
        ]
        self._count(mapped)
        return self.inner.generate(mapped)

    def end(self) -> None:
        self.inner.end()


def as_rir_policy(policy: Any, cfg: Any = None) -> Any:
    """The RIR counterpart of a ReTRAIL policy object (``retrojax eval`` builds those from ``--policy``):
    oracle → :class:`RIROraclePolicy` (same ε; ``rir.oracle_noise`` / ``rir.oracle_stall``), random →
    :class:`RIRRandomPolicy`, model → :class:`RIRModelPolicy`; any other policy (a served model reading
    ``Request.messages``) answers every role as it is."""
    from retrojax.agent.policies import ModelPolicy, OraclePolicy, RandomPolicy

    r = getattr(cfg, "rir", None)
    if isinstance(policy, OraclePolicy):
        return RIROraclePolicy(
            policy.epsilon,
            noise=float(getattr(r, "oracle_noise", 0.0)),
            stall=int(getattr(r, "oracle_stall", 4)),
        )
    if isinstance(policy, RandomPolicy):
        return RIRRandomPolicy()
    if isinstance(policy, ModelPolicy):
        return RIRModelPolicy(policy, getattr(r, "aux_temperature", None))
    return policy
