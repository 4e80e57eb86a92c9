"""RIR's budgets and knobs (the ``rir:`` config section), with the paper's defaults where it gives them.

Paper: (L_min, L_max) = (4, 8). Our choices where the paper is silent: L_0 = 4 (start and after every
rollback: review early on a fresh branch); B_rb = 3 rollbacks per task
(range-sweep variants start at their own L_min); B_agent = 60 agent replies (the
same 60-call ceiling as ReTRAIL's trials); auxiliary calls (review, coarse, fine, patch) do NOT count
against B_agent (they are counted separately, as the paper reports them); a malformed urgency means 0.5.
Auxiliary prompts hold at most ``prompt_budget`` tokens (3072: a review of a 60-step branch with compressed
observations fits, and a 4k-context model keeps room for its reply); an observation longer than
``observation_chars`` (800) is shown as the world's summary σ. A restore (and a no-rollback reflection) is
refused when fewer than ``min_calls_for_restore`` agent calls remain (2, ReTRAIL's
``min_calls_for_recovery``): with fewer, the resumed branch gets at most one move, and a restore on the last
call would end the trial at C_r.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from retrojax.agent.rir.schedule import Schedule
from retrojax.agent.rir.variants import Variant


@dataclasses.dataclass(frozen=True)
class Settings:
    schedule: Schedule = dataclasses.field(default_factory=Schedule)
    rollback_budget: int = 3  # B_rb
    agent_budget: int = 60  # B_agent
    aux_counts_against_agent: bool = False
    review_on_failure: bool = True
    prompt_budget: int = 3072  # tokens per auxiliary prompt (review, coarse, patch)
    observation_chars: int = 800  # longer raw observations are shown as σ
    min_calls_for_restore: int = 2  # agent calls that must remain for a restore to be carried out
    max_new_tokens: int = 256  # agent replies
    max_review_tokens: int = 384
    max_select_tokens: int = 96
    max_patch_tokens: int = 384

    def __post_init__(self) -> None:
        if self.rollback_budget < 0:
            raise ValueError(f"rir.rollback_budget must be ≥ 0, got {self.rollback_budget}")
        if self.agent_budget < 1:
            raise ValueError(f"rir.agent_budget must be ≥ 1, got {self.agent_budget}")
        if self.prompt_budget < 256:
            raise ValueError(f"rir.prompt_budget must be ≥ 256 tokens, got {self.prompt_budget}")
        if self.observation_chars < 1:
            raise ValueError(f"rir.observation_chars must be ≥ 1, got {self.observation_chars}")
        if self.min_calls_for_restore < 0:
            raise ValueError(f"rir.min_calls_for_restore must be ≥ 0, got {self.min_calls_for_restore}")

    @classmethod
    def from_config(cls, cfg: Any, variant: Variant | None = None) -> Settings:
        r = getattr(cfg, "rir", None)
        if r is None:
            base = cls()
        else:
            base = cls(
                schedule=Schedule(
                    float(r.l_min), float(r.l_max), float(r.l_0), True, float(r.default_urgency)
                ),
                rollback_budget=int(r.rollback_budget),
                agent_budget=int(r.agent_budget),
                aux_counts_against_agent=bool(r.aux_counts_against_agent),
                review_on_failure=bool(r.review_on_failure),
                prompt_budget=int(r.prompt_budget),
                observation_chars=int(r.observation_chars),
                min_calls_for_restore=int(r.min_calls_for_restore),
                max_new_tokens=int(cfg.sampler.max_new_tokens),
                max_review_tokens=int(r.max_review_tokens),
                max_select_tokens=int(r.max_select_tokens),
                max_patch_tokens=int(r.max_patch_tokens),
            )
        return base.for_variant(variant) if variant is not None else base

    def for_variant(self, variant: Variant) -> Settings:
        s = self.schedule
        if variant.l_range is not None:
            lo, hi = variant.l_range
            s = dataclasses.replace(
                s, l_min=float(lo), l_max=float(hi), l_0=float(lo)
            )  # L_0 = L_min of the range
        s = dataclasses.replace(s, adaptive=variant.adaptive)
        return dataclasses.replace(self, schedule=s)
