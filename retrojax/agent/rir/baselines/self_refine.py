"""Self-Refine (Madaan et al., 2023) as an RIR variant: generate → feedback → refine, on the next action.

The agent proposes a move (one agent call, counted in B_agent). Before it runs, a critic (auxiliary role
``critique``, the same policy) reads the goal, the visible path, the current observation and the proposed
move and answers keep or revise with feedback. On revise the agent is asked again in its own context, the
feedback in the note of its user turn (auxiliary role ``refine``), and the revised move is critiqued in turn;
the loop stops at a keep, a reply that is not a move, or after ``ROUNDS`` revisions (the paper iterates until
the feedback says stop or a round limit; the limit here is ours). The agent's context keeps the revised turn
in place of the draft (Self-Refine's output is the last refinement). Nothing is undone and nothing is carried
to later moves: an irreversible failure ends the trial.
"""

from __future__ import annotations

from typing import Any

from retrojax.agent.archive import CallRecord
from retrojax.agent.rir.baselines import prompts as B
from retrojax.agent.rir.baselines.common import BaselineTrial
from retrojax.agent.rir.controller import CRITIQUE, REFINE
from retrojax.agent.trial import EnvOp

ROUNDS = 2  # revisions per move at most (ours)


class SelfRefineTrial(BaselineTrial):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds_left = ROUNDS
        self.feedback = ""

    def _on_agent(self, call, req, text, finish, out_ids, error=""):
        self.rounds_left = ROUNDS
        return super()._on_agent(call, req, text, finish, out_ids, error)

    def _commit(self) -> EnvOp | None:
        prop = self.proposal
        if prop is not None and prop["kind"] == "move" and self.rounds_left > 0:
            self.phase = CRITIQUE
            return None
        return super()._commit()

    def _handlers(self) -> dict[str, Any]:
        return {CRITIQUE: self._on_critique, REFINE: self._on_refine}

    def _on_critique(self, call: CallRecord, text: str) -> EnvOp | None:
        verdict, feedback, problems = B.parse_critique(text)
        self._problems(call, problems)
        call.action = verdict
        if verdict == B.KEEP:
            self.rounds_left = 0
            return self._commit()
        shown = (self.proposal or {}).get("shown", "")
        self.feedback = feedback or "the critic asked for a different action"
        self.note = (
            f"a critic reviewed your proposed action '{shown}' before it ran: {self.feedback} "
            "Reply with your revised action."
        )
        self.phase = REFINE
        return None

    def _on_refine(self, call: CallRecord, text: str) -> EnvOp | None:
        assert self._reply is not None
        req, finish, out_ids, error = self._reply
        self.rounds_left -= 1
        self._read_action(call, req, text, finish, out_ids, error)  # the revision replaces the draft
        return self._commit()

    def _aux_prompt(self, kind: str) -> tuple[str, str]:
        pending = (self.proposal or {}).get("shown", "")

        def make(traj: str, now: str) -> str:
            return (
                f"Goal: {self.goal}\n\nPath so far (C_0 … C_{self.t}):\n{traj}\n\n"
                f"Current observation (C_{self.t}):\n{now}\n\nProposed action: {pending or '(none)'}"
            )

        return self._path_prompt(B.CRITIQUE_SYSTEM, max(0, self.t - 3), make)
