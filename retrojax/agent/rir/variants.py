"""RIR protocol names and what each variant restricts (one paired batch runs them side by side).

==================  ==========================================================================
``RIR``              hybrid triggers (agent + scheduled), adaptive horizon, coarse-to-fine restore,
                     full memory update
``RIR/react``        no recovery at all: no reviews, no rollback tool, no memory block
``RIR/agent-only``   reviews only when the agent calls ``rollback``
``RIR/scheduled-only`` reviews only on the schedule (no rollback tool)
``RIR/hybrid-fixed`` both triggers, the horizon fixed at ``L_0``
``RIR/no-rollback``  reflection only (k = 0): a Rollback verdict updates M — the patcher gets its own prompt
                     over the steps the reviewer reviewed — and drops the pending action; the world is
                     never rewound. ``RIR/reflection-only`` is accepted as the same variant: the paper's
                     Figure 4 names it "No rollback (reflection only)" and Table 3's "Reflection only" row
                     is the same restriction (state restoration off, review and memory unchanged)
``RIR/restart``      every rollback restores ``C_0``
``RIR/direct``       one-stage selection: the fine selector over the whole path (no coarse call)
``RIR/rollback-only`` restore as RIR, memory frozen (no ΔE merge, no patch call)
``RIR/range-A-B``    RIR with ``(L_min, L_max) = (A, B)`` (the range sweep)
==================  ==========================================================================

The baselines of the paper's §5.1 run as variants of the same controller and runner, under the same agent
budget (``retrojax.agent.rir.baselines``, one module each):

===================  =========================================================================
``RIR/self-refine``  critique and revise every proposed move before it runs (no rollback, nothing carried)
``RIR/reflexion``    whole trials: a failed trial is reflected on and the world reset to the start; the
                     reflections are carried forward (a reset is a new trial, not a rollback)
``RIR/lats``         tree search over actions: sampled children, value estimates, UCT selection, the world
                     restored through the trail to the selected node, reflections on failed leaves
``RIR/ga-rollback``  an assistant checks every executed step and may roll back to an earlier
                     checkpoint with feedback (explicit state rollback, within B_rb)
===================  =========================================================================

Every variant with a reviewer also reviews an irreversible failure reported by the world (a dead Sokoban
state, a mine, a failed text task) before the trial ends: our games end on such a state, so without this
review no variant could ever recover from one (see the README's RIR section).
"""

from __future__ import annotations

import dataclasses
import re

LOCALIZE = "localize"  # coarse (or direct) + fine selection
RESTART = "restart"
NO_RESTORE = "none"
ASSISTANT = "assistant"  # GA-Rollback: the assistant names the restore point in one stage
SEARCH = "search"  # LATS: the world is restored to the node the search selects

_NAMES = (
    "RIR",
    "RIR/react",
    "RIR/agent-only",
    "RIR/scheduled-only",
    "RIR/hybrid-fixed",
    "RIR/no-rollback",
    "RIR/restart",
    "RIR/direct",
    "RIR/rollback-only",
)
ALL_VARIANTS = _NAMES  # RIR and its ablations
BASELINES = ("RIR/self-refine", "RIR/reflexion", "RIR/lats", "RIR/ga-rollback")  # the paper's §5.1 baselines
ALIASES = {"rir/reflection-only": "RIR/no-rollback"}  # the paper's two names for one ablation
_RANGE = re.compile(r"^RIR/range-(\d{1,3})-(\d{1,3})$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    agent_trigger: bool = True
    scheduled_trigger: bool = True
    adaptive: bool = True
    restore: str = LOCALIZE
    coarse: bool = True
    memory: bool = True  # False: M stays as initialized (rollback-only)
    reviews: bool = True  # False only for react
    l_range: tuple[int, int] | None = None  # range sweep override of (L_min, L_max)
    method: str = "rir"  # rir | self-refine | reflexion | lats | ga-rollback (the trial's loop)

    @property
    def shows_memory(self) -> bool:
        return self.reviews


def is_rir(name: object) -> bool:
    return isinstance(name, str) and (
        name.strip().upper() == "RIR" or name.strip().upper().startswith("RIR/")
    )


def parse_variant(name: str) -> Variant:
    """A protocol name → its :class:`Variant`. Raises ``ValueError`` for unknown names."""
    raw = name.strip() if isinstance(name, str) else ""
    m = _RANGE.match(raw)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if not 1 <= lo <= hi:
            raise ValueError(f"protocol {name!r}: need 1 ≤ L_min ≤ L_max")
        return Variant(f"RIR/range-{lo}-{hi}", l_range=(lo, hi))
    canon = {n.lower(): n for n in (*_NAMES, *BASELINES)}.get(raw.lower()) or ALIASES.get(raw.lower())
    if canon is None:
        raise ValueError(
            f"unknown RIR protocol {name!r}; expected one of {', '.join((*_NAMES, *BASELINES))} or "
            "RIR/range-A-B"
        )
    if canon in BASELINES:  # no RIR review, no rollback tool, no M: each loop is its own
        return Variant(
            canon,
            agent_trigger=False,
            scheduled_trigger=False,
            reviews=False,
            memory=False,
            restore={"RIR/ga-rollback": ASSISTANT, "RIR/lats": SEARCH}.get(canon, NO_RESTORE),
            coarse=False,
            method=canon.partition("/")[2],
        )
    tail = canon.partition("/")[2]
    table = {
        "": Variant(canon),
        "react": Variant(
            canon,
            agent_trigger=False,
            scheduled_trigger=False,
            reviews=False,
            memory=False,
            restore=NO_RESTORE,
        ),
        "agent-only": Variant(canon, scheduled_trigger=False),
        "scheduled-only": Variant(canon, agent_trigger=False),
        "hybrid-fixed": Variant(canon, adaptive=False),
        "no-rollback": Variant(canon, restore=NO_RESTORE, coarse=False),
        "restart": Variant(canon, restore=RESTART, coarse=False),
        "direct": Variant(canon, coarse=False),
        "rollback-only": Variant(canon, memory=False),
    }
    return table[tail]
