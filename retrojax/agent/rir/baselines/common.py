"""What the baselines share on top of :class:`~retrojax.agent.rir.controller.RIRTrial`: a block of carried
texts (Reflexion's and LATS's reflections, GA-Rollback's feedback) that closes the agent's system prompt in
place of RIR's memory M, and the auxiliary prompts built from the visible trajectory (the same step lines,
observations and token budget as RIR's reviewer)."""

from __future__ import annotations

from collections.abc import Callable

from retrojax.agent.rir import prompts as P
from retrojax.agent.rir.controller import RIRTrial
from retrojax.agent.rir.memory import clean_entry


class BaselineTrial(RIRTrial):
    """An RIRTrial whose carried knowledge is a list of texts shown as one block (none until it holds any)."""

    title = "carried notes"  # the block's name in the agent's prompt
    keep = 0  # carry only the newest ``keep`` texts (0: all)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.carried: list[str] = []
        self.carried_version = 0

    def carry(self, text: str) -> None:
        entry = clean_entry(text, 480)
        if not entry:
            return
        self.carried.append(entry)
        if self.keep and len(self.carried) > self.keep:
            del self.carried[: len(self.carried) - self.keep]
        self.carried_version += 1
        self.record.memory_changes += 1

    def _version(self) -> int:
        return self.carried_version

    def _notes(self) -> tuple[str, ...]:
        return tuple(self.carried)

    def _memory_block(self) -> str | None:
        if not self.carried:
            return None
        return "\n".join([f"<<{self.title}>>", *(f"- {x}" for x in self.carried), f"<<end of {self.title}>>"])

    def carried_text(self) -> str:
        return self._memory_block() or f"<<{self.title}>>\n(none)\n<<end of {self.title}>>"

    def _path_prompt(self, system: str, since: int, make: Callable[[str, str], str]) -> tuple[str, str]:
        """``make(trajectory, current observation)`` within the auxiliary token budget: the branch C_0 … C_t
        with observations for the steps taken at ``C_since`` and later."""
        steps = self._steps()
        detailed = sum(1 for x in steps if x.before >= since)
        head = f"C_0 (start): {self._sigma(0)}"
        now = self.path[-1].observation
        chars = self.cfg.observation_chars

        def build(shape: P.Shape) -> str:
            traj = P.trajectory(head, steps, since, observation_chars=chars, shape=shape)
            return make(traj, P.current_observation(now, shape.clip))

        return system, self._fit(system, build, detailed, len(steps))

    def _sigma(self, i: int) -> str:
        from retrojax.agent.rir import summaries

        return summaries.render(self.world, self.path[i].sigma)
