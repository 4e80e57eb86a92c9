"""The baselines of the RIR paper's §5.1, as variants of RIR's controller and runner (same worlds, prompts
of the agent, transcripts, records and agent budget B_agent), one module each:

- ``self_refine`` — Self-Refine (Madaan et al., 2023): every proposed move is critiqued and revised before it
  runs (information-level; nothing is undone, nothing carried);
- ``reflexion`` — Reflexion (Shinn et al., 2023): whole trials; a failed trial is reflected on, the world
  starts over, and the reflections are carried into the next trial (no rollback);
- ``lats`` — LATS (Zhou et al., 2023): tree search over actions with value estimates, UCT selection and
  reflections on failed leaves; the world is restored to the selected node through the trail;
- ``ga_rollback`` — GA-Rollback (Li et al., 2025): an assistant checks every executed step and may roll the
  world back to an earlier checkpoint with feedback for the generator.

:func:`trial_class` gives the trial class of a variant (``RIRTrial`` for RIR and its ablations).
"""

from __future__ import annotations

from retrojax.agent.rir.controller import RIRTrial
from retrojax.agent.rir.variants import Variant


def trial_class(variant: Variant) -> type[RIRTrial]:
    """The trial state machine that runs ``variant``."""
    if variant.method == "rir":
        return RIRTrial
    from retrojax.agent.rir.baselines.ga_rollback import GARollbackTrial
    from retrojax.agent.rir.baselines.lats import LATSTrial
    from retrojax.agent.rir.baselines.reflexion import ReflexionTrial
    from retrojax.agent.rir.baselines.self_refine import SelfRefineTrial

    table: dict[str, type[RIRTrial]] = {
        "self-refine": SelfRefineTrial,
        "reflexion": ReflexionTrial,
        "lats": LATSTrial,
        "ga-rollback": GARollbackTrial,
    }
    return table[variant.method]
