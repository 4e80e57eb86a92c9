"""Host-side text worlds (ScienceWorld, ALFWorld) rewound by reset + replay, run in a worker pool."""

from envs.textworlds.base import Observation, ReplayDivergence, TextWorld, TextWorldError
from envs.textworlds.bridge import Outcome, TextWorldBridge, TrialRecord
from envs.textworlds.pool import WORLDS, Call, Reply, WorkerPool, make_world

__all__ = [
    "WORLDS",
    "Call",
    "Observation",
    "Outcome",
    "Reply",
    "ReplayDivergence",
    "TextWorld",
    "TextWorldBridge",
    "TextWorldError",
    "TrialRecord",
    "WorkerPool",
    "make_world",
]
