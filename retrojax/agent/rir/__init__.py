"""RIR — Rollback-Induced Reflection: a training-free recovery controller beside ReTRAIL's trial loop.

RIR wraps any policy at test time and decides **when** to review the current branch (hybrid triggers and an
adaptive horizon, Eqs. 3 and 5), **where** to restore (coarse interval, then a fine checkpoint, Eqs. 6-8)
and **what** survives a rollback (the reflection memory M = (G, E, H, F), Eqs. 9-10). One module each:

- ``schedule``: the review horizon L and its update; ``signals``: execution signals ξ_t from the path;
- ``memory``: M with replace-not-append rendering and re-verify marks; ``replies``: the auxiliary reply
  formats and their total parsers; ``summaries``: σ(C_i) per world; ``prompts``: agent and auxiliary prompts;
- ``variants``: the protocol names (``RIR``, ``RIR/react``, …, ``RIR/range-2-8``) and what each restricts;
- ``controller``: one trial as a host-side state machine (Algorithm 1); ``runner``: batched ticks over the
  same ``TrialEnv`` worlds as ReTRAIL; ``policies``: scripted oracle / random RIR players and the Flax model
  wrapper whose auxiliary calls use their own sampler rows.
"""
