"""GA-Rollback (Li et al., 2025) as an RIR variant: a generator acts, an assistant checks every step and
triggers explicit state rollbacks.

After every executed move (and on an irreversible failure) the assistant (auxiliary role ``assist``, the same
policy) reads the goal, the visible path with the observations since the last rollback, the current
observation and the feedback given so far, and answers continue or rollback; with rollback it names the
checkpoint to return to (one stage, any admissible checkpoint before the current one; an unreadable one → the
checkpoint before the last action, the stepwise default) and gives feedback. The world and the agent's
context go back to ``C_r``; the feedback joins the block the agent's system prompt carries (GA-Rollback gives
the generator the assistant's feedback on the undone step; keeping all of it is ours). Rollbacks share RIR's
budget B_rb and call floor ``rir.min_calls_for_restore``; once no rollback can be carried out the assistant is
not asked any more (its verdict could not be acted on) and a failure ends the trial.
"""

from __future__ import annotations

from typing import Any

from retrojax.agent.archive import CallRecord
from retrojax.agent.env_api import StepInfo
from retrojax.agent.rir import replies
from retrojax.agent.rir.baselines import prompts as B
from retrojax.agent.rir.baselines.common import BaselineTrial
from retrojax.agent.rir.controller import ASSIST
from retrojax.agent.trial import EnvOp


class GARollbackTrial(BaselineTrial):
    title = "assistant feedback on undone steps"

    def _can_roll_back(self) -> bool:
        return (
            self.record.recoveries < self.cfg.rollback_budget
            and self.calls_left >= self.cfg.min_calls_for_restore
            and any(self.admissible(i) for i in range(self.t))
        )

    def _after_step(self, info: StepInfo) -> None:
        if info.solved:
            self._end("success")
        elif self._can_roll_back():
            self.rec = {"trigger": "failure" if info.failed else "schedule", "window": self.review_from}
            self.phase = ASSIST
        elif info.failed:
            self._end("failure")
        else:
            self._next_turn()

    def _handlers(self) -> dict[str, Any]:
        return {ASSIST: self._on_assist}

    def _on_assist(self, call: CallRecord, text: str) -> EnvOp | None:
        cands = [i for i in range(self.t) if self.admissible(i)]
        default = max(cands)
        verdict, r, feedback, problems = B.parse_assist(text, cands, default)
        self._problems(call, problems)
        self.record.reviews += 1
        self.record.reviews_by_trigger[self.rec["trigger"]] += 1
        call.action = verdict
        if verdict != replies.ROLLBACK:
            failed = self.rec["trigger"] == "failure"
            self.rec = None
            if failed:
                self._end("failure")
            else:
                self._next_turn()
            return None
        self.carry(f"at C_{r}: {feedback or 'the assistant undid the steps after this checkpoint'}")
        self.rec.update(r=r, lo=r, hi=r)
        call.action, call.is_rewind, call.rewind_target = f"restore C_{r}", True, r
        return self._restore()

    def _aux_prompt(self, kind: str) -> tuple[str, str]:
        last = self.path[-1].action

        def make(traj: str, now: str) -> str:
            return (
                f"Goal: {self.goal}\n\nPath (C_0 … C_{self.t}; observations since C_{self.review_from}):\n"
                f"{traj}\n\nCurrent observation (C_{self.t}):\n{now}\n\nThe action just executed: {last}\n\n"
                f"Rollback points: C_0 … C_{self.t - 1} (not a checkpoint marked FAILED)\n\n"
                f"{self.carried_text()}"
            )

        return self._path_prompt(B.ASSIST_SYSTEM, self.review_from, make)
