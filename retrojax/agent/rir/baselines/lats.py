"""LATS (Zhou et al., 2023) as an RIR variant: Monte Carlo tree search over the agent's actions, with the
policy as action sampler, value function and reflector, the world restored to each selected node through the
checkpoint trail.

One iteration: **selection** — from the root, the child of highest UCT (mean value + ``EXPLORE`` · sqrt(ln
N(parent) / N(child))) while the node is fully expanded; **expansion** — ``CHILDREN`` agent calls at the
selected node (each an agent reply counted in B_agent; a repeated action adds no child, an invalid reply adds
none), each new action executed from the node; **evaluation** — one ``value`` call per new child (its visible
path and observation → a value in [0, 1]); **backpropagation** of that value to the root; a child the world
reports failed is terminal, backs up 0 and gets a ``reflect`` call whose lesson the agent's system prompt
carries from then on (the newest ``KEEP``). A solved child ends the trial. The paper also simulates each new
node to the end of the episode; under a shared agent budget we leave rollouts out and let the value calls
stand for them (ours). Moving between nodes rewinds the world to the deepest common checkpoint (an executed
rollback, counted) and replays the stored actions down to the node (world steps, no model calls); the agent's
context is the node's own path of turns. The search ends when B_agent is spent or every branch is terminal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from retrojax.agent.archive import CallRecord
from retrojax.agent.env_api import StepInfo
from retrojax.agent.rir.baselines import prompts as B
from retrojax.agent.rir.baselines.common import BaselineTrial
from retrojax.agent.rir.controller import ENV, EXECUTE, REFLECT, VALUE, Turn
from retrojax.agent.trial import EnvOp

CHILDREN = 2  # samples per expansion (the paper uses 5; a 60-reply budget affords fewer: ours)
EXPLORE = 1.0  # UCT exploration weight
KEEP = 3  # reflections carried


@dataclasses.dataclass
class TreeNode:
    id: int
    parent: int  # -1: the root (C_0)
    actions: tuple[str, ...]  # the actions from the root
    turns: tuple[Turn, ...]  # the agent turns that made them (the node's context)
    visits: int = 0
    total: float = 0.0
    samples: int = 0  # agent calls made at this node
    children: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: bool = False
    exhausted: bool = False  # fully expanded and no open child below


class LATSTrial(BaselineTrial):
    title = "reflections on failed branches"
    keep = KEEP

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nodes: list[TreeNode] = [TreeNode(0, -1, (), ())]
        self.leaf = 0  # the node being expanded
        self.child = -1  # the child awaiting its value or reflection
        self.target: int | None = None  # the node the world is being moved to
        self.queue: list[str] = []  # actions still to replay on the way there
        self._op: EnvOp | None = None

    # -- tree ----------------------------------------------------------------------------------------
    def _uct(self, parent: TreeNode, kid: TreeNode) -> float:
        n = max(1, kid.visits)
        return kid.total / n + EXPLORE * math.sqrt(math.log(max(1, parent.visits)) / n)

    def _select(self) -> TreeNode | None:
        node = self.nodes[0]
        while True:
            if node.samples < CHILDREN:
                return node
            kids = [self.nodes[c] for c in node.children.values()]
            kids = [k for k in kids if not k.failed and not k.exhausted]
            if not kids:
                node.exhausted = True
                if node.parent < 0:
                    return None
                node = self.nodes[0]
                continue
            node = max(kids, key=lambda k: self._uct(node, k))

    def _backup(self, node: TreeNode, value: float) -> None:
        while True:
            node.visits += 1
            node.total += value
            if node.parent < 0:
                return
            node = self.nodes[node.parent]

    # -- moving the world ----------------------------------------------------------------------------
    def _advance(self) -> EnvOp | None:
        if self.calls_left <= 0:
            self._end("budget")
            return None
        target = self._select()
        if target is None:
            self._end("failure")
            return None
        self.leaf = target.id
        have = tuple(n.action for n in self.path[1:])
        k = 0
        while k < min(len(have), len(target.actions)) and have[k] == target.actions[k]:
            k += 1
        self.target = target.id
        self.queue = list(target.actions[k:])
        if k < len(have):
            self.rec = {"r": k}
            self.record.rewind_calls += 1
            self.phase = ENV
            return EnvOp("rewind", target=k)
        return self._replay()

    def _replay(self) -> EnvOp | None:
        if not self.queue:
            node = self.nodes[self.target]
            self.turns = list(node.turns)
            self.target, self.note, self.phase = None, "", EXECUTE
            return None
        self.phase = ENV
        return EnvOp("step", action=self.env.parse_action(self.queue[0]))

    def take_op(self) -> EnvOp | None:
        op, self._op = self._op, None
        return op

    def on_rewound(self, state_key: str | None = None, observation: str | None = None) -> None:
        if self.phase != ENV or self.rec is None:
            raise RuntimeError(f"trial {self.spec.trial}: rewind result without a selected node")
        r = self.rec["r"]
        self.rec = None
        del self.path[r + 1 :]
        if state_key is not None:
            self.record.restore_ok.append(state_key == self.path[r].state_key)
        elif observation is not None:
            self.record.restore_ok.append(observation == self.path[r].observation)
        self.record.rollbacks += 1
        self._op = self._replay()

    # -- the agent's samples -------------------------------------------------------------------------
    def _commit(self) -> EnvOp | None:
        prop = self.proposal
        assert prop is not None
        leaf = self.nodes[self.leaf]
        call: CallRecord = prop["call"]
        if prop["kind"] != "move":
            self.proposal = None
            call.valid, call.invalid_reason = False, prop.get("reason", "not a move")
            self.record.invalid_turns += 1
            leaf.samples += 1
            return self._advance()
        if prop["action"].text in leaf.children:  # sampled again: no new child
            self.proposal = None
            leaf.samples += 1
            return self._advance()
        self.phase = ENV
        return EnvOp("step", action=prop["action"])

    def on_step(self, info: StepInfo, observation: str = "") -> None:
        if self.target is not None:  # a replayed step on the way to the selected node
            self.record.actions += 1
            self._append(info, observation, self.queue.pop(0))
            self._op = self._replay()
            return
        prop, self.proposal = self.proposal, None
        if self.phase != ENV or prop is None:
            raise RuntimeError(f"trial {self.spec.trial}: step result without a pending move")
        leaf = self.nodes[self.leaf]
        leaf.samples += 1
        call: CallRecord = prop["call"]
        if not info.valid:
            call.valid, call.invalid_reason = False, info.message or "the world rejected the action"
            self.record.invalid_turns += 1
            self._op = self._advance()
            return
        self.record.actions += 1
        text = prop["action"].text
        self._append(info, observation, text)
        call.reward, call.solved, call.failed = float(info.reward), bool(info.solved), bool(info.failed)
        child = TreeNode(len(self.nodes), leaf.id, (*leaf.actions, text), (*leaf.turns, prop["turn"]))
        self.nodes.append(child)
        leaf.children[text] = child.id
        self.turns = list(child.turns)
        self.child = child.id
        if info.solved:
            self._end("success")
        elif info.failed:
            child.failed = True
            self._backup(child, 0.0)
            self.phase = REFLECT
        else:
            self.phase = VALUE

    def _handlers(self) -> dict[str, Any]:
        return {VALUE: self._on_value, REFLECT: self._on_reflect}

    def _on_value(self, call: CallRecord, text: str) -> EnvOp | None:
        value, problems = B.parse_value(text)
        self._problems(call, problems)
        call.action = f"value {value:.2f}"
        self._backup(self.nodes[self.child], value)
        return self._advance()

    def _on_reflect(self, call: CallRecord, text: str) -> EnvOp | None:
        lesson, problems = B.parse_reflection(text)
        self._problems(call, problems)
        self.carry(lesson or f"the branch failed after '{self.path[-1].action}' at C_{self.t - 1}")
        return self._advance()

    def _aux_prompt(self, kind: str) -> tuple[str, str]:
        if kind == VALUE:

            def value(traj: str, now: str) -> str:
                return (
                    f"Goal: {self.goal}\n\nPath (C_0 … C_{self.t}):\n{traj}\n\n"
                    f"Current observation (C_{self.t}):\n{now}"
                )

            return self._path_prompt(B.VALUE_SYSTEM, max(0, self.t - 3), value)

        def reflect(traj: str, now: str) -> str:
            return (
                f"Goal: {self.goal}\n\nThe failed branch (C_0 … C_{self.t}):\n{traj}\n\n"
                f"Last observation (C_{self.t}):\n{now}\n\n{self.carried_text()}"
            )

        return self._path_prompt(B.LATS_REFLECT_SYSTEM, max(0, self.t - 3), reflect)
