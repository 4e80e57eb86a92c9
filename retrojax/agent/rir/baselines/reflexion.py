"""Reflexion (Shinn et al., 2023) as an RIR variant: verbal reflection between whole trials, carried forward.

The agent acts as under ReAct. A trial ends in success, in an irreversible failure the world reports, or by
the evaluator's heuristic (ours, after the paper's ALFWorld heuristic of repeated actions and a step cap):
the current visible observation seen ``REPEATS`` times in this trial, or ``trial_calls`` agent replies spent
in it (a third of B_agent, at least 4). A failed trial is reflected on (auxiliary role ``reflect``: the
trial's visible steps and the earlier reflections → one lesson), the lesson joins the reflections the agent's
system prompt carries (the newest ``KEEP``, the paper's memory of 1-3), and the world is reset to the start
with a fresh context: a new trial (counted in ``resets``; no checkpoint between the start and the failure is
ever restored, so Reflexion executes no rollback). All trials share the task's agent budget B_agent; a reset
needs ``rir.min_calls_for_restore`` calls left, as a restore does.
"""

from __future__ import annotations

from typing import Any

from retrojax.agent.archive import CallRecord
from retrojax.agent.env_api import StepInfo
from retrojax.agent.rir.baselines import prompts as B
from retrojax.agent.rir.baselines.common import BaselineTrial
from retrojax.agent.rir.controller import DONE, ENV, EXECUTE, REFLECT
from retrojax.agent.trial import EnvOp

KEEP = 3  # reflections carried (Shinn et al. keep 1-3)
REPEATS = 3  # the same visible observation this many times in a trial ends it (their ALFWorld heuristic)


class ReflexionTrial(BaselineTrial):
    title = "reflections on earlier trials"
    keep = KEEP

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trial_start = 0  # agent calls made before this trial began
        self.trial_calls = max(4, self.cfg.agent_budget // 3)
        self.ended = ""  # how the trial being reflected on ended

    def _trial_over(self) -> str:
        seen = [n.seen for n in self.path]
        if seen.count(seen[-1]) >= REPEATS:
            return f"the same observation came back {REPEATS} times"
        if self.record.agent_calls - self.trial_start >= self.trial_calls:
            return f"{self.trial_calls} replies were spent without reaching the goal"
        return ""

    def _after_step(self, info: StepInfo) -> None:
        if info.solved:
            self._end("success")
        elif info.failed:
            self._end_trial("the world reports an irreversible failure")
        else:
            self._next_turn()

    def _next_turn(self) -> None:
        if self.calls_left <= 0:
            self._end("budget")
            return
        why = self._trial_over()
        if why:
            self._end_trial(why)
        else:
            self.phase = EXECUTE

    def _end_trial(self, why: str) -> None:
        if self.calls_left >= max(1, self.cfg.min_calls_for_restore):
            self.ended = why
            self.phase = REFLECT
            return
        if self.path[-1].failed:
            self._end("failure")
        elif self.calls_left <= 0:
            self._end("budget")
        else:
            self.trial_start = self.record.agent_calls  # too few calls for another trial: play on
            self.phase = EXECUTE

    def _handlers(self) -> dict[str, Any]:
        return {REFLECT: self._on_reflect}

    def _on_reflect(self, call: CallRecord, text: str) -> EnvOp | None:
        lesson, problems = B.parse_reflection(text)
        self._problems(call, problems)
        self.carry(lesson or f"a trial ended without success: {self.ended}")
        call.action = "new trial"
        self.rec = {"r": 0, "trigger": "trial"}
        self.record.rewind_calls += 1
        self.phase = ENV
        return EnvOp("rewind", target=0)

    def on_rewound(self, state_key: str | None = None, observation: str | None = None) -> None:
        if self.phase != ENV or self.rec is None:
            raise RuntimeError(f"trial {self.spec.trial}: rewind result without a new trial")
        del self.path[1:]
        self.turns = []
        if state_key is not None:
            self.record.restore_ok.append(state_key == self.path[0].state_key)
        elif observation is not None:
            self.record.restore_ok.append(observation == self.path[0].observation)
        self.record.resets += 1
        self.rec = None
        self.trial_start = self.record.agent_calls
        self.note = "a new trial starts from the beginning; your reflections on earlier trials are above"
        if self.phase != DONE:
            self.phase = EXECUTE
            self._next_turn()

    def _aux_prompt(self, kind: str) -> tuple[str, str]:
        def make(traj: str, now: str) -> str:
            return (
                f"Goal: {self.goal}\n\nHow the trial ended: {self.ended}.\n\n"
                f"The trial's steps (C_0 … C_{self.t}):\n{traj}\n\nLast observation (C_{self.t}):\n{now}\n\n"
                f"{self.carried_text()}"
            )

        return self._path_prompt(B.REFLEXION_SYSTEM, 0, make)
